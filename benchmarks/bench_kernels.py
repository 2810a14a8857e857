"""Kernel micro-benchmarks of the CUDA backend at SmolLM2-135M's dims (GEMV, GEMM, attention, stack).

    python -m benchmarks bench_kernels [--out DIR] [--quick] [--ctx N]
                                       [--gemv-shapes smollm2|ouro|nanbeige] [--gemv-only]

Times (CUDA events, median of repeats after warm-up, GPU time per launch):
  - the device-to-device copy bandwidth (bytes read + written), the ceiling for the GEMVs;
  - decode GEMVs (T = 1) for each layer matrix, the LM head (also with the fused argmax) and
    one large matrix (--gemv-shapes: SmolLM2-135M's, or Ouro-1.4B's / Nanbeige4.2-3B's layer
    shapes), for GEMV v1 (one warp per row), v2 with its default geometry, tc (tensor cores;
    INT4 only, its column times v1 for the INT8 cases), auto (the default pick per shape) and,
    unless --quick, v2 at each lanes-per-row
    (4 / 8 / 16 / 32): GPU us from a CUDA graph of launches cycling over weight copies that do
    not fit in L2, GB/s of bytes read + written against the copy bandwidth, and the max error
    against float64 NumPy (relative to the output's RMS); --gemv-only stops there;
  - prefill GEMMs (T = 2048) for each layer matrix, as TFLOP/s, with and without the FP16 cache
    (cuBLAS); prefill and decode attention over the paged KV cache (``kv_write`` /
    ``kv_attention`` on a RuntimeKVCache, fp16 and int8 pages);
  - one whole synthetic layer stack (30 layers, one RuntimeKVCache slot each, as the model at
    depth 1) for each KV mode (fp16, int8):
    * a 2048-token prefill: its wall time, and a per-op table (every op of the prefill queued
      behind a spinning kernel so they run back to back, CUDA events between ops): GPU us per
      op and per op kind (GEMMs by matrix, attention, kv write, norms), plus the
      host time of the page allocation (``RuntimeKVCache.ensure(2048)``: 1,920 pages);
    * one decode step at context --ctx (default 2048) for GEMV v1 and v2: host wall clock
      per token (eager, launch-bound) and the step captured as one CUDA graph (the model's
      own captured step, kernel by kernel, is the ``step_kernels`` benchmark).
Prints tables last; with --out writes bench_kernels.json there. Needs CuPy and a GPU; without
them only ``--help`` works (the module imports, for the CPU import test).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

try:
    import cupy
except ImportError:        # --help and the CPU import test work without it
    cupy = None

from tinyloop.backends.base import STEP_ID, STEP_WORDS
from tinyloop.backends.cuda import CudaOps, KernelChoice
from tinyloop.backends.cuda.attention import decode_splits
from tinyloop.config import ModelConfig
from tinyloop.kv import PageAllocator, PageLayout, RuntimeKVCache
from tinyloop.memory import MemoryPool
from tinyloop.quant import QuantWeight, dequantize

from .common import gpu_time_us, graph_time_us, record_launches, spread, write_json

D, H, HKV, HD, FFN, VOCAB, LAYERS = 576, 9, 3, 64, 1536, 49152, 30
THETA, EPS = 1e4, 1e-5
KV_MODES = ("fp16", "int8")
# the synthetic stack as a looped model at depth 1: 30 layers = 30 KV slots
CFG = ModelConfig(vocab_size=VOCAB, d_model=D, n_heads=H, n_kv_heads=HKV, head_dim=HD,
                  ffn_dim=FFN, n_prelude=10, n_recurrent=10, n_coda=10, max_depth=1,
                  rope_theta=THETA, norm_eps=EPS)


def kv_cache(ops, pool, alloc, mode: str, capacity: int, n_positions: int):
    """A RuntimeKVCache of the synthetic stack (30 slots of ``mode`` pages) owning pages for
    ``n_positions``; returns (cache, host seconds of the ensure)."""
    cache = RuntimeKVCache(ops, pool, CFG, 1, capacity, (mode,) * CFG.n_layers, alloc)
    t0 = time.perf_counter()
    cache.ensure(n_positions)
    return cache, time.perf_counter() - t0


def kv_bytes_per_position(mode: str) -> int:
    """Bytes one position of one slot occupies in the CUDA pages (K/V codes and scales)."""
    return PageLayout.for_config(CFG, mode, kv_dtype=np.float16).bytes_per_token


def gpu_ms(fn, reps=50, warmup=5) -> float:
    """Median GPU milliseconds of one call of ``fn`` (common.gpu_time_us)."""
    return gpu_time_us(fn, reps, warmup).median / 1e3


def graph_us(fn, n=20) -> float:
    """Median GPU time per call of ``fn`` (microseconds) from a CUDA graph of n calls
    (common.graph_time_us)."""
    return graph_time_us(fn, n).median


def host_us(fn, n=2000) -> float:
    """Host wall time per call of ``fn`` in a back-to-back loop (launch-bound when kernels
    are shorter than the launch)."""
    for _ in range(50):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def rand_qw(rng, n, k, bits=4, g=32) -> QuantWeight:
    """Random codes and FP16 scales/zeros straight on the device (no host quantization)."""
    if bits == 4:
        q = cupy.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
    else:
        q = cupy.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8))
    s = cupy.asarray((rng.random((n, k // g)) * 0.01).astype(np.float16))
    z = cupy.asarray((rng.standard_normal((n, k // g)) * 0.01).astype(np.float16))
    return QuantWeight(bits, g, q, s, z)


def with_fp16(ops, w):
    class _Pool:
        def allocate(self, n, tag=None):
            buf = cupy.empty(n, cupy.uint8)

            class B:
                def array(self, shape, dtype):
                    return buf[:int(np.prod(shape)) * np.dtype(dtype).itemsize].view(
                        dtype).reshape(shape)
            return B()

        def free(self, blk):
            pass
    arr, _ = ops.make_fp16_cache(w, _Pool())
    return dataclasses.replace(w, fp16=arr)


SPIN_SRC = r'''
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
'''


def timed_ops(launches, reps=10) -> dict:
    """GPU ms of every (name, fn) of ``launches`` run in order, ``reps`` times, from CUDA
    events between the calls. Each repetition is queued behind a spinning kernel, so the calls
    run back to back on the GPU however slow the host is: each interval is one op (all the
    kernels it launches) plus the gap to the next. One untimed pass first (lazy compiles,
    scratch allocations). Returns {name: [ms of each call, all repetitions]}."""
    spin = cupy.RawKernel(SPIN_SRC, "spin")
    for _, fn in launches:
        fn()
    cupy.cuda.get_current_stream().synchronize()
    events = [cupy.cuda.Event() for _ in range(len(launches) + 1)]
    per: dict = {}
    for _ in range(reps):
        spin((1,), (1,), (20_000_000,))               # ~10 ms at 2 GHz: the host queues all
        events[0].record()
        for i, (_, fn) in enumerate(launches):
            fn()
            events[i + 1].record()
        events[-1].synchronize()
        for i, (name, _) in enumerate(launches):
            per.setdefault(name, []).append(cupy.cuda.get_elapsed_time(events[i],
                                                                       events[i + 1]))
    return per


def layer_launches(ops, layers, kv, x, bufs, pos0: int, t: int, split_norms: bool) -> list:
    """(name, fn) of every op of the 30-layer stack over rows ``x`` [t, D] at positions
    pos0.., in the model's order (one layer of ``Model.forward``), KV through ``kv`` (a
    RuntimeKVCache, slot li = layer li). ``split_norms``: the RMSNorms as their own ops (what
    rmsnorm_linear does at T > 1 anyway), so the table gives norms and GEMMs apart."""
    norm, q, a_, h, tmp = bufs
    out = []
    for li, lw in enumerate(layers):
        slot = kv.slot(li)
        if split_norms:
            out += [("rmsnorm", lambda: ops.rmsnorm(x, lw_norm(layers), EPS, norm)),
                    ("qkv GEMM", lambda lw=lw: ops.linear(norm, lw["qkv"], q))]
        else:
            out.append(("rmsnorm+qkv", lambda lw=lw: ops.rmsnorm_linear(
                x, lw_norm(layers), EPS, lw["qkv"], q, norm)))
        out += [
            ("kv_write", lambda slot=slot: ops.kv_write(q, None, pos0, THETA, H, HKV, HD, slot)),
            ("attention", lambda slot=slot: ops.kv_attention(q, slot, pos0, H, HKV, HD, a_)),
            ("wo GEMM+residual" if split_norms else "wo+residual",
             lambda lw=lw: ops.linear_residual(a_, lw["wo"], x))]
        if split_norms:
            out += [("rmsnorm", lambda: ops.rmsnorm(x, lw_norm(layers), EPS, norm)),
                    ("gate_up GEMM+swiglu", lambda lw=lw: ops.linear_swiglu(norm, lw["gu"],
                                                                            tmp, h))]
        else:
            out.append(("rmsnorm+gate_up+swiglu", lambda lw=lw: ops.rmsnorm_linear_swiglu(
                x, lw_norm(layers), EPS, lw["gu"], tmp, h, norm)))
        out.append(("down GEMM+residual" if split_norms else "down+residual",
                    lambda lw=lw: ops.linear_residual(h, lw["down"], x)))
    return out


def lw_norm(layers):
    """The RMSNorm weight every synthetic layer shares (ones, f32 [D])."""
    return layers[0]["norm"]


# op kinds of the prefill table (where the 2,048-token prefill's time goes)
PREFILL_KINDS = {"rmsnorm": "norms", "qkv GEMM": "GEMMs", "wo GEMM+residual": "GEMMs",
                 "gate_up GEMM+swiglu": "GEMMs", "down GEMM+residual": "GEMMs",
                 "kv_write": "kv write", "attention": "attention"}


def prefill_table(ops, layers, kv, main_, bufs, t, reps=3) -> dict:
    """GPU time of every op of a ``t``-token prefill of the stack (norms and GEMMs apart):
    {"ops": {op: {"calls", "ms_per_call", "ms_total", "ms_p10", "ms_p90"}},
    "kinds": {kind: ms per prefill}, "ms_sum"} (medians over ``reps`` prefills)."""
    x = main_[:t]
    per = timed_ops(layer_launches(ops, layers, kv, x, bufs, 0, t, True), reps)
    table, kinds = {}, {}
    for name, ms in per.items():
        n = len(ms) // reps
        tot = sum(ms) / reps
        table[name] = {"calls": n, "ms_per_call": statistics.median(ms), "ms_total": tot,
                       "ms_p10": float(np.percentile(ms, 10)),
                       "ms_p90": float(np.percentile(ms, 90))}
        kind = PREFILL_KINDS[name]
        kinds[kind] = kinds.get(kind, 0.0) + tot
    return {"ops": table, "kinds": kinds, "ms_sum": sum(kinds.values())}


def print_prefill_table(title, pt, alloc_ms):
    print(f"\n{title}")
    print(f"{'op':<24}{'calls':>6}{'ms/call':>9}{'p10-p90':>16}{'ms/prefill':>11}")
    for name, v in pt["ops"].items():
        print(f"{name:<24}{v['calls']:>6}{v['ms_per_call']:>9.3f}"
              f"{v['ms_p10']:>8.3f}-{v['ms_p90']:<7.3f}{v['ms_total']:>11.2f}")
    print("by kind: " + ", ".join(f"{k} {v:.2f} ms" for k, v in pt["kinds"].items())
          + f"; GPU sum {pt['ms_sum']:.2f} ms; page allocation (host) "
          f"{alloc_ms[0]:.2f} ms median ({alloc_ms[1]:.2f}-{alloc_ms[2]:.2f})")


def rand_qw_fast(w: QuantWeight) -> QuantWeight:
    """A device copy of ``w`` at new addresses (same bytes: for cycling weights out of L2)."""
    return QuantWeight(w.bits, w.group_size, w.qweight.copy(), w.scales.copy(), w.zeros.copy())


# The decode GEMV cases per model (--gemv-shapes): (name, out rows, K, bits, epilogue); the
# looped architectures' layer shapes from their published configs (common.OURO_1_4B,
# common.NANBEIGE_3B), INT4 as bench_looped writes them.
GEMV_SHAPES = {
    "smollm2": [("qkv", 960, D, 4, "f16"), ("wo", D, D, 4, "resid"),
                ("gate_up", 2 * FFN, D, 4, "swiglu"), ("down", D, FFN, 4, "resid"),
                ("lm_head", VOCAB, D, 8, "f32"),
                ("big_q4", 16384, 8192, 4, "f16"), ("big_q8", 8192, 8192, 8, "f16"),
                ("norm+qkv", 960, D, 4, "norm_f16"), ("norm+gate_up", 2 * FFN, D, 4, "norm_swiglu"),
                ("norm+lm_head", VOCAB, D, 8, "norm_f32"),
                ("norm+lm_head+argmax", VOCAB, D, 8, "norm_argmax")],
    "ouro": [("norm+qkv", 6144, 2048, 4, "norm_f16"), ("wo", 2048, 2048, 4, "resid"),
             ("norm+gate_up", 11264, 2048, 4, "norm_swiglu"), ("down", 2048, 5632, 4, "resid"),
             ("norm+lm_head", 49152, 2048, 4, "norm_f32"),
             ("norm+lm_head+argmax", 49152, 2048, 4, "norm_argmax")],
    "nanbeige": [("norm+qkv", 8192, 3072, 4, "norm_f16"), ("wo", 3072, 6144, 4, "resid"),
                 ("norm+gate_up", 21504, 3072, 4, "norm_swiglu"),
                 ("down", 3072, 10752, 4, "resid")],
}


def print_gemv(res: dict, variants) -> None:
    """The GEMV table of ``res["gemv"]``, a column per variant."""
    gemv = res["gemv"]
    vn = [v for v in variants]
    print("GEMV (T=1): GPU us per launch (CUDA-graph replay over copies that do not fit L2), "
          "GB/s of bytes read+written, % of copy bandwidth; err = max |out - NumPy| / rms(ref)")
    print(f"{'case':<21}{'shape':>12}{'b':>2}" + "".join(f"{v:>22}" for v in vn))
    for k_, v in gemv.items():
        line = f"{k_:<21}{'x'.join(map(str, v['shape'])):>12}{v['bits']:>2}"
        for name in vn:
            c = v.get(name)
            if c is None:
                line += f"{'-':>22}"
                continue
            e = "" if c["max_err_rel_rms"] is None else f" e{c['max_err_rel_rms']:.0e}"
            line += f"{c['us']:>7.2f}us{c['GBps']:>5.0f}G{100 * c['frac_copy']:>3.0f}%{e:>6}"
        if "argmax_ok" in v:
            line += f"  argmax==np.argmax(logits): {v['argmax_ok']}"
        print(line)
    print("host us per GEMV call (v1 / v2): " + ", ".join(
        f"{k_} {v['v1']['host_us']:.1f}/{v['v2']['host_us']:.1f}" for k_, v in gemv.items()
        if "v1" in v))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--out", default=None, help="directory for bench_kernels.json")
    ap.add_argument("--quick", action="store_true",
                    help="v1 and v2 only (no lanes-per-row sweep)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="decode context of the stack's decode step (<= 2048)")
    ap.add_argument("--gemv-shapes", choices=sorted(GEMV_SHAPES), default="smollm2",
                    help="the decode GEMV cases: SmolLM2-135M's (default), or Ouro-1.4B's / "
                         "Nanbeige4.2-3B's layer shapes")
    ap.add_argument("--gemv-only", action="store_true",
                    help="only the copy bandwidth and the decode GEMV table")
    args = ap.parse_args(argv)
    if cupy is None:
        raise SystemExit("bench_kernels needs CuPy and a CUDA GPU")
    rng = np.random.default_rng(0)
    ops = CudaOps()
    ops.compile_all()
    res: dict = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}

    n = 1 << 28                                   # 1 GiB of float32
    a = cupy.ones(n, cupy.float32)
    b = cupy.empty_like(a)
    ms = gpu_ms(lambda a=a, b=b: cupy.copyto(b, a), reps=20)
    copy_gbs = 2 * a.nbytes / ms / 1e6
    res["copy_GBps"] = copy_gbs
    del a, b

    # --- decode GEMVs: v1 against v2 (auto geometry and each lanes-per-row) -------------------
    variants = {"v1": CudaOps(KernelChoice(gemv="v1")),
                "v2": CudaOps(KernelChoice(gemv="v2")),
                "tc": CudaOps(KernelChoice(gemv="tc")),
                "auto": ops}                      # auto: GEMV_BY_SHAPE's pick per shape
    if not args.quick:
        for lpr in (4, 8, 16, 32):
            variants[f"v2/l{lpr}"] = CudaOps(KernelChoice(gemv="v2", gemv_lpr=lpr))
    gemv = {}
    cases = GEMV_SHAPES[args.gemv_shapes]
    for name, nout, k, bits, epi in cases:
        # enough copies (>= 2.5x the 50 MB L2, at most 400) that the weights come from DRAM
        one = rand_qw(rng, nout, k, bits)
        copies = int(min(400, max(1, -(-int(128e6) // one.nbytes))))
        ws = [one] + [rand_qw_fast(one) for _ in range(copies - 1)]
        xh = rng.standard_normal((1, k)).astype(np.float16)
        x = cupy.asarray(xh)
        x32h = rng.standard_normal((1, k)).astype(np.float32)
        x32 = cupy.asarray(x32h)
        nw = cupy.ones(k, cupy.float32)
        step = cupy.zeros(STEP_WORDS, cupy.int32)       # the fused head's id lands here
        rows = nout // 2 if epi.endswith("swiglu") else nout
        out16 = cupy.empty((1, rows), cupy.float16)
        out32 = cupy.zeros((1, nout), cupy.float32)
        in_bytes = x32.nbytes + nw.nbytes if epi.startswith("norm") else x.nbytes
        out_bytes = {"resid": 8 * nout, "f32": 4 * nout, "norm_f32": 4 * nout,
                     "norm_argmax": 4 * nout}.get(epi, 2 * rows)
        nbytes = one.nbytes + in_bytes + out_bytes
        row = {"shape": [nout, k], "bits": bits, "copies": copies, "bytes": nbytes}
        # correctness: each variant's output for ws[0] against float64 NumPy on the same inputs
        ref = None
        if nout * k <= 64e6:
            wd = dequantize(QuantWeight(bits, 32, cupy.asnumpy(one.qweight),
                                        cupy.asnumpy(one.scales), cupy.asnumpy(one.zeros)))
            if epi.startswith("norm"):
                ms_ = np.mean(x32h.astype(np.float64) ** 2)
                xin = (x32h / np.sqrt(ms_ + 1e-5)).astype(np.float16).astype(np.float64)
            else:
                xin = xh.astype(np.float64)
            y = xin @ wd.T.astype(np.float64)
            if epi.endswith("swiglu"):
                g_, u_ = y[:, :rows], y[:, rows:]
                y = g_ / (1 + np.exp(-g_)) * u_
            ref = y[0]
        for vname, vops in variants.items():
            if epi == "norm_argmax" and vname == "v1":
                continue
            state = {"i": 0}

            def run(vops=vops, w_=None):
                w = w_ if w_ is not None else ws[state["i"] % len(ws)]
                state["i"] += 1
                if epi == "f16":
                    vops.linear(x, w, out16)
                elif epi == "resid":
                    vops.linear_residual(x, w, out32)
                elif epi == "swiglu":
                    vops.linear_swiglu(x, w, None, out16)
                elif epi == "norm_f16":
                    vops.rmsnorm_linear(x32, nw, 1e-5, w, out16, None)
                elif epi == "norm_swiglu":
                    vops.rmsnorm_linear_swiglu(x32, nw, 1e-5, w, None, out16, None)
                elif epi == "norm_f32":
                    vops.rmsnorm_lm_head(x32, nw, 1e-5, w, out32, None)
                elif epi == "norm_argmax":
                    vops.head_argmax_step(x32, nw, 1e-5, w, out32, None, step)
                else:
                    vops.lm_head(x, w, out32)
            us = graph_us(run, n=len(ws))
            err = None
            if ref is not None:
                out32.fill(0)
                run(w_=one)
                got = cupy.asnumpy(out32 if (epi in ("resid", "norm_argmax")
                                             or epi.endswith("f32")) else out16)[0]
                got = got.astype(np.float64)
                err = float(np.max(np.abs(got - ref)) / (np.sqrt(np.mean(ref ** 2)) + 1e-30))
                if epi == "norm_argmax":
                    dev_id = int(cupy.asnumpy(step)[STEP_ID])
                    row["argmax_ok"] = dev_id == int(np.argmax(got))
            row[vname] = {"us": us, "GBps": nbytes / us / 1e3,
                          "frac_copy": nbytes / us / 1e3 / copy_gbs, "max_err_rel_rms": err,
                          "host_us": host_us(run, 300)}
        gemv[name] = row
    res["gemv"] = gemv
    if args.gemv_only:
        write_json(args.out, "bench_kernels.json", res)
        print(f"\n== bench_kernels on {res['device']}; copy {copy_gbs:.0f} GB/s (read+write); "
              f"GEMV shapes: {args.gemv_shapes}")
        print_gemv(res, variants)
        return 0

    # --- prefill GEMMs (T = 2048) ---------------------------------------------------------------
    t = 2048
    gemm = {}
    x = cupy.asarray(rng.standard_normal((t, FFN)).astype(np.float16))
    for name, nout, k in [("qkv", 960, D), ("wo", D, D), ("gate_up", 2 * FFN, D), ("down", D, FFN)]:
        w = rand_qw(rng, nout, k)
        xs = x[:, :k].copy()
        out = cupy.empty((t, nout), cupy.float16)
        ms = gpu_ms(lambda: ops.linear(xs, w, out))
        w16 = with_fp16(ops, rand_qw(rng, nout, k))
        ms16 = gpu_ms(lambda: ops.linear(xs, w16, out))
        flop = 2 * t * nout * k
        gemm[name] = {"shape": [t, nout, k], "ms": ms, "TFLOPs": flop / ms / 1e9,
                      "ms_fp16_cublas": ms16, "TFLOPs_fp16_cublas": flop / ms16 / 1e9}
    res["gemm"] = gemm

    # --- attention over the paged KV cache: fp16 and int8 pages ---------------------------------
    pool = MemoryPool("cuda")                     # the bench's own pool (tags as the model's)
    pages = PageAllocator(ops, pool)
    qkv = cupy.asarray(rng.standard_normal((t, (H + 2 * HKV) * HD)).astype(np.float16))
    att = cupy.empty((t, H * HD), cupy.float16)
    pairs = H * t * (t + 1) / 2
    attn = {}
    for mode in KV_MODES:
        cache, _ = kv_cache(ops, pool, pages, mode, t + 1, t + 1)
        slot = cache.slot(0)
        q_pf = qkv.copy()
        ms_kw = gpu_ms(lambda: ops.kv_write(q_pf, None, 0, THETA, H, HKV, HD, slot), reps=20)
        ms_pf = gpu_ms(lambda: ops.kv_attention(q_pf, slot, 0, H, HKV, HD, att), reps=20)
        q1 = qkv[:1].copy()
        ops.kv_write(q1, None, t, THETA, H, HKV, HD, slot)           # position t
        us_dc = graph_us(lambda: ops.kv_attention(q1, slot, t, H, HKV, HD, att[:1]))
        attn[mode] = {"T": t, "prefill_ms": ms_pf, "prefill_TFLOPs": 4 * HD * pairs / ms_pf / 1e9,
                      "kv_write_ms": ms_kw, "decode_ctx": t + 1, "decode_us": us_dc,
                      "decode_splits": decode_splits(t + 1, H, ops.sms),
                      "decode_GBps": (t + 1) * kv_bytes_per_position(mode) * (H // HKV)
                      / us_dc / 1e3}
        if mode == "fp16":
            host_attn = host_us(lambda: ops.kv_attention(q1, slot, 100, H, HKV, HD, att[:1]))
            host_kvw = host_us(lambda: ops.kv_write(q1, None, 100, THETA, H, HKV, HD, slot))
        cache.release()
    res["attention"] = attn
    main_h = cupy.ones((4, D), cupy.float32)
    norm_h = cupy.ones(D, cupy.float32)
    n1 = cupy.empty((1, D), cupy.float16)
    # host cost of one wrapper call vs the bare CuPy launch of the same kernel
    w_small = rand_qw(rng, 960, D)
    x1 = cupy.asarray(rng.standard_normal((1, D)).astype(np.float16))
    o1 = cupy.empty((1, 960), cupy.float16)
    ops.linear(x1, w_small, o1)            # first use: the weight's launch info is built
    (bare,) = record_launches(lambda: ops.linear(x1, w_small, o1))    # one GEMV launch
    res["host_us"] = {
        "linear_T1": host_us(lambda: ops.linear(x1, w_small, o1)),
        "bare_cupy_launch": host_us(lambda: bare[0](*bare[1:])),
        "rmsnorm_T1": host_us(lambda: ops.rmsnorm(main_h[:1], norm_h, EPS, n1)),
        "rmsnorm_linear_T1": host_us(lambda: ops.rmsnorm_linear(main_h[:1], norm_h, EPS,
                                                                w_small, o1, n1)),
        "kv_attention_T1": host_attn,
        "kv_write_T1": host_kvw,
    }

    # --- a 30-layer synthetic stack over a paged cache: prefill 2048 and decode, per KV mode ------
    step = cupy.zeros(STEP_WORDS, cupy.int32)     # the graph's greedy head writes its id here
    layers = [dict(qkv=rand_qw(rng, 960, D), wo=rand_qw(rng, D, D), gu=rand_qw(rng, 2 * FFN, D),
                   down=rand_qw(rng, D, FFN)) for _ in range(LAYERS)]
    head = rand_qw(rng, VOCAB, D, 8)
    norm_w = cupy.ones(D, cupy.float32)
    layers[0]["norm"] = norm_w                    # lw_norm: one norm weight for every layer
    cap = t + 64
    main_ = cupy.asarray((rng.standard_normal((cap, D)) * 0.1).astype(np.float32))
    norm = cupy.empty((t, D), cupy.float16)
    s1 = cupy.empty((t, 2 * FFN), cupy.float16)
    ad = cupy.empty((t, FFN), cupy.float16)
    logits = cupy.empty((1, VOCAB), cupy.float32)

    def rows(buf, tt, cols):                      # a [tt, cols] view of a flat buffer
        return buf.reshape(-1)[:tt * cols].reshape(tt, cols)

    def bufs(tt):                                 # (norm, qkv, attn out, ffn hidden, gate|up)
        return (norm[:tt], rows(s1, tt, 960), rows(ad, tt, D), rows(ad, tt, FFN),
                rows(s1, tt, 2 * FFN))

    def run(launches):
        for _, fn in launches:
            fn()

    ctx0 = min(args.ctx, cap - 64)
    stack_pf, pf_tables, alloc_ms, stack = {}, {}, {}, {}
    for mode in KV_MODES:
        # page allocation: host time of ensure(t) on a fresh cache (1,920 pages at t = 2048);
        # the first request adds the pool's segments, the later ones reuse them (steady state)
        al = []
        for _ in range(8):
            c, sec = kv_cache(ops, pool, pages, mode, cap, t)
            al.append(sec * 1e3)
            c.release()
        alloc_ms[mode] = (statistics.median(al[1:]), min(al[1:]), max(al[1:]), al[0])
        # the whole prefill wall clock with its page allocation, as a request pays it
        walls = []
        for _ in range(5):
            cupy.cuda.get_current_stream().synchronize()
            t0 = time.perf_counter()
            c, _ = kv_cache(ops, pool, pages, mode, cap, t)
            run(layer_launches(ops, layers, c, main_[:t], bufs(t), 0, t, False))
            cupy.cuda.get_current_stream().synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            c.release()
        kv, _ = kv_cache(ops, pool, pages, mode, cap, cap)
        pf = layer_launches(ops, layers, kv, main_[:t], bufs(t), 0, t, False)
        ms_prefill = gpu_ms(lambda: run(pf), reps=5, warmup=1)
        stack_pf[mode] = {"ms": ms_prefill, "tok_per_s": t / ms_prefill * 1e3,
                          "wall_ms_with_pages": statistics.median(walls),
                          "wall_ms_min": min(walls), "wall_ms_max": max(walls)}
        pf_tables[mode] = prefill_table(ops, layers, kv, main_, bufs(t), t)

        # decode at context ~args.ctx: v1 (head, then the 1-block argmax kernel) against v2
        # (the fused head + two-stage argmax); host wall clock per token (eager,
        # launch-bound; the op lists are built before timing) and the step as one CUDA graph
        for vname in ("v1", "v2"):
            o = variants[vname]
            fused = vname == "v2"
            steps = {p: layer_launches(o, layers, kv, main_[p:p + 1], bufs(1), p, 1, False)
                     for p in range(ctx0, ctx0 + 61)}

            def decode_token(pos, o=o, fused=fused):
                run(steps[pos])
                xr = main_[pos:pos + 1]
                if fused:
                    return o.rmsnorm_lm_head_sample(xr, norm_w, EPS, head, logits, norm[:1],
                                                    0.0, 0, 1.0, 0.0)
                o.rmsnorm_lm_head(xr, norm_w, EPS, head, logits, norm[:1])
                return o.sample(logits, 0.0, 0, 1.0, 0.0)
            for p in range(ctx0, ctx0 + 3):
                decode_token(p)
            times = []
            for rep in range(5):
                t0 = time.perf_counter()
                for p in range(ctx0, ctx0 + 50):
                    decode_token(p)
                times.append((time.perf_counter() - t0) / 50)
            pos_g = ctx0 + 60

            def body(o=o):
                run(steps[pos_g])
                # greedy head into the step state: v2 fused, v1 head then argmax kernel
                o.head_argmax_step(main_[pos_g:pos_g + 1], norm_w, EPS, head, logits,
                                   norm[:1], step)
            graph_tok_us = graph_us(body, n=1)
            key = f"{mode}/{vname}"
            wall = spread(times)
            stack[key] = {"ms_per_token_wall": wall.median * 1e3,
                          "ms_per_token_wall_min": wall.min * 1e3,
                          "ms_per_token_wall_max": wall.max * 1e3,
                          "tok_per_s_wall": 1 / wall.median,
                          "graph_gpu_us_per_token": graph_tok_us,
                          "graph_tok_per_s_bound": 1e6 / graph_tok_us}
        kv.release()
    res["stack_prefill_2048"] = stack_pf
    res["prefill_op_table"] = pf_tables
    res["page_alloc_host_ms"] = alloc_ms
    res["stack_decode"] = stack

    # --- sampling at temperature > 0 over a 49,152 logit row: the device sampler, fast path
    # against the one-block reference (KernelChoice.sampler), with min-p and the penalty ------
    lg = cupy.asarray((rng.standard_normal(VOCAB) * 3).astype(np.float32))
    recent = rng.integers(0, VOCAB, 64)
    samp = {}
    default_kernels = ops.kernels
    for cfg in ((0.8, 0, 1.0, 0.0, 1.0), (0.8, 40, 1.0, 0.0, 1.0), (0.8, 0, 0.9, 0.0, 1.0),
                (0.7, 50, 0.95, 0.0, 1.0), (0.8, 0, 0.9, 0.05, 1.1)):
        t_, k_, p_, mp_, pen_ = cfg
        rec = recent if pen_ != 1.0 else None
        row = {}
        for sampler in ("fast", "reference"):
            ops.kernels = dataclasses.replace(default_kernels, sampler=sampler)
            try:
                def one(t_=t_, k_=k_, p_=p_, mp_=mp_, pen_=pen_, rec=rec):
                    return ops.sample(lg, t_, k_, p_, 0.37, mp_, pen_, rec)
                row[sampler] = {
                    "device_wall_us": host_us(one, 200), "device_id": one(),
                    "gpu_us": graph_us(lambda t_=t_, k_=k_, p_=p_, mp_=mp_, pen_=pen_, rec=rec:
                                       ops.sample_launch(lg, t_, k_, p_, 0.37, mp_, pen_,
                                                         rec), n=10)}
            finally:
                ops.kernels = default_kernels
        samp["T={} top_k={} top_p={} min_p={} penalty={}".format(*cfg)] = row
    res["sample_nongreedy"] = samp

    write_json(args.out, "bench_kernels.json", res)

    print(f"\n== bench_kernels on {res['device']}; copy {copy_gbs:.0f} GB/s (read+write)")
    print_gemv(res, variants)
    print(f"{'GEMM (T=2048)':<14}{'N x K':>14}{'ms':>9}{'TFLOP/s':>9}{'cuBLAS ms':>11}{'TFLOP/s':>9}")
    for k_, v in gemm.items():
        print(f"{k_:<14}{'x'.join(map(str, v['shape'][1:])):>14}{v['ms']:>9.3f}{v['TFLOPs']:>9.1f}"
              f"{v['ms_fp16_cublas']:>11.3f}{v['TFLOPs_fp16_cublas']:>9.1f}")
    for mode, v in attn.items():
        print(f"attention {mode}: prefill T={t} {v['prefill_ms']:.3f} ms "
              f"({v['prefill_TFLOPs']:.1f} TFLOP/s), kv_write T={t} {v['kv_write_ms']:.3f} ms; "
              f"decode ctx={t + 1} {v['decode_us']:.1f} us ({v['decode_GBps']:.0f} GB/s, "
              f"splits {v['decode_splits']})")
    print("host us per call: " + ", ".join(f"{k_} {v:.1f}" for k_, v in res["host_us"].items()))
    for mode, v in stack_pf.items():
        a_ = alloc_ms[mode]
        print(f"30-layer stack, {mode} pages: prefill {t} = {v['ms']:.1f} ms GPU "
              f"({v['tok_per_s']:.0f} tok/s); wall with page allocation "
              f"{v['wall_ms_with_pages']:.1f} ms ({v['wall_ms_min']:.1f}-{v['wall_ms_max']:.1f});"
              f" ensure({t}) host {a_[0]:.2f} ms ({a_[1]:.2f}-{a_[2]:.2f}; first {a_[3]:.2f})")
        print_prefill_table(f"prefill {t}, {mode} pages: GPU ms per op (ops queued back to back)",
                            pf_tables[mode], a_)
    print("\nsampling (temperature > 0, 49,152 logits): the device sampler, fast | reference")
    for k_, v in samp.items():
        f_, r_ = v["fast"], v["reference"]
        print(f"  {k_:<50} fast {f_['device_wall_us']:7.1f} us wall ({f_['gpu_us']:.1f} us "
              f"GPU) | reference {r_['device_wall_us']:7.1f} us wall ({r_['gpu_us']:.1f} us "
              f"GPU); same id: {f_['device_id'] == r_['device_id']}")
    print(f"\n30-layer decode step + head + greedy pick, ctx ~{ctx0}:")
    print(f"{'mode/GEMV':<10}{'eager wall ms/tok (min-max)':>30}{'tok/s':>8}"
          f"{'graph GPU us':>14}{'graph tok/s bound':>19}")
    for vname, v in stack.items():
        print(f"{vname:<10}{v['ms_per_token_wall']:>12.3f} ({v['ms_per_token_wall_min']:.3f}-"
              f"{v['ms_per_token_wall_max']:.3f}){'':>2}{v['tok_per_s_wall']:>8.0f}"
              f"{v['graph_gpu_us_per_token']:>14.1f}"
              f"{v['graph_tok_per_s_bound']:>19.0f}")
    return 0
