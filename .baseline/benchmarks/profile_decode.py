"""Where does a decode step's time go? (a diagnostic script, not a test)

    python benchmarks/profile_decode.py [--model PATH] [--tokens N]

Times, on the CUDA backend, N decode steps three ways: the full generate loop; forward+head
without sampling (no per-token host sync); and forward alone; then prints cProfile's top
functions by own time for the generate loop.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinyloop  # noqa: E402
from bench_decode import model_or_synthetic  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=1)
    a = ap.parse_args(argv)
    path = model_or_synthetic(a.model)
    m = tinyloop.load_model(path, max_seq_len=a.max_seq_len, backend="cuda")
    ops, n = m.ops, a.tokens
    prompt = list(range(10, 26))
    m.generate(prompt, max_new_tokens=16, depth=a.depth)
    t = time.perf_counter()
    r = m.generate(prompt, max_new_tokens=n, depth=a.depth)
    full = (time.perf_counter() - t) / len(r.token_ids)
    print(f"generate: {len(r.token_ids)} tokens, decode_tokens_per_s={r.decode_tokens_per_s:.1f}"
          f", prefill_ms={r.prefill_ms:.2f}, decode_ms={r.decode_ms:.1f}")
    one = np.array([7], np.int32)
    with m.new_kv_cache(1, len(prompt) + n + 1) as cache:
        m.forward(np.array(prompt, np.int32), 0, 1, cache)
        row = m.logit_row()
        ops.synchronize()
        t = time.perf_counter()
        for i in range(n):
            m.forward(one, len(prompt) + i, 1, cache)
            m.head(len(prompt) + i, 1, row)
        ops.synchronize()
        nosync = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for i in range(n):
            m.forward(one, len(prompt) + i, 1, cache)
        ops.synchronize()
        fwd = (time.perf_counter() - t) / n
    prof = cProfile.Profile()
    prof.enable()
    m.generate(prompt, max_new_tokens=n)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    print(f"per token: generate {full * 1e3:.3f} ms ({1 / full:.0f} tok/s); forward+head no "
          f"sync {nosync * 1e3:.3f} ms; forward only {fwd * 1e3:.3f} ms")
    tinyloop.free_model(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
