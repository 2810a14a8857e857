"""The decode batch's KV ops on the NumPy reference: ``Ops.kv_write_batch`` /
``Ops.kv_attention_batch`` over B requests' own slots at their own positions equal the per-row
``kv_write`` / ``kv_attention`` calls bit for bit (Q, every page byte, the attention rows), and
``kv.cache.batch_index`` holds each step's positions and every request's block-table address,
in a model-owned buffer that free_model returns."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.backends.numpy_ops import NumpyOps
from tinyloop.config import ModelConfig
from tinyloop.errors import ConfigError
from tinyloop.kv import PageAllocator, RuntimeKVCache
from tinyloop.kv.cache import BatchSlot, batch_index
from tinyloop.memory import MemoryPool, get_pool

P = 16                                   # positions per page: the cases cross page boundaries


def _caches(ops, pool, cfg, mode, lengths):
    """One single-slot cache per request, with pages for its prefix and the position after."""
    alloc = PageAllocator(ops, pool)
    out = []
    for n in lengths:
        c = RuntimeKVCache(ops, pool, cfg, 1, n + 1, (mode,), alloc, P)
        c.ensure(n + 1)
        out.append(c)
    return out


def _fill(ops, caches, prefixes, cfg, theta):
    """Write each request's prefix rows (positions 0..n-1) with the per-row op."""
    for c, rows in zip(caches, prefixes):
        if len(rows):
            ops.kv_write(rows.copy(), None, 0, theta, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, c.slot(0))


def _pages(c) -> list:
    return [{k: v.copy() for k, v in pg.parts.items()} for pg in c.page_list(0)]


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", [(9, 3, 64), (4, 4, 32), (6, 2, 16)])
@pytest.mark.parametrize("positions", [[0], [5, 0, 16], [15, 16, 17, 31, 32, 0, 47]])
@pytest.mark.parametrize("window", [0, 5])
def test_batch_ops_equal_the_per_row_calls(rng, mode, h, hkv, hd, positions, window):
    ops, theta = NumpyOps(), 10000.0
    cfg = ModelConfig(vocab_size=8, d_model=64, n_heads=h, n_kv_heads=hkv, head_dim=hd,
                      ffn_dim=8, n_prelude=1, n_recurrent=0, n_coda=0)
    width = (h + 2 * hkv) * hd
    prefixes = [rng.standard_normal((p, width)).astype(np.float32) for p in positions]
    pool = MemoryPool("host")
    batch = _caches(ops, pool, cfg, mode, positions)
    alone = _caches(ops, pool, cfg, mode, positions)
    try:
        _fill(ops, batch, prefixes, cfg, theta)
        _fill(ops, alone, prefixes, cfg, theta)
        qkv = rng.standard_normal((len(positions), width)).astype(np.float32)
        index = batch_index(batch, positions, 1)
        rows = BatchSlot([c.slot(0) for c in batch], positions, index[0], index[1])
        got_q = qkv.copy()
        ops.kv_write_batch(got_q, None, rows, theta, h, hkv, hd)
        got = np.full((len(positions), h * hd), np.nan, np.float32)
        ops.kv_attention_batch(got_q, rows, h, hkv, hd, got, window=window)

        want_q = qkv.copy()
        want = np.full_like(got, np.nan)
        for i, (c, p) in enumerate(zip(alone, positions)):
            ops.kv_write(want_q[i:i + 1], None, p, theta, h, hkv, hd, c.slot(0))
            ops.kv_attention(want_q[i:i + 1], c.slot(0), p, h, hkv, hd, want[i:i + 1],
                             window=window)
        np.testing.assert_array_equal(got_q, want_q)
        moved = [i for i, p in enumerate(positions) if p > 0]   # RoPE at 0 is the identity
        assert all(not np.array_equal(got_q[i], qkv[i]) for i in moved)
        for i, (a, b) in enumerate(zip(batch, alone)):
            for pa, pb in zip(_pages(a), _pages(b)):
                for name in pa:
                    np.testing.assert_array_equal(pa[name], pb[name], err_msg=f"{i} {name}")
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got).all()
    finally:
        for c in batch + alone:
            c.release()


def test_a_batch_row_reads_its_own_request_not_a_neighbours(rng):
    """Two requests at one position with different prefixes: each row's attention is its own
    request's (the rows differ, and swapping the slots swaps the rows)."""
    ops = NumpyOps()
    cfg = ModelConfig(vocab_size=8, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_dim=8, n_prelude=1, n_recurrent=0, n_coda=0)
    width = (4 + 4) * 16
    pool = MemoryPool("host")
    caches = _caches(ops, pool, cfg, "fp16", [20, 20])
    try:
        _fill(ops, caches, [rng.standard_normal((20, width)).astype(np.float32)
                            for _ in range(2)], cfg, 1e4)
        q = np.repeat(rng.standard_normal((1, width)).astype(np.float32), 2, axis=0)
        outs = []
        for order in ([0, 1], [1, 0]):
            rows = BatchSlot([caches[i].slot(0) for i in order], [19, 19])
            out = np.empty((2, 64), np.float32)
            ops.kv_attention_batch(q.copy(), rows, 4, 2, 16, out)   # one query, two caches
            outs.append(out)
        assert not np.array_equal(outs[0][0], outs[0][1])
        np.testing.assert_array_equal(outs[0][::-1], outs[1])
    finally:
        for c in caches:
            c.release()


