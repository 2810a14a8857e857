"""diagnostics: the verdict on synthetic record series (exact and noisy), the trace analysis and
replay on an isolated pool, the planted faults, and the CLI end to end on a tiny model."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diagnostics import (ReplayDiverged, analyze_trace, classify, linear_fit, replay_policies,
                         replay_trace)
from diagnostics.__main__ import main
from diagnostics.faults import PlantedCache, PlantedLeak
from diagnostics.fragment import layout_state
from diagnostics.verdict import (BOUNDED_CACHE_FILLING, INCONCLUSIVE, LEAK, MIN_REQUESTS, STABLE,
                                 UNBOUNDED_CACHE, noise_band, points_needed, settled_from)
from tinyloop.backends import cuda_available
from tinyloop.memory import FakeRawAllocator, MemoryPool, _reset_pools_for_tests

MIB = 1 << 20
BASE = 600 * MIB


@pytest.fixture(autouse=True)
def fresh_pools():
    """Each test starts from new process pools (blocks of earlier tests keep their old pool)."""
    _reset_pools_for_tests()
    yield
    _reset_pools_for_tests()


def series(alloc, reserved, tags=None, peaks=None):
    """Records 1..n from per-request allocated / reserved figures (and optional by_tag)."""
    out = []
    for i, (a, r) in enumerate(zip(alloc, reserved)):
        rec = {"request": i + 1, "allocated_bytes": int(a), "reserved_bytes": int(r)}
        if tags is not None:
            rec["by_tag"] = tags[i]
        if peaks is not None:
            rec["peak_reserved_bytes"] = int(peaks[i])
        out.append(rec)
    return out


# --- the verdict, on synthetic series ---------------------------------------------------------

def test_linear_fit_matches_polyfit():
    rng = np.random.default_rng(1)
    y = 1e9 + 3000.0 * np.arange(50) + rng.normal(0, 500, 50)
    f = linear_fit(y)
    slope, intercept = np.polyfit(np.arange(50), y, 1)
    assert abs(f.slope - slope) <= 1e-6 * abs(slope)
    assert abs(f.intercept - intercept) <= 1e-6 * abs(intercept)
    assert 0 < f.stderr < 50 and f.t > 50
    exact = linear_fit(1e9 + 4096.0 * np.arange(30))
    assert exact.slope == pytest.approx(4096.0) and exact.stderr == 0 and exact.t == np.inf


def test_stable_exact_after_first_request():
    n = 40
    alloc = [BASE - 1536] + [BASE] * (n - 1)          # the logit row is made by request 1
    v = classify(series(alloc, [BASE + 8 * MIB] * n))
    assert v.verdict == STABLE
    assert v.leak_bytes_per_request == 0 and v.reserved_bytes_per_request == 0
    assert v.stable_from <= 2 and v.growing_tag is None
    assert any("identical" in e for e in v.evidence)


def test_leak_exact_rate_and_tag():
    n = 200
    alloc = [BASE + 4096 * i for i in range(n)]
    reserved = [BASE + 8 * MIB + 2 * MIB * (i // 512) for i in range(n)]
    tags = [{"weights": BASE, "other": 4096 * i, "kv_cache": 0} for i in range(n)]
    v = classify(series(alloc, reserved, tags))
    assert v.verdict == LEAK
    assert v.leak_bytes_per_request == pytest.approx(4096)
    assert v.growing_tag == "other"
    assert v.tag_bytes_per_request["weights"] == 0


@pytest.mark.parametrize("seed", range(4))
def test_leak_noisy_rate_within_10_percent(seed):
    rng = np.random.default_rng(seed)
    n = 200
    alloc = BASE + 4096 * np.arange(n) + rng.normal(0, 20_000, n)   # sigma ~ 5x the rate
    v = classify(series(alloc, [BASE + 16 * MIB] * n))
    assert v.verdict == LEAK
    assert abs(v.leak_bytes_per_request - 4096) <= 0.1 * 4096


@pytest.mark.parametrize("seed", range(6))
def test_stable_noisy(seed):
    """A retained buffer whose size varies per request (noise, no trend) is not a leak."""
    rng = np.random.default_rng(seed)
    n = 120
    alloc = BASE + rng.normal(0, 20_000, n)
    v = classify(series(alloc, [BASE + 16 * MIB] * n))
    assert v.verdict == STABLE, v.reason
    assert any("varies within" in e for e in v.evidence)


def test_noisy_leak_too_short_is_inconclusive_and_says_how_many():
    """20 requests with noise 5x the rate: never called STABLE, mostly INCONCLUSIVE with an
    estimate above 20; 200 requests of the same process decide it."""
    verdicts = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        alloc = BASE + 4096 * np.arange(200) + rng.normal(0, 20_000, 200)
        v = classify(series(alloc[:20], [BASE + 16 * MIB] * 20))
        verdicts.append(v.verdict)
        assert v.verdict != STABLE
        if v.verdict == INCONCLUSIVE:
            assert v.requests_needed > 20
        assert classify(series(alloc, [BASE + 16 * MIB] * 200)).verdict == LEAK
    assert verdicts.count(INCONCLUSIVE) >= 7


def test_unbounded_cache_staircase():
    n = 60
    reserved = [BASE + 2 * MIB * ((i + 1) // 2) for i in range(n)]    # 2 MiB every 2 requests
    v = classify(series([BASE] * n, reserved))
    assert v.verdict == UNBOUNDED_CACHE
    assert v.leak_bytes_per_request == 0
    assert abs(v.reserved_bytes_per_request - MIB) <= 0.1 * MIB


def test_unbounded_cache_seen_in_peaks_only():
    """A cache the request grows and trims again before it ends: the high-water mark grows."""
    n = 40
    peaks = [BASE + 4 * MIB * i for i in range(n)]
    v = classify(series([BASE] * n, [BASE + MIB] * n, peaks=peaks))
    assert v.verdict == UNBOUNDED_CACHE


def test_accounted_cache_growth_is_unbounded_cache_not_leak():
    """Allocated grows exactly as much as a self-accounting cache says it holds."""
    n = 40
    cache = [32768 * (i + 1) for i in range(n)]
    recs = series([BASE + c for c in cache], [BASE + 8 * MIB + 2 * MIB * (i // 64)
                                              for i in range(n)],
                  tags=[{"weights": BASE, "prefix_cache": c} for c in cache])
    for r, c in zip(recs, cache):
        r.update(cache_bytes=c, cache_tag="prefix_cache")
    v = classify(recs)
    assert v.verdict == UNBOUNDED_CACHE, v.reason
    assert v.growing_tag == "prefix_cache" and "'prefix_cache'" in v.reason
    assert v.cache_bytes_per_request == pytest.approx(32768)
    # the same records with 4 KiB per request beyond what the cache accounts for: a leak
    for i, r in enumerate(recs):
        r["allocated_bytes"] += 4096 * i
        r["by_tag"]["other"] = 4096 * i
    v = classify(recs)
    assert v.verdict == LEAK and v.growing_tag == "other"
    assert v.leak_bytes_per_request == pytest.approx(4096)


def cache_series(n, entry, budget, *, leak=0, evictions=True, over_at=None):
    """Records of ``n`` unique-prompt requests through a cache of ``budget`` bytes (None: no
    budget) that gains one ``entry`` per request and evicts the oldest once the next would not
    fit; ``leak`` bytes per request more stay allocated in tag "other"; from request
    ``over_at`` on the cache stops evicting (it grows past its budget)."""
    recs, held, evicted = [], 0, 0
    for i in range(1, n + 1):
        held += entry
        while budget is not None and held > budget and (over_at is None or i < over_at):
            held -= entry
            evicted += 1
        other = leak * i
        rec = {"request": i, "allocated_bytes": BASE + held + other,
               "reserved_bytes": BASE + 64 * MIB + 2 * MIB * ((held + other) // (2 * MIB)),
               "by_tag": {"weights": BASE, "prefix_cache": held, "other": other},
               "cache_bytes": held, "cache_tag": "prefix_cache", "cache_budget_bytes": budget}
        if evictions:
            rec["cache_evictions"] = evicted
        recs.append(rec)
    return recs


ENTRY = 1_454_080                       # 710 pages of 2 KiB: not a divisor of the budget


def test_budgeted_cache_growing_without_a_budget_is_unbounded():
    v = classify(cache_series(60, ENTRY, None))
    assert v.verdict == UNBOUNDED_CACHE, v.reason
    assert v.growing_tag == "prefix_cache" and "no budget" in v.reason
    assert v.cache_bytes_per_request == pytest.approx(ENTRY)


def test_budgeted_cache_filling_names_held_of_budget():
    """30 requests of a 64 MiB cache filled one entry per request: not full yet."""
    v = classify(cache_series(30, ENTRY, 64 * MIB))
    assert v.verdict == BOUNDED_CACHE_FILLING, v.reason
    held = 30 * ENTRY
    assert v.cache_held_bytes == held and v.cache_budget_bytes == 64 * MIB
    assert f"{held / MIB:.1f} of 64.0 MiB" in v.reason
    assert f"about {-(-(64 * MIB - held) // ENTRY)} more requests" in v.reason
    assert v.leak_bytes_per_request == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("evictions", [True, False])
def test_budgeted_cache_plateau_at_budget_is_stable(evictions):
    """60 requests: the cache fills at request 64 MiB // ENTRY and evicts from the next one on;
    the footprint holds from there, so STABLE (the verdict once called this UNBOUNDED)."""
    fits = 64 * MIB // ENTRY
    recs = cache_series(60, ENTRY, 64 * MIB, evictions=evictions)
    assert recs[fits]["cache_bytes"] == fits * ENTRY             # the plateau, by construction
    v = classify(recs)
    assert v.verdict == STABLE, v.reason
    assert v.cache_filled_at == (fits + 1 if evictions else fits)
    assert "budget" in v.reason and "UNBOUNDED" not in v.reason
    assert v.leak_bytes_per_request == 0


def test_budgeted_cache_just_full_is_inconclusive_and_says_how_many():
    fits = 64 * MIB // ENTRY
    v = classify(cache_series(fits + 3, ENTRY, 64 * MIB))
    assert v.verdict == INCONCLUSIVE, v.reason
    assert v.cache_filled_at == fits + 1 and v.requests_needed > fits + 3


def test_budgeted_cache_growing_past_its_budget_is_a_leak():
    fits = 64 * MIB // ENTRY
    v = classify(cache_series(60, ENTRY, 64 * MIB, over_at=50))
    assert v.verdict == LEAK, v.reason
    assert f"at request 50, over its declared budget" in v.reason
    assert v.growing_tag == "prefix_cache"
    assert cache_series(60, ENTRY, 64 * MIB, over_at=50)[48]["cache_bytes"] == fits * ENTRY


@pytest.mark.parametrize("n", [30, 60])
def test_leak_on_top_of_a_budgeted_cache_is_a_leak(n):
    """A 4 KiB/request leak beside a cache still filling (30) or full (60): LEAK at the leak's
    own rate, in its own tag."""
    v = classify(cache_series(n, ENTRY, 64 * MIB, leak=4096))
    assert v.verdict == LEAK, v.reason
    assert v.leak_bytes_per_request == pytest.approx(4096)
    assert v.growing_tag == "other"


def test_leak_wins_over_cache_when_both_grow():
    n = 60
    v = classify(series([BASE + 8192 * i for i in range(n)],
                        [BASE + 2 * MIB * i for i in range(n)]))
    assert v.verdict == LEAK and v.leak_bytes_per_request == pytest.approx(8192)


def test_growth_that_stopped_is_stable():
    n = 100
    reserved = [BASE + 2 * MIB * min(i, 10) for i in range(n)]        # warm-up reservations
    v = classify(series([BASE] * n, reserved))
    assert v.verdict == STABLE and v.stable_from == 11


def test_late_single_step_is_inconclusive():
    n = 30
    reserved = [BASE] * 25 + [BASE + 2 * MIB] * 5
    v = classify(series([BASE] * n, reserved))
    assert v.verdict == INCONCLUSIVE
    assert v.requests_needed > n


def test_too_few_requests():
    v = classify(series([BASE] * 3, [BASE] * 3))
    assert v.verdict == INCONCLUSIVE and v.requests_needed == MIN_REQUESTS
    assert "at least" in v.reason


def test_missing_fields_raise():
    with pytest.raises(ValueError, match="allocated_bytes"):
        classify([{"reserved_bytes": 1}] * 10)


@settings(max_examples=60, deadline=None)
@given(rate=st.integers(512, 64 * MIB), n=st.integers(MIN_REQUESTS + 2, 200),
       base=st.integers(0, 1 << 34))
def test_property_exact_leak_rate_is_exact(rate, n, base):
    v = classify(series([base + rate * i for i in range(n)], [base + 2 * rate * n] * n))
    assert v.verdict == LEAK
    assert v.leak_bytes_per_request == pytest.approx(rate, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(12, 200), base=st.integers(0, 1 << 34),
       warm=st.lists(st.integers(0, 1 << 24), min_size=1, max_size=1))
def test_property_flat_after_first_request_is_stable(n, base, warm):
    alloc = [base] + [base + warm[0]] * (n - 1)
    v = classify(series(alloc, [base + warm[0] + MIB] * n))
    assert v.verdict == STABLE


def test_noise_band_and_settled_from():
    assert noise_band([5] * 10) == 512
    assert settled_from([0, 0, 10_000, 10_000, 10_100], 512) == 2
    assert points_needed(100.0, 0.0) == 3
    assert points_needed(100.0, 1000.0) > points_needed(100.0, 100.0)


# --- trace analysis and replay, on an isolated pool ----------------------------------------

def test_analyze_trace_finds_a_fragmentation_miss():
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    quarter = 512 * 1024
    blocks = [pool.allocate(quarter, tag="scratch") for _ in range(4)]   # one full 2 MiB seg
    pool.free(blocks[0])
    pool.free(blocks[2])                  # 1 MiB free, as two 512 KiB holes
    big = pool.allocate(1 << 20, tag="scratch")                      # fits neither hole
    tr = analyze_trace(pool.events())
    assert tr["num_misses"] == 1 and tr["num_misses_same_kind"] == 1
    m = tr["misses"][0]
    assert m["size"] == 1 << 20 and m["pool_free_bytes"] == 1 << 20
    assert m["largest_free_same_kind_bytes"] == quarter and m["kind"] == "small"
    s = pool.stats()
    assert tr["peak_reserved_bytes"] == s.peak_reserved_bytes
    assert tr["peak_allocated_bytes"] == s.peak_allocated_bytes
    assert tr["timeline"][-1]["allocated_bytes"] == s.allocated_bytes
    pool.free(big)


def test_analyze_trace_classes_packed_blocks_by_their_segment():
    """A small block made in packed_scope lives in a "large" segment: the miss it causes is a
    large-class miss with 0 free bytes in that class (it once printed "same class -66 MiB",
    counting the block against the small class it never used)."""
    from tinyloop.memory.tags import packed_scope
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    small = pool.allocate(512 * 1024, tag="scratch")          # a 2 MiB small segment
    start = layout_state(pool)
    n0 = len(pool.events())
    with packed_scope():
        pages = [pool.allocate(24 * 1024, tag="kv_cache") for _ in range(3)]
    tr = analyze_trace(pool.events()[n0:], start)
    assert tr["num_misses"] == 1 and tr["num_misses_same_kind"] == 0
    m = tr["misses"][0]
    assert (m["kind"], m["size"], m["tag"]) == ("large", 24 * 1024, "kv_cache")
    assert m["pool_free_bytes"] == (2 << 20) - 512 * 1024
    assert m["free_same_kind_bytes"] == 0
    assert m["largest_free_same_kind_bytes"] == 0
    for b in pages + [small]:
        pool.free(b)
    tr = analyze_trace(pool.events()[n0:], start)
    assert tr["timeline"][-1]["allocated_bytes"] == 0
    assert all(x["free_same_kind_bytes"] >= 0 for x in tr["misses"])


def drive_pool(pool, ops, raw=None) -> list:
    """Apply ``ops`` to ``pool`` the ways TinyLoop drives it; each op a tuple:
    ("alloc", nbytes, packed, tag), ("batch", nbytes, n, packed, tag), ("free", i),
    ("free_many", k), ("reserve", nbytes, exact), ("empty_cache",), ("limit", None | bytes
    above (or, negative, below) what is reserved), ("retag", i, tag), ("plan", nbytes),
    ("refuse", k) (the raw allocator refuses its next k mallocs). Out-of-memory errors are
    part of the trace; returns the live blocks."""
    from tinyloop.errors import OutOfMemoryError
    from tinyloop.memory.tags import packed_scope
    live = []
    for op in ops:
        name = op[0]
        try:
            if name in ("alloc", "batch"):
                scope = packed_scope() if op[-2] else contextlib.nullcontext()
                with scope:
                    if name == "alloc":
                        live.append(pool.allocate(op[1], op[3]))
                    else:
                        live += pool.allocate_many(op[1], op[2], op[4])
            elif name == "free" and live:
                pool.free(live.pop(op[1] % len(live)))
            elif name == "free_many" and live:
                k = min(op[1], len(live))
                batch, live[:] = live[-k:], live[:-k]
                pool.free_many(batch)
            elif name == "reserve":
                pool.reserve(op[1], "weights", exact=op[2])
            elif name == "empty_cache":
                pool.empty_cache()
            elif name == "limit":
                pool.set_limit(None if op[1] is None else max(0, pool.reserved_bytes + op[1]))
            elif name == "retag" and live:
                pool.retag(live[op[1] % len(live)], op[2])
            elif name == "plan":
                pool.check_room([("weights", "weights", op[1])], "a plan")
            elif name == "refuse" and raw is not None:
                raw.fail_next = op[1]
        except OutOfMemoryError:
            pass
    return live


def random_ops(seed: int, n_ops: int = 500) -> list:
    """``n_ops`` seeded ops for :func:`drive_pool`, weighted as TinyLoop uses the pool."""
    rng = np.random.default_rng(seed)
    ops = []
    for _ in range(n_ops):
        u = rng.random()
        if u < 0.30:
            ops.append(("free", int(rng.integers(1 << 20))))
        elif u < 0.35:
            ops.append(("free_many", int(rng.integers(1, 9))))
        elif u < 0.68:
            size = int(rng.choice([rng.integers(1, 96 << 10), rng.integers(1 << 20, 5 << 20)]))
            packed = bool(rng.random() < 0.5)
            ops.append(("alloc", size, packed, "kv_cache" if packed else "scratch"))
        elif u < 0.80:
            ops.append(("batch", 24 << 10, int(rng.integers(1, 90)), bool(rng.random() < 0.8),
                        "kv_cache"))
        elif u < 0.87:
            ops.append(("reserve", int(rng.integers(1 << 20, 9 << 20)), bool(rng.random() < 0.3)))
        elif u < 0.90:
            ops.append(("empty_cache",))
        elif u < 0.93:
            ops.append(("limit", None if rng.random() < 0.3
                        else int(rng.integers(-8 << 20, 8 << 20))))
        elif u < 0.96:
            ops.append(("retag", int(rng.integers(1 << 20)), "prefix_cache"))
        elif u < 0.98:
            ops.append(("plan", int(rng.integers(1 << 20, 64 << 20))))
        else:
            ops.append(("refuse", int(rng.integers(1, 3))))
    return ops


def assert_replay_is_live(pool, events, start=None):
    """The replay of ``events`` (from ``start``) ends as ``pool`` is now: the same segments
    and blocks at the same addresses, the same limit, and the live peaks, final reservation
    and OOM count; its misses are analyze_trace's (bookkeeping, no pool). Returns the
    replay's result."""
    from diagnostics.replay import _Replayer
    s = pool.stats()
    tr = analyze_trace(events, start)
    assert (tr["peak_allocated_bytes"], tr["peak_reserved_bytes"]) == \
        (s.peak_allocated_bytes, s.peak_reserved_bytes)
    ours = replay_trace(events, start)
    assert ours["peak_reserved_bytes"] == s.peak_reserved_bytes
    assert ours["peak_allocated_bytes"] == s.peak_allocated_bytes
    assert ours["final_reserved_bytes"] == s.reserved_bytes
    assert ours["misses"] == tr["num_misses"]
    assert ours["ooms"] == len(tr["ooms"])
    rp = _Replayer(events)
    rp.build_start(start or {"segments": {}, "blocks": {}})
    rp.run()

    def shape(p):
        return [(g["address"], g["size"], g["kind"],
                 [(b["address"], b["size"], b["live"]) for b in g["blocks"]])
                for g in p.layout()]
    assert shape(rp.pool) == shape(pool)
    assert rp.pool.limit_bytes == pool.limit_bytes
    return ours


