"""Kernel micro-benchmarks of the CUDA backend at SmolLM2-135M's dims (a script, not a test).

    python benchmarks/bench_kernels.py [--out DIR]

Times (CUDA events, median of repeats after warm-up, GPU time per launch):
  - the device-to-device copy bandwidth (bytes read + written), the ceiling for the GEMVs;
  - decode GEMVs (T = 1) for each layer matrix, the LM head and one large matrix, as GB/s of
    weight bytes (codes + scales + zeros) against that ceiling, and the RMSNorm-fused ones
    (rmsnorm_linear / _swiglu / rmsnorm_lm_head at T = 1: the f32 residual row in);
  - prefill GEMMs (T = 2048) for each layer matrix, as TFLOP/s, with and without the FP16 cache
    (cuBLAS); prefill and decode attention;
  - one whole synthetic layer stack (30 layers) for a 2048-token prefill, and host wall clock
    per decode token through 30 layers + head + greedy sample (plain launches).
Prints a table last; with --out writes bench_kernels.json there.
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
from tinyloop.quant import QuantWeight  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
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

    # --- decode GEMVs -------------------------------------------------------------------------
    gemv = {}
    cases = [("qkv", 960, D, 4, "f16"), ("wo", D, D, 4, "resid"), ("gate_up", 2 * FFN, D, 4, "swiglu"),
             ("down", D, FFN, 4, "resid"), ("lm_head", VOCAB, D, 8, "f32"),
             ("big_q4", 16384, 8192, 4, "f16"), ("big_q8", 8192, 8192, 8, "f16"),
             # RMSNorm fused in (T = 1): the input is the f32 residual row
             ("norm+qkv", 960, D, 4, "norm_f16"), ("norm+gate_up", 2 * FFN, D, 4, "norm_swiglu"),
             ("norm+lm_head", VOCAB, D, 8, "norm_f32")]
    for name, nout, k, bits, epi in cases:
        # several copies so small matrices are not timed out of L2 alone
        copies = max(1, int(256e6 // (nout * k)))
        ws = [rand_qw(rng, nout, k, bits) for _ in range(min(copies, 8))]
        x = cupy.asarray(rng.standard_normal((1, k)).astype(np.float16))
        x32 = cupy.asarray(rng.standard_normal((1, k)).astype(np.float32))
        nw = cupy.ones(k, cupy.float32)
        out16 = cupy.empty((1, nout // 2 if epi.endswith("swiglu") else nout), cupy.float16)
        out32 = cupy.zeros((1, nout), cupy.float32)
        state = {"i": 0}

        def run():
            w = ws[state["i"] % len(ws)]
            state["i"] += 1
            if epi == "f16":
                ops.linear(x, w, out16)
            elif epi == "resid":
                ops.linear_residual(x, w, out32)
            elif epi == "swiglu":
                ops.linear_swiglu(x, w, None, out16)
            elif epi == "norm_f16":
                ops.rmsnorm_linear(x32, nw, 1e-5, w, out16, None)
            elif epi == "norm_swiglu":
                ops.rmsnorm_linear_swiglu(x32, nw, 1e-5, w, None, out16, None)
            elif epi == "norm_f32":
                ops.rmsnorm_lm_head(x32, nw, 1e-5, w, out32, None)
            else:
                ops.lm_head(x, w, out32)
        us = graph_us(run, n=max(8, len(ws)))
        nbytes = ws[0].nbytes + x.nbytes
        gemv[name] = {"shape": [nout, k], "bits": bits, "us": us, "host_us": host_us(run, 1000),
                      "GBps": nbytes / us / 1e3, "frac_copy": nbytes / us / 1e3 / copy_gbs}
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

    def forward(pos0, tt):
        x = main_[pos0:pos0 + tt]
        nb, q = norm[:tt], rows(s1, tt, 960)
        a_, h = rows(ad, tt, D), rows(ad, tt, FFN)
        for li, lw in enumerate(layers):   # as tinyloop.model: RMSNorm fused at T = 1
            ops.rmsnorm_linear(x, norm_w, 1e-5, lw["qkv"], q, nb)
            ops.rope_kv(q, pos0, 1e4, H, HKV, HD, kcs[li], vcs[li])
            ops.attention(q, kcs[li], vcs[li], pos0, H, HKV, HD, a_)
            ops.linear_residual(a_, lw["wo"], x)
            ops.rmsnorm_linear_swiglu(x, norm_w, 1e-5, lw["gu"], rows(s1, tt, 2 * FFN), h, nb)
            ops.linear_residual(h, lw["down"], x)

    def prefill():
        forward(0, t)
    ms_prefill = gpu_ms(prefill, reps=5, warmup=1)
    res["stack_prefill_2048"] = {"ms": ms_prefill, "tok_per_s": t / ms_prefill * 1e3}

    def decode_token(pos):
        forward(pos, 1)
        ops.rmsnorm_lm_head(main_[pos:pos + 1], norm_w, 1e-5, head, logits, norm[:1])
        return ops.sample(logits, 0.0, 0, 1.0, 0.0)
    for p in range(t, t + 3):
        decode_token(p)
    times = []
    for rep in range(3):
        t0 = time.perf_counter()
        for p in range(t, t + 50):
            decode_token(p)
        times.append((time.perf_counter() - t0) / 50)
    per_tok = statistics.median(times)
    # the same 30 layers + head as one CUDA graph (a preview of graph capture: GPU time only)
    pos_g = t + 60

    def body():
        forward(pos_g, 1)
        ops.rmsnorm_lm_head(main_[pos_g:pos_g + 1], norm_w, 1e-5, head, logits, norm[:1])
    graph_tok_us = graph_us(body, n=1)
    res["stack_decode"] = {"ms_per_token": per_tok * 1e3, "tok_per_s": 1 / per_tok,
                           "launches_per_token": LAYERS * 6 + 2,
                           "graph_ms_per_token": graph_tok_us / 1e3}

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
            json.dump(res, f, indent=1)

    print(f"\n== bench_kernels on {res['device']}; copy {copy_gbs:.0f} GB/s (read+write)")
    print(f"{'GEMV (T=1)':<14}{'shape':>14}{'bits':>5}{'GPU us':>9}{'GB/s':>8}{'% copy':>8}"
          f"{'host us':>9}")
    for k_, v in gemv.items():
        print(f"{k_:<14}{'x'.join(map(str, v['shape'])):>14}{v['bits']:>5}{v['us']:>9.2f}"
              f"{v['GBps']:>8.0f}{100 * v['frac_copy']:>7.0f}%{v['host_us']:>9.1f}")
    print(f"{'GEMM (T=2048)':<14}{'N x K':>14}{'ms':>9}{'TFLOP/s':>9}{'cuBLAS ms':>11}{'TFLOP/s':>9}")
    for k_, v in gemm.items():
        print(f"{k_:<14}{'x'.join(map(str, v['shape'][1:])):>14}{v['ms']:>9.3f}{v['TFLOPs']:>9.1f}"
              f"{v['ms_fp16_cublas']:>11.3f}{v['TFLOPs_fp16_cublas']:>9.1f}")
    print(f"attention prefill T=2048: {ms_pf:.3f} ms ({res['attn_prefill']['TFLOPs']:.1f} TFLOP/s);"
          f" decode ctx={t + 1}: {us_dc:.1f} us")
    print("host us per call: " + ", ".join(f"{k_} {v:.1f}" for k_, v in res["host_us"].items()))
    print(f"30-layer stack: prefill 2048 = {ms_prefill:.1f} ms ({t / ms_prefill * 1e3:.0f} tok/s);"
          f" decode = {per_tok * 1e3:.2f} ms/token = {1 / per_tok:.0f} tok/s (plain launches;"
          f" ctx ~2100; as one CUDA graph {graph_tok_us / 1e3:.2f} ms GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
