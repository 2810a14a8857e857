"""Benchmark TinyLoop's memory pool against CuPy's MemoryPool (GPU) or bare NumPy (host).

Records one realistic allocation trace of a serving loop, replays it against each allocator and
prints, per allocator: the cost of one alloc+free pair (cold: a fresh allocator; warm: the same
allocator replaying the trace again), and peak reserved / peak allocated bytes on the trace.

The trace: a looped model (d_model 2048, 12 attention slots of kv_dim 256 in fp16, ffn 5632,
vocab 32000) serving requests with log-normal prompt lengths (16..4096 tokens) and 16..256
generated tokens, ``--concurrent`` requests interleaved step by step (so lifetimes overlap and
sizes vary, the case that fragments a cache). Per request: one kv_cache block sized for
prompt + generated tokens; per 512-token prefill chunk: activation scratch and the last row's
logits; per decode step: small scratch and a logits row. Every block is freed.

    python -m benchmarks bench_pool                # cuda if CuPy sees a GPU, else host
    python -m benchmarks bench_pool --device host --requests 200
"""

from __future__ import annotations

import argparse
import math
import random
import time

import numpy as np

from tinyloop.memory import MemoryPool

D_MODEL, KV_DIM, N_SLOTS, FFN, VOCAB, QKV = 2048, 256, 12, 5632, 32000, 2048 + 2 * 256
CHUNK = 512
MiB = 1 << 20


def record_trace(n_requests: int, concurrent: int, seed: int = 0):
    """[("a", id, nbytes, tag) | ("f", id)] for a serving loop; every id is freed."""
    rng = random.Random(seed)
    trace, next_id = [], 0

    def alloc(nbytes, tag):
        nonlocal next_id
        next_id += 1
        trace.append(("a", next_id, int(nbytes), tag))
        return next_id

    def request_steps():
        prompt = int(min(4096, max(16, rng.lognormvariate(math.log(300), 1.0))))
        gen = rng.randint(16, 256)
        kv = alloc(N_SLOTS * 2 * (prompt + gen) * KV_DIM * 2, "kv_cache")   # K and V, fp16
        yield
        for start in range(0, prompt, CHUNK):                               # prefill chunks
            t = min(CHUNK, prompt - start)
            ids = [alloc(t * D_MODEL * 4, "scratch"), alloc(t * QKV * 2, "scratch"),
                   alloc(t * 2 * FFN * 2, "scratch"), alloc(t * FFN * 2, "scratch")]
            ids.append(alloc(VOCAB * 4, "logits"))
            for i in ids:
                trace.append(("f", i))
            yield
        for _ in range(gen):                                                 # decode steps
            ids = [alloc(D_MODEL * 4, "scratch"), alloc(QKV * 2, "scratch"),
                   alloc(2 * FFN * 2, "scratch"), alloc(FFN * 2, "scratch"),
                   alloc(VOCAB * 4, "logits"), alloc(8, "scratch")]
            for i in ids:
                trace.append(("f", i))
            yield
        trace.append(("f", kv))

    pending = [request_steps() for _ in range(n_requests)]
    active = []
    while pending or active:
        while pending and len(active) < concurrent:
            active.append(pending.pop())
        for gen in list(active):
            if next(gen, StopIteration) is StopIteration:
                active.remove(gen)
    return trace


def replay(trace, alloc, free):
    """Run the trace; return seconds."""
    live = {}
    t0 = time.perf_counter()
    for op in trace:
        if op[0] == "a":
            live[op[1]] = alloc(op[2], op[3])
        else:
            free(live.pop(op[1]))
    return time.perf_counter() - t0


def peaks(trace, alloc, free, reserved, allocated):
    """(peak reserved, peak allocated) bytes sampled after every allocation (untimed)."""
    live, peak_r, peak_a = {}, 0, 0
    for op in trace:
        if op[0] == "a":
            live[op[1]] = alloc(op[2], op[3])
            peak_r, peak_a = max(peak_r, reserved()), max(peak_a, allocated())
        else:
            free(live.pop(op[1]))
    return peak_r, peak_a


