"""``python -m diagnostics leak``: N identical greedy requests, a record after each, a verdict.

The test from docs/architecture.md ("why a runtime keeps memory after a request"): run the same
fixed request again and again and record, after each, allocated and reserved bytes, the bytes
of every tag, the driver's device-free figure and the process's NVML usage. A high-water mark
that stops rising is caching; allocated bytes that grow with every identical request are a
leak; reserved bytes that grow while allocated stays flat are an unbounded cache. The verdict
itself is ``diagnostics.verdict.classify`` (a pure function of the records, so it can be re-run
on a saved leak.json).

With a prefix pool (``--prefix-pool BYTES``, or ``unbounded``) every request goes through a
``tinyloop.PrefixPool``; with ``--unique-prompts`` each request's prompt ends in two tokens of its
own (same length), so each one inserts a new entry. Each record then carries the pool's
``stats()`` and ``cache_bytes`` / ``cache_tag`` ("prefix_cache") / ``cache_budget_bytes`` (its
``max_bytes``) / ``cache_evictions``, which is how the verdict tells a pool without a budget
(UNBOUNDED CACHE, naming the tag and its growth per request) from a leak, and a budgeted pool
still filling (BOUNDED CACHE, FILLING: held of budget) from one that is full and evicting
(STABLE once the footprint holds). The verdict reads those records, not the options of the
run.

Writes DIR/leak.json (``verdict``, ``leak_bytes_per_request``, the evidence and the records),
DIR/leak.csv and the plots DIR/leak_*.png.
"""

from __future__ import annotations

import os
import time

import tinyloop
from tinyloop.memory import reset_peak_memory_stats, round_size

from . import plots
from .faults import PlantedCache, PlantedLeak
from .records import fmt_bytes, take_record, write_csv, write_result
from .session import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_SEQ_LEN, DEFAULT_PROMPT,
                      backend_facts, load_timed, progress, run_on, settle_run)
from .verdict import classify


def run_leak(out_dir, *, model=None, model_path: str | None = None, requests: int = 30,
             backend: str = "auto", prompt: str = DEFAULT_PROMPT,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, depth: int | None = None,
             max_seq_len: int = DEFAULT_MAX_SEQ_LEN, plant_leak: int = 0, plant_cache: int = 0,
             prefix_pool=False, unique_prompts: bool = False,
             show_progress: bool = True, plot: bool = True) -> dict:
    """Run the leak test and write its files into ``out_dir``; returns leak.json's content.

    ``model``: a loaded Model to use (left loaded; ``model_path``, ``backend`` and
    ``max_seq_len`` are then taken from it); else the run loads ``model_path`` (default: the
    embedded model) and frees it at the end. ``plant_leak`` / ``plant_cache``: bytes per request
    of a planted fault (see ``diagnostics.faults``). ``prefix_pool``: False (no pool), None (a
    PrefixPool without a budget) or its ``max_bytes``; ``unique_prompts``: give each request a
    prompt of its own (two trailing tokens; same length). Raises ValueError for ``requests`` < 1 and
    whatever ``tinyloop.load_model`` / ``Model.generate`` raise (TinyLoopError family).
    """
    own, backend, model_path, max_seq_len = settle_run(out_dir, requests, model, model_path,
                                                       backend, max_seq_len)
    model, load_s = load_timed(model_path, max_seq_len, backend) if own else (model, 0.0)
    pool = model.pool
    leak = PlantedLeak(pool, plant_leak)
    cache = PlantedCache(pool, plant_cache)
    ppool = None if prefix_pool is False else tinyloop.PrefixPool(model, max_bytes=prefix_pool)
    records = [take_record(pool, request=0, step="loaded", duration_ms=load_s * 1e3,
                           new_tokens=0, device=pool.device)]
    texts = set()
    try:
        for i in progress(range(1, requests + 1), total=requests, desc="leak",
                          enabled=show_progress):
            reset_peak_memory_stats()
            t0 = time.perf_counter()
            req = unique_prompt(model, prompt, i) if unique_prompts else prompt
            res = model.generate(req, max_new_tokens=max_new_tokens, depth=depth,
                                 temperature=0.0, prefix_pool=ppool)
            leak.after_request()
            cache.after_request()
            dt = time.perf_counter() - t0
            texts.add(res.text)
            extra = {}
            if ppool is not None:
                st = ppool.stats()
                extra = dict(cache_bytes=st["bytes"], cache_tag="prefix_cache",
                             cache_budget_bytes=st["max_bytes"],
                             cache_evictions=st["evictions"], cached_tokens=res.cached_tokens,
                             prefix_pool={k: st[k] for k in ("hits", "misses", "evictions",
                                                            "entries", "bytes")})
            records.append(take_record(pool, request=i, step="request",
                                       duration_ms=dt * 1e3, new_tokens=len(res.token_ids),
                                       device=pool.device, planted_leak_bytes=leak.held_bytes,
                                       planted_cache_bytes=cache.grown_bytes, **extra))
        vram = tinyloop.vram_usage_bytes(model)
        depth_used = res.depth
        pool_stats = ppool.stats() if ppool is not None else None
    finally:
        leak.release()
        if ppool is not None:
            ppool.release()
        if own:
            tinyloop.free_model(model)

    verdict = classify([r for r in records if r["request"] >= 1])
    result = {
        "command": "leak",
        "verdict": verdict.verdict,
        "leak_bytes_per_request": verdict.leak_bytes_per_request,
        "reserved_bytes_per_request": verdict.reserved_bytes_per_request,
        "growing_tag": verdict.growing_tag,
        "reason": verdict.reason,
        "evidence": verdict.evidence,
        "stable_from": verdict.stable_from,
        "requests_needed": verdict.requests_needed,
        "planted": {"leak_bytes_per_request": plant_leak,
                    "leak_bytes_per_request_rounded": round_size(plant_leak) if plant_leak else 0,
                    "cache_bytes_per_request": plant_cache},
        "config": {"model": model_path, **backend_facts(backend), "device": pool.device,
                   "requests": requests, "prompt": prompt, "max_new_tokens": max_new_tokens,
                   "depth": depth_used, "max_seq_len": max_seq_len,
                   "prefix_pool": prefix_pool is not False,
                   "prefix_pool_max_bytes": None if prefix_pool is False else prefix_pool,
                   "unique_prompts": unique_prompts},
        "model": {"load_s": load_s, "vram_usage_bytes": vram,
                  "identical_outputs": None if unique_prompts else len(texts) == 1},
        "prefix_pool": pool_stats,
        "verdict_detail": verdict.to_dict(),
        "records": records,
    }
    files = [write_csv(os.path.join(out_dir, "leak.csv"), records)]
    note = plots.unavailable() if plot else None
    if plot and note is None:
        files += [
            plots.timeline_by_tag(records, os.path.join(out_dir, "leak_timeline_by_tag.png"),
                                  title="leak: memory by tag after each request",
                                  verdict=result["verdict_detail"]),
            plots.allocated_reserved_driver(records, os.path.join(out_dir, "leak_memory.png"),
                                            title="leak: allocated vs reserved vs driver"),
            plots.fragmentation(records, os.path.join(out_dir, "leak_fragmentation.png"),
                                title="leak: fragmentation after each request"),
        ]
    result["plots_note"] = note
    return write_result(out_dir, "leak", result, files)