@pytest.mark.parametrize("seed", range(3))
def test_replay_is_the_live_pool_on_packed_reserved_batched_traces(seed):
    """Replaying a trace with packed_scope, reserve(), batches, empty_cache(), limits, refused
    segments, retags, refused plans and OOM retries through the real pool class gives the live
    pool's layout, peaks, final reservation and OOM count exactly, and analyze_trace's miss
    count. (The replay once inferred segment classes from layout snapshots and took every
    segment request the log did not show for a divergence: a device refusal, after which the
    pool took a free range of the other class, stopped it.)"""
    raw = FakeRawAllocator(capacity=64 << 20)
    pool = MemoryPool(raw_allocator=raw)
    drive_pool(pool, random_ops(seed), raw)
    events = pool.events()
    assert pool.events_dropped == 0
    s = pool.stats()
    assert s.num_ooms > 0 and s.num_segment_releases > 0      # the trace has both
    acts = {(e.action, e.cause) for e in events}
    assert {("limit", "set_limit"), ("oom", "check_room"), ("oom", "allocate"),
            ("segment_alloc", "reserve"), ("segment_free", "allocate")} <= acts
    ours = assert_replay_is_live(pool, events)
    assert ours["ooms"] == s.num_ooms
    (rep, *cupy) = replay_policies(events, cuda=False)
    assert rep == {**ours, "replay_s": rep["replay_s"]}
    assert [p["skipped"] for p in cupy] == [True, True] and all(p["reason"] for p in cupy)


