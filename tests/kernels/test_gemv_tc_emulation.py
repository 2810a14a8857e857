"""CPU check of gemv_tc_*'s fragment arithmetic (kernels/gemv_mma.cu, the T = 1 tensor-core
GEMV), which this machine cannot run: a NumPy emulation of the kernel as written (x staged as
the FP16 pairs (x_j, x_j+4) of each 8-value unit with each chunk's sum; each lane's code words
of chunks c0 + t4 and c0 + 4 + t4 of rows g and g + 8; tc_word's LOP3 / sub.f16x2 / fma.f16x2
placement of nibbles into FP16; x entering B only at column g for lanes with g % 4 == t4;
mma.sync m16n8k16 assembled by the PTX ISA's fragment layout; s * D + z * sum(x) per chunk
column, the scales and zeros as tc_pair loads them; a grid's blocks each dealing its tiles'
(tile, gate / up, step) items to warps in rounds, one 16-row partial per item at the kernel's
offsets, each row's steps summed in order) against x @ W.T from the dequantized weights
(tinyloop.quant.dequantize), in float64. A wrong pair, a wrong fragment, a wrong column of B
or a wrong item deal fails it (the planted faults below).
tests/kernels/test_gemv_tc_gpu.py checks the kernel itself."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.quant import dequantize, quantize

from .test_gemv_mma_emulation import byte_perm, halves, hsub2, mma16816, pack


def hfma2(a, b, c):
    """fma.rn.f16x2 (exact here: small integers and powers of two)."""
    al, ah = halves(a)
    bl, bh = halves(b)
    cl, ch = halves(c)
    return pack(al * bl + cl, ah * bh + ch)


def tc_word(w):
    """tc_word for uint32 words w [32]: the 4 FP16 pairs (q_j, q_j+4)."""
    M0, M1, B = 0x000F000F, 0x00F000F0, 0x64006400
    h = w >> 8
    return [hsub2((w & M0) | B, B), hfma2((w & M1) | B, 0x2C002C00, 0xD400D400),
            hsub2((h & M0) | B, B), hfma2((h & M1) | B, 0x2C002C00, 0xD400D400)]


def stage_x(x):
    """tc_stage: (xp uint32 [cpad * 4, 4], sx [cpad]) from x f16 [K]."""
    k = x.size
    cpad = -(-(k // 32) // 8) * 8
    xh = np.zeros(cpad * 32, np.float16)
    xh[:k] = x
    words = xh.view(np.uint16).astype(np.uint32).reshape(-1, 4, 2)
    X = words[:, :, 0] | (words[:, :, 1] << 16)                 # [units, 4]
    xp = np.stack([byte_perm(X[:, 0], X[:, 2], 0x5410), byte_perm(X[:, 0], X[:, 2], 0x7632),
                   byte_perm(X[:, 1], X[:, 3], 0x5410), byte_perm(X[:, 1], X[:, 3], 0x7632)], 1)
    sx = xh.astype(np.float64).reshape(cpad, 32).sum(1)
    return xp, sx


def tc_pair(arr, row, c, chunks, lg, even):
    """tc_pair: the (chunk c, chunk c + 1) values of a scale or zero row, as the kernel loads
    them (g = 32: a 4-byte pair when the group count is even, else two halves; g >= 64: chunk
    c's group twice); 0 past the row's chunks."""
    if c >= chunks:
        return 0.0, 0.0
    if lg > 5:
        v = arr[row, (c * 32) >> lg]
        return v, v
    if even and c + 1 < chunks:
        return arr[row, c], arr[row, c + 1]
    return arr[row, c], (arr[row, c + 1] if c + 1 < chunks else 0.0)


def emulate(w, x, two=False, b_cols=None, blocks=None, items_per_round=3, warps=8, deal=None):
    """gemv_tc_body on a grid of ``blocks`` (default: one per tile): the raw products [N]
    (SwiGLU: gate and up [2, F]). Each block's tiles, its items dealt to ``warps`` warps in
    rounds of ``items_per_round``, each item's partials written to the block's ``red`` at the
    kernel's offsets (a slot never written stays NaN) and each output's steps summed as the
    kernel reads them back. Planted faults: ``b_cols``, (diag, lo mask) per lane from
    (g, t4); ``deal``, item i -> (tile of the block, gate / up, step) from (i, per_tile,
    steps, nt)."""
    n_all, k = w.shape
    nt = 2 if two else 1
    n = n_all // nt
    f = n if two else 0
    lg = int(np.log2(w.group_size))
    q = w.qweight.view(np.uint8)
    sc, zr = w.scales.astype(np.float64), w.zeros.astype(np.float64)
    xp, sx = stage_x(x)
    lane = np.arange(32)
    g, t4 = lane // 4, lane % 4
    diag = (g & 3) == t4
    lo = np.where(g < 4, 0xFFFFFFFF, 0).astype(np.uint32)
    if b_cols is not None:
        diag, lo = b_cols(g, t4)
    chunks = k // 32
    ngroups = sc.shape[1]
    last = q.shape[1] - 1
    steps = -(-chunks // 8)

    def item(tile, t, s):
        """One item's row sums [2, 8]: rows g and g + 8 of the tile, step s, gate / up t."""
        c0 = 8 * s
        xv = np.where(diag[:, None, None], xp[(c0 + g)[:, None] * 4 + np.arange(4)], 0)
        xv = xv.astype(np.uint32)                                # [32 lanes, 4 units, 4 pairs]
        rows = [np.minimum(16 * tile + g + 8 * h, n - 1) + t * f for h in range(2)]
        d = np.zeros((32, 4))
        for i in range(4):
            p = {}
            for h in range(2):
                for u in range(2):
                    c = c0 + t4 + 4 * u
                    col = 16 * c + 4 * i
                    byt = [np.where(c < chunks, q[rows[h], np.minimum(col + b, last)], 0)
                           for b in range(4)]
                    word = (byt[0].astype(np.uint32) | byt[1].astype(np.uint32) << 8
                            | byt[2].astype(np.uint32) << 16 | byt[3].astype(np.uint32) << 24)
                    p[h, u] = tc_word(word)
            for j in range(4):
                a = np.stack([p[0, 0][j], p[1, 0][j], p[0, 1][j], p[1, 1][j]], 1)
                b = np.stack([xv[:, i, j] & lo, xv[:, i, j] & ~lo], 1)
                d = mma16816(d, a, b)
        v = np.zeros((2, 32))
        for h in range(2):
            for ln in range(32):
                c = c0 + 2 * t4[ln]
                ss = tc_pair(sc, rows[h][ln], c, chunks, lg, ngroups % 2 == 0)
                zz = tc_pair(zr, rows[h][ln], c, chunks, lg, ngroups % 2 == 0)
                for e in range(2):
                    sxe = sx[min(c + e, sx.size - 1)]
                    v[h, ln] += ss[e] * d[ln, 2 * h + e] + zz[e] * sxe
        return v.reshape(2, 8, 4).sum(2)                         # the row's 4 lanes

    tiles = -(-n // 16)
    blocks = tiles if blocks is None else blocks
    tb = -(-tiles // blocks)
    out = np.full((nt, n), np.nan)
    for blk in range(blocks):
        tile0 = blk * tb
        if tile0 >= tiles:
            continue
        ntile = min(tb, tiles - tile0)
        per_tile = nt * steps
        items = ntile * per_tile
        red = np.full(items * 16, np.nan)
        for warp in range(warps):
            kmax = (items - warp + warps - 1) // warps
            for k0 in range(0, kmax, items_per_round):
                for kk in range(items_per_round):
                    i = warp + (k0 + kk) * warps
                    if i < items:
                        tl, t, s = ((i // per_tile, (i // steps) % nt, i % steps)
                                    if deal is None else deal(i, per_tile, steps, nt))
                        v = item(tile0 + tl, t, s)
                        red[i * 16 + np.arange(8)] = v[0]
                        red[i * 16 + 8 + np.arange(8)] = v[1]
        for j in range(ntile * 16):
            tl, r = j >> 4, (tile0 + (j >> 4)) * 16 + (j & 15)
            if r < n:
                for t in range(nt):
                    out[t, r] = sum(red[((tl * nt + t) * steps + s) * 16 + (j & 15)]
                                    for s in range(steps))
    return out if two else out[0]


def _weight(rng, n, k, g):
    return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1
                    + rng.standard_normal((n, 1)).astype(np.float32) * 0.05, bits=4,
                    group_size=g)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(16, 256), (37, 1024), (20, 3072), (9, 96), (17, 800),
                                 (5, 384), (21, 320)])
def test_emulated_gemv_tc_is_the_product(g, n, k):
    """Ragged last steps (K = 96, 800, 320 and 384: 3, 25, 10 and 12 chunks) at every group
    size that divides K, partial tiles."""
    if k % g:
        pytest.skip("K must hold whole groups")
    rng = np.random.default_rng(g + n + k)
    w = _weight(rng, n, k, g)
    x = rng.standard_normal(k).astype(np.float16)
    want = dequantize(w).astype(np.float64) @ x.astype(np.float64)
    for blocks in (None, 1, 2):                  # one tile a block; all tiles in one; a ragged last
        got = emulate(w, x, blocks=blocks)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"blocks={blocks}")


