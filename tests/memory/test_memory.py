"""The memory pool on the CPU: exact addresses on a fake raw allocator, a randomized property
test that recomputes every counter from the blocks, byte patterns on the host arena, budget and
out-of-memory figures, empty_cache, the snapshot export, the event log and threads."""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import pickle
import random
import threading
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop.memory as mem
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.errors import ConfigError, OutOfMemoryError, TinyLoopError
from tinyloop.memory import TAGS, FakeRawAllocator, MemoryPool, tag_scope
from tinyloop.memory.arena import (ALIGNMENT, LARGE_SEGMENT_ROUND, SMALL_REQUEST_MAX,
                                   SMALL_SEGMENT_BYTES, round_size, segment_size)

KiB, MiB = 1 << 10, 1 << 20
B = 0x10_0000_0000          # FakeRawAllocator's first address


pytestmark = pytest.mark.usefixtures("fresh_pools")     # every test: no pools, no limit


def fake_pool(**kw):
    raw = FakeRawAllocator(**{k: kw.pop(k) for k in ("capacity", "total_bytes") if k in kw})
    return MemoryPool(raw_allocator=raw, **kw), raw


def layout_of(pool):
    """[(segment address, size, [(block address, size, live), ...]), ...]"""
    return [(s["address"], s["size"], [(b["address"], b["size"], b["live"]) for b in s["blocks"]])
            for s in pool.layout()]


# --- size classes -------------------------------------------------------------------------
def test_round_size_and_segment_size():
    assert [round_size(n) for n in (0, 1, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024,
                                                                     1024]
    assert segment_size(512) == segment_size(SMALL_REQUEST_MAX) == SMALL_SEGMENT_BYTES == 2 * MiB
    assert segment_size(SMALL_REQUEST_MAX + 512) == 2 * MiB
    assert segment_size(2 * MiB + 512) == 4 * MiB
    assert LARGE_SEGMENT_ROUND % ALIGNMENT == 0


# --- exact addresses on the fake raw allocator --------------------------------------------
def test_split_packs_small_requests_into_one_segment():
    pool, raw = fake_pool()
    a = pool.allocate(1000, "scratch")
    b = pool.allocate(512, "logits")
    assert (a.ptr, a.nbytes, a.requested_bytes, a.tag) == (B, 1024, 1000, "scratch")
    assert (b.ptr, b.nbytes) == (B + 1024, 512)
    assert raw.log == [("malloc", B, 2 * MiB)]
    assert layout_of(pool) == [(B, 2 * MiB, [(B, 1024, True), (B + 1024, 512, True),
                                             (B + 1536, 2 * MiB - 1536, False)])]
    pool._check()


def test_coalesce_merges_both_neighbours():
    pool, raw = fake_pool()
    a, b, c = (pool.allocate(4096) for _ in range(3))
    assert [x.ptr for x in (a, b, c)] == [B, B + 4096, B + 8192]
    a.free()
    c.free()                                   # merges with the free tail
    assert layout_of(pool) == [(B, 2 * MiB, [(B, 4096, False), (B + 4096, 4096, True),
                                             (B + 8192, 2 * MiB - 8192, False)])]
    b.free()                                   # merges with both neighbours
    assert layout_of(pool) == [(B, 2 * MiB, [(B, 2 * MiB, False)])]
    assert pool.stats().largest_free_block_bytes == 2 * MiB
    pool._check()


def test_best_fit_takes_the_smallest_hole_that_fits():
    pool, _ = fake_pool()
    blocks = [pool.allocate(n) for n in (8192, 512, 2048, 512, 4096, 512)]
    for i in (0, 2, 4):                        # holes of 8192 @B, 2048, 4096
        blocks[i].free()
    hole_2048 = B + 8192 + 512
    x = pool.allocate(2000)
    assert (x.ptr, x.nbytes) == (hole_2048, 2048)
    y = pool.allocate(3000)                    # 3072 from the 4096 hole, split
    assert y.ptr == B + 8192 + 512 + 2048 + 512
    z = pool.allocate(1024)                    # best fit is now the 1024 tail of that hole
    assert z.ptr == y.ptr + 3072
    pool._check()


def test_freed_segment_is_reused_without_a_new_raw_allocation():
    pool, raw = fake_pool()
    a = pool.allocate(3 * MiB, "weights")
    a.free()
    b = pool.allocate(3 * MiB, "kv_cache")
    assert b.ptr == a.ptr == B and raw.log == [("malloc", B, 4 * MiB)]
    s = pool.stats()
    assert (s.num_segment_allocs, s.num_allocs, s.num_frees) == (1, 2, 1)


def test_large_request_gets_its_own_segment_and_its_tail_stays_free():
    pool, raw = fake_pool()
    small = pool.allocate(100)
    big = pool.allocate(3 * MiB)
    assert big.ptr == B + 2 * MiB              # after the small segment
    assert layout_of(pool)[1] == (B + 2 * MiB, 4 * MiB,
                                  [(B + 2 * MiB, 3 * MiB, True), (B + 5 * MiB, MiB, False)])
    tiny = pool.allocate(100)                  # small: never carved from a large segment
    assert tiny.ptr == B + 512
    mid = pool.allocate(SMALL_REQUEST_MAX)     # 1 MiB is still small
    assert mid.ptr == B + 1024
    del small, tiny
    pool._check()


def test_adjacent_segments_never_merge():
    pool, raw = fake_pool()
    a, b = pool.allocate(2 * MiB), pool.allocate(2 * MiB)
    assert (a.ptr, b.ptr) == (B, B + 2 * MiB)  # adjacent in memory
    a.free()
    b.free()
    assert layout_of(pool) == [(B, 2 * MiB, [(B, 2 * MiB, False)]),
                               (B + 2 * MiB, 2 * MiB, [(B + 2 * MiB, 2 * MiB, False)])]
    s = pool.stats()
    assert s.largest_free_block_bytes == 2 * MiB and s.external_fragmentation == 0.5


def test_empty_cache_releases_only_fully_free_segments():
    pool, raw = fake_pool()
    keep = pool.allocate(4096, "weights")
    gone = pool.allocate(3 * MiB)
    gone.free()
    before = pool.stats()
    assert before.reserved_bytes == 6 * MiB
    assert pool.empty_cache() == 4 * MiB
    assert raw.log[-1] == ("free", B + 2 * MiB, 4 * MiB)
    after = pool.stats()
    assert after.reserved_bytes == 2 * MiB and after.allocated_bytes == before.allocated_bytes
    assert after.num_segment_releases == 1 and not keep.freed
    assert pool.empty_cache() == 0
    keep.free()
    assert pool.empty_cache() == 2 * MiB and raw.live == {}
    pool._check()


def test_double_free_and_foreign_free_raise():
    pool, _ = fake_pool()
    other, _ = fake_pool()
    a = pool.allocate(10)
    a.free()
    with pytest.raises(ValueError, match="double free"):
        a.free()
    with pytest.raises(ValueError, match="does not belong"):
        other.free(pool.allocate(10))
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.stats().num_frees == 1


# --- tags ---------------------------------------------------------------------------------
def test_tags_explicit_scoped_nested_and_per_thread():
    pool, _ = fake_pool()
    assert pool.allocate(1).tag == "other"
    with tag_scope("weights"):
        assert pool.allocate(1).tag == "weights"
        with tag_scope("kv_cache"):
            assert pool.allocate(1).tag == "kv_cache"
            assert pool.allocate(1, "logits").tag == "logits"
            seen = []
            t = threading.Thread(target=lambda: seen.append(pool.allocate(1).tag))
            t.start()
            t.join()
            assert seen == ["other"]
        assert mem.current_tag() == "weights"
    with pytest.raises(ConfigError, match="unknown memory tag"):
        pool.allocate(1, "nope")
    with pytest.raises(ConfigError):
        with tag_scope("nope"):
            pass
    assert pool.by_tag()["weights"] == 512 and set(pool.by_tag()) == set(TAGS)


def test_retag_moves_bytes_between_tags_exactly():
    pool, _ = fake_pool()
    a = pool.allocate(1000, "kv_cache")
    b = pool.allocate(5000, "kv_cache")
    pool.retag(a, "prefix_cache")
    assert a.tag == "prefix_cache"
    assert pool.by_tag()["kv_cache"] == 5120 and pool.by_tag()["prefix_cache"] == 1024
    assert pool.stats().peak_by_tag["prefix_cache"] == 1024
    pool.retag(a, "prefix_cache")                            # same tag: nothing moves
    pool._check()
    a.free()                                                 # freed under its new tag
    assert pool.by_tag()["prefix_cache"] == 0 and pool.by_tag()["kv_cache"] == 5120
    pool._check()
    with pytest.raises(ValueError, match="freed"):
        pool.retag(a, "kv_cache")
    with pytest.raises(ConfigError, match="unknown memory tag"):
        pool.retag(b, "nope")
    other, _ = fake_pool()
    with pytest.raises(ValueError, match="does not belong"):
        other.retag(b, "other")


# --- budget and out-of-memory -------------------------------------------------------------
def test_limit_error_carries_the_figures_and_nothing_stays_allocated():
    pool, raw = fake_pool(limit_bytes=4 * MiB)
    held = pool.allocate(2 * MiB, "weights")
    before = pool.stats()
    with tag_scope("kv_cache"), pytest.raises(OutOfMemoryError) as ei:
        pool.allocate(3 * MiB - 100)
    e = ei.value
    assert isinstance(e, TinyLoopError) and isinstance(e, MemoryError)
    assert (e.requested_bytes, e.tag, e.allocated_bytes, e.reserved_bytes, e.limit_bytes,
            e.device_free_bytes, e.device) == (3 * MiB - 100, "kv_cache", 2 * MiB, 2 * MiB,
                                               4 * MiB, None, "fake")
    assert "limit" in str(e) and "kv_cache" in str(e)
    after = pool.stats()
    assert (after.allocated_bytes, after.reserved_bytes, after.requested_bytes) == (
        before.allocated_bytes, before.reserved_bytes, before.requested_bytes)
    assert (after.num_ooms, after.num_alloc_retries, after.num_allocs) == (1, 0, 1)
    assert [e.action for e in pool.events()][-1] == "oom"
    pool._check()
    held.free()
    ok = pool.allocate(3 * MiB - 100)          # releases the cached 2 MiB segment, retries
    s = pool.stats()
    assert (s.num_alloc_retries, s.num_segment_releases, s.reserved_bytes) == (1, 1, 4 * MiB)
    assert raw.log == [("malloc", B, 2 * MiB), ("free", B, 2 * MiB),
                       ("malloc", B + 2 * MiB, 4 * MiB)]
    assert ok.ptr == B + 2 * MiB


def test_reserve_past_the_limit_is_a_probe_not_an_out_of_memory():
    pool, raw = fake_pool(limit_bytes=4 * MiB)
    assert pool.reserve(3 * MiB, "weights") is True            # one 4 MiB segment
    assert raw.log == [("malloc", B, 4 * MiB)]
    assert pool.reserve(3 * MiB, "weights") is True            # already there: no new segment
    held = pool.allocate(3 * MiB, "weights")
    assert pool.reserve(3 * MiB, "weights") is False           # would cross the limit
    s = pool.stats()
    assert (s.num_ooms, s.reserved_bytes, s.allocated_bytes) == (0, 4 * MiB, 3 * MiB)
    assert "oom" not in [e.action for e in pool.events()]
    held.free()
    pool._check()


def test_limit_below_a_segment_falls_back_to_an_exact_segment():
    pool, raw = fake_pool(limit_bytes=MiB)
    a = pool.allocate(1000)
    assert raw.log == [("malloc", B, 1024)]
    with pytest.raises(OutOfMemoryError):
        pool.allocate(MiB)
    assert pool.stats().allocated_bytes == a.nbytes


def test_raw_out_of_memory_releases_cached_segments_then_raises_ours():
    pool, raw = fake_pool(capacity=8 * MiB)
    live = pool.allocate(2 * MiB + 512)        # 4 MiB segment
    cached = pool.allocate(2 * MiB)
    cached.free()                              # 2 MiB segment cached; device now full
    again = pool.allocate(2 * MiB - 512)       # fits in the cached segment, no raw call
    again.free()
    big = pool.allocate(2 * MiB + 512)         # raw refuses 4 MiB; release cached; retry
    s = pool.stats()
    assert (s.num_alloc_retries, s.num_segment_releases, s.num_ooms) == (1, 1, 0)
    # the device is full and no segment is free: a small request takes the best-fit free
    # range of the large class (two tails of 2 MiB - 512 B: the lower address wins)
    tiny = pool.allocate(100)
    assert tiny.ptr == B + 2 * MiB + 512 and pool.stats().num_ooms == 0
    with pytest.raises(OutOfMemoryError) as ei:   # no free range holds 2 MiB
        pool.allocate(2 * MiB)
    e = ei.value
    assert (e.device_free_bytes, e.limit_bytes, e.reserved_bytes) == (0, None, 8 * MiB)
    assert e.largest_free_bytes == 2 * MiB - 512 and str(2 * MiB - 512) in str(e)
    assert pool.stats().num_ooms == 1 and raw.used_bytes == 8 * MiB
    assert [op for op, *_ in raw.log] == ["malloc", "malloc", "free", "malloc"]
    del live, big, tiny


def test_forced_raw_failure_retries_once():
    pool, raw = fake_pool()
    pool.allocate(100).free()
    raw.fail_next = 2                          # both segment sizes fail on the first attempt
    blk = pool.allocate(3 * MiB)
    assert blk.ptr == B + 2 * MiB and pool.stats().num_alloc_retries == 1


def test_foreign_raw_errors_pass_through_unchanged():
    class Broken(FakeRawAllocator):
        def malloc(self, nbytes):
            raise RuntimeError("driver bug")
    pool = MemoryPool(raw_allocator=Broken())
    with pytest.raises(RuntimeError, match="driver bug"):
        pool.allocate(10)
    s = pool.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_allocs, s.num_ooms) == (0, 0, 0, 0)


