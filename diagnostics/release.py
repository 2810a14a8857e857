"""``python -m diagnostics release``: what each release step frees, in the pool's and the
driver's figures, before and after.

The steps (docs/architecture.md, "why a runtime keeps memory after a request": emptying the
allocator's cache does not unload the weights; unloading makes the next request a cold start):

1. load the model; 2. a first request; 3. a warm request -- the *end of a request* frees its
KV cache (peak during the request vs allocated after); 4. ``empty_cache()`` -- returns the
cached free segments, weights stay loaded (checked), and a request afterwards needs no reload;
5. ``free_model()`` -- the model's blocks become free pool bytes (still reserved);
6. ``empty_cache()`` again -- now the reservation goes back to the driver; 7. load again and
8. run one request: the cold start, timed against the warm request; 9. free the model again.

Every record is named after the step that ends at it (the first: "before load"), so the table
rows and the plots' x labels are the same names, in the same order.

Writes DIR/release.json (steps with before / after / freed, checks, timings, records),
DIR/release.csv and the plots DIR/release_*.png.
"""

from __future__ import annotations

import os
import time

import tinyloop
from tinyloop.backends import resolve_backend
from tinyloop.memory import empty_cache, reset_peak_memory_stats

from . import plots
from .records import (fmt_bytes, release_rows, release_step_cells, take_record, write_csv,
                      write_result)
from .session import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_SEQ_LEN, DEFAULT_PROMPT,
                      backend_facts, backend_pool, load_timed, resolve_model, run_on)

FIGURES = ("allocated_bytes", "reserved_bytes", "pool_free_bytes", "device_free_bytes",
           "process_bytes", "nvml_process_bytes")


def _delta(before: dict, after: dict) -> dict:
    """Bytes freed by a step, per figure (positive = freed; device_free: positive = the driver
    reports that much more free)."""
    out = {}
    for k in FIGURES:
        b, a = before.get(k), after.get(k)
        if b is None or a is None:
            out[k] = None
        elif k == "device_free_bytes":
            out[k] = a - b
        else:
            out[k] = b - a
    return out


def _figures(rec: dict) -> dict:
    out = {k: rec.get(k) for k in FIGURES}
    out["by_tag"] = {t: v for t, v in rec["by_tag"].items() if v}
    return out


