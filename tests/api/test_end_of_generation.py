"""A generation ends at any end-of-generation token of the tokenizer (llama.cpp's rule,
``tokenizer.end_of_generation_ids``), not only at the config's one eos id: the tiny model's
tokenizer with one merged token renamed to an EOG text ends generate, stream and the serving
engine where that token is sampled, and ``ignore_eos`` runs past it."""

from __future__ import annotations

import contextlib
import json

import pytest

import tinyloop
from tinyloop.convert.synthetic import byte_level_tokenizer_json, synthetic_config, \
    synthetic_weights
from tinyloop.format import write_tlm
from tinyloop.serve import Engine
from tinyloop.tokenizer import EOG_TEXTS

from ..conftest import TINY

KW = dict(max_new_tokens=12, temperature=1.0, seed=3)      # greedy repeats one id
PROMPT = [10, 20, 30]


def _write(path, cfg, renamed: dict[int, str]) -> None:
    """The tiny synthetic model (seed 11) with the tokens ``renamed`` (id -> text) turned
    into special added tokens of that text (their merges dropped)."""
    spec = json.loads(byte_level_tokenizer_json(cfg.vocab_size))
    vocab, model = spec["model"]["vocab"], spec["model"]
    for tid, text in renamed.items():
        old = next(k for k, v in vocab.items() if v == tid)
        del vocab[old]
        vocab[text] = tid
        model["merges"] = [m for m in model["merges"]
                           if "".join(m.split(" ") if isinstance(m, str) else m) != old]
        spec["added_tokens"].append({"id": tid, "content": text, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})
    write_tlm(path, cfg, synthetic_weights(cfg, 11), tokenizer_json=json.dumps(spec),
              chat_template="")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the plain model's seeded run, the index of its first new merged token, that id)."""
    # a vocabulary of mostly merged tokens, so the run samples some
    cfg = synthetic_config(**{**TINY, "vocab_size": 4096}, bos_token_id=256, eos_token_id=257)
    path = tmp_path_factory.mktemp("eog") / "plain.tlm"
    _write(path, cfg, {})
    m = tinyloop.load_model(str(path), max_seq_len=64, backend="numpy")
    try:
        full = m.generate(PROMPT, **KW)
    finally:
        tinyloop.free_model(m)
    assert full.finish_reason == "length" and 257 not in full.token_ids
    first = next(i for i in range(1, 12) if full.token_ids[i] >= 258
                 and full.token_ids[i] not in full.token_ids[:i])
    return cfg, tmp_path_factory.mktemp("eog"), full, first, full.token_ids[first]


@contextlib.contextmanager
def _loaded(tmp, name: str, cfg, renamed: dict[int, str]):
    """The tiny model with ``renamed`` tokens (``_write``) as ``tmp / name``, loaded on the
    NumPy backend, freed after."""
    _write(tmp / name, cfg, renamed)
    m = tinyloop.load_model(str(tmp / name), max_seq_len=64, backend="numpy")
    try:
        yield m
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("text", ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|fim_pad|>"])
def test_generate_and_stream_end_at_an_eog_token_that_is_not_the_eos(runs, text):
    cfg, tmp, full, first, tid = runs
    name = f"eog{EOG_TEXTS.index(text) if text in EOG_TEXTS else 'fim'}.tlm"
    with _loaded(tmp, name, cfg, {tid: text}) as m:
        assert m.config.eos_token_id == 257 and m.tokenizer.eog_ids == {257, tid}
        assert m.is_end_of_generation(tid) and m.is_end_of_generation(257)
        assert not m.is_end_of_generation(full.token_ids[0])
        cut = m.generate(PROMPT, **KW)
        assert (cut.token_ids, cut.finish_reason) == (full.token_ids[:first], "eos")
        assert text not in cut.text
        assert m.pool.by_tag()["kv_cache"] == 0          # the request's pages went with it
        st = m.stream(PROMPT, **KW)
        assert [p.token_id for p in st] == cut.token_ids and st.finish_reason == "eos"
        past = m.generate(PROMPT, ignore_eos=True, **KW)
        assert (past.token_ids, past.finish_reason) == (full.token_ids, "length")


def test_a_decoy_text_ends_nothing(runs):
    cfg, tmp, full, first, tid = runs
    with _loaded(tmp, "decoy.tlm", cfg, {tid: "<|end_of_turn|>"}) as m:
        assert m.tokenizer.eog_ids == {257}
        assert m.generate(PROMPT, **KW).token_ids == full.token_ids


def test_the_engine_ends_a_request_at_an_eog_token(runs):
    """Two requests in one batch: one ends at the EOG token, one with ignore_eos runs on."""
    cfg, tmp, full, first, tid = runs
    with _loaded(tmp, "engine.tlm", cfg, {tid: "<|endoftext|>"}) as m:
        with Engine(m, max_batch=4) as eng:
            a = eng.submit(PROMPT, ignore_eos=True, **KW)
            b = eng.submit(PROMPT, **KW)
            ra, rb = a.result(timeout=60), b.result(timeout=60)
        assert (ra.token_ids, ra.finish_reason) == (full.token_ids, "length")
        assert (rb.token_ids, rb.finish_reason) == (full.token_ids[:first], "eos")
        assert m.pool.by_tag()["kv_cache"] == 0          # both requests' pages are freed