def test_set_limit_parses_sizes_and_percentages():
    pool, _ = fake_pool(total_bytes=1000 * MiB)
    pool.set_limit("4M")
    assert pool.limit_bytes == 4 * MiB
    pool.set_limit("10%")
    assert pool.limit_bytes == 100 * MiB
    pool.set_limit(None)
    assert pool.limit_bytes is None
    with pytest.raises(ConfigError):
        pool.set_limit("lots")
    with pytest.raises(ConfigError):
        pool.set_limit(-5)


def test_set_limit_below_reserved_returns_cached_segments():
    pool, raw = fake_pool()
    pool.allocate(3 * MiB).free()
    keep = pool.allocate(100)
    pool.set_limit(MiB)
    assert pool.stats().reserved_bytes == 2 * MiB and not keep.freed


def test_env_limit_applies_to_new_process_pools(monkeypatch):
    monkeypatch.setenv("TINYLOOP_MEMORY_LIMIT", "3M")
    pool = mem.get_pool("host")
    assert pool.limit_bytes == 3 * MiB
    with pytest.raises(OutOfMemoryError) as ei:
        pool.allocate(4 * MiB, "weights")
    assert ei.value.limit_bytes == 3 * MiB and ei.value.device_free_bytes > 0
    assert mem.memory_stats().allocated_bytes == 0
    mem._reset_pools_for_tests()
    monkeypatch.setenv("TINYLOOP_MEMORY_LIMIT", "many")
    with pytest.raises(ConfigError, match="TINYLOOP_MEMORY_LIMIT"):
        mem.get_pool("host")


def test_set_memory_limit_default_applies_to_later_pools():
    mem.set_memory_limit("5M")
    assert mem.get_pool("host").limit_bytes == 5 * MiB
    mem.set_memory_limit(None)
    assert mem.get_pool("host").limit_bytes is None


