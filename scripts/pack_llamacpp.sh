#!/usr/bin/env bash
# Packs llama.cpp's sources for scripts/build_llamacpp.sh on the GPU machine (which has no
# network): the llama.cpp that llama-cpp-python vendors (the one the peer tests run), trimmed
# of what building llama-bench with the CPU and CUDA backends never reads: models, docs and
# media, tests, examples, benches, the Python converters, the server / web UI / CLI tools,
# the unified app, and the other GPU backends' sources. Writes .lcp/llama.cpp.tgz (ignored
# by git) and prints its size.
#
#   scripts/pack_llamacpp.sh [LLAMA_CPP_SRC]
#
# LLAMA_CPP_SRC: a llama.cpp source tree (default: the vendored copy in an unpacked
# llama-cpp-python 0.3.36 sdist at /tmp/lcp, or $LLAMA_CPP_SRC).
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-${LLAMA_CPP_SRC:-/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp}}"
if [[ ! -f "$src/CMakeLists.txt" || ! -f "$src/tools/llama-bench/llama-bench.cpp" ]]; then
    echo "pack_llamacpp.sh: $src is not a llama.cpp source tree (no CMakeLists.txt or" \
         "tools/llama-bench/llama-bench.cpp)" >&2
    exit 2
fi
mkdir -p .lcp
out=.lcp/llama.cpp.tgz
# paths relative to the tree's root; ggml's backends other than the CPU and CUDA ones are
# only added when enabled (ggml/src/CMakeLists.txt ggml_add_backend), so their folders can go
excludes=(models docs media benches tests examples pocs gguf-py conversion scripts ci skills
          app tools/ui tools/server tools/cli .git .github .devops
          ggml/src/ggml-cann ggml/src/ggml-et ggml/src/ggml-hexagon ggml/src/ggml-hip
          ggml/src/ggml-metal ggml/src/ggml-musa ggml/src/ggml-opencl ggml/src/ggml-openvino
          ggml/src/ggml-sycl ggml/src/ggml-virtgpu ggml/src/ggml-vulkan ggml/src/ggml-webgpu
          ggml/src/ggml-zdnn ggml/src/ggml-zendnn)
args=()
for e in "${excludes[@]}"; do
    args+=("--exclude=./$e")
done
tar -C "$src" "${args[@]}" -czf "$out.tmp" .
mv "$out.tmp" "$out"
bytes=$(stat -c %s "$out")
echo "$out: $bytes bytes ($(( bytes / 1024 / 1024 )) MiB) from $src"
