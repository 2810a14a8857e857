"""Every CUDA op against the NumPy reference (``NumpyOps``), on fresh random inputs.

Shapes include ragged ones (not multiples of the 64-row GEMM tiles, the 8-row GEMV blocks, the
64-query / 32-key attention tiles or the 256-key decode chunks); INT4 and INT8 at g = 32/64/128.
Outputs are poisoned with NaN before each run and NaN never passes. The reference sees the same
FP16-rounded inputs as the GPU, so the bounds measure the kernels alone:
|out - ref| <= atol + rtol * |ref|, atol scaled to the output's RMS for products.
"""

from __future__ import annotations

import dataclasses

import os
import types

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.cuda import attention as cuda_attention  # noqa: E402
from tinyloop.backends.base import STEP_POS, STEP_WORDS, Ops  # noqa: E402
from tinyloop.backends.cuda import CudaOps, KernelChoice  # noqa: E402
from tinyloop.backends.numpy_ops import NumpyOps, sample_from_logits  # noqa: E402
from tinyloop.errors import ConfigError, NonFiniteLogitsError  # noqa: E402
from tinyloop.quant import QuantWeight, dequantize, quantize  # noqa: E402

BITS_G = [(b, g) for b in (4, 8) for g in (32, 64, 128)]
F16_RTOL = 2e-3        # FP16 output rounding (half an ulp is 4.9e-4) plus float accumulation


ALL_GEMVS = pytest.mark.parametrize("ops", ["v1", "v2", "tc"], indirect=True)


# Fresh inputs every session (tests/conftest.py picks TINYLOOP_TEST_SEED; set it to replay);
# the ops, ref and rng fixtures are tests/conftest.py's.
SESSION_SEED = int(os.environ.get("TINYLOOP_TEST_SEED") or 0)


# --- helpers -----------------------------------------------------------------------------------
class FakeCudaPool:
    """The pool interface over plain CuPy buffers (the real CUDA arena is tested elsewhere)."""

    def __init__(self, fail_at: int | None = None):
        self.live, self.calls, self.fail_at = [], 0, fail_at

    def allocate(self, nbytes, tag=None):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise MemoryError(f"injected failure at allocation {self.calls}")
        blk = FakeBlock(self, nbytes, tag)
        self.live.append(blk)
        return blk

    def free(self, blk):
        self.live.remove(blk)

    def allocate_many(self, nbytes, n, tag=None):
        """``MemoryPool.allocate_many``'s contract: n blocks, all or nothing."""
        out = []
        try:
            for _ in range(n):
                out.append(self.allocate(nbytes, tag))
        except BaseException:
            self.free_many(out)
            raise
        return out

    def free_many(self, blocks):
        for blk in list(blocks):
            self.free(blk)


class FakeBlock:
    def __init__(self, pool, nbytes, tag):
        self.pool, self.tag, self.nbytes = pool, tag, int(nbytes)
        self.buf = cupy.empty(max(self.nbytes, 1), dtype=cupy.uint8)
        self.ptr = self.buf.data.ptr
        # block.contiguous_runs reads the segment: each fake block is its own segment
        self.chunk = types.SimpleNamespace(segment=self)

    def array(self, shape, dtype):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        assert n <= self.nbytes
        return self.buf[:n].view(dtype).reshape(shape)

    def free(self):
        self.pool.free(self)


def rand_weight(rng, n, k, bits, g) -> QuantWeight:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w += rng.standard_normal((n, 1)).astype(np.float32) * 0.02   # nonzero group means
    return quantize(w, bits=bits, group_size=g)


def dev_weight(ops, w: QuantWeight, fp16: bool = False) -> QuantWeight:
    """``w`` uploaded through ``ops``; with ``fp16`` it also carries the dense FP16 cache."""
    dw, _blocks = ops.upload_weight(w, FakeCudaPool())
    if fp16:
        dw = dataclasses.replace(dw, fp16=ops.make_fp16_cache(dw, FakeCudaPool())[0])
    return dw


def f16(rng, *shape, scale=1.0):
    """Random FP16 host array and its exact float32 value (what the reference sees)."""
    h = (rng.standard_normal(shape) * scale).astype(np.float16)
    return h, h.astype(np.float32)


def poisoned(shape, dtype):
    a = cupy.empty(shape, dtype=dtype)
    a.fill(np.nan)
    return a


def assert_close(out, ref, *, atol, rtol, what):
    out = np.asarray(cupy.asnumpy(out) if isinstance(out, cupy.ndarray) else out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    nonfinite = ~np.isfinite(out)
    assert not nonfinite.any(), (f"{what}: {int(nonfinite.sum())} of {out.size} outputs are "
                                 f"NaN/inf (first at {np.argwhere(nonfinite)[0].tolist()})")
    err = np.abs(out - ref)
    atol = np.broadcast_to(np.asarray(atol, np.float64), out.shape)   # scalar or per element
    lim = atol + rtol * np.abs(ref)
    if not (err <= lim).all():
        i = np.unravel_index(np.argmax(err - lim), out.shape)
        raise AssertionError(f"{what}: {int((err > lim).sum())} of {out.size} outside "
                             f"atol={atol[i]:.3g} rtol={rtol:.3g}; worst at {list(i)}: "
                             f"out={out[i]:.6g} ref={ref[i]:.6g} err={err[i]:.3g}")


def rms(a) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(a, np.float64))))) + 1e-30


# --- dequantization ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("t", [1, 5])
def test_embed(ops, ref, rng, bits, g, t):
    vocab, d = 1001, 384
    w = rand_weight(rng, vocab, d, bits, g)
    dw = dev_weight(ops, w)
    ids = rng.integers(0, vocab, size=t).astype(np.int32)
    ids[0] = vocab - 1
    want = np.empty((t, d), np.float32)
    ref.embed(w, ids, want)
    for how in ("host", "device"):
        out = poisoned((t, d), cupy.float32)
        ops.embed(dw, ids if how == "host" else cupy.asarray(ids), out)
        assert_close(out, want, atol=1e-7, rtol=1e-6, what=f"embed ids on {how}")


def test_embed_rejects_bad_host_id(ops, rng):
    dw = dev_weight(ops, rand_weight(rng, 10, 64, 8, 32))
    with pytest.raises(ConfigError, match="token id 10"):
        ops.embed(dw, [10], poisoned((1, 64), cupy.float32))


@pytest.mark.parametrize("bits,g", BITS_G)
def test_fp16_cache(ops, rng, bits, g):
    w = rand_weight(rng, 77, 640, bits, g)
    pool = FakeCudaPool()
    arr, blk = ops.make_fp16_cache(dev_weight(ops, w), pool)
    assert blk.tag == "fp16_cache" and arr.dtype == np.float16 and arr.shape == (77, 640)
    assert_close(arr, dequantize(w), atol=1e-6, rtol=1e-3, what="fp16 cache")


# --- RMSNorm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,d", [(1, 576), (3, 100), (67, 1000), (2, 2048)])
def test_rmsnorm(ops, ref, rng, t, d):
    x = (rng.standard_normal((t, d)) * 3).astype(np.float32)
    wt = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    want = np.empty((t, d), np.float32)
    ref.rmsnorm(x, wt, 1e-5, want)
    out = poisoned((t, d), cupy.float16)
    ops.rmsnorm(cupy.asarray(x), cupy.asarray(wt), 1e-5, out)
    assert_close(out, want, atol=1e-3, rtol=F16_RTOL, what="rmsnorm")


# --- linear family ----------------------------------------------------------------------------------
SHAPES = [(1, 100, 640), (1, 960, 256), (7, 100, 640), (130, 200, 256), (65, 64, 1152)]


@ALL_GEMVS
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("t,n,k", SHAPES)
@pytest.mark.parametrize("cache", [False, True])
def test_linear(ops, ref, rng, bits, g, t, n, k, cache):
    if cache and t == 1:
        pytest.skip("the FP16 cache is used only for T > 1")
    w = rand_weight(rng, n, k, bits, g)
    dw = dev_weight(ops, w, fp16=cache)
    xh, x = f16(rng, t, k)
    want = np.empty((t, n), np.float32)
    ref.linear(x, w, want)
    out = poisoned((t, n), cupy.float16)
    ops.linear(cupy.asarray(xh), dw, out)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what="linear")


