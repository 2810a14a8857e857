"""The decode batch's kernels (kernels/gemv.cu gemv_rows{R}_*, sample.cu argmax_f32 over rows)
on the GPU.

gemv_rows{R}_* (R = 2, 4, 8: gemv.rows_tile) runs a few input rows (2 <= T <= gemv.ROWS_MAX_T,
a decode batch) with the T = 1 GEMV's arithmetic for each row, so every output row must equal
the v1 GEMV on that row alone bit for bit, in every epilogue, and lie within the FP16 bound of
the NumPy reference (numpy_ops.NumpyOps.linear*: the product from the dequantized weights).
argmax_rows must give numpy.argmax's pick (first NaN, else the first maximum) and
base.logit_fault's code per row; sample_rows what ``sample`` picks on each row alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]
if not cuda_available():
    pytest.skip("needs a CUDA GPU and CuPy", allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.base import LOGIT_FAULTS, logit_fault  # noqa: E402
from tinyloop.backends.cuda import CudaOps, KernelChoice  # noqa: E402
from tinyloop.backends.cuda.gemv import ROWS_MAX_T, ROWS_TILES, rows_tile  # noqa: E402

from .test_kernels_gpu import (F16_RTOL, assert_close, dev_weight, f16,  # noqa: E402
                               rand_weight, rms)

_CODES = {v: k for k, v in LOGIT_FAULTS.items()}


@pytest.fixture
def v1():
    """The T = 1 reference: the v1 GEMV at every shape; its products of a few rows run as a
    decode batch's (``decode_batch_scope``) on gemv_rows (``batch_gemv="rows"``: the
    default batch kernel, gemv_mma, rounds otherwise)."""
    o = CudaOps(KernelChoice(gemv="v1", batch_gemv="rows"))
    with o.decode_batch_scope():
        yield o


# R = 2 for all but the last two (R = 8 and R = 4 on 132 SMs: test_row_tiles_cover_every_entry)
ROWS_SHAPES = [(2, 576, 576), (5, 960, 576), (8, 576, 1536), (9, 70, 256), (17, 576, 5632),
               (ROWS_MAX_T, 128, 4096), (16, 8192, 256), (12, 2048, 256)]


def test_row_tiles_cover_every_entry(v1):
    """The shapes below reach every built row tile on this GPU."""
    assert {rows_tile(n, t, v1.sms) for t, n, _ in ROWS_SHAPES} == set(ROWS_TILES)


@pytest.mark.parametrize("bits,g", [(4, 32), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("t,n,k", ROWS_SHAPES)
def test_gemv_rows_equal_the_t1_gemv_and_the_reference(v1, ref, rng, bits, g, t, n, k):
    """f16 / resid / f32 epilogues: rows path taken, each row == the v1 GEMV of that row."""
    if k % g:
        pytest.skip("K not a multiple of the group")
    w = rand_weight(rng, n, k, bits, g)
    dw = dev_weight(v1, w)
    assert v1._rows_path(v1._info(dw), t)
    xh, x = f16(rng, t, k)
    xd = cupy.asarray(xh)
    want = np.empty((t, n), np.float32)
    ref.linear(x, w, want)
    out = cupy.empty((t, n), cupy.float16)
    v1.linear(xd, dw, out)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what="gemv_rows f16")

    def one(fn, shape, dtype):
        rows = []
        for i in range(t):
            o = cupy.empty((1, shape), dtype)
            fn(xd[i:i + 1], o)
            rows.append(cupy.asnumpy(o)[0])
        return np.stack(rows)
    np.testing.assert_array_equal(cupy.asnumpy(out),
                                  one(lambda a, o: v1.linear(a, dw, o), n, cupy.float16))
    logits = cupy.empty((t, n), cupy.float32)
    v1.lm_head(xd, dw, logits)
    np.testing.assert_array_equal(cupy.asnumpy(logits),
                                  one(lambda a, o: v1.lm_head(a, dw, o), n, cupy.float32))
    res0 = rng.standard_normal((t, n)).astype(np.float32)
    res = cupy.asarray(res0)
    v1.linear_residual(xd, dw, res)
    solo = cupy.asarray(res0)
    for i in range(t):
        v1.linear_residual(xd[i:i + 1], dw, solo[i:i + 1])
    np.testing.assert_array_equal(cupy.asnumpy(res), cupy.asnumpy(solo))


@pytest.mark.parametrize("bits,g", [(4, 32), (8, 32)])
@pytest.mark.parametrize("t,f,k", [(3, 1536, 576), (16, 40, 256), (ROWS_MAX_T, 256, 5632)])
def test_gemv_rows_swiglu(v1, ref, rng, bits, g, t, f, k):
    w = rand_weight(rng, 2 * f, k, bits, g)
    dw = dev_weight(v1, w)
    assert v1._rows_path(v1._info(dw), t)
    xh, x = f16(rng, t, k)
    xd = cupy.asarray(xh)
    want = np.empty((t, f), np.float32)
    ref.linear_swiglu(x, w, np.empty((t, 2 * f), np.float32), want)
    out = cupy.empty((t, f), cupy.float16)
    v1.linear_swiglu(xd, dw, cupy.empty((t, 2 * f), cupy.float16), out)
    assert_close(out, want, atol=4e-3 * rms(want), rtol=2 * F16_RTOL, what="gemv_rows swiglu")
    for i in range(t):
        o = cupy.empty((1, f), cupy.float16)
        v1.linear_swiglu(xd[i:i + 1], dw, None, o)
        np.testing.assert_array_equal(cupy.asnumpy(out[i]), cupy.asnumpy(o[0]))


def test_gemv_rows_off_and_wide_grids_take_the_gemm(rng):
    """KernelChoice(batch_gemv="gemm"), T past ROWS_MAX_T, or a GEMM grid that fills the GPU
    (an LM head) run the tiled GEMM; within the FP16 bound of the rows path."""
    on, off = CudaOps(KernelChoice(gemv="v1")), CudaOps(KernelChoice(batch_gemv="gemm"))
    prefill = CudaOps(KernelChoice(gemv="v1"))
    w0 = dev_weight(prefill, rand_weight(rng, 576, 576, 4, 32))
    assert not prefill._rows_path(prefill._info(w0), 8)     # outside a decode batch: GEMM
    on._in_batch = off._in_batch = True
    w = rand_weight(rng, 576, 576, 4, 32)
    dw_on, dw_off = dev_weight(on, w), dev_weight(off, w)
    assert on._rows_path(on._info(dw_on), 8) and not off._rows_path(off._info(dw_off), 8)
    assert not on._rows_path(on._info(dw_on), ROWS_MAX_T + 1)
    head = dev_weight(on, rand_weight(rng, 49152, 576, 8, 32))
    assert not on._rows_path(on._info(head), 32)
    xh, _ = f16(rng, 8, 576)
    a, b = cupy.empty((8, 576), cupy.float16), cupy.empty((8, 576), cupy.float16)
    on.linear(cupy.asarray(xh), dw_on, a)
    off.linear(cupy.asarray(xh), dw_off, b)
    ref = cupy.asnumpy(b).astype(np.float32)
    assert_close(a, ref, atol=2e-3 * rms(ref), rtol=F16_RTOL, what="rows vs GEMM")


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_argmax_rows(ops, rng, vocab):
    """Random rows with planted ties, a NaN row (two NaNs: the first wins), a +inf row, an
    all -inf row and a row of -inf but one: ids and fault codes as numpy.argmax and
    base.logit_fault give them."""
    b = 9
    lg = rng.standard_normal((b, vocab)).astype(np.float32)
    lg[1, vocab // 2] = lg[1, vocab - 1] = lg[1].max() + 1.0      # a tie: the lower id
    lg[2, [vocab - 1, vocab // 3]] = np.nan
    lg[3, vocab // 4] = np.inf
    lg[4] = -np.inf
    lg[5] = -np.inf
    lg[5, vocab - 1] = -3.0
    ids = ops.batch_host_ids(b)
    ids[...] = -7
    ops.argmax_rows(cupy.asarray(lg), ids)
    cupy.cuda.get_current_stream().synchronize()
    for i in range(b):
        top = float(np.max(lg[i])) if not np.isnan(lg[i]).any() else float("nan")
        kind = logit_fault(top)
        assert ids[i, 1] == (_CODES[kind] if kind else 0), i
        if kind is None or kind in ("nan", "+inf"):
            assert ids[i, 0] == int(np.argmax(lg[i])), i


def test_argmax_rows_refuses_another_buffer(ops):
    from tinyloop.errors import ConfigError
    ops.batch_host_ids(4)
    with pytest.raises(ConfigError, match="batch_host_ids"):
        ops.argmax_rows(cupy.zeros((4, 10), cupy.float32), np.zeros((4, 2), np.int32))


def test_sample_rows_equal_sample_row_by_row(ops, rng):
    """sample_rows (every row without a penalty queued before one synchronisation, each with
    its own parameters) picks what ``sample`` picks on each row alone: greedy, temperature
    with top-k / top-p / min-p, a penalty row (run through ``sample``), a NaN row (its error,
    the other rows unharmed), rows given out of order and twice."""
    from tinyloop.errors import NonFiniteLogitsError
    vocab = 5000
    lg = rng.standard_normal((6, vocab)).astype(np.float32) * 3
    lg[4, 17] = np.nan
    dev = cupy.asarray(lg)
    rows = [(0, 0.0, 0, 1.0, 0.0), (1, 0.8, 0, 0.9, 0.37), (2, 0.7, 40, 1.0, 0.91, 0.05),
            (3, 1.0, 0, 1.0, 0.5, 0.0, 1.3, [1, 2, 3, 99]), (4, 0.8, 0, 0.9, 0.2),
            (5, 1.2, 5, 0.8, 0.66, 0.1), (1, 0.8, 0, 0.9, 0.99), (0, 0.9, 0, 1.0, 0.01)]
    got = ops.sample_rows(dev, rows)
    for (i, *args), g in zip(rows, got):
        try:
            want = int(ops.sample(dev[i], *args))
        except NonFiniteLogitsError as e:
            assert isinstance(g, NonFiniteLogitsError) and g.kind == e.kind
            continue
        assert g == want, (i, args)
