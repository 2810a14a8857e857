"""``python -m diagnostics fragment``: requests of varying prompt and generation length
(seeded), and what they do to the pool's free space.

Reports peak reserved / peak allocated, external fragmentation (1 - largest free block / pool
free bytes) after every request, the largest free block, and every allocation that *missed*:
the pool had to add a segment although its free bytes in total would have covered the request
(no single free chunk of the request's size class was big enough). Misses are found by
replaying the pool's event log (:func:`analyze_trace`), which also gives an allocated / reserved
timeline event by event.

The same trace is then replayed against allocator policies side by side
(``diagnostics.replay.replay_policies``): TinyLoop's own pool class over a fake raw allocator
that hands back the recorded addresses (always; it repeats every event the live pool logged, so
its peaks and misses are the live run's, or it says at which event it could not), and, where
CUDA is present, CuPy's default ``MemoryPool`` and ``MemoryAsyncPool`` (cudaMallocAsync), fed
the alloc / free sequence. On a machine without CUDA those two are reported as skipped, with
the reason.

Peaks are the running high-water marks from the start of the trace (before the load when the
run loads the model itself).

Writes DIR/fragment.json, DIR/fragment.csv (per request), DIR/fragment_trace.csv (per event,
downsampled) and the plots DIR/fragment_*.png.
"""

from __future__ import annotations

import bisect
import os
import time

import numpy as np

import tinyloop
from tinyloop.memory import reset_peak_memory_stats, size_kind

from . import plots
from .replay import ReplayDiverged, as_events, replay_policies
from .records import fmt_bytes, take_record, write_csv, write_result
from .session import (DEFAULT_MAX_SEQ_LEN, EventCollector, backend_facts, backend_pool,
                      load_timed, progress, run_on, settle_run)

TIMELINE_POINTS = 2000          # the per-event timeline is downsampled to at most this many


def layout_state(pool) -> dict:
    """The pool's segments, live blocks and limit now: {"segments": {ptr: (size, kind)},
    "blocks": {ptr: (size, tag)}, "limit_bytes": int | None} -- the starting point a trace is
    replayed from."""
    segs, blocks = {}, {}
    for seg in pool.layout():
        segs[seg["address"]] = (seg["size"], seg["kind"])
        for b in seg["blocks"]:
            if b["live"]:
                blocks[b["address"]] = (b["size"], b["tag"])
    return {"segments": segs, "blocks": blocks, "limit_bytes": pool.limit_bytes}


def _largest_free(segs: dict, blocks: dict, kind: str) -> int:
    """Largest gap between live blocks inside the segments of ``kind`` (O(blocks))."""
    starts = sorted(blocks)
    best = 0
    for ptr, (size, k) in segs.items():
        if k != kind:
            continue
        end = ptr + size
        cur = ptr
        i = bisect.bisect_left(starts, ptr)
        while i < len(starts) and starts[i] < end:
            best = max(best, starts[i] - cur)
            cur = starts[i] + blocks[starts[i]][0]
            i += 1
        best = max(best, end - cur)
    return best


