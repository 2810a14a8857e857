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
              "other": "#e17c05"}      # one per memory.tags.TAGS (tests/diagnostics/)
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
    return Figure(figsize=figsize, layout="constrained")   # makes room for outside legends


def _mib(v):
    return None if v is None else v / MIB


def _nan(v):
    return float("nan") if v is None else v


def _x(records, x_key):
    xs = [r.get(x_key) for r in records]
    if all(isinstance(v, (int, float)) and v is not None for v in xs):
        return xs, None
    return list(range(len(xs))), [str(v) for v in xs]


def _legend(ax, handles=None, labels=None, **kw):
    """The legend right of the axes, outside the data."""
    args = () if handles is None else (handles, labels)
    ax.legend(*args, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              fontsize=8, frameon=False, **kw)


def _save(fig, path) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
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
        if xlabel in ("request", "event"):
            from matplotlib.ticker import MaxNLocator
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, path)


# A record is the state *after* a request or step: it holds until the next record, so every
# per-record series is drawn as steps (drawstyle steps-post), never as a line between points.
STEPS = {"drawstyle": "steps-post"}
EXTERNAL_FRAGMENTATION = ("external fragmentation = 1 - largest free block / pool free:\nthe "
                          "share of the pool's cached free bytes that one request cannot get "
                          "in one piece (0: all in one block)")


def verdict_caption(verdict: dict) -> str:
    """One line for a chart: ``"LEAK: allocated +64.0 KiB/request (tag other); reserved
    +78.8 KiB/request"`` from a leak result's ``verdict_detail``
    (:meth:`diagnostics.verdict.Verdict.to_dict`); the slopes are the verdict's least-squares
    fits over the requests after the warm-up. A cache with a budget adds what it holds of it."""
    def rate(v):
        return ("+" if v > 0 else "") + fmt_bytes(round(v)) + "/request"
    alloc = f"allocated {rate(verdict['leak_bytes_per_request'])}"
    if verdict.get("growing_tag"):
        alloc += f" (tag {verdict['growing_tag']})"
    reserved = f"reserved {rate(verdict['reserved_bytes_per_request'])}"
    first, second = ((reserved, alloc) if verdict["verdict"] == "UNBOUNDED CACHE"
                     else (alloc, reserved))
    out = f"{verdict['verdict']}: {first}; {second}"
    held, budget = verdict.get("cache_held_bytes"), verdict.get("cache_budget_bytes")
    if held is not None and budget is not None:
        out += f"; cache {fmt_bytes(held)} of {fmt_bytes(budget)} budget"
    return out


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