def test_replay_repeats_a_segment_the_device_refused():
    """The device refuses a large request's 2 MiB segment (nothing is logged); the pool takes
    a free range of the small segment that holds a live block. The replay grants a segment
    only where the live trace shows one, so it takes the same range."""
    pool = MemoryPool(raw_allocator=FakeRawAllocator(capacity=2 << 20))
    small = pool.allocate(512 << 10, tag="scratch")              # the one 2 MiB segment
    big = pool.allocate((1 << 20) + 1, tag="scratch")            # large class, no room to grow
    (seg,) = pool.layout()
    assert seg["kind"] == "small" and seg["address"] <= big.ptr < seg["address"] + seg["size"]
    assert [e.action for e in pool.events()] == ["segment_alloc", "alloc", "alloc"]
    ours = assert_replay_is_live(pool, pool.events())
    assert ours["peak_reserved_bytes"] == 2 << 20 and ours["misses"] == 0
    pool.free_many([small, big])


@pytest.mark.parametrize("from_start", [False, True])
def test_replay_holds_the_limit_that_kept_a_free_segment(from_start):
    """Under a limit below what is reserved, returning the fully free small segment cannot
    make room for a large request, so the pool keeps it and serves the request from it. The
    replay knows the limit (a limit event; the start layout's limit) and keeps it too."""
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    w = pool.allocate(2 << 20, tag="weights")                    # a live 2 MiB large segment
    s = pool.allocate(512 << 10, tag="scratch")                  # a 2 MiB small segment
    n0 = 0
    start = None
    pool.set_limit(2 << 20)                                      # below the 4 MiB reserved
    pool.free(s)
    if from_start:
        start, n0 = layout_state(pool), len(pool.events())
        pool.reset_peak_stats()
    big = pool.allocate((1 << 20) + 512, tag="scratch")
    assert pool.reserved_bytes == 4 << 20 and pool.stats().num_segment_releases == 0
    small_seg = next(g for g in pool.layout() if g["kind"] == "small")
    assert small_seg["address"] == big.ptr
    assert start is None or start["limit_bytes"] == 2 << 20
    assert_replay_is_live(pool, pool.events()[n0:], start)
    pool.free_many([w, big])