def test_batch_ops_refuse_a_qkv_of_another_row_count(rng):
    ops = NumpyOps()
    cfg = ModelConfig(vocab_size=8, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_dim=8, n_prelude=1, n_recurrent=0, n_coda=0)
    pool = MemoryPool("host")
    caches = _caches(ops, pool, cfg, "fp16", [3, 4])
    try:
        rows = BatchSlot([c.slot(0) for c in caches], [3, 4])
        before = [_pages(c) for c in caches]
        qkv = np.zeros((3, 128), np.float32)
        with pytest.raises(ConfigError, match="2 slots and 2 positions needs qkv of as many "
                                              "rows, got 3"):
            ops.kv_write_batch(qkv, None, rows, 1e4, 4, 2, 16)
        with pytest.raises(ConfigError, match="got 3"):
            ops.kv_attention_batch(qkv, rows, 4, 2, 16, np.zeros((3, 64), np.float32))
        with pytest.raises(ConfigError, match="out has 1 rows, the batch 2"):
            ops.kv_attention_batch(qkv[:2], rows, 4, 2, 16, np.zeros((1, 64), np.float32))
        for c, pages in zip(caches, before):            # nothing was written
            for pa, pb in zip(_pages(c), pages):
                for name in pa:
                    np.testing.assert_array_equal(pa[name], pb[name])
    finally:
        for c in caches:
            c.release()


def test_batch_index_holds_positions_and_every_slots_table_address(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    caches = [m.new_kv_cache(3, 40), m.new_kv_cache(3, 40, kv_iterations="latest"),
              m.new_kv_cache(3, 40, kv_mode="int8")]
    try:
        positions = [0, 32, 17]
        for c, p in zip(caches, positions):
            c.ensure(p + 1)
        n_slots = m.config.n_slots(3)
        index = batch_index(caches, positions, n_slots)
        assert index.dtype == np.int64 and index.shape == (1 + n_slots, 3)
        assert index[0].tolist() == positions
        for s in range(n_slots):
            assert index[1 + s].tolist() == [c.kv_of(s).table.ctypes.data for c in caches]
        # "latest": the recurrent iterations share one slot's table
        r0 = m.config.n_prelude
        assert index[1 + r0, 1] == index[1 + r0 + m.config.n_recurrent, 1]
        assert index[1 + r0, 0] != index[1 + r0 + m.config.n_recurrent, 0]
        with pytest.raises(ConfigError, match="request 2 has pages for positions 0..31, "
                                              "not 32"):
            batch_index(caches, [0, 32, 32], n_slots)
        with pytest.raises(ConfigError, match="request 0's cache has"):
            batch_index(caches, positions, n_slots - 1)
    finally:
        for c in caches:
            c.release()
        tinyloop.free_model(m)


def test_the_batch_index_is_planned_at_load_and_a_batch_step_allocates_nothing(
        tiny_model_path):
    """The index buffer is a BufferPool entry of the load plan (tag buffers, sized for the
    scratch rows at max_depth), so a decode batch leaves the pool as it found it (the Engine's
    baseline holds) and free_model gives every tag back."""
    pool = get_pool("host")
    start = dict(pool.by_tag())
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    caches = [m.new_kv_cache(2, 16) for _ in range(3)]
    try:
        (entry,) = [e for e in m.plan if e.name == "batch_index"]
        assert (entry.tag, entry.phase, entry.lazy, entry.dtype) == ("buffers", 4, False,
                                                                     "int64")
        assert entry.shape == (m.chunk_rows * (1 + m.config.n_slots(m.config.max_depth)),)
        for c, n in zip(caches, (1, 4, 9)):
            m.forward(np.arange(1, n + 1, dtype=np.int32), 0, 2, c)
            c.ensure(16)                         # every page the steps below reach
        before = dict(pool.by_tag())
        m.decode_batch(caches, [3, 4, 5], [1, 4, 9], 2)
        m.decode_batch(caches, [3, 4, 5], [2, 5, 10], 2)
        assert dict(pool.by_tag()) == before
    finally:
        for c in caches:
            c.release()
        tinyloop.free_model(m)
    assert dict(pool.by_tag()) == start


def test_init_state_rows_equals_each_rows_init_state():
    """The seeded recurrent state of a decode batch (state_init="normal"): row i is
    init_state at positions[i], one copy for every row; a row count mismatch is refused."""
    ops = NumpyOps()
    positions = [0, 7, 31, 32, 1000]
    got = np.full((5, 24), np.nan, np.float32)
    ops.init_state_rows(got, positions, 0.5, 1234)
    want = np.empty_like(got)
    for i, p in enumerate(positions):
        ops.init_state(want[i:i + 1], p, 0.5, 1234)
    np.testing.assert_array_equal(got, want)
    assert len({got[i].tobytes() for i in range(5)}) == 5
    with pytest.raises(ConfigError, match="4 positions for 5 rows"):
        ops.init_state_rows(got, positions[:4], 0.5, 1234)
