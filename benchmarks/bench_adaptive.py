"""Adaptive depth and iteration KV policies at the published looped shapes: Ouro-1.4B at
depth="auto" (exit gate) against fixed depth 4, Huginn-0125 at 32 iterations under
kv_iterations "latest" against "all" (a script, not a test).

    python -m benchmarks bench_adaptive [--backend cuda] [--new-tokens 64] [--reps 3]
                                        [--threshold Q] [--huginn-depth 32] [--shrink K]
                                        [--out DIR]

Both models are written with random INT4 weights at the dims of benchmarks/common.py
(``OURO_1_4B``, ``HUGINN_3_5B``; bench_looped.py cites their sources) by
``common.write_random_model``; ``--shrink K`` divides the widths and layer counts for a CPU
smoke run (``--backend numpy``).

Ouro: the gate's threshold (the cumulative exit probability to reach, Ouro's rule:
tinyloop/adaptive.py) is, unless ``--threshold`` gives one, found per iteration KV policy by
bisection on depth="auto" generations (``calibrate``) so that about half the tokens exit by
loop 2. Measured per row over ``--reps``
generations of ``--new-tokens`` tokens after the 16-token prompt: decode tokens/s (median,
min-max), the depths the tokens ran at (mean, histogram), the weight bytes a decode step
reads at that mean (``common.weight_bytes_per_token`` per token) and the KV bytes per token
the request holds. Rows: fixed depth 4 and depth="auto" ("all") with CUDA graphs on and off
(depth="auto" replays its parts: the prelude, each iteration, coda + head), and depth="auto"
under "latest" with graphs.

Huginn: depth ``--huginn-depth`` (32, its mean recurrence) under "all" (a K/V slot per core
layer and iteration, ``P + R*32 + C`` slots) and "latest" (one per core layer: ``P + R + C``):
KV bytes per token and decode tokens/s (graphs on).
Prints a table; with --out writes bench_adaptive.json there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

from .common import (DECODE_PROMPT, HUGINN_3_5B, OURO_1_4B, shrunk, user_setting,
                     weight_bytes_per_token, write_json, write_random_model)


def _generate(model, new_tokens: int, **kw):
    return model.generate(list(DECODE_PROMPT), max_new_tokens=new_tokens, stop=[],
                          ignore_eos=True, **kw)


def _timed(model, new_tokens: int, reps: int, graphs: bool, **kw) -> dict:
    """Median / min / max decode tokens/s of ``reps`` generations (after one untimed), and the
    last one's depths."""
    with user_setting("cuda_graphs", "1" if graphs else "0"):
        _generate(model, new_tokens, **kw)
        runs = [_generate(model, new_tokens, **kw) for _ in range(reps)]
    tps = sorted(r.decode_tokens_per_s for r in runs)
    depths = runs[-1].depths
    return {"decode_tok_s": {"median": statistics.median(tps), "min": tps[0], "max": tps[-1]},
            "depths": depths, "mean_depth": float(sum(depths) / max(1, len(depths))),
            "tokens": len(depths)}


