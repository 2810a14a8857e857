"""The public lifecycle and request API on the NumPy backend (the lifecycle and memory
contract)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.backends.base import Ops
from tinyloop.memory import get_pool
from tinyloop.plan import plan_bytes_by_phase

from ..conftest import TINY, fail_nth_allocation, slow_kv_release


def _allocated():
    return get_pool("host").stats().allocated_bytes


def _live_by_tag(tag):
    return get_pool("host").stats().by_tag.get(tag, 0)


def test_load_free_returns_allocated_to_start(tiny_adapter_path):
    before = _allocated()
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=128, prefill_chunk=16,
                            backend="numpy")
    assert m.backend == "numpy"
    assert tinyloop.vram_usage_bytes(m) > 0
    assert _allocated() - before == tinyloop.vram_usage_bytes(m)
    m.generate([1, 2, 3], max_new_tokens=3)          # allocates the lazy logit_row too
    assert _allocated() - before == tinyloop.vram_usage_bytes(m)
    tinyloop.free_model(m)
    assert _allocated() == before
    assert tinyloop.vram_usage_bytes(m) == 0
    tinyloop.free_model(m)                           # idempotent
    with pytest.raises(errors.ModelFreedError):
        m.logits([1, 2])


def test_plan_predicts_what_the_load_allocates(tiny_adapter_path):
    """The plan (the numbers `tinyloop inspect` prints) equals the requested bytes per tag."""
    pool = get_pool("host")
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=100, prefill_chunk=10,
                            backend="numpy")
    try:
        blocks = list(m._blocks)
        requested = {}
        for b in blocks:
            requested[b.tag] = requested.get(b.tag, 0) + b.requested_bytes
        by_phase = plan_bytes_by_phase([e for e in m.plan if not e.lazy])
        assert requested["weights"] == by_phase[2]
        assert requested["buffers"] == by_phase[4]
        main = next(e for e in m.plan if e.name == "main")
        norm = next(e for e in m.plan if e.name == "norm")
        assert main.shape == (100, TINY["d_model"]) and main.dtype == "float32"
        assert norm.shape == (10, TINY["d_model"])          # chunk-wide scratch
        assert sum(b.nbytes for b in blocks) == m.vram_usage_bytes()
        assert all(b.nbytes % 512 == 0 and b.nbytes >= b.requested_bytes for b in blocks)
    finally:
        tinyloop.free_model(m)
    del pool


@pytest.mark.parametrize("failing_tag", ["weights", "buffers"])
def test_failed_load_in_each_phase_leaves_nothing(tiny_adapter_path, monkeypatch, failing_tag):
    before = _allocated()
    seen = fail_nth_allocation(monkeypatch, get_pool("host"), failing_tag, 3)
    with pytest.raises(errors.OutOfMemoryError, match="injected"):
        tinyloop.load_model(tiny_adapter_path, max_seq_len=64, backend="numpy")
    monkeypatch.undo()
    assert seen["n"] == 3
    assert _allocated() == before


def test_kv_cache_is_per_request_and_released(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        kv0 = _live_by_tag("kv_cache")
        peak_seen = []
        for piece in m.stream([1, 2, 3, 4], max_new_tokens=5, depth=3):
            peak_seen.append(_live_by_tag("kv_cache"))
        cfg = m.config
        want = cfg.n_slots(3) * 2 * (4 + 5) * cfg.n_kv_heads * cfg.head_dim * 4
        assert max(peak_seen) - kv0 >= want
        assert _live_by_tag("kv_cache") == kv0
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("max_seq_len,chunk,n,rows", [(64, 0, 40, 40), (64, 16, 40, 16),
                                                      (300, 0, 200, 128), (300, 0, 5, 5)])
def test_logits_block_is_what_the_request_plan_says(tiny_model_path, max_seq_len, chunk, n,
                                                    rows):
    """logits() takes one float32 [rows, vocab] block, rows = min(128, scratch rows, T), and
    Model.request_plan names exactly that block (so inspect-style predictions cannot drift)."""
    from tinyloop.memory import round_size
    m = tinyloop.load_model(tiny_model_path, max_seq_len=max_seq_len, prefill_chunk=chunk,
                            backend="numpy")
    try:
        pool = get_pool("host")
        vocab = m.config.vocab_size
        plan = {e.name: e for e in m.request_plan(n, 1, logits=True)}
        assert plan["logits"].shape == (rows, vocab) and plan["logits"].dtype == "float32"
        assert "logits" not in {e.name for e in m.request_plan(n, 1)}
        live = _live_by_tag("logits")
        pool.reset_peak_stats()
        m.logits(np.arange(n) % vocab, depth=1)
        assert pool.stats().peak_by_tag["logits"] - live == round_size(rows * vocab * 4)
        assert _live_by_tag("logits") == live
    finally:
        tinyloop.free_model(m)


def test_stream_equals_generate_and_sampling_is_seeded(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        a = m.generate("hello", max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.9,
                       seed=123, depth=2)
        b = [t.token_id for t in m.stream("hello", max_new_tokens=10, temperature=0.9,
                                          top_k=40, top_p=0.9, seed=123, depth=2)]
        c = m.generate("hello", max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.9,
                       seed=124, depth=2)
        assert a.token_ids == b
        assert a.token_ids != c.token_ids
        assert a.text == m.tokenizer.decode(a.token_ids)
        assert a.finish_reason == "length" and len(a.token_ids) == 10
        assert a.prompt_token_ids == m.tokenizer.encode("hello")
    finally:
        tinyloop.free_model(m)


def test_stop_string_cuts_text(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        full = m.generate([10, 20, 30], max_new_tokens=12)
        stop = full.text[3:5]
        assert stop
        cut = m.generate([10, 20, 30], max_new_tokens=12, stop=[stop])
        assert cut.finish_reason == "stop"
        assert cut.text == full.text[:full.text.index(stop)]
        assert stop not in cut.text
    finally:
        tinyloop.free_model(m)


def test_eos_stops_generation(tiny_model_path, monkeypatch):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        full = m.generate([10, 20, 30], max_new_tokens=8)
        object.__setattr__(m.config, "eos_token_id", full.token_ids[2])
        res = m.generate([10, 20, 30], max_new_tokens=8)
        assert res.finish_reason == "eos"
        assert res.token_ids == full.token_ids[:full.token_ids.index(full.token_ids[2])]
    finally:
        tinyloop.free_model(m)


def test_ignore_eos_decodes_past_the_eos_token(tiny_model_path):
    """With ignore_eos a seeded run is the one whose EOS id the model never picks: the same
    ids (the EOS token among them), max_new_tokens of them, finish "length"; stream yields
    the same tokens; without it the run ends before its first EOS."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    kw = dict(max_new_tokens=12, temperature=1.0, seed=3)     # greedy repeats one id
    try:
        full = m.generate([10, 20, 30], **kw)
        assert full.finish_reason == "length" and len(full.token_ids) == 12
        first = next(i for i in range(1, 12) if full.token_ids[i] not in full.token_ids[:i])
        eos = full.token_ids[first]
        object.__setattr__(m.config, "eos_token_id", eos)
        cut = m.generate([10, 20, 30], **kw)
        assert cut.finish_reason == "eos" and cut.token_ids == full.token_ids[:first]
        res = m.generate([10, 20, 30], ignore_eos=True, **kw)
        assert res.finish_reason == "length"
        assert res.token_ids == full.token_ids and eos in res.token_ids
        assert res.text == full.text
        st = m.stream([10, 20, 30], ignore_eos=True, **kw)
        assert [t.token_id for t in st] == full.token_ids
        assert st.finish_reason == "length"
        with pytest.raises(errors.ConfigError, match="ignore_eos"):
            m.generate([10, 20, 30], max_new_tokens=4, ignore_eos="yes")
        with pytest.raises(errors.ConfigError, match="ignore_eos"):
            m.stream([10, 20, 30], max_new_tokens=4, ignore_eos=1)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("kwargs, match", [
    (dict(depth=0), "depth=0"),
    (dict(depth=5), "max_depth=4"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(stop=[""]), "stop"),
    (dict(max_new_tokens=100), "max_seq_len"),
])
def test_bad_generate_arguments(tiny_model_path, kwargs, match):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    before = _allocated()
    try:
        with pytest.raises(errors.ConfigError, match=match):
            m.generate([1, 2, 3], **kwargs)
        assert _allocated() == before
    finally:
        tinyloop.free_model(m)


