"""Kernel micro-benchmarks of the CUDA backend at SmolLM2-135M's dims (a script, not a test).

    python benchmarks/bench_kernels.py [--out DIR] [--quick] [--ctx N]

Times (CUDA events, median of repeats after warm-up, GPU time per launch):
  - the device-to-device copy bandwidth (bytes read + written), the ceiling for the GEMVs;
  - decode GEMVs (T = 1) for each layer matrix, the LM head (also with the fused argmax) and
    one large matrix, for GEMV v1 (one warp per row), v2 with its default geometry and, unless
    --quick, v2 at each lanes-per-row (4 / 8 / 16 / 32): GPU us from a CUDA graph of launches
    cycling over weight copies that do not fit in L2, GB/s of bytes read + written against the
    copy bandwidth, and the max error against float64 NumPy (relative to the output's RMS);
  - prefill GEMMs (T = 2048) for each layer matrix, as TFLOP/s, with and without the FP16 cache
    (cuBLAS); prefill and decode attention;
  - one whole synthetic layer stack (30 layers): a 2048-token prefill; and one decode step at
    context --ctx (default 2048) for v1 and v2: the per-kernel table (every launch of the
    step queued behind a spinning kernel so they run back to back, CUDA events between
    launches: GPU us per kernel, GB/s from the bytes its shapes read and write), host wall
    clock per token (eager, launch-bound), and the step captured as one CUDA graph.
Prints tables last; with --out writes bench_kernels.json there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupy  # noqa: E402

from tinyloop.backends.cuda_ops import CudaOps  # noqa: E402
from tinyloop.quant import QuantWeight, dequantize  # noqa: E402

D, H, HKV, HD, FFN, VOCAB, LAYERS = 576, 9, 3, 64, 1536, 49152, 30


def gpu_ms(fn, reps=50, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def graph_us(fn, n=20) -> float:
    """GPU time per call of ``fn`` (microseconds), from replaying a CUDA graph of n calls:
    launch gaps removed, so small kernels are timed alone."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(n):
            fn()
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(20):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times) * 1e3 / n


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
    object.__setattr__(w, "fp16", arr)
    return w


SPIN_SRC = r'''
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
'''


def per_kernel_table(ops, layers, head, norm_w, kcs, vcs, main_, bufs, pos, copy_gbs,
                     reps=10) -> dict:
    """GPU time of every launch of one decode step (30 layers + head + greedy pick) at
    context ``pos + 1``, from CUDA events between launches. The step is queued behind a
    spinning kernel, so the launches run back to back on the GPU however slow the host is:
    each interval is one kernel plus the gap to the next. Bytes read + written per launch
    are computed from the shapes (weights, activations, KV rows), giving GB/s.
    Returns {kernel: {"launches", "us" (median per launch), "us_step", "bytes", "GBps"}}."""
    spin = cupy.RawKernel(SPIN_SRC, "spin")
    norm, q, a_, h, logits = bufs
    hd_bytes = HKV * HD * 2
    ctx = pos + 1
    w0 = layers[0]
    sizes = {
        "rmsnorm+qkv": w0["qkv"].nbytes + 8 * D + 2 * 960,
        "rope_kv": 2 * 2 * 960 + 2 * hd_bytes,
        "attention": 2 * ctx * hd_bytes + 2 * 2 * H * HD,
        "wo+residual": w0["wo"].nbytes + 2 * D + 8 * D,
        "rmsnorm+gate_up+swiglu": w0["gu"].nbytes + 8 * D + 2 * FFN,
        "down+residual": w0["down"].nbytes + 2 * FFN + 8 * D,
        "head rmsnorm+lm_head": head.nbytes + 8 * D + 4 * VOCAB,
        "argmax (sample)": 4 * VOCAB,
        "head rmsnorm+lm_head+argmax": head.nbytes + 8 * D + 4 * VOCAB,
    }
    fused = ops.gemv["version"] == "v2"
    x = main_[pos:pos + 1]
    launches = []            # (name, fn)
    for li, lw in enumerate(layers):
        launches += [
            ("rmsnorm+qkv", lambda lw=lw: ops.rmsnorm_linear(x, norm_w, 1e-5, lw["qkv"], q,
                                                              norm)),
            ("rope_kv", lambda li=li: ops.rope_kv(q, pos, 1e4, H, HKV, HD, kcs[li], vcs[li])),
            ("attention", lambda li=li: ops.attention(q, kcs[li], vcs[li], pos, H, HKV, HD, a_)),
            ("wo+residual", lambda lw=lw: ops.linear_residual(a_, lw["wo"], x)),
            ("rmsnorm+gate_up+swiglu", lambda lw=lw: ops.rmsnorm_linear_swiglu(
                x, norm_w, 1e-5, lw["gu"], None, h, norm)),
            ("down+residual", lambda lw=lw: ops.linear_residual(h, lw["down"], x)),
        ]
    if fused:
        launches.append(("head rmsnorm+lm_head+argmax", lambda: ops.head_argmax_launch(
            ops._info(head), x, norm_w, 1e-5, logits, ops._id_ptr)))
    else:
        launches.append(("head rmsnorm+lm_head", lambda: ops.rmsnorm_lm_head(
            x, norm_w, 1e-5, head, logits, norm)))
        launches.append(("argmax (sample)", lambda: ops._fn("sample", "argmax_f32")(
            (1,), (1024,), (logits.data.ptr, VOCAB, ops._id_ptr))))
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
            per.setdefault(name, []).append(
                cupy.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e3)
    table = {}
    n_steps = reps
    for name, us in per.items():
        n = len(us) // n_steps
        med = statistics.median(us)
        table[name] = {"launches": n, "us": med, "us_p10": float(np.percentile(us, 10)),
                       "us_p90": float(np.percentile(us, 90)), "us_step": sum(us) / n_steps,
                       "bytes": sizes[name], "GBps": sizes[name] / med / 1e3,
                       "frac_copy": sizes[name] / med / 1e3 / copy_gbs}
    return table


