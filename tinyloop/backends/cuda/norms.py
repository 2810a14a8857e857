"""Embedding and RMSNorm (kernels/dequant.cu, kernels/rmsnorm.cu): a mixin of CudaOps."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from .checks import _F16, _F32, _dev, _fast_ok, _log2g, _shape, _weight
from .compile import GEOMETRY, cupy

_DQ_THREADS = GEOMETRY["dequant"]["DQ_THREADS"]
_RMS_THREADS = GEOMETRY["rmsnorm"]["RMS_THREADS"]


class NormOps:
    """``embed`` and ``rmsnorm`` of ``base.Ops`` on the device (mixed into CudaOps)."""

    def embed(self, w, ids, out):
        """out f32 [T, d] = dequantized rows ``ids`` of ``w`` ([vocab, d]).

        ``ids``: a device int32 [T] array, or host ints (a T = 1 id travels as a kernel
        argument; more are uploaded). Host ids are range-checked; a bad device id gives a
        NaN row.
        """
        _weight(w, "w")
        vocab, d = w.shape
        _dev(out, "out", np.float32, 2)
        t = out.shape[0]
        keep = None
        if isinstance(ids, cupy.ndarray):
            _dev(ids, "ids", np.int32, 1)
            _shape(ids, "ids", (t,))
            ids_ptr, id0 = ids.data.ptr, 0
        else:
            host = np.atleast_1d(np.asarray(ids))
            if host.ndim != 1 or host.shape[0] != t or host.dtype.kind not in "iu":
                raise ConfigError(f"ids must be {t} integers, got {host.dtype} {host.shape}")
            bad = (host < 0) | (host >= vocab)
            if bad.any():
                raise ConfigError(f"token id {int(host[bad][0])} is outside 0..{vocab - 1}")
            if t == 1:
                ids_ptr, id0 = 0, int(host[0])
            else:                        # uploaded into a scratch block
                dev, keep = self.empty(self._cuda_pool, (t,), np.int32, "scratch")
                ids_ptr, id0 = dev.data.ptr, 0
        try:
            if keep is not None:
                self.from_host(host.astype(np.int32), dev)
            _shape(out, "out", (t, d))
            self._fn("dequant", f"embed_q{w.bits}")(
                (t,), (_DQ_THREADS,),
                (w.qweight.data.ptr, w.scales.data.ptr, w.zeros.data.ptr, ids_ptr, id0, d,
                 vocab, _log2g(w), out.data.ptr))
        finally:
            # the launch is queued: the block may go back at once (every later use of it is
            # on this stream, after the kernel)
            if keep is not None:
                keep.free()

    def rmsnorm(self, x, weight, eps, out):
        """out f16 [T, d] = x / sqrt(mean(x^2) + eps) * weight; x f32 [T, d], weight f32 [d]."""
        if not _fast_ok(x, _F32, 2):
            _dev(x, "x", np.float32, 2)
        t, d = x.shape
        if not _fast_ok(weight, _F32, 1, d):
            _dev(weight, "weight", np.float32, 1)
            _shape(weight, "weight", (d,))
        out = self._out(out, "out", _F16, t, d)
        self._fn("rmsnorm", "rmsnorm_f32_f16")(
            (t,), (_RMS_THREADS,), (x.data.ptr, weight.data.ptr, float(eps), d, out.data.ptr))
