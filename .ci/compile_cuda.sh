#!/usr/bin/env bash
# Compile every kernel source (tinyloop/backends/cuda/kernels/*.cu) for sm_90 with nvcc: a
# syntax and resource check for CI, which has nvcc but no GPU. Each file is compiled twice: as
# written (-I the kernel folder), and as the exact text compile.load_source hands NVRTC at run
# time (common.cuh pasted in, with the GEOMETRY -D options), when Python can import tinyloop. Warnings are errors. Prints ptxas register / spill lines with -v.
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
K=tinyloop/backends/cuda/kernels
for f in "$K"/*.cu; do
    name=$(basename "$f" .cu)
    if "$NVCC" "${flags[@]}" -I "$K" -o "$tmp/$name.cubin" "$f"; then
        echo "ok    $f"
    else
        echo "FAIL  $f"; fail=1
    fi
    if python3 -c "import tinyloop.backends.cuda.compile" 2>/dev/null; then
        python3 -c "import sys; from tinyloop.backends.cuda.compile import load_source; \
sys.stdout.write(load_source('$name'))" > "$tmp/${name}_nvrtc.cu"
        # the -D options NVRTC gets (GEOMETRY), as nvcc arguments
        mapfile -t geo < <(python3 -c "from tinyloop.backends.cuda.compile import nvrtc_options; \
print('\n'.join(o for o in nvrtc_options('$name') if o.startswith('-D')))")
        if "$NVCC" "${flags[@]}" "${geo[@]}" -o "$tmp/${name}_nvrtc.cubin" "$tmp/${name}_nvrtc.cu"; then
            echo "ok    $f (as pasted for NVRTC)"
        else
            echo "FAIL  $f (as pasted for NVRTC)"; fail=1
        fi
    fi
done
exit $fail
