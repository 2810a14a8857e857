"""PrefixCache, ResumeHandle, PrefixPool and prefix files on the NumPy backend.

Every comparison is against an uncached run of the same request (the reference): greedy tokens
identical, logits within RTOL x max|logit| (the bound chunked prefill alone also stays in).
"""

from __future__ import annotations

import gc
import os
import struct
import threading

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.config import KV_MODES
from tinyloop.kv import DEFAULT_PAGE_SIZE
from tinyloop.memory import get_pool
from tinyloop.kv.pool import encode_key
from tinyloop.tlpx import _HEADER

from ..conftest import TINY, fail_nth_allocation

PAGE = DEFAULT_PAGE_SIZE  # KV page positions (the paged cache's P); prefixes end on / inside one
RTOL = 1e-5


def _tag(tag):
    return get_pool("host").stats().by_tag.get(tag, 0)


def _allocated():
    return get_pool("host").stats().allocated_bytes


def _close(a, b, rtol=RTOL):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    assert np.isfinite(a).all() and np.isfinite(b).all()
    scale = float(np.abs(b).max())
    err = float(np.abs(a - b).max())
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} x {scale:.3g}"


def _state(handle) -> dict:
    """A handle's storage as flat host arrays: kv.<slot>.<part>, rows, snapshot."""
    st = handle._st.host_state()
    out = {k: v for k, v in st.items() if k != "kv"}
    for s, parts in enumerate(st["kv"]):
        out.update({f"kv.{s}.{name}": a for name, a in parts.items()})
    return out


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, TINY["vocab_size"], n).astype(np.int32)


@pytest.fixture(params=["tiny_model_path", "tiny_adapter_path"])
def model(request):
    m = tinyloop.load_model(request.getfixturevalue(request.param), max_seq_len=256,
                            backend="numpy")
    yield m
    tinyloop.free_model(m)


@pytest.fixture
def plain(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=256, backend="numpy")
    yield m
    tinyloop.free_model(m)


# -- PrefixCache ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_mode", KV_MODES)
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("n_prefix", [2 * PAGE, 2 * PAGE + 5])       # on / inside a page
def test_prefix_reuse_equals_no_reuse(model, depth, kv_mode, n_prefix):
    """Reuse is bit-identical to a prefill chunked at the prefix's end (the same computation),
    and within 1e-5 x max|logit| of an unchunked prefill in fp16 (quantized modes: as close as
    chunking itself gets, since a ~1e-6 difference can move a value across a rounding step);
    greedy tokens equal in every mode."""
    prompt = _ids(n_prefix + 11, seed=n_prefix + depth)
    ref_logits = model.logits(prompt, depth=depth, kv_mode=kv_mode)
    ref = model.generate(prompt, max_new_tokens=12, depth=depth, kv_mode=kv_mode)
    chunked = tinyloop.load_model(model.path, max_seq_len=256, prefill_chunk=n_prefix,
                                  backend="numpy")
    try:
        chunked_logits = chunked.logits(prompt, depth=depth, kv_mode=kv_mode)
    finally:
        tinyloop.free_model(chunked)
    before = _tag("prefix_cache")
    with model.prefill(prompt[:n_prefix], depth=depth, kv_mode=kv_mode) as pc:
        assert pc.tokens == tuple(int(t) for t in prompt[:n_prefix])
        assert (pc.depth, pc.kv_mode, len(pc)) == (depth, kv_mode, n_prefix)
        assert _tag("prefix_cache") - before == pc.nbytes > 0
        got = model.generate(prompt, max_new_tokens=12, prefix=pc)
        assert got.token_ids == ref.token_ids
        assert got.cached_tokens == n_prefix and ref.cached_tokens == 0
        assert got.depth == depth
        reused = model.logits(prompt, prefix=pc)
        np.testing.assert_array_equal(reused, chunked_logits)
        if kv_mode == "fp16":
            _close(reused, ref_logits)
        else:
            assert (np.abs(reused - ref_logits).max()
                    <= max(RTOL * np.abs(ref_logits).max(),
                           np.abs(chunked_logits - ref_logits).max()))
        assert (reused.argmax(-1) == ref_logits.argmax(-1)).all()
        if kv_mode == "fp16":              # the other entry points, once per depth and length
            _close(model.score(prompt, prefix=pc), model.score(prompt, depth=depth),
                   rtol=1e-4)
            streamed = [t.token_id for t in model.stream(prompt, max_new_tokens=12, prefix=pc)]
            assert streamed == ref.token_ids
            # a prompt equal to the prefix: nothing left to prefill, the cached last row samples
            whole = model.generate(prompt[:n_prefix], max_new_tokens=6, prefix=pc)
            assert whole.token_ids == model.generate(prompt[:n_prefix], max_new_tokens=6,
                                                     depth=depth).token_ids
            assert whole.cached_tokens == n_prefix
        # the request shared the prefix's full pages and freed only its own
        assert _tag("prefix_cache") - before == pc.nbytes
    assert pc.released and pc.nbytes == 0
    assert _tag("prefix_cache") == before


def test_prefix_with_chunked_prefill(tiny_adapter_path):
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=256, prefill_chunk=8,
                            backend="numpy")
    try:
        prompt = _ids(45, seed=3)
        with m.prefill(prompt[:21], depth=2) as pc:
            _close(m.logits(prompt, prefix=pc), m.logits(prompt, depth=2))
            assert (m.generate(prompt, 8, prefix=pc).token_ids
                    == m.generate(prompt, 8, depth=2).token_ids)
    finally:
        tinyloop.free_model(m)


