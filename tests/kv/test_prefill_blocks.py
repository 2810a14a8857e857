"""A position's logits depend only on the tokens up to it: not on where the request's prefill
began (fresh, after a PrefixCache / ResumeHandle, on a PrefixPool hit), nor on prefill_chunk.
Compared bit for bit (np.array_equal) on the NumPy backend, the oracle."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.backends.numpy_ops import NumpyOps
from tinyloop.quant import quantize

from ..conftest import TINY

T = 70                                       # prompt length: > 2 pages, > 4 chunks of 16
IDS = (np.arange(T) * 37 + 11) % TINY["vocab_size"]
CHUNKS = (0, 7, 16)
PREFIXES = (1, 5, 16, 20, 33, 32, T - 1, T)


def _every_way(m, depth: int) -> dict:
    """The logits of IDS at ``depth`` computed every way a request can start: name -> array."""
    out = {"fresh": m.logits(IDS, depth=depth)}
    with tinyloop.PrefixPool(m) as pool:
        m.logits(IDS[:20], depth=depth, prefix_pool=pool)
        out["pool partial hit (20)"] = m.logits(IDS, depth=depth, prefix_pool=pool)
        out["pool full hit"] = m.logits(IDS, depth=depth, prefix_pool=pool)
        assert pool.stats()["hits"] == 2
    for n in PREFIXES:
        with m.prefill(IDS[:n], depth=depth) as pc:
            out[f"prefix {n}"] = m.logits(IDS, prefix=pc)
    with m.resume_handle(IDS[:45], depth=1, max_depth=TINY["max_depth"]) as rh:
        if depth > 1:
            rh.upgrade(depth)
        out["resume handle (45)"] = m.logits(IDS, prefix=rh)
    return out


@pytest.mark.parametrize("kv_mode", ["fp16", "int8", "h_int8"])
@pytest.mark.parametrize("which", ["tiny_model_path", "tiny_adapter_path"])
def test_logits_do_not_depend_on_where_the_prefill_started(request, which, kv_mode):
    path = request.getfixturevalue(which)
    ref = None
    for chunk in CHUNKS:
        m = tinyloop.load_model(path, max_seq_len=96, prefill_chunk=chunk, backend="numpy",
                                kv_mode=kv_mode)
        try:
            got = _every_way(m, depth=3)
        finally:
            tinyloop.free_model(m)
        if ref is None:
            ref = got["fresh"]
            assert np.isfinite(ref).all()
        for name, logits in got.items():
            diff = float(np.abs(logits - ref).max())
            assert np.array_equal(logits, ref), (chunk, name, diff)


def test_the_issue_case_a_full_pool_hit_repeats_its_first_serving(tiny_model_path):
    """prefill_chunk=16: a prompt first served on a partial pool hit, then fully cached."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=96, prefill_chunk=16, backend="numpy")
    try:
        with tinyloop.PrefixPool(m) as pool:
            m.logits(IDS[:20], prefix_pool=pool)
            first = m.logits(IDS[:40], prefix_pool=pool)
            repeat = m.logits(IDS[:40], prefix_pool=pool)
        assert np.array_equal(first, repeat)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("chunk, m0", [(16, 20), (16, 32), (7, 3), (0, 20)])
def test_prefill_chunks_and_head_blocks_sit_at_absolute_multiples(tiny_model_path, chunk, m0):
    """After a prefix of m0 positions the forward runs positions m0..T-1 in the pieces of
    the absolute row blocks [k R, (k+1) R) they fall in (R: the scratch rows), and the head of
    logits() runs over blocks at absolute multiples of its block rows."""
    max_seq_len = 96
    m = tinyloop.load_model(tiny_model_path, max_seq_len=max_seq_len, prefill_chunk=chunk,
                            backend="numpy")
    try:
        r = chunk or max_seq_len
        rows = min(128, r, T)
        chunks, heads = [], []
        real_chunk, real_head = m._forward_chunk, m.head
        m._forward_chunk = lambda ids, pos0, t, *a, **k: (chunks.append((pos0, t)),
                                                          real_chunk(ids, pos0, t, *a, **k))
        m.head = lambda pos0, t, out: (heads.append((pos0, t)), real_head(pos0, t, out))
        with m.prefill(IDS[:m0]) as pc:
            chunks.clear()
            m.logits(IDS, prefix=pc)
        want = [(max(m0, k), min(T, k + r) - max(m0, k)) for k in range(0, T, r)
                if k + r > m0]
        assert chunks == want
        assert heads == [(k, min(rows, T - k)) for k in range(0, T, rows)]
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("d_in, d_out", [(64, 64), (64, 128), (128, 64), (64, 300),
                                         (32, 64), (256, 1536)])
def test_numpy_linear_rows_do_not_depend_on_how_many_rows_share_the_call(d_in, d_out):
    """Each row of ``linear`` over any slice of rows, and over the rows in another order,
    equals that row of the whole product (a GEMM rounds a row by the row count and the
    row's offset in its tiles: OpenBLAS's Zen kernels differ for nearly every one)."""
    rng = np.random.default_rng(d_in * 1000 + d_out)
    w = quantize(rng.standard_normal((d_out, d_in)).astype(np.float32), 4, 32)
    ops = NumpyOps()
    x = rng.standard_normal((80, d_in)).astype(np.float32)
    whole = np.empty((80, d_out), np.float32)
    ops.linear(x, w, whole)
    for a in (0, 3, 17):
        for n in (1, 2, 3, 5, 9, 16, 18, 31, 40):
            part = np.empty((n, d_out), np.float32)
            ops.linear(x[a:a + n], w, part)
            assert np.array_equal(part, whole[a:a + n]), (a, n)
    perm = rng.permutation(80)
    shuffled = np.empty((80, d_out), np.float32)
    ops.linear(x[perm], w, shuffled)
    assert np.array_equal(shuffled, whole[perm])
