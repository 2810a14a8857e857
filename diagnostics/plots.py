"""PNG plots of records (matplotlib, drawn on ``matplotlib.figure.Figure`` with the Agg canvas:
no pyplot, no display, nothing changes the notebook's or the user's backend).

Every function takes a list of records (see ``diagnostics.records``), a path, and the key of the
x axis: a number per record (``request``) or a label (``step``, drawn as categories). Sizes are
plotted in MiB.
"""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tinyloop.memory import TAGS

from .records import device_used_bytes

MIB = float(1 << 20)
TAG_COLORS = {"weights": "#4c72b0", "fp16_cache": "#8172b2", "buffers": "#55a868",
              "logits": "#ccb974", "kv_cache": "#c44e52", "prefix_cache": "#da8bc3",
              "resume": "#8c8c8c", "scratch": "#64b5cd", "cupy": "#937860", "other": "#e17c05"}


def _mib(v):
    return None if v is None else v / MIB


def _x(records, x_key):
    xs = [r.get(x_key) for r in records]
    if all(isinstance(v, (int, float)) and v is not None for v in xs):
        return xs, None
    return list(range(len(xs))), [str(v) for v in xs]


def _finish(fig, ax, labels, xlabel, path) -> str:
    if labels is not None:
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    else:
        ax.set_xlabel(xlabel)
    fig.tight_layout()
    FigureCanvasAgg(fig)
    path = os.fspath(path)
    fig.savefig(path, dpi=100)
    return path


def timeline_by_tag(records, path, *, x_key="request", title="memory by tag") -> str:
    """Stacked area of live bytes per tag, with reserved bytes as a line above it."""
    xs, labels = _x(records, x_key)
    tags = [t for t in TAGS if any((r.get("by_tag") or {}).get(t, 0) for r in records)]
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    if tags:
        ys = [[(r.get("by_tag") or {}).get(t, 0) / MIB for r in records] for t in tags]
        ax.stackplot(xs, ys, labels=tags, colors=[TAG_COLORS.get(t) for t in tags], alpha=0.85,
                     step="post" if labels is None else None)
    ax.plot(xs, [r["reserved_bytes"] / MIB for r in records], "k--", lw=1.2,
            label="reserved", drawstyle="steps-post" if labels is None else "default")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    return _finish(fig, ax, labels, x_key, path)


def allocated_reserved_driver(records, path, *, x_key="request",
                              title="allocated vs reserved vs driver") -> str:
    """Top: the pool's allocated and reserved bytes and the driver's figure for the process
    (NVML on CUDA, RSS on the host). Bottom: the driver's used bytes for the whole device."""
    xs, labels = _x(records, x_key)
    fig = Figure(figsize=(8, 5.2))
    ax = fig.add_subplot(2, 1, 1)
    ax.plot(xs, [r["allocated_bytes"] / MIB for r in records], "-o", ms=2.5,
            label="allocated (live blocks)")
    ax.plot(xs, [r["reserved_bytes"] / MIB for r in records], "-s", ms=2.5,
            label="reserved (pool segments)")
    if any(r.get("peak_reserved_bytes") for r in records):
        ax.plot(xs, [(r.get("peak_reserved_bytes") or 0) / MIB for r in records], ":",
                color="gray", label="peak reserved in step")
    proc = [_mib(r.get("process_bytes")) for r in records]
    if any(p is not None for p in proc):
        dev = records[0].get("device", "")
        ax.plot(xs, [float("nan") if p is None else p for p in proc], "-^", ms=2.5,
                label="driver: process (" + ("NVML" if dev == "cuda" else "RSS") + ")")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.tick_params(labelbottom=False)
    ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
    used = [device_used_bytes(r) for r in records]
    ax2.plot(xs, [float("nan") if u is None else u / MIB for u in used], "-", color="#c44e52",
             label="driver: device used (total - free)")
    ax2.set_ylabel("MiB")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    return _finish(fig, ax2, labels, x_key, path)