def test_replay_repeats_a_failed_batch_of_its_length():
    """A batch of 200 KV pages gets one 2 MiB segment (85 pages) and then no room: its oom
    records the batch (200 pages' bytes, one page's request), and the replay asks for that
    batch, not one page more than the room it sees."""
    from tinyloop.errors import OutOfMemoryError
    from tinyloop.memory.tags import packed_scope
    pool = MemoryPool(raw_allocator=FakeRawAllocator(capacity=2 << 20))
    with packed_scope(), pytest.raises(OutOfMemoryError):
        pool.allocate_many(24 << 10, 200, "kv_cache")
    ev = pool.events()
    assert [(e.action, e.size, e.request, e.kind) for e in ev] == [
        ("segment_alloc", 2 << 20, 24 << 10, "large"), ("oom", 200 * (24 << 10), 24 << 10,
                                                        "large")]
    ours = assert_replay_is_live(pool, ev)
    assert ours["ooms"] == 1 and ours["final_reserved_bytes"] == 2 << 20


def test_replay_repeats_a_refused_plan_and_a_retagged_free():
    """A plan check_room refused logs an oom and changes nothing else; a retagged block's free
    logs its new tag. The replay repeats both: the refused plan through check_room, the retag
    before the free."""
    pool = MemoryPool(raw_allocator=FakeRawAllocator(), limit_bytes=4 << 20)
    page = pool.allocate(4096, tag="kv_cache")
    from tinyloop.errors import OutOfMemoryError
    with pytest.raises(OutOfMemoryError):
        pool.check_room([("weights", "weights", 5 << 20)], "loading a model")
    pool.retag(page, "prefix_cache")
    pool.free(page)
    ev = pool.events()
    assert [(e.action, e.tag, e.cause) for e in ev] == [
        ("limit", None, "set_limit"), ("segment_alloc", "kv_cache", "allocate"),
        ("alloc", "kv_cache", None), ("oom", "weights", "check_room"),
        ("free_requested", "prefix_cache", None), ("free_completed", "prefix_cache", None)]
    assert assert_replay_is_live(pool, ev)["ooms"] == 1


