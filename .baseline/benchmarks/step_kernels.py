"""Per-kernel GPU time of one captured decode step (a script, not a test).

    python benchmarks/step_kernels.py [--model PATH] [--depth 1] [--ctx 64] [--pdl 0,1]
                                      [--kv-mode fp16]

Records every kernel launch of one decode step (the eager step that precedes a capture, with
its real arguments), groups the launches by kernel, and captures each group alone as a graph
(its launches in step order, with or without programmatic dependent launch): the graph's
replay time (CUDA events, median of 20 replays after 5) divided by the group's launches is
that kernel's cost inside a captured step, launch gap included. Prints a table per PDL
setting: kernel, launches per step, µs per launch, µs per step, the bytes a launch must read
(its weight's codes + scales + zeros, or the attention's K / V for the context) and the GB/s
that gives, and the sum against the whole step's replay (benchmarks/graph_replay.py).
bench_decode.py prints the same table (step_table) for the model it measured. The isolated
replays rewrite the model's scratch with stale inputs: the model is freed after.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["TINYLOOP_MEGAKERNEL"] = "0"
os.environ["TINYLOOP_CUDA_GRAPHS"] = "1"
import tinyloop  # noqa: E402
from tinyloop.backends import cuda_ops  # noqa: E402
from tinyloop.backends.base import STEP_ID, STEP_POS, STEP_WORDS  # noqa: E402
from tinyloop.quant import QuantWeight  # noqa: E402
from bench_decode import model_or_synthetic  # noqa: E402
from gpu_timing import time_us  # noqa: E402


def record_step(model, depth: int, ctx: int, cache) -> list:
    """The launches (kernel, grid, block, args, shared_mem) of one eager decode step."""
    rec = []
    real = cuda_ops._Kernel.__call__

    def spy(self, grid, block, args, shared_mem=0):
        rec.append((self, grid, block, tuple(args), shared_mem))
        return real(self, grid, block, args, shared_mem)
    cuda_ops._Kernel.__call__ = spy
    try:
        model.decode_step(cache, 11, ctx, 0.0)      # the key's first step runs eagerly
    finally:
        cuda_ops._Kernel.__call__ = real
    return rec


def group_key(name: str, args: tuple) -> str:
    """The table row of a launch: its kernel, and for a GEMV (other than the head's argmax)
    also rows x K (the O and down projections run the same kernel); the GEMV launches pass
    (..., rows, K, F, log2 g, out) last."""
    if name.startswith("gemv") and "argmax" not in name:
        return f"{name} {args[-5]}x{args[-4]}"
    return name


def graph_us(ops, launches, reset, reps: int = 20) -> float:
    """Median GPU µs of one replay of ``launches`` captured as a graph; ``reset()`` puts the
    step state back at the recorded position before each replay (the step's last kernel
    advances it: unchecked, replays would run past the request's pages)."""
    ops.graph_begin()
    try:
        for k, grid, block, args, smem in launches:
            k(grid, block, args, smem)
        graph = ops.graph_end()
    except BaseException:
        ops.graph_abort()
        raise
    try:
        return time_us(lambda: ops.graph_launch(graph), reps=reps, warmup=5, setup=reset)[0]
    finally:
        ops.graph_free(graph)


def weight_bytes(model) -> dict:
    """Device address of each quantized weight's codes -> (bytes of codes + scales + zeros,
    rows): what a launch reading that weight streams (an embedding lookup reads one row)."""
    out = {}
    ws = [model._head, model._embed]
    for lw in model._layers:
        ws.extend(w for w in vars(lw).values() if isinstance(w, QuantWeight))
    for w in ws:
        if isinstance(w, QuantWeight):
            out[w.qweight.data.ptr] = (w.qweight.nbytes + w.scales.nbytes + w.zeros.nbytes,
                                       w.shape[0])
    return out


def launch_bytes(name: str, args: tuple, wbytes: dict, kv_per_pos: int, ctx: int) -> int:
    """Bytes one launch must read from memory at least: the weight whose codes it is passed
    (one row for the embedding), or the slot's K / V (and scales) for ctx + 1 keys (the
    decode attention); 0 for the rest (step state, RoPE / K-V writes: a few KB)."""
    if name.startswith("attn_"):
        return kv_per_pos * (ctx + 1)
    for a in args:
        hit = wbytes.get(a) if isinstance(a, int) else None
        if hit is not None:
            return hit[0] // hit[1] if name.startswith("embed") else hit[0]
    return 0


def step_table(model, depth: int = 1, ctx: int = 64, kv_mode=None, pdl: str = "1",
               out=sys.stdout) -> list:
    """Per-kernel GPU time of one captured decode step at ``depth`` after ``ctx`` tokens,
    printed to ``out`` per PDL setting (comma list) and returned as dicts (pdl, whole_us,
    rows: kernel, launches, us_per_launch, us_per_step, bytes_per_launch, GBps). The replays
    rewrite the model's decode scratch with stale inputs: free the model after."""
    ops = model.ops
    results = []
    with model.lock, model.new_kv_cache(depth, ctx + 64, kv_mode=kv_mode) as cache:
        model.decode_graphs.release()       # so the step below runs eagerly (a key's first)
        model.forward(np.arange(10, 10 + ctx, dtype=np.int32), 0, depth, cache)
        rec = record_step(model, depth, ctx, cache)
        kv_per_pos = cache.slot(0).layout.bytes_per_token
        wbytes = weight_bytes(model)
        state = np.zeros(STEP_WORDS, np.int32)
        state[STEP_ID], state[STEP_POS] = 11, ctx

        def reset():
            ops.from_host(state, model.decode_graphs.step_state)
        groups = collections.OrderedDict()
        for r in rec:
            groups.setdefault(group_key(r[0].name, r[3]), []).append(r)
        old = os.environ.get("TINYLOOP_PDL")
        try:
            for p in pdl.split(","):
                os.environ["TINYLOOP_PDL"] = p
                whole = graph_us(ops, rec, reset)
                print(f"\n== depth {depth}, ctx {ctx}, PDL {p}: {len(rec)} launches, whole step "
                      f"{whole:.1f} us", file=out)
                print(f"{'kernel':44s} {'n':>4s} {'us/launch':>10s} {'us/step':>9s} "
                      f"{'KB/launch':>10s} {'GB/s':>7s}", file=out)
                rows, total = [], 0.0
                for key, launches in groups.items():
                    us = graph_us(ops, launches, reset)
                    total += us
                    k0 = launches[0]
                    nb = launch_bytes(k0[0].name, k0[3], wbytes, kv_per_pos, ctx)
                    per = us / len(launches)
                    gbs = nb / per / 1e3 if nb else 0.0
                    rows.append({"kernel": key, "launches": len(launches), "us_per_launch": per,
                                 "us_per_step": us, "bytes_per_launch": nb, "GBps": gbs})
                    print(f"{key:44s} {len(launches):4d} {per:10.2f} {us:9.1f} "
                          f"{nb / 1024:10.1f} {gbs:7.1f}" if nb else
                          f"{key:44s} {len(launches):4d} {per:10.2f} {us:9.1f} "
                          f"{'-':>10s} {'-':>7s}", file=out)
                print(f"{'sum of the groups':44s} {'':4s} {'':10s} {total:9.1f}", file=out)
                results.append({"pdl": p, "depth": depth, "ctx": ctx, "whole_us": whole,
                                "sum_us": total, "rows": rows})
        finally:
            if old is None:
                os.environ.pop("TINYLOOP_PDL", None)
            else:
                os.environ["TINYLOOP_PDL"] = old
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--pdl", default="0,1")
    ap.add_argument("--kv-mode", default=None, help="KV storage mode (default: the model's)")
    a = ap.parse_args(argv)
    path = model_or_synthetic(a.model)
    m = tinyloop.load_model(path, max_seq_len=2048, backend="cuda")
    try:
        step_table(m, a.depth, a.ctx, a.kv_mode, a.pdl)
    finally:
        tinyloop.free_model(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