# --- host arena ---------------------------------------------------------------------------
def test_host_blocks_are_aligned_views_of_their_own_bytes():
    pool = MemoryPool("host")
    a = pool.allocate(12 * 4, "buffers")
    arr = a.array((3, 4), np.float32)
    assert arr.shape == (3, 4) and arr.dtype == np.float32
    assert arr.ctypes.data == a.ptr and a.ptr % ALIGNMENT == 0
    arr[...] = 7
    assert a.array(12, np.float32).sum() == 84
    with pytest.raises(ValueError, match="needs 64 bytes"):
        a.array((4, 4), np.float32)
    a.free()
    with pytest.raises(ValueError, match="freed"):
        a.array(1, np.uint8)


def test_host_byte_patterns_survive_until_free():
    pool = MemoryPool("host")
    rng = random.Random(3)
    live = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 60):
            blk, fill = live.pop(rng.randrange(len(live)))
            view = blk.array(blk.requested_bytes, np.uint8)
            assert (view == fill).all(), f"bytes of {blk!r} were overwritten"
            blk.free()
        else:
            n = rng.choice([rng.randint(0, 4096), rng.randint(4096, 3 * MiB)])
            blk = pool.allocate(n, rng.choice(TAGS))
            fill = step % 251
            blk.array(n, np.uint8)[...] = fill
            live.append((blk, fill))
        if step % 500 == 0:
            pool.empty_cache()
            pool._check()
    for blk, fill in live:
        assert (blk.array(blk.requested_bytes, np.uint8) == fill).all()
        blk.free()
    assert pool.stats().allocated_bytes == 0


def test_empty_cache_lowers_reserved_keeps_allocated_and_data():
    pool = mem.get_pool("host")
    w = pool.allocate(3 * MiB, "weights")
    w.array(3 * MiB, np.uint8)[...] = 42
    for _ in range(4):
        pool.allocate(5 * MiB, "kv_cache").free()
    before = mem.memory_stats()
    assert before.reserved_bytes > before.allocated_bytes
    released = mem.empty_cache()
    after = mem.memory_stats()
    assert released > 0 and after.reserved_bytes == before.reserved_bytes - released
    assert after.allocated_bytes == before.allocated_bytes == 3 * MiB
    assert (w.array(3 * MiB, np.uint8) == 42).all()


def test_ops_empty_allocates_through_the_pool():
    from tinyloop.backends.base import Ops
    pool = mem.get_pool("host")
    arr, blk = Ops().empty(pool, (2, 3), np.float32, "buffers")
    assert arr.shape == (2, 3) and blk.tag == "buffers" and blk.requested_bytes == 24
    assert mem.memory_stats().by_tag["buffers"] == 512


# --- stats, report, peaks -----------------------------------------------------------------
def test_memory_stats_defaults_to_host_and_report_shows_unattributed():
    pool = mem.get_pool("host")
    blk = pool.allocate(1000, "logits")
    s = mem.memory_stats()
    assert s.device == "host" and s.allocated_bytes == 1024 and s.requested_bytes == 1000
    assert s.reserved_bytes == 2 * MiB and s.pool_free_bytes == 2 * MiB - 1024
    assert s.device_total_bytes >= s.device_free_bytes > 0 and s.nvml_process_bytes is None
    assert s.unattributed_bytes == s.process_bytes - s.reserved_bytes
    report = mem.memory_report()
    for word in ("allocated", "reserved", "host memory free", "unattributed", "logits", "OOMs"):
        assert word in report, word
    blk.free()


def test_peaks_and_reset():
    pool, _ = fake_pool()
    a = pool.allocate(3 * MiB, "weights")
    b = pool.allocate(MiB, "scratch")
    b.free()
    s = pool.stats()
    assert s.peak_allocated_bytes == 4 * MiB and s.peak_by_tag["scratch"] == MiB
    pool.reset_peak_stats()
    s = pool.stats()
    assert s.peak_allocated_bytes == 3 * MiB and s.peak_by_tag["scratch"] == 0
    assert s.peak_reserved_bytes == s.reserved_bytes == 6 * MiB
    a.free()


# --- event log and snapshot ---------------------------------------------------------------
def test_event_log_is_a_bounded_ring():
    pool, _ = fake_pool(event_capacity=10)
    for _ in range(5):
        pool.allocate(100, "resume").free()
    ev = pool.events()
    assert len(ev) == 10 and pool.events_dropped == 6
    assert [e.action for e in ev[-3:]] == ["alloc", "free_requested", "free_completed"]
    assert ev[-1].tag == "resume" and ev[-1].size == 512 and ev[-1].address == B


def test_events_record_what_placement_decides_on():
    """Each segment event names its segment's class, the call behind it and the request it
    served; an alloc the class it asked in; a limit has its own event; a failed batch's oom
    holds the batch's bytes and one block's request. (A replay of the log needs exactly
    these: the log once left them to be inferred.)"""
    pool, raw = fake_pool(capacity=16 * MiB)
    with mem.packed_scope():
        page = pool.allocate(24 * KiB, "kv_cache")
    s = pool.allocate(4096, "scratch")
    pool.reserve(3 * MiB, "weights")                       # a 4 MiB segment
    pool.reserve(5 * MiB, "weights", exact=True)           # exactly 5 MiB
    pool.free(page)
    pool.empty_cache()                                     # three fully free segments go
    pool.free(s)
    pool.set_limit(3 * MiB)
    w = pool.allocate(2 * MiB, "weights")   # no room under the limit until the small one goes
    want = [
        ("segment_alloc", B, 2 * MiB, "kv_cache", "large", "allocate", 24 * KiB),
        ("alloc", B, 24 * KiB, "kv_cache", "large", None, None),
        ("segment_alloc", B + 2 * MiB, 2 * MiB, "scratch", "small", "allocate", 4096),
        ("alloc", B + 2 * MiB, 4096, "scratch", "small", None, None),
        ("segment_alloc", B + 4 * MiB, 4 * MiB, "weights", "large", "reserve", 3 * MiB),
        ("segment_alloc", B + 8 * MiB, 5 * MiB, "weights", "large", "reserve_exact", 5 * MiB),
        ("free_requested", B, 24 * KiB, "kv_cache", None, None, None),
        ("free_completed", B, 24 * KiB, "kv_cache", None, None, None),
        ("segment_free", B, 2 * MiB, None, "large", "empty_cache", None),
        ("segment_free", B + 4 * MiB, 4 * MiB, None, "large", "empty_cache", None),
        ("segment_free", B + 8 * MiB, 5 * MiB, None, "large", "empty_cache", None),
        ("free_requested", B + 2 * MiB, 4096, "scratch", None, None, None),
        ("free_completed", B + 2 * MiB, 4096, "scratch", None, None, None),
        ("limit", 0, 3 * MiB, None, None, "set_limit", None),
        ("segment_free", B + 2 * MiB, 2 * MiB, "weights", "small", "allocate", 2 * MiB),
        ("segment_alloc", B + 13 * MiB, 2 * MiB, "weights", "large", "allocate", 2 * MiB),
        ("alloc", B + 13 * MiB, 2 * MiB, "weights", "large", None, None),
    ]
    assert [tuple(e[1:]) for e in pool.events()] == want
    n0 = len(pool.events())
    with mem.packed_scope(), pytest.raises(OutOfMemoryError):
        pool.allocate_many(24 * KiB, 100, "kv_cache")      # 24 KiB segments until the limit
    ev = pool.events()[n0:]
    fitted = (3 * MiB - 2 * MiB) // (24 * KiB)
    assert [e.action for e in ev] == ["segment_alloc"] * fitted + ["oom"]
    assert {(e.size, e.kind, e.cause, e.request) for e in ev[:-1]} == {
        (24 * KiB, "large", "allocate", 24 * KiB)}
    assert tuple(ev[-1][1:]) == ("oom", 0, 100 * 24 * KiB, "kv_cache", "large", "allocate",
                                 24 * KiB)
    with pytest.raises(OutOfMemoryError):
        pool.check_room([("weights", "weights", 4 * MiB)], "a plan")
    assert tuple(pool.events()[-1][1:]) == ("oom", 0, 4 * MiB, "weights", None, "check_room",
                                            None)
    pool.free(w)