@ALL_GEMVS
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("t,n,k", [(1, 576, 1536), (1, 70, 256), (130, 576, 1536), (9, 70, 256)])
@pytest.mark.parametrize("cache", [False, True])
def test_linear_residual(ops, ref, rng, bits, g, t, n, k, cache):
    if cache and t == 1:
        pytest.skip("the FP16 cache is used only for T > 1")
    w = rand_weight(rng, n, k, bits, g)
    dw = dev_weight(ops, w, fp16=cache)
    xh, x = f16(rng, t, k)
    res0 = rng.standard_normal((t, n)).astype(np.float32)
    want = res0.copy()
    ref.linear_residual(x, w, want)
    res = cupy.asarray(res0)
    ops.linear_residual(cupy.asarray(xh), dw, res)
    delta = want - res0
    # the cuBLAS path rounds the product to FP16 before the add: half an FP16 ulp of |x @ W.T|
    atol = 2e-3 * rms(delta) + (1e-3 * np.abs(delta) if cache else 0.0)
    assert_close(res, want, atol=atol, rtol=1e-6, what="linear_residual")


@ALL_GEMVS
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("t,f,k", [(1, 1536, 576), (1, 40, 256), (67, 1536, 576), (3, 40, 256)])
@pytest.mark.parametrize("cache", [False, True])
def test_linear_swiglu(ops, ref, rng, bits, g, t, f, k, cache):
    if cache and t == 1:
        pytest.skip("the FP16 cache is used only for T > 1")
    if k % g:
        k = 640
    w = rand_weight(rng, 2 * f, k, bits, g)
    dw = dev_weight(ops, w, fp16=cache)
    xh, x = f16(rng, t, k, scale=3.0)
    want = np.empty((t, f), np.float32)
    ref.linear_swiglu(x, w, None, want)
    out = poisoned((t, f), cupy.float16)
    tmp = poisoned((t + 3, 2 * f), cupy.float16)          # a buffer sized for a larger T
    ops.linear_swiglu(cupy.asarray(xh), dw, tmp, out)
    # T > 1 rounds the weights to FP16 in the GEMM (a random walk of 2^-11 relative errors:
    # <= 2e-3 * ||w_row * x||_2 at 4 sigma) and gate / up to FP16 in tmp (1e-3 relative);
    # propagate both through silu(g) * u.
    gu = NumpyOps._matmul(x, w)
    wd = dequantize(w).astype(np.float64)
    mag = np.sqrt(np.square(x.astype(np.float64)) @ np.square(wd).T)      # [T, 2F]
    g_, u_ = gu[:, :f], gu[:, f:]
    dg = 1e-3 * np.abs(g_) + 2e-3 * mag[:, :f]
    du = 1e-3 * np.abs(u_) + 2e-3 * mag[:, f:]
    sg = 1.0 / (1.0 + np.exp(-g_))
    dsilu = sg * (1.0 + g_ * (1.0 - sg))
    prop = (np.abs(dsilu * u_) * dg + np.abs(g_ * sg) * du) if t > 1 else 0.0
    assert_close(out, want, atol=3e-3 * rms(want) + prop, rtol=F16_RTOL, what="linear_swiglu")


@ALL_GEMVS
@pytest.mark.parametrize("t", [1, 3, 70])
@pytest.mark.parametrize("bits", [4, 8])
def test_lm_head(ops, ref, rng, t, bits):
    vocab, d = 5003, 576
    w = rand_weight(rng, vocab, d, bits, 32)
    dw = dev_weight(ops, w)
    xh, x = f16(rng, t, d)
    want = np.empty((t, vocab), np.float32)
    ref.lm_head(x, w, want)
    out = poisoned((t, vocab), cupy.float32)
    ops.lm_head(cupy.asarray(xh), dw, out)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=1e-3, what="lm_head")


@ALL_GEMVS
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("t", [1, 5, 70])
@pytest.mark.parametrize("e_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("cache", [False, True])
def test_inject(ops, ref, rng, bits, g, t, e_dtype, cache):
    if cache and t == 1:
        pytest.skip("the FP16 cache is used only for T > 1")
    d = 576
    w = rand_weight(rng, d, 2 * d, bits, g) if (2 * d) % g == 0 else None
    if w is None:
        pytest.skip(f"2d={2 * d} is not a multiple of g={g}")
    dw = dev_weight(ops, w, fp16=cache)
    # The GPU rounds both halves to FP16 on the way in; the reference gets those same values.
    state_h = rng.standard_normal((t, d)).astype(np.float16).astype(np.float32)
    e_h = rng.standard_normal((t, d)).astype(np.float16).astype(np.float32)
    want = state_h.copy()
    ref.inject(want, e_h, w, None, None)
    state = cupy.asarray(state_h)
    e = cupy.asarray(e_h.astype(e_dtype))
    ops.inject(state, e, dw, poisoned((t, 2 * d), cupy.float16),
               poisoned((t, d), cupy.float16))
    assert_close(state, want, atol=2e-3 * rms(want), rtol=1e-3, what="inject")


# --- RMSNorm fused into the next projection (T = 1: one gemv_norm_* launch) ----------------------
# d: multiples of 32 (the GEMV's K rule) ragged against the 256-thread block, the 32 lanes and
# the 4-chunk unroll, up to 8192; a g that does not divide d rounds d up to a multiple of g.
NORM_D = [96, 576, 1504, 8192]
EPS = 1e-5


def _fit(d, g):
    return -(-d // g) * g


def resid_row(rng, t, d):
    """A residual row f32 [t, d] (with one outlier per row) and a norm weight f32 [d]."""
    x = (rng.standard_normal((t, d)) * 3).astype(np.float32)
    x[np.arange(t), rng.integers(0, d, size=t)] = 40.0
    wt = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return x, wt


def ref_normed(ref, x, wt):
    """NumpyOps.rmsnorm, rounded to the CUDA activation dtype (FP16) the projection consumes:
    the reference sees the same inputs as the unfused linear tests."""
    n = np.empty_like(x)
    ref.rmsnorm(x, wt, EPS, n)
    return n.astype(np.float16).astype(np.float32)


def assert_within_f16_rounding(fused, unfused, what, atol=2.0 ** -24):
    """fused == unfused to within one FP16 ulp (the kernels are in fact bit-identical)."""
    assert_close(fused, cupy.asnumpy(unfused).astype(np.float64), atol=atol, rtol=2.0 ** -10,
                 what=what)


def assert_unwritten(norm, what):
    assert cupy.isnan(norm).all(), f"{what}: the fused path wrote the norm scratch"


@ALL_GEMVS
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("d", NORM_D)
@pytest.mark.parametrize("n", [960, 100])
def test_rmsnorm_linear_fused(ops, ref, rng, bits, g, d, n):
    d = _fit(d, g)
    w = rand_weight(rng, n, d, bits, g)
    dw = dev_weight(ops, w)
    x, wt = resid_row(rng, 1, d)
    want = np.empty((1, n), np.float32)
    ref.linear(ref_normed(ref, x, wt), w, want)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    out, norm = poisoned((1, n), cupy.float16), poisoned((1, d), cupy.float16)
    ops.rmsnorm_linear(xd, wtd, EPS, dw, out, norm)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what="rmsnorm_linear T=1")
    assert_unwritten(norm, "rmsnorm_linear")
    un, norm2 = poisoned((1, n), cupy.float16), poisoned((1, d), cupy.float16)
    Ops.rmsnorm_linear(ops, xd, wtd, EPS, dw, un, norm2)          # unfused: rmsnorm + linear
    assert_within_f16_rounding(out, un, "rmsnorm_linear fused vs unfused")


@ALL_GEMVS
@pytest.mark.parametrize("bits,g", BITS_G)
@pytest.mark.parametrize("d,f", [(576, 1536), (96, 40), (1504, 200), (8192, 72)])
def test_rmsnorm_linear_swiglu_fused(ops, ref, rng, bits, g, d, f):
    d = _fit(d, g)
    w = rand_weight(rng, 2 * f, d, bits, g)
    dw = dev_weight(ops, w)
    x, wt = resid_row(rng, 1, d)
    want = np.empty((1, f), np.float32)
    ref.linear_swiglu(ref_normed(ref, x, wt), w, None, want)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    out, norm = poisoned((1, f), cupy.float16), poisoned((1, d), cupy.float16)
    tmp = poisoned((4, 2 * f), cupy.float16)
    ops.rmsnorm_linear_swiglu(xd, wtd, EPS, dw, tmp, out, norm)
    assert_close(out, want, atol=3e-3 * rms(want), rtol=F16_RTOL,
                 what="rmsnorm_linear_swiglu T=1")
    assert_unwritten(norm, "rmsnorm_linear_swiglu")
    un, norm2 = poisoned((1, f), cupy.float16), poisoned((1, d), cupy.float16)
    Ops.rmsnorm_linear_swiglu(ops, xd, wtd, EPS, dw, tmp, un, norm2)
    assert_within_f16_rounding(out, un, "rmsnorm_linear_swiglu fused vs unfused")


@ALL_GEMVS
@pytest.mark.parametrize("bits,g,vocab,d", [(4, 32, 5003, 576), (8, 32, 5003, 576),
                                            (4, 128, 1000, 8192), (8, 64, 1000, 8192),
                                            (8, 32, 49157, 576)])
def test_rmsnorm_lm_head_fused(ops, ref, rng, bits, g, vocab, d):
    w = rand_weight(rng, vocab, d, bits, g)
    dw = dev_weight(ops, w)
    x, wt = resid_row(rng, 1, d)
    want = np.empty((1, vocab), np.float32)
    ref.lm_head(ref_normed(ref, x, wt), w, want)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    out, norm = poisoned((1, vocab), cupy.float32), poisoned((1, d), cupy.float16)
    ops.rmsnorm_lm_head(xd, wtd, EPS, dw, out, norm)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=1e-3, what="rmsnorm_lm_head T=1")
    assert_unwritten(norm, "rmsnorm_lm_head")
    un, norm2 = poisoned((1, vocab), cupy.float32), poisoned((1, d), cupy.float16)
    Ops.rmsnorm_lm_head(ops, xd, wtd, EPS, dw, un, norm2)
    assert_within_f16_rounding(out, un, "rmsnorm_lm_head fused vs unfused",
                               atol=2.0 ** -11 * rms(cupy.asnumpy(un)))


