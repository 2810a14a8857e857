"""Prefill attention (T > 1) on tensor cores (attention_prefill.cu, KernelChoice.attn_prefill
mma) against the NumPy oracle (NumpyOps.kv_attention), an independent float64 reference over
the values the kernel stages, and the scalar FP32 kernel (attention.cu, scalar).

Tolerance (argued, computed per output element). The mma kernel reads the same K/V the oracle
reads, except that int8 pages are dequantized in float32 and then rounded to FP16 for the MMA
(fp16 pages are FP16 already). Over those staged values K~, V~ it differs from exact softmax
attention by:
  * P rounded to FP16: each p_j = 2^(s_j - m) gets a relative error |d_j| <= u = 2^-11 (round
    to nearest, p <= 1); l sums the same rounded p, so the output is sum_j w_j (1 + d_j) v_j /
    (1 + sum_j w_j d_j), which is off by at most u / (1 - u) * sum_j w_j |v_j - out|
    <= u (1 + u) (w @ |V~| + |out|). p below 2^-14 is subnormal in FP16: absolute error
    <= 2^-25 each, at most ctx * 2^-25 * 2 max|V~| in all;
  * the FP16 output: half an ulp, 2^-11 |out|;
  * FP32 sums of l and of O = P~ V~ over <= ctx terms: relative <= ctx 2^-23 (with the tensor
    cores' truncating adds), below u for ctx <= 2^12: a second u on the P term;
  * scores in FP32, exp2f and scale*log2(e) in float32: relative ~1e-6: 1e-6 max|V~|.
That is ``tol``. Against the oracle (float32 K/V in int8 mode) the bound adds |ref64 - oracle|,
the exactly computed effect of the FP16 staging (zero up to float64 noise in fp16 mode).
Against the scalar kernel it adds the scalar kernel's own bound from test_kernels.py
(2e-3 rms(out) + F16_RTOL |out|).

Block tables are permuted (logical page i lives in a random physical page) so a kernel that
assumed contiguous pages would fail; P = 16 / 32 / 48 (48: pages that are not a multiple of
the kernel's key tile). ``large`` scales Q and K up and grows K with the position, so the
running max rises tile after tile and the online-softmax rescale is exercised.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.cuda import CudaOps, KernelChoice  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402

from .test_kernels_gpu import (F16_RTOL, HEADS, SESSION_SEED, copy_pages,  # noqa: E402
                               kv_pair, poisoned, qkv_rows, rms)

U = 2.0 ** -11       # FP16 unit roundoff


def _permute_table(kv, rng, npages: int) -> None:
    """Logical page i of ``kv`` (a device SlotKV) -> a random one of its physical pages."""
    perm = rng.permutation(npages)
    kv.table_host[:npages] = kv.table_host[:npages][perm]
    kv.table[:npages].set(np.ascontiguousarray(kv.table_host[:npages]))


def _fill(ops, ref, rng, mode, h, hkv, hd, t, pos0, p, large=False, extra=8):
    """Caches on both backends holding the same stored K/V for positions 0..pos0+t-1 (the
    device one through a permuted block table) and the chunk's Q rows.
    Returns (c_ref, c_dev, q float32 [t, (h + 2 hkv) hd + extra], qh float16 alike)."""
    ctx = pos0 + t
    c_ref, c_dev = kv_pair(ops, ref, mode, h, hkv, hd, ctx, p)
    _, allq = qkv_rows(rng, ctx, h, hkv, hd, extra=extra)
    if large:
        allq[:, :(h + hkv) * hd] *= 4.0                                 # Q and K: scores x16
        allq[:, h * hd:(h + hkv) * hd] *= (1.0 + 2.0 * np.arange(ctx) / ctx)[:, None]
    allq = allq.astype(np.float16).astype(np.float32)
    ref.kv_write(allq.copy(), None, 0, 1e4, h, hkv, hd, c_ref.slot(0))
    npages = -(-ctx // p)
    _permute_table(c_dev.slot(0), rng, npages)
    copy_pages(c_ref.slot(0), c_dev.slot(0), mode, npages)
    qh = allq[pos0:].astype(np.float16)
    return c_ref, c_dev, qh.astype(np.float32), qh


def _ref64(ref, kv, q, pos0, h, hkv, hd, window=0):
    """Float64 causal attention over the values the mma kernel stages (K, V rounded to FP16)
    and its bound ``tol`` (module docstring); ``window`` > 0: key j visible from position p
    when p - window < j (written here from the definition, not NumPyOps' chunked rule).
    Returns (out, tol), both [t, h hd]."""
    t, ctx = q.shape[0], pos0 + q.shape[0]
    k, v = ref.kv_rows(kv, 0, ctx, hkv, hd, None)                     # [ctx, hkv, hd]
    k = np.asarray(k, np.float32).astype(np.float16).astype(np.float64)
    v = np.asarray(v, np.float32).astype(np.float16).astype(np.float64)
    qq = q[:, :h * hd].reshape(t, h, hd).astype(np.float64) / np.sqrt(hd)
    future = np.arange(ctx)[None, :] > (pos0 + np.arange(t))[:, None]
    if window > 0:
        future |= np.arange(ctx)[None, :] <= (pos0 + np.arange(t))[:, None] - window
    out = np.empty((t, h, hd))
    tol = np.empty((t, h, hd))
    for hh in range(h):
        kh = hh // (h // hkv)
        s = np.where(future, -np.inf, qq[:, hh] @ k[:, kh].T)          # [t, ctx]
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        o = w @ v[:, kh]
        vmax = np.abs(v[:, kh]).max()
        out[:, hh] = o
        tol[:, hh] = (2.0 * U * (1 + U) * (w @ np.abs(v[:, kh]) + np.abs(o)) + U * np.abs(o)
                      + ctx * 2.0 ** -24 * vmax + 1e-6 * vmax)
    return out.reshape(t, h * hd), tol.reshape(t, h * hd)


def _run(ops, monkeypatch, version, qh, c_dev, pos0, h, hkv, hd, spare=3, window=0):
    """kv_attention with KernelChoice.attn_prefill = ``version`` into a NaN-poisoned buffer
    with ``spare`` rows more than T; checks the spare rows are untouched; returns out
    [T, h hd]."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_prefill=version))
    t = qh.shape[0]
    buf = poisoned((t + spare, h * hd), cupy.float16)
    ops.kv_attention(cupy.asarray(qh), c_dev.slot(0), pos0, h, hkv, hd, buf, window=window)
    host = cupy.asnumpy(buf).astype(np.float64)
    assert np.isnan(host[t:]).all(), f"{version}: wrote rows past T={t}"
    return host[:t]


def _check(got, want, tol, what):
    assert np.isfinite(got).all(), (f"{what}: {int((~np.isfinite(got)).sum())} outputs are "
                                    f"NaN/inf (first at {np.argwhere(~np.isfinite(got))[0]})")
    err = np.abs(got - want)
    if not (err <= tol).all():
        i = np.unravel_index(np.argmax(err - tol), got.shape)
        raise AssertionError(f"{what}: {int((err > tol).sum())} of {got.size} outside the "
                             f"bound; worst at {list(i)}: got={got[i]:.6g} want={want[i]:.6g} "
                             f"err={err[i]:.3g} bound={tol[i]:.3g} (seed {SESSION_SEED})")


def _case(ops, ref, rng, monkeypatch, mode, h, hkv, hd, t, pos0, p, large=False, extra=8,
          window=0):
    c_ref, c_dev, q, qh = _fill(ops, ref, rng, mode, h, hkv, hd, t, pos0, p, large, extra)
    oracle = np.empty((t, h * hd), np.float32)
    ref.kv_attention(q, c_ref.slot(0), pos0, h, hkv, hd, oracle, window=window)
    oracle = oracle.astype(np.float64)
    r64, tol = _ref64(ref, c_ref.slot(0), q, pos0, h, hkv, hd, window)
    mma = _run(ops, monkeypatch, "mma", qh, c_dev, pos0, h, hkv, hd, window=window)
    scalar = _run(ops, monkeypatch, "scalar", qh, c_dev, pos0, h, hkv, hd, window=window)
    what = (f"{mode} T={t} pos0={pos0} P={p} heads={h}/{hkv}x{hd} large={large} "
            f"window={window}")
    _check(mma, r64, tol, f"mma vs float64 over FP16-staged K/V, {what}")
    staging = np.abs(r64 - oracle)                   # exactly the FP16 staging's effect
    _check(mma, oracle, tol + staging, f"mma vs NumPy oracle, {what}")
    scalar_tol = 2e-3 * rms(oracle) + F16_RTOL * np.abs(oracle)
    _check(scalar, oracle, scalar_tol, f"scalar vs NumPy oracle, {what}")
    _check(mma, scalar, tol + staging + scalar_tol, f"mma vs scalar, {what}")
    return mma, oracle


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 63, 64, 65, 200, 2048])
@pytest.mark.parametrize("pos0", [0, 37])
@pytest.mark.parametrize("p", [32, 48])
def test_prefill_smollm_heads(ops, ref, rng, monkeypatch, mode, t, pos0, p):
    """SmolLM2's heads (9 query / 3 KV of 64): every ragged T against the 64-row q tile and
    the 64-key tile, a chunk after earlier positions (pos0 = 37, not page-aligned), P = 32
    (a divisor of the key tile) and 48 (not). T = 1 takes the decode kernel."""
    _case(ops, ref, rng, monkeypatch, mode, 9, 3, 64, t, pos0, p)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("t,pos0", [(17, 0), (65, 100), (200, 0)])