def test_limit_events_are_counted_in_events_dropped():
    pool, _ = fake_pool(event_capacity=4)
    pool.set_limit("8M")
    pool.allocate(100, "scratch").free()     # segment_alloc, alloc, free_requested, _completed
    pool.set_limit(None)
    pool.empty_cache()                       # one segment_free
    assert pool.events_dropped == 1 + 4 + 1 + 1 - 4
    assert [(e.action, e.size) for e in pool.events()] == [
        ("free_requested", 512), ("free_completed", 512), ("limit", None),
        ("segment_free", 2 * MiB)]
    pool.set_limit(4 * MiB, return_free=False)       # nothing to keep or return here
    assert pool.limit_bytes == 4 * MiB and pool.events_dropped == 4


def test_set_limit_can_keep_the_free_segments():
    pool, raw = fake_pool()
    keep = pool.allocate(3 * MiB, "weights")
    pool.allocate(1000, "scratch").free()            # a fully free 2 MiB small segment
    pool.set_limit(2 * MiB, return_free=False)
    assert pool.reserved_bytes == 6 * MiB and len(raw.live) == 2
    pool.set_limit(2 * MiB)
    assert pool.reserved_bytes == 4 * MiB and len(raw.live) == 1
    pool.free(keep)


def test_snapshot_loads_back_and_blocks_tile_segments(tmp_path):
    pool = mem.get_pool("host")
    keep = [pool.allocate(n, t) for n, t in ((1000, "weights"), (3 * MiB, "kv_cache"),
                                             (7000, "logits"))]
    pool.allocate(20000, "scratch").free()
    path = tmp_path / "mem.pickle"
    mem.export_snapshot(path)
    with open(path, "rb") as f:
        assert f.read(2) == b"\x80\x04"        # pickle protocol 4
    snap = pickle.loads(path.read_bytes())
    assert len(snap["segments"]) == 2
    for seg in snap["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr and b["state"] in ("active_allocated", "inactive")
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"]
                                            if b["state"] == "active_allocated")
        assert seg["device"] == 0 and seg["segment_type"] in ("small", "large")
    cats = {b["category"] for s in snap["segments"] for b in s["blocks"]}
    assert cats == {"weights", "kv_cache", "logits", None}
    trace = snap["device_traces"][0]
    assert {e["action"] for e in trace} == {"segment_alloc", "alloc", "free_requested",
                                            "free_completed"}
    assert all(e["stream"] == 0 and e["frames"] == [] for e in trace)
    assert [e["category"] for e in trace if e["action"] == "alloc"] == [
        "weights", "kv_cache", "logits", "scratch"]
    del keep


def test_cupy_hook_without_cupy_raises_backend_unavailable():
    import importlib.util
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed; tests/memory/test_memory_gpu.py covers the hook on a GPU")
    from tinyloop.errors import BackendUnavailableError
    with pytest.raises(BackendUnavailableError):
        mem.install_cupy_allocator()
    assert mem.uninstall_cupy_allocator() is False


# --- finalizer frees and threads ----------------------------------------------------------
def test_finalizer_free_while_the_lock_is_held_is_deferred():
    pool, _ = fake_pool()
    blk = pool.allocate(100)
    with pool._lock:                            # as if the GC ran inside allocate()
        pool.free_from_finalizer(blk)
        assert not blk.freed
    assert pool.stats().allocated_bytes == 0 and blk.freed
    other = pool.allocate(100)
    pool.free_from_finalizer(other)            # lock free: immediate
    assert other.freed


def test_a_cuda_ops_dying_at_exit_reads_no_module_global(monkeypatch):
    """At interpreter exit a module's globals may already be None when a CudaOps is collected:
    its finalizer must not look ``sys`` up then (it printed an AttributeError traceback at the
    end of every GPU script that left a CudaOps alive)."""
    import importlib
    ops_mod = importlib.import_module("tinyloop.backends.cuda.ops")
    obj = object.__new__(ops_mod.CudaOps)      # no device needed: it holds no block
    monkeypatch.setattr(ops_mod, "sys", None)  # what shutdown leaves in the module
    ops_mod.CudaOps.__del__(obj)


def test_threads_allocate_and_free_concurrently():
    pool = MemoryPool("host")
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        live = []
        try:
            for i in range(400):
                if live and rng.random() < 0.5:
                    blk, fill = live.pop(rng.randrange(len(live)))
                    assert (blk.array(blk.requested_bytes, np.uint8) == fill).all()
                    blk.free()
                else:
                    n = (rng.randint(1, 64 * KiB) if rng.random() < 0.9
                         else rng.randint(MiB, 3 * MiB))
                    blk = pool.allocate(n, "scratch")
                    blk.array(n, np.uint8)[...] = seed
                    live.append((blk, seed))
                if i % 100 == 0:
                    pool.empty_cache()
            for blk, _ in live:
                blk.free()
        except BaseException as e:              # reported to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s = pool.stats()
    assert s.allocated_bytes == 0 and s.num_allocs == s.num_frees and s.active_blocks == 0
    pool._check()


# --- randomized property test -------------------------------------------------------------
SIZES = st.one_of(st.integers(0, 4096), st.integers(0, 2 * SMALL_REQUEST_MAX),
                  st.sampled_from([511, 512, 513, SMALL_REQUEST_MAX - 1, SMALL_REQUEST_MAX,
                                   SMALL_REQUEST_MAX + 1, 2 * MiB, 2 * MiB + 1]),
                  st.integers(2 * MiB, 9 * MiB))
OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), SIZES, st.sampled_from(TAGS)),
    st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("limit"), st.one_of(st.none(), st.integers(0, 24 * MiB))),
    st.tuples(st.just("reset_peak")),
), max_size=60)


def check_against_blocks(pool, raw, live, counts, peaks):
    """Every figure of ``pool.stats()`` recomputed from the blocks and the raw allocator."""
    pool._check()
    s = pool.stats()
    layout = pool.layout()
    # segments are exactly the raw allocator's live allocations, tiled by their blocks
    assert {seg["address"]: seg["size"] for seg in layout} == raw.live
    spans = []
    for seg in layout:
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr and b["size"] > 0 and b["size"] % ALIGNMENT == 0
            addr += b["size"]
            if b["live"]:
                spans.append((b["address"], b["address"] + b["size"]))
        assert addr == seg["address"] + seg["size"]
    # live blocks in the layout are exactly the test's live blocks, and none overlap
    assert sorted(spans) == sorted((b.ptr, b.ptr + b.nbytes) for b in live)
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    allocated = sum(b.nbytes for b in live)
    free_sizes = [b["size"] for seg in layout for b in seg["blocks"] if not b["live"]]
    assert s.allocated_bytes == allocated
    assert s.requested_bytes == sum(b.requested_bytes for b in live)
    assert s.reserved_bytes == raw.used_bytes == allocated + sum(free_sizes)
    assert s.pool_free_bytes == sum(free_sizes)
    assert s.largest_free_block_bytes == max(free_sizes, default=0)
    frag = 1 - max(free_sizes) / sum(free_sizes) if free_sizes else 0.0
    assert s.external_fragmentation == pytest.approx(frag)
    for t in TAGS:
        assert s.by_tag[t] == sum(b.nbytes for b in live if b.tag == t)
        assert s.peak_by_tag[t] == peaks["tag"][t]
    assert s.peak_allocated_bytes == peaks["allocated"]
    assert s.peak_reserved_bytes == peaks["reserved"]
    assert s.active_blocks == len(live) and s.segments == len(raw.live)
    assert (s.num_allocs, s.num_frees, s.num_ooms) == (counts["alloc"], counts["free"],
                                                       counts["oom"])
    assert s.num_segment_allocs == sum(1 for op, *_ in raw.log if op == "malloc")
    assert s.num_segment_releases == sum(1 for op, *_ in raw.log if op == "free")
    assert all(b.nbytes == round_size(b.requested_bytes) for b in live)


