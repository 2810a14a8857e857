"""Decode attention (T = 1) over the paged KV cache: v1 against split-K, GPU µs per launch.

v1 (one block per query head, attention.cu) against split-K (attention_decode.cu), GPU µs per
launch inside a captured graph: SLOTS launches, each over its own KV slot (a decode step's
layers), captured once and replayed (CUDA events around each replay, median of 9 with the
min-max spread, divided by SLOTS), at SmolLM2 dims (9 query heads, 3 KV heads, head dim 64,
pages of 32) for each K/V page mode and context 128, 192, 256, 512, 2048, 2110, 4096, 8000.
Launched one by one from the host instead, each launch costs the host's launch time (tens of
µs), not the kernel's.

The KV pages are one device array per slot cut into page-sized pieces with random contents
(timing only; correctness is tests/kernels/test_kernels_gpu.py::test_decode_split). Also
prints the split count the host rule picks (0 = the single-pass kernel: the "default" column
then times v1) and a "split-K forced" column (at least one split: the crossover check of
DS_SINGLE_PASS_MAX).
One call on the device:  python -m benchmarks bench_attn_decode [--out f.json]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from tinyloop.backends.cuda import CudaOps, KernelChoice
from tinyloop.backends.cuda import attention as cuda_attention
from tinyloop.backends.cuda.attention import decode_splits

from .common import ATTN_H as H, ATTN_HD as HD, ATTN_HKV as HKV, ATTN_PAGE as P
from .common import graph_time_us, random_kv_slot, write_json

CTXS = (128, 192, 256, 512, 2048, 2110, 4096, 8000)   # 192 / 256: DS_SINGLE_PASS_MAX's crossover
SLOTS = 30              # launches per captured graph, one KV slot each (SmolLM2's 30 layers)


def captured_us(attend, slots):
    """GPU µs per launch of ``attend(slot)`` (one attention launch over ``slot``) inside a
    captured graph that runs it once over each of ``slots`` (common.graph_time_us: median,
    min and max of 9 replays)."""
    it = itertools.cycle(slots)
    return graph_time_us(lambda: attend(next(it)), n=len(slots), reps=9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="a .json file or a directory for it")
    args = ap.parse_args(argv)
    import cupy
    rng = np.random.default_rng(0)
    ops = {v: CudaOps(KernelChoice(attn_decode=v)) for v in ("v1", "split")}
    for o in ops.values():
        o.compile_all()
    q = cupy.asarray(rng.standard_normal((1, (H + 2 * HKV) * HD)).astype(np.float16))
    res = {}
    print(f"decode attention, H={H} Hkv={HKV} hd={HD} P={P}: GPU us per launch inside a graph "
          f"of {SLOTS} (min-max)")
    print(f"{'mode':<6}{'ctx':>6}{'splits':>8}{'v1':>20}{'default':>20}{'speedup':>9}"
          f"{'split-K forced':>22}{'v1/forced':>10}")
    for mode in ("fp16", "int8"):
        for ctx in CTXS:
            slots = [random_kv_slot(mode, ctx, rng) for _ in range(SLOTS)]  # (slot, buffer)
            kvs = [kv for kv, _buf in slots]
            row = {"splits": decode_splits(ctx, H, ops["split"].sms)}
            outs = {}
            for v, o in ops.items():
                out = cupy.empty((1, H * HD), cupy.float16)
                row[v] = captured_us(lambda kv, o=o, out=out: o.kv_attention(
                    q, kv, ctx - 1, H, HKV, HD, out), kvs)
                o.kv_attention(q, kvs[0], ctx - 1, H, HKV, HD, out)
                outs[v] = cupy.asnumpy(out).astype(np.float32)
            # split-K even where the rule falls back to single-pass (one split at ctx <= 128):
            # the column that checks DS_SINGLE_PASS_MAX
            rule = cuda_attention.decode_splits
            cuda_attention.decode_splits = lambda c, h, s: max(1, rule(c, h, s))
            try:
                out = cupy.empty((1, H * HD), cupy.float16)
                row["forced"] = captured_us(lambda kv, out=out: ops["split"].kv_attention(
                    q, kv, ctx - 1, H, HKV, HD, out), kvs)
            finally:
                cuda_attention.decode_splits = rule
            row["max_abs_diff_v1_split"] = float(np.abs(outs["v1"] - outs["split"]).max())
            res[f"{mode}/{ctx}"] = row
            f = lambda t: f"{t[0]:7.2f} ({t[1]:.2f}-{t[2]:.2f})"   # noqa: E731
            print(f"{mode:<6}{ctx:>6}{row['splits']:>8}{f(row['v1']):>20}{f(row['split']):>20}"
                  f"{row['v1'][0] / row['split'][0]:>8.2f}x{f(row['forced']):>22}"
                  f"{row['v1'][0] / row['forced'][0]:>9.2f}x  |v1-split|max "
                  f"{row['max_abs_diff_v1_split']:.1e}")
    write_json(args.out, "attn_decode.json", res)
    return 0
