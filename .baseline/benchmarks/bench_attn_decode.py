"""Decode attention (T = 1) over the paged KV cache: v1 (one block per query head,
attention.cu) against split-K (attention_decode.cu), GPU µs per launch (CUDA events, median of
200 with the 10th-90th percentile spread), at SmolLM2 dims (9 query heads, 3 KV heads, head
dim 64, pages of 32) for each K/V page mode and context 128, 192, 256, 512, 2048, 2110, 4096
(issue 10).

The KV pages are one device array cut into page-sized pieces with random contents (timing only;
correctness is tests/gpu/test_kernels.py::test_decode_split). Also prints the split count the
host rule picks (0 = the single-pass kernel: the "default" column then times v1) and a
"split-K forced" column (at least one split: the crossover check of DS_SINGLE_PASS_MAX).
One call on the device:  python benchmarks/bench_attn_decode.py [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import types

import numpy as np

import cupy

from tinyloop.backends import cuda_ops
from tinyloop.backends.cuda_ops import CudaOps, decode_splits
from tinyloop.kvcache import PageLayout

from gpu_timing import time_us

H, HKV, HD, P = 9, 3, 64, 32
CTXS = (128, 192, 256, 512, 2048, 2110, 4096)   # 192 / 256: DS_SINGLE_PASS_MAX's crossover


def slot(mode: str, ctx: int, rng):
    lay = PageLayout(mode, P, HKV, HD, 576)
    npages = -(-ctx // P)
    pb = -(-lay.page_bytes // 256) * 256
    buf = cupy.asarray(rng.integers(0, 255, npages * pb, dtype=np.uint8))
    if mode == "fp16":      # finite FP16 values: small random halves
        n = npages * pb // 2
        buf.view(cupy.float16)[:] = cupy.asarray(rng.standard_normal(n).astype(np.float16))
    else:                   # int8 codes random; scales 0.01
        for i in range(npages):
            for name in ("k_scale", "v_scale"):
                part = next(p for p in lay.parts if p.name == name)
                o = i * pb + part.offset
                buf[o:o + part.nbytes].view(cupy.float16)[:] = 0.01
    table_host = np.array([buf.data.ptr + i * pb for i in range(npages)], np.int64)
    kv = types.SimpleNamespace(layout=lay, table=cupy.asarray(table_host),
                               table_host=table_host)
    return kv, buf


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ops = {v: CudaOps(attn_decode=v) for v in ("v1", "split")}
    for o in ops.values():
        o.compile_all()
    q = cupy.asarray(rng.standard_normal((1, (H + 2 * HKV) * HD)).astype(np.float16))
    res = {}
    print(f"decode attention, H={H} Hkv={HKV} hd={HD} P={P}: GPU us per call (p10-p90)")
    print(f"{'mode':<6}{'ctx':>6}{'splits':>8}{'v1':>20}{'default':>20}{'speedup':>9}"
          f"{'split-K forced':>22}{'v1/forced':>10}")
    for mode in ("fp16", "int8"):
        for ctx in CTXS:
            kv, _buf = slot(mode, ctx, rng)
            row = {"splits": decode_splits(ctx, H, ops["split"].sms)}
            outs = {}
            for v, o in ops.items():
                out = cupy.empty((1, H * HD), cupy.float16)
                row[v] = time_us(lambda o=o, out=out: o.kv_attention(q, kv, ctx - 1, H, HKV, HD,
                                                                     out))
                outs[v] = cupy.asnumpy(out).astype(np.float32)
            # split-K even where the rule falls back to single-pass (one split at ctx <= 128):
            # the column that checks DS_SINGLE_PASS_MAX
            rule = cuda_ops.decode_splits
            cuda_ops.decode_splits = lambda c, h, s: max(1, rule(c, h, s))
            try:
                out = cupy.empty((1, H * HD), cupy.float16)
                row["forced"] = time_us(lambda out=out: ops["split"].kv_attention(
                    q, kv, ctx - 1, H, HKV, HD, out))
            finally:
                cuda_ops.decode_splits = rule
            row["max_abs_diff_v1_split"] = float(np.abs(outs["v1"] - outs["split"]).max())
            res[f"{mode}/{ctx}"] = row
            f = lambda t: f"{t[0]:7.2f} ({t[1]:.2f}-{t[2]:.2f})"   # noqa: E731
            print(f"{mode:<6}{ctx:>6}{row['splits']:>8}{f(row['v1']):>20}{f(row['split']):>20}"
                  f"{row['v1'][0] / row['split'][0]:>8.2f}x{f(row['forced']):>22}"
                  f"{row['v1'][0] / row['forced'][0]:>9.2f}x  |v1-split|max "
                  f"{row['max_abs_diff_v1_split']:.1e}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