def test_prefix_misuse_is_refused(plain, tiny_model_path):
    prompt = _ids(30, seed=5)
    pc = plain.prefill(prompt[:20], depth=2)
    bad = prompt.copy()
    bad[13] = (bad[13] + 1) % TINY["vocab_size"]
    with pytest.raises(errors.ConfigError, match="position 13"):
        plain.generate(bad, 4, prefix=pc)
    with pytest.raises(errors.ConfigError, match="shorter than the prefix"):
        plain.generate(prompt[:10], 4, prefix=pc)
    with pytest.raises(errors.ConfigError, match="depth=3 differs"):
        plain.generate(prompt, 4, depth=3, prefix=pc)
    with pytest.raises(errors.ConfigError, match="depth=3 differs"):
        plain.logits(prompt, depth=3, prefix=pc)
    other_mode = next(m for m in KV_MODES if m != pc.kv_mode)
    with pytest.raises(errors.ConfigError, match="kv_mode"):
        plain.generate(prompt, 4, kv_mode=other_mode, prefix=pc)
    with pytest.raises(errors.ConfigError, match="PrefixCache"):
        plain.generate(prompt, 4, prefix="not a handle")
    with pytest.raises(errors.ConfigError, match="not both"):
        plain.generate(prompt, 4, prefix=pc, prefix_pool=tinyloop.PrefixPool(plain))
    other = tinyloop.load_model(tiny_model_path, max_seq_len=256, backend="numpy")
    try:
        with pytest.raises(errors.HandleError, match="another Model"):
            other.generate(prompt, 4, prefix=pc)
    finally:
        tinyloop.free_model(other)
    pc.release()
    pc.release()                                             # idempotent
    for call in (lambda: plain.generate(prompt, 4, prefix=pc),
                 lambda: plain.logits(prompt, prefix=pc), lambda: pc.save("x.tlpx")):
        with pytest.raises(errors.HandleError, match="released"):
            call()
    with pytest.raises(errors.ConfigError, match="depth"):
        plain.prefill(prompt, depth=TINY["max_depth"] + 1)
    with pytest.raises(errors.ConfigError, match="unknown KV cache mode"):
        plain.prefill(prompt, kv_mode="fp8")
    with pytest.raises(errors.ConfigError, match="max_seq_len"):
        plain.prefill(_ids(300, seed=1))


def test_free_model_releases_handles_and_gc_frees_with_warning(tiny_model_path):
    before = _allocated()
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    pc = m.prefill([1, 2, 3, 4])
    rh = m.resume_handle([1, 2, 3], depth=1, max_depth=2)
    pool = tinyloop.PrefixPool(m)
    m.generate([5, 6, 7], 2, prefix_pool=pool)
    assert pool.stats()["entries"] == 1
    tinyloop.free_model(m)
    assert _allocated() == before
    assert pc.released and rh.released and pool.stats()["bytes"] == 0
    with pytest.raises(errors.HandleError):
        pool.check(m)

    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        base = _tag("prefix_cache")
        with pytest.warns(ResourceWarning, match="PrefixCache of 3 tokens"):
            m.prefill([1, 2, 3])                         # dropped at once
            gc.collect()
        m.generate([4, 5], 1)                            # the next request frees it
        assert _tag("prefix_cache") == base
    finally:
        tinyloop.free_model(m)


# -- ResumeHandle -----------------------------------------------------------------------------
def test_resume_upgrade_equals_fresh_prefill(model):
    prompt = _ids(2 * PAGE + 7, seed=21)
    full = np.concatenate([prompt, _ids(9, seed=22)])
    before = _tag("resume")
    rh = model.resume_handle(prompt, depth=2, max_depth=4)
    try:
        assert (rh.depth, rh.max_depth) == (2, 4)
        assert _tag("resume") - before > 0
        _close(model.logits(full, prefix=rh), model.logits(full, depth=2))
        assert rh.upgrade(4) is rh and rh.depth == 4
        fresh = model.resume_handle(prompt, depth=4, max_depth=4)
        try:
            # the handle's state equals a fresh prefill at depth 4, slot by slot
            a, b = _state(rh), _state(fresh)
            assert a.keys() == b.keys()
            for part in a:
                _close(a[part], b[part])
        finally:
            fresh.release()
        ref = model.logits(full, depth=4)
        _close(model.logits(full, prefix=rh), ref)
        ref_tokens = model.generate(full, 10, depth=4).token_ids
        runs = [model.generate(full, 10, prefix=rh) for _ in range(3)]
        assert all(r.token_ids == ref_tokens for r in runs)      # restore-and-decode repeats
        assert all(r.cached_tokens == len(prompt) and r.depth == 4 for r in runs)
        with pytest.raises(errors.ConfigError, match="must be in"):
            rh.upgrade(4)
    finally:
        rh.release()
    assert _tag("resume") == before
    with pytest.raises(errors.HandleError):
        rh.upgrade(3)


def test_resume_upgrade_in_steps_and_bad_depths(plain):
    prompt = _ids(40, seed=8)
    with plain.resume_handle(prompt, depth=1, max_depth=4) as rh:
        for d in (2, 3, 4):
            rh.upgrade(d)
            assert (plain.generate(prompt, 6, prefix=rh).token_ids
                    == plain.generate(prompt, 6, depth=d).token_ids)
    with pytest.raises(errors.ConfigError, match="max_depth"):
        plain.resume_handle(prompt, depth=3, max_depth=2)
    with pytest.raises(errors.ConfigError, match="max_depth"):
        plain.resume_handle(prompt, depth=1, max_depth=TINY["max_depth"] + 1)
    with plain.resume_handle(prompt, depth=1, max_depth=2) as rh:
        with pytest.raises(errors.ConfigError, match="must be in 2..2"):
            rh.upgrade(3)
        with pytest.raises(errors.ConfigError, match="int"):
            rh.upgrade(2.0)
        assert rh.depth == 1


def test_fingerprint_is_the_weights_and_layout(tiny_model_path, tiny_adapter_path, tmp_path):
    import shutil
    from tinyloop.format import read_tlm
    from tinyloop.model import model_fingerprint
    copy = tmp_path / "copy.tlm"
    shutil.copy(tiny_model_path, copy)
    a = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    b = tinyloop.load_model(str(copy), max_seq_len=64, backend="numpy")
    c = tinyloop.load_model(tiny_adapter_path, max_seq_len=32, backend="numpy")
    try:
        assert len(a.fingerprint) == 32
        assert a.fingerprint == b.fingerprint != c.fingerprint     # bytes, not the path
        with read_tlm(tiny_model_path) as f:
            assert model_fingerprint(f) == a.fingerprint
        d = tinyloop.load_model(str(copy), max_seq_len=32, backend="numpy")
        try:
            os.utime(copy, ns=(1, 1))                   # the file changed after the load
            with pytest.raises(errors.FormatError, match="changed since it was loaded"):
                d.fingerprint
            with pytest.raises(errors.FormatError, match="changed"):
                tinyloop.PrefixPool(d)
        finally:
            tinyloop.free_model(d)
        assert b.fingerprint == a.fingerprint                       # kept once computed
    finally:
        for m in (a, b, c):
            tinyloop.free_model(m)


