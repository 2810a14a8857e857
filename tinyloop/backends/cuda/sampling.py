"""Picking the next token (kernels/sample.cu): the argmax, the temperature sampler (for an
eager ``sample`` and inside a captured step alike: the fast path, ``sample_fast_*``, or the
one-block reference ``sample_step`` by ``KernelChoice.sampler``, each after ``sample_params``
copies its parameters to the device), the repetition penalty (``sample_penalize``) and the
heads of a captured step: a mixin of CudaOps.
``numpy_ops.sample_from_logits`` is the rule each follows."""

from __future__ import annotations

import ctypes

import numpy as np

from ...errors import ConfigError
from ..base import (LOGIT_FAULTS, REPEAT_LAST_N_MAX, Ops, check_sample_rows,
                    non_finite_logits, penalized, sample_filters, window_ring)
from ..numpy_ops import sample_from_logits
from .checks import _F32, _dev
from .compile import GEOMETRY, cupy

_SAMPLE_THREADS = GEOMETRY["sample"]["SMP_THREADS"]
_FAST_THREADS = GEOMETRY["sample"]["SMP_FAST_THREADS"]
_SAMPLE_MAX_N = 1 << 22  # sample_step: u64 sums of 2^40-scaled weights stay < 2^63
_FAST_MAX_BLOCKS = 512   # sample.cu SMP_MAX_BLOCKS
_FAST_CHUNK = 512        # tokens per block of the fast path's grid kernels (at least)
_FAST_BYTES = 9288 + 4 * REPEAT_LAST_N_MAX    # sizeof(SmpFast) in sample.cu
_PRM = 8                 # sample.cu SMP_PRM: f64 parameters per sampler call