def analyze_trace(events, start: dict | None = None, *,
                  max_detailed_misses: int = 1000) -> dict:
    """Replay ``events`` (``MemoryEvent`` tuples, oldest first) from ``start`` (see
    :func:`layout_state`; empty if None) by bookkeeping alone -- blocks and segments, no pool --
    and return::

        {"timeline": [{"event", "time", "allocated_bytes", "reserved_bytes"}],   # every event
         "misses": [{"event", "time", "size", "tag", "kind", "pool_free_bytes",
                     "free_same_kind_bytes", "largest_free_same_kind_bytes"}],
         "ooms": [...same fields, for "oom" events...],
         "peak_allocated_bytes", "peak_reserved_bytes", "num_allocs", "num_frees",
         "num_segment_allocs", "num_segment_frees", "num_misses", "num_misses_same_kind"}

    A miss is an allocation that added a segment for itself (a segment_alloc whose cause is
    "allocate", followed by its alloc into that segment; a ``reserve()``'s segment is none)
    although it was no bigger than the pool's free bytes (reserved - allocated) just before;
    ``num_misses_same_kind`` counts those whose own size class had the free bytes, so only
    fragmentation kept it out.

    A block's size class is the class of the segment holding it, found by address (a
    ``segment_alloc`` event records its segment's class): allocations made in ``packed_scope``
    (the model's tensors, KV pages) sit in "large" segments whatever their size, and a request
    the pool could not grow for takes a free range of the other class, so the class cannot be
    read off the block size. An oom's class is the one its request asked in. Raises
    ``ReplayDiverged`` for a segment_alloc that records no class.
    """
    events = as_events(events)
    start = start or {"segments": {}, "blocks": {}}
    segs = dict(start["segments"])                      # ptr -> (size, kind)
    seg_starts = sorted(segs)
    blocks = {p: (s, t) for p, (s, t) in start["blocks"].items()}   # ptr -> (size, tag)
    allocated = sum(s for s, _ in blocks.values())
    reserved = sum(s for s, _ in segs.values())

    def kind_at(addr: int, size: int) -> str:
        """The class of the segment holding ``addr`` (the size rule if none does)."""
        i = bisect.bisect_right(seg_starts, addr) - 1
        if i >= 0:
            ssize, k = segs[seg_starts[i]]
            if addr < seg_starts[i] + ssize:
                return k
        return size_kind(size)

    block_kind = {p: kind_at(p, s) for p, (s, _) in blocks.items()}
    alloc_kind = {"small": 0, "large": 0}
    for p, (s, _) in blocks.items():
        alloc_kind[block_kind[p]] += s
    seg_kind = {"small": 0, "large": 0}
    for s, k in segs.values():
        seg_kind[k] += s
    peak_a, peak_r = allocated, reserved
    timeline, misses, ooms = [], [], []
    n_alloc = n_free = n_seg = n_segfree = 0
    for i, ev in enumerate(events):
        t, action, addr, size, tag = ev[:5]
        if action == "segment_alloc":
            n_seg += 1
            nxt = events[i + 1] if i + 1 < len(events) else None
            k = ev.kind
            if k is None:
                raise ReplayDiverged(f"event {i} (a segment_alloc of {size} B) records no size "
                                     f"class (a trace from a pool that does not log it?)")
            if ev.cause == "allocate" and nxt is not None and nxt.action == "alloc" \
                    and addr <= nxt.address < addr + size:
                r = nxt.size
                largest = _largest_free(segs, blocks, k)
                free_total = reserved - allocated
                if r <= free_total:
                    miss = {"event": i, "time": t, "size": r, "tag": nxt[4], "kind": k,
                            "pool_free_bytes": free_total,
                            "free_same_kind_bytes": seg_kind[k] - alloc_kind[k]}
                    if len(misses) < max_detailed_misses:
                        miss["largest_free_same_kind_bytes"] = largest
                    misses.append(miss)
            segs[addr] = (size, k)
            bisect.insort(seg_starts, addr)
            seg_kind[k] += size
            reserved += size
        elif action == "alloc":
            k = kind_at(addr, size)
            blocks[addr] = (size, tag)
            block_kind[addr] = k
            allocated += size
            alloc_kind[k] += size
            n_alloc += 1
        elif action == "free_completed":
            old = blocks.pop(addr, None)
            size = old[0] if old is not None else size
            allocated -= size
            alloc_kind[block_kind.pop(addr, None) or kind_at(addr, size)] -= size
            n_free += 1
        elif action == "segment_free":
            old = segs.pop(addr, None)
            reserved -= size
            if old is not None:
                seg_kind[old[1]] -= size
                seg_starts.remove(addr)
            n_segfree += 1
        elif action == "oom":
            k = ev.kind or size_kind(size)              # a refused plan has no class
            ooms.append({"event": i, "time": t, "size": size, "tag": tag, "kind": k,
                         "pool_free_bytes": reserved - allocated,
                         "free_same_kind_bytes": seg_kind[k] - alloc_kind[k],
                         "largest_free_same_kind_bytes": _largest_free(segs, blocks, k)})
        peak_a, peak_r = max(peak_a, allocated), max(peak_r, reserved)
        timeline.append({"event": i, "time": t, "allocated_bytes": allocated,
                         "reserved_bytes": reserved})
    return {"timeline": timeline, "misses": misses, "ooms": ooms,
            "peak_allocated_bytes": peak_a, "peak_reserved_bytes": peak_r,
            "num_allocs": n_alloc, "num_frees": n_free, "num_segment_allocs": n_seg,
            "num_segment_frees": n_segfree, "num_misses": len(misses),
            "num_misses_same_kind": sum(1 for m in misses
                                        if m["size"] <= m["free_same_kind_bytes"])}


def request_plan(n: int, seed: int, vocab_size: int, max_prompt_tokens: int,
                 max_new_tokens: int, max_seq_len: int) -> list[dict]:
    """``n`` seeded requests: prompt length uniform in 1..max_prompt_tokens (random token ids),
    generation length uniform in 1..max_new_tokens, both capped to fit ``max_seq_len``."""
    rng = np.random.default_rng(seed)
    max_new_tokens = max(1, min(max_new_tokens, max_seq_len - 1))
    max_prompt_tokens = max(1, min(max_prompt_tokens, max_seq_len - max_new_tokens))
    out = []
    for _ in range(n):
        p = int(rng.integers(1, max_prompt_tokens + 1))
        g = int(rng.integers(1, max_new_tokens + 1))
        out.append({"prompt": rng.integers(0, vocab_size, size=p).tolist(), "max_new_tokens": g})
    return out