REPLAY_OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"),
              st.one_of(st.integers(1, 96 << 10), st.integers((1 << 20) - 2048, (1 << 20) + 2048),
                        st.integers(1 << 20, 5 << 20)),
              st.booleans(), st.sampled_from(["scratch", "kv_cache", "logits"])),
    st.tuples(st.just("batch"), st.sampled_from([512, 24 << 10, 96 << 10, 1536 << 10]),
              st.integers(1, 120), st.booleans(), st.just("kv_cache")),
    st.tuples(st.just("free"), st.integers(0, 1 << 20)),
    st.tuples(st.just("free"), st.integers(0, 1 << 20)),
    st.tuples(st.just("free_many"), st.integers(1, 12)),
    st.tuples(st.just("reserve"), st.integers(1, 9 << 20), st.booleans()),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("limit"), st.one_of(st.none(), st.integers(-6 << 20, 4 << 20))),
    st.tuples(st.just("retag"), st.integers(0, 1 << 20), st.sampled_from(["prefix_cache",
                                                                         "other"])),
    st.tuples(st.just("plan"), st.integers(1, 24 << 20)),
    st.tuples(st.just("refuse"), st.integers(1, 3)),
), min_size=20, max_size=120)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=REPLAY_OPS, capacity=st.one_of(st.none(), st.integers(2 << 20, 24 << 20)),
       start_after=st.integers(0, 60), device=st.sampled_from(["fake", "cuda"]))
def test_property_replay_is_the_live_pool(ops, capacity, start_after, device):
    """Any sequence of allocations (plain, packed, batched), frees, reserves, empty_cache,
    limits, retags, refused plans and device refusals, replayed from any point of it (the
    layout and limit then as the start), never diverges and ends as the live pool: layout,
    limit, peaks, final reservation and OOM count; misses as analyze_trace counts them. (A
    "cuda" device bounds a plan by its free bytes too.)"""
    raw = FakeRawAllocator(capacity=capacity, device=device)
    pool = MemoryPool(raw_allocator=raw)
    drive_pool(pool, ops[:start_after], raw)         # its blocks stay live: the start's
    start, n0 = layout_state(pool), len(pool.events())
    pool.reset_peak_stats()
    drive_pool(pool, ops[start_after:], raw)
    assert pool.events_dropped == 0
    assert_replay_is_live(pool, pool.events()[n0:], start)


def test_replay_from_a_started_pool_rebuilds_its_layout():
    """A trace that starts after a packed load (one reserved segment, small blocks in it, free
    gaps, a plain small segment): the replay starts from that layout, not from the blocks
    re-allocated one by one."""
    from tinyloop.memory.tags import packed_scope
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    pool.reserve(7 << 20, "weights")
    with packed_scope():
        w = [pool.allocate(int(n), tag="weights") for n in (300_000, 70_000, 2_500_000, 5000)]
    small = [pool.allocate(40_000, tag="buffers") for _ in range(3)]
    pool.free(w[1])
    pool.free(small[1])
    start = layout_state(pool)
    pool.reset_peak_stats()
    n0 = len(pool.events())
    drive_pool(pool, random_ops(5, n_ops=300))
    assert_replay_is_live(pool, pool.events()[n0:], start)


def test_replay_names_the_first_event_it_cannot_repeat():
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    a = pool.allocate(4096, tag="scratch")
    b = pool.allocate(4096, tag="scratch")
    pool.free(a)
    pool.free(b)
    events = pool.events()
    assert events[2].action == "alloc"
    events[2] = events[2]._replace(address=events[2].address + 8192)   # not where it goes
    with pytest.raises(ReplayDiverged, match="at event 2"):
        replay_trace(events)
    (ours, *_) = replay_policies(events, cuda=False)
    assert ours["skipped"] and "at event 2" in ours["reason"]


def test_a_trace_without_the_recorded_fields_is_refused_naming_the_event():
    """Events stripped to (time, action, address, size, tag) do not say the size classes and
    causes the replay repeats: the replay and analyze_trace say which event lacks them (a
    TinyLoopError), and replay_policies reports the replay as skipped with that reason."""
    from tinyloop.errors import TinyLoopError
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    pool.free(pool.allocate(4096, tag="scratch"))
    bare = [tuple(e[:5]) for e in pool.events()]
    with pytest.raises(TinyLoopError, match="event 0 .*records no"):
        replay_trace(bare)
    with pytest.raises(ReplayDiverged, match="event 0 .*records no size class"):
        analyze_trace(bare)
    (ours, *_) = replay_policies(bare, cuda=False)
    assert ours["skipped"] and "event 0" in ours["reason"]
    assert replay_trace(pool.events())["peak_reserved_bytes"] == 2 << 20


def test_analyze_trace_from_a_started_pool():
    """A trace collected mid-life starts from the layout (blocks live before it began)."""
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    old = pool.allocate(3 << 20, tag="weights")
    start = layout_state(pool)
    n0 = len(pool.events())
    tmp = pool.allocate(1000, tag="logits")
    pool.free(tmp)
    pool.free(old)
    tr = analyze_trace(pool.events()[n0:], start)
    assert tr["timeline"][0]["allocated_bytes"] == 3 << 20        # the segment_alloc event
    assert max(p["allocated_bytes"] for p in tr["timeline"]) == (3 << 20) + 1024
    assert tr["timeline"][-1]["allocated_bytes"] == 0
    assert tr["peak_reserved_bytes"] == pool.reserved_bytes


# --- planted faults -----------------------------------------------------------------------

def test_planted_leak_holds_rounded_bytes():
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    leak = PlantedLeak(pool, 1000)
    for k in range(1, 6):
        leak.after_request()
        assert pool.allocated_bytes == 1024 * k and pool.by_tag()["other"] == 1024 * k
    leak.release()
    assert pool.allocated_bytes == 0


