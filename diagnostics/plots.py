"""PNG plots of records (matplotlib, drawn on ``matplotlib.figure.Figure`` with the Agg canvas:
no pyplot, no display, nothing changes the notebook's or the user's backend).

matplotlib is imported on first use, not with this module: ``python -m diagnostics --help`` and
every verdict work without it; :func:`unavailable` says why plots cannot be drawn (the runners
then skip them with that one-line note).

Every function takes a list of records (see ``diagnostics.records``), a path, and the key of the
x axis: a number per record (``request``) or a label (``step``, drawn as categories). Sizes are
plotted in MiB (growth panels in KiB when the growth is under 1 MiB).
"""

from __future__ import annotations

import os

from tinyloop.memory import TAGS
from tinyloop.memory.stats import fmt_bytes

from .records import device_used_bytes

MIB = float(1 << 20)
TAG_COLORS = {"weights": "#4c72b0", "fp16_cache": "#8172b2", "buffers": "#55a868",
              "logits": "#ccb974", "kv_cache": "#c44e52", "prefix_cache": "#da8bc3",
              "resume": "#8c8c8c", "scratch": "#64b5cd", "cupy": "#937860", "graphs": "#2ca02c",
              "other": "#e17c05"}      # one per memory.tags.TAGS (tests/test_diagnostics.py)
VERDICT_COLORS = {"STABLE": "#2e7d32", "LEAK": "#c62828", "UNBOUNDED CACHE": "#ef6c00",
                  "BOUNDED CACHE, FILLING": "#1565c0", "INCONCLUSIVE": "#616161"}
CONTEXT_BAND_COLOR = "#f2c14e"


