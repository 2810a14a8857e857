#!/usr/bin/env bash
# The whole GPU suite in one go, on a machine with an NVIDIA GPU (run from anywhere):
#   1. nvcc compile check of tinyloop/backends/cuda/kernels/ (.ci/compile_cuda.sh), when nvcc is present;
#   2. every GPU test (pytest -m gpu), JUnit XML + log;
#   3. the benchmarks (python -m benchmarks NAME): bench_kernels (kernel micro-benchmarks),
#      bench_decode (end-to-end decode/prefill, pool stats, peer figure) with step_kernels
#      (one captured decode step: generate against replay, kernel by kernel), bench_prefix
#      (prefix caching: TTFT, upgrades, a pool over a chat trace).
# Full logs go to $OUT (default ./gpu_suite_out); a short summary table is printed last.
# Exit status: nonzero if any step failed. Env: SKIP_NVCC, SKIP_BENCH_KERNELS, SKIP_BENCH_DECODE, SKIP_BENCH_PREFIX, JUNIT=1 (XML), SUITE_PATHS,
# STEP_TIMEOUT (seconds per step, default 900), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_suite_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TINYLOOP_REPORT_DIR="$OUT" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the serve extra, where scripts/device_prep.sh installed what the image lacks
[[ -d /root/site_serve ]] && PYTHONPATH="$PYTHONPATH:/root/site_serve"
PY=${PYTHON:-python3}
declare -A status secs

step() {   # step NAME LOGFILE CMD...
    local name=$1 log=$2; shift 2
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/suite.log"
    timeout "${STEP_TIMEOUT:-900}" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    status[$name]=$rc; secs[$name]=$((SECONDS - t0))
    tail -n 25 "$OUT/$log" | tee -a "$OUT/suite.log"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
} >"$OUT/suite.log" 2>&1

if command -v nvcc >/dev/null && [[ -z "${SKIP_NVCC:-}" ]]; then
    step compile compile.log bash .ci/compile_cuda.sh
fi
# SUITE_PATHS: the test paths (default: all of tests/); the whole suite nears one device call's
# 10 minutes, so it can run in two calls (e.g. "tests/api tests/convert tests/diagnostics
# tests/kernels tests/kv" and "tests/memory tests/model tests/project tests/serve")
step tests pytest_gpu.log $PY -m pytest -m gpu ${SUITE_PATHS:-tests} -q -rfEs --continue-on-collection-errors \
    -p no:cacheprovider ${JUNIT:+--junitxml="$OUT/pytest_gpu.xml"}
[[ -z "${SKIP_BENCH_KERNELS:-}" ]] && step bench_kernels bench_kernels.log $PY -m benchmarks bench_kernels --out "$OUT"
if [[ -z "${SKIP_BENCH_DECODE:-}" ]]; then
    step bench_decode bench_decode.log $PY -m benchmarks bench_decode --out "$OUT"
    step step_kernels step_kernels.log $PY -m benchmarks step_kernels --pdl 1 --out "$OUT"
fi
if [[ -z "${SKIP_BENCH_PREFIX:-}" ]]; then
    step bench_prefix bench_prefix.log $PY -m benchmarks bench_prefix --backend cuda --out "$OUT"
fi

echo
echo "== summary (logs in $OUT)"
printf '%-14s %-6s %6s  %s\n' step status secs detail
for name in compile tests bench_kernels bench_decode step_kernels bench_prefix; do
    [[ -n "${status[$name]+x}" ]] || continue
    detail=""
    case $name in
        tests) detail=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/pytest_gpu.log" | tail -n 1);;
        compile) detail="$(grep -c '^ok' "$OUT/compile.log") ok, $(grep -c '^FAIL' "$OUT/compile.log") failed";;
        bench_kernels) detail=$(grep -E '^30-layer stack' "$OUT/bench_kernels.log" | tail -n 1);;
        bench_decode) detail=$(grep -iE 'decode|tok' "$OUT/bench_decode.log" | tail -n 1);;
        step_kernels) detail=$(grep -E '^depth 1 pdl 1' "$OUT/step_kernels.log" | tail -n 1);;
        bench_prefix) detail=$(grep -E 'depth 1: no cache' "$OUT/bench_prefix.log" | tail -n 1);;
    esac
    printf '%-14s %-6s %6s  %s\n' "$name" "$([[ ${status[$name]} == 0 ]] && echo ok || echo FAIL:${status[$name]})" "${secs[$name]}" "$detail"
done
rc=0
for v in "${status[@]}"; do [[ $v == 0 ]] || rc=1; done
exit $rc
