#!/usr/bin/env bash
# One call on the GPU machine: reassemble the real model (part 1 copied to /root/tlc by the
# call before, part 2 carried in .model_parts/), then the GPU suite (tests + kernel and decode
# benchmarks on a synthetic SmolLM2-dims model), the decode benchmark on the real model, the
# pool benchmark against CuPy's MemoryPool, and the diagnostics on CUDA. Logs: $OUT/logs.tgz;
# the summary table is printed last. scripts/device_carry.sh writes what the two calls carry.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/device_out}
W=/tmp/device_run; rm -rf "$W"; mkdir -p "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
M=/root/tlc/smollm2.tlm
SITE=""; [[ -d /root/site ]] && SITE=/root/site
if [[ -f .model_parts/smollm2.tlm.part01 && -f /root/tlc/smollm2.tlm.part00 ]]; then
    cat /root/tlc/smollm2.tlm.part00 .model_parts/smollm2.tlm.part01 > "$M"
fi
if [[ -f "$M" ]] && [[ "$(sha256sum "$M" | cut -d' ' -f1)" == "$(cut -d' ' -f1 .model_parts/sha256)" ]]; then
    export TINYLOOP_TEST_MODEL=$M; echo "real model: $M (sha256 ok)"
else
    echo "real model: NOT available"; M=""
fi
# PART=suite runs only the GPU suite, PART=real only the real-model steps (the assembled model
# stays in /root/tlc while the machine is warm); default: both. The whole suite no longer fits
# one 10-minute call on a cold machine: PART=suite1 runs its tests/kernels half, PART=suite2
# the other test folders and the suite's benchmarks, each in its own call.
PART=${PART:-all}
SUITE_TIMEOUT=330
case $PART in
    suite1) export SUITE_PATHS=tests/kernels SKIP_BENCH_KERNELS=1 SKIP_BENCH_PREFIX=1
            SUITE_TIMEOUT=540;;
    suite2) export SUITE_PATHS="tests/api tests/convert tests/diagnostics tests/kv tests/memory tests/model tests/project tests/serve"
            export SKIP_BENCH_PREFIX=${SKIP_BENCH_PREFIX-1}; SUITE_TIMEOUT=360;;
esac
if [[ $PART != real ]]; then
    # the synthetic decode bench is skipped by default: the real-model one below measures
    # decode per KV mode and path, with the PyTorch peer, in the other call. The nvcc compile
    # check too (SKIP_NVCC= to run it): CI's tests/kernels/test_cuda_compile.py makes it for
    # sm_90, and on a cold machine it takes minutes of the call
    OUT=$W STEP_TIMEOUT=${STEP_TIMEOUT:-$SUITE_TIMEOUT} SKIP_BENCH_DECODE=${SKIP_BENCH_DECODE:-1} \
        SKIP_NVCC=${SKIP_NVCC-1} bash scripts/gpu_suite.sh > "$W/gpu_suite_summary.txt" 2>&1
    tail -n 12 "$W/gpu_suite_summary.txt"
fi
# SKIP="name ..." leaves those steps out (to fit a call into the device time that is left)
x() { local n=$1; shift; [[ " ${SKIP:-} " == *" $n "* ]] && { echo "== $n: skipped"; return; }
      echo "== $n"; timeout "${XT:-120}" "$@" > "$W/$n.log" 2>&1; echo "rc=$?" >> "$W/$n.log"; }
[[ $PART == suite* ]] && M=""
# the GPU tests that take the real model (TINYLOOP_TEST_MODEL), when the suite ran without it
[[ -n "$M" && $PART == real ]] && XT=300 x gpu_real_tests python3 -m pytest -m gpu -q -rfEs \
    -p no:cacheprovider tests/memory/test_memory_gpu.py tests/model/test_cuda_model.py \
    tests/model/test_cuda_graphs.py
# A/B against an earlier tree: a copy of its tinyloop/, cuda_src/ and benchmarks/ in .baseline/
# (scripts/baseline.sh REV writes it), measured in the same call, before and after this tree's run.
# A tree with the benchmarks package runs it from .baseline/ (so its own tinyloop/ is imported);
# an older one has the script (and its per-kernel step table, left out here)
ab() { [[ -n "$M" && -d .baseline && -n "${BASELINE:-}" ]] || return 0
    if [[ -f .baseline/benchmarks/__main__.py ]]; then
        XT=240 x "bench_baseline$1" env -C .baseline PYTHONPATH="$PWD/.baseline" python3 -m \
            benchmarks bench_decode --model "$M" --kv-modes fp16 --no-peer ${BASELINE_ARGS:-} \
            --out "$W/baseline$1"
    else
        XT=240 x "bench_baseline$1" env PYTHONPATH="$PWD/.baseline" python3 \
            .baseline/benchmarks/bench_decode.py --model "$M" --kv-modes fp16 --no-peer \
            --no-step-table ${BASELINE_ARGS:-} --out "$W/baseline$1"
    fi; }