def fragmentation(records, path, *, x_key="request", title="fragmentation") -> str:
    """External fragmentation (1 - largest free block / pool free) and the free bytes."""
    xs, labels = _x(records, x_key)
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(xs, [r.get("external_fragmentation", 0.0) for r in records], "-", color="#c44e52",
            label="external fragmentation")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("1 - largest free / pool free")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    axr = ax.twinx()
    axr.plot(xs, [r.get("pool_free_bytes", 0) / MIB for r in records], "--", color="#4c72b0",
             label="pool free (reserved - allocated)")
    axr.plot(xs, [r.get("largest_free_block_bytes", 0) / MIB for r in records], ":",
             color="#55a868", label="largest free block")
    axr.set_ylabel("MiB")
    axr.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = axr.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="center left")
    return _finish(fig, ax, labels, x_key, path)


def event_timeline(timeline, path, *, title="allocation trace") -> str:
    """Allocated and reserved bytes after every event of a replayed trace
    (``fragment.replay_trace(...)["timeline"]``: dicts with event, allocated, reserved)."""
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    xs = [p["event"] for p in timeline]
    ax.plot(xs, [p["allocated_bytes"] / MIB for p in timeline], lw=1, label="allocated")
    ax.plot(xs, [p["reserved_bytes"] / MIB for p in timeline], lw=1, label="reserved")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _finish(fig, ax, None, "event", path)


def policy_comparison(policies, path, *, title="one trace, three allocators") -> str:
    """Bars of peak reserved and peak in-use bytes per allocator policy (skipped ones omitted).
    ``policies``: dicts with name, peak_reserved_bytes, peak_allocated_bytes."""
    done = [p for p in policies if not p.get("skipped")]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(done)))
    ax.bar([x - 0.2 for x in xs], [p["peak_allocated_bytes"] / MIB for p in done], 0.4,
           label="peak in use")
    ax.bar([x + 0.2 for x in xs], [p["peak_reserved_bytes"] / MIB for p in done], 0.4,
           label="peak reserved")
    ax.set_xticks(xs)
    ax.set_xticklabels([p["name"] for p in done], fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    FigureCanvasAgg(fig)
    fig.savefig(os.fspath(path), dpi=100)
    return os.fspath(path)


KV_MODE_COLORS = {"fp16": "#4c72b0", "int8": "#55a868", "h_fp16": "#8172b2",
                  "h_int8": "#ccb974", "h_int4": "#c44e52"}


def kv_bytes_by_mode(table, path, *, title="KV cache bytes by storage mode") -> str:
    """Two panels from ``kv_mode_table`` rows: bytes per token (all slots) at each depth, per
    mode (bars), and KV bytes against context length at the deepest depth (lines, MiB)."""
    modes = [r["mode"] for r in table["rows"]]
    depths = table["depths"]
    fig = Figure(figsize=(10, 4.2))
    ax = fig.add_subplot(1, 2, 1)
    w = 0.8 / len(depths)
    for j, d in enumerate(depths):
        ax.bar([i + j * w for i in range(len(modes))],
               [r["bytes_per_token"][str(d)] / 1024 for r in table["rows"]], w,
               label=f"depth {d}")
    ax.set_xticks([i + w * (len(depths) - 1) / 2 for i in range(len(modes))])
    ax.set_xticklabels(modes)
    ax.set_ylabel("KiB per token (all slots)")
    ax.set_title("bytes per token")
    ax.legend(fontsize=8)
    ax2 = fig.add_subplot(1, 2, 2)
    ctx = table["context"]
    d = str(depths[-1])
    for r in table["rows"]:
        ax2.plot(ctx, [r["bytes_per_token"][d] * c / MIB for c in ctx], label=r["mode"],
                 color=KV_MODE_COLORS.get(r["mode"]))
    ax2.set_ylabel("MiB")
    ax2.set_title(f"KV bytes vs context (depth {d})")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    return _finish(fig, ax2, None, "context length (positions)", path)
