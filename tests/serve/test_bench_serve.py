"""``python -m benchmarks bench_serve`` runs end to end on the NumPy backend on a tiny model:
every level generates its tokens, and allocated bytes return to their start value."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..conftest import TINY

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_bench_serve_runs_on_the_numpy_backend(tmp_path):
    from benchmarks.common import write_synthetic_model
    dims = {k: v for k, v in TINY.items() if k != "max_depth"}
    model = write_synthetic_model(str(tmp_path / "tiny.tlm"), seed=5, max_depth=4, **dims)
    r = subprocess.run([sys.executable, "-m", "benchmarks", "bench_serve", "--backend", "numpy",
                        "--model", model, "--concurrency", "1,3", "--prompt-tokens", "12",
                        "--new-tokens", "24", "--reps", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    out = json.load(open(tmp_path / "bench_serve.json"))
    levels = out["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["tokens"] == 24 * lv["concurrency"]       # EOS ignored: every token made
        assert lv["allocated_back_to_start"] and lv["aggregate_tok_s"] > 0
        assert lv["ttft_ms_p50"] <= lv["ttft_ms_p99"]
        assert lv["bytes_per_request_by_tag"]["kv_cache"] > 0
        assert lv["threads_tok_s"] > 0
        # the decode window counts only tokens made once every request had its first
        assert 0 <= lv["decode_tokens"] <= lv["tokens"] - lv["concurrency"]
        assert lv["decode_window_s"] > 0
        runs = lv["runs"]
        assert len(runs) == 2
        for run in runs:
            assert run["decode_tok_s"] == run["decode_tokens"] / run["decode_window_s"]
            assert run["allocated_back_to_start"]
        # the level's figure is the median of its runs, with their spread
        decode = sorted(run["decode_tok_s"] for run in runs)
        assert lv["decode_tok_s"] == (decode[0] + decode[1]) / 2
        assert lv["decode_tok_s_spread"] == {"median": lv["decode_tok_s"], "min": decode[0],
                                             "max": decode[1], "runs": 2}
    assert out["batch1_generate_decode_tok_s"] > 0


def test_the_decode_window_runs_on_the_engines_clock_when_the_caller_wakes_late(
        tiny_model_path, monkeypatch):
    """A caller that wakes only after every request ended (a busy machine) still gets a
    positive window, measured from the engine's last first token to its last token, and
    counts no decode token it could not see being made."""
    import numpy as np

    import tinyloop
    from benchmarks.bench_serve import run_level
    from tinyloop.serve.engine import EngineRequest
    seen = []
    real_iter = EngineRequest.__iter__

    def late_iter(self):
        self._done.wait(60)                 # the caller wakes after the request ended
        seen.append(self)
        return real_iter(self)
    monkeypatch.setattr(EngineRequest, "__iter__", late_iter)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy")
    prompts = [np.random.default_rng(i).integers(3, 200, 8).tolist() for i in range(3)]
    lv = run_level(m, prompts, new_tokens=10, depth=None, prefill_chunk=64)
    assert lv["tokens"] == 30
    window = max(r.finished_at for r in seen) - max(r.first_token_at for r in seen)
    assert window > 0 and lv["decode_window_s"] == window
    assert lv["decode_tokens"] == 0 and lv["decode_tok_s"] == 0.0