@pytest.mark.parametrize("per_request", [1 << 20, 3 << 20, 64 << 20])
def test_planted_cache_grows_reservation_not_allocation(per_request):
    pool = MemoryPool(raw_allocator=FakeRawAllocator())
    keep = [pool.allocate(5 << 20, tag="weights"), pool.allocate(4096, tag="buffers")]
    tmp = pool.allocate(3 << 20, tag="kv_cache")      # a cached free segment of the "model"
    pool.free(tmp)
    r0, a0 = pool.reserved_bytes, pool.allocated_bytes
    cache = PlantedCache(pool, per_request)
    for k in range(1, 9):
        cache.after_request()
        assert pool.allocated_bytes == a0
        grown = pool.reserved_bytes - r0
        assert grown == cache.grown_bytes
        assert k * per_request <= grown < k * per_request + 2 * max(2 << 20, per_request)
    for b in keep:
        pool.free(b)


# --- the CLI end to end, on the tiny model (NumPy backend) ---------------------------------

def _run(tmp_path, *argv, rc=0):
    out = tmp_path / "out"
    got = main([*argv, "--out", str(out), "--backend", "numpy", "--no-progress"]
               if argv[0] in ("leak", "fragment") else
               [*argv, "--out", str(out), "--backend", "numpy"])
    assert got == rc
    return out


