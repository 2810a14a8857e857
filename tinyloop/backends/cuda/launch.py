"""Launching a kernel: the wrapper every op calls (``Kernel``), and programmatic dependent
launch (PDL) through ``cuLaunchKernelEx`` for the kernels of a captured decode step.

CuPy's RawKernel packs a Python int as int64, a float as double and a cupy.ndarray as its
device pointer; every kernel entry takes only pointers, ``i64`` and ``double`` by value for
that reason.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ...errors import ConfigError
from .compile import cupy

# The kernels a captured decode step may launch with PDL: each calls kernels/common.cuh's
# pdl_wait() before it reads anything an earlier kernel writes (TL_PDL_ENTER at its top, or in
# gemv2_body after the weight preload). Name prefixes; tests/test_pdl.py checks each entry's
# source. A kernel outside this list is launched plainly even while PDL is on.
PDL_KERNELS = ("gemv_", "gemv2_", "kv_write_", "attn_split_", "attn_decode_",
               "embed_q", "argmax_f32", "sample_step", "swiglu_f16",
               "add_f16_to_f32", "concat_inject_", "copy_f16_to_f32", "decode_step_advance",
               "qkv_rope_step_")
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6      # cuda.h CUlaunchAttributeID


class _CULaunchAttribute(ctypes.Structure):
    # cuda.h CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _CULaunchConfig(ctypes.Structure):
    # cuda.h CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


def _dim3(d) -> tuple:
    t = (int(d),) if isinstance(d, (int, np.integer)) else tuple(int(v) for v in d)
    if not 1 <= len(t) <= 3:
        raise ConfigError(f"a launch dimension takes 1 to 3 values, got {d!r}")
    return t + (1,) * (3 - len(t))


def _kernel_arg(a):
    """One kernel argument as CuPy's RawKernel packs it: a Python int as int64, a float as
    double, a NumPy scalar as its own dtype, a cupy.ndarray as its device pointer."""
    if isinstance(a, (bool, np.bool_)):
        raise ConfigError("a kernel argument must not be a bool (pass an int)")
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    if isinstance(a, np.generic):
        raw = a.tobytes()
        return (ctypes.c_char * len(raw)).from_buffer_copy(raw)
    if cupy is not None and isinstance(a, cupy.ndarray):
        return ctypes.c_uint64(a.data.ptr)
    raise ConfigError(f"unsupported kernel argument type {type(a).__name__}")


class PdlLauncher:
    """``cuLaunchKernelEx`` with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1
    (CuPy's RawKernel sets no launch attributes): the launched kernel may begin before the
    previous kernel in the stream completes, and waits for it in ``pdl_wait``. Captured into
    a graph this becomes a programmatic dependency edge (CUDA 12.3+)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p]
        self._attr = _CULaunchAttribute()
        self._attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        ctypes.memmove(ctypes.addressof(self._attr) + _CULaunchAttribute.value.offset,
                       ctypes.byref(ctypes.c_int(1)), 4)

    def launch(self, func_ptr: int, grid, block, args: tuple, shared_mem: int,
               stream_ptr: int) -> None:
        """Queue ``func_ptr`` (a CUfunction) on ``stream_ptr``; raises CuPy's CUDADriverError
        for a refused launch (nothing queued)."""
        g, b = _dim3(grid), _dim3(block)
        cfg = _CULaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), stream_ptr,
                              ctypes.addressof(self._attr), 1)
        vals = [_kernel_arg(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        rc = self._launch(ctypes.byref(cfg), func_ptr, params, None)
        if rc != 0:
            raise cupy.cuda.driver.CUDADriverError(rc)


class PdlSwitch:
    """Whether launches go through ``PdlLauncher`` now (on only while a decode step is being
    captured with PDL); shared by one backend's kernels. ``launcher``: None until
    ``CudaOps.pdl_capture`` probes, then the launcher or False (refused)."""

    __slots__ = ("on", "launcher")

    def __init__(self):
        self.on = False
        self.launcher = None


class Kernel:
    """A RawKernel of a family, called as CuPy's (grid, block, args, shared_mem=); launched
    with PDL while its backend's switch is on and its name is in PDL_KERNELS."""

    __slots__ = ("raw", "name", "pdl", "switch", "pool")

    def __init__(self, raw, name: str, switch: PdlSwitch, pool=None):
        self.raw = raw
        self.name = name
        self.pdl = name.startswith(PDL_KERNELS)
        self.switch = switch
        self.pool = pool           # until the first launch: the pool that measures it

    def __getattr__(self, name):
        # everything else is the RawKernel's (.kernel: CuPy's Function, .attributes, ...)
        if name == "raw":              # not set yet: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.raw, name)

    def __call__(self, grid, block, args, shared_mem=0):
        if self.pool is not None:
            # a lazily loaded module loads the kernel at its first launch: measured
            pool, self.pool = self.pool, None
            with pool.measure_driver("kernel modules"):
                return self(grid, block, args, shared_mem)
        sw = self.switch
        if sw.on and self.pdl:
            sw.launcher.launch(self.raw.kernel.ptr, grid, block, args, shared_mem,
                               cupy.cuda.get_current_stream().ptr)
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)