def run_ops(ops, capacity):
    pool, raw = fake_pool(capacity=capacity)
    live, counts = [], {"alloc": 0, "free": 0, "oom": 0}
    peaks = {"allocated": 0, "reserved": 0, "tag": dict.fromkeys(TAGS, 0)}
    for op in ops:
        if op[0] == "alloc":
            try:
                live.append(pool.allocate(op[1], op[2]))
                counts["alloc"] += 1
            except OutOfMemoryError as e:
                counts["oom"] += 1
                assert e.requested_bytes == op[1] and e.tag == op[2]
        elif op[0] == "free" and live:
            live.pop(op[1] % len(live)).free()
            counts["free"] += 1
        elif op[0] == "empty_cache":
            pool.empty_cache()
        elif op[0] == "limit":
            pool.set_limit(op[1])
        elif op[0] == "reset_peak":
            pool.reset_peak_stats()
            peaks["allocated"] = sum(b.nbytes for b in live)
            peaks["reserved"] = raw.used_bytes
            peaks["tag"] = {t: sum(b.nbytes for b in live if b.tag == t) for t in TAGS}
        peaks["allocated"] = max(peaks["allocated"], sum(b.nbytes for b in live))
        peaks["reserved"] = max(peaks["reserved"], raw.used_bytes)
        for t in TAGS:
            peaks["tag"][t] = max(peaks["tag"][t], sum(b.nbytes for b in live if b.tag == t))
        check_against_blocks(pool, raw, live, counts, peaks)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.one_of(st.none(), st.integers(0, 32 * MiB)))
def test_property_counters_equal_a_recomputation_from_the_blocks(ops, capacity):
    run_ops(ops, capacity)


def test_long_random_trace_keeps_every_invariant():
    rng = random.Random(7)
    ops = []
    for _ in range(4000):
        r = rng.random()
        if r < 0.5:
            ops.append(("alloc", rng.choice([rng.randint(0, 8192), rng.randint(0, 3 * MiB)]),
                        rng.choice(TAGS)))
        elif r < 0.97:
            ops.append(("free", rng.randrange(1 << 30)))
        else:
            ops.append(("empty_cache",))
    run_ops(ops, 64 * MiB)


# --- the serving rule against an independent model of the pool ---------------------------
# What the pool promises (MemoryPool.allocate): a request of r bytes (rounded up to 512, at
# least 512) is served whenever one free range of a held segment is at least r long, or a new
# segment of r bytes fits under the limit (rounded up to 512) and the device once every fully
# free segment is returned. The model below knows only the raw allocator's segments and the
# blocks the test holds: free ranges are the gaps between those blocks inside each segment.

def _model_round(n):
    return max(512, -(-n // 512) * 512)


def _model_free_ranges(raw, live):
    """[(segment ptr, segment size, [gap sizes])] from the raw segments and the live blocks."""
    out = []
    for ptr, size in raw.live.items():
        inside = sorted((b.ptr, b.nbytes) for b in live if ptr <= b.ptr < ptr + size)
        gaps, at = [], ptr
        for p, n in inside:
            assert p >= at, "blocks overlap"
            if p > at:
                gaps.append(p - at)
            at = p + n
        assert at <= ptr + size, "a block runs past its segment"
        if at < ptr + size:
            gaps.append(ptr + size - at)
        out.append((ptr, size, gaps, bool(inside)))
    return out


def _model_room(raw, live, limit, capacity):
    """(largest free range, room for a new segment or None) in the model."""
    ranges = _model_free_ranges(raw, live)
    largest = max((g for *_, gaps, _ in ranges for g in gaps), default=0)
    pinned = sum(size for _, size, _, used in ranges if used)
    bounds = [x for x in (limit, capacity) if x is not None]
    return largest, (min(bounds) - pinned if bounds else None)


def _model_serves(r, raw, live, limit, capacity):
    largest, room = _model_room(raw, live, limit, capacity)
    return r <= largest or room is None or r <= room


def _check_model_oom(e, r, raw, live, limit):
    """An out-of-memory the model agrees with, whose error states the largest free range,
    the room the limit leaves and why."""
    largest, _ = _model_room(raw, live, limit, None)
    assert r > largest
    assert e.largest_free_bytes == largest and f"({largest} bytes)" in str(e)
    pinned = sum(size for _, size, _, used in _model_free_ranges(raw, live) if used)
    if limit is None:
        assert e.room_bytes is None
    else:
        assert e.room_bytes == max(0, limit - pinned) and f"{limit} - {pinned} bytes" in str(e)
    assert "no new segment can be had" in str(e)


def _check_accounting(pool, raw, live):
    pool._check()
    s = pool.stats()
    assert s.allocated_bytes == sum(b.nbytes for b in live)
    assert s.requested_bytes == sum(b.requested_bytes for b in live)
    assert s.reserved_bytes == raw.used_bytes == sum(raw.live.values())
    assert s.pool_free_bytes == sum(g for *_, gaps, _ in _model_free_ranges(raw, live)
                                    for g in gaps)
    for t in TAGS:
        assert s.by_tag[t] == sum(b.nbytes for b in live if b.tag == t)


MIXED = st.one_of(st.integers(0, 8 * KiB), st.integers(0, SMALL_REQUEST_MAX + 4 * KiB),
                  st.sampled_from([SMALL_REQUEST_MAX, SMALL_REQUEST_MAX + 1, 2 * MiB - 512,
                                   2 * MiB, 2 * MiB + 1]),
                  st.integers(2 * MiB, 5 * MiB))
SERVE_OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), MIXED, st.booleans(), st.sampled_from(TAGS)),
    st.tuples(st.just("batch"), st.integers(0, 96 * KiB), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("limit"), st.one_of(st.none(), st.integers(0, 12 * MiB))),
), max_size=40)


def _serve_step(pool, raw, live, op, limit, capacity):
    """Apply ``op`` one block at a time (a batch: block by block, the carved ones freed again
    on failure), checking each allocation against the model. Returns (blocks made, error)."""
    kind, nbytes, *rest = op
    n, packed_ = (1, rest[0]) if kind == "alloc" else (rest[0], rest[1])
    tag = rest[1] if kind == "alloc" else "kv_cache"
    r = _model_round(nbytes)
    made = []
    with (mem.packed_scope() if packed_ else contextlib.nullcontext()):
        for _ in range(n):
            serves = _model_serves(r, raw, live + made, limit, capacity)
            before = pool.reserved_bytes
            try:
                blk = pool.allocate(nbytes, tag)
            except OutOfMemoryError as e:
                assert not serves, f"{r} bytes refused though the model serves them: {e}"
                _check_model_oom(e, r, raw, live + made, limit)
                for b in made:
                    b.free()
                return [], (len(made), e)
            assert blk.nbytes == r
            if limit is not None:
                assert pool.reserved_bytes <= max(limit, before)
            made.append(blk)
    return made, None


def _blocks_of(blocks):
    return [(b.ptr, b.nbytes, b.requested_bytes, b.tag) for b in blocks]


