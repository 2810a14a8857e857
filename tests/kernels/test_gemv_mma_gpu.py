"""gemv_mma{CT}_* (kernels/gemv_mma.cu: a decode batch's products on tensor cores,
``KernelChoice(batch_gemv="mma")``) on the GPU, against the NumPy reference
(numpy_ops.NumpyOps.linear*: the product from the dequantized weights) within the FP16 bound of
the outputs, and against gemv_rows{R}_* (the FMA GEMV of every row) within FP32 rounding of
the sums: every epilogue, INT4 / INT8, groups of 32 to 128, 2 to 32 input rows (every column
tile count), output rows not a multiple of the 16-row tile, K of one to 176 chunks. The
fragment and K-permutation arithmetic is checked on the CPU by test_gemv_mma_emulation.py."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]
if not cuda_available():
    pytest.skip("needs a CUDA GPU and CuPy", allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.cuda import CudaOps, KernelChoice  # noqa: E402
from tinyloop.backends.cuda.gemv import MMA_COL_TILES, mma_geometry  # noqa: E402

from .test_kernels_gpu import (F16_RTOL, assert_close, dev_weight, f16,  # noqa: E402
                               rand_weight, rms)


def _batch(kind):
    o = CudaOps(KernelChoice(gemv="v1", batch_gemv=kind))
    o._in_batch = True                         # what decode_batch_scope sets
    return o


@pytest.fixture(scope="module")
def both():
    return _batch("mma"), _batch("rows")


SHAPES = [(2, 576, 576), (5, 960, 576), (8, 576, 1536), (9, 70, 256), (16, 37, 64),
          (17, 576, 5632), (32, 128, 4096), (31, 2048, 96), (24, 16, 32)]


def test_shapes_reach_every_column_tile():
    assert {mma_geometry(t, k, False)[0] for t, _, k in SHAPES} == set(MMA_COL_TILES)


@pytest.mark.parametrize("bits,g", [(4, 32), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("t,n,k", SHAPES)
def test_gemv_mma_is_the_product(both, ref, rng, bits, g, t, n, k):
    """f16 / f32 / resid epilogues: the mma path is taken, within the FP16 bound of the
    reference, and within FP32 rounding of gemv_rows on the same inputs."""
    if k % g:
        pytest.skip("K not a multiple of the group")
    mma, rows = both
    w = rand_weight(rng, n, k, bits, g)
    dm, dr = dev_weight(mma, w), dev_weight(rows, w)
    assert mma._rows_path(mma._info(dm), t)
    xh, x = f16(rng, t, k)
    xd = cupy.asarray(xh)
    want = np.empty((t, n), np.float32)
    ref.linear(x, w, want)
    out = cupy.empty((t, n), cupy.float16)
    mma.linear(xd, dm, out)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what="gemv_mma f16")
    assert mma._info(dm).mma is not None            # the tensor-core kernel ran

    a, b = cupy.empty((t, n), cupy.float32), cupy.empty((t, n), cupy.float32)
    mma.lm_head(xd, dm, a)
    rows.lm_head(xd, dr, b)
    a, b = cupy.asnumpy(a), cupy.asnumpy(b)
    scale = np.abs(xh.astype(np.float64)) @ np.abs(_dense(w)).T + 1e-30   # sum |x w|
    assert np.all(np.abs(a - b) <= 1e-4 * scale), float(np.max(np.abs(a - b) / scale))
    assert_close(a, want, atol=1e-3 * rms(want), rtol=1e-3, what="gemv_mma f32")

    res0 = rng.standard_normal((t, n)).astype(np.float32)
    res = cupy.asarray(res0)
    mma.linear_residual(xd, dm, res)
    np.testing.assert_allclose(cupy.asnumpy(res), res0 + a, rtol=1e-6, atol=1e-6)


def _dense(w):
    from tinyloop.quant import dequantize
    return dequantize(w).astype(np.float64)


@pytest.mark.parametrize("bits,g", [(4, 32), (8, 32), (4, 64)])
@pytest.mark.parametrize("t,f,k", [(3, 1536, 576), (16, 40, 256), (32, 256, 5632),
                                   (9, 21, 64)])
def test_gemv_mma_swiglu(both, ref, rng, bits, g, t, f, k):
    """SwiGLU: gate rows r and up rows r + F in one block; within the reference's bound and
    close to gemv_rows."""
    if k % g:
        pytest.skip("K not a multiple of the group")
    mma, rows = both
    w = rand_weight(rng, 2 * f, k, bits, g)
    dm, dr = dev_weight(mma, w), dev_weight(rows, w)
    assert mma._rows_path(mma._info(dm), t)
    xh, x = f16(rng, t, k)
    xd = cupy.asarray(xh)
    want = np.empty((t, f), np.float32)
    ref.linear_swiglu(x, w, np.empty((t, 2 * f), np.float32), want)
    out = cupy.empty((t, f), cupy.float16)
    mma.linear_swiglu(xd, dm, cupy.empty((t, 2 * f), cupy.float16), out)
    assert_close(out, want, atol=4e-3 * rms(want), rtol=2 * F16_RTOL, what="gemv_mma swiglu")
    other = cupy.empty((t, f), cupy.float16)
    rows.linear_swiglu(xd, dr, cupy.empty((t, 2 * f), cupy.float16), other)
    o = cupy.asnumpy(other).astype(np.float32)
    assert_close(out, o, atol=2e-3 * rms(o), rtol=F16_RTOL, what="gemv_mma vs gemv_rows")


def test_gemv_mma_leaves_rows_past_t_and_n_unwritten(both, rng):
    """Output rows t >= T (the buffer's padding) and nothing past N is written."""
    mma, _ = both
    t, n, k = 5, 37, 64
    dm = dev_weight(mma, rand_weight(rng, n, k, 4, 32))
    xh, _ = f16(rng, t, k)
    out = cupy.full((t + 3, n + 5), np.nan, cupy.float16)
    mma._gemv_rows(mma._info(dm), "f16", cupy.asarray(xh), t, n, 0, out, n + 5)
    got = cupy.asnumpy(out)
    assert np.isfinite(got[:t, :n]).all()
    assert np.isnan(got[:t, n:]).all() and np.isnan(got[t:]).all()
