"""KV bytes per storage mode for a model: a table and a plot (``python -m diagnostics kvmodes``).

No model is loaded: the figures come from the .tlm header and ``tinyloop.kv.layouts.PageLayout``
(the layout the caches are built from) for one backend, named with every figure: the modes
store the same codes on both, except ``fp16``, whose K/V are the backend's ``kv_dtype``
(float16 on CUDA, float32 on the NumPy reference: twice the bytes). ``tinyloop inspect`` prints
the same figures for the same backend.
"""

from __future__ import annotations

import os

import numpy as np

from tinyloop.backends import ops_class
from tinyloop.config import KV_MODES
from tinyloop.format import read_tlm
from tinyloop.kv.layouts import PageLayout, kv_bytes_per_token

from . import plots
from .records import write_json
from .session import resolve_model

CONTEXT = [0, 256, 512, 1024, 2048, 4096, 8192]


def storage(layout: PageLayout) -> str:
    """What a page of ``layout`` stores, part by part: ``"k float32, v float32"``."""
    return ", ".join(f"{p.name} {p.dtype}" for p in layout.parts)


def kv_mode_table(cfg, depths=None, *, backend: str = "auto") -> dict:
    """Rows per mode for ``backend`` ("auto" | "cuda" | "numpy"; its ``kv_dtype`` sizes fp16
    K/V): bytes per token per slot, over all slots at each depth (``bytes_per_token``:
    kv_iterations "all"; ``bytes_per_token_latest``: "latest"), and what a page stores.
    Returns {"backend", "kv_dtype", "depths", "context", "rows"}."""
    ops = ops_class(backend)
    kv_dtype = np.dtype(ops.kv_dtype).name
    depths = depths or sorted({1, cfg.max_depth})
    rows = []
    for mode in KV_MODES:
        try:
            lay = PageLayout.for_config(cfg, mode, 1, kv_dtype)
        except ValueError:                    # h_int* on a d_model that groups do not divide
            continue
        rows.append({"mode": mode, "bytes_per_token_per_slot": lay.bytes_per_token,
                     "storage": storage(lay),
                     "bytes_per_token": {str(d): kv_bytes_per_token(cfg, d, (mode,) *
                                                                    cfg.n_layers, kv_dtype)
                                         for d in depths},
                     # kv_iterations="latest": one slot per recurrent layer at any depth
                     "bytes_per_token_latest": {
                         str(d): kv_bytes_per_token(cfg, d, (mode,) * cfg.n_layers, kv_dtype,
                                                    "latest") for d in depths}})
    return {"backend": ops.name, "kv_dtype": kv_dtype, "depths": depths, "context": CONTEXT,
            "rows": rows}


def run_kvmodes(out_dir, *, model_path: str | None = None, backend: str = "auto",
                plot: bool = True) -> dict:
    """Write kvmodes.json (and kv_bytes_by_mode.png) for ``model_path`` on ``backend`` into
    ``out_dir``; returns the table (:func:`kv_mode_table`) with ``config`` and ``files``."""
    os.makedirs(out_dir, exist_ok=True)
    path = resolve_model(model_path)
    with read_tlm(path) as f:
        cfg = f.config
    res = {"command": "kvmodes", "config": {"model": path}, **kv_mode_table(cfg, backend=backend)}
    files = []
    if plot:
        files.append(os.path.basename(plots.kv_bytes_by_mode(
            res, os.path.join(out_dir, "kv_bytes_by_mode.png"))))
    res["files"] = files + ["kvmodes.json"]
    write_json(os.path.join(out_dir, "kvmodes.json"), res)
    return res


def summary(res: dict) -> str:
    d = res["depths"]
    lines = [f"KV bytes per token by storage mode on backend {res['backend']} (fp16 mode: K/V "
             f"{res['kv_dtype']}) for {os.path.basename(res['config']['model'])}",
             f"  {'mode':<8}{'per slot':>10}" + "".join(f"{'depth ' + str(x):>14}" for x in d)
             + "   stored as"]
    for r in res["rows"]:
        lines.append(f"  {r['mode']:<8}{r['bytes_per_token_per_slot']:>10,d}"
                     + "".join(f"{r['bytes_per_token'][str(x)]:>14,d}" for x in d)
                     + f"   {r['storage']}")
    return "\n".join(lines)
