"""min-p and the repetition penalty: the rule (``numpy_ops.sample_from_logits``) against a
brute-force reference written here (plain Python over float64, exact sums by math.fsum), its
edges, the argument checks, the penalty window generate passes, the CLI's options, and the
base backend's window ring (the semantics the device ring of a captured step follows)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tinyloop
from tinyloop.backends.base import REPEAT_LAST_N_MAX, STEP_ID, STEP_POS, STEP_WORDS
from tinyloop.backends.numpy_ops import NumpyOps, penalize_logits, sample_from_logits
from tinyloop.errors import ConfigError

MARGIN = 1e-9      # draws / cuts this close to a boundary are left out (rounding decides)


def brute(logits, temperature, top_k, top_p, u, min_p=0.0, penalty=1.0, recent=()):
    """The rule, spelled out: penalty, then temperature, top-k, top-p, min-p, the draw.
    Returns None when a cut or the draw falls within MARGIN of a boundary."""
    x = [float(v) for v in np.asarray(logits, np.float32)]
    pen = np.float32(penalty)
    for i in set(int(r) for r in recent):
        v = np.float32(x[i])
        x[i] = float(v / pen if v > 0 else v * pen)
    if temperature == 0:
        best = max(x)
        return x.index(best)
    z = [v / temperature for v in x]
    ranked = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if top_k and top_k < len(ranked):
        ranked = ranked[:top_k]
    w = [math.exp(z[i] - z[ranked[0]]) for i in ranked]
    total = math.fsum(w)
    if top_p < 1.0:
        keep = len(ranked)
        for j in range(len(ranked)):
            c = math.fsum(w[:j + 1]) / total
            if abs(c - top_p) < MARGIN:
                return None
            if c >= top_p:
                keep = j + 1
                break
        ranked, w = ranked[:keep], w[:keep]
    if min_p > 0.0:
        if any(abs(v - min_p) < MARGIN for v in w):
            return None
        kept = [(i, v) for i, v in zip(ranked, w) if v >= min_p]
        ranked, w = [i for i, _ in kept], [v for _, v in kept]
    total = math.fsum(w)
    for j in range(len(ranked)):
        c = math.fsum(w[:j + 1]) / total
        if abs(c - u) < MARGIN:
            return None
        if c > u:
            return ranked[j]
    return ranked[-1]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 60))
    base = draw(st.lists(st.floats(-8, 8, width=32), min_size=n, max_size=n))
    logits = np.array(base, np.float32)
    if n > 3 and draw(st.booleans()):                       # ties
        logits[draw(st.integers(0, n - 1))] = logits[0]
        logits[draw(st.integers(0, n - 1))] = logits.max()
    if n > 2 and draw(st.booleans()):                       # masked tokens
        logits[: draw(st.integers(0, n - 1))] = -np.inf
        assume(np.isfinite(logits).any())
    temperature = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0, 2.0]))
    top_k = draw(st.sampled_from([0, 1, 3, n, n + 2]))
    top_p = draw(st.sampled_from([1.0, 0.95, 0.5, 0.0]))
    min_p = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    penalty = draw(st.sampled_from([1.0, 1.3, 0.7, 2.0]))
    recent = draw(st.lists(st.integers(0, n - 1), max_size=8))
    u = draw(st.floats(0.0, 1.0, exclude_max=True))
    return logits, temperature, top_k, top_p, u, min_p, penalty, recent


@settings(max_examples=400, deadline=None)
@given(cases())
def test_rule_equals_the_brute_force_reference(case):
    logits, temperature, top_k, top_p, u, min_p, penalty, recent = case
    want = brute(logits, temperature, top_k, top_p, u, min_p, penalty, recent)
    assume(want is not None)
    got = sample_from_logits(logits, temperature, top_k, top_p, u, min_p, penalty, recent)
    assert got == want


def test_min_p_0_and_penalty_1_change_nothing():
    rng = np.random.default_rng(1)
    for _ in range(30):
        logits = (rng.standard_normal(500) * 3).astype(np.float32)
        recent = rng.integers(0, 500, 20)
        for t, k, p in ((0.0, 0, 1.0), (0.8, 0, 0.9), (1.2, 40, 1.0)):
            u = float(rng.random())
            want = sample_from_logits(logits, t, k, p, u)
            assert sample_from_logits(logits, t, k, p, u, 0.0, 1.0, recent) == want
            assert want == brute(logits, t, k, p, u) or brute(logits, t, k, p, u) is None


def test_min_p_1_keeps_only_the_tied_maxima_in_id_order():
    logits = np.zeros(1000, np.float32)
    logits[[700, 7, 400]] = 3.0
    for u, want in ((0.0, 7), (0.3, 7), (0.34, 400), (0.66, 400), (0.67, 700), (0.999, 700)):
        assert sample_from_logits(logits, 1.0, 0, 1.0, u, min_p=1.0) == want


def test_min_p_cuts_at_the_ratio_to_the_top_token():
    # p_i / p_max = exp((l_i - l_max) / T): with T = 1, logits 0, -1, -2, -3 have ratios
    # 1, 0.368, 0.135, 0.050; min_p 0.1 keeps three
    logits = np.array([0.0, -1.0, -2.0, -3.0], np.float32)
    w = np.exp([0.0, -1.0, -2.0])
    for u in np.linspace(0, 0.999, 25):
        got = sample_from_logits(logits, 1.0, 0, 1.0, float(u), min_p=0.1)
        assert got == int(np.searchsorted(np.cumsum(w) / w.sum(), u, side="right"))


def test_all_but_one_masked_always_picks_it():
    logits = np.full(300, -np.inf, np.float32)
    logits[123] = -50.0
    for u in (0.0, 0.5, 0.9999):
        for min_p, pen in ((0.0, 1.0), (1.0, 2.0), (0.5, 0.5)):
            got = sample_from_logits(logits, 0.7, 0, 0.9, u, min_p, pen, [123, 4, 5])
            assert got == 123


def test_penalty_divides_positive_and_multiplies_negative_logits_once_per_id():
    # 2.0 / 1.25 = 1.6 < 1.9: the penalised token loses its lead
    assert sample_from_logits(np.array([2.0, 1.9], np.float32), 0.0, 0, 1.0, 0.0,
                              repetition_penalty=1.25, recent_ids=[0]) == 1
    # -1.0 * 1.25 = -1.25 < -1.1
    assert sample_from_logits(np.array([-1.0, -1.1], np.float32), 0.0, 0, 1.0, 0.0,
                              repetition_penalty=1.25, recent_ids=[0]) == 1
    # one application however often the id occurs: 2.0 / 1.25 = 1.6 > 1.5 (thrice: 1.02)
    assert sample_from_logits(np.array([2.0, 1.5], np.float32), 0.0, 0, 1.0, 0.0,
                              repetition_penalty=1.25, recent_ids=[0, 0, 0]) == 0
    out = penalize_logits(np.array([2.0, -1.0, 0.0, 3.0], np.float32), 1.25, [0, 1, 2, 1])
    assert out.dtype == np.float32
    assert out.tolist() == [np.float32(2.0) / np.float32(1.25),
                            np.float32(-1.0) * np.float32(1.25), 0.0, 3.0]


@pytest.mark.parametrize("kw,match", [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": "x"}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repeat_last_n": -1}, "repeat_last_n"),
    ({"repeat_last_n": REPEAT_LAST_N_MAX + 1}, "repeat_last_n"),
    ({"repeat_last_n": 2.5}, "repeat_last_n"), ({"repeat_last_n": True}, "repeat_last_n")])
def test_bad_filter_arguments_raise_at_the_call(tiny_model_path, kw, match):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        with pytest.raises(ConfigError, match=match):
            m.generate("hello", max_new_tokens=4, temperature=0.8, **kw)
        with pytest.raises(ConfigError, match=match):
            m.stream("hello", max_new_tokens=4, **kw)
    finally:
        tinyloop.free_model(m)


def test_generate_passes_the_last_n_tokens_of_the_request(tiny_model_path):
    """Each sample sees the distinct tokens of the last repeat_last_n positions (prompt, then
    generated) through the one sampled from, and the tokens follow the rule on them."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    try:
        prompt = [1, 5, 9, 5, 12, 30, 2, 7]
        real = m.head_sample
        seen = []

        def spy(pos, out, temperature, top_k, top_p, u, **filters):
            got = real(pos, out, temperature, top_k, top_p, u, **filters)
            row = np.array(out[0], np.float32)
            seen.append((pos, list(filters.get("recent_ids", [])), got,
                         sample_from_logits(row, temperature, top_k, top_p, u,
                                            filters.get("min_p", 0.0),
                                            filters.get("repetition_penalty", 1.0),
                                            filters.get("recent_ids"))))
            return got

        m.head_sample = spy
        for last_n in (3, 64):
            seen.clear()
            r = m.generate(prompt, max_new_tokens=10, temperature=0.9, top_p=0.95, min_p=0.02,
                           repetition_penalty=1.5, repeat_last_n=last_n, seed=3)
            everything = prompt + r.token_ids
            assert len(seen) == len(r.token_ids)
            for pos, recent, got, want in seen:
                assert recent == everything[max(0, pos + 1 - last_n):pos + 1]
                assert got == want
        # penalty 1 or window 0: no window is passed, and the tokens are the plain rule's
        seen.clear()
        plain = m.generate(prompt, max_new_tokens=10, temperature=0.9, seed=3).token_ids
        assert all(rec == [] for _, rec, _, _ in seen)
        for kw in ({"repetition_penalty": 1.0}, {"repetition_penalty": 1.5,
                                                 "repeat_last_n": 0}):
            assert m.generate(prompt, max_new_tokens=10, temperature=0.9, seed=3,
                              **kw).token_ids == plain
    finally:
        tinyloop.free_model(m)


