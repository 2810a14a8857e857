"""``python -m diagnostics report DIR``: one self-contained HTML page (plots embedded as base64
PNGs) with the verdicts of the leak / fragment / release runs found in DIR."""

from __future__ import annotations

import base64
import datetime
import glob
import html
import os

from .records import fmt_bytes, read_json, release_rows, release_step_cells

COMMANDS = ("leak", "fragment", "release")

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:1.5em auto;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
.verdict{font-size:1.15em;padding:.6em .8em;border-radius:6px;background:#eef}
.STABLE{background:#e3f4e3}.LEAK{background:#fbe3e3}.UNBOUNDED{background:#fdf0d8}
.BOUNDED{background:#e6eefa}
.INCONCLUSIVE{background:#eee}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:2px 8px}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.plots img{width:49%;min-width:420px;margin:2px 0}
ul.ev{font-size:.9em;font-family:ui-monospace,monospace}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _img(path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return (f'<img alt="{_e(os.path.basename(path))}" title="{_e(os.path.basename(path))}" '
            f'src="data:image/png;base64,{data}">')


def _kv_table(d: dict) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _leak_section(r: dict) -> str:
    cls = r["verdict"].split()[0].rstrip(",")
    out = [f'<p class="verdict {cls}"><b>{_e(r["verdict"])}</b>: {_e(r["reason"])}</p>',
           f"<p>leak rate (least-squares fit of allocated bytes at request end): "
           f"<b>{_e(fmt_bytes(r['leak_bytes_per_request']))}/request</b>; reservation "
           f"{_e(fmt_bytes(r['reserved_bytes_per_request']))}/request"
           + (f"; growing tag <b>{_e(r['growing_tag'])}</b>" if r.get("growing_tag") else "")
           + (f"; about {_e(r['requests_needed'])} requests would decide"
              if r.get("requests_needed") else "") + "</p>"]
    p = r.get("planted", {})
    if p.get("leak_bytes_per_request") or p.get("cache_bytes_per_request"):
        out.append(f"<p>planted faults: leak {_e(p.get('leak_bytes_per_request'))} B/request, "
                   f"cache {_e(p.get('cache_bytes_per_request'))} B/request</p>")
    out.append('<ul class="ev">' + "".join(f"<li>{_e(e)}</li>" for e in r["evidence"]) + "</ul>")
    out.append(_kv_table(r["config"]))
    return "\n".join(out)


def _fragment_section(r: dict) -> str:
    out = [f'<p class="verdict">{_e(r["verdict"])}</p>',
           _kv_table({
               "peak reserved / peak allocated": f"{fmt_bytes(r['peak_reserved_bytes'])} / "
               f"{fmt_bytes(r['peak_allocated_bytes'])} = "
               f"{r['peak_reserved_over_peak_allocated']:.3f}",
               "external fragmentation (max, final): 1 - largest free block / pool free, "
               "the share of the cached free bytes one request cannot get in one piece":
                   f"{r['external_fragmentation_max']:.3f}, "
                   f"{r['external_fragmentation_final']:.3f}",
               "largest free block at the end": f"{fmt_bytes(r['largest_free_block_bytes_final'])}"
               f" of {fmt_bytes(r['pool_free_bytes_final'])} free",
               "misses (all / same size class / during requests)":
                   f"{r['num_misses']} / {r['num_misses_same_kind']} / "
                   f"{r['num_misses_during_requests']}",
               "OOMs": r["num_ooms"],
               "trace events (dropped)": f"{r['trace']['events']} "
                                         f"({r['trace']['events_dropped']})"})]
    rows = []
    for p in r.get("policies", []):
        if p["skipped"]:
            rows.append(f"<tr><td>{_e(p['name'])}</td><td colspan=4>skipped: "
                        f"{_e(p['reason'])}</td></tr>")
        else:
            ratio = p.get("peak_reserved_over_peak_allocated")
            ratio = "n/a" if ratio is None else f"{ratio:.3f}"
            how = (" (the live pool's class; every event repeated)" if p.get("exact")
                   else " (the alloc / free sequence)")
            rows.append(f"<tr><td>{_e(p['name'] + how)}</td>"
                        f"<td class=n>{_e(fmt_bytes(p['peak_allocated_bytes']))}</td>"
                        f"<td class=n>{_e(fmt_bytes(p['peak_reserved_bytes']))}</td>"
                        f"<td class=n>{ratio}</td>"
                        f"<td class=n>{_e(p['misses'])}</td></tr>")
    if rows:
        out.append("<h3>the same trace, replayed against allocator policies</h3><table><tr>"
                   "<th>policy</th><th>peak in use</th><th>peak reserved</th>"
                   "<th>reserved/in use</th><th>misses</th></tr>" + "".join(rows) + "</table>")
    out.append(_kv_table(r["config"]))
    return "\n".join(out)


def _release_section(r: dict) -> str:
    out = [f'<p class="verdict">{_e(r["verdict"])}</p>', "<table><tr><th>step</th>"
           "<th>action</th><th>allocated</th><th>reserved</th><th>process (driver)</th>"
           "<th>device free</th><th>freed alloc / reserved</th></tr>"]
    for s in release_rows(r):
        after, freed = release_step_cells(s)
        out.append(f"<tr><td>{_e(s['step'])}</td><td>{_e(s['action'])}</td>"
                   + "".join(f"<td class=n>{_e(c)}</td>" for c in after)
                   + (f"<td class=n>{_e(freed[0])} / {_e(freed[1])}</td></tr>"
                      if freed[0] else "<td></td></tr>"))
    out.append("</table>")
    out.append(_kv_table({**r["checks"], **{k: (f"{v:.3f}" if isinstance(v, float) else v)
                                             for k, v in r["timings"].items()}}))
    return "\n".join(out)


_SECTIONS = {"leak": ("Leak test: identical requests", _leak_section),
             "fragment": ("Fragmentation: varying requests", _fragment_section),
             "release": ("Release steps", _release_section)}


def write_report(out_dir, path: str | None = None) -> str:
    """Render DIR's results into ``path`` (default DIR/report.html); returns the path.

    Raises FileNotFoundError when DIR holds none of leak.json / fragment.json / release.json.
    """
    found = {c: os.path.join(out_dir, f"{c}.json") for c in COMMANDS
             if os.path.exists(os.path.join(out_dir, f"{c}.json"))}
    if not found:
        raise FileNotFoundError(f"{out_dir} has no leak.json, fragment.json or release.json: "
                                f"run `python -m diagnostics leak --out {out_dir}` first")
    body = []
    summary = []
    for cmd, jpath in found.items():
        r = read_json(jpath)
        title, render = _SECTIONS[cmd]
        summary.append(f"<li><a href='#{cmd}'>{_e(cmd)}</a>: <b>{_e(r['verdict'])}</b></li>")
        pngs = sorted(glob.glob(os.path.join(out_dir, f"{cmd}_*.png")))
        body.append(f"<h2 id='{cmd}'>{_e(title)}</h2>\n{render(r)}\n<div class='plots'>"
                    + "".join(_img(p) for p in pngs) + "</div>")
    now = datetime.datetime.now().isoformat(timespec="seconds")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>TinyLoop memory report"
            f"</title><style>{_CSS}</style></head><body><h1>TinyLoop memory report</h1>"
            f"<p>{_e(os.path.abspath(out_dir))}, rendered {now}. allocated = live blocks; "
            f"reserved = segments the pool holds (live or cached); device free / process = the "
            f"driver's view. A stable reserved high-water mark is caching; allocated bytes that "
            f"grow with every identical request are a leak.</p><ul>{''.join(summary)}</ul>"
            + "\n".join(body) + "</body></html>\n")
    path = path or os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write(page)
    return path
