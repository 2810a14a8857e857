#!/usr/bin/env bash
# Builds llama.cpp's llama-bench (and only what it links: ggml, the CPU and CUDA backends,
# libllama, llama-common) from the tarball scripts/pack_llamacpp.sh writes, for
# benchmarks/vs_llamacpp.py. Release, static libraries (one self-contained binary), CUDA for
# the H200 (compute capability 9.0); the settings tests/llama_cpp_peer.cmake explains for the
# CPU side (no -march=native, one CPU backend linked in, no OpenMP, no ccache).
#
#   scripts/build_llamacpp.sh SRC_TGZ DEST
#
# DEST/src holds the unpacked sources, DEST/build the build; prints the path of
# DEST/build/bin/llama-bench on the last line. Environment: GGML_CUDA (ON; OFF builds the
# CPU backend only, which is how the script is checked on a machine without CUDA), JOBS
# (15), CUDA_ARCHS (90).
set -euo pipefail
if [[ $# -ne 2 ]]; then
    echo "usage: scripts/build_llamacpp.sh SRC_TGZ DEST" >&2
    exit 2
fi
tgz="$1"
dest="$2"
cuda="${GGML_CUDA:-ON}"
jobs="${JOBS:-15}"
archs="${CUDA_ARCHS:-90}"
if [[ ! -f "$tgz" ]]; then
    echo "build_llamacpp.sh: $tgz does not exist (make it with scripts/pack_llamacpp.sh)" >&2
    exit 2
fi
mkdir -p "$dest/src"
tar -xzf "$tgz" -C "$dest/src"
if [[ ! -f "$dest/src/tools/llama-bench/llama-bench.cpp" ]]; then
    echo "build_llamacpp.sh: $tgz holds no tools/llama-bench/llama-bench.cpp" >&2
    exit 2
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$dest/src" -B "$dest/build" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_CUDA="$cuda" \
    -DCMAKE_CUDA_ARCHITECTURES="$archs" \
    -DGGML_NATIVE=OFF \
    -DGGML_BACKEND_DL=OFF \
    -DGGML_CPU_ALL_VARIANTS=OFF \
    -DGGML_OPENMP=OFF \
    -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF
cmake --build "$dest/build" --config Release --target llama-bench -j "$jobs"
bin="$dest/build/bin/llama-bench"
[[ -x "$bin" ]] || { echo "build_llamacpp.sh: $bin was not built" >&2; exit 1; }
echo "$bin"