def test_cli_passes_min_p_and_the_penalty(tiny_model_path, capsys):
    from tinyloop.cli import main
    args = ["generate", tiny_model_path, "hello", "--max-new-tokens", "8", "--backend",
            "numpy", "--raw", "--no-progress", "--temperature", "0.9", "--seed", "4"]
    assert main(args + ["--min-p", "0.05", "--repetition-penalty", "1.4",
                        "--repeat-last-n", "16"]) == 0
    out = capsys.readouterr().out
    m = tinyloop.load_model(tiny_model_path, backend="numpy")
    try:
        want = m.generate("hello", max_new_tokens=8, temperature=0.9, seed=4, min_p=0.05,
                          repetition_penalty=1.4, repeat_last_n=16).text
    finally:
        tinyloop.free_model(m)
    assert out.rstrip("\n") == want
    assert main(args + ["--min-p", "2"]) != 0
    assert "min_p" in capsys.readouterr().err


def test_base_window_ring_follows_the_step_state():
    """The captured step's window ring (base semantics, which sample.cu's sample_params follows
    on the device): seeded once from the host, it then takes each step's input token itself."""
    ops = NumpyOps()
    rng = np.random.default_rng(5)
    vocab, last_n = 40, 5
    tokens = list(rng.integers(0, vocab, 12))
    ops.set_step_sampling(0.0, 0, 1.0, 0.0, 0.0, 3.0, last_n)
    pos0 = 6
    ops.set_step_window(tokens[pos0 + 1 - last_n:pos0 + 1], pos0, last_n)
    for pos in range(pos0, 11):
        state = np.zeros(STEP_WORDS, np.int32)
        state[STEP_ID], state[STEP_POS] = tokens[pos], pos
        logits = rng.standard_normal(vocab).astype(np.float32)
        x = np.zeros((1, 4), np.float32)
        ops.rmsnorm_lm_head = lambda x, wt, eps, w, out, norm, row=logits: out.__setitem__(
            0, row)
        out = np.zeros((1, vocab), np.float32)
        ops.head_sample_step(x, None, 1e-5, None, out, None, state)
        window = tokens[max(0, pos + 1 - last_n):pos + 1]
        assert state[STEP_ID] == brute(logits, 0.0, 0, 1.0, 0.0, 0.0, 3.0, window)
    with pytest.raises(ConfigError, match="repeat_last_n"):
        ops.set_step_window([1, 2, 3], 5, 2)