def run_serving(ops, limit, capacity):
    """Pool ``a`` runs every op as the pool does it (``allocate_many`` for a batch), pool
    ``ref`` one block at a time against the model; both must end each step in the same
    layout, and ``a``'s batch errors must name the whole batch."""
    a_raw, ref_raw = FakeRawAllocator(capacity=capacity), FakeRawAllocator(capacity=capacity)
    a = MemoryPool(raw_allocator=a_raw, limit_bytes=limit)
    ref = MemoryPool(raw_allocator=ref_raw, limit_bytes=limit)
    limit = None if limit is None else -(-limit // 512) * 512
    a_live, ref_live = [], []
    for op in ops:
        if op[0] in ("alloc", "batch"):
            made, err = _serve_step(ref, ref_raw, ref_live, op, limit, capacity)
            if op[0] == "alloc":
                try:
                    with (mem.packed_scope() if op[2] else contextlib.nullcontext()):
                        got = [a.allocate(op[1], op[3])]
                except OutOfMemoryError:
                    got = None
            else:
                _, nbytes, n, packed_ = op
                try:
                    with (mem.packed_scope() if packed_ else contextlib.nullcontext()):
                        got = a.allocate_many(nbytes, n, "kv_cache")
                except OutOfMemoryError as e:
                    got = None
                    fitted, _ = err
                    assert (e.requested_bytes, e.blocks) == (nbytes * n, n)
                    if n > 1:
                        assert f"a batch of {n} blocks of {_model_round(nbytes)} bytes" \
                            in str(e) and f"held {fitted} of them" in str(e)
                    largest, _ = _model_room(a_raw, a_live, limit, None)
                    assert e.largest_free_bytes == largest          # without the batch
            assert (got is None) == (err is not None), (op, err)
            if got is not None:
                assert _blocks_of(got) == _blocks_of(made)
                a_live += got
                ref_live += made
        elif op[0] == "free" and a_live:
            i = op[1] % len(a_live)
            a_live.pop(i).free()
            ref_live.pop(i).free()
        elif op[0] == "empty_cache":
            assert a.empty_cache() == ref.empty_cache()
        elif op[0] == "limit":
            a.set_limit(op[1])
            ref.set_limit(op[1])
            limit = a.limit_bytes
        assert a.layout() == ref.layout() and a_raw.live == ref_raw.live
        _check_accounting(a, a_raw, a_live)
        _check_accounting(ref, ref_raw, ref_live)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=SERVE_OPS, limit=st.one_of(st.none(), st.integers(0, 12 * MiB)),
       capacity=st.one_of(st.none(), st.integers(0, 12 * MiB)))
def test_property_a_request_the_free_bytes_can_serve_is_served(ops, limit, capacity):
    run_serving(ops, limit, capacity)


def test_packed_request_is_served_from_a_small_segment_a_live_block_pins():
    """The small segment holds a 4 KiB block; a packed (large-class) 8 KiB request under a
    2 MiB limit has no room for a segment of its own and takes the small segment's free
    range."""
    pool, raw = fake_pool(limit_bytes=2 * MiB)
    a = pool.allocate(4 * KiB, "prefix_cache")
    with mem.packed_scope():
        b = pool.allocate(8 * KiB, "kv_cache")
    assert (a.ptr, b.ptr) == (B, B + 4 * KiB) and raw.log == [("malloc", B, 2 * MiB)]
    assert pool.stats().pool_free_bytes == 2 * MiB - 12 * KiB
    with mem.packed_scope():                   # and a batch of pages, likewise
        pages = pool.allocate_many(16 * KiB, 4, "kv_cache")
    assert [p.ptr for p in pages] == [B + 12 * KiB + i * 16 * KiB for i in range(4)]
    pool._check()


def test_small_request_is_served_from_a_large_segment_when_the_limit_is_full():
    pool, raw = fake_pool(limit_bytes=4 * MiB)
    with mem.packed_scope():
        w = pool.allocate(3 * MiB, "weights")          # one 4 MiB segment: the limit
    s = pool.allocate(100, "scratch")                  # small: no 2 MiB segment fits
    assert s.ptr == w.ptr + 3 * MiB and len(raw.live) == 1
    with pytest.raises(OutOfMemoryError) as ei:        # more than the free range left
        pool.allocate(MiB, "scratch")
    e = ei.value
    assert e.largest_free_bytes == MiB - 512 and e.room_bytes == 0
    assert f"({MiB - 512} bytes)" in str(e) and "4194304 - 4194304 bytes" in str(e)


def test_batch_error_names_the_batch_and_not_its_own_pages():
    """A batch that does not fit: the error's request is the whole batch, and the free bytes
    it shows are the pool's after the batch's pages went back (not the batch's pages)."""
    pool, _ = fake_pool(limit_bytes=2 * MiB)
    with mem.packed_scope():
        keep = pool.allocate(2 * MiB - 48 * KiB, "weights")
        with pytest.raises(OutOfMemoryError) as ei:
            pool.allocate_many(16 * KiB, 4, "kv_cache")
    e = ei.value
    assert (e.requested_bytes, e.blocks, e.tag) == (64 * KiB, 4, "kv_cache")
    assert e.allocated_bytes == keep.nbytes and e.largest_free_bytes == 48 * KiB
    msg = str(e)
    assert "a batch of 4 blocks of 16384 bytes (64.0 KiB in all" in msg
    assert "held 3 of them" in msg and "(49152 bytes) of 48.0 KiB free without the batch" in msg
    assert pool.stats().allocated_bytes == keep.nbytes


# --- every byte named: the driver's bytes outside the pool --------------------------------
def test_report_names_the_driver_lines_and_the_rest_is_unattributed():
    """Fake NVML readings: the context at the pool's creation, then module loads, the first
    cuBLAS call (whose output takes a pool segment) and a graph made and destroyed; every line
    is what its measurement saw beyond the pool's own segments, and unattributed is the rest."""
    raw = FakeRawAllocator(device="cuda", nvml_bytes=500 * MiB)
    pool = MemoryPool(raw_allocator=raw)
    with mem.packed_scope():
        w = pool.allocate(3 * MiB, "weights")          # a 4 MiB segment
    raw.nvml_bytes += 4 * MiB
    with pool.measure_driver("kernel modules"):
        raw.nvml_bytes += 6 * MiB
    with pool.measure_driver("kernel modules"):       # a module already loaded: nothing
        pass
    with pool.measure_driver("cublas workspace"):
        y = pool.allocate(100, "cupy")                  # the product: a 2 MiB pool segment
        raw.nvml_bytes += 2 * MiB + 8 * MiB             # that segment + the workspace
    with pool.measure_driver("cuda graphs"):
        raw.nvml_bytes += 2 * MiB
    with pool.measure_driver("cuda graphs"):            # destroyed: the line goes back to 0
        raw.nvml_bytes -= 2 * MiB
    raw.nvml_bytes += MiB                               # something nothing measured
    s = pool.stats()
    assert s.process_bytes == 500 * MiB + 4 * MiB + 6 * MiB + 10 * MiB + MiB
    assert s.reserved_bytes == 6 * MiB
    assert s.driver_bytes == {"cuda context": 500 * MiB, "kernel modules": 6 * MiB,
                              "cublas workspace": 8 * MiB, "cuda graphs": 0}
    assert s.unattributed_bytes == s.process_bytes - 6 * MiB - 514 * MiB == MiB
    lines = s.report().splitlines()
    want = {"cuda context (NVML": "500.0 MiB", "kernel modules (NVML": "6.0 MiB",
            "cublas workspace (NVML": "8.0 MiB", "cuda graphs (NVML": "0 B",
            "unattributed (process - reserved - the lines above)": "1.0 MiB"}
    for label, figure in want.items():
        (line,) = [ln for ln in lines if ln.strip().startswith(label)]
        assert line.endswith(f" {figure}") and len(line) == 56 + 12, (label, line)
    del w, y


def test_report_without_nvml_names_no_driver_line():
    raw = FakeRawAllocator(device="cuda")               # NVML cannot see the process
    pool = MemoryPool(raw_allocator=raw)
    with pool.measure_driver("kernel modules"):
        pass
    s = pool.stats()
    assert s.driver_bytes == {} and s.unattributed_bytes is None
    assert "kernel modules" not in s.report() and "install pynvml" in s.report()


# Calls that allocate memory outside the pool: raw runtime/driver allocators (any receiver)
# and CuPy's array constructors. Outside tinyloop/memory/ none may appear, except in the
# one function whose CuPy temporaries the cupy hook routes through the pool on purpose (the
# array-code reference of the sampler).
_RAW_ALLOC = {"malloc", "mallocHost", "hostAlloc", "mallocManaged", "mallocAsync",
              "mallocFromPoolAsync", "mallocPitch", "malloc3D", "mallocArray", "memAlloc",
              "memAllocHost", "memHostAlloc", "memAllocManaged", "memAllocAsync",
              "alloc_pinned_memory", "PinnedMemory", "ManagedMemory", "MemoryPool",
              "PinnedMemoryPool", "MemoryAsyncPool"}