def unavailable() -> str | None:
    """None when matplotlib can be imported; else the one-line note a run prints instead of
    its plots (the ImportError's text and the install command)."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as e:
        return f"plots skipped: matplotlib cannot be imported ({e}); pip install matplotlib"
    return None


def _figure(figsize):
    from matplotlib.figure import Figure
    return Figure(figsize=figsize)


def _mib(v):
    return None if v is None else v / MIB


def _x(records, x_key):
    xs = [r.get(x_key) for r in records]
    if all(isinstance(v, (int, float)) and v is not None for v in xs):
        return xs, None
    return list(range(len(xs))), [str(v) for v in xs]


def _save(fig, path) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig.tight_layout()
    FigureCanvasAgg(fig)
    path = os.fspath(path)
    fig.savefig(path, dpi=100)
    return path


def _finish(fig, ax, labels, xlabel, path) -> str:
    if labels is not None:
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    else:
        ax.set_xlabel(xlabel)
    return _save(fig, path)


def verdict_caption(verdict: dict) -> str:
    """One line for a chart: ``"LEAK: allocated +64.0 KiB/request (tag other); reserved
    +78.8 KiB/request"`` from a leak result's ``verdict_detail``
    (:meth:`diagnostics.verdict.Verdict.to_dict`); the slopes are the verdict's least-squares
    fits over the requests after the warm-up."""
    def rate(v):
        return ("+" if v > 0 else "") + fmt_bytes(round(v)) + "/request"
    alloc = f"allocated {rate(verdict['leak_bytes_per_request'])}"
    if verdict.get("growing_tag"):
        alloc += f" (tag {verdict['growing_tag']})"
    reserved = f"reserved {rate(verdict['reserved_bytes_per_request'])}"
    first, second = ((reserved, alloc) if verdict["verdict"] == "UNBOUNDED CACHE"
                     else (alloc, reserved))
    return f"{verdict['verdict']}: {first}; {second}"


def _growth_unit(values):
    top = max((abs(v) for v in values), default=0)
    return (1024.0, "KiB") if top < MIB else (MIB, "MiB")


def growth_since(records, baseline: int, tags):
    """Per tag (and ``allocated``), bytes minus the bytes at ``records[baseline]``: the series the
    growth panel draws. Returns {name: [int, ...]}."""
    base = records[baseline]
    out = {"allocated": [r["allocated_bytes"] - base["allocated_bytes"] for r in records]}
    for t in tags:
        b = (base.get("by_tag") or {}).get(t, 0)
        out[t] = [(r.get("by_tag") or {}).get(t, 0) - b for r in records]
    return out


def timeline_by_tag(records, path, *, x_key="request", title="memory by tag",
                    verdict: dict | None = None) -> str:
    """Stacked area of live bytes per tag, with reserved bytes as a line above it.

    Where x is a request number a second panel shows each tag's growth since the warm-up (bytes
    at each request minus those at the first request after ``verdict["warmup"]``; the first
    request without a verdict), with the fitted allocated slope: a leak of a few KiB per request
    that is a sliver on top of the weights is a plain line there. ``verdict``: a leak result's
    ``verdict_detail``; its verdict and slope go on the chart.
    """
    xs, labels = _x(records, x_key)
    tags = [t for t in TAGS if any((r.get("by_tag") or {}).get(t, 0) for r in records)]
    growth_panel = labels is None and len(records) >= 2
    fig = _figure((8, 7.0) if growth_panel else (8, 4.2))
    ax = fig.add_subplot(2 if growth_panel else 1, 1, 1)
    if tags:
        ys = [[(r.get("by_tag") or {}).get(t, 0) / MIB for r in records] for t in tags]
        ax.stackplot(xs, ys, labels=tags, colors=[TAG_COLORS.get(t) for t in tags], alpha=0.85,
                     step="post" if labels is None else None)
    ax.plot(xs, [r["reserved_bytes"] / MIB for r in records], "k--", lw=1.2,
            label="reserved", drawstyle="steps-post" if labels is None else "default")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    if verdict is not None:
        fig.suptitle(title, fontsize=11)
        ax.set_title(verdict_caption(verdict), fontsize=9, fontweight="bold",
                     color=VERDICT_COLORS.get(verdict["verdict"], "black"))
    else:
        ax.set_title(title)
    if not growth_panel:
        return _finish(fig, ax, labels, x_key, path)
    ax.tick_params(labelbottom=False)
    ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
    numbered = [i for i, r in enumerate(records) if isinstance(r.get(x_key), (int, float))
                and r.get(x_key) >= 1]
    warm = verdict.get("warmup", 0) if verdict else 0
    base = numbered[min(warm, len(numbered) - 1)] if numbered else 0
    series = growth_since(records, base, tags)
    scale, unit = _growth_unit([v for s in series.values() for v in s[base:]])
    moved = [t for t in tags if any(series[t][base:])]
    for t in moved:
        ax2.plot(xs[base:], [v / scale for v in series[t][base:]], "-o", ms=2.5, lw=1.5,
                 color=TAG_COLORS.get(t), label=t)
    ax2.plot(xs[base:], [v / scale for v in series["allocated"][base:]], "k:", lw=1.2,
             label="allocated (all tags)")
    if verdict is not None and len(xs) - base >= 2:
        slope = verdict["leak_bytes_per_request"]
        x0 = xs[base]
        ax2.plot([x0, xs[-1]], [0.0, slope * (xs[-1] - x0) / scale], "--", color=VERDICT_COLORS
                 .get(verdict["verdict"], "black"), lw=1.2,
                 label=f"fit: {fmt_bytes(round(slope))}/request")
    if base > 0:
        ax2.axvspan(xs[0], xs[base], color="#cccccc", alpha=0.4, lw=0, label="warm-up")
    ax2.axhline(0.0, color="gray", lw=0.8)
    ax2.set_ylabel(f"growth since warm-up ({unit})")
    ax2.set_title(f"growth per tag since request {xs[base]}"
                  + (f", after {warm} warm-up request(s)" if verdict else "")
                  + ("" if moved else " (no tag changed)"), fontsize=9)
    ax2.legend(fontsize=8, loc="upper left", ncol=2)
    ax2.grid(alpha=0.3)
    return _finish(fig, ax2, labels, x_key, path)


def allocated_reserved_driver(records, path, *, x_key="request",
                              title="allocated vs reserved vs driver") -> str:
    """Top: the pool's allocated and reserved bytes and the driver's figure for the process
    (NVML on CUDA, RSS on the host), with the gap between the driver's figure and reserved
    drawn as a labelled band: on CUDA that is the CUDA context (plus anything allocated outside
    the pool); on the host it is the process's memory outside the pool (interpreter, libraries).
    Bottom: the driver's used bytes for the whole device (host memory on the NumPy backend)."""
    xs, labels = _x(records, x_key)
    cuda = records[0].get("device", "") == "cuda" if records else False
    fig = _figure((8, 5.6))
    ax = fig.add_subplot(2, 1, 1)
    reserved = [r["reserved_bytes"] / MIB for r in records]
    ax.plot(xs, [r["allocated_bytes"] / MIB for r in records], "-o", ms=2.5,
            label="allocated (live blocks)")
    ax.plot(xs, reserved, "-s", ms=2.5, label="reserved (pool segments)")
    if any(r.get("peak_reserved_bytes") for r in records):
        ax.plot(xs, [(r.get("peak_reserved_bytes") or 0) / MIB for r in records], ":",
                color="gray", label="peak reserved in step")
    proc = [_mib(r.get("process_bytes")) for r in records]
    if any(p is not None for p in proc):
        proc_f = [float("nan") if p is None else p for p in proc]
        ax.plot(xs, proc_f, "-^", ms=2.5, color="#6a1b9a",
                label="driver: process (NVML)" if cuda else "host: process RSS (host memory)")
        gaps = sorted(p - q for p, q in zip(proc_f, reserved) if p == p)
        gap = gaps[len(gaps) // 2] if gaps else 0.0
        what = ("CUDA context (+ outside the pool)" if cuda
                else "host memory outside the pool (interpreter, libraries)")
        ax.fill_between(xs, reserved, proc_f, where=[p == p and p >= q for p, q in
                                                     zip(proc_f, reserved)],
                        color=CONTEXT_BAND_COLOR, alpha=0.35, lw=0,
                        label=f"{what}: {gap:.0f} MiB (median)")
        mid = len(xs) // 4                  # clear of the legend, which goes where it fits
        if proc_f[mid] == proc_f[mid] and proc_f[mid] > reserved[mid]:
            ax.annotate("CUDA context" if cuda else "outside the pool",
                        (xs[mid], (proc_f[mid] + reserved[mid]) / 2), ha="center",
                        va="center", fontsize=8, color="#7a5c00")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    ax.tick_params(labelbottom=False)
    ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
    used = [device_used_bytes(r) for r in records]
    ax2.plot(xs, [float("nan") if u is None else u / MIB for u in used], "-", color="#c44e52",
             label="driver: device used (total - free)" if cuda
             else "host: memory used by all processes (total - available)")
    ax2.set_ylabel("MiB")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    return _finish(fig, ax2, labels, x_key, path)


def fragmentation(records, path, *, x_key="request", title="fragmentation") -> str:
    """External fragmentation (1 - largest free block / pool free) and the free bytes."""
    xs, labels = _x(records, x_key)
    fig = _figure((8, 4.2))
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
    fig = _figure((8, 3.6))
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
    fig = _figure((8, 3.6))
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
    return _save(fig, path)


KV_MODE_COLORS = {"fp16": "#4c72b0", "int8": "#55a868", "h_fp16": "#8172b2",
                  "h_int8": "#ccb974", "h_int4": "#c44e52"}


def kv_bytes_by_mode(table, path, *, title="KV cache bytes by storage mode") -> str:
    """Two panels from ``kv_mode_table`` rows: bytes per token (all slots) at each depth, per
    mode (bars), and KV bytes against context length at the deepest depth (lines, MiB)."""
    modes = [r["mode"] for r in table["rows"]]
    depths = table["depths"]
    fig = _figure((10, 4.2))
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
    if table.get("backend"):
        title += f" -- backend {table['backend']}, fp16 mode K/V {table['kv_dtype']}"
    fig.suptitle(title)
    return _finish(fig, ax2, None, "context length (positions)", path)
