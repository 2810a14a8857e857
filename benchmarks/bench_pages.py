"""Host time of KV page allocation: the batched path against the one-page reference (CPU).

Target: a 2,048-token prefill's pages within 15 ms. CPU only: NumPy ops over the host pool.

A 2,048-token prefill of SmolLM2-135M at depth 1 needs ceil(2048 / 32) x 30 = 1,920 pages
(depth 4: 60 slots, 3,840), all allocated on the host before the first kernel of the prefill;
the one-page reference makes one pool allocation, one array view and one memset per page
(figures in docs/kv_modes.md). This benchmark times, per (depth, mode):

- ``RuntimeKVCache.ensure(2048)`` (batched: ``PageAllocator.alloc_many``) against
  ``tests/kv_reference.ensure_one_by_one`` (the reference: ``PageAllocator.alloc`` per page),
  on a warm pool (the segments of an earlier request are cached, the serving steady state) and a cold one (a fresh
  pool: segments are added as pages are carved), and ``release()`` of the batched cache's
  pages (``unref_many`` -> ``MemoryPool.free_many``: neighbours go back as one run);
- with the host memset as it is (it writes the bytes: real memory traffic on the host, unlike
  CUDA's asynchronous cudaMemsetAsync) and with zeroing stubbed out to a counter, which is the
  host cost the CUDA backend sees (plus one launch per counted memset);
- the pool alone: ``MemoryPool.allocate_many`` / ``free_many`` of 1,920 page-sized blocks
  against 1,920 ``allocate`` / ``free`` calls.

Pages use the CUDA page size (float16 K/V: 24,576 B for fp16 at SmolLM2's dims). Each figure is
the median of ``--repeats`` runs with its min-max spread, in ms (on a shared host the
minimum is the steadier figure).

    python -m benchmarks bench_pages                 # SmolLM2-135M's dims
    python -m benchmarks bench_pages --repeats 31 --tokens 512
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tests.kv_reference import ensure_one_by_one
from tinyloop.backends.numpy_ops import NumpyOps
from tinyloop.config import ModelConfig
from tinyloop.kv import PageAllocator, PageLayout, RuntimeKVCache
from tinyloop.memory import MemoryPool, packed_scope

from .common import spread

# SmolLM2-135M's dims (the converted model's header says the same; read without loading it)
SMOL = ModelConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                   ffn_dim=1536, n_prelude=10, n_recurrent=10, n_coda=10, max_depth=8)


class HostOps16(NumpyOps):
    """NumPy ops with the CUDA backend's float16 KV pages (the page size the H200 allocates)."""
    kv_dtype = np.float16


class StubZeroOps(HostOps16):
    """Zeroing replaced by a counter of memset calls: the host cost CUDA's async memset has."""

    def __init__(self):
        self.memsets = 0

    def zero(self, arr) -> None:
        self.memsets += 1

    def zero_ranges(self, ranges) -> None:
        self.memsets += len(ranges)


def _stat(ts) -> str:
    t = spread(x * 1e3 for x in ts)
    return f"{t.median:8.2f} [{t.min:.2f}-{t.max:.2f}]"


def bench_ensure(ops, cfg, depth, mode, tokens, repeats, warm: bool, batched: bool):
    """(ensure seconds list, release seconds list, memsets per ensure or None, pages)."""
    pool = MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    modes = (mode,) * cfg.n_layers

    def one():
        cache = RuntimeKVCache(ops, pool, cfg, depth, tokens, modes, alloc)
        m0 = getattr(ops, "memsets", 0)
        t0 = time.perf_counter()
        (cache.ensure(tokens) if batched else ensure_one_by_one(cache, tokens))
        t1 = time.perf_counter()
        memsets = getattr(ops, "memsets", None)
        memsets = None if memsets is None else memsets - m0
        pages = sum(len(cache.page_list(s)) for s in range(cache.n_slots))
        t2 = time.perf_counter()
        cache.release()
        t3 = time.perf_counter()
        return t1 - t0, t3 - t2, memsets, pages

    if warm:
        one()                                   # cache the segments a request needs
    ens, rel = [], []
    for _ in range(repeats):
        if not warm:
            pool = MemoryPool("host")
            alloc = PageAllocator(ops, pool)
        a, b, memsets, pages = one()
        ens.append(a)
        rel.append(b)
    return ens, rel, memsets, pages