_CUPY_ALLOC = {"alloc", "malloc_managed", "malloc_async", "Memory"}     # cupy.cuda.<name>
_CUPY_NEW = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like",
             "full_like", "asarray", "array", "ascontiguousarray", "arange", "copy"}
_ALLOWED: set = set()     # (file under tinyloop/, function) pairs exempt from the check


def _dotted(node):
    import ast
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def raw_allocation_calls(source: str, filename: str = "<src>") -> list:
    """(line, enclosing function, call) of every call in ``source`` that allocates outside
    the pool (see _RAW_ALLOC / _CUPY_NEW)."""
    import ast
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                name = _dotted(child.func)
                head, last = name.split(".")[0], child.func.attr
                cupy_call = head in ("cupy", "cp")
                if (last in _RAW_ALLOC and head != "np") or (
                        cupy_call and name.count(".") == 1 and last in _CUPY_NEW) or (
                        cupy_call and last in _CUPY_ALLOC):
                    out.append((child.lineno, func, name))
            visit(child, func)

    visit(ast.parse(source, filename), None)
    return out


def test_the_raw_allocation_finder_finds_each_kind():
    src = ("import cupy\n"
           "def f(rt, n):\n"
           "    a = cupy.cuda.runtime.malloc(n)\n"
           "    b = rt.hostAlloc(8, 3)\n"
           "    c = cupy.cuda.alloc_pinned_memory(64)\n"
           "    d = cupy.empty(3)\n"
           "    e = cupy.exp(d)\n"            # an operation: routed by the cupy hook
           "    g = pool.allocate(10)\n"
           "    h = cupy.cuda.alloc(256)\n"
           "    return cupy.cuda.runtime.memset(a, 0, n)\n")
    assert [(ln, name) for ln, _, name in raw_allocation_calls(src)] == [
        (3, "cupy.cuda.runtime.malloc"), (4, "rt.hostAlloc"),
        (5, "cupy.cuda.alloc_pinned_memory"), (6, "cupy.empty"), (9, "cupy.cuda.alloc")]