def test_bad_token_ids(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        with pytest.raises(errors.TokenizerError, match=r"\[1\]=300"):
            m.logits([1, 300])
        with pytest.raises(errors.TokenizerError, match="-1"):
            m.generate([-1])
        assert m.logits([]).shape == (1, m.config.vocab_size)      # empty: [BOS]
        with pytest.raises(errors.ConfigError, match="1-D"):
            m.logits([[1, 2]])
        with pytest.raises(errors.ConfigError, match="max_seq_len"):
            m.logits(list(range(65)))
    finally:
        tinyloop.free_model(m)


def test_bad_load_arguments(tiny_model_path, tmp_path):
    with pytest.raises(errors.ConfigError, match="max_seq_len"):
        tinyloop.load_model(tiny_model_path, max_seq_len=0, backend="numpy")
    with pytest.raises(errors.ConfigError, match="prefill_chunk"):
        tinyloop.load_model(tiny_model_path, prefill_chunk=-1, backend="numpy")
    with pytest.raises(errors.ConfigError, match="backend"):
        tinyloop.load_model(tiny_model_path, backend="tpu")
    with pytest.raises(errors.TinyLoopError, match="not found"):
        tinyloop.load_model(tmp_path / "nope.tlm", backend="numpy")


def test_concurrent_calls_are_serialized(tiny_model_path):
    """Four threads on one Model get exactly the results of sequential calls; each call's
    forward passes form one uninterrupted run (generate holds the per-model lock)."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        prompts = [[1, 2, 3], [200, 100, 50, 25], [7] * 9, [42, 43]]
        want = [m.generate(p, max_new_tokens=20, depth=2).token_ids for p in prompts]
        got = [None] * 4
        active, peak, order = [0], [0], []
        orig = m._forward_chunk

        def spy(*a, **k):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            order.append(threading.get_ident())
            try:
                return orig(*a, **k)
            finally:
                active[0] -= 1

        m._forward_chunk = spy
        barrier = threading.Barrier(4)

        def work(i):
            barrier.wait()
            got[i] = m.generate(prompts[i], max_new_tokens=20, depth=2).token_ids

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert got == want
        assert peak[0] == 1
        assert sum(1 for a, b in zip(order, order[1:]) if a != b) == 3   # 4 contiguous runs
    finally:
        tinyloop.free_model(m)


def test_open_stream_does_not_hold_the_model(tiny_model_path):
    """A stream suspended between tokens lets other calls run, and is not disturbed by them;
    a fully consumed stream has already released its KV cache."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        kv0 = _live_by_tag("kv_cache")
        want = [t.token_id for t in m.stream([9, 8, 7], max_new_tokens=10, depth=2)]
        g = m.stream([9, 8, 7], max_new_tokens=10, depth=2)
        got = [next(g).token_id for _ in range(4)]
        other = []
        th = threading.Thread(target=lambda: other.append(
            m.generate([1, 2, 3, 4, 5], max_new_tokens=6, depth=3).token_ids))
        th.start()
        th.join(timeout=30)
        assert other and len(other[0]) == 6              # not blocked by the open stream
        got += [t.token_id for t in g]
        assert got == want                               # and the stream was not disturbed
        g2 = m.stream([9, 8, 7], max_new_tokens=3)
        assert len([next(g2) for _ in range(3)]) == 3
        assert _live_by_tag("kv_cache") == kv0           # released before the last yield
    finally:
        tinyloop.free_model(m)


def test_stream_after_free_raises_model_freed(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    kv0 = _live_by_tag("kv_cache")
    g = m.stream([1, 2, 3], max_new_tokens=5)
    next(g)
    tinyloop.free_model(m)
    with pytest.raises(errors.ModelFreedError):
        next(g)
    assert _live_by_tag("kv_cache") == kv0


def test_model_dropped_without_free_is_freed_with_a_warning(tiny_model_path):
    import gc
    before = _allocated()
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    assert _allocated() > before
    with pytest.warns(ResourceWarning, match="without free_model"):
        del m
        gc.collect()
    assert _allocated() == before


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_seq_len=2 ** 62), "max_seq_len"),
    (dict(max_seq_len=True), "max_seq_len"),
    (dict(prefill_chunk=2 ** 40), "prefill_chunk"),
])
def test_absurd_sizes_are_refused_before_allocating(tiny_model_path, kwargs, match):
    before = _allocated()
    with pytest.raises(errors.ConfigError, match=match):
        tinyloop.load_model(tiny_model_path, backend="numpy", **kwargs)
    assert _allocated() == before


