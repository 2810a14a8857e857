"""CPU check of gemv_mma.cu's fragment arithmetic, which this machine cannot run: a NumPy
emulation of the kernel as written (each lane's code words and x columns, the LOP3 / PRMT
placement into FP16 and sub.f16x2, mma.sync m16n8k16 assembled from every lane's fragments
by the PTX ISA's fragment layout, the warps' chunk split and the per-chunk s * dot + z * sum(x))
against x @ W.T from the dequantized weights (tinyloop.quant.dequantize), in float64. A wrong
permutation of K between the codes and x, a wrong fragment row or column, or a wrong pair
fails it. tests/kernels/test_gemv_mma_gpu.py checks the kernel itself."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.quant import dequantize, quantize

ONES = 0x3C003C00


def halves(w):
    """uint32 array -> (lo, hi) float64 values of its two FP16 halves."""
    w = np.asarray(w, np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def pack(lo, hi):
    lo = np.asarray(lo, np.float16).view(np.uint16).astype(np.uint32)
    hi = np.asarray(hi, np.float16).view(np.uint16).astype(np.uint32)
    return lo | (hi << 16)


def hsub2(a, b):
    """sub.rn.f16x2 (exact here: small integers)."""
    al, ah = halves(a)
    bl, bh = halves(b)
    return pack(al - bl, ah - bh)


def byte_perm(a, b, sel):
    """__byte_perm / prmt (default mode): result byte k = byte (sel >> 4k) & 7 of b:a."""
    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for k in range(4):
        i = (sel >> (4 * k)) & 7
        out |= ((src >> np.uint64(8 * i)) & np.uint64(0xFF)) << np.uint64(8 * k)
    return out.astype(np.uint32)


def mma16816(c, a, b):
    """c [32, 4] += A @ B, A from a [32, 4] and B from b [32, 2] (uint32 FP16 pairs), by the
    m16n8k16 fragment layout (common.cuh mma16816), in float64."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg, (r, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                      (g + 8, 2 * t + 8))):
            A[r, k], A[r, k + 1] = halves(a[lane, reg])
        for reg, k in enumerate((2 * t, 2 * t + 8)):
            B[k, g], B[k + 1, g] = halves(b[lane, reg])
    D = A @ B
    out = c.copy()
    for lane in range(32):
        g, t = divmod(lane, 4)
        out[lane] += (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
    return out


def codes_words(w, row, c, bits):
    """mma_load_codes for every lane (t4 = lane % 4) of row indices ``row`` [32]."""
    t4 = np.arange(32) % 4
    q = w.qweight.view(np.uint8)
    if bits == 4:
        base = 16 * c + 4 * t4
        b = np.stack([q[row, base + i] for i in range(4)], 1).astype(np.uint32)
        return (b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24), None
    base = 32 * c + 8 * t4
    b = np.stack([q[row, base + i] for i in range(8)], 1).astype(np.uint32)
    return (b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24,
            b[:, 4] | b[:, 5] << 8 | b[:, 6] << 16 | b[:, 7] << 24)


def mma_codes(wx, wy, bits):
    """a[m][p] [32] of mma_codes."""
    if bits == 4:
        M, Bz = 0x000F000F, 0x64006400
        p = [hsub2(((wx >> (4 * i)) & M) | Bz, Bz) for i in range(4)]
        return [[p[0], p[1]], [p[2], p[3]]]
    Bz = 0x64806480
    v0, v1 = wx ^ 0x80808080, wy ^ 0x80808080
    return [[hsub2(byte_perm(v0, 0x64646464, 0x4140), Bz),
             hsub2(byte_perm(v0, 0x64646464, 0x4342), Bz)],
            [hsub2(byte_perm(v1, 0x64646464, 0x4140), Bz),
             hsub2(byte_perm(v1, 0x64646464, 0x4342), Bz)]]


def mma_x(X, bits):
    """b[m][p] [32] of mma_x from X [32, 4] (uint32 words of 8 x halves)."""
    if bits == 4:
        return [[byte_perm(X[:, 0], X[:, 2], 0x5410), byte_perm(X[:, 0], X[:, 2], 0x7632)],
                [byte_perm(X[:, 1], X[:, 3], 0x5410), byte_perm(X[:, 1], X[:, 3], 0x7632)]]
    return [[X[:, 0], X[:, 1]], [X[:, 2], X[:, 3]]]


def emulate(w, x, bits, two, warps, place_x=mma_x):
    """gemv_mma_impl's block loop for every block: the raw products [T, N] (SwiGLU: the gate
    and up products [2, T, F]) in float64. ``place_x``: mma_x, or a planted fault."""
    n_all, k = w.shape
    n = n_all // 2 if two else n_all
    f = n if two else 0
    t_rows = x.shape[0]
    ct_n = -(-t_rows // 8)
    lg = int(np.log2(w.group_size))
    ngroups = k >> lg
    xw = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    nt = 2 if two else 1
    res = np.zeros((nt, t_rows, n))
    lane = np.arange(32)
    g, t4 = lane // 4, lane % 4
    sc = w.scales.astype(np.float64)
    zr = w.zeros.astype(np.float64)
    for blk in range(-(-n // 16)):
        r0 = 16 * blk
        rows = [[np.minimum(r0 + g + 8 * h, n - 1) + wt * f for h in range(2)]
                for wt in range(nt)]
        part = np.zeros((warps, nt, ct_n, 32, 4))
        for warp in range(warps):
            for c in range(warp, k // 32, warps):
                grp = (c * 32) >> lg
                a = [[mma_codes(*codes_words(w, rows[wt][h], c, bits), bits) for h in range(2)]
                     for wt in range(nt)]
                for ct in range(ct_n):
                    t = 8 * ct + g
                    cols = 32 * c + 8 * t4[:, None] + np.arange(8)
                    xs = np.where((t < t_rows)[:, None],
                                  xw[np.minimum(t, t_rows - 1)[:, None], cols], 0)
                    X = (xs[:, 0::2] | (xs[:, 1::2] << 16)).astype(np.uint32)
                    b = place_x(X, bits)
                    sx = np.zeros((32, 4))
                    for m in range(2):
                        sx = mma16816(sx, np.full((32, 4), ONES, np.uint32),
                                      np.stack(b[m], 1))
                    for wt in range(nt):
                        dot = np.zeros((32, 4))
                        for m in range(2):
                            af = np.stack([a[wt][0][m][0], a[wt][1][m][0], a[wt][0][m][1],
                                           a[wt][1][m][1]], 1)
                            dot = mma16816(dot, af, np.stack(b[m], 1))
                        for i in range(4):
                            r = rows[wt][i >> 1]
                            part[warp, wt, ct, :, i] += (sc[r, grp] * dot[:, i]
                                                         + zr[r, grp] * sx[:, i])
        tot = part.sum(0)
        for wt in range(nt):
            for ct in range(ct_n):
                for i in range(4):
                    row = r0 + g + 8 * (i >> 1)
                    t = 8 * ct + 2 * t4 + (i & 1)
                    ok = (row < n) & (t < t_rows)
                    res[wt, t[ok], row[ok]] = tot[wt, ct, ok, i]
    return res if two else res[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("t_rows,n,k,warps", [(1, 16, 64, 2), (5, 37, 96, 3),
                                              (13, 20, 128, 8), (20, 9, 64, 1)])
def test_emulated_gemv_mma_is_the_product(bits, g, t_rows, n, k, warps):
    if k % g:
        pytest.skip("K must hold whole groups")
    rng = np.random.default_rng(bits * 1000 + g + n)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1
                 + rng.standard_normal((n, 1)).astype(np.float32) * 0.05,
                 bits=bits, group_size=g)
    x = (rng.standard_normal((t_rows, k))).astype(np.float16)
    want = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    got = emulate(w, x, bits, False, warps)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("bits", [4, 8])
def test_emulated_gemv_mma_swiglu_takes_gate_and_up_rows(bits):
    rng = np.random.default_rng(bits)
    f, k = 21, 64
    w = quantize(rng.standard_normal((2 * f, k)).astype(np.float32) * 0.1, bits=bits,
                 group_size=32)
    x = rng.standard_normal((9, k)).astype(np.float16)
    full = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    gate, up = emulate(w, x, bits, True, 2)
    np.testing.assert_allclose(gate, full[:, :f], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(up, full[:, f:], rtol=1e-9, atol=1e-9)


def test_the_emulation_catches_a_wrong_pairing():
    """The check can fail: the INT4 x pairs taken as (x0, x1) (the INT8 placement) while the
    codes stay (q0, q4) permutes K between the two operands."""
    rng = np.random.default_rng(3)
    w = quantize(rng.standard_normal((16, 64)).astype(np.float32), bits=4, group_size=32)
    x = rng.standard_normal((3, 64)).astype(np.float16)
    want = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    got = emulate(w, x, 4, False, 2, place_x=lambda X, bits: mma_x(X, 8))
    assert not np.allclose(got, want, rtol=1e-3, atol=1e-3)
