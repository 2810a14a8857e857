"""KV bytes per storage mode for a model: a table and a plot (``python -m diagnostics kvmodes``).

No model is loaded: the figures come from the .tlm header and ``tinyloop.kvcache.PageLayout``
(the layout the caches are built from), so they hold for both backends (fp16 K/V counted as
FP16, the CUDA dtype; the NumPy reference stores fp16 mode as float32, twice that).
"""

from __future__ import annotations

import os

from tinyloop.config import KV_MODES
from tinyloop.format import read_tlm
from tinyloop.kvcache import PageLayout, kv_bytes_per_token

from . import plots
from .records import write_json
from .session import resolve_model

CONTEXT = [0, 256, 512, 1024, 2048, 4096, 8192]


def kv_mode_table(cfg, depths=None) -> dict:
    """Rows per mode: bytes per token per slot, and over all slots at each depth."""
    depths = depths or sorted({1, cfg.max_depth})
    rows = []
    for mode in KV_MODES:
        try:
            lay = PageLayout.for_config(cfg, mode, 1)
        except ValueError:                    # h_int* on a d_model that groups do not divide
            continue
        rows.append({"mode": mode, "bytes_per_token_per_slot": lay.bytes_per_token,
                     "bytes_per_token": {str(d): kv_bytes_per_token(cfg, d, (mode,) *
                                                                    cfg.n_layers)
                                         for d in depths}})
    return {"depths": depths, "context": CONTEXT, "rows": rows}


def run_kvmodes(out_dir, *, model_path: str | None = None, plot: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    path = resolve_model(model_path)
    with read_tlm(path) as f:
        cfg = f.config
    res = {"command": "kvmodes", "config": {"model": path}, **kv_mode_table(cfg)}
    files = []
    if plot:
        files.append(os.path.basename(plots.kv_bytes_by_mode(
            res, os.path.join(out_dir, "kv_bytes_by_mode.png"))))
    res["files"] = files + ["kvmodes.json"]
    write_json(os.path.join(out_dir, "kvmodes.json"), res)
    return res


def summary(res: dict) -> str:
    d = res["depths"]
    lines = [f"KV bytes per token by storage mode ({res['config']['model']})",
             f"  {'mode':<8}{'per slot':>10}" + "".join(f"{'depth ' + str(x):>14}" for x in d)]
    for r in res["rows"]:
        lines.append(f"  {r['mode']:<8}{r['bytes_per_token_per_slot']:>10,d}"
                     + "".join(f"{r['bytes_per_token'][str(x)]:>14,d}" for x in d))
    return "\n".join(lines)
