"""Sampling edges: top_p = 0 is greedy; logits with a NaN or +inf,
or only -inf, raise NonFiniteLogitsError naming the step and position instead of being sampled;
NaN or inf norm weights and scales are refused by the writer and the loader.

``check_non_finite_generation`` runs on both backends (tests/model/test_cuda_model.py calls it
with backend="cuda")."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.backends.numpy_ops import sample_from_logits
from tinyloop.convert.synthetic import synthetic_config, synthetic_weights
from tinyloop.format import read_tlm, write_tlm
from tinyloop.memory import get_pool

from ..conftest import TINY

NAN, INF = np.float32(np.nan), np.float32(np.inf)


# --- top_p = 0 -------------------------------------------------------------------------------
def test_top_p_0_keeps_one_token_so_it_is_greedy():
    rng = np.random.default_rng(0)
    for trial in range(40):
        logits = (rng.standard_normal(1000) * 3).astype(np.float32)
        if trial % 2:
            logits[[700, 7, 400]] = logits.max() + 1.0          # a tie: the lowest id wins
        want = int(np.argmax(logits))
        for temperature in (0.3, 1.0, 2.5):
            for top_p in (0.0, 1e-8, np.float32(0.0)):
                for u in (0.0, 0.5, 0.9999):
                    assert sample_from_logits(logits, temperature, 0, top_p, u) == want
            assert sample_from_logits(logits, temperature, 1, 1.0, 0.9999) == want   # top_k=1


def test_generate_top_p_0_equals_greedy_at_any_temperature(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        greedy = m.generate("hello", max_new_tokens=12).token_ids
        assert m.generate("hello", max_new_tokens=12, top_p=0.0).token_ids == greedy
        for seed in range(3):
            r = m.generate("hello", max_new_tokens=12, temperature=1.5, top_p=0, seed=seed)
            assert r.token_ids == greedy
        # and it is not greedy by accident: top_p = 1 at that temperature samples elsewhere
        assert any(m.generate("hello", max_new_tokens=12, temperature=1.5, seed=s).token_ids
                   != greedy for s in range(3))
    finally:
        tinyloop.free_model(m)


def test_cli_top_p_0_runs_and_is_greedy(tiny_model_path, capsys):
    from tinyloop.cli import main
    common = ["generate", tiny_model_path, "hello", "--max-new-tokens", "8", "--backend",
              "numpy", "--max-seq-len", "64"]
    assert main(common) == 0
    greedy = capsys.readouterr().out.split("\n# ")[0]
    assert main(common + ["--top-p", "0", "--temperature", "0.9", "--seed", "4"]) == 0
    assert capsys.readouterr().out.split("\n# ")[0] == greedy


# --- non-finite logits: the sampler ------------------------------------------------------------
def _row(values, n=50):
    out = np.linspace(-2, 2, n).astype(np.float32)
    for i, v in values.items():
        out[i] = v
    return out


FAULTY = [                                  # (name, logits, kind) of each fault kind
    ("all NaN", np.full(7, NAN), "nan"),
    ("[0, +inf]", np.array([0, INF], np.float32), "+inf"),
    ("all -inf", np.full(7, -INF), "all -inf"),
    ("one NaN, the last", _row({49: NAN}), "nan"),
    ("one NaN before a +inf", _row({3: INF, 20: NAN}), "nan"),
    ("one +inf", _row({30: INF}), "+inf"),
    ("+inf and -inf", _row({0: -INF, 1: INF}), "+inf"),
]


@pytest.mark.parametrize("name, logits, kind", FAULTY, ids=[c[0] for c in FAULTY])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0),
                                                       (0.7, 5, 0.9), (1.0, 0, 0.0)])
def test_non_finite_logits_raise_instead_of_sampling(name, logits, kind, temperature, top_k,
                                                     top_p):
    with pytest.raises(errors.NonFiniteLogitsError) as ei:
        sample_from_logits(logits, temperature, top_k, top_p, 0.5)
    e = ei.value
    assert isinstance(e, errors.TinyLoopError) and isinstance(e, FloatingPointError)
    assert e.kind == kind and e.step is None and e.position is None
    assert {"nan": "NaN", "+inf": "+inf", "all -inf": "all -inf"}[kind] in str(e)


def test_some_minus_inf_logits_are_masked_tokens_not_faults():
    logits = _row({i: -INF for i in range(0, 50, 2)})        # even ids masked
    assert sample_from_logits(logits, 0.0, 0, 1.0, 0.0) == 49
    picks = {sample_from_logits(logits, 2.0, 0, 1.0, u) for u in np.linspace(0, 0.999, 200)}
    assert picks and all(p % 2 == 1 for p in picks) and len(picks) > 5


# --- non-finite logits: generate and stream, on either backend -----------------------------------
def check_non_finite_generation(path: str, backend: str) -> None:
    """NaN norm weights (corrupted after load) and logits that turn non-finite at a later step
    raise NonFiniteLogitsError naming step and position; the request's KV cache is released,
    and the model generates as before once the fault is gone."""
    m = tinyloop.load_model(path, max_seq_len=64, backend=backend)
    pool = m.pool
    try:
        prompt = [5, 6, 7]
        want = m.generate(prompt, max_new_tokens=5).token_ids
        kv0 = pool.by_tag()["kv_cache"]
        good = m.ops.to_host(m._output_norm).copy()
        m._output_norm[...] = np.nan            # as a stray write or a bad kernel would leave it
        for temperature in (0.0, 1.0):
            with pytest.raises(errors.NonFiniteLogitsError) as ei:
                m.generate(prompt, max_new_tokens=4, temperature=temperature, seed=0)
            e = ei.value
            assert (e.kind, e.step, e.position) == ("nan", 0, 2)
            assert "at step 0 (position 2)" in str(e)
            assert pool.by_tag()["kv_cache"] == kv0
        m.ops.from_host(good, m._output_norm)

        # the hook below spoils rows of the eager head; a captured decode step never calls
        # it (tests/model/test_graphs.py checks faults inside a replayed step), so graphs are off
        saved_env = {k: os.environ.get(k) for k in ("TINYLOOP_CUDA_GRAPHS",)}
        os.environ.update({k: "0" for k in saved_env})
        real_head = m.head
        refs = {t: m.generate(prompt, max_new_tokens=8, temperature=t, seed=1).token_ids
                for t in (0.0, 0.8)}
        for bad_call, value, kind in ((3, np.inf, "+inf"), (2, -np.inf, "all -inf"),
                                      (5, np.nan, "nan")):
            calls = []

            # generate samples through Model.head_sample (the CUDA backend fuses head and
            # argmax): spoil the logit row of one call, then sample it as the backend does
            def head_sample(pos, out, temperature, top_k, top_p, u, bad_call=bad_call,
                            value=value):
                real_head(pos, 1, out)
                calls.append(pos)
                if len(calls) == bad_call:
                    out[...] = value
                return int(m.ops.sample(out[0], temperature, top_k, top_p, u))

            m.head_sample = head_sample
            step, position = bad_call - 1, len(prompt) - 1 + bad_call - 1
            for temperature in (0.0, 0.8):
                calls.clear()
                with pytest.raises(errors.NonFiniteLogitsError) as ei:
                    m.generate(prompt, max_new_tokens=8, temperature=temperature, seed=1)
                assert (ei.value.kind, ei.value.step, ei.value.position) == (kind, step, position)
                assert f"at step {step} (position {position})" in str(ei.value)
                assert ei.value.partial.token_ids == refs[temperature][:step]
                assert ei.value.partial.finish_reason == "error"
                calls.clear()
                got = []
                with pytest.raises(errors.NonFiniteLogitsError) as ei:
                    for t in m.stream(prompt, max_new_tokens=8):
                        got.append(t.token_id)
                assert got == want[:len(got)] and len(got) <= step
                assert ei.value.partial.token_ids == refs[0.0][:step]
                assert pool.by_tag()["kv_cache"] == kv0
            del m.head_sample
        for k, v in saved_env.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        assert m.generate(prompt, max_new_tokens=5).token_ids == want
    finally:
        tinyloop.free_model(m)


def test_non_finite_logits_in_generation_name_step_and_position(tiny_model_path):
    check_non_finite_generation(tiny_model_path, "numpy")


# --- non-finite weights: writer and loader -------------------------------------------------------
def test_write_tlm_refuses_nan_norm_weight_and_inf_scale(tmp_path):
    cfg = synthetic_config(**TINY)
    for name, part, idx, value in (("blk.1.ffn_norm", None, (5,), np.nan),
                                   ("output_norm", None, (0,), -np.inf),
                                   ("blk.0.attn_qkv", "scales", (3, 1), np.inf),
                                   ("token_embd", "zeros", (299, 0), np.nan)):
        w = synthetic_weights(cfg, seed=1)
        if part is None:
            w[name][idx] = value
        else:
            getattr(w[name], part)[idx] = value
        where = name + ("" if part is None else f".{part}")
        with pytest.raises(errors.NonFiniteWeightError,
                           match=rf"{where}\[{', '.join(map(str, idx))}\] is {value}"):
            write_tlm(tmp_path / "x.tlm", cfg, w)
        assert not list(tmp_path.iterdir())              # nothing written, no temp file


@pytest.mark.parametrize("entry, index, raw, shown", [
    ("blk.0.attn_norm", 17, np.float32(np.nan).tobytes(), "blk.0.attn_norm[17] is nan"),
    ("output_norm", 63, np.float32(np.inf).tobytes(), "output_norm[63] is inf"),
    ("blk.2.ffn_down.scales", 5, np.float16(np.inf).tobytes(), "blk.2.ffn_down.scales[1, 1]"),   # 4 groups a row
    ("token_embd.zeros", 0, np.float16(-np.inf).tobytes(), "token_embd.zeros[0, 0] is -inf"),
])
def test_loader_refuses_nan_norm_weights_and_scales(tiny_model_path, tmp_path, entry, index,
                                                    raw, shown):
    bad = tmp_path / "bad.tlm"
    shutil.copy(tiny_model_path, bad)
    with read_tlm(bad) as f:
        e = f.entries[entry]
        off = f.data_start + e.offset + index * len(raw)
    with open(bad, "r+b") as fh:
        fh.seek(off)
        fh.write(raw)
    before = get_pool("host").stats().allocated_bytes
    with pytest.raises(errors.NonFiniteWeightError, match=shown.replace("[", r"\[")) as ei:
        tinyloop.load_model(bad, max_seq_len=32, backend="numpy")
    assert isinstance(ei.value, errors.FormatError) and str(bad) in str(ei.value)
    assert get_pool("host").stats().allocated_bytes == before


@pytest.mark.parametrize("kw, name", [({"max_new_tokens": 10 ** 400}, "max_seq_len"),
                                      ({"temperature": 10 ** 400}, "temperature"),
                                      ({"top_k": float("nan")}, "top_k"),
                                      ({"repetition_penalty": 10 ** 400}, "repetition_penalty"),
                                      ({"repeat_last_n": 10 ** 400}, "repeat_last_n"),
                                      ({"temperature": float("inf")}, "temperature")])
def test_numbers_past_float_range_are_config_errors(tiny_model_path, kw, name):
    """An int too large for a float is refused by name (float() of it raised OverflowError),
    and the message shows at most the value's first 80 characters."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        with pytest.raises(errors.ConfigError, match=name) as e:
            m.generate([5, 6], max_new_tokens=kw.pop("max_new_tokens", 3), **kw)
        assert len(str(e.value)) < 300
    finally:
        tinyloop.free_model(m)