ab 1
# with the long-context sweep (decode after 64 / 1k / 4k / 8k prompt tokens at depths 1 and 4)
# in the captured modes only: the store-h modes would rebuild K/V over 8k keys a step
[[ -n "$M" ]] && XT=420 x bench_real python3 -m benchmarks bench_decode --model "$M" \
    --kv-modes "${BENCH_KV_MODES:-all}" --contexts "${BENCH_CONTEXTS:-64,1024,4096,8000}" \
    --context-modes fp16,int8 --out "$W/real"
ab 2
# the decode-step profiler: generate against the graph replayed back to back per depth and PDL
# setting ("depth D pdl P: ..." lines), then depth 1's captured step kernel by kernel
[[ -n "$M" ]] && XT=240 x step_kernels python3 -m benchmarks step_kernels --model "$M" \
    --depths 1,2,4 --table-depths 1 --pdl 0,1
# continuous batching on the real model: 1 / 4 / 16 / 32 requests, each level 3 times
[[ -n "$M" ]] && XT=200 x bench_serve python3 -m benchmarks bench_serve --model "$M" \
    --backend cuda --reps 3 --out "$W/serve"
[[ $PART != suite* ]] && x bench_attn python3 -m benchmarks bench_attn_decode --out "$W/attn_decode.json"
[[ $PART != suite* ]] && x bench_attn_prefill python3 -m benchmarks bench_attn_prefill --out "$W/attn_prefill.json"
[[ $PART != suite* ]] && x bench_pool python3 -m benchmarks bench_pool --device cuda
if [[ -n "$M" ]]; then
    x diag_leak python3 -m diagnostics leak --backend cuda --model "$M" --requests 40 --out "$W/diag" --no-progress
    x diag_fragment python3 -m diagnostics fragment --backend cuda --model "$M" --requests 120 --max-prompt-tokens 1500 --out "$W/diag" --no-progress
    x diag_release python3 -m diagnostics release --backend cuda --model "$M" --out "$W/diag"
    x diag_report python3 -m diagnostics report "$W/diag"
fi
if [[ -n "$M" && -n "${NOTEBOOK:-}" ]]; then
    echo "== notebook"    # NOTEBOOK=1: the executed notebook to commit: $OUT/vram_report.ipynb
    # nbclient/ipykernel may be missing there: the call before installs carried wheels into
    # /root/site (only for this step, so they never shadow the image's packages elsewhere)
    OUT="$FINAL" PYTHONPATH="$PWD${SITE:+:$SITE}" timeout 300 bash scripts/execute_notebook.sh > "$W/notebook.log" 2>&1
    echo "rc=$?" >> "$W/notebook.log"
fi
tar czf "$FINAL/logs.tgz" -C "$W" . 2>/dev/null
echo; echo "================ SUMMARY ================"
[[ -f "$W/gpu_suite_summary.txt" ]] && tail -n 10 "$W/gpu_suite_summary.txt"
[[ -f "$W/gpu_real_tests.log" ]] && { echo "-- GPU tests on the real model:"; grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_real_tests.log" | tail -n 6; }
[[ -f "$W/bench_real.log" ]] && { echo "-- real SmolLM2:"; grep -E "decode depth|prefill|peer|captured" "$W/bench_real.log" | head -24; tail -n 8 "$W/bench_real.log"; }
[[ -f "$W/bench_real.log" ]] && { echo "-- real SmolLM2, decode after a long prompt:"; grep -E "ctx[0-9]" "$W/bench_real.log"; }
for f in "$W"/bench_baseline*.log; do [[ -f $f ]] && { echo "-- $(basename $f .log) (.baseline tree):"; grep -E "decode depth|prefill|graphs" "$f" | head -12; }; done
[[ -f "$W/bench_serve.log" ]] && { echo "-- bench_serve (real SmolLM2):"; grep -A5 "^requests" "$W/bench_serve.log"; }
[[ -f "$W/step_kernels.log" ]] && { grep -E "^depth" "$W/step_kernels.log"
    grep -vE "cupy|Traceback|File|^ |^$|^depth" "$W/step_kernels.log" | tail -n 12; }
tail -n 14 "$W/bench_attn.log" 2>/dev/null
tail -n 8 "$W/bench_attn_prefill.log" 2>/dev/null
tail -n 6 "$W/bench_pool.log" 2>/dev/null
for f in "$W"/diag_*.log "$W"/notebook.log; do [[ -f $f ]] && { echo "-- $(basename $f)"; grep -iE "verdict|rate|frees|cold|rc=" "$f" | head -5; }; done