# -- PrefixPool -------------------------------------------------------------------------------
def test_pool_key_is_injective_and_exact(plain):
    fp = plain.fingerprint
    keys = {encode_key(fp, 1, "fp16", [1, 2]), encode_key(fp, 2, "fp16", [1, 2]),
            encode_key(fp, 1, "int8", [1, 2]), encode_key(fp, 1, "fp16", [1, 2, 0]),
            encode_key(fp, 1, "fp16", [258]), encode_key(fp, 1, "fp16", [1]),
            encode_key(bytes(32), 1, "fp16", [1, 2])}
    assert len(keys) == 7
    pool = tinyloop.PrefixPool(plain)
    prompt = _ids(40, seed=2)
    plain.generate(prompt, 2, depth=1, prefix_pool=pool)
    r = plain.generate(prompt, 2, depth=2, prefix_pool=pool)          # same tokens, depth 2
    assert r.cached_tokens == 0
    s = pool.stats()
    assert (s["hits"], s["misses"], s["entries"]) == (0, 2, 2)
    r = plain.generate(prompt, 2, depth=2, prefix_pool=pool)
    assert r.cached_tokens == len(prompt)
    r = plain.generate(prompt, 2, depth=2, kv_mode="int8", prefix_pool=pool)  # another mode
    assert r.cached_tokens == 0 and pool.stats()["misses"] == 3
    assert plain.generate(prompt, 2, depth=2, kv_mode="int8", prefix_pool=pool).cached_tokens
    assert pool.key(prompt, 2) == encode_key(plain.fingerprint, 2,
                                             ("fp16",) * plain.config.n_layers, prompt)
    assert pool.key(prompt, 2, "int8") != pool.key(prompt, 2)


def test_pool_lru_evicts_exactly_the_shortfall(plain):
    L = PAGE + 3
    pool = tinyloop.PrefixPool(plain, max_bytes=3 * tinyloop.PrefixPool(plain).entry_bytes(L, 2))
    one = pool.entry_bytes(L, 2)
    prompts = [_ids(L, seed=100 + i) for i in range(6)]
    prompts = [np.concatenate([[i + 3], p[1:]]).astype(np.int32) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts[:3]):
        plain.generate(p, 1, depth=2, prefix_pool=pool)
        s = pool.stats()
        assert s["bytes"] == _tag("prefix_cache") == (i + 1) * one
        assert s["evictions"] == 0
    plain.generate(prompts[0], 1, depth=2, prefix_pool=pool)          # refresh 0: 1 is oldest
    plain.generate(prompts[3], 1, depth=2, prefix_pool=pool)
    s = pool.stats()
    assert (s["evictions"], s["entries"], s["bytes"]) == (1, 3, 3 * one)
    fp16 = plain.resolve_kv_modes("fp16")
    assert pool.lookup(prompts[1], 2, fp16) == (None, 0)
    # an entry twice as long needs exactly two evictions: the two oldest (2, then 0)
    big = np.concatenate([prompts[4], _ids(L, seed=7)]).astype(np.int32)
    need = pool.entry_bytes(len(big), 2)
    assert 2 * one >= need - (pool.max_bytes - 3 * one) > one
    plain.generate(big, 1, depth=2, prefix_pool=pool)
    s = pool.stats()
    assert s["evictions"] == 3 and s["entries"] == 2
    assert s["bytes"] == _tag("prefix_cache") <= pool.max_bytes
    assert pool.lookup(prompts[3], 2, fp16)[1] == L
    assert pool.lookup(prompts[0], 2, fp16) == (None, 0)
    # larger than the whole budget: refused, nothing evicted
    huge = _ids(7 * PAGE, seed=9)
    assert pool.entry_bytes(len(huge), 2) > pool.max_bytes
    plain.generate(huge, 1, depth=2, prefix_pool=pool)
    assert pool.stats()["rejected"] == 1 and pool.stats()["entries"] == 2
    pool.clear()
    assert pool.stats()["bytes"] == _tag("prefix_cache") == 0


def test_pool_chat_trace_hits_every_turn_after_the_first(plain):
    """N system prompts, varied user turns: every turn after a system prompt's first hits,
    reusing at least the system prompt; held bytes stay within the budget and equal the tag."""
    systems = [_ids(2 * PAGE + i, seed=300 + i) for i in range(3)]
    budget = 6 * tinyloop.PrefixPool(plain).entry_bytes(3 * PAGE + 20, 1)
    pool = tinyloop.PrefixPool(plain, max_bytes=budget)
    rng = np.random.default_rng(4)
    seen = set()
    for turn in range(12):
        s = int(rng.integers(len(systems)))
        prompt = np.concatenate([systems[s], _ids(int(rng.integers(3, 20)), seed=900 + turn)])
        prompt = prompt.astype(np.int32)
        ref = plain.generate(prompt, 4, depth=1)
        got = plain.generate(prompt, 4, depth=1, prefix_pool=pool)
        assert got.token_ids == ref.token_ids
        if s in seen:
            assert got.cached_tokens >= len(systems[s])
        else:
            assert got.cached_tokens == 0
        seen.add(s)
        st = pool.stats()
        assert st["bytes"] == _tag("prefix_cache") <= budget
    st = pool.stats()
    assert st["hits"] == 12 - len(seen) and st["misses"] == len(seen)


def test_pool_logits_and_score_reuse(plain):
    pool = tinyloop.PrefixPool(plain)
    prompt = _ids(50, seed=12)
    ref = plain.logits(prompt, depth=3)
    _close(plain.logits(prompt[:30], depth=3, prefix_pool=pool), ref[:30])
    _close(plain.logits(prompt, depth=3, prefix_pool=pool), ref)
    assert pool.stats()["hit_tokens"] == 30
    _close(plain.score(prompt, depth=3, prefix_pool=pool), plain.score(prompt, depth=3),
           rtol=1e-4)


def test_pool_refuses_other_models_and_bad_budgets(plain, tiny_model_path):
    pool = tinyloop.PrefixPool(plain, max_bytes="1M")
    assert pool.max_bytes == 2 ** 20
    other = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        with pytest.raises(errors.HandleError, match="another Model"):
            other.generate([1, 2, 3], 2, prefix_pool=pool)
    finally:
        tinyloop.free_model(other)
    for bad in (-1, 1.5, True, "lots"):
        with pytest.raises(errors.ConfigError, match="max_bytes"):
            tinyloop.PrefixPool(plain, max_bytes=bad)
    with pytest.raises(errors.ConfigError, match="Model"):
        tinyloop.PrefixPool("model")
    with pytest.raises(errors.ConfigError, match="PrefixPool"):
        plain.generate([1, 2], 2, prefix_pool={})
    pool.release()
    with pytest.raises(errors.HandleError, match="released"):
        plain.generate([1, 2], 2, prefix_pool=pool)