def test_cli_leak_plain_is_stable(tmp_path, tiny_model_path, capsys):
    out = _run(tmp_path, "leak", "--requests", "20", "--model", tiny_model_path)
    r = json.loads((out / "leak.json").read_text())
    assert r["verdict"] == STABLE, r["reason"]
    assert r["leak_bytes_per_request"] == 0
    assert len(r["records"]) == 21 and r["model"]["identical_outputs"]
    for name in ("leak.csv", "leak_timeline_by_tag.png", "leak_memory.png",
                 "leak_fragmentation.png"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "leak.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 21 and "tag_kv_cache_bytes" in rows[0] and "device_free_bytes" in rows[0]
    assert "VERDICT: STABLE" in capsys.readouterr().out


def test_cli_leak_planted_leak(tmp_path, tiny_model_path):
    out = _run(tmp_path, "leak", "--requests", "40", "--model", tiny_model_path,
               "--plant-leak", "4096", rc=3)
    r = json.loads((out / "leak.json").read_text())
    assert r["verdict"] == LEAK, r["reason"]
    assert abs(r["leak_bytes_per_request"] - 4096) <= 0.1 * 4096
    assert r["growing_tag"] == "other"
    assert r["planted"]["leak_bytes_per_request"] == 4096


def test_cli_leak_planted_cache(tmp_path, tiny_model_path):
    out = _run(tmp_path, "leak", "--requests", "40", "--model", tiny_model_path,
               "--plant-cache", "1M", rc=4)
    r = json.loads((out / "leak.json").read_text())
    assert r["verdict"] == UNBOUNDED_CACHE, r["reason"]
    assert r["leak_bytes_per_request"] == 0
    assert abs(r["reserved_bytes_per_request"] - MIB) <= 0.1 * MIB


@pytest.mark.parametrize("budget", ["unbounded", "100K"])
def test_cli_leak_prefix_pool(tmp_path, tiny_model_path, capsys, budget):
    """Unique prompts through a prefix pool: without a budget an UNBOUNDED CACHE naming
    prefix_cache (not a LEAK); with one, STABLE once full -- and the pool's bytes equal its tag
    and stay within the budget after every request."""
    out = _run(tmp_path, "leak", "--requests", "30", "--model", tiny_model_path,
               "--prefix-pool", budget, "--unique-prompts",
               rc=4 if budget == "unbounded" else 0)
    r = json.loads((out / "leak.json").read_text())
    recs = r["records"][1:]
    for rec in recs:
        assert rec["cache_bytes"] == rec["by_tag"]["prefix_cache"]
    entry = recs[0]["cache_bytes"]
    assert entry > 0
    if budget == "unbounded":
        assert r["verdict"] == UNBOUNDED_CACHE, r["reason"]
        assert r["growing_tag"] == "prefix_cache"
        assert r["verdict_detail"]["cache_bytes_per_request"] == pytest.approx(entry)
        assert r["prefix_pool"]["entries"] == 30 and r["prefix_pool"]["evictions"] == 0
    else:
        assert r["verdict"] == STABLE, r["reason"]
        assert all(rec["cache_bytes"] <= 100 * 1024 for rec in recs)
        assert r["prefix_pool"]["entries"] == 100 * 1024 // entry
        assert r["prefix_pool"]["evictions"] == 30 - r["prefix_pool"]["entries"]
    assert r["prefix_pool"]["hits"] == 29             # the shared prompt, every request after 1
    assert "prefix pool (budget" in capsys.readouterr().out


def test_cli_leak_budgeted_prefix_pool_fills_then_holds(tmp_path, tiny_model_path, capsys):
    """A budget of 12 entries, one new entry per request (NumPy backend, tiny model): after 8
    requests BOUNDED CACHE, FILLING with held-of-budget figures; after 30 the pool is full from
    request 13 on and the footprint holds: STABLE. Both exit 0. (It once said UNBOUNDED CACHE
    "with no budget" next to a line giving the budget.)"""
    probe = _run(tmp_path, "leak", "--requests", "1", "--model", tiny_model_path,
                 "--prefix-pool", "unbounded", "--unique-prompts", "--no-plots", rc=5)
    entry = json.loads((probe / "leak.json").read_text())["records"][1]["cache_bytes"]
    budget = 12 * entry + entry // 2
    capsys.readouterr()
    out = _run(tmp_path, "leak", "--requests", "8", "--model", tiny_model_path,
               "--prefix-pool", str(budget), "--unique-prompts", "--no-plots", rc=0)
    r = json.loads((out / "leak.json").read_text())
    assert r["verdict"] == BOUNDED_CACHE_FILLING, r["reason"]
    assert r["verdict_detail"]["cache_held_bytes"] == 8 * entry
    assert r["verdict_detail"]["cache_budget_bytes"] == budget
    assert f"filling: {8 * entry / MIB:.1f} of {budget / MIB:.1f} MiB" in capsys.readouterr().out
    out = _run(tmp_path, "leak", "--requests", "30", "--model", tiny_model_path,
               "--prefix-pool", str(budget), "--unique-prompts", rc=0)
    r = json.loads((out / "leak.json").read_text())
    assert r["verdict"] == STABLE, r["reason"]
    assert r["verdict_detail"]["cache_filled_at"] == 13
    assert r["prefix_pool"]["evictions"] == 30 - 12
    assert all(rec["cache_budget_bytes"] == budget for rec in r["records"][1:])


def test_cli_fragment(tmp_path, tiny_model_path):
    out = _run(tmp_path, "fragment", "--requests", "12", "--model", tiny_model_path,
               "--max-prompt-tokens", "60", "--seed", "3")
    r = json.loads((out / "fragment.json").read_text())
    assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"] > 0
    assert 0 <= r["external_fragmentation_max"] <= 1
    assert len(r["records"]) == 13 and r["trace"]["events_dropped"] == 0
    assert len({rec["prompt_tokens"] for rec in r["records"][1:]}) > 3      # varying lengths
    names = [p["name"] for p in r["policies"]]
    assert names == ["tinyloop pool", "cupy MemoryPool", "cupy MemoryAsyncPool"]
    ours = r["policies"][0]
    assert ours["exact"], ours
    assert ours["peak_reserved_bytes"] == r["peak_reserved_bytes"]      # the live pool's own
    assert ours["peak_allocated_bytes"] == r["peak_allocated_bytes"]
    assert ours["misses"] == r["num_misses"]
    assert r["trace"]["peak_reserved_bytes"] == r["peak_reserved_bytes"]
    if not cuda_available():
        assert all(p["skipped"] and "GPU" in p["reason"] for p in r["policies"][1:])
    for name in ("fragment.csv", "fragment_trace.csv", "fragment_fragmentation.png",
                 "fragment_trace.png", "fragment_policies.png", "fragment_memory.png",
                 "fragment_timeline_by_tag.png"):
        assert (out / name).stat().st_size > 0, name


def test_fragment_replay_of_a_loaded_model_is_the_live_run(tmp_path, tiny_model_path):
    """The notebook's way: a model loaded before the trace (its packed, reserved segment is the
    start layout) and prompts long enough that KV pages add segments during the requests."""
    import tinyloop
    from diagnostics.fragment import run_fragment
    model = tinyloop.load_model(tiny_model_path, max_seq_len=2048, backend="numpy")
    try:
        r = run_fragment(tmp_path, model=model, requests=8, max_prompt_tokens=1500,
                         max_new_tokens=2, show_progress=False, plot=False)
    finally:
        tinyloop.free_model(model)
    ours = r["policies"][0]
    assert r["trace"]["num_segment_allocs"] >= 1, r["trace"]
    assert ours["exact"], ours
    assert (ours["peak_reserved_bytes"], ours["peak_allocated_bytes"], ours["misses"]) == \
        (r["peak_reserved_bytes"], r["peak_allocated_bytes"], r["num_misses"])


def test_cli_release(tmp_path, tiny_model_path):
    out = _run(tmp_path, "release", "--model", tiny_model_path)
    r = json.loads((out / "release.json").read_text())
    c = r["checks"]
    assert c["empty_cache_kept_weights"] and c["free_model_released_model_bytes"]
    assert c["request_end_frees_kv_cache"] and c["outputs_identical"]
    assert c["empty_cache_after_free_model_released_bytes"] > 0
    steps = {s["step"]: s for s in r["steps"]}
    assert steps["free_model"]["after"]["allocated_bytes"] == 0
    assert steps["empty_cache after free_model"]["after"]["reserved_bytes"] == 0
    assert steps["empty_cache"]["after"]["by_tag"]["weights"] > 0
    assert r["timings"]["cold_start_s"] > 0 and r["timings"]["warm_request_s"] > 0
    assert (out / "release_memory.png").stat().st_size > 0


def test_cli_report_renders_all_sections(tmp_path, tiny_model_path):
    out = _run(tmp_path, "leak", "--requests", "10", "--model", tiny_model_path)
    _run(tmp_path, "release", "--model", tiny_model_path, "--no-plots")
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "Leak test" in page and "Release steps" in page
    assert page.count("data:image/png;base64,") == 3       # leak's plots; release had none
    assert json.loads((out / "leak.json").read_text())["verdict"] in page


@pytest.mark.parametrize("backend, itemsize, dtype", [("numpy", 4, "float32"),
                                                     ("cuda", 2, "float16")])
def test_kvmodes_and_inspect_agree_and_name_backend_and_dtype(tmp_path, tiny_model_path, capsys,
                                                              backend, itemsize, dtype):
    """fp16 K/V bytes per token per slot: 2 (K and V) * n_kv_heads * head_dim * the backend's
    K/V itemsize, the same in `diagnostics kvmodes` and `tinyloop inspect`, each naming the
    backend and the dtype. (kvmodes once printed the CUDA figure unnamed beside inspect's
    NumPy one.)"""
    from tests.conftest import TINY
    from tinyloop.cli import main as tinyloop_main
    want = 2 * TINY["n_kv_heads"] * TINY["head_dim"] * itemsize
    assert main(["kvmodes", "--model", tiny_model_path, "--backend", backend, "--out",
                 str(tmp_path), "--no-plots"]) == 0
    kv_out = capsys.readouterr().out
    assert f"on backend {backend} (fp16 mode: K/V {dtype})" in kv_out
    fp16 = next(line.split() for line in kv_out.splitlines() if line.split()[:1] == ["fp16"])
    assert int(fp16[1].replace(",", "")) == want
    assert f"k {dtype}, v {dtype}" in kv_out
    r = json.loads((tmp_path / "kvmodes.json").read_text())
    assert (r["backend"], r["kv_dtype"]) == (backend, dtype)
    assert tinyloop_main(["inspect", tiny_model_path, "--backend", backend]) == 0
    ins = capsys.readouterr().out
    assert f"memory plan for backend={backend} (activations" in ins
    assert f"KV cache storage modes on backend {backend} (fp16 mode: K/V {dtype}" in ins
    table = ins[ins.index("KV cache storage modes"):]
    fp16 = next(line.split() for line in table.splitlines() if line.split()[:1] == ["fp16"])
    assert int(fp16[1].replace(",", "")) == want


def test_cli_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no leak.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["leak", "--plant-leak", "lots"])
    assert main(["leak", "--model", str(tmp_path / "missing.tlm"), "--backend", "numpy",
                 "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("fault, verdict, code", [
    ([], STABLE, 0), (["--plant-leak", "4096"], LEAK, 3),
    (["--plant-cache", "1M"], UNBOUNDED_CACHE, 4)])