def _write(conf: dict, name: str, shrink: int) -> str:
    if shrink > 1:
        conf = shrunk(conf, shrink)
    path = os.path.join(tempfile.mkdtemp(), f"{name}.tlm")
    t = time.perf_counter()
    write_random_model(conf, path)
    print(f"{name}: wrote {os.path.getsize(path) / 1e9:.2f} GB in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    return path


def exit_share(depths, by: int = 2) -> float:
    """The share of ``depths`` at most ``by``."""
    return sum(d <= by for d in depths) / max(1, len(depths))


def calibrate(model, new_tokens: int, top: int, policy: str, steps: int = 12) -> float:
    """The gate threshold at which about half of one depth="auto" generation's tokens exit by
    loop 2 under ``policy``: bisection over 0..1 (a higher threshold exits later), each step a
    generation of ``new_tokens`` (the exits change the tokens, so the share is measured on
    the auto run itself, not on a run without exits)."""
    lo, hi = 0.0, 1.0
    best = (math.inf, 0.5)
    for _ in range(steps):
        th = (lo + hi) / 2
        r = _generate(model, new_tokens, depth="auto", exit_rule="gate", exit_threshold=th,
                      max_depth=top, kv_iterations=policy)
        share = exit_share(r.depths)
        best = min(best, (abs(share - 0.5), th))
        if share > 0.5:
            lo = th                 # too many exits: raise the threshold
        else:
            hi = th
    return best[1]


def run_ouro(args) -> list:
    import tinyloop
    path = _write(OURO_1_4B, "ouro", args.shrink)
    m = tinyloop.load_model(path, backend=args.backend, max_seq_len=256)
    rows = []
    try:
        top = 4
        th = {pol: (args.threshold if args.threshold is not None
                    else calibrate(m, args.new_tokens, top, pol)) for pol in ("all", "latest")}
        wb = {d: weight_bytes_per_token(m, d) for d in range(1, top + 1)}
        auto = dict(depth="auto", exit_rule="gate", max_depth=top)
        cases = [("fixed 4, graphs", dict(depth=top), True, "all"),
                 ("fixed 4, eager", dict(depth=top), False, "all"),
                 ("auto, all, graphs", dict(auto, exit_threshold=th["all"]), True, "all"),
                 ("auto, all, eager", dict(auto, exit_threshold=th["all"]), False, "all"),
                 ("auto, latest, graphs", dict(auto, exit_threshold=th["latest"]), True,
                  "latest")]
        for label, kw, graphs, policy in cases:
            r = _timed(m, args.new_tokens, args.reps, graphs, kv_iterations=policy, **kw)
            hist = {str(d): r["depths"].count(d) for d in range(1, top + 1)}
            rows.append({"arch": "ouro", "case": label,
                         "threshold": kw.get("exit_threshold"), "kv_iterations": policy,
                         **r, "depth_histogram": hist,
                         "exit_by_loop_2": exit_share(r["depths"]),
                         "weight_bytes_per_token": sum(wb[d] for d in r["depths"])
                         / r["tokens"],
                         "kv_bytes_per_token": m.kv_bytes_per_token(top,
                                                                    kv_iterations=policy)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "depths"}), flush=True)
    finally:
        tinyloop.free_model(m)
        os.remove(path)
    return rows


def run_huginn(args) -> list:
    import tinyloop
    from tinyloop.kv import slot_layers
    path = _write(HUGINN_3_5B, "huginn", args.shrink)
    m = tinyloop.load_model(path, backend=args.backend, max_seq_len=256)
    rows = []
    try:
        depth = min(args.huginn_depth, m.config.max_depth)
        for policy in ("all", "latest"):
            r = _timed(m, args.new_tokens, args.reps, True, depth=depth, kv_iterations=policy)
            rows.append({"arch": "huginn", "case": f"depth {depth}, {policy}",
                         "kv_iterations": policy, "depth": depth,
                         "decode_tok_s": r["decode_tok_s"], "tokens": r["tokens"],
                         "kv_bytes_per_token": m.kv_bytes_per_token(depth,
                                                                    kv_iterations=policy),
                         "kv_slots": len(slot_layers(m.config, depth, policy))})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        tinyloop.free_model(m)
        os.remove(path)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", help="cuda (numpy: a CPU smoke run)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=None,
                    help="Ouro's gate threshold (default: calibrated, see the module doc)")
    ap.add_argument("--huginn-depth", type=int, default=32)
    ap.add_argument("--shrink", type=int, default=1,
                    help="divide layer counts and widths by this (a CPU smoke run)")
    ap.add_argument("--out", default=None, help="folder for bench_adaptive.json")
    args = ap.parse_args(argv)
    rows = run_ouro(args) + run_huginn(args)
    print(f"\n{'arch':7s} {'case':21s} {'tok/s':>8s} {'min-max':>15s} {'mean d':>6s} "
          f"{'exit<=2':>7s} {'MB w/tok':>8s} {'KV B/tok':>10s}")
    for r in rows:
        d = r["decode_tok_s"]
        mean = r.get("mean_depth", r.get("depth"))
        wb = r.get("weight_bytes_per_token")
        share = r.get("exit_by_loop_2")
        print(f"{r['arch']:7s} {r['case']:21s} {d['median']:8.1f} "
              f"{d['min']:7.1f}-{d['max']:<7.1f} {mean:6.2f} "
              f"{'-' if share is None else f'{share:.2f}':>7s} "
              f"{'-' if wb is None else f'{wb / 1e6:.1f}':>8s} {r['kv_bytes_per_token']:10,d}")
    write_json(args.out, "bench_adaptive.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
