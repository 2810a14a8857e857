"""Records: one row of memory figures per step of a run, and the JSON / CSV files they go to.

A record is a plain ``dict`` (so a verdict can be computed from a JSON file, and tests can
write synthetic series by hand). :func:`take_record` fills it from the pool's ``MemoryStats``:

- ``allocated_bytes``, ``reserved_bytes``, ``requested_bytes``, ``pool_free_bytes`` (pool);
- ``peak_allocated_bytes``, ``peak_reserved_bytes``: the high-water marks since the last
  ``reset_peak_memory_stats`` (the runners reset them before every request, so they are the
  request's own high-water marks);
- ``by_tag``: tag -> live bytes (weights, fp16_cache, buffers, kv_cache, ...), and
  ``peak_by_tag``: tag -> high-water bytes since the last peak reset;
- ``largest_free_block_bytes``, ``external_fragmentation``, ``segments``, ``active_blocks``,
  ``num_segment_allocs``, ``num_ooms``;
- the driver's view: ``device_free_bytes`` / ``device_total_bytes`` (cudaMemGetInfo; on the
  host pool, the host's available / total memory), ``process_bytes`` (NVML on cuda, VmRSS on the
  host) and ``nvml_process_bytes`` (None off CUDA or without pynvml);
- whatever the runner adds (``request``, ``step``, ``duration_ms``, ``new_tokens``, ...).

CSV files flatten ``by_tag`` into ``tag_<name>_bytes`` columns, one per tag in ``TAGS``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time

from tinyloop.memory import TAGS

STAT_FIELDS = ("allocated_bytes", "reserved_bytes", "requested_bytes", "pool_free_bytes",
               "peak_allocated_bytes", "peak_reserved_bytes", "largest_free_block_bytes",
               "external_fragmentation", "segments", "active_blocks", "num_segment_allocs",
               "num_ooms", "device_free_bytes", "device_total_bytes", "process_bytes",
               "nvml_process_bytes")


def take_record(pool, **extra) -> dict:
    """A record of ``pool``'s figures now, with ``extra`` fields (and ``time_s``) added."""
    s = pool.stats()
    rec = dict(extra)
    rec["time_s"] = time.time()
    for name in STAT_FIELDS:
        rec[name] = getattr(s, name)
    rec["by_tag"] = dict(s.by_tag)
    rec["peak_by_tag"] = dict(s.peak_by_tag)
    return rec


def device_used_bytes(rec: dict) -> int | None:
    """``device_total - device_free`` (the driver's used figure for the whole device), or None."""
    free, total = rec.get("device_free_bytes"), rec.get("device_total_bytes")
    if free is None or total is None:
        return None
    return total - free


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):       # numpy scalars
        return x.item()
    return x


def write_json(path, obj) -> str:
    """Write ``obj`` as indented JSON (NaN / inf become null); returns the path."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(_jsonable(obj), f, indent=1)
        f.write("\n")
    return path


def write_result(out_dir, command: str, result: dict, files: list) -> dict:
    """Finish a command's run: list ``files`` (paths of what it wrote) and ``<command>.json`` in
    ``result["files"]``, write ``result`` to ``out_dir/<command>.json``, return it."""
    result["files"] = [os.path.basename(f) for f in files] + [f"{command}.json"]
    write_json(os.path.join(out_dir, f"{command}.json"), result)
    return result


RELEASE_FIGURES = ("allocated_bytes", "reserved_bytes", "process_bytes", "device_free_bytes")


def release_rows(result: dict) -> list[dict]:
    """A release result's table rows: its starting state (no ``freed``), then every step; their
    ``step`` names are the records' ``step`` labels, which the plots use."""
    return ([result["start"]] if result.get("start") else []) + result["steps"]


def release_step_cells(step: dict) -> tuple[list[str], list[str]]:
    """The figures a release step's table row shows: ``fmt_bytes`` of its ``after`` figures
    (RELEASE_FIGURES, in order) and of what it freed (allocated, reserved, process; empty for
    the starting state)."""
    after = [fmt_bytes(step["after"][k]) for k in RELEASE_FIGURES]
    if "freed" not in step:
        return after, ["", "", ""]
    freed = [fmt_bytes(step["freed"][k]) for k in RELEASE_FIGURES[:3]]
    return after, freed


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def flatten(rec: dict) -> dict:
    """``rec`` with ``by_tag`` spread into ``tag_<name>_bytes`` columns (nested dicts dropped)."""
    out = {k: v for k, v in rec.items() if not isinstance(v, (dict, list))}
    by_tag = rec.get("by_tag") or {}
    for tag in TAGS:
        out[f"tag_{tag}_bytes"] = by_tag.get(tag, 0)
    return out


def write_csv(path, records: list[dict]) -> str:
    """Write ``records`` (flattened) as CSV; the columns are the union, in first-seen order."""
    rows = [flatten(r) for r in records]
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    path = os.fspath(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return path


def fmt_bytes(n) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units); None -> ``"n/a"``; floats keep a sign."""
    if n is None:
        return "n/a"
    sign, n = ("-", -n) if n < 0 else ("", n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