@ALL_GEMVS
@pytest.mark.parametrize("bits", [4, 8])
def test_rmsnorm_fused_grid_stride(ops, rng, monkeypatch, bits):
    """A capped grid (blocks striding over rows, each normalizing the row itself) gives
    bit-identical results."""
    d, n, f = 576, 203, 77
    x, wt = (cupy.asarray(a) for a in resid_row(rng, 1, d))
    wl = dev_weight(ops, rand_weight(rng, n, d, bits, 32))
    ws = dev_weight(ops, rand_weight(rng, 2 * f, d, bits, 64))
    norm = poisoned((1, d), cupy.float16)

    def run():
        o1, o2 = poisoned((1, n), cupy.float16), poisoned((1, f), cupy.float16)
        o3 = poisoned((1, n), cupy.float32)
        ops.rmsnorm_linear(x, wt, EPS, wl, o1, norm)
        ops.rmsnorm_linear_swiglu(x, wt, EPS, ws, None, o2, norm)
        ops.rmsnorm_lm_head(x, wt, EPS, wl, o3, norm)
        return [cupy.asnumpy(o) for o in (o1, o2, o3)]
    full = run()
    for cap in (1, 3):
        monkeypatch.setattr(ops, "_grid_cap", cap)         # every v2 and RMSNorm-fused grid
        for a, b in zip(run(), full):
            assert np.isfinite(a).all() and np.array_equal(a, b), f"grid cap {cap}"
    assert_unwritten(norm, "grid stride")


@pytest.mark.parametrize("bits", [4, 8])
def test_rmsnorm_pairs_compose_for_prefill(ops, ref, rng, bits):
    """T > 1: each pair is rmsnorm into ``norm`` then the projection (bit-identical to calling
    the two ops; those are checked against NumPy above)."""
    t, d, n, f, vocab = 5, 576, 70, 40, 300
    x, wt = resid_row(rng, t, d)
    xn = ref_normed(ref, x, wt)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    wl = dev_weight(ops, rand_weight(rng, n, d, bits, 32))
    ws = dev_weight(ops, rand_weight(rng, 2 * f, d, bits, 32))
    wh = dev_weight(ops, rand_weight(rng, vocab, d, bits, 32))
    tmp = poisoned((t, 2 * f), cupy.float16)
    cases = [
        ("rmsnorm_linear", n, cupy.float16,
         lambda o, nm: ops.rmsnorm_linear(xd, wtd, EPS, wl, o, nm),
         lambda o, nm: ops.linear(nm, wl, o)),
        ("rmsnorm_linear_swiglu", f, cupy.float16,
         lambda o, nm: ops.rmsnorm_linear_swiglu(xd, wtd, EPS, ws, tmp, o, nm),
         lambda o, nm: ops.linear_swiglu(nm, ws, tmp, o)),
        ("rmsnorm_lm_head", vocab, cupy.float32,
         lambda o, nm: ops.rmsnorm_lm_head(xd, wtd, EPS, wh, o, nm),
         lambda o, nm: ops.lm_head(nm, wh, o)),
    ]
    for name, cols, dt, pair, proj in cases:
        out, norm = poisoned((t, cols), dt), poisoned((t, d), cupy.float16)
        pair(out, norm)
        assert_close(norm, xn, atol=1e-3, rtol=F16_RTOL, what=f"{name} T={t} norm")
        un, norm2 = poisoned((t, cols), dt), poisoned((t, d), cupy.float16)
        ops.rmsnorm(xd, wtd, EPS, norm2)
        proj(un, norm2)
        a_, b_ = cupy.asnumpy(out), cupy.asnumpy(un)
        assert np.isfinite(a_).all() and np.array_equal(a_, b_), f"{name} T={t}"


def test_rmsnorm_fused_errors_name_the_bad_value(ops, rng):
    dw = dev_weight(ops, rand_weight(rng, 64, 128, 4, 32))
    x, wt = cupy.zeros((1, 128), cupy.float32), cupy.ones(128, cupy.float32)
    out, norm = cupy.empty((1, 64), cupy.float16), cupy.empty((1, 128), cupy.float16)
    with pytest.raises(ConfigError, match="x must be float32, got float16"):
        ops.rmsnorm_linear(x.astype(cupy.float16), wt, EPS, dw, out, norm)
    with pytest.raises(ConfigError, match="in_features=128, but the input has 96"):
        ops.rmsnorm_linear(cupy.zeros((1, 96), cupy.float32), wt, EPS, dw, out, norm)
    with pytest.raises(ConfigError, match=r"weight has shape \(127,\), expected \(128,\)"):
        ops.rmsnorm_lm_head(x, wt[:127], EPS, dw, cupy.empty((1, 64), cupy.float32), norm)
    with pytest.raises(ConfigError, match=r"out has shape \(1, 63\), expected \(1, 64\)"):
        ops.rmsnorm_linear(x, wt, EPS, dw, cupy.empty((1, 63), cupy.float16), norm)
    with pytest.raises(ConfigError, match="out must be float32, got float16"):
        ops.rmsnorm_lm_head(x, wt, EPS, dw, out, norm)


# --- GEMV v2: every lanes-per-row / block size; the LM head's fused argmax -----------------------
_V2_OPS: dict = {}


def v2_ops(lpr, threads):
    """CudaOps whose v2 GEMVs use ``lpr`` lanes per row and ``threads``-thread blocks."""
    if (lpr, threads) not in _V2_OPS:
        _V2_OPS[(lpr, threads)] = CudaOps(KernelChoice(gemv="v2", gemv_lpr=lpr,
                                                       gemv_threads=threads))
    return _V2_OPS[(lpr, threads)]


@pytest.mark.parametrize("lpr", [4, 8, 16, 32])
@pytest.mark.parametrize("threads", [64, 128, 256])
@pytest.mark.parametrize("bits,g,n,k", [(4, 32, 203, 576), (8, 32, 37, 1536), (4, 64, 11, 8192),
                                        (8, 128, 70, 4096)])