def test_step_sampling_checks_the_filters():
    ops = NumpyOps()
    ops.set_step_sampling(0.0, 0, 1.0, 0.0, 0.0, 1.5, 8)            # greedy with the penalty
    assert ops._step_sampling == (0.0, 0, 1.0, 0.0) and ops._step_filters == (0.0, 1.5, 8)
    for args, match in (((0.0, 0, 1.0, 0.0), "temperature > 0"),
                        ((0.0, 0, 1.0, 0.0, 0.0, 1.5, 0), "temperature > 0"),
                        ((0.8, 0, 1.0, 0.5, 1.2), "min_p"),
                        ((0.8, 0, 1.0, 0.5, 0.0, 0.0), "repetition_penalty"),
                        ((0.8, 0, 1.0, 0.5, 0.0, 1.2, REPEAT_LAST_N_MAX + 1),
                         "repeat_last_n")):
        with pytest.raises(ConfigError, match=match):
            ops.set_step_sampling(*args)


def test_cli_ignore_eos_runs_past_the_models_eos(tiny_model_path, tmp_path, capsys):
    """--ignore-eos: on a model whose EOS id its seeded run samples, the CLI prints the text
    of the run on the same weights with another EOS id, all 8 tokens, ended by "length";
    without it the run ends at that EOS."""
    from tinyloop.cli import main
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic

    from ..conftest import TINY
    m = tinyloop.load_model(tiny_model_path, backend="numpy")
    try:
        full = m.generate("hello", max_new_tokens=8, temperature=1.0, seed=3)
    finally:
        tinyloop.free_model(m)
    first = next(i for i in range(1, 8) if full.token_ids[i] not in full.token_ids[:i])
    path = tmp_path / "eos.tlm"      # tiny_model_path's weights (same seed), that EOS id
    write_synthetic(path, synthetic_config(**TINY, eos_token_id=full.token_ids[first]),
                    seed=11)
    args = ["generate", str(path), "hello", "--max-new-tokens", "8", "--backend", "numpy",
            "--raw", "--no-progress", "--temperature", "1.0", "--seed", "3"]
    assert main(args + ["--ignore-eos"]) == 0
    cap = capsys.readouterr()
    assert cap.out.rstrip("\n") == full.text
    assert "8 new tokens" in cap.err and "(length)" in cap.err
    assert main(args) == 0
    cap = capsys.readouterr()
    assert f"{first} new tokens" in cap.err and "(eos)" in cap.err