def test_no_allocation_outside_the_memory_package_bypasses_the_pool():
    import pathlib
    import tinyloop
    root = pathlib.Path(tinyloop.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("memory/"):
            continue
        for line, func, name in raw_allocation_calls(path.read_text(encoding="utf-8"), rel):
            if (rel, func) not in _ALLOWED:
                found.append(f"tinyloop/{rel}:{line} {func}: {name}")
    assert not found, "allocations outside the pool:\n" + "\n".join(found)


# --- with a real (tiny, synthetic) model on the NumPy backend ------------------------------
def test_empty_cache_keeps_the_model_working(tiny_model_path):
    import tinyloop
    start = mem.memory_stats("host").allocated_bytes
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        first = m.generate([1, 2, 3], max_new_tokens=4).token_ids
        before = mem.memory_stats("host")
        released = mem.empty_cache()
        after = mem.memory_stats("host")
        assert after.reserved_bytes == before.reserved_bytes - released
        assert after.allocated_bytes == before.allocated_bytes
        assert m.generate([1, 2, 3], max_new_tokens=4).token_ids == first
    finally:
        tinyloop.free_model(m)
    assert mem.memory_stats("host").allocated_bytes == start


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pool_objects():
    """Live instances of the pool's and the KV cache's own classes the collector tracks."""
    from tinyloop.kv import Page, PageAllocator, RuntimeKVCache
    from tinyloop.memory.arena import Chunk, Segment
    from tinyloop.model import Model
    kinds = (Chunk, Segment, mem.Block, mem.MemoryPool, Page, PageAllocator, RuntimeKVCache,
             Model)
    return collections.Counter(type(o).__name__ for o in gc.get_objects()
                               if isinstance(o, kinds))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's statm")
def test_free_model_returns_host_memory_at_once_without_the_collector(tmp_path):
    """NumPy backend: free_model + empty_cache gives the segments' pages back to the OS while
    the cycle collector is off, and a collection afterwards finds no pool object in a cycle."""
    path = tmp_path / "wide.tlm"       # float32 weight copies of some 60 MiB, all touched
    write_synthetic(path, synthetic_config(vocab_size=2000, d_model=512, n_heads=8,
                                           n_kv_heads=4, head_dim=64, ffn_dim=2048,
                                           n_prelude=1, n_recurrent=2, n_coda=1,
                                           max_depth=2), seed=5)
    import tinyloop
    gc.collect()
    gc.disable()
    try:
        m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
        m.generate([1, 2, 3], max_new_tokens=3)
        with m.prefill([1, 2, 3, 4]) as p:
            m.generate([1, 2, 3, 4, 5], max_new_tokens=2, prefix=p)
        pool = mem.get_pool("host")
        buffers = [weakref.ref(seg.handle.base) for seg in pool._arena.segments.values()]
        rss_loaded = _rss_bytes()
        tinyloop.free_model(m)
        del m, p
        released = mem.empty_cache()
        rss_freed = _rss_bytes()
        assert released >= 60 * MiB
        assert all(r() is None for r in buffers), "a released segment's buffer is alive"
        assert rss_loaded - rss_freed >= 0.75 * released, (rss_loaded, rss_freed, released)
        before = _pool_objects()
        gc.collect()
        assert _pool_objects() == before, "the collector freed pool objects: a cycle held them"
    finally:
        gc.enable()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's statm")
def test_a_released_host_segment_leaves_the_process_whatever_the_c_heap_did_before():
    """Host segments are their own memory maps: once glibc's malloc has raised its mmap
    threshold (freeing a large block does that), a segment from the C heap with live heap
    blocks after it could not be given back, and its pages stayed resident after release."""
    import ctypes
    from tinyloop.memory.raw import HostRawAllocator
    big = np.ones(30 * MiB, np.uint8)
    del big                                      # glibc's mmap threshold now sits near 30 MiB
    raw = HostRawAllocator()
    segs, pins = [], []
    for _ in range(8):
        _, h = raw.malloc(8 * MiB)
        h[:] = 1                                 # resident
        segs.append(h)
        pins.append(ctypes.create_string_buffer(200_000))    # heap blocks after each segment
    loaded = _rss_bytes()
    segs.clear()
    assert loaded - _rss_bytes() >= 0.75 * 64 * MiB
    assert len(pins) == 8


def test_load_over_budget_raises_ours_and_leaves_nothing(tiny_model_path):
    import tinyloop
    start = mem.memory_stats("host")
    mem.set_memory_limit(start.reserved_bytes + 4 * KiB, "host")
    with pytest.raises(OutOfMemoryError) as ei:
        tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    assert ei.value.limit_bytes == start.reserved_bytes + 4 * KiB
    after = mem.memory_stats("host")
    assert after.allocated_bytes == start.allocated_bytes and after.num_ooms == 1


def _mid_model(tmp_path):
    """A model whose float32 weight copies (phase 3 on the NumPy backend) are most of it."""
    path = tmp_path / "mid.tlm"
    write_synthetic(path, synthetic_config(vocab_size=300, d_model=256, n_heads=4,
                                           n_kv_heads=2, head_dim=64, ffn_dim=1024,
                                           n_prelude=1, n_recurrent=2, n_coda=1, max_depth=2),
                    seed=3)
    return str(path)


def _planned_phase_bytes(path):
    """{phase: bytes} of a NumPy load at max_seq_len 64, each entry rounded up to whole
    512-byte blocks, from the plan's shapes and dtypes (lazy entries excluded)."""
    from tinyloop.backends.numpy_ops import NumpyOps
    from tinyloop.format import read_tlm
    from tinyloop.plan import backend_load_plan
    with read_tlm(path) as f:
        plan = backend_load_plan(NumpyOps, f.config, f.quant_layout(), 64, 0)
    out = {}
    for e in plan:
        if not e.lazy:
            n = int(np.prod(e.shape)) * np.dtype(e.dtype).itemsize
            out[e.phase] = out.get(e.phase, 0) + max(512, -(-n // 512) * 512)
    return out


def test_load_512_bytes_short_of_its_limit_fails_up_front_naming_the_plan(tmp_path):
    import tinyloop
    path = _mid_model(tmp_path)
    phases = _planned_phase_bytes(path)
    total = sum(phases.values())
    assert sorted(phases) == [2, 3, 4] and phases[3] > phases[2] + phases[4]
    pool = mem.get_pool("host")
    mem.set_memory_limit(total - 512, "host")
    with pytest.raises(OutOfMemoryError) as ei:
        tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    e, s = ei.value, pool.stats()
    assert (s.num_allocs, s.num_segment_allocs, s.num_ooms) == (0, 0, 1)   # before anything
    assert (e.requested_bytes, e.room_bytes, e.limit_bytes) == (total, total - 512, total - 512)
    msg = str(e)
    assert f"needs {mem.stats.fmt_bytes(total)} ({total} bytes" in msg
    assert all(f"= {phases[ph]}" in msg for ph in phases)
    assert "512 bytes short from the buffer pool phase on (tag 'buffers')" in msg
    assert e.tag == "buffers" and "FP16_CACHE" not in msg     # the copies fit: not the cause
    mem.set_memory_limit(total, "host")                       # exactly the plan: it loads
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    try:
        s = pool.stats()
        assert s.allocated_bytes == total and s.reserved_bytes == total and s.num_ooms == 1
    finally:
        tinyloop.free_model(m)


def test_load_that_fits_only_phase_by_phase_is_packed_per_phase(tmp_path, monkeypatch):
    """The device has no contiguous range for the whole load but one for each phase: each
    phase gets one segment of exactly its planned bytes, so a limit of the plan's total fits
    (one 2 MiB-rounded segment per tensor would not)."""
    import tinyloop
    path = _mid_model(tmp_path)
    phases = _planned_phase_bytes(path)
    total, biggest = sum(phases.values()), max(phases.values())
    pool = mem.get_pool("host")
    real = pool._raw.malloc
    sizes = []

    def malloc(nbytes):
        if nbytes > biggest:
            raise MemoryError(f"no contiguous {nbytes} bytes")
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(pool._raw, "malloc", malloc)
    mem.set_memory_limit(total, "host")
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    try:
        s = pool.stats()
        assert sizes == [phases[2], phases[3], phases[4]]
        assert s.allocated_bytes == s.reserved_bytes == total and s.num_ooms == 0
        mem.set_memory_limit(None, "host")          # room for a request's KV pages
        assert m.generate([1, 2, 3], max_new_tokens=2).token_ids
    finally:
        tinyloop.free_model(m)


class _FakeCupy:
    """Just enough of ``cupy.cuda`` for the allocator hook: get/set_allocator and the two
    memory wrappers (the hook's bookkeeping is pure Python, so it is tested without a GPU)."""

    def __init__(self):
        import types
        self.current = "cupy-default"
        cuda = types.SimpleNamespace()
        cuda.get_allocator = lambda: self.current
        cuda.set_allocator = self._set
        cuda.UnownedMemory = lambda ptr, size, owner, dev: (ptr, size, owner, dev)
        cuda.MemoryPointer = lambda mem, off: mem
        self.cuda = cuda

    def _set(self, fn):
        self.current = fn


@pytest.fixture
def fake_cupy(monkeypatch):
    import sys
    from tinyloop.memory import cupy_hook
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    yield fake
    cupy_hook.reset_for_tests()


def test_cupy_installs_are_tokens_removing_one_keeps_the_others(fake_cupy):
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    a = mem.install_cupy_allocator(pool)
    b = mem.install_cupy_allocator(pool, tag="scratch")
    assert fake_cupy.current is b.allocate
    assert a.uninstall() is True                 # not on top: b now restores the default
    assert fake_cupy.current is b.allocate and not a.installed and b.installed
    assert a.uninstall() is False
    ptr, size, owner, _ = fake_cupy.current(1000)
    assert pool.by_tag()["scratch"] == size == 1024
    del owner
    assert pool.by_tag()["scratch"] == 0         # CuPy dropping the memory frees the block
    with b:
        pass
    assert fake_cupy.current == "cupy-default"
    assert mem.uninstall_cupy_allocator() is False


def test_cupy_routing_is_counted_and_never_removes_a_users_install(fake_cupy):
    from tinyloop.memory.cupy_hook import cupy_allocator_installed
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    first = mem.route_cupy_allocations(pool)         # a first CUDA model
    routed = fake_cupy.current
    user = mem.install_cupy_allocator(pool, tag="other")   # the user's own install on top
    second = mem.route_cupy_allocations(pool)        # a second model shares the routing
    assert fake_cupy.current is user.allocate
    first.release()
    first.release()                                  # idempotent: counts once
    assert second.active and not first.active
    second.release()                                 # the last holder: routing removed...
    assert user.installed and fake_cupy.current is user.allocate   # ...the user's stays
    user.uninstall()
    assert fake_cupy.current == "cupy-default" and not cupy_allocator_installed()
    again = mem.route_cupy_allocations(pool)         # a fresh routing after the last release
    assert fake_cupy.current is not routed and fake_cupy.current != "cupy-default"
    again.release()
    assert fake_cupy.current == "cupy-default"


# --- a limit that is not a multiple of 512 B -----------------------------------------------
@pytest.mark.parametrize("limit", [100_000_000, 1000, 512 * 7 + 1, 3 * MiB + 1])
def test_allocation_of_exactly_a_100_000_000_byte_limit_fits_an_empty_pool(limit):
    pool, raw = fake_pool(limit_bytes=limit)
    want = -(-limit // ALIGNMENT) * ALIGNMENT             # the limit in whole 512-byte blocks
    assert pool.limit_bytes == want
    blk = pool.allocate(limit, "weights")
    assert blk.nbytes == round_size(limit) == want
    s = pool.stats()
    assert s.reserved_bytes <= s.limit_bytes == want
    with pytest.raises(OutOfMemoryError):                 # and not a byte more
        pool.allocate(1)
    blk.free()
    pool._check()


def test_percentage_limit_is_rounded_to_blocks_and_fits_an_allocation_of_itself():
    total = 1000 * MiB + 123                              # 7% of it is not a multiple of 512
    pool, _ = fake_pool(total_bytes=total)
    pool.set_limit("7%")
    exact = int(total * 7 / 100)
    assert exact % ALIGNMENT and pool.limit_bytes == round_size(exact)
    pool.allocate(exact).free()
    mem.set_memory_limit(100_000_001, device="host")
    assert mem.get_pool("host").limit_bytes == round_size(100_000_001)
    mem.get_pool("host").allocate(100_000_001).free()


# --- releasing at interpreter exit ----------------------------------------------------------
def _imports_fail(monkeypatch):
    """Make every import statement fail as it does once ``sys.meta_path`` is None."""
    import builtins

    def no_import(*args, **kwargs):
        raise ImportError("sys.meta_path is None, Python is likely shutting down")
    monkeypatch.setattr(builtins, "__import__", no_import)


def test_cupy_routing_release_imports_nothing_as_at_exit(fake_cupy, monkeypatch):
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    user = mem.install_cupy_allocator(pool, tag="other")
    routing = mem.route_cupy_allocations(pool)
    with monkeypatch.context() as m:
        _imports_fail(m)
        routing.release()                  # the CUDA model's release path
        assert user.uninstall()
    assert fake_cupy.current == "cupy-default"


def test_model_free_imports_nothing_as_at_exit(tiny_model_path, monkeypatch):
    import tinyloop
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    m.generate([1, 2, 3], max_new_tokens=2)
    with monkeypatch.context() as mp:
        _imports_fail(mp)
        m.free()
    assert tinyloop.vram_usage_bytes(m) == 0 and mem.get_pool("host").allocated_bytes == 0
