#!/usr/bin/env bash
# The first of the two back-to-back device calls (see scripts/device_run.sh): a call carries at
# most 64 MiB, so this one brings part 0 of the real model (carry .model_parts/smollm2.tlm.part00)
# to /root/tlc, and, where the image lacks nbclient/ipykernel (needed to execute the notebook),
# installs wheels carried in .whl/ into /root/site. The machine stays warm ~30 s for the next call.
# scripts/device_carry.sh writes .model_parts/ and .whl/serve/ on the machine that calls.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p /root/tlc
[[ -f .model_parts/smollm2.tlm.part00 ]] && cp .model_parts/smollm2.tlm.part00 /root/tlc/
if ! python3 -c "import nbclient, nbformat, ipykernel" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .whl/*.whl \
        && echo "notebook packages installed into /root/site"
fi
# the serving tests' packages (the serve extra and their dependencies, .whl/serve/), each only
# where the image cannot import it, into /root/site_serve (appended to PYTHONPATH by
# scripts/gpu_suite.sh, so the image's own packages come first)
if ls .whl/serve/*.whl >/dev/null 2>&1; then
    for w in .whl/serve/*.whl; do
        mod=$(basename "$w" | cut -d- -f1); [[ $mod == httpcore2 ]] && mod=httpcore2
        python3 -c "import $mod" 2>/dev/null && continue
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /root/site_serve "$w" && echo "installed $(basename "$w") into /root/site_serve"
    done
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
ls -la /root/tlc