def run_fragment(out_dir, *, model=None, model_path: str | None = None, requests: int = 30,
                 backend: str = "auto", seed: int = 0, max_prompt_tokens: int = 96,
                 max_new_tokens: int = 16, depth: int | None = None,
                 max_seq_len: int = DEFAULT_MAX_SEQ_LEN, show_progress: bool = True,
                 replay: bool = True, plot: bool = True) -> dict:
    """Run the fragmentation test and write its files into ``out_dir``; returns
    fragment.json's content. ``model``: a loaded Model to use and leave loaded (the trace then
    starts after its load); else ``model_path`` is loaded and freed. Raises ValueError for
    ``requests`` < 1."""
    own, backend, model_path, max_seq_len = settle_run(out_dir, requests, model, model_path,
                                                       backend, max_seq_len)
    pool = backend_pool(backend) if own else model.pool
    start = layout_state(pool)
    # peaks from the trace's start on (never reset per request): the run's running high-water
    # marks, over the same span the trace and its replay cover
    reset_peak_memory_stats()
    collector = EventCollector(pool).start()
    if own:
        model, load_s = load_timed(model_path, max_seq_len, backend)
    else:
        load_s = 0.0
    assert model.pool is pool
    collector.collect()
    records = [take_record(pool, request=0, step="loaded", device=pool.device,
                           duration_ms=load_s * 1e3, prompt_tokens=0, new_tokens=0)]
    plan = request_plan(requests, seed, model.config.vocab_size, max_prompt_tokens,
                        max_new_tokens, max_seq_len)
    try:
        for i, req in progress(enumerate(plan, 1), total=requests, desc="fragment",
                               enabled=show_progress):
            t0 = time.perf_counter()
            res = model.generate(req["prompt"], max_new_tokens=req["max_new_tokens"],
                                 depth=depth, temperature=0.0)
            dt = time.perf_counter() - t0
            collector.collect()
            records.append(take_record(pool, request=i, step="request", device=pool.device,
                                       duration_ms=dt * 1e3,
                                       prompt_tokens=len(req["prompt"]),
                                       max_new_tokens=req["max_new_tokens"],
                                       new_tokens=len(res.token_ids)))
    finally:
        if own:
            tinyloop.free_model(model)
        collector.collect()

    trace = analyze_trace(collector.events, start)
    policies = replay_policies(collector.events, start) if replay else []
    if collector.dropped and policies:
        policies[0] = {"name": "tinyloop pool", "skipped": True,
                       "reason": f"the pool's event ring dropped {collector.dropped} events "
                                 f"before they were collected: the trace is incomplete"}
    last = records[-1]
    frag = [r["external_fragmentation"] for r in records[1:]]
    summary_fields = {
        "peak_allocated_bytes": last["peak_allocated_bytes"],
        "peak_reserved_bytes": last["peak_reserved_bytes"],
        "peak_reserved_over_peak_allocated": (last["peak_reserved_bytes"]
                                              / last["peak_allocated_bytes"]
                                              if last["peak_allocated_bytes"] else None),
        "external_fragmentation_max": max(frag),
        "external_fragmentation_final": frag[-1],
        "largest_free_block_bytes_final": last["largest_free_block_bytes"],
        "largest_free_block_bytes_min": min(r["largest_free_block_bytes"] for r in records[1:]),
        "pool_free_bytes_final": last["pool_free_bytes"],
        "num_misses": trace["num_misses"],
        "num_misses_same_kind": trace["num_misses_same_kind"],
        "num_ooms": len(trace["ooms"]),
    }
    # Requests' own misses (after the load), the ones a serving user would feel
    load_end = next((j for j, e in enumerate(collector.events)
                     if e[0] >= records[0]["time_s"]), len(collector.events))
    for m in trace["misses"]:
        m["during_requests"] = m["event"] >= load_end
    # the misses a serving user feels first, then the load's
    trace["misses"].sort(key=lambda m: (not m["during_requests"], m["event"]))
    summary_fields["num_misses_during_requests"] = sum(1 for m in trace["misses"]
                                                       if m["during_requests"])
    result = {
        "command": "fragment",
        "verdict": (f"{trace['num_misses']} allocation(s) needed a new segment although the "
                    f"pool's free bytes would have covered them"
                    f" ({summary_fields['num_misses_during_requests']} during requests); peak "
                    f"reserved / peak allocated = "
                    f"{summary_fields['peak_reserved_over_peak_allocated']:.3f}"),
        **summary_fields,
        "config": {"model": model_path, **backend_facts(backend), "device": pool.device,
                   "requests": requests, "seed": seed, "max_prompt_tokens": max_prompt_tokens,
                   "max_new_tokens": max_new_tokens, "depth": res.depth,
                   "max_seq_len": max_seq_len},
        "trace": {"events": len(collector.events), "events_dropped": collector.dropped,
                  **{k: trace[k] for k in ("peak_allocated_bytes", "peak_reserved_bytes",
                                           "num_allocs", "num_frees", "num_segment_allocs",
                                           "num_segment_frees", "num_misses",
                                           "num_misses_same_kind")}},
        "misses": trace["misses"],
        "ooms": trace["ooms"],
        "policies": policies,
        "records": records,
    }
    step = max(1, len(trace["timeline"]) // TIMELINE_POINTS)
    timeline = trace["timeline"][::step]
    files = [write_csv(os.path.join(out_dir, "fragment.csv"), records),
             write_csv(os.path.join(out_dir, "fragment_trace.csv"), timeline)]
    note = plots.unavailable() if plot else None
    if plot and note is None:
        files += [
            plots.timeline_by_tag(records, os.path.join(out_dir, "fragment_timeline_by_tag.png"),
                                  title="fragment: memory by tag after each request"),
            plots.allocated_reserved_driver(records, os.path.join(out_dir,
                                                                  "fragment_memory.png"),
                                            title="fragment: allocated vs reserved vs driver"),
            plots.fragmentation(records, os.path.join(out_dir, "fragment_fragmentation.png"),
                                title="fragment: external fragmentation after each request"),
            plots.event_timeline(timeline, os.path.join(out_dir, "fragment_trace.png"),
                                 title="fragment: allocated / reserved at every pool event"),
        ]
        if policies:
            files.append(plots.policy_comparison(
                policies, os.path.join(out_dir, "fragment_policies.png"),
                title="fragment: the recorded trace replayed against allocator policies"))
    result["plots_note"] = note
    return write_result(out_dir, "fragment", result, files)


def summary(result: dict) -> str:
    c = result["config"]
    lines = [f"fragment: {c['requests']} requests (seed {c['seed']}, prompts 1..."
             f"{c['max_prompt_tokens']} tokens, 1..{c['max_new_tokens']} new tokens) on "
             f"{run_on(c)}",
             f"  peak reserved {fmt_bytes(result['peak_reserved_bytes'])} / peak allocated "
             f"{fmt_bytes(result['peak_allocated_bytes'])} = "
             f"{result['peak_reserved_over_peak_allocated']:.3f}",
             f"  external fragmentation (1 - largest free block / pool free: the share of "
             f"the cached free bytes one request cannot get in one piece): max "
             f"{result['external_fragmentation_max']:.3f}, final "
             f"{result['external_fragmentation_final']:.3f}; largest free block at the end "
             f"{fmt_bytes(result['largest_free_block_bytes_final'])} of "
             f"{fmt_bytes(result['pool_free_bytes_final'])} free",
             f"  misses (new segment although the free total covered the request): "
             f"{result['num_misses']} ({result['num_misses_same_kind']} with enough free bytes "
             f"in the request's own size class; {result['num_misses_during_requests']} during "
             f"requests); OOMs: {result['num_ooms']}"]
    for m in result["misses"][:10]:
        lines.append(f"    {'request' if m.get('during_requests') else 'load':<8}"
                     f"{fmt_bytes(m['size'])} {m['kind']} ({m['tag']}): pool free "
                     f"{fmt_bytes(m['pool_free_bytes'])}, same class "
                     f"{fmt_bytes(m['free_same_kind_bytes'])}, largest free of that class "
                     f"{fmt_bytes(m.get('largest_free_same_kind_bytes'))}")
    if len(result["misses"]) > 10:
        lines.append(f"    ... {len(result['misses']) - 10} more in fragment.json")
    t = result["trace"]
    lines.append(f"  trace: {t['events']} events ({t['events_dropped']} dropped by the ring "
                 f"buffer before collection)")
    for p in result["policies"]:
        if p["skipped"]:
            lines.append(f"  replay {p['name']}: skipped: {p['reason']}")
            continue
        what = ("TinyLoop's pool class over the recorded addresses, every event repeated"
                if p.get("exact") else "the alloc / free sequence; no size classes, no "
                "reserve()")
        lines.append(f"  replay {p['name']} ({what}): peak reserved "
                     f"{fmt_bytes(p['peak_reserved_bytes'])}, peak in use "
                     f"{fmt_bytes(p['peak_allocated_bytes'])}, misses {p['misses']}")
        if p.get("exact"):
            same = (p["peak_reserved_bytes"] == result["peak_reserved_bytes"]
                    and p["misses"] == result["num_misses"])
            lines.append("    = the live run's peak reserved and misses" if same else
                         f"    DIFFERS from the live run (peak reserved "
                         f"{fmt_bytes(result['peak_reserved_bytes'])}, misses "
                         f"{result['num_misses']})")
    return "\n".join(lines)