def test_a_temperature_below_sampling_eps_is_greedy_and_a_huge_top_k_keeps_all(
        tiny_model_path):
    """temperature 1e-308 divided the logits past float range (inf - inf: NaN weights, and
    junk tokens); below SAMPLING_EPS it is greedy. top_k past the vocabulary (even past
    int64) keeps every token, as top_k = 0 does, with the same seeded draws."""
    from tinyloop.generate import SAMPLING_EPS
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        greedy = m.generate([5, 6, 7], max_new_tokens=8).token_ids
        for t in (5e-324, 1e-308, SAMPLING_EPS / 2):
            assert m.generate([5, 6, 7], max_new_tokens=8, temperature=t,
                              seed=3).token_ids == greedy
        want = m.generate([5, 6, 7], max_new_tokens=8, temperature=1.0, seed=3).token_ids
        for k in (m.config.vocab_size, 10 ** 400):
            assert m.generate([5, 6, 7], max_new_tokens=8, temperature=1.0, top_k=k,
                              seed=3).token_ids == want
    finally:
        tinyloop.free_model(m)


def test_a_text_past_the_character_limit_is_refused_before_encoding(tiny_model_path,
                                                                    monkeypatch):
    """Over MAX_CHARS_PER_POSITION characters a position of max_seq_len, a text prompt is
    refused unencoded whatever it holds (bytes no token holds would otherwise pass the
    min_tokens bound and encode for seconds); at the limit it is encoded as usual."""
    from tinyloop.generate import MAX_CHARS_PER_POSITION
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        encoded = []
        real = type(m.tokenizer).encode
        monkeypatch.setattr(type(m.tokenizer), "encode",
                            lambda self, t, *a, **k: encoded.append(len(t)) or
                            real(self, t, *a, **k))
        limit = 64 * MAX_CHARS_PER_POSITION
        with pytest.raises(errors.ConfigError, match="character limit"):
            m.generate("a" * (limit + 1), max_new_tokens=1)
        assert encoded == []
        with pytest.raises(errors.ConfigError, match="max_seq_len"):
            m.generate("a" * limit, max_new_tokens=1)      # checked, then too many tokens
    finally:
        tinyloop.free_model(m)