def unique_prompt(model, prompt: str, i: int):
    """Request ``i``'s own prompt: ``prompt``'s ids and two tokens that encode ``i`` (every
    request the same length, so a pool's entries are all one size)."""
    ids = [int(t) for t in model.encode_prompt(prompt)]
    base = min(1000, model.config.vocab_size // 4)
    span = model.config.vocab_size - base
    return ids + [base + i % span, base + (i // span) % span]


def summary(result: dict) -> str:
    """The lines the CLI prints for a leak run."""
    c = result["config"]
    kind = "unique-prompt" if c.get("unique_prompts") else "identical"
    lines = [f"leak: {c['requests']} {kind} requests ({c['max_new_tokens']} new tokens, "
             f"greedy, depth {c['depth']}) on {run_on(c)}",
             f"VERDICT: {result['verdict']}: {result['reason']}"]
    ps = result.get("prefix_pool")
    if ps is not None:
        budget = ("unbounded" if ps["max_bytes"] is None else fmt_bytes(ps["max_bytes"]))
        lines.append(f"  prefix pool (budget {budget}): {ps['entries']} entries, "
                     f"{fmt_bytes(ps['bytes'])} held; {ps['hits']} hits / {ps['misses']} "
                     f"misses, {ps['evictions']} evictions")
    if result["requests_needed"]:
        lines.append(f"  about {result['requests_needed']} requests would decide "
                     f"(--requests {result['requests_needed']})")
    accounted = result["verdict_detail"].get("cache_held_bytes") is not None
    lines.append(f"  leak rate {fmt_bytes(result['leak_bytes_per_request'])}/request (fit of "
                 f"allocated at request end"
                 + (", less the bytes the cache accounts for" if accounted else "")
                 + f"); reservation {fmt_bytes(result['reserved_bytes_per_request'])}/request")
    p = result["planted"]
    if p["leak_bytes_per_request"]:
        lines.append(f"  planted leak {p['leak_bytes_per_request']} B/request (pool rounds to "
                     f"{p['leak_bytes_per_request_rounded']} B)")
    if p["cache_bytes_per_request"]:
        lines.append(f"  planted cache {p['cache_bytes_per_request']} B/request")
    lines += ["  " + e for e in result["evidence"]]
    return "\n".join(lines)
