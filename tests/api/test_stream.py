"""stream and generate: one generation loop, so the same ids, text and finish reason; the same
argument checks at the call; errors that name where they struck and carry what was generated;
and nothing a live stream holds outlives free_model."""

from __future__ import annotations

import gc

import pytest

import tinyloop
from tinyloop import errors
from tinyloop.memory import get_pool


def _allocated():
    return get_pool("host").stats().allocated_bytes


# --- free_model with open streams ----------------------------------------------------------------
def test_free_model_releases_what_suspended_streams_hold(tiny_model_path):
    """Streams suspended at a yield (plain, sharing a PrefixCache's pages, on a PrefixPool),
    one in a reference cycle nobody collects, and one never started: free_model returns
    allocated to its value before the load at once, and each stream's next step raises
    ModelFreedError."""
    before = _allocated()
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy")
    system = [5, 6, 7, 8] * 10                       # 40 tokens: one full page and a part
    pc = m.prefill(system, depth=2)
    pool = tinyloop.PrefixPool(m)
    m.generate(system + [1], max_new_tokens=2, depth=2, prefix_pool=pool)
    streams = [m.stream([1, 2, 3], max_new_tokens=60),
               m.stream(system + [9, 10], max_new_tokens=50, prefix=pc),
               m.stream(system + [11], max_new_tokens=50, depth=2, prefix_pool=pool)]
    for s in streams:
        next(s)
    cycle = [m.stream([4, 4, 4], max_new_tokens=60)]
    next(cycle[0])
    cycle.append(cycle)                              # only a collection would close it
    del cycle
    unstarted = m.stream([3, 2, 1], max_new_tokens=10)
    gc.disable()
    try:
        assert _allocated() > before + tinyloop.vram_usage_bytes(m) + pc.nbytes
        tinyloop.free_model(m)
        assert _allocated() == before
    finally:
        gc.enable()
    for s in streams + [unstarted]:
        with pytest.raises(errors.ModelFreedError):
            next(s)
    assert pc.released
    gc.collect()
    assert _allocated() == before


# --- the same ids, text and finish reason --------------------------------------------------------
def _reference(tok, script, stops, max_new_tokens, eos):
    """generate's (ids, text, finish reason) by their definition, token by token with
    whole-prefix decodes: stop at EOS (not included), at max_new_tokens, or at the first token
    after which the text holds a stop string (included), the text cut before the earliest
    stop string it holds."""
    new = []
    for i in script:
        if i == eos:
            return new, tok.decode(new), "eos"
        new.append(i)
        text = tok.decode(new)
        found = [text.find(s) for s in stops if s in text]
        if found:
            return new, text[:min(found)], "stop"
        if len(new) == max_new_tokens:
            return new, text, "length"
    raise AssertionError("the script ran out")


def _both(m, script, **kw):
    """(stream pieces, the stream's result, generate's result) with ``script`` as the
    sampled ids (tests.api.test_api.ScriptedOps)."""
    from .test_api import ScriptedOps
    real = m._ops
    try:
        m._ops = ScriptedOps(real, script)
        s = m.stream([1, 2], **kw)
        pieces = list(s)
        m._ops = ScriptedOps(real, script)
        res = m.generate([1, 2], **kw)
    finally:
        m._ops = real
    return pieces, s.result, res


def _check_agree(m, script, stops, max_new_tokens):
    tok, eos = m.tokenizer, m.config.eos_token_id
    pieces, sres, res = _both(m, script, max_new_tokens=max_new_tokens, stop=stops)
    want_ids, want_text, want_reason = _reference(tok, script, stops, max_new_tokens, eos)
    assert (res.token_ids, res.text, res.finish_reason) == (want_ids, want_text, want_reason)
    assert [p.token_id for p in pieces] == res.token_ids
    assert "".join(p.text for p in pieces) == res.text
    assert sres.finish_reason == res.finish_reason
    assert (sres.token_ids, sres.text) == (res.token_ids, res.text)
    assert all(p.finish_reason is None for p in pieces[:-1])
    if pieces and pieces[-1].finish_reason is not None:
        assert pieces[-1].finish_reason == res.finish_reason
    if res.finish_reason in ("stop", "length"):      # known as the last token is yielded
        assert pieces[-1].finish_reason == res.finish_reason
    return pieces, res


@pytest.mark.parametrize("text, stop", [("Hello! world", "! w"),        # ASCII
                                        ("caf\u00e9 ok", "\u00e9 o"),     # 2-byte character
                                        ("tick \U0001F600!", "\U0001F600")])   # 4-byte one
def test_stream_yields_the_token_that_completed_a_stop_string(tiny_model_path, text, stop):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    try:
        ids = m.tokenizer.encode(text, parse_special=False)
        pieces, res = _check_agree(m, ids + [ord("z")] * 4, [stop], len(ids) + 4)
        assert res.finish_reason == "stop"
        assert m.tokenizer.decode(res.token_ids).endswith(stop)      # the completing token
        assert not m.tokenizer.decode(res.token_ids[:-1]).endswith(stop)
        assert pieces[-1].token_id == res.token_ids[-1] and pieces[-1].text == ""
    finally:
        tinyloop.free_model(m)


