"""Where a captured decode step's time goes: GPU time of the graph replayed back to back
against the per-token time of ``generate`` (a script, not a test).

    python benchmarks/graph_replay.py [--model PATH] [--depths 1,4] [--pdl 0,1] [--ctx 64]

For each depth and each ``TINYLOOP_PDL`` setting (programmatic dependent launch in the
capture; the graph key holds the setting, so both live in one model):
  - ``generate``: decode tokens/s of greedy generation (median of 5 runs of 128 tokens after
    a warm-up), i.e. the graph replay plus the host's share per token;
  - ``replay``: the same graph launched 200 times back to back with no host synchronisation
    between replays (CUDA events around the batch; median of 5 batches): GPU microseconds per
    step, and the tokens/s that would give;
  - ``host``: the difference per token (the host's reaction, Python and the launch).
Greedy, megakernel off. Without --model a synthetic SmolLM2-135M-dims model is written
(bench_decode.smollm2_like).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["TINYLOOP_MEGAKERNEL"] = "0"
os.environ["TINYLOOP_CUDA_GRAPHS"] = "1"
import tinyloop  # noqa: E402
from bench_decode import model_or_synthetic  # noqa: E402
from gpu_timing import time_us  # noqa: E402

REPLAYS = 200


def replay_us(model, depth: int, ctx: int) -> float:
    """GPU µs per replay of the depth's captured step, REPLAYS back to back from ``ctx``
    (median of 5 batches)."""
    g = model.decode_graphs
    prompt = np.arange(10, 10 + ctx, dtype=np.int32)
    cap = ctx + 5 * REPLAYS + 8
    with model.lock, model.new_kv_cache(depth, cap) as cache:
        model.forward(prompt, 0, depth, cache)
        tok, pos = 11, ctx
        for _ in range(3):                      # eager, capture, one replay
            tok = model.decode_step(cache, tok, pos, 0.0)
            pos += 1
        graph = g._entries[g.key(cache)].graph
        assert graph is not None, "the step was not captured"
        ops = model.ops

        def batch():
            for _ in range(REPLAYS):
                ops.graph_launch(graph)
        us = time_us(batch, reps=5, warmup=0)[0] / REPLAYS
        g._expect = None                        # the device state ran ahead of the host's
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--depths", default="1,4")
    ap.add_argument("--pdl", default="0,1")
    ap.add_argument("--ctx", type=int, default=64)
    a = ap.parse_args(argv)
    path = model_or_synthetic(a.model)
    m = tinyloop.load_model(path, max_seq_len=2048, backend="cuda")
    prompt = list(range(10, 10 + a.ctx))
    rows = []
    for d in [int(x) for x in a.depths.split(",")]:
        for p in a.pdl.split(","):
            os.environ["TINYLOOP_PDL"] = p
            for _ in range(3):
                m.generate(prompt, max_new_tokens=64, depth=d)
            tps = statistics.median(m.generate(prompt, max_new_tokens=128,
                                               depth=d).decode_tokens_per_s for _ in range(5))
            us = replay_us(m, d, a.ctx)
            host = 1e6 / tps - us
            rows.append((d, p, tps, us, 1e6 / us, host))
            print(f"depth {d} pdl {p}: generate {tps:7.1f} tok/s | replay {us:7.1f} us/step "
                  f"({1e6 / us:7.1f} tok/s) | host {host:6.1f} us/token", flush=True)
    print(f"graphs: {m.graph_stats()['graphs']} captured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
