"""Embedding and RMSNorm (kernels/dequant.cu, kernels/rmsnorm.cu), and the looped
architectures' norms and elementwise ops around them (embedding scale, Q/K/V bias, the
seeded initial state: kernels/elementwise.cu): a mixin of CudaOps."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ..base import STATE_TRUNCATE
from .checks import _F16, _F32, _dev, _fast_ok, _log2g, _shape, _weight
from .compile import GEOMETRY, cupy

_DQ_THREADS = GEOMETRY["dequant"]["DQ_THREADS"]
_RMS_THREADS = GEOMETRY["rmsnorm"]["RMS_THREADS"]
_EW_THREADS = GEOMETRY["elementwise"]["EW_THREADS"]
_U64 = 1 << 64


class NormOps:
    """``embed``, ``rmsnorm`` and the VERSION 2 facts' ops (``scale``, ``add_bias``,
    ``norm_residual``, ``linear_norm_residual``, ``linear_residual_norm``, ``init_state``,
    ``init_state_rows``, ``init_state_step``) of ``base.Ops`` on the device (mixed into CudaOps)."""

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

    def _resid(self, x, name: str):
        """Validate a residual-stream array x f32 [T, d] (contiguous); return (T, d)."""
        if not _fast_ok(x, _F32, 2):
            _dev(x, name, np.float32, 2)
        return x.shape

    def _norm_weight(self, weight, d: int) -> None:
        if not _fast_ok(weight, _F32, 1, d):
            _dev(weight, "weight", np.float32, 1)
            _shape(weight, "weight", (d,))

    def scale(self, x, s):
        """x f32 [T, d] *= s (one launch)."""
        t, d = self._resid(x, "x")
        n = t * d
        self._fn("elementwise", "scale_f32")(
            ((n + _EW_THREADS - 1) // _EW_THREADS,), (_EW_THREADS,), (x.data.ptr, n, float(s)))

    def add_bias(self, x, bias):
        """x f16 [T, n] += bias f32 [n] (the fused QKV rows, before RoPE and the K/V write)."""
        if not _fast_ok(x, _F16, 2):
            _dev(x, "x", np.float16, 2)
        t, n = x.shape
        if not _fast_ok(bias, _F32, 1, n):
            _dev(bias, "bias", np.float32, 1)
            _shape(bias, "bias", (n,))
        self._fn("elementwise", "add_bias_f16")(
            ((n + _EW_THREADS - 1) // _EW_THREADS, t), (_EW_THREADS,),
            (x.data.ptr, bias.data.ptr, n))

    def norm_residual(self, x, weight, eps):
        """x f32 [T, d] = rmsnorm(x) * weight f32 [d], in place, kept in float32."""
        t, d = self._resid(x, "x")
        self._norm_weight(weight, d)
        self._fn("rmsnorm", "rmsnorm_f32_inplace")(
            (t,), (_RMS_THREADS,), (x.data.ptr, weight.data.ptr, float(eps), d))

    def linear_norm_residual(self, x, w, weight, eps, residual, tmp):
        """residual f32 [T, d] += rmsnorm(x f16 [T, in] @ W.T) * weight; ``tmp`` f16
        [>= T, d] takes the product (the GEMV / GEMM, then one norm-and-add launch)."""
        t, d = self._resid(residual, "residual")
        self._norm_weight(weight, d)
        tmp = self._out(tmp, "tmp", _F16, t, d)
        self.linear(x, w, tmp)
        self._fn("rmsnorm", "rmsnorm_f16_add_f32")(
            (t,), (_RMS_THREADS,),
            (tmp.data.ptr, weight.data.ptr, float(eps), d, residual.data.ptr))

    def linear_residual_norm(self, x, w, weight, eps, residual):
        """residual f32 [T, d] = rmsnorm(residual + x f16 [T, in] @ W.T) * weight (the
        residual GEMV / GEMM, then the in-place norm)."""
        t, d = self._resid(residual, "residual")
        self._norm_weight(weight, d)
        self.linear_residual(x, w, residual)
        self.norm_residual(residual, weight, eps)

    def _init_state(self, out, pos0: int, step_ptr: int, std: float, seed: int) -> None:
        t, d = self._resid(out, "out")
        seed = int(seed)
        if not 0 <= seed < _U64:
            raise ConfigError(f"state seed {seed} is outside 0..2**64-1")
        if pos0 < 0:
            raise ConfigError(f"init_state: pos0 must be >= 0, got {pos0}")
        self._fn("elementwise", "init_state_f32")(
            ((d + _EW_THREADS - 1) // _EW_THREADS, t), (_EW_THREADS,),
            (out.data.ptr, int(pos0), int(step_ptr), d, float(std), float(STATE_TRUNCATE),
             seed - _U64 if seed >= 1 << 63 else seed))    # the kernel reads the u64 bits

    def init_state(self, out, pos0, std, seed):
        """out f32 [T, d] = ``base.seeded_state(pos0, T, d, std, seed)``, drawn on the device
        (one launch, nothing copied from the host). Raises ConfigError for a seed outside
        0..2**64-1 or a negative pos0."""
        self._init_state(out, int(pos0), 0, std, seed)

    def init_state_rows(self, out, positions, std, seed, positions_dev=None):
        """``Ops.init_state_rows`` drawn on the device in one launch (elementwise.cu
        ``init_state_rows_f32``: row i at ``positions_dev[i]``, a device int64 [B] array of
        ``positions``, the step's index); without ``positions_dev``, one ``init_state``
        launch per row. Raises ConfigError for a seed outside 0..2**64-1, a negative
        position, or positions / positions_dev of another length than ``out``'s rows."""
        t, d = self._resid(out, "out")
        if len(positions) != t:
            raise ConfigError(f"init_state_rows: {len(positions)} positions for {t} rows")
        if positions_dev is None:
            for i, p in enumerate(positions):
                self.init_state(out[i:i + 1], p, std, seed)
            return
        seed = int(seed)
        if not 0 <= seed < _U64:
            raise ConfigError(f"state seed {seed} is outside 0..2**64-1")
        if min(positions) < 0:
            raise ConfigError(f"init_state_rows: positions must be >= 0, got {min(positions)}")
        if not (type(positions_dev) is cupy.ndarray and positions_dev.dtype == np.int64
                and positions_dev.ndim == 1 and positions_dev.flags.c_contiguous
                and positions_dev.shape[0] == t):
            raise ConfigError(f"init_state_rows: positions_dev must be a contiguous device "
                              f"int64 array of the {t} rows, got "
                              f"{type(positions_dev).__name__} "
                              f"{getattr(positions_dev, 'dtype', '')} "
                              f"{getattr(positions_dev, 'shape', '')}")
        self._fn("elementwise", "init_state_rows_f32")(
            ((d + _EW_THREADS - 1) // _EW_THREADS, t), (_EW_THREADS,),
            (out.data.ptr, positions_dev.data.ptr, d, float(std), float(STATE_TRUNCATE),
             seed - _U64 if seed >= 1 << 63 else seed))    # the kernel reads the u64 bits

    def init_state_step(self, out, step, std, seed):
        """``init_state`` of one row at the device step state's position ``step[STEP_POS]``
        (int32 [STEP_WORDS]), read by the kernel: no host read, so a captured step holds it."""
        self._init_state(out, 0, self._step_ptr(step), std, seed)
