#!/usr/bin/env bash
# Compile every cuda_src/*.cu for sm_90 with nvcc: a syntax and resource check for CI, which has
# nvcc but no GPU. Each file is compiled twice: as written (-I cuda_src), and as the exact text
# cuda_ops.load_source hands NVRTC at run time (common.cuh pasted in), when Python can import
# tinyloop. Warnings are errors. Prints ptxas register / spill lines with -v.
#   usage: .ci/compile_cuda.sh [-v]        env: NVCC (default nvcc), CUDA_ARCH (default sm_90)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
ARCH=${CUDA_ARCH:-sm_90}
VERBOSE=${1:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$NVCC" --version | tail -n 1
flags=(-arch="$ARCH" -std=c++17 --Werror all-warnings -cubin)
[[ "$VERBOSE" == "-v" ]] && flags+=(-Xptxas -v)
fail=0
for f in cuda_src/*.cu; do
    name=$(basename "$f" .cu)
    if "$NVCC" "${flags[@]}" -I cuda_src -o "$tmp/$name.cubin" "$f"; then
        echo "ok    $f"
    else
        echo "FAIL  $f"; fail=1
    fi
    if python3 -c "import tinyloop.backends.cuda_ops" 2>/dev/null; then
        python3 -c "import sys; from tinyloop.backends.cuda_ops import load_source; \
sys.stdout.write(load_source('$name'))" > "$tmp/${name}_nvrtc.cu"
        if "$NVCC" "${flags[@]}" -o "$tmp/${name}_nvrtc.cubin" "$tmp/${name}_nvrtc.cu"; then
            echo "ok    $f (as pasted for NVRTC)"
        else
            echo "FAIL  $f (as pasted for NVRTC)"; fail=1
        fi
    fi
done
exit $fail