def bench_tinyloop(trace, device):
    pool = MemoryPool(device)
    alloc, free = pool.allocate, pool.free
    cold = replay(trace, alloc, free)
    warm = replay(trace, alloc, free)
    s = pool.stats()
    out = dict(cold=cold, warm=warm, peak_reserved=s.peak_reserved_bytes,
               peak_allocated=s.peak_allocated_bytes, segments=s.num_segment_allocs)
    pool.empty_cache()
    return out


def bench_cupy(trace):
    import cupy as cp
    mp = cp.cuda.MemoryPool()
    alloc = lambda n, tag: mp.malloc(n)                 # noqa: E731
    free = lambda p: None                               # noqa: E731  dropped pointer = free
    cold = replay(trace, alloc, free)
    warm = replay(trace, alloc, free)
    mp.free_all_blocks()
    mp2 = cp.cuda.MemoryPool()
    peak_r, peak_a = peaks(trace, lambda n, tag: mp2.malloc(n), free,
                           mp2.total_bytes, mp2.used_bytes)
    mp2.free_all_blocks()
    return dict(cold=cold, warm=warm, peak_reserved=peak_r, peak_allocated=peak_a,
                segments=None)


def bench_numpy(trace):
    alloc = lambda n, tag: np.empty(n, np.uint8)       # noqa: E731
    free = lambda a: None                               # noqa: E731
    cold = replay(trace, alloc, free)
    warm = replay(trace, alloc, free)
    live = [0]

    def alloc_count(n, tag):
        live[0] += n
        return n

    def free_count(n):
        live[0] -= n
    peak_r, peak_a = peaks(trace, alloc_count, free_count, lambda: live[0], lambda: live[0])
    return dict(cold=cold, warm=warm, peak_reserved=peak_r, peak_allocated=peak_a,
                segments=None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "host", "cuda"), default="auto")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        from tinyloop.backends import cuda_available
        device = "cuda" if cuda_available() else "host"

    trace = record_trace(args.requests, args.concurrent, args.seed)
    n_alloc = sum(1 for op in trace if op[0] == "a")
    sizes = [op[2] for op in trace if op[0] == "a"]
    live, peak_req = {}, 0
    total = 0
    for op in trace:
        if op[0] == "a":
            live[op[1]] = op[2]
            total += op[2]
            peak_req = max(peak_req, total)
        else:
            total -= live.pop(op[1])
    print(f"trace: {args.requests} requests, {args.concurrent} concurrent, {n_alloc} allocs, "
          f"sizes {min(sizes)} B .. {max(sizes) / MiB:.1f} MiB, "
          f"peak live requested {peak_req / MiB:.1f} MiB")

    rows = [(f"tinyloop MemoryPool ({device})", bench_tinyloop(trace, device))]
    if device == "cuda":
        rows.append(("cupy.cuda.MemoryPool", bench_cupy(trace)))
    else:
        rows.append(("numpy.empty (no pool)", bench_numpy(trace)))
    print(f"{'allocator':<32}{'cold us/pair':>14}{'warm us/pair':>14}{'peak reserved':>16}"
          f"{'peak allocated':>16}{'res/alloc':>11}{'segments':>10}")
    for name, r in rows:
        print(f"{name:<32}{r['cold'] / n_alloc * 1e6:>14.2f}{r['warm'] / n_alloc * 1e6:>14.2f}"
              f"{r['peak_reserved'] / MiB:>12.1f} MiB{r['peak_allocated'] / MiB:>12.1f} MiB"
              f"{r['peak_reserved'] / max(1, r['peak_allocated']):>11.3f}"
              f"{'' if r['segments'] is None else r['segments']:>10}")
    print("us/pair: wall time of one alloc + its free, Python loop included (same loop for "
          "every allocator); peak allocated is after each allocator's rounding")
    return 0