def test_bad_objects_get_clear_errors(tiny_model_path, tmp_path):
    with pytest.raises(errors.ConfigError, match="path"):
        tinyloop.load_model(None, backend="numpy")
    with pytest.raises(errors.TinyLoopError, match="not a file"):
        tinyloop.load_model(tmp_path, backend="numpy")
    with pytest.raises(errors.ConfigError, match="Model"):
        tinyloop.free_model(None)
    with pytest.raises(errors.ConfigError, match="Model"):
        tinyloop.vram_usage_bytes("x")
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        with pytest.raises(errors.TokenizerError, match="Unicode"):
            m.generate("a\ud800b")
        for bad in (dict(seed=-1), dict(seed="abc"), dict(seed=1.5), dict(stop=123),
                    dict(temperature=True), dict(top_p=True)):
            with pytest.raises(errors.ConfigError):
                m.generate([1, 2], max_new_tokens=2, **bad)
        r = m.generate([1, 2], max_new_tokens=np.int64(2), depth=np.int64(2),
                       temperature=np.float32(0.5), seed=np.int64(3))
        assert len(r.token_ids) == 2
    finally:
        tinyloop.free_model(m)


def test_untokenized_model_needs_ids(tmp_path):
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    p = tmp_path / "small.tlm"
    write_synthetic(p, synthetic_config(**{**TINY, "vocab_size": 100}), seed=1)
    m = tinyloop.load_model(p, max_seq_len=16, backend="numpy")
    try:
        assert m.tokenizer is None
        with pytest.raises(errors.TokenizerError, match="token ids"):
            m.generate("text")
        assert len(m.generate([1, 2], max_new_tokens=3).token_ids) == 3
    finally:
        tinyloop.free_model(m)


