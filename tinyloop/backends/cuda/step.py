"""The captured decode step's backend side (tinyloop/graphs.py drives it; the step state's
layout is ``backends.base``'s): stream capture, replay, programmatic dependent launch, and the
one-launch position advance: a mixin of CudaOps."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from ...errors import ConfigError
from ..base import STEP_WORDS
from .checks import _dev, _fast_ok, _shape
from .compile import GEOMETRY, cupy
from .launch import PdlLauncher

_STEP_ADVANCE_THREADS = GEOMETRY["rope"]["STEP_ADVANCE_THREADS"]
_EW_THREADS = GEOMETRY["elementwise"]["EW_THREADS"]


class StepOps:
    """Capture and replay of a decode step (mixed into CudaOps)."""

    graph_kv_modes = ("fp16", "int8")     # the store-h modes rebuild K/V chunk by chunk, with
                                          # a host loop over the context (the chunk count is
                                          # ceil(ctx / C)): eager only, never captured

    def graph_constants(self) -> tuple:
        """The host-chosen launch constants of a decode step: the GEMV version and forced
        geometry, the test grid cap, the SM count (v2 grids derive from it), the decode
        attention kernel, whether fp16 slots run the fused QKV + RoPE kernel
        (``KernelChoice.fused_qkv_rope``), whether the capture uses PDL (``pdl_capture``) and
        the sampler (``KernelChoice.sampler``)."""
        kc = self.kernels
        return ((kc.gemv, kc.gemv_lpr, kc.gemv_threads), self._grid_cap, self.sms,
                kc.attn_decode, kc.fused_qkv_rope, self.pdl_capture, kc.sampler)

    @property
    def pdl_capture(self) -> bool:
        """Whether a decode-step capture launches PDL_KERNELS with programmatic dependent
        launch: ``KernelChoice.pdl`` on, a GPU of compute capability
        9.0 or later (griddepcontrol is sm_90 PTX), and a driver that takes the launch: the
        first ask launches one empty kernel that way, outside any capture (a refusal - an old
        driver, no libcuda - warns once and turns PDL off for this backend, so captures use
        plain launches instead of failing)."""
        if self._cc < 90 or not self.kernels.pdl:
            return False
        if self._pdl.launcher is None:
            self._pdl.launcher = self._pdl_probe()
        return self._pdl.launcher is not False

    def _pdl_probe(self):
        """A working _PdlLauncher, or False (with a warning) when the driver refuses it."""
        if self._capturing is not None:
            raise ConfigError("the PDL probe must run before a capture opens")
        try:
            launcher = PdlLauncher()
            k = self._fn("elementwise", "copy_f16_to_f32")   # n = 0: touches no memory
            pool, k.pool = k.pool, None        # a first launch: measured, as _Kernel's
            with (pool.measure_driver("kernel modules") if pool is not None
                  else contextlib.nullcontext()):
                launcher.launch(k.raw.kernel.ptr, 1, _EW_THREADS, (0, 0, 0), 0,
                                cupy.cuda.get_current_stream().ptr)
            cupy.cuda.get_current_stream().synchronize()
            return launcher
        except Exception as exc:                         # OSError, CUDADriverError, ...
            warnings.warn(f"TinyLoop: programmatic dependent launch is unavailable ({exc}); "
                          "decode steps are captured with plain launches", RuntimeWarning,
                          stacklevel=3)
            return False

    @staticmethod
    def _step_ptr(step) -> int:
        if not (_fast_ok(step, np.dtype(np.int32), 1) and step.shape[0] == STEP_WORDS):
            _dev(step, "step", np.int32, 1)
            _shape(step, "step", (STEP_WORDS,))
        return step.data.ptr

    def step_advance(self, step, host_out, theta: float | None = None,
                     head_dim: int | None = None) -> None:
        """``step[STEP_POS] += 1`` and (id, fault) to ``host_out`` (``step_host_buffer``'s
        mapped pinned int32 [2]) in one launch (rope.cu ``decode_step_advance``), which also
        writes the new position's RoPE table into the state (STEP_ROPE) for the next step's
        KV writes when ``theta`` and ``head_dim`` (even, <= STEP_ROPE_MAX) are given."""
        if host_out.ctypes.data != self._id_ptr:
            raise ConfigError("host_out must be step_host_buffer()'s mapped pinned buffer")
        hd = int(head_dim) if theta is not None and head_dim is not None else 0
        self._fn("rope", "decode_step_advance")(
            (1,), (_STEP_ADVANCE_THREADS,),
            (self._step_ptr(step), self._id_ptr, float(theta or 0.0), hd))

    def step_host_buffer(self):
        """The mapped pinned int32 [2] the sampled id and fault code land in (shared with
        ``sample``: both synchronise before reading it)."""
        return np.ctypeslib.as_array(self._id_view)

    def graph_begin(self) -> None:
        """Begin a CuPy stream capture on this backend's non-blocking capture stream, made
        current until ``graph_end`` / ``graph_abort`` (relaxed mode: CuPy's default)."""
        if self._capturing is not None:
            raise ConfigError("a decode-step capture is already open")
        use_pdl = self.pdl_capture          # probes PDL once, before any capture
        if self._capture_stream is None:
            self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        s = self._capture_stream
        s.__enter__()
        try:
            s.begin_capture()
        except BaseException:
            s.__exit__(None, None, None)
            raise
        self._capturing = s
        self._pdl.on = use_pdl

    def graph_end(self):
        """End the capture; return the ``cupy.cuda.Graph`` (instantiated by CuPy)."""
        s, self._capturing = self._capturing, None
        self._pdl.on = False
        if s is None:
            raise ConfigError("no decode-step capture is open")
        try:
            return s.end_capture()
        finally:
            s.__exit__(None, None, None)

    def graph_abort(self) -> None:
        """End a failed capture and drop what it captured; the capture stream leaves capture
        mode (an invalidated capture raises from end_capture: ignored) and stops being
        current, so the next capture and every eager launch work."""
        s, self._capturing = self._capturing, None
        self._pdl.on = False
        if s is None:
            return
        try:
            try:
                s.end_capture()
            except Exception:        # invalidated by the failure, or already ended
                pass
        finally:
            s.__exit__(None, None, None)

    def graph_launch(self, graph) -> None:
        """Queue one replay on the current stream (ordered after the eager prefill)."""
        graph.launch(cupy.cuda.get_current_stream())

    def graph_sync(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    def graph_free(self, graph) -> None:
        """Nothing to do beyond dropping the reference: CuPy's Graph destroys its graph and
        executable graph when collected (the caller holds the only reference)."""