def _first_request(records, x_key) -> int:
    """Index of the first record numbered 1 or more (0 when none is)."""
    return next((i for i, r in enumerate(records) if isinstance(r.get(x_key), (int, float))
                 and r.get(x_key) >= 1), 0)


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
    fig = _figure((9.5, 7.0) if growth_panel else (9.5, 4.4))
    ax = fig.add_subplot(2 if growth_panel else 1, 1, 1)
    if tags:
        ys = [[(r.get("by_tag") or {}).get(t, 0) / MIB for r in records] for t in tags]
        ax.stackplot(xs, ys, labels=tags, colors=[TAG_COLORS.get(t) for t in tags], alpha=0.85,
                     step="post")
    ax.plot(xs, [r["reserved_bytes"] / MIB for r in records], "k--", lw=1.2,
            label="reserved", **STEPS)
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    _legend(ax)
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
                 color=TAG_COLORS.get(t), label=t, **STEPS)
    ax2.plot(xs[base:], [v / scale for v in series["allocated"][base:]], "k:", lw=1.2,
             label="allocated (all tags)", **STEPS)
    fitted = series["allocated"]
    if all(r.get("cache_bytes") is not None for r in records[base:]):
        # a cache that accounts for its bytes: the leak fit is of what it does not hold
        b0 = records[base]["allocated_bytes"] - records[base]["cache_bytes"]
        fitted = [0] * base + [r["allocated_bytes"] - r["cache_bytes"] - b0
                               for r in records[base:]]
        ax2.plot(xs[base:], [v / scale for v in fitted[base:]], "-", color="#555555", lw=5,
                 alpha=0.3, label="allocated less the cache", zorder=1, **STEPS)
    if verdict is not None and len(xs) - base >= 2:
        slope = verdict["leak_bytes_per_request"]
        i0 = base
        if verdict.get("cache_filled_at") in xs:      # fitted from the fill on
            i0 = xs.index(verdict["cache_filled_at"])
            ax2.axvline(xs[i0], color="#da8bc3", ls="-.", lw=1,
                        label=f"cache full (request {xs[i0]})")
        x0, y0 = xs[i0], fitted[i0] / scale
        ax2.plot([x0, xs[-1]], [y0, y0 + slope * (xs[-1] - x0) / scale], "--",
                 color=VERDICT_COLORS.get(verdict["verdict"], "black"), lw=1.2,
                 label=f"leak fit: {fmt_bytes(round(slope))}/request")
    if base > 0:
        ax2.axvspan(xs[0], xs[base], color="#cccccc", alpha=0.4, lw=0, label="warm-up")
    ax2.axhline(0.0, color="gray", lw=0.8)
    ax2.set_ylabel(f"growth since warm-up ({unit})")
    ax2.set_title(f"growth per tag since request {xs[base]}"
                  + (f", after {warm} warm-up request(s)" if verdict else "")
                  + ("" if moved else " (no tag changed)"), fontsize=9)
    _legend(ax2)
    ax2.grid(alpha=0.3)
    return _finish(fig, ax2, labels, x_key, path)


