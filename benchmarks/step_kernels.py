"""Where one captured decode step's time goes: per kernel, whole step, and the host's share.

    python -m benchmarks step_kernels [--model PATH|default|synthetic] [--depths 1] [--ctx 64]
                                      [--pdl 0,1] [--table-depths D] [--kv-mode fp16]
                                      [--sampling greedy|top_p|min_p_penalty|all]
                                      [--no-replay] [--cprofile]

The one decode-step profiler. For each depth and each ``--pdl`` setting
(``KernelChoice.pdl``: programmatic dependent launch in the capture):
  - per kernel (at ``--table-depths``, default the same depths): records every kernel launch
    of one decode step (the eager step that precedes a capture, with its real arguments;
    ``--sampling`` picks the step's sampler: greedy, or one of ``SAMPLING``'s device-sampled
    settings, whose window of recent tokens is the context's last 64), groups the launches
    by kernel, and captures each group alone as a graph (its launches in step order): the
    graph's replay time (CUDA events, median of 20 replays after 5) divided by the group's
    launches is that kernel's cost inside a captured step, launch gap included. A table:
    kernel, launches per step, µs per launch, µs per step, the bytes a launch must read (its
    weight's codes + scales + zeros, or the attention's K / V for the context) and the GB/s
    that gives, and the sum against the whole step's replay;
  - unless --no-replay, one line ``depth D pdl P: generate ... | replay ... | host ...``:
    decode tokens/s of greedy ``generate`` (median of 5 runs of 128 tokens after a warm-up),
    the model's own captured step launched 200 times back to back with no host
    synchronisation between replays (CUDA events around the batch; median of 5 batches) as
    GPU µs per step, and the difference per token (the host's reaction, Python and launch).
With --cprofile, cProfile's top functions by own time over one greedy generation per depth.
The isolated per-kernel replays rewrite the model's scratch with stale inputs: the tables come
last and the model is freed after. With --out, writes step_kernels.json there.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys

import numpy as np

import tinyloop
from tinyloop.backends.base import STEP_ID, STEP_POS, STEP_WORDS
from tinyloop.graphs import decode_graphs, decode_step
from tinyloop.quant import QuantWeight

from .common import (add_model_arg, gpu_time_us, model_label, model_path, record_launches,
                     write_json)

REPLAYS = 200
# --sampling: (temperature, top_k, top_p, min_p, repetition_penalty), bench_decode's rows
SAMPLING = {"greedy": (0.0, 0, 1.0, 0.0, 1.0), "top_p": (0.8, 0, 0.9, 0.0, 1.0),
            "min_p_penalty": (0.8, 0, 0.9, 0.05, 1.1), "all": (0.8, 40, 0.9, 0.05, 1.1)}
WINDOW = 64         # the penalty's window of recent tokens (repeat_last_n)


def record_step(model, depth: int, ctx: int, cache, sampling: str = "greedy") -> list:
    """The launches (kernel, grid, block, args, shared_mem) of one eager decode step of token
    11 at position ``ctx`` (the prompt ``prompt_ids(ctx)`` before it), sampled as
    ``SAMPLING[sampling]`` says (u = 0.37)."""
    t, k, p, mp, pen = SAMPLING[sampling]
    recent = None
    if pen != 1.0:       # the window ends with the step's own token
        recent = np.append(prompt_ids(ctx)[max(0, ctx + 1 - WINDOW):], 11).astype(np.int32)
    # the key's first step runs eagerly
    return record_launches(lambda: decode_step(model, cache, 11, ctx, t, k, p, 0.37, mp, pen,
                                               recent, WINDOW if pen != 1.0 else 0))


def prompt_ids(ctx: int) -> np.ndarray:
    """The ``ctx`` prompt ids the tables' step follows."""
    return np.arange(10, 10 + ctx, dtype=np.int32)


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
        return gpu_time_us(lambda: ops.graph_launch(graph), reps=reps, warmup=5,
                           setup=reset).median
    finally:
        ops.graph_free(graph)


def weight_bytes(model) -> dict:
    """Device address of each quantized weight's codes -> (bytes of codes + scales + zeros,
    rows): what a launch reading that weight streams (an embedding lookup reads one row)."""
    out = {}
    for w in model.quant_weights().values():
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
               out=sys.stdout, sampling: str = "greedy") -> list:
    """Per-kernel GPU time of one captured decode step at ``depth`` after ``ctx`` tokens
    (sampled as ``SAMPLING[sampling]``), printed to ``out`` per PDL setting (comma list) and
    returned as dicts (pdl, depth, ctx, sampling, whole_us, sum_us, rows: kernel, launches,
    us_per_launch, us_per_step, bytes_per_launch, GBps). The replays rewrite the model's
    decode scratch with stale inputs: free the model after."""
    ops = model.ops
    results = []
    with model.lock, model.new_kv_cache(depth, ctx + 64, kv_mode=kv_mode) as cache:
        decode_graphs(model).release()       # so the step below runs eagerly (a key's first)
        model.forward(prompt_ids(ctx), 0, depth, cache)
        rec = record_step(model, depth, ctx, cache, sampling)
        kv_per_pos = cache.slot(0).layout.bytes_per_token
        wbytes = weight_bytes(model)
        state = np.zeros(STEP_WORDS, np.int32)
        state[STEP_ID], state[STEP_POS] = 11, ctx

        def reset():
            ops.from_host(state, decode_graphs(model).step_state)
        groups = collections.OrderedDict()
        for r in rec:
            groups.setdefault(group_key(r[0].name, r[3]), []).append(r)
        old = ops.kernels
        try:
            for p in pdl.split(","):
                ops.kernels = dataclasses.replace(old, pdl=p == "1")
                whole = graph_us(ops, rec, reset)
                print(f"\n== depth {depth}, ctx {ctx}, {sampling}, PDL {p}: {len(rec)} "
                      f"launches, whole step {whole:.1f} us", file=out)
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
                results.append({"pdl": p, "depth": depth, "ctx": ctx, "sampling": sampling,
                                "whole_us": whole, "sum_us": total, "rows": rows})
        finally:
            ops.kernels = old
    return results


