"""Prefill attention (T > 1) over the paged KV cache: scalar against FlashAttention-2.

The scalar FP32 kernel (attention.cu) against FlashAttention-2 on tensor cores
(attention_prefill.cu), GPU µs per launch (CUDA events, median of 50 with the min-max
spread) and TFLOP/s, at SmolLM2 dims (9 query heads, 3 KV heads, head dim 64, pages of 32)
for each K/V page mode, T = 512 and 2,048 from position 0 and a 512-token chunk after 1,536
positions.

FLOPs: 4 hd per causal (query, key) pair (2 for Q K^T, 2 for P V), summed over the pairs and
the query heads: H * 4 hd * sum_i (pos0 + i + 1); 4.83 GFLOP per layer at T = 2,048 (half of
that if one counts multiply-adds). The 30-layer column is 30 launches' worth. Pages: one
device array cut into page-sized pieces with random contents (common.random_kv_slot; timing
only: correctness is tests/kernels/test_attn_prefill_gpu.py). Also prints max |mma - scalar|.
One call on the device:  python -m benchmarks bench_attn_prefill [--out f.json]
"""

from __future__ import annotations

import argparse

import numpy as np

from tinyloop.backends.cuda import CudaOps, KernelChoice

from .common import ATTN_H as H, ATTN_HD as HD, ATTN_HKV as HKV, ATTN_PAGE as P
from .common import gpu_time_us, random_kv_slot, write_json

CASES = ((512, 0), (2048, 0), (512, 1536))     # (T, pos0)
LAYERS = 30


def flops(t: int, pos0: int) -> float:
    return H * 4.0 * HD * (t * pos0 + t * (t + 1) / 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="a .json file or a directory for it")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    import cupy
    rng = np.random.default_rng(0)
    ops = {v: CudaOps(KernelChoice(attn_prefill=v)) for v in ("scalar", "mma")}
    for o in ops.values():
        o.compile_all()
    res = {}
    print(f"prefill attention, H={H} Hkv={HKV} hd={HD} P={P}: GPU us per call (min-max), "
          "TFLOP/s at the median")
    print(f"{'mode':<6}{'T':>6}{'pos0':>6}{'scalar':>24}{'mma':>24}{'speedup':>9}"
          f"{'x30 layers (ms)':>18}")
    for mode in ("fp16", "int8"):
        for t, pos0 in CASES:
            kv, _buf = random_kv_slot(mode, pos0 + t, rng)
            q = cupy.asarray(rng.standard_normal((t, (H + 2 * HKV) * HD)).astype(np.float16))
            row = {"gflop": flops(t, pos0) / 1e9}
            outs = {}
            for v, o in ops.items():
                out = cupy.empty((t, H * HD), cupy.float16)
                row[v] = gpu_time_us(lambda o=o, out=out: o.kv_attention(q, kv, pos0, H, HKV, HD,
                                                                     out),
                                 reps=args.reps)
                row[v + "_tflops"] = flops(t, pos0) / (row[v][0] * 1e-6) / 1e12
                outs[v] = cupy.asnumpy(out).astype(np.float32)
            row["max_abs_diff"] = float(np.abs(outs["mma"] - outs["scalar"]).max())
            res[f"{mode}/T{t}/pos0{pos0}"] = row
            f = lambda v: (f"{row[v][0]:8.1f} ({row[v][1]:.0f}-{row[v][2]:.0f}) "   # noqa: E731
                           f"{row[v + '_tflops']:5.1f}")
            print(f"{mode:<6}{t:>6}{pos0:>6}{f('scalar'):>24}{f('mma'):>24}"
                  f"{row['scalar'][0] / row['mma'][0]:>8.2f}x"
                  f"{LAYERS * row['scalar'][0] / 1e3:>8.2f} ->{LAYERS * row['mma'][0] / 1e3:>6.2f}"
                  f"  |mma-scalar|max {row['max_abs_diff']:.1e}")
    write_json(args.out, "attn_prefill.json", res)
    return 0