def test_gemv2_geometries(ref, rng, lpr, threads, bits, g, n, k):
    """Each v2 geometry, each epilogue, against NumPy; a capped grid (rows strided, every
    block normalizing the row) bit-identical to the full one; the RMSNorm-fused kernels
    bit-identical to rmsnorm + the same GEMV. K = 4096 / 8192 with 4 lanes per row takes
    several batches of chunks per row."""
    o = v2_ops(lpr, threads)
    w = rand_weight(rng, 2 * n, k, bits, g)          # 2n rows (gate|up for the SwiGLU epilogue)
    dw = dev_weight(o, w)
    assert o._info(dw).lpr == lpr
    xh, x = f16(rng, 1, k)
    xr, wt = resid_row(rng, 1, k)
    res0 = rng.standard_normal((1, 2 * n)).astype(np.float32)
    xn = ref_normed(ref, xr, wt)
    want, want_sw = np.empty((1, 2 * n), np.float32), np.empty((1, n), np.float32)
    want_n, want_nsw = np.empty((1, 2 * n), np.float32), np.empty((1, n), np.float32)
    want_res = res0.copy()
    ref.linear(x, w, want)
    ref.linear_swiglu(x, w, None, want_sw)
    ref.linear_residual(x, w, want_res)
    ref.linear(xn, w, want_n)
    ref.linear_swiglu(xn, w, None, want_nsw)
    xd, xrd, wtd = cupy.asarray(xh), cupy.asarray(xr), cupy.asarray(wt)
    norm = poisoned((1, k), cupy.float16)

    def run():
        outs = [poisoned((1, 2 * n), cupy.float16), poisoned((1, 2 * n), cupy.float32),
                poisoned((1, n), cupy.float16), cupy.asarray(res0),
                poisoned((1, 2 * n), cupy.float16), poisoned((1, n), cupy.float16),
                poisoned((1, 2 * n), cupy.float32)]
        o.linear(xd, dw, outs[0])
        o.lm_head(xd, dw, outs[1])
        o.linear_swiglu(xd, dw, None, outs[2])
        o.linear_residual(xd, dw, outs[3])
        o.rmsnorm_linear(xrd, wtd, EPS, dw, outs[4], norm)
        o.rmsnorm_linear_swiglu(xrd, wtd, EPS, dw, None, outs[5], norm)
        o.rmsnorm_lm_head(xrd, wtd, EPS, dw, outs[6], norm)
        return [cupy.asnumpy(a) for a in outs]
    full = run()
    for cap in (1, 3):
        o._grid_cap = cap
        try:
            capped = run()
        finally:
            o._grid_cap = None
        for i, (a, b) in enumerate(zip(capped, full)):
            assert np.array_equal(a, b), f"output {i}: grid cap {cap} differs"
    f16_, f32_, sw, res, n16, nsw, n32 = full
    what = f"v2 lpr={lpr} threads={threads}"
    assert_close(f16_, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what=f"{what} linear")
    assert_close(f32_, want, atol=2e-3 * rms(want), rtol=1e-3, what=f"{what} lm_head")
    assert_close(sw, want_sw, atol=3e-3 * rms(want_sw), rtol=F16_RTOL, what=f"{what} swiglu")
    assert_close(res, want_res, atol=2e-3 * rms(want_res - res0), rtol=1e-6,
                 what=f"{what} residual")
    assert_close(n16, want_n, atol=2e-3 * rms(want_n), rtol=F16_RTOL, what=f"{what} norm+linear")
    assert_close(nsw, want_nsw, atol=3e-3 * rms(want_nsw), rtol=F16_RTOL,
                 what=f"{what} norm+swiglu")
    assert_close(n32, want_n, atol=2e-3 * rms(want_n), rtol=1e-3, what=f"{what} norm+lm_head")
    assert_unwritten(norm, what)
    # fused == rmsnorm + the same v2 GEMV, bit for bit (the norm prologue emulates rmsnorm.cu)
    nrm = poisoned((1, k), cupy.float16)
    o.rmsnorm(xrd, wtd, EPS, nrm)
    u16, usw, u32 = (poisoned((1, 2 * n), cupy.float16), poisoned((1, n), cupy.float16),
                     poisoned((1, 2 * n), cupy.float32))
    o.linear(nrm, dw, u16)
    o.linear_swiglu(nrm, dw, None, usw)
    o.lm_head(nrm, dw, u32)
    for name, a, b in (("linear", n16, u16), ("swiglu", nsw, usw), ("lm_head", n32, u32)):
        assert np.array_equal(a, cupy.asnumpy(b)), f"{what}: fused {name} != rmsnorm + {name}"


def _device_id(ops) -> tuple:
    """The device copy of the fused argmax's (id, fault code) (what a captured step would
    feed back)."""
    mem = cupy.cuda.UnownedMemory(ops._id_dev, 8, ops)
    got = cupy.ndarray((2,), cupy.int32, cupy.cuda.MemoryPointer(mem, 0)).get()
    return int(got[0]), int(got[1])


def _copy_row(w: QuantWeight, src: int, dst: int) -> None:
    for name in ("qweight", "scales", "zeros"):
        getattr(w, name)[dst] = getattr(w, name)[src]


@pytest.mark.parametrize("bits,g,vocab,d", [(8, 32, 49152, 576), (4, 32, 5003, 576),
                                            (8, 32, 49157, 576), (4, 128, 1000, 8192),
                                            (8, 32, 1, 64)])
@pytest.mark.parametrize("case", ["plain", "ties", "nan"])
def test_lm_head_argmax(ops, ref, rng, bits, g, vocab, d, case):
    """rmsnorm_lm_head_sample at temperature 0: one launch whose id is numpy.argmax of the
    logits it wrote (the lowest id among equal maxima; a NaN row raises NonFiniteLogitsError as
    sample does, with the first NaN's id and code 1 on the device), also under grid caps
    1 / 3 and on repeated launches (the last-block ticket re-arms); the logits match NumPy,
    and the id is NumPy's argmax wherever the top-2 margin exceeds the tolerance."""
    w = rand_weight(rng, vocab, d, bits, g)
    x, wt = resid_row(rng, 1, d)
    want = np.empty((1, vocab), np.float32)
    ref.lm_head(ref_normed(ref, x, wt), w, want)
    expect_id = None
    if case == "ties" and vocab > 2:          # the best row copied to a lower and the last id
        first = poisoned((1, vocab), cupy.float32)          # the kernel's own best row
        ops.rmsnorm_lm_head(cupy.asarray(x), cupy.asarray(wt), EPS, dev_weight(ops, w), first,
                            poisoned((1, d), cupy.float16))
        m = int(np.argmax(cupy.asnumpy(first)[0]))
        lo = m // 2 if m else 1
        _copy_row(w, m, lo)
        _copy_row(w, m, vocab - 1)
        expect_id = min(m, lo)
    if case == "nan":                         # NaN scales: NaN logits; the first NaN wins
        bad = sorted(rng.choice(vocab, min(2, vocab), replace=False).tolist())
        w.scales[bad, 0] = np.float16(np.nan)     # vocab 1: its one row (was left finite)
        expect_id = bad[0]
    ref.lm_head(ref_normed(ref, x, wt), w, want)
    dw = dev_weight(ops, w)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    norm = poisoned((1, d), cupy.float16)
    ids, rows = [], []
    for cap in (None, 1, 3, None):
        ops._grid_cap = cap
        try:
            out = poisoned((1, vocab), cupy.float32)
            if case == "nan":                 # refused as sample refuses it (fault code 1)
                with pytest.raises(NonFiniteLogitsError) as err:
                    ops.rmsnorm_lm_head_sample(xd, wtd, EPS, dw, out, norm, 0.0, 0, 1.0, 0.0)
                assert err.value.kind == "nan"
                ids.append(_device_id(ops)[0])
            else:
                ids.append(ops.rmsnorm_lm_head_sample(xd, wtd, EPS, dw, out, norm, 0.0, 0,
                                                      1.0, 0.0))
            rows.append(cupy.asnumpy(out)[0])
        finally:
            ops._grid_cap = None
        assert _device_id(ops) == (ids[-1], 1 if case == "nan" else 0)
    logits = rows[0]
    for r in rows[1:]:
        assert np.array_equal(r, logits, equal_nan=True)
    assert len(set(ids)) == 1, f"ids differ across grid caps / launches: {ids}"
    got = ids[0]
    assert got == int(np.argmax(logits))
    if case != "nan":
        assert got == sample_from_logits(logits, 0.0, 0, 1.0, 0.5)
    assert_unwritten(norm, "rmsnorm_lm_head_sample")
    if expect_id is not None:
        assert got == expect_id, f"{case}: got id {got}, expected {expect_id}"
    if case == "nan":
        return
    atol = 2e-3 * rms(want)
    assert_close(logits, want[0], atol=atol, rtol=1e-3, what="fused head logits")
    top2 = np.sort(want[0])[-2:] if vocab > 1 else np.array([0.0, 1.0])
    if case == "plain" and top2[1] - top2[0] > 4 * (atol + 1e-3 * abs(top2[1])):
        assert got == int(np.argmax(want[0]))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.0, 40, 0.9)])
