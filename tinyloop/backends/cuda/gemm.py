"""Prefill projections (T > 1): the tensor-core GEMM of the packed weights (kernels/gemm.cu),
or cuBLAS (``cupy.matmul``) on a weight's dense FP16 copy when it carries one
(``TINYLOOP_FP16_CACHE=1``, ``make_fp16_cache``): a mixin of CudaOps."""

from __future__ import annotations

import numpy as np

from ...quant import QuantWeight
from .checks import _log2g, _weight
from .compile import GEOMETRY, cupy

_GEMM_BM, _GEMM_BN = GEOMETRY["gemm"]["BM"], GEOMETRY["gemm"]["BN"]
_GEMM_THREADS = GEOMETRY["gemm"]["GEMM_THREADS"]
_DQ_THREADS = GEOMETRY["dequant"]["DQ_THREADS"]
_EW_THREADS = GEOMETRY["elementwise"]["EW_THREADS"]


def launch_gemm(info, epi: str, x, t: int, out, ldo: int) -> None:
    """Queue out (epilogue ``epi``: f16 | resid | f32) = x f16 [t, K] @ W.T with the packed
    weight of ``info`` (a ``gemv._WInfo``); shapes already validated."""
    info.gemm[epi](((info.n + _GEMM_BN - 1) // _GEMM_BN, (t + _GEMM_BM - 1) // _GEMM_BM),
                   (_GEMM_THREADS,), (*info.args, x.data.ptr, t, info.n, info.k, info.lg,
                                      out.data.ptr, ldo))


class GemmOps:
    """cuBLAS on the FP16 copies and the copies themselves (mixed into CudaOps)."""

    def _cublas_matmul(self, a, b, out=None):
        """``cupy.matmul`` (cuBLAS); the first call is measured for the cuBLAS handle and
        workspace it makes (device memory outside the pool)."""
        if self._cublas_measured:
            return cupy.matmul(a, b, out=out)
        with self._cuda_pool.measure_driver("cublas workspace"):
            y = cupy.matmul(a, b, out=out)
        self._cublas_measured = True
        return y

    def _cublas(self, x, w16, out, epi: str):
        # Prefill only (T > 1): cuBLAS through CuPy on the FP16 cache (FP32 accumulation).
        # The resid / f32 epilogues round the product to FP16 first (one temporary from CuPy's
        # allocator, i.e. the pool's "cupy" tag while a model lives).
        if epi == "f16":
            self._cublas_matmul(x, w16.T, out=out)
            return
        y = self._cublas_matmul(x, w16.T)         # [T, N] f16
        kern = "add_f16_to_f32" if epi == "resid" else "copy_f16_to_f32"
        self._fn("elementwise", kern)(((y.size + _EW_THREADS - 1) // _EW_THREADS,), (_EW_THREADS,),
                                      (y.data.ptr, y.size, out.data.ptr))

    def make_fp16_cache(self, w: QuantWeight, pool, tag: str | None = "fp16_cache"):
        """Dense FP16 ``[out, in]`` copy of a device QuantWeight, for cuBLAS prefill GEMMs.

        Returns (array, block); the block is taken from ``pool`` under ``tag`` (None: the
        current tag_scope).
        """
        _weight(w, "w")
        n, k = w.shape
        blk = pool.allocate(n * k * 2, tag)
        try:
            out = blk.array((n, k), np.float16)
            self._fn("dequant", f"dequant_f16_q{w.bits}")(
                (n,), (_DQ_THREADS,),
                (w.qweight.data.ptr, w.scales.data.ptr, w.zeros.data.ptr, k, _log2g(w),
                 out.data.ptr))
        except BaseException:
            pool.free(blk)
            raise
        return out, blk
