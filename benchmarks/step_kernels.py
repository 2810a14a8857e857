"""Per-kernel GPU time of one captured decode step (a script, not a test).

    python benchmarks/step_kernels.py [--model PATH] [--depth 1] [--ctx 64] [--pdl 0,1]
                                      [--kv-mode fp16]

Records every kernel launch of one decode step (the eager step that precedes a capture, with
its real arguments), groups the launches by kernel, and captures each group alone as a graph
(its launches in step order, with or without programmatic dependent launch): the graph's
replay time (CUDA events, median of 20 replays after 5) divided by the group's launches is
that kernel's cost inside a captured step, launch gap included. Prints a table per PDL
setting: kernel, launches per step, µs per launch, µs per step, and the sum against the
whole step's replay (benchmarks/graph_replay.py). The isolated replays rewrite the model's
scratch with stale inputs: the model is freed after.
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
    ops = m.ops
    with m.lock, m.new_kv_cache(a.depth, a.ctx + 64, kv_mode=a.kv_mode) as cache:
        m.forward(np.arange(10, 10 + a.ctx, dtype=np.int32), 0, a.depth, cache)
        rec = record_step(m, a.depth, a.ctx, cache)
        state = np.zeros(STEP_WORDS, np.int32)
        state[STEP_ID], state[STEP_POS] = 11, a.ctx

        def reset():
            ops.from_host(state, m.decode_graphs.step_state)
        groups = collections.OrderedDict()
        for r in rec:
            groups.setdefault(group_key(r[0].name, r[3]), []).append(r)
        for p in a.pdl.split(","):
            os.environ["TINYLOOP_PDL"] = p
            whole = graph_us(ops, rec, reset)
            print(f"\n== depth {a.depth}, ctx {a.ctx}, PDL {p}: {len(rec)} launches, whole step "
                  f"{whole:.1f} us")
            print(f"{'kernel':52s} {'n':>4s} {'us/launch':>10s} {'us/step':>9s}")
            total = 0.0
            for key, launches in groups.items():
                us = graph_us(ops, launches, reset)
                total += us
                print(f"{key:52s} {len(launches):4d} {us / len(launches):10.2f} {us:9.1f}")
            print(f"{'sum of the groups':52s} {'':4s} {'':10s} {total:9.1f}")
    tinyloop.free_model(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
