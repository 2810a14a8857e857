"""Requests on the CUDA backend: prefill row blocks at absolute positions give bit-identical
logits for a full PrefixPool hit and for prefixes ending on a chunk boundary; stream and
generate agree (the captured decode step included); free_model releases a suspended stream's
KV cache (bound to a captured graph); an out-of-memory part-way keeps the tokens so far."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.memory import get_pool

pytestmark = pytest.mark.gpu

SMALL = dict(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=320,
             n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4, rope_theta=10000.0)
CHUNK = 64


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("models") / "small.tlm"
    write_synthetic(p, synthetic_config(**SMALL), seed=5)
    return str(p)


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, SMALL["vocab_size"], n).astype(np.int32)


def test_full_pool_hit_and_chunk_aligned_prefixes_are_bit_identical(path):
    m = tinyloop.load_model(path, max_seq_len=512, prefill_chunk=CHUNK, backend="cuda")
    try:
        ids = _ids(300)
        fresh = m.logits(ids, depth=2)
        with tinyloop.PrefixPool(m) as pool:
            m.logits(ids[:100], depth=2, prefix_pool=pool)
            first = m.logits(ids, depth=2, prefix_pool=pool)          # partial hit at 100
            repeat = m.logits(ids, depth=2, prefix_pool=pool)         # full hit
        assert np.array_equal(first, repeat)
        for n in (CHUNK, 2 * CHUNK, 4 * CHUNK):
            with m.prefill(ids[:n], depth=2) as pc:
                assert np.array_equal(m.logits(ids, prefix=pc), fresh), n
    finally:
        tinyloop.free_model(m)


def test_stream_equals_generate_with_a_stop_string(path):
    m = tinyloop.load_model(path, max_seq_len=256, backend="cuda")
    try:
        prompt = _ids(20, 1)
        full = m.generate(prompt, max_new_tokens=40, depth=2)
        texts = [m.tokenizer.decode([t]) for t in full.token_ids]
        k = next(i for i in range(5, len(texts)) if texts[i].strip())
        stop = [texts[k]]
        res = m.generate(prompt, max_new_tokens=40, depth=2, stop=stop)
        s = m.stream(prompt, max_new_tokens=40, depth=2, stop=stop)
        pieces = list(s)
        assert [p.token_id for p in pieces] == res.token_ids
        assert "".join(p.text for p in pieces) == res.text
        assert s.finish_reason == res.finish_reason
    finally:
        tinyloop.free_model(m)


def test_free_model_releases_a_suspended_streams_cache(path):
    pool = get_pool("cuda")
    before = pool.stats().allocated_bytes
    m = tinyloop.load_model(path, max_seq_len=256, backend="cuda")
    s = m.stream(_ids(20, 2), max_new_tokens=100, depth=2)
    for _ in range(5):                                 # past the first captured step
        next(s)
    tinyloop.free_model(m)
    assert pool.stats().allocated_bytes == before
    with pytest.raises(errors.ModelFreedError) as ei:
        next(s)
    assert len(ei.value.partial.token_ids) >= 5


def test_out_of_memory_part_way_keeps_the_tokens(path, monkeypatch):
    from ..conftest import fail_nth_allocation
    m = tinyloop.load_model(path, max_seq_len=256, backend="cuda")
    try:
        prompt = _ids(20, 3)
        full = m.generate(prompt, max_new_tokens=30, depth=2)
        own = m.pool.stats().allocated_bytes - tinyloop.vram_usage_bytes(m)
        # the block tables, then the first pages: the pages after them fail (the first
        # decode step of a captured graph takes its whole capacity, the eager one the next)
        n_slots = m.config.n_slots(2)
        fail_nth_allocation(monkeypatch, m.pool, "kv_cache", 1 + n_slots + 1)
        with pytest.raises(errors.OutOfMemoryError) as ei:
            m.generate(prompt, max_new_tokens=30, depth=2)
        monkeypatch.undo()
        e = ei.value
        assert e.step >= 1 and e.position == len(prompt) - 1 + e.step
        assert e.partial.token_ids == full.token_ids[:e.step]
        assert m.pool.stats().allocated_bytes - tinyloop.vram_usage_bytes(m) == own
    finally:
        tinyloop.free_model(m)