def bench_pool(nbytes: int, n: int, repeats: int):
    """Seconds of n allocate + n free against allocate_many + free_many, warm pool."""
    pool = MemoryPool("host")
    with packed_scope():
        pool.free_many(pool.allocate_many(nbytes, n, "kv_cache"))      # warm the segments
        out = {"allocate x n": [], "free x n": [], "allocate_many": [], "free_many": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            blocks = [pool.allocate(nbytes, "kv_cache") for _ in range(n)]
            t1 = time.perf_counter()
            for b in blocks:
                pool.free(b)
            t2 = time.perf_counter()
            blocks = pool.allocate_many(nbytes, n, "kv_cache")
            t3 = time.perf_counter()
            pool.free_many(blocks)
            t4 = time.perf_counter()
            out["allocate x n"].append(t1 - t0)
            out["free x n"].append(t2 - t1)
            out["allocate_many"].append(t3 - t2)
            out["free_many"].append(t4 - t3)
    left = pool.stats().allocated_bytes
    if left:
        raise RuntimeError(f"the pool still holds {left} B after the pool benchmark")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="positions ensured (default 2048)")
    ap.add_argument("--depths", default="1,4", help="comma-separated depths (default 1,4)")
    ap.add_argument("--modes", default="fp16,int8", help="KV modes (default fp16,int8)")
    ap.add_argument("--repeats", type=int, default=15, help="runs per figure (default 15)")
    args = ap.parse_args(argv)
    cfg = SMOL
    depths = [int(d) for d in args.depths.split(",")]
    modes = args.modes.split(",")
    print(f"ensure({args.tokens}) host ms: median [min-max] of {args.repeats}; pages of "
          f"{PageLayout.for_config(cfg, 'fp16', kv_dtype=np.float16).page_bytes} B (fp16)")
    print(f"{'depth':>5} {'mode':>5} {'zeroing':>8} {'pool':>5} {'pages':>6} "
          f"{'one-by-one':>24} {'batched':>24} {'speedup':>7} {'release':>22} "
          f"{'memsets 1x1/batch':>18}")
    for depth in depths:
        for mode in modes:
            for zeroing, ops_cls in (("host", HostOps16), ("stubbed", StubZeroOps)):
                for warm in (True, False):
                    ref = bench_ensure(ops_cls(), cfg, depth, mode, args.tokens, args.repeats,
                                       warm, batched=False)
                    new = bench_ensure(ops_cls(), cfg, depth, mode, args.tokens, args.repeats,
                                       warm, batched=True)
                    speed = spread(ref[0]).median / spread(new[0]).median
                    ms = "-" if ref[2] is None else f"{ref[2]}/{new[2]}"
                    print(f"{depth:>5} {mode:>5} {zeroing:>8} {'warm' if warm else 'cold':>5} "
                          f"{new[3]:>6} {_stat(ref[0]):>24} {_stat(new[0]):>24} "
                          f"{speed:>6.1f}x {_stat(new[1]):>22} {ms:>18}",
                          flush=True)
    n = -(-args.tokens // 32) * len(range(cfg.n_slots(1)))
    nbytes = PageLayout.for_config(cfg, "fp16", kv_dtype=np.float16).page_bytes
    print(f"\npool alone: {n} blocks of {nbytes} B (tag kv_cache, packed), warm pool, ms "
          f"median [min-max] of {args.repeats}")
    for k, ts in bench_pool(nbytes, n, args.repeats).items():
        print(f"  {k:>14}: {_stat(ts)}   ({spread(ts).median / n * 1e6:.2f} us per block)")
    return 0
