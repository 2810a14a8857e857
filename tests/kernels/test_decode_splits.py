"""CPU checks of the split-K decode attention's host rule and index math (cuda_src/
attention_decode.cu): the split count from the length bucket, and a NumPy emulation of the
kernel's page partition, per-split online-softmax partials and combine against a dense softmax."""

import numpy as np
import pytest

from tinyloop.backends.cuda.attention import (DS_BATCH_BLOCKS_PER_SM, DS_MAX_SPLITS,
                                              DS_MIN_KEYS, DS_ROW_BLOCKS_PER_SM,
                                              DS_SINGLE_PASS_MAX, decode_splits)
from tinyloop.backends.cuda.compile import GEOMETRY

DS_THREADS = GEOMETRY["attention_decode"]["DS_THREADS"]


def emulate(q, k, v, ctx, page, nsplit, min_pps=1, window=0):
    """The kernel's arithmetic in float64 (ds_split_range): the keys lo..ctx-1 (lo =
    max(0, ctx - window) for window > 0, else 0) lie in the pages from pg0 = lo // page on,
    npages = ceil(ctx / page) - pg0 of them; split s owns pages [pg0 + s*pps, pg0 + (s+1)*pps),
    pps = max(ceil(npages / nsplit), min_pps), i.e. keys max(lo, ...)..; splits from
    n_used = ceil(npages / pps) on are empty; partials (m, l, o) in log2 units; combine by
    the max."""
    lo = max(0, ctx - window) if window > 0 else 0
    pg0 = lo // page
    npages = -(-ctx // page) - pg0
    pps = max(-(-npages // nsplit), min_pps)
    n_used = -(-npages // pps)
    parts, covered = [], []
    for s in range(nsplit):
        k0, k1 = max(lo, (pg0 + s * pps) * page), min(ctx, (pg0 + (s + 1) * pps) * page)
        assert (k0 < k1) == (s < n_used), (s, n_used)
        if k0 >= k1:
            parts.append((-np.inf, 0.0, np.zeros(q.shape[0])))
            continue
        assert k0 // page >= pg0                 # no split holds a page before the window
        covered.extend(range(k0, k1))
        sc = k[k0:k1] @ q
        m = sc.max()
        p = np.exp2(sc - m)
        parts.append((m, p.sum(), p @ v[k0:k1]))
    assert covered == list(range(lo, ctx))      # every key of the window once, in order
    mx = max(p[0] for p in parts)
    assert np.isfinite(mx)
    w = [np.exp2(p[0] - mx) for p in parts]
    return sum(wi * p[2] for wi, p in zip(w, parts)) / sum(wi * p[1] for wi, p in zip(w, parts))


@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize("nsplit", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("chunk_floor", [False, True])
def test_split_partition_and_combine_equal_a_dense_softmax(page, nsplit, chunk_floor):
    # chunk_floor: the split kernel's min_pps = ceil(DS_THREADS / page) (attn_split_step)
    rng = np.random.default_rng(page * 100 + nsplit)
    hd = 64
    for ctx in sorted({1, page - 1, page, page + 1, 2047, 4096} - {0}):
        q = rng.standard_normal(hd)
        k = rng.standard_normal((ctx, hd)) * 2
        v = rng.standard_normal((ctx, hd))
        sc = k @ q
        p = np.exp2(sc - sc.max())
        want = p @ v / p.sum()
        min_pps = -(-DS_THREADS // page) if chunk_floor else 1
        np.testing.assert_allclose(emulate(q, k, v, ctx, page, nsplit, min_pps), want,
                                   rtol=1e-10,
                                   atol=1e-12)


@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize("nsplit", [1, 3, 16, 64])
@pytest.mark.parametrize("window", [1, 5, 64, 200, 10**6])
def test_split_partition_of_a_sliding_window(page, nsplit, window):
    """With a window only its pages are dealt out (the first split starting at its first key,
    inside a page) and the partials combine to a dense softmax over keys ctx-window..ctx-1,
    written here from the definition; empty splits (more splits than window pages) weigh 0."""
    rng = np.random.default_rng(page * 1000 + nsplit * 10 + window % 7)
    hd = 32
    min_pps = -(-DS_THREADS // page)
    for ctx in (1, page, page + 1, 300, 2049):
        q = rng.standard_normal(hd)
        k = rng.standard_normal((ctx, hd)) * 2
        v = rng.standard_normal((ctx, hd))
        sc = np.where(np.arange(ctx) > ctx - 1 - window, k @ q, -np.inf)
        p = np.exp2(sc - sc.max())
        want = p @ v / p.sum()
        for floor in (1, min_pps):
            np.testing.assert_allclose(emulate(q, k, v, ctx, page, nsplit, floor, window),
                                       want, rtol=1e-10, atol=1e-12)


def test_split_count_rule():
    # 9 heads on 132 SMs (SmolLM2 on an H200): bucket / DS_MIN_KEYS, capped near 8 blocks / SM
    # for one query row (so every split is one chunk of keys up to 8,192 keys), near 2 for a
    # batch's rows x heads
    assert (DS_ROW_BLOCKS_PER_SM, DS_BATCH_BLOCKS_PER_SM) == (8, 2)
    assert decode_splits(DS_SINGLE_PASS_MAX + 1, 9, 132) == 2
    assert decode_splits(2048, 9, 132) == 2048 // DS_MIN_KEYS
    assert decode_splits(2110, 9, 132) == 4096 // DS_MIN_KEYS
    assert decode_splits(8000, 9, 132) == 8192 // DS_MIN_KEYS == DS_MAX_SPLITS
    assert decode_splits(8000, 9, 132, DS_BATCH_BLOCKS_PER_SM) == -(-264 // 9)
    assert decode_splits(2110, 9, 132, DS_BATCH_BLOCKS_PER_SM) == min(4096 // DS_MIN_KEYS,
                                                                      -(-264 // 9))
    assert decode_splits(8000, 4 * 9, 132, DS_BATCH_BLOCKS_PER_SM) == -(-264 // 36)
    assert decode_splits(1 << 20, 1, 10_000) == DS_MAX_SPLITS
    # a function of the bucket: every length of one bucket gets the same count
    assert len({decode_splits(c, 9, 132) for c in range(1025, 2049)}) == 1


def test_short_contexts_fall_back_to_the_single_pass_kernel():
    """0 = the single-pass kernel: every context up to the measured crossover (split-K was
    0.8x at 128 keys), and any case the rule would give one split (the single pass plus a
    combine launch); split-K from the next bucket on, for any head count that leaves room."""
    assert DS_SINGLE_PASS_MAX == 128
    for ctx in (1, 2, 31, 32, 33, 127, 128):
        assert decode_splits(ctx, 9, 132) == 0, ctx
    for ctx in (129, 200, 256, 257, 512, 4096):
        assert decode_splits(ctx, 9, 132) >= 2, ctx
    # one split by the SM cap (heads >= 8 x SMs) is the single pass too
    assert decode_splits(4096, 1100, 132) == 0
    assert decode_splits(4096, 400, 132, DS_BATCH_BLOCKS_PER_SM) == 0
    # slow reference of the rule, independent of the implementation's bucket arithmetic
    for ctx in range(1, 5000, 7):
        bucket = DS_MIN_KEYS
        while bucket < ctx:
            bucket *= 2
        for per_sm in (DS_ROW_BLOCKS_PER_SM, DS_BATCH_BLOCKS_PER_SM):
            ns = min(DS_MAX_SPLITS, bucket // DS_MIN_KEYS, -(-per_sm * 132 // 9))
            want = 0 if ctx <= DS_SINGLE_PASS_MAX or ns <= 1 else ns
            assert decode_splits(ctx, 9, 132, per_sm) == want, (ctx, per_sm)


def test_the_batch_scratch_bound_covers_every_batch_and_context():
    """Engine.start reserves batch_split_bound's scratch once: every batch of 1..rows rows at
    every context length takes no more tickets and partials than it covers (the split count
    of the batch kernel is max(1, decode_splits(..., DS_BATCH_BLOCKS_PER_SM)) over
    B * n_heads blocks)."""
    from tinyloop.backends.cuda.attention import batch_split_bound, decode_splits
    for sms in (1, 78, 132):
        for n_heads in (1, 9, 16, 48):
            for rows in (1, 3, 32, 64):
                units_max, partials = batch_split_bound(rows, n_heads, sms)
                assert units_max == rows * n_heads
                for b in range(1, rows + 1):
                    for ctx in (1, 63, 64, 257, 1024, 4097, 8000, 1 << 17):
                        units = b * n_heads
                        ns = max(1, decode_splits(ctx, units, sms, DS_BATCH_BLOCKS_PER_SM))
                        assert units * ns <= partials, (sms, n_heads, rows, b, ctx)