def test_cli_inspect_and_synthetic(tmp_path, capsys):
    from tinyloop.cli import main
    p = tmp_path / "c.tlm"
    assert main(["convert", "--synthetic", str(p), "--dims",
                 "vocab_size=300,d_model=64,n_heads=4,n_kv_heads=2,head_dim=16,ffn_dim=128,"
                 "n_prelude=1,n_recurrent=2,n_coda=1,max_depth=3"]) == 0
    assert main(["inspect", str(p), "--max-seq-len", "100", "--prefill-chunk", "10",
                 "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    assert "phase 2 weights" in out and "main" in out
    m = tinyloop.load_model(p, max_seq_len=100, prefill_chunk=10, backend="numpy")
    try:
        w = sum(b.requested_bytes for b in m._blocks if b.tag == "weights")
        assert f"{w:,d}" in out                        # the printed prediction is the truth
    finally:
        tinyloop.free_model(m)
    assert main(["generate", str(p), "hi", "--max-new-tokens", "3", "--backend",
                 "numpy"]) == 0
    assert main(["inspect", str(tmp_path / "missing.tlm")]) == 1
    assert "missing.tlm" in capsys.readouterr().err
    for argv, needle in ((["inspect", str(p), "--depth", "99"], "max_depth=3"),
                         (["inspect", str(p), "--max-seq-len", "-5"], "max_seq_len=-5"),
                         (["generate", str(p), "hi", "--seed", "-1"], "--seed"),
                         (["generate", str(p), "hi", "--top-p", "-0.1"], "top_p"),
                         (["convert", "--synthetic", str(tmp_path / "x.tlm"), "--dims", "foo=1"],
                          "foo"),
                         (["convert", "--synthetic", str(p), str(p)], "one path")):
        assert main(argv) == 1, argv
        assert needle in capsys.readouterr().err, argv


# --- exit with a live model -----------------------------------------------------------
EXIT_SCRIPT = r"""
import atexit, gc, sys, warnings
warnings.simplefilter("always")                  # every ResourceWarning is printed
path, backend = sys.argv[1], sys.argv[2]

def after_tinyloop_hook():                       # registered first, so it runs last
    from tinyloop.memory import get_pool
    from tinyloop.memory.cupy_hook import cupy_allocator_installed
    device = "cuda" if backend == "cuda" else "host"
    print("allocated at exit", get_pool(device).stats().allocated_bytes,
          "routing", cupy_allocator_installed(), flush=True)

atexit.register(after_tinyloop_hook)
import tinyloop
from tinyloop.memory import get_pool
device = "cuda" if backend == "cuda" else "host"
base = get_pool(device).stats().allocated_bytes
print("base", base, flush=True)

dropped = tinyloop.load_model(path, max_seq_len=32, backend=backend)
dropped.generate([1, 2, 3], max_new_tokens=2)
del dropped                                      # dropped while the program runs: warns
gc.collect()
print("after drop", get_pool(device).stats().allocated_bytes - base, flush=True)

freed = tinyloop.load_model(path, max_seq_len=32, backend=backend)
tinyloop.free_model(freed)                       # freed: no warning, ever

class Holder:                                    # a model kept in a reference cycle
    def __init__(self):
        self.me = self
        self.model = tinyloop.load_model(path, max_seq_len=32, backend=backend)

cycle = Holder()
live = tinyloop.load_model(path, max_seq_len=32, backend=backend)   # alive at exit
live.generate([1, 2, 3], max_new_tokens=2)
print("live at end", tinyloop.vram_usage_bytes(live) > 0, flush=True)
"""


def run_exit_script(path: str, backend: str):
    """Run EXIT_SCRIPT in a fresh interpreter; return (returncode, stdout, stderr)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TINYLOOP_MEMORY_LIMIT", None)
    p = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, path, backend], env=env,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def check_exit_output(rc: int, out: str, err: str) -> None:
    assert rc == 0, err
    lines = out.splitlines()
    base = int(lines[0].split()[1])
    assert base == 0
    assert "after drop 0" in lines and "live at end True" in lines
    assert lines[-1] == "allocated at exit 0 routing False"
    # exactly one ResourceWarning about a Model, for the one dropped while the program ran;
    # nothing at exit (other libraries' warnings, e.g. CuPy's, are not this test's business)
    assert err.count("garbage-collected without free_model()") == 1, err
    assert "Exception ignored" not in err and "Traceback" not in err, err


def test_exit_with_live_numpy_model_frees_it_cleanly(tiny_model_path):
    check_exit_output(*run_exit_script(tiny_model_path, "numpy"))


# --- stop strings while streaming -----------------------------------------------------
class ScriptedOps:
    """The model's ops with ``sample`` replaced by a fixed script of token ids."""

    def __init__(self, ops, script):
        self._ops, self._script = ops, list(script)

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def sample(self, logits, temperature, top_k, top_p, u):
        return self._script.pop(0)

    def rmsnorm_lm_head_sample(self, x, weight, eps, w, out, norm, temperature, top_k, top_p,
                               u):
        # the composition (head, then this object's scripted sample), not a fused backend's
        return Ops.rmsnorm_lm_head_sample(self, x, weight, eps, w, out, norm, temperature,
                                          top_k, top_p, u)


def _reference_text(tok, ids, stops, max_new_tokens, eos):
    """generate's text by its definition, token by token with whole-prefix decodes: stop at
    EOS, at max_new_tokens, or at the first token after which the text holds a stop string,
    cut before the earliest one held."""
    new = []
    for i in ids:
        if i == eos:
            break
        new.append(i)
        text = tok.decode(new)
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], "stop"
        if len(new) == max_new_tokens:
            break
    return tok.decode(new), "eos" if len(new) < max_new_tokens else "length"


def _run_script(m, monkeypatch, script, stops, max_new_tokens=40):
    real = m._ops
    monkeypatch.setattr(m, "_ops", ScriptedOps(real, script))
    pieces = list(m.stream([1, 2], max_new_tokens=max_new_tokens, stop=stops))
    monkeypatch.setattr(m, "_ops", ScriptedOps(real, script))
    res = m.generate([1, 2], max_new_tokens=max_new_tokens, stop=stops)
    monkeypatch.setattr(m, "_ops", real)
    return pieces, res


@pytest.mark.parametrize("text, stops, ends_with_eos", [
    ("Hello! world", ["! "], True),                  # the case: "Hello" then "!"
    ("Hello!", ["! "], True),                        # "!" held, then EOS: it must arrive
    ("Hello!", ["! "], False),                       # ... or the length limit
    ("xab", ["b", "a"], True),                       # the earliest stop, not the first listed
    ("abcd", ["abcd", "c"], True),                   # "c" completes first
    ("a\n\nb", ["\n\n\n", "\n\nb"], True),           # overlapping prefixes
    ("tick 😀!", ["😀?"], True),                     # a held emoji split over tokens
    ("caf\u00e9 ok", ["\u00e9 ok"], True),
])
def test_stream_stop_pieces_join_to_generate_text(tiny_model_path, monkeypatch, text, stops,
                                                  ends_with_eos):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    try:
        tok, eos = m.tokenizer, m.config.eos_token_id
        ids = tok.encode(text, parse_special=False)
        script = ids + [eos] if ends_with_eos else ids + [ord("z")]   # "z" never comes
        limit = len(ids) + (1 if ends_with_eos else 0)
        pieces, res = _run_script(m, monkeypatch, script, stops, max_new_tokens=limit)
        want, reason = _reference_text(tok, script, stops, limit, eos)
        assert res.text == want and res.finish_reason == reason
        assert "".join(p.text for p in pieces) == want
        got_ids = [p.token_id for p in pieces]
        assert got_ids == res.token_ids                    # the stop's last token included
        assert eos not in got_ids
        assert pieces[-1].finish_reason in (None, reason)
    finally:
        tinyloop.free_model(m)


def test_stream_stop_never_yields_a_stop_prefix_too_early(tiny_model_path, monkeypatch):
    """Random texts over a small alphabet and random stops: the joined pieces equal
    generate's text, which equals the definition, and no piece ever shows text that a later
    stop cut away."""
    import random
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    rng = random.Random(7)
    try:
        tok, eos = m.tokenizer, m.config.eos_token_id
        for trial in range(150):
            text = "".join(rng.choice("ab! \n\u00e9") for _ in range(rng.randint(1, 24)))
            stops = ["".join(rng.choice("ab! \n\u00e9") for _ in range(rng.randint(1, 4)))
                     for _ in range(rng.randint(1, 3))]
            ids = tok.encode(text, parse_special=False)
            script = ids + ([eos] if trial % 2 else [ord("b")] * 4)
            limit = len(ids) + (1 if trial % 2 else rng.randint(0, 2)) or 1
            pieces, res = _run_script(m, monkeypatch, script, stops, max_new_tokens=limit)
            want, reason = _reference_text(tok, script, stops, limit, eos)
            assert res.text == want and res.finish_reason == reason, (text, stops)
            seen = ""
            for p in pieces:
                seen += p.text
                assert want.startswith(seen), (text, stops, seen)
            assert seen == want, (text, stops)
    finally:
        tinyloop.free_model(m)


def test_exit_while_a_daemon_thread_holds_the_model_does_not_hang(tiny_model_path):
    """The exit hook waits a bounded time for a request a daemon thread holds, then leaves
    that model to the process's end; finalization never blocks on the model's lock."""
    import os
    import subprocess
    import sys
    script = r"""
import sys, threading, time
import tinyloop
m = tinyloop.load_model(sys.argv[1], max_seq_len=32, backend="numpy")
other = tinyloop.load_model(sys.argv[1], max_seq_len=32, backend="numpy")
held = threading.Event()
def hold():
    with m._lock:
        held.set()
        time.sleep(3600)
threading.Thread(target=hold, daemon=True).start()
held.wait()
print("exiting", flush=True)
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-W", "always", "-c", script, tiny_model_path],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "exiting\n", p.stderr
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "ResourceWarning" not in p.stderr, p.stderr


@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_adapter_path"])
def test_quant_weights_name_every_quantized_tensor(fixture, request):
    """Model.quant_weights: the file's quantized tensors by name (``output`` only where the
    head is untied), each with the bytes its codes, scales and zeros take at the file's bits
    and group size (counted here from the shape); refused after free."""
    from tinyloop.format import read_tlm
    path = request.getfixturevalue(fixture)
    with read_tlm(path) as f:
        want = {}
        for n in f.quant_names():
            q = f.quant_weight(n)
            rows, cols = q.shape
            want[n] = rows * cols * q.bits // 8 + 2 * 2 * rows * (cols // q.group_size)
        tied = f.config.tied_head
    m = tinyloop.load_model(path, backend="numpy")
    try:
        got = m.quant_weights()
        if tied:
            want.pop("output", None)
        assert set(got) == set(want)
        assert {n: w.nbytes for n, w in got.items()} == want
        assert ("inject.adapter" in got) == m.injects
    finally:
        tinyloop.free_model(m)
    with pytest.raises(errors.ModelFreedError):
        m.quant_weights()


def test_every_error_copies_and_pickles_with_its_attributes():
    """copy.copy and pickle keep each TinyLoopError's class, message, arguments and
    attributes, including those whose __init__ takes required keyword-only arguments
    (NonFiniteLogitsError's kind: the default reduction re-calls __init__ without them, so
    the engine's per-request copy of a row's error failed) and an OSError's filename."""
    import copy
    import inspect
    import pickle
    classes = [c for c in vars(errors).values()
               if inspect.isclass(c) and issubclass(c, errors.TinyLoopError)]
    assert len(classes) > 20
    for cls in classes:
        kw = {errors.NonFiniteLogitsError: dict(kind="+inf", step=3, position=9),
              errors.OutOfMemoryError: dict(requested_bytes=5, tag="kv_cache", step=1)}
        e = cls(28, "no space", "out.tlm") if cls is errors.FileWriteError else \
            cls("what went wrong", **kw.get(cls, {}))
        e.partial = "the partial result"
        for c in (copy.copy(e), pickle.loads(pickle.dumps(e))):
            assert type(c) is cls and c is not e
            assert (str(c), c.args, c.__dict__) == (str(e), e.args, e.__dict__), cls
    c = copy.copy(errors.FileWriteError(28, "no space", "out.tlm"))
    assert (c.errno, c.strerror, c.filename) == (28, "no space", "out.tlm")
    c = pickle.loads(pickle.dumps(errors.NonFiniteLogitsError("x", kind="nan", step=2)))
    assert (c.kind, c.step, c.position) == ("nan", 2, None)


def _drained(st):
    list(st)
    return st.result


def test_decode_time_ends_when_the_last_token_is_known(tiny_model_path, monkeypatch):
    """decode_ms runs from the prefill's end to the last token, not through the KV cache's
    release that follows it (a long context's pages take milliseconds to free): a release
    that takes 1,000 s by the module's clock leaves decode_ms and tokens/s as they were."""
    from tinyloop import generate as gen
    clock = slow_kv_release(monkeypatch, gen)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        for run in (lambda: m.generate([10, 20, 30], max_new_tokens=6),
                    lambda: _drained(m.stream([10, 20, 30], max_new_tokens=6))):
            before = clock.shift
            r = run()
            assert clock.shift == before + 1000.0            # the release did run
            # far below the 1,000 s the release took, whatever a loaded machine's stalls
            assert len(r.token_ids) == 6 and 0.0 < r.decode_ms < 100_000.0
            assert r.decode_tokens_per_s > 5 / 100.0       # 5 tokens in under 100 s
    finally:
        tinyloop.free_model(m)