def replay_us(model, depth: int, ctx: int, kv_mode=None) -> float:
    """GPU µs per replay of the depth's captured step, REPLAYS back to back from ``ctx``
    (median of 5 batches), over a cache in ``kv_mode`` (None: the model's)."""
    g = decode_graphs(model)
    prompt = prompt_ids(ctx)
    cap = ctx + 5 * REPLAYS + 8
    with model.lock, model.new_kv_cache(depth, cap, kv_mode=kv_mode) as cache:
        model.forward(prompt, 0, depth, cache)
        tok, pos = 11, ctx
        for _ in range(3):                      # eager, capture, one replay
            tok = decode_step(model, cache, tok, pos, 0.0)
            pos += 1
        graph = g.captured(cache)
        if graph is None:
            raise RuntimeError("the decode step was not captured (graphs off, or a KV mode "
                               "the captured step does not run)")
        ops = model.ops

        def batch():
            for _ in range(REPLAYS):
                ops.graph_launch(graph)
        try:
            us = gpu_time_us(batch, reps=5, warmup=0).median / REPLAYS
        finally:
            g.forget_device_state()             # the device state ran ahead of the host's
    return us


def generate_vs_replay(model, depth: int, ctx: int, kv_mode=None) -> dict:
    """Greedy ``generate`` tokens/s against the captured step's back-to-back replay at
    ``depth`` after ``ctx`` tokens, both in ``kv_mode`` (None: the model's); ``host_us``: the
    difference per token."""
    prompt = list(range(10, 10 + ctx))
    for _ in range(3):
        model.generate(prompt, max_new_tokens=64, depth=depth, kv_mode=kv_mode)
    tps = statistics.median(model.generate(prompt, max_new_tokens=128, depth=depth,
                                           kv_mode=kv_mode).decode_tokens_per_s
                            for _ in range(5))
    us = replay_us(model, depth, ctx, kv_mode)
    return {"generate_tokens_per_s": tps, "replay_us": us, "replay_tokens_per_s": 1e6 / us,
            "host_us": 1e6 / tps - us}


def cprofile_generate(model, depth: int, tokens: int = 128, top: int = 22) -> None:
    """cProfile's ``top`` functions by own time over one greedy generation."""
    import cProfile
    import pstats
    prompt = list(range(10, 26))
    model.generate(prompt, max_new_tokens=16, depth=depth)
    prof = cProfile.Profile()
    prof.enable()
    model.generate(prompt, max_new_tokens=tokens, depth=depth)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    add_model_arg(ap)
    ap.add_argument("--depths", default="1", help="comma list of depths")
    ap.add_argument("--ctx", type=int, default=64, help="tokens of context before the step")
    ap.add_argument("--pdl", default="0,1", help="comma list of PDL settings (0, 1)")
    ap.add_argument("--table-depths", default=None,
                    help="comma list of depths of the per-kernel tables (default: --depths)")
    ap.add_argument("--kv-mode", default=None,
                    help="KV storage mode of the replay line and the tables (default: the "
                         "model's)")
    ap.add_argument("--sampling", default="greedy", choices=sorted(SAMPLING),
                    help="the per-kernel tables' sampler (default greedy)")
    ap.add_argument("--no-replay", action="store_true",
                    help="skip the generate / back-to-back replay / host line")
    ap.add_argument("--cprofile", action="store_true",
                    help="also print cProfile's top functions over one generation")
    ap.add_argument("--out", default=None, help="directory for step_kernels.json")
    a = ap.parse_args(argv)
    path = model_path(a.model)
    # room for the tables' step, or for the replays' REPLAYS steps a batch after the context
    need = a.ctx + 64 if a.no_replay else a.ctx + 5 * REPLAYS + 72
    m = tinyloop.load_model(path, max_seq_len=max(2048, need), backend="cuda")
    depths = [int(x) for x in a.depths.split(",")]
    table_depths = depths if a.table_depths is None else \
        [int(x) for x in a.table_depths.split(",")]
    res = {"model": model_label(a.model, path), "replay": {}, "kernels": {}}
    try:
        old = m.ops.kernels
        for d in depths:
            if not a.no_replay:
                for p in a.pdl.split(","):
                    m.ops.kernels = dataclasses.replace(old, pdl=p == "1")
                    try:
                        g = res["replay"][f"depth{d}_pdl{p}"] = generate_vs_replay(
                            m, d, a.ctx, a.kv_mode)
                    finally:
                        m.ops.kernels = old
                    print(f"depth {d} pdl {p}: generate {g['generate_tokens_per_s']:7.1f} tok/s"
                          f" | replay {g['replay_us']:7.1f} us/step "
                          f"({g['replay_tokens_per_s']:7.1f} tok/s) | host "
                          f"{g['host_us']:6.1f} us/token", flush=True)
            if a.cprofile:
                cprofile_generate(m, d)
        res["graphs"] = m.graph_stats()["graphs"]
        print(f"graphs: {res['graphs']} captured")
        for d in table_depths:          # last: the isolated replays leave the scratch stale
            res["kernels"][f"depth{d}"] = step_table(m, d, a.ctx, a.kv_mode, a.pdl,
                                                     sampling=a.sampling)
    finally:
        tinyloop.free_model(m)
    write_json(a.out, "step_kernels.json", res)
    return 0