def _fast_grid(n: int) -> int:
    return max(1, min(_FAST_MAX_BLOCKS, -(-n // _FAST_CHUNK)))


def _check_draw(temperature, top_k, u) -> None:
    """ConfigError for a sampled row's u outside [0, 1) or top_k < 0."""
    if temperature > 0.0 and not 0.0 <= u < 1.0:
        raise ConfigError(f"u must lie in [0, 1), got {u}")
    if temperature > 0.0 and top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (0 = off), got {top_k}")


class SamplingOps:
    """``sample`` and the captured step's heads on the device (mixed into CudaOps)."""

    def sample(self, logits, temperature, top_k, top_p, u, min_p=0.0, repetition_penalty=1.0,
               recent_ids=None) -> int:
        """The next token id from f32 logits [vocab] (or [1, vocab]), by
        ``numpy_ops.sample_from_logits``'s rule; only the id crosses to the host.

        temperature <= 0 and no repetition penalty: the argmax kernel writes the id straight to
        pinned host memory (no allocation; one stream synchronisation). Otherwise
        ``sample_launch``: sample.cu's sampler, the captured step's (fixed-point weights,
        radix selects: no sort of the row, no CuPy temporaries), with its parameters in pinned
        memory of their own; a vocabulary past 2^22, which its fixed-point sums do not take, is
        copied to the host and sampled by the NumPy rule itself. Either kernel writes the
        row's fault code beside the id, so a row with a NaN or +inf, or only -inf, raises
        NonFiniteLogitsError as on NumPy (checked once the stream has synchronised; no extra
        pass over the row). ``recent_ids``: the penalty window, at most REPEAT_LAST_N_MAX ids
        in [0, vocab). Raises ConfigError for u outside [0, 1), top_k < 0, a bad window.
        """
        _dev(logits, "logits", np.float32)
        if logits.ndim == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ConfigError(f"logits must be one row [vocab], got shape {logits.shape}")
        _check_draw(temperature, top_k, u)
        n = logits.shape[0]
        pen = penalized(repetition_penalty, recent_ids)
        if pen:
            ids = np.asarray(recent_ids, dtype=np.int64).reshape(-1)
            if ids.size > REPEAT_LAST_N_MAX or ids.min() < 0 or ids.max() >= n:
                raise ConfigError(f"recent_ids must be at most {REPEAT_LAST_N_MAX} ids in "
                                  f"[0, {n}), got {ids.size} in [{ids.min()}, {ids.max()}]")
        if temperature <= 0.0 and not pen:
            self._fn("sample", "argmax_f32")((1,), (_SAMPLE_THREADS,),
                                             (logits.data.ptr, n, self._id_ptr))
        elif n <= _SAMPLE_MAX_N:
            self.sample_launch(logits, temperature, top_k, top_p, u, min_p, repetition_penalty,
                               recent_ids)
        else:
            return sample_from_logits(cupy.asnumpy(logits), temperature, top_k, top_p, u, min_p,
                                      repetition_penalty, recent_ids)
        cupy.cuda.get_current_stream().synchronize()
        self._raise_on_fault()
        return int(self._id_view[0])

    def argmax_rows(self, logits, out) -> None:
        """``Ops.argmax_rows`` in one launch (sample.cu ``argmax_f32``, grid B): row i's id
        and fault code go straight to ``out[i]``, which must be this backend's
        ``batch_host_ids`` buffer (mapped pinned memory). No synchronisation. Raises
        ConfigError for logits that are not f32 [B, vocab] contiguous on the device, or
        another ``out``."""
        _dev(logits, "logits", np.float32, 2)
        if not logits.flags.c_contiguous or logits.shape[1] == 0:
            raise ConfigError(f"logits must be contiguous f32 [B, vocab], got shape "
                              f"{logits.shape}")
        b = logits.shape[0]
        ids = self._bids
        if (ids is None or not isinstance(out, np.ndarray) or out.shape[0] < b
                or out.ctypes.data != ids.ctypes.data):
            raise ConfigError("argmax_rows writes into the backend's batch_host_ids buffer "
                              f"of at least {b} rows")
        self._fn("sample", "argmax_f32")((b,), (_SAMPLE_THREADS,),
                                         (logits.data.ptr, logits.shape[1], out.ctypes.data))

    def _host_block(self, name: str, nbytes: int):
        """The mapped pinned block held in attribute ``name`` (tag scratch), of at least
        ``nbytes`` bytes: taken, or when too small freed after a synchronisation and taken
        again (never inside a capture: a captured step addresses the old one). Returns its
        host address."""
        blk = getattr(self, name)
        if blk is None or blk.requested_bytes < nbytes:
            if self._capturing is not None:
                raise ConfigError("a decode batch's host buffers must exist before a capture")
            if blk is not None:
                cupy.cuda.get_current_stream().synchronize()
                setattr(self, name, None)
                blk.free()
            blk = self._pinned_pool.allocate(int(nbytes), "scratch")
            setattr(self, name, blk)
        return blk.ptr

    def batch_host_ids(self, rows: int):
        """``Ops.batch_host_ids``: int32 [rows, 2] of mapped pinned memory (tag scratch, UVA:
        the kernel writes it at its host address); grown, never inside a capture, when more
        rows are asked for (the old buffer is then freed after a synchronisation)."""
        rows = int(rows)
        if self._bids is None or self._bids.shape[0] < rows:
            self._bids = None
            ptr = self._host_block("_bids_blk", 8 * rows)
            self._bids = np.ctypeslib.as_array(
                (ctypes.c_int32 * (2 * rows)).from_address(ptr)).reshape(rows, 2)
        return self._bids[:rows]

    def batch_host_inputs(self, nbytes: int):
        """``Ops.batch_host_inputs``: uint8 [nbytes] of pinned memory (tag scratch) that
        ``copy_host_inputs`` copies from; grown as ``batch_host_ids``."""
        nbytes = int(nbytes)
        if self._binp is None or self._binp.size < nbytes:
            self._binp = None
            ptr = self._host_block("_binp_blk", nbytes)
            self._binp = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return self._binp[:nbytes]

    def copy_host_inputs(self, host, out) -> None:
        """``Ops.copy_host_inputs``: one cudaMemcpyAsync host -> device on the current stream
        (inside a capture: a copy node, which reads ``host`` at every replay)."""
        if host.nbytes != out.nbytes or host.dtype != out.dtype:
            raise ConfigError(f"copy_host_inputs: host {host.dtype} {host.shape} does not "
                              f"match device {out.dtype} {out.shape}")
        if not (host.flags.c_contiguous and out.flags.c_contiguous):
            raise ConfigError("copy_host_inputs: both arrays must be contiguous")
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, host.ctypes.data, host.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    def sample_rows(self, logits, rows) -> list:
        """``Ops.sample_rows`` with one synchronisation: every row without a repetition
        penalty is queued first (the argmax for temperature <= 0, else the sampler of
        ``sample_launch``), each with its own parameters and result words in mapped pinned
        memory (``_rows_sampler``), then the rows with a penalty (whose window ring is one
        per backend) run one by one through ``sample``. A vocabulary past the sampler's
        2^22 runs every row through ``sample``."""
        _dev(logits, "logits", np.float32, 2)
        n = logits.shape[1]
        if not logits.flags.c_contiguous or n == 0 or n > _SAMPLE_MAX_N:
            return super().sample_rows(logits, rows)
        out: list = [None] * len(rows)
        check_sample_rows(rows, logits.shape[0])        # every row checked before any runs
        for _, temperature, top_k, _, u, *_ in rows:
            _check_draw(temperature, top_k, u)
        prm, ids = self._rows_sampler(len(rows))
        queued, later = [], []
        for j, (i, temperature, top_k, top_p, u, *_) in enumerate(rows):
            min_p, pen, recent = sample_filters(rows[j][1:])
            if penalized(pen, recent):
                later.append(j)
                continue
            row = logits.data.ptr + int(i) * n * 4
            out_ptr = ids.ctypes.data + 8 * j
            if temperature <= 0.0:
                self._fn("sample", "argmax_f32")((1,), (_SAMPLE_THREADS,), (row, n, out_ptr))
            else:
                self._ensure_wq(n)
                self._write_prm(prm[j], temperature, top_k, top_p, u, min_p, 1.0, 0)
                self._sampler_launches(row, n, prm.ctypes.data + 8 * _PRM * j, out_ptr, None)
            queued.append(j)
        if queued:
            cupy.cuda.get_current_stream().synchronize()
        for j in queued:
            code = int(ids[j, 1])
            out[j] = non_finite_logits(LOGIT_FAULTS[code]) if code else int(ids[j, 0])
        for j, got in zip(later, Ops.sample_rows(self, logits, [rows[j] for j in later])):
            out[j] = got
        return out

    def _rows_sampler(self, rows: int) -> tuple:
        """(f64 [rows, 8] parameters, int32 [rows, 2] ids and fault codes) of ``sample_rows``:
        one mapped pinned block (tag scratch), grown (after a synchronisation) for more
        rows."""
        if self._rsmp is None or self._rsmp[0].shape[0] < rows:
            if self._rsmp_blk is not None:
                cupy.cuda.get_current_stream().synchronize()
                blk, self._rsmp_blk, self._rsmp = self._rsmp_blk, None, None
                blk.free()
            self._rsmp_blk = self._pinned_pool.allocate(rows * (8 * _PRM + 8), "scratch")
            base = self._rsmp_blk.ptr
            prm = np.ctypeslib.as_array((ctypes.c_double * (_PRM * rows)).from_address(base))
            ids = np.ctypeslib.as_array(
                (ctypes.c_int32 * (2 * rows)).from_address(base + 8 * _PRM * rows))
            self._rsmp = (prm.reshape(rows, _PRM), ids.reshape(rows, 2))
        prm, ids = self._rsmp
        return prm, ids

    def _raise_on_fault(self) -> None:
        """Raise NonFiniteLogitsError for the fault code an argmax / sampler kernel wrote
        (after a synchronisation)."""
        code = int(self._id_view[1])
        if code:
            raise non_finite_logits(LOGIT_FAULTS[code])

    def sample_launch(self, logits, temperature, top_k, top_p, u, min_p=0.0,
                      repetition_penalty=1.0, recent_ids=None) -> None:
        """Queue sample.cu's sampler on f32 logits [n] (validated by ``sample``; n <= 2^22),
        its parameters written to the eager sampler's pinned f64 [8] first; the id and the
        row's fault code go to the mapped pinned int [2] ``step_host_buffer``. With the
        penalty the window goes to the eager window ring (mapped pinned memory the kernel
        reads, so this makes no CUDA call and a capture may hold it) and ``sample_penalize``
        writes the penalised row first. Its scratch is pool blocks, grown only for a larger
        vocabulary."""
        n = logits.shape[0]
        self._ensure_wq(n)
        pen = penalized(repetition_penalty, recent_ids)
        m = len(recent_ids) if pen else 0
        self._write_prm(self._esmp_view, temperature, top_k, top_p, u, min_p,
                        repetition_penalty, m)
        if pen:
            ids = np.asarray(recent_ids, dtype=np.int32).reshape(-1)
            self._ering[:m] = ids
            self._estate[:] = (ids[-1], 0, m - 1, 0)
        self._sampler_launches(logits.data.ptr, n, self._esmp_ptr, self._id_ptr,
                               (self._ering_ptr, self._estate_ptr) if pen else None)

    @staticmethod
    def _write_prm(view, temperature, top_k, top_p, u, min_p, penalty, last_n) -> None:
        """The sampler's f64 [8] parameters (sample.cu SMP_P_*)."""
        vals = (float(temperature), float(int(top_k)), float(top_p), float(u), float(min_p),
                float(penalty), float(int(last_n)), 0.0)
        for i in range(_PRM):
            view[i] = vals[i]

    def _sampler_launches(self, logits_ptr: int, n: int, prm_ptr: int, out_ptr: int,
                          penalty) -> None:
        """The sampler's launches on the row at ``logits_ptr`` (f32 [n]): ``sample_params``
        first (the f64 [8] parameters at ``prm_ptr``, and with ``penalty`` = (window ring,
        state) pointers the window, into the device scratch), then with ``penalty``
        ``sample_penalize`` into the scratch row; then the fast path's three kernels, or the
        reference ``sample_step`` when ``KernelChoice.sampler`` says so. Fixed launches
        whatever the parameters (they are read on the device), so a captured step holds
        them."""
        fs = self._fs_ptr
        ring, state = penalty if penalty is not None else (0, 0)
        self._fn("sample", "sample_params")((1,), (_SAMPLE_THREADS,),
                                            (prm_ptr, fs, ring, state))
        if penalty is not None:
            self._fn("sample", "sample_penalize")(
                (_fast_grid(n),), (_FAST_THREADS,), (logits_ptr, n, fs, self._pl_ptr))
            logits_ptr = self._pl_ptr
        if self.kernels.sampler == "reference":
            # SmpFast's first field is the parameters' device copy
            self._fn("sample", "sample_step")(
                (1,), (_SAMPLE_THREADS,), (logits_ptr, n, fs, self._wq_ptr, out_ptr))
            return
        g = _fast_grid(n)
        self._fn("sample", "sample_fast_max")((g,), (_FAST_THREADS,), (logits_ptr, n, fs))
        self._fn("sample", "sample_fast_hist")((g,), (_FAST_THREADS,),
                                               (logits_ptr, n, fs, self._wq_ptr))
        self._fn("sample", "sample_fast_pick")(
            (1,), (_SAMPLE_THREADS,), (logits_ptr, n, fs, g, self._wq_ptr, out_ptr))

    def _ensure_wq(self, n: int) -> None:
        """The sampler's scratch: u64 [>= n] weights and the f32 [>= n] penalised row
        (one pool block, grown only for a larger vocabulary), and the fast path's bins with
        the captured step's window ring (one fixed device block), and the eager sampler's
        window ring and step words int32 [4] (mapped pinned memory). Never inside a capture:
        the eager step before it makes them."""
        if self._fs_blk is None:
            if self._capturing is not None:
                raise ConfigError("the sampler's scratch must exist before a capture")
            blk = self._cuda_pool.allocate(_FAST_BYTES + 4 * REPEAT_LAST_N_MAX, "scratch")
            try:
                pin = self._pinned_pool.allocate(4 * REPEAT_LAST_N_MAX + 16, "scratch")
            except BaseException:
                blk.free()
                raise
            raw = blk.array((blk.requested_bytes,), np.uint8)
            self._fs_blk, self._fs_ptr, self._epin_blk = blk, blk.ptr, pin
            self._ring = raw[_FAST_BYTES:_FAST_BYTES + 4 * REPEAT_LAST_N_MAX].view(np.int32)
            self._ering_ptr = pin.ptr
            self._ering = np.ctypeslib.as_array(
                (ctypes.c_int32 * REPEAT_LAST_N_MAX).from_address(pin.ptr))
            self._estate_ptr = pin.ptr + 4 * REPEAT_LAST_N_MAX
            self._estate = np.ctypeslib.as_array(
                (ctypes.c_int32 * 4).from_address(self._estate_ptr))
        if n <= self._wq_cap:
            return
        if self._capturing is not None:
            raise ConfigError("the sampler's scratch must be grown before a capture")
        if self._wq_blk is not None:
            cupy.cuda.get_current_stream().synchronize()
            blk, self._wq_blk, self._wq_ptr, self._wq_cap = self._wq_blk, None, 0, 0
            blk.free()
        self._wq_blk = self._cuda_pool.allocate(12 * n, "scratch")
        self._wq_ptr = self._wq_blk.ptr
        self._pl_ptr = self._wq_ptr + 8 * n
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

    def set_step_sampling(self, temperature, top_k, top_p, u, min_p=0.0,
                          repetition_penalty=1.0, repeat_last_n=0) -> None:
        """``Ops.set_step_sampling``: validated, then written to the mapped pinned f64 [8] that
        a replayed sampler reads. Only between steps (the previous replay has synchronised,
        so no kernel is reading it)."""
        super().set_step_sampling(temperature, top_k, top_p, u, min_p, repetition_penalty,
                                  repeat_last_n)
        t, k, p, u = self._step_sampling
        mp, pen, last_n = self._step_filters
        self._write_prm(self._smp_view, t, k, p, u, mp, pen, last_n if pen != 1.0 else 0)

    def set_step_window(self, recent_ids, pos: int, repeat_last_n: int) -> None:
        """``Ops.set_step_window``: the window ring (``base.window_ring``) copied to the
        captured step's device ring, then the stream synchronised (a replay on another stream
        follows). Only between steps, never inside a capture."""
        ring = window_ring(recent_ids, pos, repeat_last_n)
        self._ensure_wq(1)
        self._ring[:ring.size].set(ring)
        cupy.cuda.get_current_stream().synchronize()

    def head_sample_step(self, x, weight, eps, w, out, norm, step) -> None:
        """Sampled head into the step state (``Ops.head_sample_step``): ``rmsnorm_lm_head``
        into ``out`` f32 [1, vocab], then (with the repetition penalty of the last
        ``set_step_sampling`` on) ``sample_penalize`` over the window ring, which
        ``sample_params`` advances, and the sampler (``_sampler_launches``; parameters read
        at run time from ``set_step_sampling``'s pinned buffer; id and fault code to
        ``step``). Whether the penalty runs is fixed when the step is captured (a graph
        key). Its scratch must exist before a capture: the eager step that precedes every
        capture makes it. Raises ConfigError past the device sampler's vocabulary limit."""
        sp = self._step_ptr(step)
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        info = self._info(w)
        out = self._out(out, "out", _F32, 1, info.n)
        n = info.n
        if n > _SAMPLE_MAX_N:
            raise ConfigError(f"a sampled decode step needs the device sampler (vocabulary "
                              f"<= {_SAMPLE_MAX_N}); got {n} tokens")
        self._ensure_wq(n)
        _, pen, last_n = self._step_filters
        penalty = (self._ring.data.ptr, sp) if pen != 1.0 and last_n > 0 else None
        self._sampler_launches(out.data.ptr, n, self._smp_ptr, sp, penalty)
