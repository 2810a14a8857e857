#!/usr/bin/env bash
# Writes, on this machine, what the device calls carry (the GPU machine reaches no registry and
# a call carries at most 64 MiB; every path written here is git-ignored):
#   .model_parts/smollm2.tlm.part00, .part01, sha256: the embedded default model converted to
#       .tlm, in two parts (scripts/device_prep.sh brings part 0, scripts/device_run.sh part 1);
#   .whl/serve/*.whl: the serve extra with its dependencies, as wheels for the device image's
#       python3 (3.12, x86_64), which device_prep.sh installs only where the image lacks them.
# usage: scripts/device_carry.sh [model|wheels]...   (default: both). Needs the project
# installed (the README's test command) for the model, pip and a registry for the wheels.
# Then, back to back:
#   run: bash scripts/device_prep.sh                 carry .model_parts/smollm2.tlm.part00
#   run: PART=real bash scripts/device_run.sh        carry .model_parts/smollm2.tlm.part01,
#                                                    .model_parts/sha256, .whl/serve
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE_PY=${DEVICE_PY:-3.12}
what=("$@"); [[ ${#what[@]} -eq 0 ]] && what=(model wheels)
for w in "${what[@]}"; do
    case $w in
        model)
            rm -rf .model_parts && mkdir -p .model_parts
            "$PY" -m tinyloop.cli convert default .model_parts/smollm2.tlm
            (cd .model_parts && sha256sum smollm2.tlm > sha256 \
                && split -b 60M -d -a 2 smollm2.tlm smollm2.tlm.part && rm smollm2.tlm)
            ls -l .model_parts;;
        wheels)
            rm -rf .whl/serve && mkdir -p .whl/serve
            # the serve extra as pyproject.toml lists it
            mapfile -t reqs < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve"]))')
            "$PY" -m pip download -q --only-binary=:all: --python-version "$DEVICE_PY" \
                --implementation cp --platform manylinux2014_x86_64 --platform any \
                --dest .whl/serve "${reqs[@]}"
            ls .whl/serve;;
        *) echo "usage: $0 [model|wheels]..." >&2; exit 2;;
    esac
done