def test_lm_head_sample_nongreedy(ops, ref, rng, temperature, top_k, top_p):
    """temperature > 0: the logits rmsnorm_lm_head writes, then sample: the rule's pick."""
    vocab, d = 3001, 576
    w = rand_weight(rng, vocab, d, 8, 32)
    dw = dev_weight(ops, w)
    x, wt = resid_row(rng, 1, d)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    out, norm = poisoned((1, vocab), cupy.float32), poisoned((1, d), cupy.float16)
    for u in rng.random(10):
        got = ops.rmsnorm_lm_head_sample(xd, wtd, EPS, dw, out, norm, temperature, top_k,
                                         top_p, float(u))
        logits = cupy.asnumpy(out)[0]
        assert got == sample_from_logits(logits, temperature, top_k, top_p, float(u))


def test_gemv_choice_errors_name_the_field(monkeypatch):
    with pytest.raises(ConfigError, match="KernelChoice.gemv="):
        CudaOps(KernelChoice(gemv="v3"))
    monkeypatch.setenv("TINYLOOP_GEMV_LPR", "6")                # no longer read
    assert CudaOps().kernels.gemv_lpr is None


# --- RoPE and attention ------------------------------------------------------------------------
HEADS = [(9, 3, 64), (4, 4, 32), (6, 2, 128), (3, 1, 16), (5, 1, 80)]


def qkv_rows(rng, t, h, hkv, hd, extra=0):
    return f16(rng, t, (h + 2 * hkv) * hd + extra)


def kv_pair(ops, ref, mode, h, hkv, hd, capacity, page_size, d_model=64):
    """The same one-slot paged cache on both backends: (numpy cache, cuda cache).
    ``d_model``: the width of the stored h rows (store-h modes)."""
    from tinyloop.config import ModelConfig
    from tinyloop.kv import PageAllocator, RuntimeKVCache
    from tinyloop.memory import MemoryPool
    cfg = ModelConfig(vocab_size=8, d_model=d_model, n_heads=h, n_kv_heads=hkv, head_dim=hd,
                      ffn_dim=8, n_prelude=1, n_recurrent=0, n_coda=0)
    host = MemoryPool("host")
    c_ref = RuntimeKVCache(ref, host, cfg, 1, capacity, (mode,), PageAllocator(ref, host),
                           page_size)
    dev = FakeCudaPool()
    c_dev = RuntimeKVCache(ops, dev, cfg, 1, capacity, (mode,), PageAllocator(ops, dev),
                           page_size)
    c_ref.ensure(capacity)
    c_dev.ensure(capacity)
    return c_ref, c_dev


def gather(kv, n, dev: bool) -> dict:
    """Every part of positions 0..n-1 of a slot, on the host, read through its block table."""
    p = kv.page_size
    out = {}
    for part in kv.layout.parts:
        rows = [kv.page_parts(i)[part.name] for i in range(-(-n // p))]
        rows = [cupy.asnumpy(r) if dev else np.asarray(r) for r in rows]
        out[part.name] = np.concatenate(rows)[:n]
    return out


PAGES = [1, 16, 32, 48]


@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("t,pos0", [(1, 0), (1, 4097), (17, 0), (70, 5), (3, 100000)])
@pytest.mark.parametrize("p", [16, 32])
def test_kv_write_fp16(ops, ref, rng, h, hkv, hd, t, pos0, p):
    theta = 10000.0 if hd != 128 else 500000.0
    qh, q = qkv_rows(rng, t, h, hkv, hd)
    c_ref, c_dev = kv_pair(ops, ref, "fp16", h, hkv, hd, pos0 + t + 2, p)
    qkv_ref = q.copy()
    ref.kv_write(qkv_ref, None, pos0, theta, h, hkv, hd, c_ref.slot(0))
    qkv = cupy.asarray(qh)
    ops.kv_write(qkv, None, pos0, theta, h, hkv, hd, c_dev.slot(0))
    assert_close(qkv, qkv_ref, atol=1e-3, rtol=F16_RTOL, what="rope q (+ untouched k|v)")
    n = pos0 + t + 2
    got, want = gather(c_dev.slot(0), n, True), gather(c_ref.slot(0), n, False)
    rows = slice(pos0, pos0 + t)
    assert_close(got["k"][rows], want["k"][rows], atol=1e-3, rtol=F16_RTOL, what="paged k")
    assert_close(got["v"][rows], want["v"][rows], atol=0, rtol=0, what="paged v")
    for name in ("k", "v"):                 # pages are zeroed at allocation; nothing else written
        others = got[name].copy()
        others[rows] = 0
        assert not others.any(), f"kv_write wrote {name} rows outside {pos0}..{pos0 + t - 1}"


@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("scale", [300.0, 1.0, 0.02])
def test_kv_write_int8_codes_match_numpy(ops, ref, rng, h, hkv, hd, scale):
    """Position 0 (RoPE is the identity there): K and V codes and scales byte-identical to
    the NumPy reference. Later positions: V identical, K within one code (the rotation is
    float32 here, float64 there)."""
    t = 40
    qh, q = qkv_rows(rng, t, h, hkv, hd)
    qh = (q * scale).astype(np.float16)
    q = qh.astype(np.float32)
    qh[5, h * hd:] = 0                                    # a zero row: s = 0, codes 0
    q[5, h * hd:] = 0
    c_ref, c_dev = kv_pair(ops, ref, "int8", h, hkv, hd, t, 16)
    ref.kv_write(q.copy(), None, 0, 1e4, h, hkv, hd, c_ref.slot(0))
    ops.kv_write(cupy.asarray(qh), None, 0, 1e4, h, hkv, hd, c_dev.slot(0))
    got, want = gather(c_dev.slot(0), t, True), gather(c_ref.slot(0), t, False)
    for name in ("v", "v_scale"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("k", "k_scale"):
        np.testing.assert_array_equal(got[name][0], want[name][0], err_msg=name + " at pos 0")
    assert np.abs(got["k"].astype(int) - want["k"].astype(int)).max() <= 1
    np.testing.assert_allclose(got["k_scale"].astype(np.float32),
                               want["k_scale"].astype(np.float32), rtol=2e-3)
    assert not got["v"][5].any() and not got["v_scale"][5].any()
    # read back within half a quantization step: neither clipped nor zeroed
    v = q[:, (h + hkv) * hd:].reshape(t, hkv, hd)
    deq = got["v"].astype(np.float32) * got["v_scale"].astype(np.float32)[..., None]
    step = np.abs(v).max(-1, keepdims=True) / 127
    assert (np.abs(deq - v) <= 0.5 * step * (1 + 2e-3) + 1e-12).all()


def special_kv_rows(rng, h, hkv, hd):
    """FP16 qkv rows [6, (h + 2 hkv) hd] whose K / V heads FP16 can only just hold: +-65504
    (RoPE turns such a K pair past FP16's range), FP16 subnormals, zeros, and heads holding
    NaN, +inf or -inf (one bad head each, the rest random)."""
    t, kv0 = 6, h * hd
    qh, _ = qkv_rows(rng, t, h, hkv, hd)
    kvw = 2 * hkv * hd
    qh[0, kv0:] = np.where(rng.uniform(size=kvw) < 0.5, -65504.0, 65504.0)
    qh[1, kv0:] = rng.uniform(-6e-6, 6e-6, kvw)
    qh[2, kv0:] = 0
    qh[3, kv0 + 5] = np.nan                                   # K head 0
    qh[4, kv0 + (2 * hkv - 1) * hd + 1] = np.inf              # the last V head
    qh[5, kv0 + hkv * hd] = -np.inf                           # V head 0
    return qh, qh.astype(np.float32)


@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_kv_write_special_values_match_numpy(ops, ref, rng, h, hkv, hd, mode):
    """int8 at position 0 (RoPE the identity): codes and scales byte-identical to the NumPy
    reference, saturating scales included, a head holding NaN / inf with the NaN scale and
    codes 0 there too, every other head finite. fp16 at positions 37..: a rotated K pair
    past FP16's range is stored as +-65504 (finite), NaN / inf stay non-finite where the
    reference's are."""
    from tinyloop.quant import saturate_f16
    qh, q = special_kv_rows(rng, h, hkv, hd)
    t = qh.shape[0]
    pos0 = 0 if mode == "int8" else 37
    c_ref, c_dev = kv_pair(ops, ref, mode, h, hkv, hd, pos0 + t, 16)
    ref.kv_write(q.copy(), None, pos0, 1e4, h, hkv, hd, c_ref.slot(0))
    ops.kv_write(cupy.asarray(qh), None, pos0, 1e4, h, hkv, hd, c_dev.slot(0))
    rows = slice(pos0, pos0 + t)
    got = {k: v[rows] for k, v in gather(c_dev.slot(0), pos0 + t, True).items()}
    want = {k: v[rows] for k, v in gather(c_ref.slot(0), pos0 + t, False).items()}
    if mode == "int8":
        for name in ("v", "v_scale"):
            np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8),
                                          err_msg=name)
        for name in ("k", "k_scale"):                          # RoPE is exact only at 0
            np.testing.assert_array_equal(got[name][0].view(np.uint8),
                                          want[name][0].view(np.uint8), err_msg=name)
        np.testing.assert_array_equal(np.isnan(got["k_scale"]), np.isnan(want["k_scale"]))
        bad = {(3, "k", 0), (4, "v", hkv - 1), (5, "v", 0)}
        for r in range(t):
            for part in ("k", "v"):
                for j in range(hkv):
                    s = got[part + "_scale"][r, j]
                    assert np.isnan(s) == ((r, part, j) in bad), (r, part, j)
                    if (r, part, j) in bad:
                        assert not got[part][r, j].any()
        assert (np.abs(got["v_scale"][0].astype(np.float32)) <= 65504).all()
        return
    for name in ("k", "v"):
        g = got[name].astype(np.float32)
        w = saturate_f16(want[name]).astype(np.float32)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w), err_msg=name)
        fin = np.isfinite(w)
        assert_close(g[fin], w[fin], atol=1e-3, rtol=F16_RTOL, what=f"paged {name}")
    assert np.abs(want["k"][0]).max() > 65504                 # the case is the one meant
    assert np.isfinite(got["k"][0].astype(np.float32)).all()