def test_stream_and_generate_agree_on_any_script(tiny_model_path):
    """Property: random texts (ASCII, 2-, 3- and 4-byte characters), random stop strings,
    max_new_tokens and EOS placement give the same ids, text and finish reason through stream
    and generate, equal to the definition."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    alphabet = "ab! \n\u00e9\u20ac\U0001F600"
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy")
    tok, eos = m.tokenizer, m.config.eos_token_id

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(text=st.text(alphabet, min_size=1, max_size=16),
           stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
           eos_at=st.one_of(st.none(), st.integers(0, 40)),
           extra=st.integers(-3, 3))
    def check(text, stops, eos_at, extra):
        ids = tok.encode(text, parse_special=False)
        script = ids + [ord("b")] * 8
        if eos_at is not None:
            script.insert(min(eos_at, len(script)), eos)
        _check_agree(m, script, stops, max(1, len(ids) + extra))

    try:
        check()
    finally:
        tinyloop.free_model(m)


def test_stream_result_and_finish_reason_at_eos_and_zero_tokens(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    try:
        eos = m.config.eos_token_id
        pieces, sres, res = _both(m, [65, 66, eos], max_new_tokens=10)
        assert [p.token_id for p in pieces] == [65, 66] == res.token_ids
        assert sres.finish_reason == res.finish_reason == "eos"
        s = m.stream([1, 2], max_new_tokens=0)
        assert list(s) == [] and s.finish_reason == "length" and s.result.token_ids == []
        s = m.stream([1, 2], max_new_tokens=3)
        assert s.result is None and s.finish_reason is None        # not ended yet
        with pytest.raises(StopIteration) as ei:
            while True:
                next(s)
        assert ei.value.value == s.result and len(s.result.token_ids) == 3
    finally:
        tinyloop.free_model(m)


# --- arguments are checked at the call -----------------------------------------------------------
def _released_prefix(m):
    pc = m.prefill([1, 2])
    pc.release()
    return pc


def _released_pool(m):
    pool = tinyloop.PrefixPool(m)
    pool.release()
    return pool


BAD = {   # name: (error type, kwargs of the call, given the model)
    "depth 0": (errors.ConfigError, lambda m: dict(depth=0)),
    "depth above max_depth": (errors.ConfigError, lambda m: dict(depth=5)),
    "depth not an int": (errors.ConfigError, lambda m: dict(depth=1.5)),
    "max_new_tokens < 0": (errors.ConfigError, lambda m: dict(max_new_tokens=-1)),
    "max_new_tokens not an int": (errors.ConfigError, lambda m: dict(max_new_tokens="3")),
    "prompt + max_new_tokens > max_seq_len": (errors.ConfigError,
                                              lambda m: dict(max_new_tokens=62)),
    "temperature < 0": (errors.ConfigError, lambda m: dict(temperature=-0.5)),
    "temperature nan": (errors.ConfigError, lambda m: dict(temperature=float("nan"))),
    "top_k < 0": (errors.ConfigError, lambda m: dict(top_k=-1)),
    "top_k fractional": (errors.ConfigError, lambda m: dict(top_k=2.5)),
    "top_p > 1": (errors.ConfigError, lambda m: dict(top_p=1.5)),
    "top_p nan": (errors.ConfigError, lambda m: dict(top_p=float("nan"))),
    "seed < 0": (errors.ConfigError, lambda m: dict(seed=-1)),
    "seed not an int": (errors.ConfigError, lambda m: dict(seed="x")),
    "stop empty string": (errors.ConfigError, lambda m: dict(stop=[""])),
    "stop not a string": (errors.ConfigError, lambda m: dict(stop=3)),
    "kv_mode unknown": (errors.ConfigError, lambda m: dict(kv_mode="fp8")),
    "prompt id out of range": (errors.TokenizerError, lambda m: dict(prompt=[1, 300])),
    "prompt empty": (errors.ConfigError, lambda m: dict(prompt=[])),
    "prompt 2-D": (errors.ConfigError, lambda m: dict(prompt=[[1, 2]])),
    "prompt not valid Unicode": (errors.TokenizerError, lambda m: dict(prompt="a\ud800")),
    "prefix not a PrefixCache": (errors.ConfigError, lambda m: dict(prefix="abc")),
    "prefix released": (errors.HandleError, lambda m: dict(prefix=_released_prefix(m))),
    "prefix not the prompt's start": (errors.ConfigError,
                                      lambda m: dict(prefix=m.prefill([9, 9]))),
    "prefix at another depth": (errors.ConfigError,
                                lambda m: dict(prefix=m.prefill([1, 2], depth=2), depth=3)),
    "prefix_pool not a PrefixPool": (errors.ConfigError, lambda m: dict(prefix_pool=[])),
    "prefix_pool released": (errors.HandleError,
                             lambda m: dict(prefix_pool=_released_pool(m))),
    "prefix and prefix_pool": (errors.ConfigError,
                               lambda m: dict(prefix=m.prefill([1, 2]),
                                              prefix_pool=tinyloop.PrefixPool(m))),
}


@pytest.mark.parametrize("case", list(BAD))
def test_stream_checks_every_argument_at_the_call_as_generate_does(tiny_model_path, case):
    kind, make = BAD[case]
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        kw = {"prompt": [1, 2, 3], **make(m)}
        before = _allocated()
        with pytest.raises(kind) as by_generate:
            m.generate(**kw)
        with pytest.raises(kind) as by_stream:
            m.stream(**kw)                           # no next(): it raises at the call
        assert type(by_stream.value) is type(by_generate.value)
        assert str(by_stream.value) == str(by_generate.value)
        assert _allocated() == before
    finally:
        tinyloop.free_model(m)


def test_stream_on_a_freed_model_raises_at_the_call(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    tinyloop.free_model(m)
    with pytest.raises(errors.ModelFreedError):
        m.stream([1, 2, 3])


# --- an error part-way: where, and what was generated --------------------------------------------
@pytest.mark.parametrize("via", ["generate", "stream"])
@pytest.mark.parametrize("batch", [1, 2])
def test_out_of_memory_part_way_names_step_and_position_and_keeps_the_tokens(
        tiny_model_path, monkeypatch, via, batch):
    from tinyloop.kv import DEFAULT_PAGE_SIZE
    from ..conftest import fail_nth_allocation
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    try:
        prompt, depth = [7, 8, 9], 2
        full = m.generate(prompt, max_new_tokens=50, depth=depth)
        assert len(full.token_ids) == 50
        # the failing allocation: the pages of the first position of page ``batch``; step k
        # samples from position len(prompt) - 1 + k
        position = max(len(prompt) - 1, (batch - 1) * DEFAULT_PAGE_SIZE)
        step = position - (len(prompt) - 1)
        own = _allocated() - tinyloop.vram_usage_bytes(m)
        n_slots = m.config.n_slots(depth)
        fail_nth_allocation(monkeypatch, m.pool, "kv_cache", 1 + (batch - 1) * n_slots + 1)
        got = []
        with pytest.raises(errors.OutOfMemoryError) as ei:
            if via == "generate":
                m.generate(prompt, max_new_tokens=50, depth=depth)
            else:
                for piece in m.stream(prompt, max_new_tokens=50, depth=depth):
                    got.append(piece.token_id)
        monkeypatch.undo()
        e = ei.value
        assert (e.step, e.position, e.tag) == (step, position, "kv_cache")
        assert f"step {step} " in str(e) and f"position {position}" in str(e)
        assert "injected" in str(e)                              # the pool's own message
        p = e.partial
        assert p.token_ids == full.token_ids[:step]
        assert p.text == m.tokenizer.decode(p.token_ids)
        assert p.finish_reason == "error" and p.prompt_token_ids == prompt
        assert got == p.token_ids[:len(got)]                     # what the stream yielded
        assert _allocated() - tinyloop.vram_usage_bytes(m) == own      # nothing left
        assert m.generate(prompt, max_new_tokens=50, depth=depth).token_ids == full.token_ids
    finally:
        tinyloop.free_model(m)


def test_model_freed_part_way_carries_the_tokens_so_far(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    want = m.generate([1, 2, 3], max_new_tokens=10).token_ids
    s = m.stream([1, 2, 3], max_new_tokens=10)
    got = [next(s).token_id for _ in range(4)]
    tinyloop.free_model(m)
    with pytest.raises(errors.ModelFreedError) as ei:
        next(s)
    p = ei.value.partial.token_ids                   # a held-back token may follow
    assert got == want[:4] == p[:4] and p == want[:len(p)]


def _stop_prefix_len_reference(text, stops):
    """The rule by definition: the longest k < len(s), k <= len(text), with text ending in
    s[:k], over the stop strings."""
    return max([k for s in stops for k in range(min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:k])], default=0)


def test_the_stop_prefix_search_agrees_with_its_definition():
    from hypothesis import given, settings, strategies as st

    from tinyloop.generate import _stop_prefix_len

    @settings(max_examples=400, deadline=None)
    @given(text=st.text("ab\u00e9", max_size=24),
           stops=st.lists(st.text("ab\u00e9", min_size=1, max_size=12), min_size=1,
                          max_size=4))
    def check(text, stops):
        assert _stop_prefix_len(text, stops) == _stop_prefix_len_reference(text, stops)
    check()
    # a long stop string costs one pass per candidate start, not one slice per length
    long_stop, text = "x" * 100_000 + "!", "y" * 30_000 + "x" * 5
    assert _stop_prefix_len(text, [long_stop]) == 5
