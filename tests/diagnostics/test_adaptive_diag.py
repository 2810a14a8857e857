"""diagnostics.adaptive: the depth summary of a depth="auto" request and the KV bytes per
iteration policy, and the plot that draws them."""

from __future__ import annotations

import os

import pytest

import tinyloop
from diagnostics import adaptive, plots
from tinyloop.generate import GenerationResult


def test_depth_summary_counts_the_skipped_iterations():
    r = GenerationResult(token_ids=[1, 2, 3, 4], text="", prompt_token_ids=[0],
                         finish_reason="length", depth=4, depths=[4, 2, 1, 3])
    s = adaptive.depth_summary(r, 4)
    # 16 iterations at a fixed depth 4, 10 run: 6 saved
    assert s["compute_saved"] == pytest.approx(6 / 16)
    assert s["mean_depth"] == 2.5 and s["histogram"] == {1: 1, 2: 1, 3: 1, 4: 1}


def test_policy_bytes_and_the_plot(tmp_path, tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, backend="numpy", max_seq_len=32)
    try:
        c = m.config
        b = adaptive.policy_bytes(c, [1, 2, 4], m.kv_modes, m.ops.kv_dtype)
        one = m.kv_bytes_per_token(1)
        rec = (m.kv_bytes_per_token(2) - one)               # one iteration's slots
        assert b["all"] == [one, one + rec, one + 3 * rec]
        assert b["latest"] == [one] * 3
        r = m.generate([5, 6, 7], max_new_tokens=6, depth="auto", exit_rule="state",
                       exit_threshold=0.5, max_depth=4, stop=[])
        s = adaptive.depth_summary(r, 4)
        assert s["compute_saved"] == pytest.approx(1 - sum(r.depths) / (4 * len(r.depths)))
        if plots.unavailable() is None:
            out = plots.adaptive_depth(s, b, [1, 2, 4], tmp_path / "adaptive.png")
            assert os.path.getsize(out) > 1000
    finally:
        tinyloop.free_model(m)
