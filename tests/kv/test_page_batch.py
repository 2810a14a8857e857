"""Batched KV page allocation (docs/kv_modes.md "Allocating pages in batches"). Every batched
path is checked against its one-by-one reference on a pool in the same state:
``MemoryPool.allocate_many`` / ``free_many`` against ``allocate`` / ``free`` (same addresses,
sizes, tags, counters, peaks, layout and event log), ``PageAllocator.alloc_many`` against
``alloc`` (same pages, zeroed bytes), ``RuntimeKVCache.ensure`` against
``tests/kv_reference.ensure_one_by_one`` (same block tables); and out-of-memory part-way
through a batch leaves nothing allocated and nothing lost."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import numpy as np
import pytest

from tinyloop.backends.numpy_ops import NumpyOps
from tinyloop.config import ModelConfig
from tinyloop.errors import HandleError, OutOfMemoryError
from tinyloop.kv import PageAllocator, PageLayout, RuntimeKVCache, resolve_kv_modes
from tinyloop.memory import FakeRawAllocator, MemoryPool, packed_scope
from tinyloop.memory.block import contiguous_runs

from ..kv_reference import ensure_one_by_one

KiB, MiB = 1 << 10, 1 << 20
SMOL = ModelConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                   ffn_dim=1536, n_prelude=2, n_recurrent=2, n_coda=2, max_depth=4)

pytestmark = pytest.mark.usefixtures("fresh_pools")


def _fake_pool(**kw):
    return MemoryPool(raw_allocator=FakeRawAllocator(), **kw)


def _history(pool, seed: int) -> list:
    """Fragment ``pool`` the same way for a given seed: mixed sizes, packed and not, half of
    them freed in random order. Returns the blocks still live."""
    rng = random.Random(seed)
    live = []
    for _ in range(60):
        nbytes = rng.choice([rng.randint(1, 64 * KiB), rng.randint(1, 3 * MiB)])
        scope = packed_scope() if rng.random() < 0.5 else contextlib.nullcontext()
        with scope:
            live.append(pool.allocate(nbytes, rng.choice(["weights", "kv_cache", "scratch"])))
    rng.shuffle(live)
    for blk in live[: len(live) // 2]:
        pool.free(blk)
    return live[len(live) // 2:]


def _state(pool):
    """Everything observable about a pool but event times and driver figures."""
    s = dataclasses.asdict(pool.stats())
    return (pool.layout(), s, [(e.action, e.address, e.size, e.tag) for e in pool.events()],
            pool.events_dropped)


def _blocks(blocks):
    return [(b.ptr, b.nbytes, b.requested_bytes, b.tag, b.freed) for b in blocks]


# --- the pool -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("packed", [False, True])
def test_allocate_many_equals_n_allocates(seed, packed):
    ref_pool, pool = _fake_pool(), _fake_pool()
    _history(ref_pool, seed)
    _history(pool, seed)
    assert _state(ref_pool) == _state(pool)
    rng = random.Random(1000 + seed)
    scope = packed_scope if packed else contextlib.nullcontext
    for _ in range(3):                      # several batches: later ones reuse earlier tails
        nbytes = rng.choice([24576, 12672, rng.randint(1, 200 * KiB), 700 * KiB])
        n = rng.randint(0, 300)
        with scope():
            ref = [ref_pool.allocate(nbytes, "kv_cache") for _ in range(n)]
            got = pool.allocate_many(nbytes, n, "kv_cache")
        assert _blocks(got) == _blocks(ref)
        assert _state(pool) == _state(ref_pool)
        pool._check()
        # free in a random order: free_many equals one free per block
        order = list(range(n))
        rng.shuffle(order)
        keep = rng.randint(0, n)
        for i in order[keep:]:
            ref_pool.free(ref[i])
        pool.free_many([got[i] for i in order[keep:]])
        assert _blocks(got) == _blocks(ref)
        assert _state(pool) == _state(ref_pool)
        pool._check()
        # the kept ones in allocation order: neighbours go back as runs
        kept = [i for i in sorted(order[:keep]) if i % 3]
        for i in kept:
            ref_pool.free(ref[i])
        pool.free_many([got[i] for i in kept])
        assert _blocks(got) == _blocks(ref)
        assert _state(pool) == _state(ref_pool)
        pool._check()


def test_free_many_of_neighbours_equals_one_free_each():
    """A batch freed in allocation order (runs of neighbours, given back to the arena at
    once) logs the same events and leaves the same layout and figures as one free each."""
    ref_pool, pool = _fake_pool(), _fake_pool()
    for p in (ref_pool, pool):
        _history(p, 5)
    with packed_scope():
        ref = ref_pool.allocate_many(24576, 200, "kv_cache")
        got = pool.allocate_many(24576, 200, "kv_cache")
    for k in (7, 3, 150, 40):                  # a hole first: runs meet free neighbours
        ref_pool.free(ref[k])
        pool.free(got[k])
    left = [i for i in range(200) if i not in (7, 3, 150, 40)]
    for i in left:
        ref_pool.free(ref[i])
    pool.free_many([got[i] for i in left])
    assert _blocks(got) == _blocks(ref)
    assert _state(pool) == _state(ref_pool)
    pool._check()


def test_allocate_many_carves_contiguous_runs():
    """One fresh segment's worth of pages comes back as one address-contiguous run; a batch
    that spans segments has one run per segment, never one across two segments (the fake
    allocator hands out adjacent segments)."""
    pool = _fake_pool()
    with packed_scope():
        per_seg = (2 * MiB) // 24576
        blocks = pool.allocate_many(24576, 2 * per_seg + 5, "kv_cache")
    runs = contiguous_runs(blocks)
    segs = pool.layout()
    assert len(segs) == 3 and len(runs) == 3
    assert [r[0] for r in runs] == [s["address"] for s in segs]
    assert [r[1] for r in runs] == [per_seg * 24576] * 2 + [5 * 24576]
    assert sum(n for _, n in runs) == sum(b.nbytes for b in blocks)


@pytest.mark.parametrize("how", ["device full", "limit"])
def test_out_of_memory_mid_batch_leaves_nothing(how):
    """The batch needs more pages than fit: it raises, nothing is allocated, no alloc event
    is logged, and every byte the failed batch carved is usable again (the pages that fit one
    by one on a twin pool fit as one batch, at the same addresses)."""
    def make():
        if how == "device full":
            pool = MemoryPool(raw_allocator=FakeRawAllocator(capacity=9 * MiB))
        else:
            pool = MemoryPool(raw_allocator=FakeRawAllocator(), limit_bytes=9 * MiB)
        with packed_scope():
            blocks = [pool.allocate(n, "weights") for n in (3 * MiB, 100 * KiB, 700 * KiB)]
        small = [pool.allocate(n, "scratch") for n in (5000, 60 * KiB)]
        pool.free(blocks[1])                    # a hole the first pages fill
        pool.free(small[0])
        return pool, blocks + small

    twin, _ = make()
    with packed_scope():
        fit = []
        with pytest.raises(OutOfMemoryError):
            while True:
                fit.append(twin.allocate(24576, "kv_cache"))
    assert fit                                  # the test needs some pages to fit

    pool, _ = make()
    before = dataclasses.asdict(pool.stats())
    allocs_before = [e for e in pool.events() if e.action == "alloc"]
    with packed_scope(), pytest.raises(OutOfMemoryError):
        pool.allocate_many(24576, len(fit) + 1, "kv_cache")
    pool._check()
    after = dataclasses.asdict(pool.stats())
    for k in ("allocated_bytes", "requested_bytes", "active_blocks", "num_allocs", "by_tag",
              "num_frees"):
        assert after[k] == before[k], k
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert [e for e in pool.events() if e.action == "alloc"] == allocs_before
    with packed_scope():
        got = pool.allocate_many(24576, len(fit), "kv_cache")
    # the same bytes (the failed batch's segments are cached now, so best fit may order the
    # addresses differently), and no more: one page beyond still fails
    assert sorted(b.ptr for b in got) == sorted(b.ptr for b in fit)
    with packed_scope(), pytest.raises(OutOfMemoryError):
        pool.allocate(24576, "kv_cache")
    pool._check()


def test_allocate_many_and_free_many_reject_bad_input():
    pool = _fake_pool()
    with pytest.raises(ValueError):
        pool.allocate_many(-1, 3)
    with pytest.raises(ValueError):
        pool.allocate_many(512, -1)
    with pytest.raises(Exception, match="unknown memory tag"):
        pool.allocate_many(512, 2, "kv")
    assert pool.allocate_many(512, 0) == [] and pool.allocated_bytes == 0
    a, b = pool.allocate_many(512, 2, "scratch")
    other = _fake_pool().allocate(512)
    for bad in ([a, a], [a, other]):
        with pytest.raises(ValueError):
            pool.free_many(bad)
    assert not a.freed and not b.freed          # nothing was freed by a refused call
    pool.free_many([a, b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_many([a])
    assert pool.allocated_bytes == 0
    pool._check()


# --- pages ----------------------------------------------------------------------------------
class CountingOps(NumpyOps):
    """NumPy ops that record every zero_ranges call."""

    def __init__(self):
        self.ranges = []

    def zero_ranges(self, ranges) -> None:
        ranges = list(ranges)
        self.ranges.append(ranges)
        super().zero_ranges(ranges)


def _dirty(pages) -> None:
    for p in pages:
        p.block.array((p.layout.page_bytes,), np.uint8)[...] = 0xA5


@pytest.mark.parametrize("mode", ["fp16", "int8", "h_int4"])
def test_alloc_many_equals_alloc_one_by_one(mode):
    """Same pool, same state: the batch returns the reference's pages (addresses, order,
    tags, pool figures), every byte zeroed although the reference's pages were dirtied, with
    one memset per contiguous run."""
    ops, pool = CountingOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    lay = PageLayout.for_config(SMOL, mode, 32)
    with packed_scope():
        spacer = [pool.allocate(n, "weights") for n in (5000, 300 * KiB, 70000)]
    pool.free(spacer[1])                        # a hole the pages fill first (best fit)
    n = 2 * (2 * MiB) // lay.page_bytes + 7
    # a first round adds the segments; from then on the pool returns to one state after each
    # round (coalescing is canonical), so the reference and the batch start alike
    for p in [alloc.alloc(lay) for _ in range(n)]:
        alloc.unref(p)
    ref = [alloc.alloc(lay) for _ in range(n)]
    ref_addrs = [p.addr for p in ref]
    ref_tags = {p.block.tag for p in ref}
    ref_stats = dataclasses.asdict(pool.stats())
    _dirty(ref)
    for p in ref:
        alloc.unref(p)
    assert alloc.live_pages == 0
    got = alloc.alloc_many(lay, n)
    assert [p.addr for p in got] == ref_addrs
    assert {p.block.tag for p in got} == ref_tags == {"kv_cache"}
    s = dataclasses.asdict(pool.stats())
    for k in ("allocated_bytes", "requested_bytes", "by_tag", "reserved_bytes",
              "active_blocks", "segments"):
        assert s[k] == ref_stats[k], k
    assert alloc.live_pages == n and all(p.refs == 1 for p in got)
    for p in got:
        assert not p.block.array((lay.page_bytes,), np.uint8).any()
        assert set(p.parts) == {q.name for q in lay.parts}
    (ranges,) = ops.ranges
    # every page's bytes in exactly one range, no range outside the pages, runs maximal
    covered = sorted((a, a + m) for a, m in ranges)
    blocks = sorted((p.addr, p.addr + p.block.nbytes) for p in got)
    merged = []
    for a, b in blocks:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    seg_starts = {s["address"] for s in pool.layout()}
    assert sum(b - a for a, b in covered) == sum(b - a for a, b in blocks)
    assert all(any(a <= x < y <= b for a, b in merged) for x, y in covered)
    assert len(ranges) >= len(merged) and len(ranges) <= len(merged) + len(seg_starts)
    alloc.unref_many(got)
    assert pool.allocated_bytes == sum(b.nbytes for b in spacer) - spacer[1].nbytes


def test_alloc_many_frees_its_pages_when_zeroing_fails(monkeypatch):
    ops, pool = NumpyOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)

    def broken(ranges):
        raise RuntimeError("memset failed")

    monkeypatch.setattr(ops, "zero_ranges", broken)
    with pytest.raises(RuntimeError, match="memset"):
        alloc.alloc_many(PageLayout.for_config(SMOL, "fp16", 32), 10)
    assert pool.allocated_bytes == 0 and alloc.live_pages == 0
    pool._check()


def test_unref_many_refuses_a_double_release_before_changing_anything():
    ops, pool = NumpyOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    a, b = alloc.alloc_many(PageLayout.for_config(SMOL, "int8", 32), 2)
    alloc.ref(a)                                # a: 2 holders
    with pytest.raises(HandleError):
        alloc.unref_many([a, b, b])
    assert (a.refs, b.refs, alloc.live_pages) == (2, 1, 2)
    alloc.unref_many([a, a, b])
    assert alloc.live_pages == 0 and pool.allocated_bytes == 0
    with pytest.raises(HandleError):
        _ = b.parts


# --- the cache ------------------------------------------------------------------------------
@pytest.mark.parametrize("depth,n", [(1, 100), (3, 64), (4, 1)])
def test_ensure_equals_one_by_one(depth, n):
    """The same pool, a reference request then the batched one: identical block tables (the
    same pages in every slot), pool figures and zeroed bytes; growing in two steps too."""
    ops, pool = CountingOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    modes = ("fp16",) * SMOL.n_layers
    with RuntimeKVCache(ops, pool, SMOL, depth, 128, modes, alloc) as warm:
        ensure_one_by_one(warm, n)               # segments added; same state after each round
    with RuntimeKVCache(ops, pool, SMOL, depth, 128, modes, alloc) as ref:
        ensure_one_by_one(ref, n // 2 + 1)
        ensure_one_by_one(ref, n)
        want = ref.table_host.copy()
        want_bytes = (ref.nbytes, pool.allocated_bytes, pool.by_tag()["kv_cache"])
        for s in range(ref.n_slots):
            _dirty(ref.page_list(s))
    with RuntimeKVCache(ops, pool, SMOL, depth, 128, modes, alloc) as cache:
        cache.ensure(n // 2 + 1)
        cache.ensure(n)
        assert np.array_equal(cache.table_host, want)
        assert (cache.nbytes, pool.allocated_bytes, pool.by_tag()["kv_cache"]) == want_bytes
        assert cache.length == ref.length
        for s in range(cache.n_slots):
            for p in cache.page_list(s):
                assert not p.block.array((p.layout.page_bytes,), np.uint8).any()
    assert pool.allocated_bytes == 0 and alloc.live_pages == 0
    pool._check()


def test_ensure_mixed_modes_gives_every_slot_its_layout():
    ops, pool = CountingOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    modes = resolve_kv_modes({"prelude": "int8", "recurrent": "h_int4", "coda": "fp16"}, SMOL)
    with RuntimeKVCache(ops, pool, SMOL, 3, 200, modes, alloc) as cache:
        cache.ensure(70)
        assert len(ops.ranges) == 3            # one batch (one zero_ranges call) per layout
        for s in range(cache.n_slots):
            pages = cache.page_list(s)
            assert len(pages) == 3 and all(p.layout is cache.layouts[s] for p in pages)
            assert list(cache.table_host[s, :3]) == [p.addr for p in pages]
            assert not cache.table_host[s, 3:].any()
        assert cache.nbytes == pool.by_tag()["kv_cache"]


def test_ensure_out_of_memory_then_release_leaves_nothing():
    ops = NumpyOps()
    pool = MemoryPool("host", limit_bytes=6 * MiB)
    alloc = PageAllocator(ops, pool)
    modes = ("fp16",) * SMOL.n_layers
    cache = RuntimeKVCache(ops, pool, SMOL, 4, 2048, modes, alloc)
    with pytest.raises(OutOfMemoryError):
        cache.ensure(2048)
    # the host and device tables agree about which pages exist
    assert np.array_equal(np.asarray(cache._table), cache.table_host)
    cache.release()
    assert pool.allocated_bytes == 0 and alloc.live_pages == 0
    pool._check()


def test_share_prefix_and_make_private_copy_the_bytes():
    ops, pool = NumpyOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    modes = ("int8",) * SMOL.n_layers
    rng = np.random.default_rng(0)
    with RuntimeKVCache(ops, pool, SMOL, 2, 128, modes, alloc) as src:
        src.ensure(70)
        for s in range(src.n_slots):
            for p in src.page_list(s):
                u8 = p.block.array((p.layout.page_bytes,), np.uint8)
                u8[...] = rng.integers(0, 256, u8.shape)
        with RuntimeKVCache(ops, pool, SMOL, 2, 128, modes, alloc) as dst:
            dst.share_prefix(src, 70)           # 2 full pages shared, the third copied
            for s in range(dst.n_slots):
                mine, theirs = dst.page_list(s), src.page_list(s)
                assert mine[:2] == theirs[:2] and mine[2] is not theirs[2]
                assert all(p.refs == 2 for p in mine[:2]) and mine[2].refs == 1
                assert np.array_equal(mine[2].block.array((12672,), np.uint8),
                                      theirs[2].block.array((12672,), np.uint8))
            first = SMOL.n_prelude
            dropped = dst.make_private(first)
            assert len(dropped) == 2 * (dst.n_slots - first)
            for s in range(dst.n_slots):
                mine, theirs = dst.page_list(s), src.page_list(s)
                for k in range(3):
                    assert (mine[k] is theirs[k]) == (s < first and k < 2)
                    assert np.array_equal(mine[k].block.array((12672,), np.uint8),
                                          theirs[k].block.array((12672,), np.uint8))
                assert list(dst.table_host[s, :3]) == [p.addr for p in mine]
            assert all(p.refs == 1 for p in dropped)
    assert pool.allocated_bytes == 0 and alloc.live_pages == 0
