"""Launching a kernel: the wrapper every op calls (``Kernel``), and programmatic dependent
launch (PDL) through ``cuLaunchKernelEx`` for the kernels of a captured decode step.

CuPy's RawKernel packs a Python int as int64, a float as double and a cupy.ndarray as its
device pointer; every kernel entry takes only pointers, ``i64`` and ``double`` by value for
that reason.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np

from ...errors import ConfigError
from .compile import cupy

# The kernels a captured decode step may launch with PDL: each calls kernels/common.cuh's
# pdl_wait() before it reads anything an earlier kernel writes (TL_PDL_ENTER at its top, or in
# gemv2_body after the weight preload). Name prefixes; tests/kernels/test_pdl.py checks each entry's
# source. A kernel outside this list is launched plainly even while PDL is on.
PDL_KERNELS = ("gemv_", "gemv2_", "kv_write_", "attn_split_", "attn_decode_",
               "embed_q", "argmax_f32", "sample_", "swiglu_f16",
               "add_f16_to_f32", "concat_inject_", "copy_f16_to_f32", "decode_step_advance",
               "qkv_rope_step_", "scale_f32", "add_bias_f16", "init_state_f32")
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


# Argument signatures, declared per kernel (a pattern over its names) and checked once, at a
# kernel's first launch: p = a pointer (an int address, 0 for none, or a cupy.ndarray),
# i = an i64 (a Python int), f = a double (a Python float). Every entry takes only these: a
# Python int travels as int64 and a float as double (CuPy's packing), so an ``int`` or
# ``float`` parameter would read garbage. tests/kernels/test_pdl.py checks each pattern against the
# entries of kernels/*.cu.
_PAGED = "pi" + "iiii"                 # block table, P, then the four part offsets
SIGNATURES = (
    (r"embed_q\d+", "ppppiiiip"),
    (r"dequant_f16_q\d+", "pppiip"),
    (r"rmsnorm_f32_f16", "ppfip"),
    (r"rmsnorm_f32_inplace", "ppfi"),
    (r"rmsnorm_f16_add_f32", "ppfip"),
    (r"scale_f32", "pif"),
    (r"add_bias_f16", "ppi"),
    (r"init_state_f32", "pipiffi"),
    (r"init_state_rows_f32", "ppiffi"),
    (r"swiglu_f16", "pip"),
    (r"(add|copy)_f16_to_f32", "pip"),
    (r"concat_inject_f(16|32)", "ppip"),
    (r"gemv_q\d+_\w+", "ppppiiiip"),
    (r"gemv_rows\d_q\d+_\w+", "ppppiiiiiipi"),
    (r"gemv_mma\w+_q\d+_\w+", "ppppiiiiiipi"),
    (r"gemv_norm_q\d+_\w+", "ppfpppiiiip"),
    (r"gemv2_q\d+_\w+_l\w+", "ppppiiiip"),
    (r"gemv_tc_q\d+_\w+", "ppppiiiip"),
    (r"gemv_tc_norm_q\d+_\w+", "ppfpppiiiip"),
    (r"gemv2_norm_q\d+_argmax_l\w+", "ppfpppiiipppppp"),
    (r"gemv2_norm_q\d+_(?!argmax)\w+_l\w+", "ppfpppiiiip"),
    (r"gemm_q\d+_\w+", "ppppiiiipi"),
    (r"qkv_rope_step_q\d+_\w+", "ppfpppiiipp" + "fiii" + _PAGED + "pp"),
    (r"kv_write_step_\w+", "pip" + "fiii" + _PAGED),
    # a decode batch: positions [B] in place of the position, block-table addresses [B] in
    # place of the table (kv.cache.batch_index)
    (r"kv_write_batch_\w+", "pip" + "fiii" + _PAGED),
    (r"kv_write_(?!step_|batch_)\w+", "pii" + "fiii" + _PAGED),
    (r"decode_step_advance", "ppfi"),
    # the attention kernels: ... n_heads, n_kv, scale_log2, window (0 = full attention), ...
    (r"attn_prefill_\w+_hd\w+", "piii" + _PAGED + "iifip"),
    (r"attn_decode_step_\w+_hd\w+", "pp" + _PAGED + "iifip"),
    (r"attn_decode_batch_\w+_hd\w+", "pip" + _PAGED + "iifip"),
    (r"attn_decode_(?!step_|batch_)\w+_hd\w+", "pi" + _PAGED + "iifip"),
    (r"attn_split_batch_\w+_hd\w+", "pip" + _PAGED + "iifippp"),
    (r"attn_split_(?!batch_)\w+_hd\w+", "pip" + _PAGED + "iifippp"),
    (r"attn_fa_\w+_hd\w+", "piii" + _PAGED + "iifiip"),
    (r"h_write_\w+", "piipp" + "iiiiiiiii"),
    (r"h_read_\w+", "piiiiiiiiip"),
    (r"h_attn_chunk", "piipiiiiifipiip"),
    (r"argmax_f32", "pip"),
    (r"sample_step", "pippp"),
    (r"sample_params", "pppp"),
    (r"sample_penalize", "pipp"),
    (r"sample_fast_max", "pip"),
    (r"sample_fast_hist", "pipp"),
    (r"sample_fast_pick", "pipipp"),
)
_SIG_RE = tuple((re.compile(pat), kinds) for pat, kinds in SIGNATURES)


def signature(name: str) -> str:
    """The declared argument kinds of kernel ``name`` (the first pattern of SIGNATURES that
    matches it whole). Raises ConfigError for a kernel with no declaration."""
    for pat, kinds in _SIG_RE:
        if pat.fullmatch(name):
            return kinds
    raise ConfigError(f"kernel {name!r} has no declared argument signature "
                      "(launch.SIGNATURES)")


def check_args(name: str, kinds: str, args: tuple) -> None:
    """Raise ConfigError naming the kernel and the argument when ``args`` do not fit
    ``kinds`` (see SIGNATURES): the count, or an argument of the wrong Python type (a bool,
    a NumPy scalar other than int64 / float64, which CuPy would pack at another width)."""
    if len(args) != len(kinds):
        raise ConfigError(f"kernel {name} takes {len(kinds)} arguments ({kinds}), got "
                          f"{len(args)}")
    for i, (a, k) in enumerate(zip(args, kinds)):
        if isinstance(a, (bool, np.bool_)):
            ok = False
        elif k == "f":
            ok = isinstance(a, (float, np.float64))
        else:
            ok = isinstance(a, (int, np.int64)) or (
                k == "p" and cupy is not None and isinstance(a, cupy.ndarray))
        if not ok:
            want = {"p": "a pointer (int)", "i": "an i64 (int)", "f": "a double (float)"}[k]
            raise ConfigError(f"kernel {name} argument {i} must be {want}, got "
                              f"{type(a).__name__} {a!r}")


class Kernel:
    """A RawKernel of a family, called as CuPy's (grid, block, args, shared_mem=); launched
    with PDL while its backend's switch is on and its name is in PDL_KERNELS."""

    __slots__ = ("raw", "name", "pdl", "switch", "pool", "kinds")

    def __init__(self, raw, name: str, switch: PdlSwitch, pool=None):
        self.raw = raw
        self.name = name
        self.pdl = name.startswith(PDL_KERNELS)
        self.switch = switch
        self.pool = pool           # until the first launch: the pool that measures it
        self.kinds = signature(name)    # checked against the first launch's arguments

    def __getattr__(self, name):
        # everything else is the RawKernel's (.kernel: CuPy's Function, .attributes, ...)
        if name == "raw":              # not set yet: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.raw, name)

    def __call__(self, grid, block, args, shared_mem=0):
        if self.kinds is not None:
            check_args(self.name, self.kinds, args)
            self.kinds = None                    # once: the call sites pass fixed types
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