def run_release(out_dir, *, model_path: str | None = None, backend: str = "auto",
                prompt: str = DEFAULT_PROMPT, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                depth: int | None = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                plot: bool = True) -> dict:
    """Run the release steps and write their files into ``out_dir``; returns release.json's
    content."""
    os.makedirs(out_dir, exist_ok=True)
    backend = resolve_backend(backend)
    model_path = resolve_model(model_path)
    pool = backend_pool(backend)
    records, steps = [], []

    def rec(step: str, **extra) -> dict:
        r = take_record(pool, step=step, index=len(records), device=pool.device, **extra)
        records.append(r)
        return r

    def request(model, label: str):
        reset_peak_memory_stats()
        t0 = time.perf_counter()
        res = model.generate(prompt, max_new_tokens=max_new_tokens, depth=depth,
                             temperature=0.0)
        dt = time.perf_counter() - t0
        return res, dt, rec(label, duration_ms=dt * 1e3, new_tokens=len(res.token_ids))

    def step(name: str, action: str, before: dict, after: dict, **notes) -> None:
        steps.append({"step": name, "action": action, "before": _figures(before),
                      "after": _figures(after), "freed": _delta(before, after), **notes})

    r0 = rec("before load")
    model, load_s = load_timed(model_path, max_seq_len, backend)
    r1 = rec("load", duration_ms=load_s * 1e3)
    vram = tinyloop.vram_usage_bytes(model)
    step("load", "tinyloop.load_model()", r0, r1, seconds=load_s, model_bytes=vram)
    try:
        _, first_s, r2 = request(model, "first request")
        step("first request", "model.generate() after load", r1, r2, seconds=first_s,
             peak_allocated_during_bytes=r2["peak_allocated_bytes"],
             peak_kv_cache_bytes=r2["peak_by_tag"].get("kv_cache", 0))
        res, warm_s, r3 = request(model, "end of request")
        end_of_request = r3["peak_allocated_bytes"] - r3["allocated_bytes"]
        step("end of request", "a warm request ends (its KV cache is freed)", r2, r3,
             seconds=warm_s, peak_allocated_during_bytes=r3["peak_allocated_bytes"],
             freed_at_request_end_bytes=end_of_request,
             peak_kv_cache_bytes=r3["peak_by_tag"].get("kv_cache", 0))
        vram = tinyloop.vram_usage_bytes(model)     # now with the lazily made logit row
        released = empty_cache()
        r4 = rec("empty_cache")
        weights_kept = (r4["by_tag"]["weights"] == r3["by_tag"]["weights"] > 0
                        and tinyloop.vram_usage_bytes(model) == vram)
        step("empty_cache", "tinyloop.memory.empty_cache() with the model loaded", r3, r4,
             released_bytes=released, weights_kept=weights_kept,
             model_bytes_after=tinyloop.vram_usage_bytes(model))
        res2, after_empty_s, r5 = request(model, "request after empty_cache")
        step("request after empty_cache", "model.generate(): no reload, the KV segment is "
             "reserved again", r4, r5, seconds=after_empty_s,
             same_output=res2.token_ids == res.token_ids)
    finally:
        tinyloop.free_model(model)
    r6 = rec("free_model")
    step("free_model", "tinyloop.free_model(): the model's blocks become free pool bytes", r5,
         r6, model_bytes_after=tinyloop.vram_usage_bytes(model))
    released2 = empty_cache()
    r7 = rec("empty_cache after free_model")
    step("empty_cache after free_model", "tinyloop.memory.empty_cache(): the segments go back "
         "to the driver", r6, r7, released_bytes=released2)

    model2, load2_s = load_timed(model_path, max_seq_len, backend)
    r8 = rec("reload", duration_ms=load2_s * 1e3)
    step("reload", "load_model() again: the first half of a cold start", r7, r8,
         seconds=load2_s)
    try:
        res3, cold_first_s, r9 = request(model2, "cold request")
    finally:
        tinyloop.free_model(model2)
    step("cold request", "the first request after the reload: the second half of a cold "
         "start", r8, r9, seconds=cold_first_s, cold_start_s=load2_s + cold_first_s,
         same_output=res3.token_ids == res.token_ids)
    r10 = rec("free_model at the end")
    step("free_model at the end", "tinyloop.free_model() of the reloaded model", r9, r10)

    cold_s = load2_s + cold_first_s
    checks = {
        "request_end_frees_kv_cache": r3["by_tag"].get("kv_cache", 0) == 0
        and end_of_request > 0,
        "empty_cache_kept_weights": weights_kept,
        "empty_cache_released_bytes": released,
        "free_model_released_model_bytes": r5["allocated_bytes"] - r6["allocated_bytes"] >= vram,
        "empty_cache_after_free_model_released_bytes": released2,
        "outputs_identical": res2.token_ids == res.token_ids == res3.token_ids,
    }
    # The driver's side of the last release: how much of what the pool returned the driver
    # (NVML / RSS) actually saw go. Much less means something outside the pool still holds it
    # (on the host: a live NumPy view keeps a returned segment's pages mapped).
    if r6.get("process_bytes") is not None and r7.get("process_bytes") is not None:
        checks["driver_saw_bytes_released"] = r6["process_bytes"] - r7["process_bytes"]
        # page-granular and allocator-dependent figures: judge only releases of 64 MiB or more
        checks["driver_saw_most_of_release"] = (
            None if released2 < (64 << 20)
            else r6["process_bytes"] - r7["process_bytes"] >= released2 // 2)
    timings = {"load_s": load_s, "first_request_s": first_s, "warm_request_s": warm_s,
               "request_after_empty_cache_s": after_empty_s, "reload_s": load2_s,
               "cold_first_request_s": cold_first_s, "cold_start_s": cold_s,
               "cold_over_warm": cold_s / warm_s if warm_s > 0 else None}
    verdict = (f"end of request frees {fmt_bytes(end_of_request)} (KV cache); empty_cache() "
               f"returns {fmt_bytes(released)} and keeps the weights "
               f"({'yes' if weights_kept else 'NO'}); free_model() frees "
               f"{fmt_bytes(r5['allocated_bytes'] - r6['allocated_bytes'])} and the next "
               f"empty_cache() returns {fmt_bytes(released2)} to the driver; a cold start "
               f"(load + request) takes {cold_s:.2f} s vs {warm_s:.2f} s warm "
               f"({timings['cold_over_warm']:.1f}x)")
    if checks.get("driver_saw_most_of_release") is False:
        verdict += (f"; WARNING: the driver's process figure fell by only "
                    f"{fmt_bytes(checks['driver_saw_bytes_released'])} of the "
                    f"{fmt_bytes(released2)} the pool returned: something outside the pool "
                    f"still holds the memory")
    result = {"command": "release", "verdict": verdict, "checks": checks, "timings": timings,
              "model_bytes": vram,
              "config": {"model": model_path, **backend_facts(backend), "device": pool.device,
                         "prompt": prompt, "max_new_tokens": max_new_tokens,
                         "depth": res.depth, "max_seq_len": max_seq_len},
              "start": {"step": r0["step"], "action": "the process before the load",
                        "after": _figures(r0)},
              "steps": steps, "records": records}
    files = [write_csv(os.path.join(out_dir, "release.csv"), records)]
    note = plots.unavailable() if plot else None
    if plot and note is None:
        files += [
            plots.timeline_by_tag(records, os.path.join(out_dir, "release_timeline_by_tag.png"),
                                  x_key="step", title="release: memory by tag at each step"),
            plots.allocated_reserved_driver(records, os.path.join(out_dir, "release_memory.png"),
                                            x_key="step",
                                            title="release: allocated vs reserved vs driver"),
            plots.fragmentation(records, os.path.join(out_dir, "release_fragmentation.png"),
                                x_key="step", title="release: fragmentation at each step"),
        ]
    result["plots_note"] = note
    return write_result(out_dir, "release", result, files)


def summary(result: dict) -> str:
    c = result["config"]
    lines = [f"release: {os.path.basename(c['model'])} on {run_on(c)}",
             f"  {result['verdict']}", "",
             f"  {'step':<30}{'allocated':>12}{'reserved':>12}{'proc (drv)':>12}"
             f"{'dev free':>12}   freed (- = grew): alloc / reserved / proc"]
    for s in release_rows(result):
        after, freed = release_step_cells(s)
        lines.append(f"  {s['step']:<30}" + "".join(f"{c:>12}" for c in after)
                     + ("   " + " / ".join(freed) if freed[0] else ""))
    lines.append("")
    lines += [f"  check {k}: {v}" for k, v in result["checks"].items()]
    return "\n".join(lines)