def copy_pages(src_kv, dst_kv, mode: str, npages: int) -> None:
    """Pages 0..npages-1 of NumPy slot ``src_kv`` into CUDA slot ``dst_kv``, byte for byte,
    each through its own block table (fp16 mode: rounded to FP16 first, on both sides)."""
    for i in range(npages):
        src, dst = src_kv.page_parts(i), dst_kv.page_parts(i)
        for name, arr in src.items():
            if mode == "fp16":
                arr[...] = arr.astype(np.float16)        # the stored values, as FP16
            dst[name].set(np.ascontiguousarray(arr).astype(dst[name].dtype))


def _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, t, pos0, p, step=False, window=0):
    """The NumPy cache is filled by its kv_write; its pages are copied byte for byte into the
    CUDA pages (fp16 mode: rounded to FP16 first, on both sides), so both attentions read the
    same stored values through their own block tables. ``window``: both sliding-window (the
    NumPy reference's mask: keys p-window+1..p)."""
    ctx = pos0 + t
    c_ref, c_dev = kv_pair(ops, ref, mode, h, hkv, hd, ctx, p)
    _, allq = qkv_rows(rng, ctx, h, hkv, hd, extra=8)   # extra columns: a padded qkv row
    ref.kv_write(allq.copy(), None, 0, 1e4, h, hkv, hd, c_ref.slot(0))
    copy_pages(c_ref.slot(0), c_dev.slot(0), mode, -(-ctx // p))
    qh = allq[pos0:].astype(np.float16)
    q = qh.astype(np.float32)
    want = np.empty((t, h * hd), np.float32)
    ref.kv_attention(q, c_ref.slot(0), pos0, h, hkv, hd, want, window=window)
    out = poisoned((t, h * hd), cupy.float16)
    if step:                                  # the position from a device step state
        state = np.zeros(STEP_WORDS, np.int32)
        state[STEP_POS] = pos0
        ops.kv_attention_step(cupy.asarray(qh), c_dev.slot(0), cupy.asarray(state), h, hkv, hd,
                              out, window=window)
    else:
        ops.kv_attention(cupy.asarray(qh), c_dev.slot(0), pos0, h, hkv, hd, out, window=window)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL,
                 what=f"{mode} attention T={t} pos0={pos0} P={p} step={step} window={window} "
                      f"(seed {SESSION_SEED})")
    return want


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("t,pos0", [(2, 0), (67, 0), (200, 0), (64, 37), (33, 300)])
@pytest.mark.parametrize("p", [16, 32, 48])
def test_paged_attention_prefill(ops, ref, rng, monkeypatch, mode, h, hkv, hd, t, pos0, p):
    """The scalar prefill kernel (attention.cu, the slow reference) against NumPy with this
    file's float tolerance; the tensor-core kernel, which rounds int8 K/V and P to FP16, has
    its own argued bounds in tests/kernels/test_attn_prefill_gpu.py."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_prefill="scalar"))
    _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, t, pos0, p)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("ctx", [1, 2, 31, 32, 33, 255, 256, 257, 1000, 3000])
def test_paged_attention_decode(ops, ref, rng, mode, h, hkv, hd, ctx):
    _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, 1, ctx - 1, 32)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("p", [16, 32])
@pytest.mark.parametrize("ctx", ["1", "P-1", "P", "P+1", "2047", "4096"])
@pytest.mark.parametrize("splits", [1, 3, 16, 64])
def test_decode_split(ops, ref, rng, monkeypatch, mode, h, hkv, hd, p, ctx, splits):
    """Split-K decode attention (attention_decode.cu) with a forced split count (more splits
    than pages leaves splits empty) against NumPy's kv_attention."""
    n = {"1": 1, "P-1": p - 1, "P": p, "P+1": p + 1}.get(ctx) or int(ctx)
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="split"))
    monkeypatch.setattr(cuda_attention, "decode_splits", lambda *a: splits)
    _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, 1, n - 1, p)


@pytest.mark.parametrize("version", ["v1", "split"])
@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("ctx", [1, 33, 2047, 4096])
def test_decode_versions_and_step_state(ops, ref, rng, monkeypatch, version, mode, ctx):
    """KernelChoice.attn_decode's both kernels with the host's split rule, and
    kv_attention_step reading ctx from a device step state (split-K: on the device; v1: on
    the host)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode=version))
    for step in (False, True):
        _paged_attention_case(ops, ref, rng, mode, 9, 3, 64, 1, ctx - 1, 32, step=step)


# --- sliding-window attention: every kernel a sliding layer reaches, against NumPy's mask -----
WINDOW_HEADS = [(9, 3, 64), (4, 2, 96), (6, 2, 128)]
# 1: the query's own key only; 5: inside a page or across one; 64: several pages; 10**6: wider
# than every context here (full attention through the window code)
WINDOWS = [1, 5, 64, 10**6]


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", WINDOW_HEADS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("ctx", [1, 16, 17, 35, 300, 2049])
def test_decode_v1_sliding_window(ops, ref, rng, monkeypatch, mode, h, hkv, hd, window, ctx):
    """The one-block-per-head decode kernel (attention.cu) with a window, P = 16: the window
    starts inside a page, on a page boundary (ctx 17, window 1: key 16 alone) and across
    one (ctx 17 / 35, window 5); host position and the device step state (v1 reads the
    length on the host for the step kernel too)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="v1"))
    for step in (False, True):
        _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, 1, ctx - 1, 16, step=step,
                              window=window)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", WINDOW_HEADS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("ctx", [17, 35, 300, 2049, 4096])
@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("p", [16, 32])
def test_decode_split_sliding_window(ops, ref, rng, monkeypatch, mode, h, hkv, hd, window, ctx,
                                     splits, p):
    """Split-K decode (attention_decode.cu) with a forced split count and a window: only the
    window's pages are dealt to the splits (more splits than window pages leaves splits
    empty, which the combine must weigh 0), the first split starting at the window's first
    key inside its page; the position from the host and from the device step state (the
    captured step's path)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="split"))
    monkeypatch.setattr(cuda_attention, "decode_splits", lambda *a: splits)
    for step in (False, True):
        _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, 1, ctx - 1, p, step=step,
                              window=window)


@pytest.mark.parametrize("version", ["v1", "split"])
@pytest.mark.parametrize("window", [5, 200])
def test_decode_window_with_the_host_split_rule(ops, ref, rng, monkeypatch, version, window):
    """The host's own split choice for a sliding layer (the window's key count picks it:
    single-pass for a short window whatever the context) at contexts of 129 to 4096 keys."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode=version))
    for ctx in (129, 1000, 4096):
        for step in (False, True):
            _paged_attention_case(ops, ref, rng, "fp16", 9, 3, 64, 1, ctx - 1, 32, step=step,
                                  window=window)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", WINDOW_HEADS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("t,pos0", [(2, 0), (67, 0), (64, 37), (33, 300), (200, 0)])