def test_python_dash_m_leak_exit_status(tmp_path, tiny_model_path, fault, verdict, code):
    """The exit status is the verdict's, as --help documents it (a LEAK once exited 0)."""
    p = subprocess.run([sys.executable, "-m", "diagnostics", "leak", "--requests", "24",
                        "--model", tiny_model_path, "--backend", "numpy", "--out",
                        str(tmp_path), "--no-plots", "--no-progress", *fault],
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
    assert f"VERDICT: {verdict}:" in p.stdout, p.stdout + p.stderr
    assert p.returncode == code, p.stderr
    assert json.loads((tmp_path / "leak.json").read_text())["verdict"] == verdict
    h = subprocess.run([sys.executable, "-m", "diagnostics", "leak", "--help"],
                       capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
    assert h.returncode == 0
    assert f"  {code}  {verdict}" in h.stdout


def _plot_records(n=30, leak=2816 * 1024 // 30):
    """Records like a leak run's: request 0 (loaded) .. n, ~650 MiB of weights and a small leak
    (about 2.75 MiB over the run) in tag "other"."""
    out = []
    for i in range(n + 1):
        other = leak * max(0, i - 1)
        alloc = 650 * MIB + other
        out.append({"request": i, "step": "request", "device": "host",
                    "allocated_bytes": alloc, "reserved_bytes": 700 * MIB,
                    "peak_reserved_bytes": 700 * MIB, "pool_free_bytes": 700 * MIB - alloc,
                    "largest_free_block_bytes": 700 * MIB - alloc,
                    "external_fragmentation": 0.0, "process_bytes": 800 * MIB,
                    "device_free_bytes": 10 << 30, "device_total_bytes": 16 << 30,
                    "by_tag": {"weights": 650 * MIB, "other": other}})
    return out


def _drawn(monkeypatch, call):
    """The matplotlib Figure a diagnostics.plots function draws (its file is not written)."""
    from diagnostics import plots
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or str(path))
    call()
    (fig,) = figs
    fig.canvas.draw()
    return fig


def _check_layout(fig):
    """Every legend lies outside every axes' data area, and every per-record line is a step
    plot (a straight line of 2 points -- a fit, a reference -- is not one)."""
    from matplotlib.transforms import Bbox
    axes = fig.axes
    legends = [a.get_legend() for a in axes if a.get_legend() is not None]
    assert legends
    for leg in legends:
        lb = leg.get_window_extent()
        for a in axes:
            ab = a.get_window_extent()
            assert not Bbox.intersection(lb, ab) or \
                Bbox.intersection(lb, ab).width * Bbox.intersection(lb, ab).height < 1, \
                f"legend {[t.get_text() for t in leg.get_texts()]} over {a.get_title()!r}"
    for a in axes:
        for line in a.get_lines():
            if len(line.get_xdata()) > 2 and not line.get_label().startswith("_"):
                assert line.get_drawstyle() == "steps-post", line.get_label()


def test_plots_legends_outside_steps_and_a_leak_on_its_own_axis(monkeypatch, tmp_path):
    """A 2.75 MiB leak on a 700 MiB pool: flat on the MiB panel, a rising series on the growth
    panel of allocated minus request 1's value; legends beside the data; steps, not diagonals;
    the largest free block drawn on top of (and narrower than) pool free."""
    from diagnostics import plots
    recs = _plot_records()
    fig = _drawn(monkeypatch, lambda: plots.allocated_reserved_driver(recs, tmp_path / "m.png"))
    _check_layout(fig)
    growth = [a for a in fig.axes if "since request 1" in a.get_ylabel()]
    assert len(growth) == 1
    (line,) = [x for x in growth[0].get_lines() if x.get_label() == "allocated"]
    ys = np.asarray(line.get_ydata(), dtype=float)
    assert growth[0].get_ylabel().startswith("MiB")
    want = (recs[-1]["allocated_bytes"] - recs[1]["allocated_bytes"]) / MIB
    assert ys[0] == 0 and ys[-1] == pytest.approx(want)
    lo, hi = growth[0].get_ylim()
    assert hi - lo < 4 * want                   # the leak spans the axis, not a sliver of it
    v = classify(recs[1:]).to_dict()
    _check_layout(_drawn(monkeypatch, lambda: plots.timeline_by_tag(
        recs, tmp_path / "t.png", verdict=v)))
    fig = _drawn(monkeypatch, lambda: plots.fragmentation(recs, tmp_path / "f.png"))
    _check_layout(fig)
    lines = {x.get_label(): x for a in fig.axes for x in a.get_lines()}
    free, largest = lines["pool free\n(reserved - allocated)"], lines["largest free block"]
    assert largest.get_zorder() > free.get_zorder()
    assert largest.get_linewidth() < free.get_linewidth()
    assert any("1 - largest free block / pool free" in a.get_title() for a in fig.axes)
    steps = [dict(r, step=name) for r, name in zip(recs[:4], ["a", "b", "c", "d"])]
    for fn in (plots.timeline_by_tag, plots.allocated_reserved_driver, plots.fragmentation):
        _check_layout(_drawn(monkeypatch, lambda: fn(steps, tmp_path / "s.png", x_key="step")))
    timeline = [{"event": i, "allocated_bytes": (i % 7) * MIB, "reserved_bytes": 8 * MIB}
                for i in range(50)]
    _check_layout(_drawn(monkeypatch, lambda: plots.event_timeline(timeline, tmp_path / "e.png")))


def test_cli_release_table_names_are_the_plot_labels(tmp_path, tiny_model_path, capsys):
    """The release table's rows and the plots' x labels (the records' step names) are the same
    names in the same order (they once differed: "loaded" / "load", "request 1 done" / ...)."""
    out = _run(tmp_path, "release", "--model", tiny_model_path, "--no-plots")
    r = json.loads((out / "release.json").read_text())
    labels = [rec["step"] for rec in r["records"]]
    assert labels == [r["start"]["step"]] + [s["step"] for s in r["steps"]]
    text = capsys.readouterr().out
    rows = [line.split("  ")[1].strip() for line in text.splitlines()
            if line.startswith("  ") and any(line[2:].startswith(lb) for lb in labels)]
    assert rows[-len(labels):] == labels
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    cells = [c.split("</td>")[0] for c in page.split("<tr><td>")[1:]]
    assert [c for c in cells if c in labels] == labels


def test_every_memory_tag_has_a_plot_colour():
    """A tag without a colour made every CUDA plot fail ("Invalid RGBA argument: None") once
    the "graphs" tag existed."""
    from diagnostics.plots import TAG_COLORS
    from tinyloop.memory.tags import TAGS
    assert set(TAG_COLORS) == set(TAGS)
    assert len(set(TAG_COLORS.values())) == len(TAG_COLORS)     # tags stay distinguishable