def print_kernel_table(title, table, copy_gbs):
    print(f"\n{title}  (copy bandwidth {copy_gbs:,.0f} GB/s read+write)")
    print(f"{'kernel':<30}{'n/step':>7}{'us med':>8}{'p10-p90':>14}{'us/step':>9}{'KB':>9}"
          f"{'GB/s':>8}{'% copy':>8}")
    tot = 0.0
    for name, v in table.items():
        tot += v["us_step"]
        print(f"{name:<30}{v['launches']:>7}{v['us']:>8.2f}"
              f"{v['us_p10']:>7.2f}-{v['us_p90']:<6.2f}{v['us_step']:>9.1f}"
              f"{v['bytes'] / 1e3:>9.1f}{v['GBps']:>8.0f}{100 * v['frac_copy']:>7.1f}%")
    print(f"{'sum (one decode step, GPU)':<30}{'':>7}{'':>8}{'':>14}{tot:>9.1f} us")


def rand_qw_fast(w: QuantWeight) -> QuantWeight:
    """A device copy of ``w`` at new addresses (same bytes: for cycling weights out of L2)."""
    return QuantWeight(w.bits, w.group_size, w.qweight.copy(), w.scales.copy(), w.zeros.copy())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="v1 and v2 only (no lanes-per-row sweep)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="decode context for the per-kernel table and the stack")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ops = CudaOps()
    ops.compile_all()
    res: dict = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}

    n = 1 << 28                                   # 1 GiB of float32
    a = cupy.ones(n, cupy.float32)
    b = cupy.empty_like(a)
    ms = gpu_ms(lambda: cupy.copyto(b, a), reps=20)
    copy_gbs = 2 * a.nbytes / ms / 1e6
    res["copy_GBps"] = copy_gbs
    del a, b

    # --- decode GEMVs: v1 against v2 (auto geometry and each lanes-per-row) -------------------
    variants = {"v1": CudaOps(gemv="v1"), "v2": CudaOps(gemv="v2"),
                "auto": ops}                      # auto: GEMV_BY_SHAPE's pick per shape
    if not args.quick:
        for lpr in (4, 8, 16, 32):
            variants[f"v2/l{lpr}"] = CudaOps(gemv="v2", gemv_lpr=lpr)
    gemv = {}
    cases = [("qkv", 960, D, 4, "f16"), ("wo", D, D, 4, "resid"),
             ("gate_up", 2 * FFN, D, 4, "swiglu"), ("down", D, FFN, 4, "resid"),
             ("lm_head", VOCAB, D, 8, "f32"),
             ("big_q4", 16384, 8192, 4, "f16"), ("big_q8", 8192, 8192, 8, "f16"),
             # RMSNorm fused in (T = 1): the input is the f32 residual row
             ("norm+qkv", 960, D, 4, "norm_f16"), ("norm+gate_up", 2 * FFN, D, 4, "norm_swiglu"),
             ("norm+lm_head", VOCAB, D, 8, "norm_f32"),
             ("norm+lm_head+argmax", VOCAB, D, 8, "norm_argmax")]
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
                    vops.head_argmax_launch(vops._info(w), x32, nw, 1e-5, out32, 0)
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
                    dev_id = int(cupy.asnumpy(cupy.ndarray(
                        (1,), cupy.int32, cupy.cuda.MemoryPointer(
                            cupy.cuda.UnownedMemory(vops._id_dev, 4, vops), 0)))[0])
                    row["argmax_ok"] = dev_id == int(np.argmax(got))
            info = vops._info(one)
            row[vname] = {"us": us, "GBps": nbytes / us / 1e3,
                          "frac_copy": nbytes / us / 1e3 / copy_gbs, "max_err_rel_rms": err,
                          "lpr": getattr(info, "lpr", None),
                          "host_us": host_us(run, 300)}
        gemv[name] = row
    res["gemv"] = gemv

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

    # --- attention -------------------------------------------------------------------------------
    qkv = cupy.asarray(rng.standard_normal((t, (H + 2 * HKV) * HD)).astype(np.float16))
    kc = cupy.asarray(rng.standard_normal((t + 1, HKV, HD)).astype(np.float16))
    vc = cupy.asarray(rng.standard_normal((t + 1, HKV, HD)).astype(np.float16))
    att = cupy.empty((t, H * HD), cupy.float16)
    main_h = cupy.ones((4, D), cupy.float32)
    norm_h = cupy.ones(D, cupy.float32)
    n1 = cupy.empty((1, D), cupy.float16)
    ms_pf = gpu_ms(lambda: ops.attention(qkv, kc, vc, 0, H, HKV, HD, att), reps=20)
    pairs = H * t * (t + 1) / 2
    res["attn_prefill"] = {"T": t, "ms": ms_pf, "TFLOPs": 4 * HD * pairs / ms_pf / 1e9}
    us_dc = graph_us(lambda: ops.attention(qkv[:1], kc, vc, t, H, HKV, HD, att[:1]))
    ms_dc = us_dc / 1e3
    res["attn_decode"] = {"ctx": t + 1, "us": us_dc,
                          "GBps": 2 * (t + 1) * HKV * HD * 2 * (H // HKV) / ms_dc / 1e6}
    # host cost of one wrapper call vs the bare CuPy launch of the same kernel
    w_small = rand_qw(rng, 960, D)
    x1 = cupy.asarray(rng.standard_normal((1, D)).astype(np.float16))
    o1 = cupy.empty((1, 960), cupy.float16)
    info = ops._info(w_small)
    raw_args = (*info.args, x1.data.ptr, 960, D, 0, 5, o1.data.ptr)
    res["host_us"] = {
        "linear_T1": host_us(lambda: ops.linear(x1, w_small, o1)),
        "bare_cupy_launch": host_us(lambda: info.gemv["f16"]((120,), (256,), raw_args)),
        "rmsnorm_T1": host_us(lambda: ops.rmsnorm(main_h[:1], norm_h, 1e-5, n1)),
        "rmsnorm_linear_T1": host_us(lambda: ops.rmsnorm_linear(main_h[:1], norm_h, 1e-5,
                                                                w_small, o1, n1)),
        "attention_T1": host_us(lambda: ops.attention(qkv[:1], kc, vc, 100, H, HKV, HD,
                                                       att[:1])),
    }

    # --- a 30-layer synthetic stack: prefill 2048 and decode -------------------------------------
    layers = [dict(qkv=rand_qw(rng, 960, D), wo=rand_qw(rng, D, D), gu=rand_qw(rng, 2 * FFN, D),
                   down=rand_qw(rng, D, FFN)) for _ in range(LAYERS)]
    head = rand_qw(rng, VOCAB, D, 8)
    norm_w = cupy.ones(D, cupy.float32)
    cap = t + 64
    kcs = [cupy.zeros((cap, HKV, HD), cupy.float16) for _ in range(LAYERS)]
    vcs = [cupy.zeros((cap, HKV, HD), cupy.float16) for _ in range(LAYERS)]
    main_ = cupy.asarray((rng.standard_normal((cap, D)) * 0.1).astype(np.float32))
    norm = cupy.empty((t, D), cupy.float16)
    s1 = cupy.empty((t, 2 * FFN), cupy.float16)
    ad = cupy.empty((t, FFN), cupy.float16)
    logits = cupy.empty((1, VOCAB), cupy.float32)

    def rows(buf, tt, cols):                      # a [tt, cols] view of a flat buffer
        return buf.reshape(-1)[:tt * cols].reshape(tt, cols)

    def forward(pos0, tt, o=ops):
        x = main_[pos0:pos0 + tt]
        nb, q = norm[:tt], rows(s1, tt, 960)
        a_, h = rows(ad, tt, D), rows(ad, tt, FFN)
        for li, lw in enumerate(layers):   # as tinyloop.model: RMSNorm fused at T = 1
            o.rmsnorm_linear(x, norm_w, 1e-5, lw["qkv"], q, nb)
            o.rope_kv(q, pos0, 1e4, H, HKV, HD, kcs[li], vcs[li])
            o.attention(q, kcs[li], vcs[li], pos0, H, HKV, HD, a_)
            o.linear_residual(a_, lw["wo"], x)
            o.rmsnorm_linear_swiglu(x, norm_w, 1e-5, lw["gu"], rows(s1, tt, 2 * FFN), h, nb)
            o.linear_residual(h, lw["down"], x)

    def prefill():
        forward(0, t)
    ms_prefill = gpu_ms(prefill, reps=5, warmup=1)
    res["stack_prefill_2048"] = {"ms": ms_prefill, "tok_per_s": t / ms_prefill * 1e3}

    # decode at context ~args.ctx: v1 (head, then the 1-block argmax kernel) against v2 (the
    # fused head + two-stage argmax); host wall clock per token (eager, launch-bound), the
    # per-kernel GPU table (launches queued back to back) and the step as one CUDA graph
    ctx0 = min(args.ctx, cap - 64)
    stack, tables = {}, {}
    for vname in ("v1", "v2"):
        o = variants[vname]
        fused = vname == "v2"

        def decode_token(pos, o=o, fused=fused):
            forward(pos, 1, o)
            xr = main_[pos:pos + 1]
            if fused:
                return o.rmsnorm_lm_head_sample(xr, norm_w, 1e-5, head, logits, norm[:1], 0.0,
                                                0, 1.0, 0.0)
            o.rmsnorm_lm_head(xr, norm_w, 1e-5, head, logits, norm[:1])
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

        def body(o=o, fused=fused):
            forward(pos_g, 1, o)
            xr = main_[pos_g:pos_g + 1]
            if fused:
                o.head_argmax_launch(o._info(head), xr, norm_w, 1e-5, logits, o._id_ptr)
            else:
                o.rmsnorm_lm_head(xr, norm_w, 1e-5, head, logits, norm[:1])
                o._fn("sample", "argmax_f32")((1,), (1024,), (logits.data.ptr, VOCAB, o._id_ptr))
        graph_tok_us = graph_us(body, n=1)
        tables[vname] = per_kernel_table(o, layers, head, norm_w, kcs, vcs, main_,
                                         (norm[:1], rows(s1, 1, 960), rows(ad, 1, D),
                                          rows(ad, 1, FFN), logits), ctx0 + 61, copy_gbs)
        eager_gpu = sum(v["us_step"] for v in tables[vname].values())
        stack[vname] = {"ms_per_token_wall": statistics.median(times) * 1e3,
                        "ms_per_token_wall_min": min(times) * 1e3,
                        "ms_per_token_wall_max": max(times) * 1e3,
                        "tok_per_s_wall": 1 / statistics.median(times),
                        "launches_per_token": LAYERS * 6 + (1 if fused else 2),
                        "eager_gpu_us_per_token": eager_gpu,
                        "graph_gpu_us_per_token": graph_tok_us,
                        "graph_tok_per_s_bound": 1e6 / graph_tok_us}
    res["stack_decode"] = stack
    res["decode_kernel_table"] = tables

    # --- sampling at temperature > 0 over a 49,152 logit row: device sampler vs CuPy sort ------
    lg = cupy.asarray((rng.standard_normal(VOCAB) * 3).astype(np.float32))
    samp = {}
    for cfg in ((0.8, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9), (0.7, 50, 0.95)):
        row = {}
        for how in ("device", "cupy"):
            ops.device_sampling = how == "device"
            try:
                row[f"{how}_wall_us"] = host_us(lambda: ops.sample(lg, *cfg, 0.37), 200)
                row[f"{how}_id"] = ops.sample(lg, *cfg, 0.37)
            finally:
                ops.device_sampling = True
        row["gpu_us"] = graph_us(lambda: ops.sample_launch(lg, *cfg, 0.37, 0), n=10)
        samp["T={} top_k={} top_p={}".format(*cfg)] = row
    res["sample_nongreedy"] = samp

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
            json.dump(res, f, indent=1)

    print(f"\n== bench_kernels on {res['device']}; copy {copy_gbs:.0f} GB/s (read+write)")
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
    print(f"{'GEMM (T=2048)':<14}{'N x K':>14}{'ms':>9}{'TFLOP/s':>9}{'cuBLAS ms':>11}{'TFLOP/s':>9}")
    for k_, v in gemm.items():
        print(f"{k_:<14}{'x'.join(map(str, v['shape'][1:])):>14}{v['ms']:>9.3f}{v['TFLOPs']:>9.1f}"
              f"{v['ms_fp16_cublas']:>11.3f}{v['TFLOPs_fp16_cublas']:>9.1f}")
    print(f"attention prefill T=2048: {ms_pf:.3f} ms ({res['attn_prefill']['TFLOPs']:.1f} TFLOP/s);"
          f" decode ctx={t + 1}: {us_dc:.1f} us")
    print("host us per call: " + ", ".join(f"{k_} {v:.1f}" for k_, v in res["host_us"].items()))
    print(f"30-layer stack: prefill 2048 = {ms_prefill:.1f} ms ({t / ms_prefill * 1e3:.0f} tok/s)")
    for vname, tab in tables.items():
        print_kernel_table(f"one decode step, GEMV {vname}, ctx {ctx0 + 62}", tab, copy_gbs)
    print("\nsampling (temperature > 0, 49,152 logits): device sampler vs the CuPy sort path")
    for k_, v in samp.items():
        print(f"  {k_:<26} device {v['device_wall_us']:8.1f} us wall ({v['gpu_us']:.1f} us GPU)"
              f"   cupy {v['cupy_wall_us']:8.1f} us wall   same id: "
              f"{v['device_id'] == v['cupy_id']}")
    print(f"\n30-layer decode step + head + greedy pick, ctx ~{ctx0}:")
    print(f"{'GEMV':<6}{'eager wall ms/tok (min-max)':>30}{'tok/s':>8}{'eager GPU us':>14}"
          f"{'graph GPU us':>14}{'graph tok/s bound':>19}{'launches':>10}")
    for vname, v in stack.items():
        print(f"{vname:<6}{v['ms_per_token_wall']:>12.3f} ({v['ms_per_token_wall_min']:.3f}-"
              f"{v['ms_per_token_wall_max']:.3f}){'':>2}{v['tok_per_s_wall']:>8.0f}"
              f"{v['eager_gpu_us_per_token']:>14.1f}{v['graph_gpu_us_per_token']:>14.1f}"
              f"{v['graph_tok_per_s_bound']:>19.0f}{v['launches_per_token']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