def allocated_reserved_driver(records, path, *, x_key="request",
                              title="allocated vs reserved vs driver") -> str:
    """Top: the pool's allocated and reserved bytes and the driver's figure for the process
    (NVML on CUDA, RSS on the host), with the gap between the driver's figure and reserved
    drawn as a labelled band: on CUDA that is the CUDA context (plus anything allocated outside
    the pool); on the host it is the process's memory outside the pool (interpreter, libraries).
    Middle, where x is a request number: allocated and reserved minus their values at the first
    request, on an axis of their own (a leak of a few KiB per request is flat on the top
    panel's hundreds of MiB). Bottom: the driver's used bytes for the whole device (host memory
    on the NumPy backend)."""
    xs, labels = _x(records, x_key)
    cuda = records[0].get("device", "") == "cuda" if records else False
    growth_panel = labels is None and len(records) >= 2
    rows = 3 if growth_panel else 2
    fig = _figure((9.5, 8.0 if growth_panel else 5.8))
    ax = fig.add_subplot(rows, 1, 1)
    reserved = [r["reserved_bytes"] / MIB for r in records]
    ax.plot(xs, reserved, "-", lw=5, alpha=0.35, color="#ff7f0e",
            label="reserved (pool segments)", **STEPS)      # wide: allocated shows on top
    ax.plot(xs, [r["allocated_bytes"] / MIB for r in records], "-o", ms=2.5, color="#1f77b4",
            label="allocated (live blocks)", zorder=3, **STEPS)
    if any(r.get("peak_reserved_bytes") for r in records):
        ax.plot(xs, [(r.get("peak_reserved_bytes") or 0) / MIB for r in records], ":",
                color="gray", label="peak reserved in step", **STEPS)
    proc = [_mib(r.get("process_bytes")) for r in records]
    if any(p is not None for p in proc):
        proc_f = [_nan(p) for p in proc]
        ax.plot(xs, proc_f, "-^", ms=2.5, color="#6a1b9a",
                label="driver: process (NVML)" if cuda else "host: process RSS (host memory)",
                **STEPS)
        gaps = sorted(p - q for p, q in zip(proc_f, reserved) if p == p)
        gap = gaps[len(gaps) // 2] if gaps else 0.0
        what = ("CUDA context (+ outside the pool)" if cuda
                else "host memory outside the pool\n(interpreter, libraries)")
        ax.fill_between(xs, reserved, proc_f, where=[p == p and p >= q for p, q in
                                                     zip(proc_f, reserved)],
                        color=CONTEXT_BAND_COLOR, alpha=0.35, lw=0, step="post",
                        label=f"{what}: {gap:.0f} MiB (median)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    _legend(ax)
    ax.grid(alpha=0.3)
    ax.tick_params(labelbottom=False)
    if growth_panel:
        axg = fig.add_subplot(rows, 1, 2, sharex=ax)
        b = _first_request(records, x_key)
        ga = [r["allocated_bytes"] - records[b]["allocated_bytes"] for r in records[b:]]
        gr = [r["reserved_bytes"] - records[b]["reserved_bytes"] for r in records[b:]]
        scale, unit = _growth_unit(ga + gr)
        axg.plot(xs[b:], [v / scale for v in gr], "-", lw=5, alpha=0.35, color="#ff7f0e",
                 label="reserved", **STEPS)                 # wide: allocated shows on top
        axg.plot(xs[b:], [v / scale for v in ga], "-o", ms=2.5, lw=1.2, color="#1f77b4",
                 label="allocated", zorder=3, **STEPS)
        axg.axhline(0.0, color="gray", lw=0.8)
        axg.set_ylabel(f"{unit} since request {xs[b]}")
        axg.set_title(f"growth since request {xs[b]}: allocated and reserved minus their "
                      f"values then", fontsize=9)
        _legend(axg)
        axg.grid(alpha=0.3)
        axg.tick_params(labelbottom=False)
    ax2 = fig.add_subplot(rows, 1, rows, sharex=ax)
    used = [device_used_bytes(r) for r in records]
    ax2.plot(xs, [_nan(u if u is None else u / MIB) for u in used], "-",
             color="#c44e52", label="driver: device used\n(total - free)" if cuda
             else "host: memory used by all\nprocesses (total - available)", **STEPS)
    ax2.set_ylabel("MiB")
    ax2.ticklabel_format(axis="y", useOffset=False, style="plain")
    _legend(ax2)
    ax2.grid(alpha=0.3)
    return _finish(fig, ax2, labels, x_key, path)


def fragmentation(records, path, *, x_key="request", title="fragmentation") -> str:
    """Top: the pool's free bytes (reserved - allocated) and its largest free block, in MiB
    (the block drawn narrow on top of the wide free-bytes line, so both show where they are
    equal). Bottom: external fragmentation, 1 - largest free block / pool free, defined on the
    chart."""
    xs, labels = _x(records, x_key)
    fig = _figure((9.5, 5.8))
    ax = fig.add_subplot(2, 1, 1)
    ax.plot(xs, [r.get("pool_free_bytes", 0) / MIB for r in records], "-", color="#4c72b0",
            lw=5, alpha=0.35, label="pool free\n(reserved - allocated)", **STEPS)
    ax.plot(xs, [r.get("largest_free_block_bytes", 0) / MIB for r in records], "-o",
            color="#1b5e20", lw=1.2, ms=3, label="largest free block", zorder=3, **STEPS)
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)
    ax.tick_params(labelbottom=False)
    ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
    ax2.plot(xs, [r.get("external_fragmentation", 0.0) for r in records], "-o", ms=3,
             color="#c44e52", label="external\nfragmentation", **STEPS)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("1 - largest / pool free")
    ax2.set_title(EXTERNAL_FRAGMENTATION, fontsize=8)
    ax2.grid(alpha=0.3)
    _legend(ax2)
    return _finish(fig, ax2, labels, x_key, path)


def event_timeline(timeline, path, *, title="allocation trace") -> str:
    """Allocated and reserved bytes after every event of a replayed trace
    (``fragment.analyze_trace(...)["timeline"]``, possibly downsampled: dicts with event,
    allocated_bytes, reserved_bytes), as steps."""
    fig = _figure((9.5, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    xs = [p["event"] for p in timeline]
    ax.plot(xs, [p["reserved_bytes"] / MIB for p in timeline], lw=1.2, color="#ff7f0e",
            label="reserved", **STEPS)
    ax.plot(xs, [p["allocated_bytes"] / MIB for p in timeline], lw=1, color="#1f77b4",
            label="allocated", **STEPS)
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    _legend(ax)
    ax.grid(alpha=0.3)
    return _finish(fig, ax, None, "event", path)


def policy_comparison(policies, path, *, title="one trace, three allocators") -> str:
    """Bars of peak reserved and peak in-use bytes per allocator policy (skipped ones omitted).
    ``policies``: dicts with name, peak_reserved_bytes, peak_allocated_bytes (``exact``: the
    replay of the live pool class, labelled so)."""
    done = [p for p in policies if not p.get("skipped")]
    fig = _figure((9.5, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(done)))
    ax.bar([x - 0.2 for x in xs], [p["peak_allocated_bytes"] / MIB for p in done], 0.4,
           label="peak in use")
    ax.bar([x + 0.2 for x in xs], [p["peak_reserved_bytes"] / MIB for p in done], 0.4,
           label="peak reserved")
    ax.set_xticks(xs)
    ax.set_xticklabels([p["name"] + ("\n(= the live run)" if p.get("exact") else "")
                        for p in done], fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    _legend(ax)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


KV_MODE_COLORS = {"fp16": "#4c72b0", "int8": "#55a868", "h_fp16": "#8172b2",
                  "h_int8": "#ccb974", "h_int4": "#c44e52"}


def kv_bytes_by_mode(table, path, *, title="KV cache bytes by storage mode") -> str:
    """Two panels from ``kv_mode_table`` rows: bytes per token (all slots) at each depth, per
    mode (bars), and KV bytes against context length at the deepest depth (lines, MiB). The
    title names the backend and its fp16-mode K/V dtype."""
    modes = [r["mode"] for r in table["rows"]]
    depths = table["depths"]
    fig = _figure((11, 4.4))
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
    _legend(ax)
    ax2 = fig.add_subplot(1, 2, 2)
    ctx = table["context"]
    d = str(depths[-1])
    for r in table["rows"]:
        ax2.plot(ctx, [r["bytes_per_token"][d] * c / MIB for c in ctx], label=r["mode"],
                 color=KV_MODE_COLORS.get(r["mode"]))
    ax2.set_ylabel("MiB")
    ax2.set_title(f"KV bytes vs context (depth {d})")
    _legend(ax2)
    if table.get("backend"):
        title += f" -- backend {table['backend']}, fp16 mode K/V {table['kv_dtype']}"
    fig.suptitle(title)
    return _finish(fig, ax2, None, "context length (positions)", path)


def adaptive_depth(summary, policies, depths, path, *, title="adaptive depth") -> str:
    """Two panels: the depth each token of a request ran at (``adaptive.depth_summary``;
    steps, the mean dashed, the compute saved in the title) and the KV bytes per token of
    each iteration KV policy by depth (``adaptive.policy_bytes``, KiB)."""
    fig = _figure((11, 4.2))
    ax = fig.add_subplot(1, 2, 1)
    ds = summary["depths"]
    ax.plot(range(len(ds)), ds, **STEPS, label="depth")
    ax.axhline(summary["mean_depth"], linestyle="--", color="#616161",
               label=f"mean {summary['mean_depth']:.2f}")
    ax.set_ylim(0.5, summary["max_depth"] + 0.5)
    ax.set_ylabel("depth (recurrent iterations)")
    ax.set_title(f"depth per token: {summary['compute_saved']:.0%} of the iterations at "
                 f"depth {summary['max_depth']} saved")
    _legend(ax)
    ax2 = fig.add_subplot(1, 2, 2)
    for policy, values in policies.items():
        ax2.plot(depths, [v / 1024 for v in values], marker="o", label=policy)
    ax2.set_ylabel("KiB per token (all slots)")
    ax2.set_title("KV bytes per token by iteration policy")
    _legend(ax2)
    fig.suptitle(title)
    ax.set_xlabel("token")
    return _finish(fig, ax2, None, "depth", path)
