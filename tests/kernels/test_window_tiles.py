"""CPU checks of the sliding-window index arithmetic of the attention kernels that cannot run
here: a NumPy emulation of which key tiles a prefill block loads and each of its warps runs
(attention.cu's scalar kernel, attention_prefill.cu's tensor-core kernel, their skip and mask
conditions as the kernels write them), the store-h chunk loop (attention.py ``_h_attention``
with kv_h.cu ``h_attn_chunk``'s per-row key range and merge), and the online softmax with
the -inf guard, against a dense softmax over keys max(0, p-window+1)..p written from the
definition. Run under ``np.errstate(invalid="raise")``: an exp2(-inf - -inf) raises. The GPU
tests (tests/kernels/test_kernels_gpu.py, test_attn_prefill_gpu.py, tests/kv/test_kv_h_gpu.py)
check the kernels themselves."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tinyloop.backends.cuda.compile import GEOMETRY

from .test_kernel_signatures import SRC

PF_Q = GEOMETRY["attention"]["PF_Q"]
PF_KV = int(re.search(r"#define PF_KV (\d+)", (SRC / "attention.cu").read_text()).group(1))
FA_Q = 16 * GEOMETRY["attention_prefill"]["FA_WARPS"]
# attention_prefill.cu: constexpr int KT = HD > 64 ? 32 : 64
_KT = re.search(r"KT = HD > 64 \? (\d+) : (\d+);", (SRC / "attention_prefill.cu").read_text())
FA_KT = {"hd>64": int(_KT.group(1)), "hd<=64": int(_KT.group(2))}
HD = 8
CASES = [(1, 299), (2, 0), (17, 0), (67, 0), (64, 37), (200, 0), (33, 300), (130, 1000)]
WINDOWS = [0, 1, 5, 64, 10**6]


def win_lo(p: int, window: int) -> int:
    """common.cuh win_lo: the first key position p reads."""
    return max(0, p - window + 1) if window > 0 else 0


def dense(q, k, v, pos0, window):
    """Softmax attention of query rows at pos0.. over keys win_lo(p)..p, float64, from the
    definition (log2 units as the kernels')."""
    t = q.shape[0]
    out = np.empty((t, q.shape[1]))
    for i in range(t):
        p = pos0 + i
        lo = max(0, p - window + 1) if window > 0 else 0
        s = k[lo:p + 1] @ q[i]
        w = np.exp2(s - s.max())
        out[i] = w @ v[lo:p + 1] / w.sum()
    return out


def online(state, s, vt):
    """One tile's online-softmax update of (m, l, o) for one row, as the prefill kernels do
    it: against m_use = 0 while the running max is -inf."""
    m, l, o = state
    m_new = max(m, s.max())
    m_use = 0.0 if m_new == -math.inf else m_new
    alpha = np.exp2(m - m_use)
    p = np.exp2(s - m_use)
    return m_new, l * alpha + p.sum(), o * alpha + p @ vt


def emulate_prefill(kind, q, k, v, pos0, window, tile):
    """The prefill kernel ``kind`` ("scalar": blocks of PF_Q rows, warps of 8 rows, the skip
    when every row has k0 > qpos or k0 + tile <= qlo, the mask qlo <= key <= qpos; "mma":
    blocks of FA_Q rows, warps of 16, the skip unless k0 <= wmax and k0 + tile - 1 >=
    win_lo(wmin), the causal mask where k0 + tile - 1 > wmin and the window's where
    k0 < win_lo(wmax)) over staged K/V (zeros outside klo..kv_end-1). Checks that every tile
    a warp runs holds a visible key of one of its rows. Returns (out [T, HD], how many row
    updates met a tile with none of the row's keys before the row saw any: the guard's
    cases)."""
    t = q.shape[0]
    rows_block, rows_warp = (PF_Q, 8) if kind == "scalar" else (FA_Q, 16)
    out = np.full((t, HD), np.nan)
    guarded = 0
    for q0 in range(0, t, rows_block):
        last = min(q0 + rows_block, t) - 1
        kv_end = pos0 + last + 1
        klo = win_lo(pos0 + q0, window)
        keys = np.arange(kv_end + tile)
        live = (keys >= klo) & (keys < kv_end)
        ks = np.where(live[:, None], np.pad(k, ((0, tile), (0, 0)))[:len(keys)], 0.0)
        vs = np.where(live[:, None], np.pad(v, ((0, tile), (0, 0)))[:len(keys)], 0.0)
        for r0 in range(q0, last + 1, rows_warp):
            rows = [min(r, t - 1) for r in range(r0, r0 + rows_warp)]   # past T: row T-1
            pos = [pos0 + r for r in rows]
            lo = [win_lo(p, window) for p in pos]
            wmin, wmax = pos0 + r0, pos[-1]
            states = [(-math.inf, 0.0, np.zeros(HD)) for _ in rows]
            for k0 in range(klo // tile * tile, kv_end, tile):
                if kind == "scalar":
                    run = not all(k0 > p or k0 + tile <= a for p, a in zip(pos, lo))
                else:
                    run = k0 <= wmax and k0 + tile - 1 >= win_lo(wmin, window)
                if not run:
                    continue
                c = np.arange(tile)
                assert any(((k0 + c >= a) & (k0 + c <= p)).any() for p, a in zip(pos, lo))
                for i, (r, p, a) in enumerate(zip(rows, pos, lo)):
                    sc = ks[k0:k0 + tile] @ q[r]
                    if kind == "scalar":
                        masked = ~((k0 + c <= p) & (k0 + c >= a))
                    else:
                        masked = ((k0 + tile - 1 > wmin) & (c > p - k0)) | \
                                 ((k0 < win_lo(wmax, window)) & (c < a - k0))
                    assert (live[k0 + c] | masked).all()   # no visible key was zeroed
                    guarded += bool(masked.all() and states[i][0] == -math.inf)
                    states[i] = online(states[i], np.where(masked, -np.inf, sc),
                                       vs[k0:k0 + tile])
            for r, (m, l, o) in zip(rows, states):
                assert l > 0, (kind, r, pos0, window)
                out[r] = o / l
    return out, guarded


def emulate_h(q, k, v, pos0, window, chunk, nw=3):
    """The store-h chunk loop: chunks from win_lo(pos0) // chunk on; per chunk and row the
    keys kbeg..kend-1, dealt to nw warps (warp w: kbeg + w, + nw, ...) with their own
    online-softmax states; the merge with the carried state, a state or part with m = -inf
    weighing 0 (h_attn_chunk). Returns out [T, HD]."""
    t, ctx = q.shape[0], pos0 + q.shape[0]
    n_chunks = -(-ctx // chunk)
    ci0 = win_lo(pos0, window) // chunk
    st = [(-math.inf, 0.0, np.zeros(HD)) for _ in range(t)]
    out = np.full((t, HD), np.nan)
    for ci in range(ci0, n_chunks):
        c0 = ci * chunk
        n = min(chunk, ctx - c0)
        for i in range(t):
            kend = min(n, pos0 + i - c0 + 1)
            kbeg = max(0, win_lo(pos0 + i, window) - c0)
            parts = []
            for w in range(nw):
                m, l, o = -math.inf, 0.0, np.zeros(HD)
                for j in range(kbeg + w, kend, nw):
                    s = float(k[c0 + j] @ q[i])
                    m_new = max(m, s)
                    alpha = np.exp2(m - m_new)
                    p = np.exp2(s - m_new)
                    m, l, o = m_new, l * alpha + p, o * alpha + p * v[c0 + j]
                parts.append((m, l, o))
            carried = [] if ci == ci0 else [st[i]]
            m_all = max([-math.inf] + [x[0] for x in carried + parts])
            l_sum, a_sum = 0.0, np.zeros(HD)
            for m, l, o in carried + parts:
                f = 0.0 if m == -math.inf else np.exp2(m - m_all)
                l_sum, a_sum = l_sum + l * f, a_sum + o * f
            if ci == n_chunks - 1:
                out[i] = a_sum / l_sum if l_sum > 0 else 0.0
            else:
                st[i] = (m_all, l_sum, a_sum)
    return out


def _inputs(t, pos0, seed):
    rng = np.random.default_rng(seed)
    ctx = pos0 + t
    return (rng.standard_normal((t, HD)) * 2, rng.standard_normal((ctx, HD)),
            rng.standard_normal((ctx, HD)))


@pytest.mark.parametrize("t,pos0", CASES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind,tile", [("scalar", PF_KV), ("mma", FA_KT["hd<=64"]),
                                       ("mma", FA_KT["hd>64"])])
def test_prefill_tiles_and_masks_give_the_window_softmax(t, pos0, window, kind, tile):
    q, k, v = _inputs(t, pos0, t * 7 + pos0 + window % 11)
    with np.errstate(invalid="raise"):
        got, guarded = emulate_prefill(kind, q, k, v, pos0, window, tile)
    np.testing.assert_allclose(got, dense(q, k, v, pos0, window), rtol=1e-10, atol=1e-12)
    if window == 0 or window >= pos0 + t:
        assert guarded == 0           # full attention: a row's first tile holds key 0


@pytest.mark.parametrize("t,pos0", CASES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("chunk", [48, 256])
def test_store_h_chunks_give_the_window_softmax(t, pos0, window, chunk):
    q, k, v = _inputs(t, pos0, t * 5 + pos0 + chunk + window % 13)
    with np.errstate(invalid="raise"):
        got = emulate_h(q, k, v, pos0, window, chunk)
    np.testing.assert_allclose(got, dense(q, k, v, pos0, window), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind,tile", [("scalar", PF_KV), ("mma", FA_KT["hd<=64"]),
                                       ("mma", FA_KT["hd>64"])])
def test_small_windows_reach_the_guard(kind, tile):
    """The cases above include rows that meet a tile holding none of their keys before they
    saw any (their running max still -inf), where an exponential against the max itself
    would be exp2(-inf - -inf) = NaN: window 5 with rows crossing a tile boundary."""
    q, k, v = _inputs(64, 37, 3)
    _, guarded = emulate_prefill(kind, q, k, v, 37, 5, tile)
    assert guarded > 0