def test_emulated_gemv_tc_swiglu_takes_gate_and_up_rows():
    rng = np.random.default_rng(5)
    f, k = 21, 512
    w = _weight(rng, 2 * f, k, 32)
    x = rng.standard_normal(k).astype(np.float16)
    full = dequantize(w).astype(np.float64) @ x.astype(np.float64)
    gate, up = emulate(w, x, two=True, blocks=1)     # both tiles' gate and up items in one block
    np.testing.assert_allclose(gate, full[:f], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(up, full[f:], rtol=1e-9, atol=1e-9)


def test_the_emulation_catches_a_wrong_b_column():
    """The check can fail: x entering B at every lane's column (no chunk separation) sums
    chunks under one another's scales."""
    rng = np.random.default_rng(7)
    w = _weight(rng, 16, 512, 32)
    x = rng.standard_normal(512).astype(np.float16)
    want = dequantize(w).astype(np.float64) @ x.astype(np.float64)
    bad = emulate(w, x, b_cols=lambda g, t4: (np.ones(32, bool),
                                              np.where(g < 4, 0xFFFFFFFF, 0).astype(np.uint32)))
    assert np.max(np.abs(bad - want)) > 1e-3


def test_the_emulation_catches_a_wrong_code_pair():
    """tc_word's pairs (q_j, q_j+4) against x pairs (x_j, x_j+1) permutes K between the
    operands."""
    rng = np.random.default_rng(8)
    w = _weight(rng, 16, 256, 32)
    x = rng.standard_normal(256).astype(np.float16)
    want = dequantize(w).astype(np.float64) @ x.astype(np.float64)
    global stage_x
    good = stage_x

    def wrong(xx):
        xp, sx = good(xx)
        words = np.zeros_like(xp)
        h = np.pad(xx, (0, xp.shape[0] * 8 - xx.size)).astype(np.float16).view(np.uint16)
        h = h.astype(np.uint32).reshape(-1, 4, 2)
        words[:] = h[:, :, 0] | (h[:, :, 1] << 16)
        return words, sx

    stage_x = wrong
    try:
        bad = emulate(w, x)
    finally:
        stage_x = good
    assert np.max(np.abs(bad - want)) > 1e-3


@pytest.mark.parametrize("n,k,two", [(16, 256, False), (960, 576, False), (8192, 3072, False),
                                     (10752, 3072, True), (3072, 10752, False),
                                     (49152, 2048, False), (150000, 16384, True), (17, 96, True),
                                     (120000, 5280, False), (100000, 6528, False),
                                     (65536, 5280, False), (60000, 5280, True)])
@pytest.mark.parametrize("resident", [1, 7, 132, 264, 396, 100000])
def test_tc_geometry_deals_every_tile_once(n, k, two, resident):
    """gemv_tc_body gives block b tiles [b tb, min(tiles, (b + 1) tb)) with tb = ceil(tiles /
    blocks): on tc_geometry's grid every tile falls in exactly one block, no block is empty,
    the grid stays within one wave unless the shared-memory cap forces more blocks, and the
    shared memory holds x's staging and the largest block's partials and leaves 1 KiB of the
    48 KiB a launch gets for the entries' static shared memory (the shapes at K = 5280 and
    6528 once rounded to within 128 bytes of 48 KiB)."""
    from tinyloop.backends.cuda.gemv import tc_geometry

    blocks, smem = tc_geometry(n, k, two, resident)
    tiles = -(-n // 16)
    tb = -(-tiles // blocks)
    owned = [min(tiles, (b + 1) * tb) - b * tb for b in range(blocks)]
    assert min(owned) >= 1 and sum(owned) == tiles
    cpad = -(-(k // 32) // 8) * 8
    assert smem == cpad * 68 + tb * (2 if two else 1) * (cpad // 8) * 16 * 4
    assert smem <= 47 * 1024
    if cpad * 68 + -(-tiles // min(tiles, resident)) * (2 if two else 1) * cpad * 8 <= 47 * 1024:
        assert blocks <= resident


def test_the_emulation_catches_a_wrong_item_deal():
    """Items dealt as (gate / up, step) in the other order put a step's gate partial in an up
    slot: the block's rows come out wrong."""
    rng = np.random.default_rng(9)
    f, k = 20, 768
    w = _weight(rng, 2 * f, k, 32)
    x = rng.standard_normal(k).astype(np.float16)
    full = dequantize(w).astype(np.float64) @ x.astype(np.float64)
    gate, up = emulate(w, x, two=True, blocks=1,
                       deal=lambda i, per_tile, steps, nt: (i // per_tile, i % nt,
                                                            (i // nt) % steps))
    assert np.max(np.abs(np.concatenate([gate, up]) - full)) > 1e-3