def test_prefill_head_shapes(ops, ref, rng, monkeypatch, mode, h, hkv, hd, t, pos0):
    """Every head dim family (16, 32, 64, 128: key tiles of 64 and 32) and GQA group sizes
    1, 3, 4, with P = 16."""
    _case(ops, ref, rng, monkeypatch, mode, h, hkv, hd, t, pos0, 16)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("t,pos0", [(200, 0), (2048, 0), (130, 1000)])
def test_prefill_online_softmax_rescale(ops, ref, rng, monkeypatch, mode, t, pos0):
    """Scores 16x larger and growing with the key position: the running max moves up tile
    after tile, so every tile rescales O and l (alpha < 1) and most P are tiny or subnormal."""
    _case(ops, ref, rng, monkeypatch, mode, 9, 3, 64, t, pos0, 32, large=True)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", [(9, 3, 64), (4, 2, 96), (6, 2, 128)])
@pytest.mark.parametrize("window", [1, 5, 64, 10**6])
@pytest.mark.parametrize("t,pos0", [(17, 0), (65, 100), (200, 0), (130, 1000)])
def test_prefill_sliding_window(ops, ref, rng, monkeypatch, mode, h, hkv, hd, window, t, pos0):
    """Both prefill kernels with a window (1: each row its own key; 5 / 64: windows inside a
    key tile and across tiles and pages; 10**6: wider than the context), P = 16, against the
    oracle and the float64 reference with the window written from its definition: a warp's
    16 rows have different first keys, so a tile can hold none of some rows' keys while their
    running max is still -inf (window 1 / 5), and tiles before the block's first window are
    skipped (pos0 = 1000)."""
    _case(ops, ref, rng, monkeypatch, mode, h, hkv, hd, t, pos0, 16, window=window)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("window", [7, 100])
def test_prefill_sliding_window_rescale(ops, ref, rng, monkeypatch, mode, window):
    """Growing scores (``large``) with a window: the running max moves up tile after tile
    from the window's first tile on."""
    _case(ops, ref, rng, monkeypatch, mode, 9, 3, 64, 300, 200, 32, large=True, window=window)


def test_prefill_odd_row_pitch_falls_back_to_scalar(ops, ref, rng, monkeypatch):
    """An odd qkv row pitch (no 4-byte Q loads): the mma setting runs the scalar kernel and
    the result still matches."""
    _case(ops, ref, rng, monkeypatch, "fp16", 9, 3, 64, 70, 5, 32, extra=7)


def test_prefill_choice_is_an_argument(monkeypatch):
    monkeypatch.setenv("TINYLOOP_ATTN_PREFILL", "scalar")          # no longer read
    assert CudaOps().kernels.attn_prefill == "mma"
    assert CudaOps(KernelChoice(attn_prefill="scalar")).kernels.attn_prefill == "scalar"
    with pytest.raises(ConfigError, match="KernelChoice or None"):
        CudaOps("scalar")