def test_scalar_prefill_sliding_window(ops, ref, rng, monkeypatch, mode, h, hkv, hd, window,
                                       t, pos0):
    """The scalar prefill kernel (attention.cu) with a window, P = 16: the rows of one warp
    (8 consecutive positions) and one block (64) have different first keys, so a 32-key tile
    holds none of some rows' keys (window 1 / 5: rows whose running max is still -inf) and
    tiles before the block's first window are skipped (pos0 = 300)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_prefill="scalar"))
    _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, t, pos0, 16, window=window)


def test_a_window_changes_the_output(ops, ref, rng):
    """The window cases test a real mask: on the same cache and query (the same draws), window
    5 at 300 keys differs from full attention by far more than the kernel bound, so a kernel
    ignoring the window fails the cases above."""
    seed = int(rng.integers(1 << 30))
    want = _paged_attention_case(ops, ref, np.random.default_rng(seed), "fp16", 9, 3, 64, 1,
                                 299, 16, window=5)
    full = _paged_attention_case(ops, ref, np.random.default_rng(seed), "fp16", 9, 3, 64, 1,
                                 299, 16)
    assert np.abs(want - full).max() > 10 * (2e-3 * rms(full) + F16_RTOL * np.abs(full).max())


def test_paged_ops_refuse_a_missing_page_and_an_unbuilt_mode(ops, ref, rng):
    c_ref, c_dev = kv_pair(ops, ref, "fp16", 4, 2, 16, 64, 16)
    c_dev.table_host[0, 2] = 0                           # as if position 32.. had no page
    qh, _ = qkv_rows(rng, 1, 4, 2, 16)
    with pytest.raises(ConfigError, match="position 40 has no page"):
        ops.kv_attention(cupy.asarray(qh), c_dev.slot(0), 40, 4, 2, 16,
                         cupy.empty((1, 64), cupy.float16))


# --- sampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 1000, 49152, 50001])
def test_sample_greedy(ops, rng, vocab):
    logits = rng.standard_normal(vocab).astype(np.float32)
    if vocab > 10:
        top = logits.max() + 1.0
        logits[[vocab - 3, 7, vocab // 2]] = top                # ties: lowest id wins
    got = ops.sample(cupy.asarray(logits), 0.0, 0, 1.0, 0.5)
    assert got == int(np.argmax(logits)) == sample_from_logits(logits, 0.0, 0, 1.0, 0.5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 40, 1.0),
                                                     (1.3, 0, 0.9), (0.8, 50, 0.95),
                                                     (2.0, 1, 1.0)])
def test_sample_nongreedy(ops, rng, temperature, top_k, top_p):
    logits = (rng.standard_normal(2003) * 3).astype(np.float32)
    dev = cupy.asarray(logits)
    for u in rng.random(20):
        want = sample_from_logits(logits, temperature, top_k, top_p, float(u))
        assert ops.sample(dev, temperature, top_k, top_p, float(u)) == want, f"u={u}"


@pytest.mark.parametrize("vocab", [1, 2, 7, 2003, 49152])
def test_sample_device_matches_rule(ops, rng, vocab):
    """sample.cu's one-block sampler (temperature > 0) picks sample_from_logits's token, for
    ties (equal logits ranked by id), +0 / -0, top_k 1 / k / >= vocab, top_p tiny / mid / off.
    u stays below 1 - 2^-30: within
    ~2^-40 of 1 the fixed-point kernel may pick another zero-mass tail token (documented)."""
    for trial in range(12):
        logits = (rng.standard_normal(vocab) * rng.choice([0.5, 3.0, 10.0])).astype(np.float32)
        if trial % 3 == 0 and vocab > 10:
            logits[rng.integers(0, vocab, vocab // 3)] = logits[rng.integers(0, vocab)]
        if trial % 4 == 1 and vocab > 3:
            logits[:3] = np.array([0.0, -0.0, 0.0], np.float32)
        temperature = float(rng.choice([0.3, 0.7, 1.0, 2.0]))
        top_k = int(rng.choice([0, 1, 5, 40, vocab, vocab + 3]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 1e-6]))
        dev = cupy.asarray(logits)
        for u in list(rng.random(4)) + [0.0]:
            want = sample_from_logits(logits, temperature, top_k, top_p, float(u))
            got = ops.sample(dev, temperature, top_k, top_p, float(u))
            assert got == want, (vocab, trial, temperature, top_k, top_p, u, got, want)


def test_sample_past_the_device_vocabulary_takes_the_rule(ops, rng):
    """A row longer than the fixed-point sampler takes (2^22) is sampled by the NumPy rule on
    the host: the same pick, and the same NonFiniteLogitsError for a NaN row."""
    from tinyloop.backends.cuda.sampling import _SAMPLE_MAX_N
    from tinyloop.errors import NonFiniteLogitsError
    logits = (rng.standard_normal(_SAMPLE_MAX_N + 5) * 3).astype(np.float32)
    dev = cupy.asarray(logits)
    for u in (0.0, 0.37, 0.9):
        assert ops.sample(dev, 0.8, 40, 0.95, u) == sample_from_logits(logits, 0.8, 40, 0.95, u)
    dev[7] = np.nan
    with pytest.raises(NonFiniteLogitsError):
        ops.sample(dev, 0.8, 0, 1.0, 0.5)


def test_sample_top_p_0_is_greedy(ops, rng):
    logits = (rng.standard_normal(2003) * 3).astype(np.float32)
    logits[[5, 900]] = logits.max() + 1.0                       # a tie: the lower id
    dev = cupy.asarray(logits)
    for u in (0.0, 0.5, 0.999):
        assert ops.sample(dev, 1.0, 0, 0.0, u) == 5 == sample_from_logits(logits, 1.0, 0, 0.0, u)


def _faulty_rows(vocab: int) -> list:
    """(logits, kind) rows no token can be sampled from, of each fault kind."""
    base = np.linspace(-3, 3, vocab, dtype=np.float32)
    nan_one, pinf, ninf_some = base.copy(), base.copy(), base.copy()
    nan_one[vocab - 1] = np.nan                                 # the last element: the
    pinf[vocab // 3] = np.inf                                   # reduction must see it
    ninf_some[: vocab // 2] = -np.inf                           # a masked half is fine
    return [(np.full(vocab, np.nan, np.float32), "nan"), (nan_one, "nan"),
            (np.array([0, np.inf] + [0] * (vocab - 2), np.float32), "+inf"), (pinf, "+inf"),
            (np.full(vocab, -np.inf, np.float32), "all -inf"), (ninf_some, None)]


@pytest.mark.parametrize("vocab", [2, 1000, 49152])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_non_finite_logits_raise(ops, vocab, temperature):
    """The temperature > 0 sampler (sample.cu's) and the argmax."""
    from tinyloop.errors import NonFiniteLogitsError
    for logits, kind in _faulty_rows(vocab):
        dev = cupy.asarray(logits)
        if kind is None:                                        # -inf marks a masked token
            got = ops.sample(dev, temperature, 0, 1.0, 0.3)
            assert got == sample_from_logits(logits, temperature, 0, 1.0, 0.3)
            assert got >= vocab // 2
            continue
        with pytest.raises(NonFiniteLogitsError) as want:
            sample_from_logits(logits, temperature, 0, 1.0, 0.3)
        with pytest.raises(NonFiniteLogitsError) as got:
            ops.sample(dev, temperature, 0, 1.0, 0.3)
        assert got.value.kind == want.value.kind == kind
        assert str(got.value) == str(want.value)
    # the flag does not stick: a clean row afterwards samples normally
    clean = np.arange(vocab, dtype=np.float32)
    assert ops.sample(cupy.asarray(clean), 0.0, 0, 1.0, 0.0) == vocab - 1


# --- boundary checks and weight upload ----------------------------------------------------------
def test_wrapper_errors_name_the_bad_value(ops, rng):
    dw = dev_weight(ops, rand_weight(rng, 64, 128, 4, 32))
    x = cupy.zeros((2, 128), cupy.float16)
    with pytest.raises(ConfigError, match="x must be float16, got float32"):
        ops.linear(x.astype(cupy.float32), dw, cupy.empty((2, 64), cupy.float16))
    with pytest.raises(ConfigError, match=r"out has shape \(2, 63\), expected \(2, 64\)"):
        ops.linear(x, dw, cupy.empty((2, 63), cupy.float16))
    with pytest.raises(ConfigError, match="in_features=128, but the input has 96"):
        ops.linear(cupy.zeros((2, 96), cupy.float16), dw, cupy.empty((2, 64), cupy.float16))
    with pytest.raises(ConfigError, match="C-contiguous"):
        ops.linear(cupy.zeros((2, 256), cupy.float16)[:, ::2], dw,
                   cupy.empty((2, 64), cupy.float16))
    with pytest.raises(ConfigError, match="cupy.ndarray"):
        ops.rmsnorm(np.zeros((1, 8), np.float32), cupy.ones(8, cupy.float32), 1e-5,
                    cupy.empty((1, 8), cupy.float16))
    _, c40 = kv_pair(ops, NumpyOps(), "fp16", 1, 1, 40, 4, 16)
    with pytest.raises(ConfigError, match="head_dim=40 has no attention kernel"):
        ops.kv_attention(cupy.zeros((1, 120), cupy.float16), c40.slot(0), 0, 1, 1, 40,
                         cupy.empty((1, 40), cupy.float16))
    _, c64 = kv_pair(ops, NumpyOps(), "fp16", 1, 1, 64, 4, 16)
    with pytest.raises(ConfigError, match="kv.table has 1 pages of 16 positions, need 17"):
        ops.kv_write(cupy.zeros((2, 192), cupy.float16), None, 15, 1e4, 1, 1, 64, c64.slot(0))


def test_upload_weight_frees_on_failure(ops, rng):
    w = rand_weight(rng, 32, 64, 4, 32)
    pool = FakeCudaPool()
    dw, blocks = ops.upload_weight(w, pool)
    assert len(blocks) == 3 and len(pool.live) == 3
    for name in ("qweight", "scales", "zeros"):
        np.testing.assert_array_equal(cupy.asnumpy(getattr(dw, name)), getattr(w, name))
    failing = FakeCudaPool(fail_at=3)
    with pytest.raises(MemoryError, match="injected"):
        ops.upload_weight(w, failing)
    assert failing.live == []

@ALL_GEMVS

def test_decode_sequence_allocates_nothing(ops, rng):
    """One decode layer's launches, the fused greedy head and both samplers leave CuPy's pool
    untouched."""
    d, h, hkv, hd, f = 576, 9, 3, 64, 1536
    qkv_w = dev_weight(ops, rand_weight(rng, (h + 2 * hkv) * hd, d, 4, 32))
    wo = dev_weight(ops, rand_weight(rng, d, h * hd, 4, 32))
    gu = dev_weight(ops, rand_weight(rng, 2 * f, d, 4, 32))
    down = dev_weight(ops, rand_weight(rng, d, f, 4, 32))
    head = dev_weight(ops, rand_weight(rng, 1000, d, 8, 32))
    resid = cupy.asarray(rng.standard_normal((1, d)).astype(np.float32))
    norm_w = cupy.ones(d, cupy.float32)
    xn = cupy.empty((1, d), cupy.float16)
    qkv = cupy.empty((1, (h + 2 * hkv) * hd), cupy.float16)
    att = cupy.empty((1, h * hd), cupy.float16)
    act = cupy.empty((1, f), cupy.float16)
    _, cache = kv_pair(ops, NumpyOps(), "int8", h, hkv, hd, 64, 32)   # pages made up front
    kv = cache.slot(0)
    logits = cupy.empty((1, 1000), cupy.float32)
    emb = cupy.empty((1, d), cupy.float32)

    def step(pos):
        ops.embed(head, [pos % 1000], emb)
        ops.rmsnorm(resid, norm_w, 1e-5, xn)
        ops.linear(xn, qkv_w, qkv)
        ops.kv_write(qkv, None, pos, 1e4, h, hkv, hd, kv)
        ops.kv_attention(qkv, kv, pos, h, hkv, hd, att)
        ops.linear_residual(att, wo, resid)
        ops.rmsnorm(resid, norm_w, 1e-5, xn)
        ops.linear_swiglu(xn, gu, None, act)
        ops.linear_residual(act, down, resid)
        # the model's fused pairs (one launch each at T = 1)
        ops.rmsnorm_linear(resid, norm_w, 1e-5, qkv_w, qkv, xn)
        ops.rmsnorm_linear_swiglu(resid, norm_w, 1e-5, gu, None, act, xn)
        ops.linear_residual(act, down, resid)
        ops.rmsnorm_lm_head(resid, norm_w, 1e-5, head, logits, xn)
        ops.sample(logits, 0.8, 40, 0.9, 0.3)                      # the device sampler
        ops.rmsnorm_lm_head_sample(resid, norm_w, 1e-5, head, logits, xn, 0.0, 0, 1.0, 0.0)
        return ops.sample(logits, 0.0, 0, 1.0, 0.0)

    step(0)
    mp = cupy.get_default_memory_pool()
    used, total = mp.used_bytes(), mp.total_bytes()
    for pos in range(1, 20):
        step(pos)
    assert (mp.used_bytes(), mp.total_bytes()) == (used, total)
    assert np.isfinite(cupy.asnumpy(resid)).all()


@pytest.mark.parametrize("ops", ["auto"], indirect=True)    # v1 on layer shapes: the pair's
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("pos,table_ready,cap", [(0, False, None), (45, True, None),
                                                 (45, False, None), (4097, True, None),
                                                 (45, True, 1), (45, True, 3)])
@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_qkv_rope_step_equals_the_pair(ops, ref, rng, monkeypatch, h, hkv, hd, bits, pos,
                                       table_ready, cap, mode):
    """qkv_rope.cu (RMSNorm + QKV GEMV + RoPE + K/V page write, one launch) leaves qkv and
    every part of the page row at the step's position (int8: codes and scales) bit for bit as
    rmsnorm_linear + kv_write_step do, with the step state's RoPE table (written by
    step_advance) or without one; twice in a row (the int8 ticket re-arms). ``cap``: the grid
    capped at that many blocks, so each block loops over several passes of rows (and with int8
    pages one block is also the last, quantizing block)."""
    from tinyloop.backends.base import STEP_ROPE_POS
    if cap is not None:
        monkeypatch.setattr(ops, "_grid_cap", cap)
    d = 256
    n = (h + 2 * hkv) * hd
    w = dev_weight(ops, rand_weight(rng, n, d, bits, 32))
    wt = cupy.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
    x = cupy.asarray(rng.standard_normal((1, d)).astype(np.float32))
    theta = 10000.0 if hd != 128 else 500000.0
    state = np.zeros(STEP_WORDS, np.int32)
    state[STEP_POS] = pos - 1 if table_ready else pos
    step = cupy.asarray(state)
    if table_ready:                     # the previous step's advance prepared pos's table
        ops.step_advance(step, ops.step_host_buffer(), theta, hd)
        assert int(step[STEP_ROPE_POS]) == pos + 1 and int(step[STEP_POS]) == pos
    got, want, again = {}, {}, {}
    for fused, out in ((True, got), (False, want), (True, again)):
        _, c = kv_pair(ops, ref, mode, h, hkv, hd, pos + 1, 32)
        qkv = poisoned((1, n), cupy.float16)
        norm = cupy.empty((1, d), cupy.float16)
        if fused:
            assert ops.rmsnorm_qkv_kv_step(x, wt, 1e-5, w, qkv, step, theta, h, hkv, hd,
                                           c.slot(0))
        else:
            ops.rmsnorm_linear(x, wt, 1e-5, w, qkv, norm)
            ops.kv_write_step(qkv, None, step, theta, h, hkv, hd, c.slot(0))
        out["qkv"] = cupy.asnumpy(qkv)
        rows = gather(c.slot(0), pos + 1, dev=True)
        out.update({part: r[pos] for part, r in rows.items()})
    assert set(got) == {"qkv", "k", "v"} | ({"k_scale", "v_scale"} if mode == "int8" else set())
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_array_equal(again[name], want[name], err_msg=name)
    assert np.isfinite(got["qkv"].astype(np.float32)).all() and got["k"].any()
    monkeypatch.setattr(ops, "kernels",                          # the switch: the pair runs
                        dataclasses.replace(ops.kernels, fused_qkv_rope=False))
    assert not ops.rmsnorm_qkv_kv_step(x, wt, 1e-5, w, poisoned((1, n), cupy.float16), step,
                                       theta, h, hkv, hd, c.slot(0))
