"""Picking the next token (kernels/sample.cu): the argmax, the one temperature sampler
(``sample_step``, for an eager ``sample`` and inside a captured step alike) and the heads of a
captured step: a mixin of CudaOps. ``numpy_ops.sample_from_logits`` is the rule each
follows."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ..base import LOGIT_FAULTS, non_finite_logits
from ..numpy_ops import sample_from_logits
from .checks import _F32, _dev
from .compile import GEOMETRY, cupy

_SAMPLE_THREADS = GEOMETRY["sample"]["SMP_THREADS"]
_SAMPLE_MAX_N = 1 << 22  # sample_step: u64 sums of 2^40-scaled weights stay < 2^63


class SamplingOps:
    """``sample`` and the captured step's heads on the device (mixed into CudaOps)."""

    def sample(self, logits, temperature, top_k, top_p, u) -> int:
        """The next token id from f32 logits [vocab] (or [1, vocab]), by
        ``numpy_ops.sample_from_logits``'s rule; only the id crosses to the host.

        temperature <= 0: the argmax kernel writes the id straight to pinned host memory
        (no allocation; one stream synchronisation). Otherwise ``sample.cu``'s one-block
        sampler, the captured step's (fixed-point weights, radix selects: no sort, no CuPy
        temporaries), with its parameters in pinned memory of their own; a vocabulary past
        2^22, which its fixed-point sums do not take, is copied to the host and sampled by the
        NumPy rule itself. Either kernel writes the row's fault code beside the id, so a row
        with a NaN or +inf, or only -inf, raises NonFiniteLogitsError as on NumPy (checked once
        the stream has synchronised; no extra pass over the row). Raises ConfigError for u
        outside [0, 1) or top_k < 0.
        """
        _dev(logits, "logits", np.float32)
        if logits.ndim == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ConfigError(f"logits must be one row [vocab], got shape {logits.shape}")
        if temperature > 0.0 and not 0.0 <= u < 1.0:
            raise ConfigError(f"u must lie in [0, 1), got {u}")
        if temperature > 0.0 and top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {top_k}")
        n = logits.shape[0]
        if temperature <= 0.0:
            self._fn("sample", "argmax_f32")((1,), (_SAMPLE_THREADS,),
                                             (logits.data.ptr, n, self._id_ptr))
        elif n <= _SAMPLE_MAX_N:
            self.sample_launch(logits, temperature, top_k, top_p, u)
        else:
            return sample_from_logits(cupy.asnumpy(logits), temperature, top_k, top_p, u)
        cupy.cuda.get_current_stream().synchronize()
        self._raise_on_fault()
        return int(self._id_view[0])

    def _raise_on_fault(self) -> None:
        """Raise NonFiniteLogitsError for the fault code an argmax / sampler kernel wrote
        (after a synchronisation)."""
        code = int(self._id_view[1])
        if code:
            raise non_finite_logits(LOGIT_FAULTS[code])

    def sample_launch(self, logits, temperature, top_k, top_p, u) -> None:
        """Queue ``sample.cu``'s one-block top-k / top-p sampler (temperature > 0) on f32
        logits [n] (validated by ``sample``; n <= 2^22), its parameters written to the eager
        sampler's pinned f64 [4] first; the id and the row's fault code go to the mapped
        pinned int [2] ``step_host_buffer``. Its u64 [n] scratch is a pool block, grown only
        for a larger vocabulary."""
        n = logits.shape[0]
        self._ensure_wq(n)
        v = self._esmp_view
        v[0], v[1], v[2], v[3] = float(temperature), float(int(top_k)), float(top_p), float(u)
        self._fn("sample", "sample_step")(
            (1,), (_SAMPLE_THREADS,), (logits.data.ptr, n, self._esmp_ptr, self._wq_ptr,
                                       self._id_ptr))

    def _ensure_wq(self, n: int) -> None:
        """The sampler's u64 [>= n] scratch (cudaMalloc, outside the pool; grown only for a
        larger vocabulary, never inside a capture: the eager step before it grows it)."""
        if n <= self._wq_cap:
            return
        if self._capturing is not None:
            raise ConfigError("the sampler's scratch must be grown before a capture")
        if self._wq_blk is not None:
            cupy.cuda.get_current_stream().synchronize()
            blk, self._wq_blk, self._wq_ptr, self._wq_cap = self._wq_blk, None, 0, 0
            blk.free()
        self._wq_blk = self._cuda_pool.allocate(8 * n, "scratch")
        self._wq_ptr = self._wq_blk.ptr
        self._wq_cap = n

    def head_argmax_step(self, x, weight, eps, w, out, norm, step) -> None:
        """Greedy head into the step state (``Ops.head_argmax_step``): with the v2 GEMV one
        fused launch (RMSNorm + LM head + argmax, ``head_argmax_launch``) writing the id and
        fault code to ``step``; otherwise ``rmsnorm_lm_head`` then the argmax kernel into
        ``step``. The logits land in ``out`` f32 [1, vocab] either way."""
        sp = self._step_ptr(step)
        info = self._info(w)
        if info.v2 and self._norm_fused(x, weight, info):
            out = self._out(out, "out", _F32, 1, info.n)
            self.head_argmax_launch(info, x, weight, eps, out, 0, id_dev=sp)
            return
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        out = self._out(out, "out", _F32, 1, info.n)
        self._fn("sample", "argmax_f32")((1,), (_SAMPLE_THREADS,), (out.data.ptr, info.n, sp))

    @property
    def graph_sampling(self) -> bool:
        """A captured step can sample (temperature > 0) where sample.cu's device sampler runs
        (vocabularies up to 2^22: ``head_sample_step`` refuses a larger one)."""
        return True

    def set_step_sampling(self, temperature, top_k, top_p, u) -> None:
        """``Ops.set_step_sampling``: validated, then written to the mapped pinned f64 [4] that
        a replayed ``sample_step`` reads. Only between steps (the previous replay has
        synchronised, so no kernel is reading it)."""
        super().set_step_sampling(temperature, top_k, top_p, u)
        t, k, p, u = self._step_sampling
        self._smp_view[0], self._smp_view[1], self._smp_view[2], self._smp_view[3] = \
            t, float(k), p, u

    def head_sample_step(self, x, weight, eps, w, out, norm, step) -> None:
        """Sampled head into the step state (``Ops.head_sample_step``): ``rmsnorm_lm_head``
        into ``out`` f32 [1, vocab], then sample.cu's ``sample_step`` (one block; parameters
        read at run time from ``set_step_sampling``'s pinned buffer; id and fault code to
        ``step``). Its u64 [vocab] scratch must exist before a capture: the eager step that
        precedes every capture makes it. Raises ConfigError past the device sampler's
        vocabulary limit."""
        sp = self._step_ptr(step)
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        info = self._info(w)
        out = self._out(out, "out", _F32, 1, info.n)
        n = info.n
        if n > _SAMPLE_MAX_N:
            raise ConfigError(f"a sampled decode step needs the device sampler (vocabulary "
                              f"<= {_SAMPLE_MAX_N}); got {n} tokens")
        self._ensure_wq(n)
        self._fn("sample", "sample_step")(
            (1,), (_SAMPLE_THREADS,), (out.data.ptr, n, self._smp_ptr, self._wq_ptr, sp))