@pytest.mark.parametrize("what", ["rows", "block table", "copied page"])
def test_pool_insert_out_of_memory_does_not_fail_the_request(plain, monkeypatch, what):
    pool = tinyloop.PrefixPool(plain)
    prompt = _ids(60, seed=77)                        # 60 % PAGE != 0: a partly filled page
    ref = plain.generate(prompt, 3, depth=2).token_ids
    before = _allocated()
    # the request's kv_cache allocations: its block table, then its pages; the insert's: the
    # entry's block table, then a copy of each slot's partly filled page
    request_allocs = 1 + plain.config.n_slots(2) * -(-len(prompt) // PAGE)
    tag, nth = {"rows": ("prefix_cache", 1), "block table": ("kv_cache", request_allocs + 1),
                "copied page": ("kv_cache", request_allocs + 3)}[what]
    fail_nth_allocation(monkeypatch, get_pool("host"), tag, nth)
    got = plain.generate(prompt, 3, depth=2, prefix_pool=pool)
    assert got.token_ids == ref
    s = pool.stats()
    assert (s["rejected"], s["entries"], s["bytes"]) == (1, 0, 0)
    assert _allocated() == before and _tag("prefix_cache") == 0


# -- save / load ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["prefix", "resume"])
def test_save_load_round_trip_is_exact(model, tmp_path, kind):
    prompt = _ids(37, seed=41)
    full = np.concatenate([prompt, _ids(6, seed=42)]).astype(np.int32)
    if kind == "prefix":
        h = model.prefill(prompt, depth=3)
    else:
        h = model.resume_handle(prompt, depth=2, max_depth=4)
    path = tmp_path / "p.tlpx"
    n = h.save(path)
    assert os.path.getsize(path) == n
    loaded = model.load_prefix(path)
    try:
        assert type(loaded) is type(h)
        assert (loaded.tokens, loaded.depth, loaded.kv_mode) == (h.tokens, h.depth, h.kv_mode)
        assert loaded.nbytes == h.nbytes
        a, b = _state(loaded), _state(h)
        assert a.keys() == b.keys()
        for part in a:
            np.testing.assert_array_equal(a[part], b[part])
        assert (model.generate(full, 8, prefix=loaded).token_ids
                == model.generate(full, 8, prefix=h).token_ids)
        if kind == "resume":
            assert loaded.max_depth == 4
            loaded.upgrade(4)
            h.upgrade(4)
            a, b = _state(loaded), _state(h)
            for part in a:
                np.testing.assert_array_equal(a[part], b[part])
    finally:
        loaded.release()
        h.release()


def _corruptions(raw: bytes, other_fp: bytes):
    """(name, bytes) of every corrupted variant: each must be refused."""
    hs = _HEADER.size
    fields = list(_HEADER.unpack(raw[:hs]))

    def with_field(i, v):
        f = list(fields)
        f[i] = v
        return _HEADER.pack(*f) + raw[hs:]

    out = [("empty", b""), ("half header", raw[:hs // 2]), ("header only", raw[:hs]),
           ("truncated payload", raw[:-1]), ("trailing byte", raw + b"\0"),
           ("bad magic", b"X" + raw[1:]), ("version", with_field(1, 99)),
           ("foreign model", with_field(2, other_fp)), ("kind", with_field(3, 7)),
           ("kv dtype", with_field(4, 9)), ("depth 0", with_field(5, 0)),
           ("depth > max", with_field(5, 99)), ("max_depth", with_field(6, 4096)),
           ("planes", with_field(7, 3)), ("kv_mode", with_field(8, b"fp99")),
           ("kv_mode bytes", with_field(8, b"\xff" * 16)),
           ("n_tokens huge", with_field(9, 2 ** 32 - 1)),
           ("n_tokens+1", with_field(9, fields[9] + 1)),
           ("slots", with_field(10, fields[10] + 1)), ("head_dim", with_field(12, 32)),
           ("d_model", with_field(13, 65)), ("vocab", with_field(14, 301)),
           ("n_layers", with_field(15, fields[15] + 1)), ("digest", with_field(16, bytes(32))),
           ("payload_len huge", with_field(17, 2 ** 64 - 1))]
    for off in (hs, hs + 8 * fields[15] + 1, hs + 8 * fields[15] + 4 * 37 + 100,
                len(raw) - 1):                        # the modes, a token, K/V, the rows
        b = bytearray(raw)
        b[off] ^= 0x40
        out.append((f"flipped byte {off}", bytes(b)))
    b = bytearray(raw)                                        # a token id past the vocabulary,
    tok = hs + 8 * fields[15]                                 # checksum made consistent
    b[tok:tok + 4] = struct.pack("<I", 5000)
    import hashlib
    f = list(fields)
    f[16] = hashlib.sha256(bytes(b[hs:])).digest()
    out.append(("token out of vocab", _HEADER.pack(*f) + bytes(b[hs:])))
    return out


def test_every_corrupted_prefix_file_is_refused_with_nothing_changed(tiny_adapter_path,
                                                                      tiny_model_path,
                                                                      tmp_path):
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=256, backend="numpy")
    other = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        prompt = _ids(37, seed=41)
        full = np.concatenate([prompt, _ids(6, seed=42)]).astype(np.int32)
        for kind in ("prefix", "resume"):
            h = (m.prefill(prompt, depth=3) if kind == "prefix"
                 else m.resume_handle(prompt, depth=2, max_depth=4))
            pool = tinyloop.PrefixPool(m, max_bytes="1M")
            m.generate(full, 2, depth=3, prefix_pool=pool)
            path = tmp_path / f"{kind}.tlpx"
            h.save(path)
            raw = path.read_bytes()
            state_before = _state(h)
            pool_before = pool.stats()
            before = _allocated()
            tokens_before = m.generate(full, 8, prefix=h).token_ids
            logits_before = m.logits(full, prefix=h)
            for name, data in _corruptions(raw, other.fingerprint):
                bad = tmp_path / "bad.tlpx"
                bad.write_bytes(data)
                with pytest.raises(errors.TinyLoopError):
                    m.load_prefix(bad)
                assert _allocated() == before, name
                assert pool.stats() == pool_before, name
                for part, arr in _state(h).items():
                    np.testing.assert_array_equal(arr, state_before[part])
            assert m.generate(full, 8, prefix=h).token_ids == tokens_before
            np.testing.assert_array_equal(m.logits(full, prefix=h), logits_before)
            with pytest.raises(errors.FormatError, match="another model"):
                other.load_prefix(path)
            h.release()
            pool.release()
        with pytest.raises(FileNotFoundError):
            m.load_prefix(tmp_path / "missing.tlpx")
    finally:
        tinyloop.free_model(other)
        tinyloop.free_model(m)


# -- threads ----------------------------------------------------------------------------------
def test_threads_mixing_pool_inserts_evictions_and_upgrades(tiny_adapter_path):
    """8 threads: pooled generations under eviction pressure, and upgrades of their own resume
    handles; each thread gets the output it gets alone."""
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=256, backend="numpy")
    try:
        system = _ids(2 * PAGE, seed=500)
        jobs = []
        for i in range(8):
            prompt = np.concatenate([system if i % 2 else _ids(2 * PAGE, seed=600 + i),
                                     _ids(5 + i, seed=700 + i)]).astype(np.int32)
            jobs.append((i, prompt, 1 + i % 3))
        solo = {}
        for i, prompt, d in jobs:
            if i % 4 == 3:
                solo[i] = [m.generate(prompt, 5, depth=dd).token_ids for dd in (d, d + 1)]
            else:
                solo[i] = m.generate(prompt, 5, depth=d).token_ids
        probe = tinyloop.PrefixPool(m)
        pool = tinyloop.PrefixPool(m, max_bytes=2 * probe.entry_bytes(2 * PAGE + 12, 2))
        probe.release()
        got, failures = {}, []
        barrier = threading.Barrier(8)

        def work(i, prompt, d):
            try:
                barrier.wait()
                if i % 4 == 3:
                    with m.resume_handle(prompt[:-3], depth=d, max_depth=d + 1) as rh:
                        a = m.generate(prompt, 5, prefix=rh).token_ids
                        rh.upgrade(d + 1)
                        got[i] = [a, m.generate(prompt, 5, prefix=rh).token_ids]
                else:
                    out = []
                    for _ in range(3):
                        out.append([t.token_id for t in
                                    m.stream(prompt, 5, depth=d, prefix_pool=pool)])
                    assert out[0] == out[1] == out[2]
                    got[i] = out[0]
            except BaseException as e:       # reported below, with the thread's number
                failures.append((i, e))

        threads = [threading.Thread(target=work, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
        assert got == solo
        s = pool.stats()
        assert s["bytes"] == _tag("prefix_cache") <= pool.max_bytes
        # 6 pooled threads x 3 streams; 6 distinct prompts through a pool of under 3 entries
        assert s["hits"] + s["misses"] == 18 and s["inserts"] >= 6 and s["evictions"] >= 4
        pool.release()
    finally:
        tinyloop.free_model(m)


def test_upgrade_between_a_calls_check_and_its_prefill_is_refused(plain):
    """A ResumeHandle upgraded by another thread after a call validated it: the call's first
    step refuses it rather than restoring slots of the wrong depth."""
    from tinyloop.generate import check_prefix_args, prefill_request
    prompt = _ids(30, seed=31)
    with plain.resume_handle(prompt[:20], depth=1, max_depth=3) as rh:
        depth, mode = check_prefix_args(plain, prompt, None, None, rh, None)
        rh.upgrade(3)
        with plain._lock, plain.new_kv_cache(depth, len(prompt), mode) as cache:
            with pytest.raises(errors.ConfigError, match="upgrade"):
                prefill_request(plain, prompt, depth, mode, cache, prefix=rh)


# -- pages shared by reference ----------------------------------------------------------------
def _page_nbytes(model):
    from tinyloop.memory import round_size
    return round_size(model.kv_page_layout("fp16").page_bytes)


@pytest.mark.parametrize("n_prefix", [2 * PAGE, 2 * PAGE + 5])
def test_a_request_shares_the_prefix_full_pages(plain, n_prefix):
    """While a request from a prefix runs, it holds the prefix's full pages by reference: its
    own kv_cache bytes are smaller by exactly those pages (a partly filled one is copied)."""
    prompt = _ids(n_prefix + 40, seed=n_prefix)
    slots = plain.config.n_slots(2)
    base = _tag("kv_cache")
    it = plain.stream(prompt, 4, depth=2)
    next(it)
    plain_bytes = _tag("kv_cache") - base
    it.close()
    with plain.prefill(prompt[:n_prefix], depth=2) as pc:
        held = _tag("prefix_cache")
        it = plain.stream(prompt, 4, prefix=pc)
        next(it)
        shared = slots * (n_prefix // PAGE) * _page_nbytes(plain)
        assert _tag("kv_cache") - base == plain_bytes - shared
        assert _tag("prefix_cache") == held                   # shared pages counted once
        it.close()
        assert _tag("kv_cache") == base
    assert _tag("prefix_cache") == 0


def test_pool_entries_share_pages_and_count_them_once(plain):
    system = _ids(2 * PAGE, seed=40)
    a = np.concatenate([system, _ids(9, seed=41)]).astype(np.int32)
    b = np.concatenate([system, _ids(13, seed=42)]).astype(np.int32)
    pool = tinyloop.PrefixPool(plain)
    plain.generate(a, 2, depth=1, prefix_pool=pool)
    assert plain.generate(b, 2, depth=1, prefix_pool=pool).cached_tokens == 2 * PAGE
    shared = plain.config.n_slots(1) * 2 * _page_nbytes(plain)
    s = pool.stats()
    assert s["entries"] == 2
    assert s["bytes"] == (pool.entry_bytes(len(a), 1) + pool.entry_bytes(len(b), 1) - shared)
    assert s["bytes"] == _tag("prefix_cache")
    pool.clear()
    assert pool.stats()["bytes"] == _tag("prefix_cache") == 0


def test_upgrade_while_a_stream_shares_the_handle_pages(tiny_adapter_path):
    """A stream restored from a ResumeHandle keeps decoding at its depth while the handle is
    upgraded between two of its steps (copy-on-write of the shared pages the upgrade
    rewrites); the handle then equals a fresh prefill at the new depth."""
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=256, backend="numpy")
    try:
        prompt = _ids(2 * PAGE, seed=50)               # ends on a page boundary: all shared
        full = np.concatenate([prompt, _ids(3, seed=51)]).astype(np.int32)
        want_1 = m.generate(full, 10, depth=1).token_ids
        want_3 = m.generate(full, 10, depth=3).token_ids
        with m.resume_handle(prompt, depth=1, max_depth=3) as rh:
            it = m.stream(full, 10, prefix=rh)
            got = [next(it).token_id for _ in range(4)]
            rh.upgrade(3)
            got += [t.token_id for t in it]
            assert got == want_1
            assert m.generate(full, 10, prefix=rh).token_ids == want_3
    finally:
        tinyloop.free_model(m)


# -- ResumeHandle under a per-kind / per-layer kv_mode ---------------------------------------
# every slot keeps its own layer kind's page layout at every depth: the coda's K/V never lands
# in a slot laid out for a recurrent layer
MODE_MIXES = [
    {"prelude": "fp16", "recurrent": "int8", "coda": "fp16"},
    {"prelude": "int8", "recurrent": "fp16", "coda": "h_int4"},
    {"recurrent": "h_fp16", "coda": "int8"},
    {"prelude": "h_int8", "recurrent": "h_int4", "coda": "fp16"},
    ("int8", "fp16", "h_int8", "h_int4"),         # per physical layer: the two recurrent differ
    ("h_fp16", "h_int4", "int8", "fp16"),
]


def _mix_id(mix):
    return "-".join(mix.values()) if isinstance(mix, dict) else "-".join(mix) \
        if isinstance(mix, tuple) else mix


def _slots_at_depth(handle, depth):
    """The handle's K/V of every slot at ``depth`` (storage order mapped back), host copies."""
    from tinyloop.kv.layouts import room_slots
    kv = handle._st.host_state()["kv"]
    return [kv[i] for i in room_slots(handle._model.config, depth, handle._st.kv.depth)]


def _assert_equals_fresh_run(model, chunked, handle, prompt, full, depth, kv_mode,
                             tokens=True):
    """``handle`` at ``depth`` is exactly a fresh run: its rows and every slot's K/V equal a
    fresh PrefixCache's, its logits equal an uncached run chunked at the prefix's end (the
    same computation), and (``tokens``) its greedy tokens too."""
    assert handle.depth == depth
    with model.prefill(prompt, depth=depth, kv_mode=kv_mode) as fresh:
        np.testing.assert_array_equal(handle._st.host_state()["rows"],
                                      fresh._st.host_state()["rows"])
        for got, want in zip(_slots_at_depth(handle, depth), fresh._st.host_state()["kv"],
                             strict=True):
            assert got.keys() == want.keys()
            for part in got:
                np.testing.assert_array_equal(got[part], want[part])
    np.testing.assert_array_equal(model.logits(full, prefix=handle),
                                  chunked.logits(full, depth=depth, kv_mode=kv_mode))
    if tokens:
        assert (model.generate(full, 4, prefix=handle).token_ids
                == chunked.generate(full, 4, depth=depth, kv_mode=kv_mode).token_ids)


@pytest.mark.parametrize("kv_mode", MODE_MIXES, ids=_mix_id)
def test_resume_handle_with_any_mode_mix_equals_a_fresh_run_at_every_depth(model, kv_mode,
                                                                            tmp_path):
    """For each mix and every depth 1..max_depth: a handle made at that depth, the handle made
    at depth 1 and upgraded step by step to it, and both after save / load (and a loaded one
    upgraded further) equal a fresh run at that depth."""
    max_depth = TINY["max_depth"]
    prompt = _ids(PAGE + 13, seed=61)                       # a full page and a partly filled one
    full = np.concatenate([prompt, _ids(7, seed=62)]).astype(np.int32)
    chunked = tinyloop.load_model(model.path, max_seq_len=256, prefill_chunk=len(prompt),
                                  backend="numpy")
    held = ("prefix_cache", "resume", "kv_cache")
    before = [_tag(t) for t in held]
    try:
        with model.resume_handle(prompt, depth=1, max_depth=max_depth,
                                 kv_mode=kv_mode) as grown:
            for d in range(1, max_depth + 1):
                if d > 1:
                    grown.upgrade(d)
                _assert_equals_fresh_run(model, chunked, grown, prompt, full, d, kv_mode)
                with model.resume_handle(prompt, depth=d, max_depth=max_depth,
                                         kv_mode=kv_mode) as made:
                    _assert_equals_fresh_run(model, chunked, made, prompt, full, d, kv_mode,
                                             tokens=False)
                    a, b = _state(grown), _state(made)
                    assert a.keys() == b.keys()
                    for part in a:
                        np.testing.assert_array_equal(a[part], b[part])
                path = tmp_path / f"d{d}.tlpx"
                grown.save(path)
                with model.load_prefix(path) as back:
                    assert (back.depth, back.max_depth, back.kv_mode) == (d, max_depth,
                                                                          grown.kv_mode)
                    _assert_equals_fresh_run(model, chunked, back, prompt, full, d, kv_mode,
                                             tokens=False)
                    if d < max_depth:
                        back.upgrade(max_depth)
                        _assert_equals_fresh_run(model, chunked, back, prompt, full,
                                                 max_depth, kv_mode, tokens=False)
        assert [_tag(t) for t in held] == before
    finally:
        tinyloop.free_model(chunked)


def test_readme_mode_mix_below_max_depth(plain):
    """The README's pair: a per-kind kv_mode and resume_handle(depth=1, max_depth=4), then
    generate(prompt, prefix=rh), equals a run without the handle."""
    kv = {"prelude": "fp16", "recurrent": "int8", "coda": "fp16"}
    prompt = _ids(PAGE, seed=63)
    with plain.resume_handle(prompt, depth=1, max_depth=4, kv_mode=kv) as rh:
        got = plain.generate(prompt, 8, prefix=rh)
        assert got.cached_tokens == PAGE
        assert got.token_ids == plain.generate(prompt, 8, depth=1, kv_mode=kv).token_ids


def test_version_2_prefix_files_are_read_only_where_their_bytes_agree(plain, tmp_path):
    """Version 2 stored a ResumeHandle below max_depth with its coda in another slot: such a
    file is refused; a version 2 PrefixCache or ResumeHandle at max_depth loads as saved."""
    prompt = _ids(40, seed=64)

    def as_v2(handle, name):
        path = tmp_path / name
        handle.save(path)
        raw = bytearray(path.read_bytes())
        raw[8:12] = struct.pack("<I", 2)               # the header's version (not hashed)
        path.write_bytes(bytes(raw))
        return path

    with plain.prefill(prompt, depth=2) as pc, \
            plain.resume_handle(prompt, depth=3, max_depth=3) as top, \
            plain.resume_handle(prompt, depth=1, max_depth=3) as low:
        for h, name in ((pc, "pc.tlpx"), (top, "top.tlpx")):
            with plain.load_prefix(as_v2(h, name)) as back:
                a, b = _state(back), _state(h)
                for part in a:
                    np.testing.assert_array_equal(a[part], b[part])
        before = _allocated()
        with pytest.raises(errors.UnsupportedVersionError, match="version 2 ResumeHandle"):
            plain.load_prefix(as_v2(low, "low.tlpx"))
        assert _allocated() == before


# -- failed operations leave handles and pools as they were -----------------------------------
@pytest.fixture(scope="module")
def two_coda_model(tmp_path_factory):
    """TINY with two coda layers, stored in two page layouts (so a copy-on-write of the coda
    takes two allocation batches), and a recurrent layout that is neither."""
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    path = tmp_path_factory.mktemp("models") / "two_coda.tlm"
    write_synthetic(path, synthetic_config(**{**TINY, "n_coda": 2}), seed=13)
    m = tinyloop.load_model(str(path), max_seq_len=256, backend="numpy")
    yield m, ("fp16", "int8", "int8", "h_int8", "fp16")
    tinyloop.free_model(m)


def _each_failing_allocation(monkeypatch, setup, op, check_unchanged, tags=None):
    """For every memory tag and n = 1, 2, ...: ``state = setup()``, then ``op(state)`` with the
    n-th allocation under that tag failing; each failure must leave ``check_unchanged(state,
    before)`` true, where ``before`` is the pool's allocated bytes before the call. Stops a tag
    at the first n the operation gets through (fewer than n allocations under the tag).
    Returns the states the operation succeeded on, one per tag, and the failures seen."""
    from tinyloop.memory.tags import TAGS
    pool = get_pool("host")
    done, failures = [], 0
    for tag in tags or TAGS:
        n = 1
        while True:
            state = setup()
            before = _allocated()
            seen = fail_nth_allocation(monkeypatch, pool, tag, n)
            try:
                op(state)
            except errors.OutOfMemoryError as e:
                assert str(e) == "injected"
                monkeypatch.undo()
                check_unchanged(state, before)
                failures += 1
                n += 1
                continue
            finally:
                monkeypatch.undo()
            assert seen["n"] < n            # got through: the n-th allocation never came
            done.append(state)
            break
    return done, failures


@pytest.mark.parametrize("mixed", [False, True], ids=["fp16", "mixed"])
def test_failed_upgrade_at_any_allocation_leaves_the_handle_as_it_was(two_coda_model,
                                                                       monkeypatch, mixed):
    """A stream restored from the handle shares its pages, so the upgrade first copies the
    pages it rewrites (two layouts: two batches). Each failing allocation leaves the handle at
    its depth with its state, allocated bytes as before, and the stream and the handle still
    equal to runs without them; the upgrade that gets through equals a fresh run."""
    m, kv = two_coda_model
    kv = kv if mixed else "fp16"
    prompt = _ids(2 * PAGE + 5, seed=71)
    full = np.concatenate([prompt, _ids(4, seed=72)]).astype(np.int32)
    want_1 = m.generate(full, 6, depth=1, kv_mode=kv).token_ids
    want_3 = m.generate(full, 6, depth=3, kv_mode=kv).token_ids
    live = []

    def setup():
        rh = m.resume_handle(prompt, depth=1, max_depth=3, kv_mode=kv)
        it = m.stream(full, 6, prefix=rh)
        first = next(it).token_id                       # the stream holds the shared pages
        live.append(rh)
        return dict(rh=rh, it=it, first=first, state=_state(rh))

    def check_unchanged(s, before):
        rh = s["rh"]
        assert not rh.released and rh.depth == 1
        assert _allocated() == before
        for part, arr in _state(rh).items():
            np.testing.assert_array_equal(arr, s["state"][part])
        assert [s["first"]] + [t.token_id for t in s["it"]] == want_1
        if not checked:                                 # once: a request from the handle
            assert m.generate(full, 6, prefix=rh).token_ids == want_1
            checked.append(True)

    checked = []
    done, failures = _each_failing_allocation(monkeypatch, setup,
                                              lambda s: s["rh"].upgrade(3), check_unchanged)
    assert failures >= 2                       # each copy-on-write batch was made to fail
    for s in done:
        assert s["rh"].depth == 3
        assert [s["first"]] + [t.token_id for t in s["it"]] == want_1
        assert m.generate(full, 6, prefix=s["rh"]).token_ids == want_3
    while live:
        live.pop().release()


def test_make_private_is_all_or_nothing(two_coda_model, monkeypatch):
    """RuntimeKVCache.make_private failing in a copy or in the block-table upload, after the
    first layout's batch was made: the cache holds its old pages, nothing stays allocated."""
    import tinyloop.kv.cache as kvcache
    m, kv = two_coda_model
    src = m.new_kv_cache(2, 3 * PAGE, kv_mode=kv)
    src.ensure(3 * PAGE)
    for what in ("copy", "upload"):
        dst = m.new_kv_cache(2, 3 * PAGE, kv_mode=kv)
        dst.share_prefix(src, 3 * PAGE)                 # every page shared
        pages = [dst.page_list(s) for s in range(dst.n_slots)]
        table = dst.table_host.copy()
        before = _allocated()
        calls = {"n": 0}
        with monkeypatch.context() as mp:
            if what == "copy":
                real = kvcache.copy_page

                def flaky_copy(a, b):
                    calls["n"] += 1
                    if calls["n"] == 4:                   # inside the second layout's pages
                        raise RuntimeError("copy failed")
                    real(a, b)
                mp.setattr(kvcache, "copy_page", flaky_copy)
            else:
                def flaky_upload(host, dev):
                    calls["n"] += 1
                    if calls["n"] == 1:
                        raise RuntimeError("upload failed")
                    np.copyto(dev, host)
                mp.setattr(dst._ops, "from_host", flaky_upload)
            with pytest.raises(RuntimeError, match="failed"):
                dst.make_private(m.config.n_prelude + m.config.n_recurrent)
        assert [dst.page_list(s) for s in range(dst.n_slots)] == pages
        np.testing.assert_array_equal(dst.table_host, table)
        np.testing.assert_array_equal(m.ops.to_host(dst._table), table)
        assert _allocated() == before
        assert all(p.refs == 2 for ps in pages for p in ps)
        dst.release()
    src.release()


def test_failed_load_prefix_at_any_allocation_leaves_nothing(two_coda_model, monkeypatch,
                                                            tmp_path):
    m, kv = two_coda_model
    prompt = _ids(PAGE + 9, seed=73)
    with m.resume_handle(prompt, depth=2, max_depth=3, kv_mode=kv) as rh:
        rh.save(tmp_path / "rh.tlpx")
        want = _state(rh)
        pool = tinyloop.PrefixPool(m)
        m.generate(prompt, 1, depth=2, kv_mode=kv, prefix_pool=pool)
        pool_before = pool.stats()
        loaded = []

        def check_unchanged(_, before):
            assert _allocated() == before and pool.stats() == pool_before
            for part, arr in _state(rh).items():
                np.testing.assert_array_equal(arr, want[part])

        done, failures = _each_failing_allocation(
            monkeypatch, lambda: None,
            lambda _: loaded.append(m.load_prefix(tmp_path / "rh.tlpx")), check_unchanged)
        assert failures >= 3                           # block table, rows, snapshot, pages
        for back in loaded:
            got = _state(back)
            for part in want:
                np.testing.assert_array_equal(got[part], want[part])
            back.release()
        pool.release()


def test_failed_pool_insert_at_any_allocation_leaves_the_entries(plain, monkeypatch):
    """A prompt that extends an entry, into a full pool: a success replaces that entry and
    evicts the LRU one; a failure at any allocation (of the request, or of the insert, which
    the request survives) leaves every entry, the pool's bytes and allocated bytes as they
    were, and the entries still hit."""
    from tinyloop.memory.tags import TAGS
    base = _ids(PAGE + 8, seed=81)
    ext = np.concatenate([base, _ids(PAGE, seed=82)]).astype(np.int32)
    other = _ids(PAGE + 3, seed=83)
    want = plain.generate(ext, 2, depth=1).token_ids
    probe = tinyloop.PrefixPool(plain)
    budget = probe.entry_bytes(len(ext), 1) + probe.entry_bytes(len(other), 1) // 2
    probe.release()
    rejected_seen = hit_checked = 0
    for tag in TAGS:
        n = 1
        while True:
            pool = tinyloop.PrefixPool(plain, max_bytes=budget)
            plain.generate(other, 1, depth=1, prefix_pool=pool)
            plain.generate(base, 1, depth=1, prefix_pool=pool)
            keys = list(pool._entries)
            st = pool.stats()
            before = (_allocated(), _tag("prefix_cache"))
            seen = fail_nth_allocation(monkeypatch, get_pool("host"), tag, n)
            got = None
            try:
                got = plain.generate(ext, 2, depth=1, prefix_pool=pool).token_ids
            except errors.OutOfMemoryError as e:
                assert str(e).endswith(": injected")     # prefixed with the step it ended
            finally:
                monkeypatch.undo()
            s = pool.stats()
            if s["inserts"] == st["inserts"]:              # the request or its insert failed
                assert got in (None, want)
                rejected_seen += s["rejected"] - st["rejected"]
                assert list(pool._entries) == keys
                assert (s["entries"], s["bytes"], s["evictions"], s["replaced"]) == \
                    (st["entries"], st["bytes"], st["evictions"], st["replaced"])
                assert (_allocated(), _tag("prefix_cache")) == before
                if not hit_checked:
                    assert plain.generate(base, 1, depth=1,
                                          prefix_pool=pool).cached_tokens == len(base)
                    assert plain.generate(other, 1, depth=1,
                                          prefix_pool=pool).cached_tokens == len(other)
                    hit_checked = 1
                pool.release()
                n += 1
                continue
            assert seen["n"] < n and got == want
            assert (s["entries"], s["replaced"], s["evictions"]) == (1, 1, 1)
            assert s["bytes"] == _tag("prefix_cache") <= budget
            pool.release()
            break
    assert rejected_seen >= 2            # the insert's own allocations were made to fail


# -- one route: a request without a prefix runs no prefix code; page holders in one place ----
PREFIX_CODE = ("tinyloop/kv/handles.py", "tinyloop/kv/pool.py", "tinyloop/tlpx.py")


def _files_called(fn) -> set:
    """The tinyloop source files whose Python functions run while ``fn()`` runs."""
    import sys
    seen = set()

    def prof(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace(os.sep, "/")
            if "/tinyloop/" in path:
                seen.add("tinyloop/" + path.rsplit("/tinyloop/", 1)[1])
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_a_request_without_a_prefix_runs_no_prefix_code(plain):
    """generate / stream / logits / score without prefix= or prefix_pool= call no function of
    the handle, pool or prefix-file modules; with a prefix they do (the tracer sees them)."""
    prompt = _ids(40, seed=41)
    plain_calls = [lambda: plain.generate(prompt, 3), lambda: list(plain.stream(prompt, 3)),
                   lambda: plain.logits(prompt), lambda: plain.score(prompt)]
    for call in plain_calls:
        ran = _files_called(call)
        assert "tinyloop/generate.py" in ran and "tinyloop/model.py" in ran
        assert ran.isdisjoint(PREFIX_CODE), sorted(ran & set(PREFIX_CODE))
    with plain.prefill(prompt[:20]) as pc:
        assert "tinyloop/kv/handles.py" in _files_called(
            lambda: plain.generate(prompt, 3, prefix=pc))


def test_page_holders_are_counted_by_the_page_allocator(plain):
    """Pool entries that share a page each hold it once (``Page.holds``), the page is tagged
    prefix_cache while any holds it and kv_cache once only a request references it, and the
    model keeps no table of its own."""
    pages = plain.kv_pages
    a = _ids(2 * PAGE + 3, seed=51)
    b = np.concatenate([a[:2 * PAGE], _ids(5, seed=52)])
    c = np.concatenate([a[:2 * PAGE], _ids(7, seed=53)])
    b[2 * PAGE] = 3 if a[2 * PAGE] != 3 else 4           # the three part at position 2P
    c[2 * PAGE] = next(t for t in (5, 6, 7) if t not in (a[2 * PAGE], b[2 * PAGE]))
    pool = tinyloop.PrefixPool(plain)
    entries = []
    for n, prompt in enumerate((a, b, c), start=1):
        plain.logits(prompt, prefix_pool=pool)
        entries = [e for e in pool._entries.values()]
        assert len(entries) == n
        # the first two pages of every slot are the same Pages in every entry: n holders
        firsts = [[e.storage.kv.page_list(s)[:2] for s in range(e.storage.kv.n_slots)]
                  for e in entries]
        for s, shared in enumerate(firsts[0]):
            for page in shared:
                assert all(f[s][0] is shared[0] and f[s][1] is shared[1] for f in firsts)
                assert page.holds == n and page.refs == n
    n_slots = entries[0].storage.kv.n_slots
    # 2 shared pages per slot, and each entry's own last page
    assert pages.held_pages == n_slots * (2 + len(entries))
    assert pages.held_pages == pages.live_pages
    assert not hasattr(plain, "_prefix_holds")
    pool.release()
    assert pages.live_pages == pages.held_pages == 0

    with plain.prefill(a[:2 * PAGE]) as pc:
        held = pc.storage.kv.page_list(0)[0]
        s = plain.stream(a, 4, prefix=pc)
        next(s)                                        # the request shares pc's full pages
        assert (held.holds, held.refs) == (1, 2)
        page_bytes = _tag("prefix_cache")
        pc.release()                                   # the last holder goes mid-request
        assert (held.holds, held.refs) == (0, 1)
        assert _tag("prefix_cache") == 0 and _tag("kv_cache") >= held.block.nbytes
        assert page_bytes >= held.block.nbytes
        assert [t.token_id for t in s]                 # the request still reads the page
    assert pages.live_pages == 0 and _tag("kv_cache") == 0
