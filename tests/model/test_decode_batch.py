"""Model.decode_batch: one decode step of B requests, each over its own KV cache at its own
position, gives each request's solo decode step (forward of one id, then the head) on the
NumPy backend, bit for bit, and writes each row's K/V into its own request's pages."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.errors import ConfigError, TokenizerError

from ..conftest import TINY

# a Huginn-like stack: sandwich norms, seeded state (read per position), Q/K/V bias, scaled
# embedding, a sliding-window layer, the injection adapter
ARCH = dict(injection="adapter", state_init="normal", state_std=0.5, layer_norms="sandwich",
            qkv_bias=True, embed_scale=2.0, sliding_window=5, sliding_layers=(1,))


@pytest.fixture(scope="module")
def arch_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "arch.tlm"
    write_synthetic(path, synthetic_config(**TINY, **ARCH), seed=5)
    return str(path)


def _prefilled(model, prompt, depth, kv_mode, capacity):
    cache = model.new_kv_cache(depth, capacity, kv_mode=kv_mode)
    model.forward(np.asarray(prompt, np.int32), 0, depth, cache)
    return cache


def _solo_step(model, cache, token, pos, depth):
    """A request's decode step alone: the forward of one id at ``pos``, then the head."""
    out = np.empty((1, model.config.vocab_size), np.float32)
    model.forward(np.array([token], np.int32), pos, depth, cache)
    model.head(pos, 1, out)
    return out[0]


def _check_batch_equals_solo(model, depth, kv_mode, lengths, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, n) for n in lengths]
    cap = max(lengths) + steps
    batch = [_prefilled(model, p, depth, kv_mode, cap) for p in prompts]
    solo = [_prefilled(model, p, depth, kv_mode, cap) for p in prompts]
    try:
        pos = list(lengths)
        tokens = [int(p[-1]) for p in prompts]
        for _ in range(steps):
            got = model.decode_batch(batch, tokens, pos, depth)
            assert got.shape == (len(lengths), vocab) and got.dtype == np.float32
            want = np.stack([_solo_step(model, c, t, p, depth)
                             for c, t, p in zip(solo, tokens, pos)])
            np.testing.assert_array_equal(got, want)
            # the next step reads the K/V this one wrote: each row's went to its own pages
            tokens = [int(np.argmax(r)) for r in want]
            pos = [p + 1 for p in pos]
    finally:
        for c in batch + solo:
            c.release()


@pytest.mark.parametrize("kv_mode", ["fp16", "int8", "h_int8"])
def test_decode_batch_equals_each_requests_solo_step(tiny_model_path, kv_mode):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, backend="numpy")
    try:
        # lengths across page boundaries (pages of 32) and one request twice as long
        _check_batch_equals_solo(m, 2, kv_mode, [3, 31, 32, 33, 70])
    finally:
        tinyloop.free_model(m)


def test_decode_batch_every_arch_fact_and_adapter(arch_path, tiny_adapter_path):
    for path in (arch_path, tiny_adapter_path):
        m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
        try:
            _check_batch_equals_solo(m, 3, None, [1, 7, 12, 40], seed=1)
        finally:
            tinyloop.free_model(m)


def test_decode_batch_of_more_rows_than_the_numpy_padding(tiny_model_path):
    # 40 rows: the head's product (vocab 300) runs unpadded, the solo step's padded
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        _check_batch_equals_solo(m, 2, None, list(range(1, 41)), steps=1, seed=3)
    finally:
        tinyloop.free_model(m)


def test_decode_batch_larger_than_the_scratch_rows_runs_in_sub_batches(tiny_model_path):
    # prefill_chunk=4: the scratch holds 4 rows, so 7 requests run as 4 + 3
    m = tinyloop.load_model(tiny_model_path, max_seq_len=48, prefill_chunk=4, backend="numpy")
    try:
        _check_batch_equals_solo(m, 1, None, [2, 5, 9, 4, 11, 6, 3], seed=2)
    finally:
        tinyloop.free_model(m)


def test_decode_batch_sampling_returns_each_rows_id(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    caches = [_prefilled(m, [5, 6, 7][:n], 2, None, 8) for n in (1, 2, 3)]
    try:
        ref = [_prefilled(m, [5, 6, 7][:n], 2, None, 8) for n in (1, 2, 3)]
        want = [_solo_step(m, c, 9, n, 2) for c, n in zip(ref, (1, 2, 3))]
        for c in ref:
            c.release()
        params = [(0.0, 0, 1.0, 0.0), (0.8, 5, 0.9, 0.3), (1.0, 0, 1.0, 0.7)]
        got = m.decode_batch(caches, [9, 9, 9], [1, 2, 3], sampling=params)
        expect = [tinyloop.backends.numpy_ops.sample_from_logits(w, *p)
                  for w, p in zip(want, params)]
        assert got == expect
    finally:
        for c in caches:
            c.release()
        tinyloop.free_model(m)


def test_decode_batch_refuses_bad_batches_by_name(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    a = m.new_kv_cache(2, 8)
    b = m.new_kv_cache(3, 8)
    c = m.new_kv_cache(2, 8, kv_mode="int8")
    before = m.pool.allocated_bytes
    try:
        with pytest.raises(ConfigError, match="depth 3"):
            m.decode_batch([a, b], [1, 2], [0, 0])
        with pytest.raises(ConfigError, match="kv_mode 'int8'"):
            m.decode_batch([a, c], [1, 2], [0, 0])
        with pytest.raises(ConfigError, match="appears twice"):
            m.decode_batch([a, a], [1, 2], [0, 0])
        with pytest.raises(ConfigError, match=r"positions\[0\]=8"):
            m.decode_batch([a], [1], [8])
        with pytest.raises(ConfigError, match="one entry per request"):
            m.decode_batch([a], [1, 2], [0])
        with pytest.raises(ConfigError, match="empty"):
            m.decode_batch([], [], [])
        with pytest.raises(TokenizerError, match=r"tokens\[1\]=300"):
            m.decode_batch([a, c], [1, 300], [0, 0])
        assert m.pool.allocated_bytes == before        # nothing gained, nothing left
    finally:
        for x in (a, b, c):
            x.release()
        tinyloop.free_model(m)
