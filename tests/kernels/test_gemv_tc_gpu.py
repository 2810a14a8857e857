"""gemv_tc_* (kernels/gemv_mma.cu: the T = 1 tensor-core GEMV, ``KernelChoice(gemv="tc")``)
on the GPU: against the NumPy reference within
the FP16 bound of the outputs and against the v1 GEMV within FP32 rounding of the sums, for
every epilogue and the RMSNorm-fused entries (bit for bit against rmsnorm + the unfused
entry); groups of 32 to 128, output rows not a multiple of the 16-row tile, K of one chunk to
a ragged last step, more steps than warps, fewer blocks than tiles (the tile stride). The
fragment arithmetic is checked on the CPU by test_gemv_tc_emulation.py."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]
if not cuda_available():
    pytest.skip("needs a CUDA GPU and CuPy", allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.base import Ops  # noqa: E402
from tinyloop.backends.cuda import CudaOps, KernelChoice  # noqa: E402

from .test_kernels_gpu import (EPS, F16_RTOL, assert_close, dev_weight, f16,  # noqa: E402
                               poisoned, rand_weight, ref_normed, resid_row, rms)


@pytest.fixture(scope="module")
def both():
    return CudaOps(KernelChoice(gemv="tc")), CudaOps(KernelChoice(gemv="v1"))


# (n, k, g): one step per warp, a ragged last step (K = 800: 25 chunks), more steps than warps,
# one chunk, partial tiles, the Nanbeige4.2-3B and Ouro-1.4B layer shapes
SHAPES = [(2048, 2048, 32), (37, 800, 32), (100, 5632, 32), (3072, 10752, 32), (70, 1024, 64),
          (16, 4096, 128), (9, 32, 32), (1000, 12288, 32), (8192, 3072, 32)]


def _sum_abs(xh, w):
    from tinyloop.quant import dequantize
    return np.abs(xh.astype(np.float64)) @ np.abs(dequantize(w).astype(np.float64)).T + 1e-30


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_gemv_tc_is_the_product(both, ref, rng, n, k, g):
    tc, v1 = both
    w = rand_weight(rng, n, k, 4, g)
    dt, dv = dev_weight(tc, w), dev_weight(v1, w)
    assert tc._info(dt).tc is not None
    xh, x = f16(rng, 1, k)
    xd = cupy.asarray(xh)
    want = np.empty((1, n), np.float32)
    ref.linear(x, w, want)
    out = poisoned((1, n), cupy.float16)
    tc.linear(xd, dt, out)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what="gemv_tc f16")

    a, b = cupy.empty((1, n), cupy.float32), cupy.empty((1, n), cupy.float32)
    tc.lm_head(xd, dt, a)
    v1.lm_head(xd, dv, b)
    a, b = cupy.asnumpy(a), cupy.asnumpy(b)
    scale = _sum_abs(xh, w)
    assert np.all(np.abs(a - b) <= 1e-5 * scale), float(np.max(np.abs(a - b) / scale))

    res0 = rng.standard_normal((1, n)).astype(np.float32)
    res = cupy.asarray(res0)
    tc.linear_residual(xd, dt, res)
    np.testing.assert_allclose(cupy.asnumpy(res), res0 + a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("f,k,g", [(5632, 2048, 32), (21, 512, 32), (300, 3072, 64),
                                   (40, 8192, 32)])
def test_gemv_tc_swiglu(both, ref, rng, f, k, g):
    tc, v1 = both
    w = rand_weight(rng, 2 * f, k, 4, g)
    dt, dv = dev_weight(tc, w), dev_weight(v1, w)
    xh, x = f16(rng, 1, k)
    xd = cupy.asarray(xh)
    want = np.empty((1, f), np.float32)
    tmp = np.empty((1, 2 * f), np.float32)
    ref.linear_swiglu(x, w, tmp, want)
    out = poisoned((1, f), cupy.float16)
    tc.linear_swiglu(xd, dt, None, out)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what="gemv_tc swiglu")
    o1 = poisoned((1, f), cupy.float16)
    v1.linear_swiglu(xd, dv, None, o1)
    assert_close(out, cupy.asnumpy(o1).astype(np.float64), atol=1e-3 * rms(want),
                 rtol=2.0 ** -9, what="gemv_tc swiglu vs v1")


@pytest.mark.parametrize("epi", ["f16", "swiglu", "f32"])
@pytest.mark.parametrize("cap", [None, 3])
def test_gemv_tc_norm_fused_equals_rmsnorm_then_gemv(both, ref, rng, epi, cap):
    """The RMSNorm-fused entry normalizes x exactly as rmsnorm.cu and then runs the same body:
    bit for bit the unfused pair, also with fewer blocks than tiles (3: the tile stride and
    every block striding over several tiles)."""
    tc, _ = both
    n, k = (300, 5632) if epi != "swiglu" else (150, 5632)
    w = rand_weight(rng, 2 * n if epi == "swiglu" else n, k, 4, 32)
    dt = dev_weight(tc, w)
    x, wt = resid_row(rng, 1, k)
    xd, wtd = cupy.asarray(x), cupy.asarray(wt)
    dtype = cupy.float32 if epi == "f32" else cupy.float16
    fused, un = poisoned((1, n), dtype), poisoned((1, n), dtype)
    norm, norm2 = poisoned((1, k), cupy.float16), poisoned((1, k), cupy.float16)
    prev, tc._grid_cap = tc._grid_cap, cap
    try:
        if epi == "f16":
            tc.rmsnorm_linear(xd, wtd, EPS, dt, fused, norm)
            Ops.rmsnorm_linear(tc, xd, wtd, EPS, dt, un, norm2)
        elif epi == "swiglu":
            tc.rmsnorm_linear_swiglu(xd, wtd, EPS, dt, None, fused, norm)
            Ops.rmsnorm_linear_swiglu(tc, xd, wtd, EPS, dt, poisoned((1, 2 * n), cupy.float16),
                                      un, norm2)
        else:
            tc.rmsnorm_lm_head(xd, wtd, EPS, dt, fused, norm)
            Ops.rmsnorm_lm_head(tc, xd, wtd, EPS, dt, un, norm2)
    finally:
        tc._grid_cap = prev
    assert cupy.isnan(norm).all(), "the fused path wrote the norm scratch"
    np.testing.assert_array_equal(cupy.asnumpy(fused), cupy.asnumpy(un))
    want = np.empty((1, 2 * n if epi == "swiglu" else n), np.float32)
    xn = ref_normed(ref, x, wt)
    if epi == "swiglu":
        out = np.empty((1, n), np.float32)
        ref.linear_swiglu(xn, w, want, out)
        want = out
    else:
        ref.linear(xn, w, want)
    assert_close(fused, want, atol=2e-3 * rms(want), rtol=F16_RTOL, what=f"norm {epi}")


def test_gemv_tc_declines_what_it_cannot_take(both, rng):
    """INT8 weights run v1 under gemv="tc"."""
    tc, _ = both
    assert tc._info(dev_weight(tc, rand_weight(rng, 64, 2048, 8, 32))).tc is None
    assert tc._info(dev_weight(tc, rand_weight(rng, 64, 576, 4, 32))).tc is not None


def test_a_model_on_the_tc_gemv_matches_numpy_with_graphs_on_and_off(tmp_path, monkeypatch):
    """A small synthetic INT4 model with every decode projection on gemv_tc (forced): greedy
    tokens with graphs on equal graphs off and match the NumPy backend's, at depths 1 and 4."""
    import tinyloop
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    p = tmp_path / "small.tlm"
    write_synthetic(p, synthetic_config(vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2,
                                        head_dim=64, ffn_dim=704, n_prelude=1, n_recurrent=2,
                                        n_coda=1, max_depth=4, rope_theta=10000.0),
                    seed=5, bits=4, group_size=32)
    prompt = list(range(3, 40))
    ref = tinyloop.load_model(str(p), backend="numpy", max_seq_len=128)
    m = tinyloop.load_model(str(p), backend="cuda", max_seq_len=128,
                            kernels=KernelChoice(gemv="tc"))
    try:
        for depth in (1, 4):
            want = ref.generate(prompt, max_new_tokens=12, depth=depth).token_ids
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
            eager = m.generate(prompt, max_new_tokens=12, depth=depth).token_ids
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
            graph = m.generate(prompt, max_new_tokens=12, depth=depth).token_ids
            assert graph == eager
            assert eager == want, (depth, eager, want)
        assert m.graph_stats()["captures"] >= 1
        assert any(i.tc is not None for i in list(m.ops._winfo.values()))
    finally:
        tinyloop.free_model(m)
        tinyloop.free_model(ref)
