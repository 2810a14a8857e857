"""CudaOps: the op set of ``backends.base`` on CuPy device arrays, composed of one mixin per
kernel family (norms, gemv, gemm, kv, attention, sampling, the captured step); this module
holds what they share: the backend's scratch blocks, the kernel cache and host <-> device
memory.

Every op has one host wrapper that validates dtype, shape and contiguity (errors name the
bad value) and then launches with raw pointers and plain Python ints / floats, so the decode
path does no allocation and no host synchronisation except ``sample``'s one chosen id.
Dtypes: activations float16, residual stream and logits float32; the KV cache is paged
(``kv/layouts.py``): FP16 K/V, or INT8 codes + FP16 scales, read through a device block table;
or (store-h modes) the normed QKV input h as FP16 / INT8 / INT4 codes, from which attention
rebuilds K and V chunk by chunk into the phase-5 scratch.
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import numpy as np

from ...errors import ConfigError
from ...memory import get_pool
from ..base import Ops
from .attention import AttentionOps
from .checks import _aligned, _dev, _fast_ok, _rows, _shape
from .choice import KernelChoice
from .compile import FAMILIES, cupy, get_module
from .gemm import GemmOps
from .gemv import _BLOCKS_PER_SM, _MAX_BLOCKS_PER_SM, GemvOps
from .kv import H_KERNEL_MODES, KV_KERNEL_MODES, KVOps
from .launch import Kernel, PdlSwitch
from .norms import NormOps
from .sampling import SamplingOps
from .step import StepOps


class CudaOps(NormOps, GemvOps, GemmOps, KVOps, AttentionOps, SamplingOps, StepOps, Ops):
    """Ops on CuPy device arrays inside TinyLoop's CUDA pool (see the module docstring)."""

    name = "cuda"
    device = "cuda"
    act_dtype = np.float16
    kv_dtype = np.float16
    kv_modes = KV_KERNEL_MODES + H_KERNEL_MODES
    fp16_cache_default = False    # the GEMV / GEMM kernels read the packed weights directly
    xp = cupy

    def __init__(self, kernels: KernelChoice | None = None):
        """``kernels``: the kernel variant of each op (``KernelChoice``; None: the defaults).
        Raises ConfigError without CuPy or for a ``kernels`` that is not a KernelChoice."""
        if cupy is None:
            raise ConfigError("CudaOps needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)")
        self._fns: dict = {}
        self._pdl = PdlSwitch()      # on while a decode step is captured with PDL
        self._winfo = weakref.WeakKeyDictionary()    # device QuantWeight -> _WInfo
        self._heads_seen: set = set()                # (H, Hkv, hd, qkv cols) already checked
        # grid cap of the RMSNorm-fused GEMVs: about one resident wave, so each launch
        # normalizes the row at most this many times (blocks stride over the rows)
        try:
            sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        except Exception:                                # an older CuPy: no .attributes
            sms = int(cupy.cuda.runtime.getDeviceProperties(
                cupy.cuda.Device().id)["multiProcessorCount"])
        self._resident: dict = {}      # (kernel, threads, smem) -> resident blocks (GemvOps)
        self.sms = sms
        self._cc = int(cupy.cuda.Device().compute_capability)     # e.g. 90 for sm_90
        self._kernels = KernelChoice.of(kernels)
        # Every buffer of the backend's own is a pool block under tag "scratch": device
        # scratch in the cuda pool, the mapped host words in the pinned pool (blocks of these
        # process pools, returned by release() or, for an Ops no Model owns, when it dies).
        self._cuda_pool = get_pool("cuda")
        self._pinned_pool = get_pool("pinned")
        # split-K decode attention's partials f32 [n_heads, splits, hd + 2], a pool block
        # taken on the first decode that needs more (an eager step always precedes a capture,
        # so a captured launch never grows it; a capture that did would fail its pool check)
        self._ds_blk, self._ds_ptr, self._ds_cap = None, 0, 0
        # the decode batch's split-K tickets and partials (attention.AttentionOps
        # ._batch_split_scratch), a pool block taken on the first batch and grown when a
        # larger one needs more
        self._dsb_blk, self._dsb_cap, self._dsb_tick = None, 0, 0
        self._grid_cap = None          # tests: cap every v2 grid (exercises the row stride)
        self._in_batch = False         # inside decode_batch_scope (gemv.py _rows_path)
        # The sampled id and the row's fault code (base.LOGIT_FAULTS) land in 8 bytes of
        # pinned, mapped host memory that the argmax kernels write directly (UVA: the host
        # pointer is valid on the device), so greedy decode allocates nothing and copies
        # nothing back besides these two ints. Then two sets of sampler parameters f64 [8] =
        # (temperature, top_k, top_p, u, min_p, repetition penalty, window, 0) that sample.cu's
        # kernels read when they run: a captured step's (the host writes them before each
        # replay: set_step_sampling / head_sample_step) and an eager ``sample``'s, apart so
        # neither overwrites the other. One pinned block holds all three.
        self._pinned_blk = self._pinned_pool.allocate(8 + 128, "scratch")
        self._id_ptr = self._pinned_blk.ptr
        self._id_view = (ctypes.c_int32 * 2).from_address(self._id_ptr)
        self._smp_ptr = self._id_ptr + 8
        self._smp_view = (ctypes.c_double * 8).from_address(self._smp_ptr)
        self._esmp_ptr = self._smp_ptr + 64
        self._esmp_view = (ctypes.c_double * 8).from_address(self._esmp_ptr)
        # Device scratch of the LM head's fused argmax (gemv2_norm_*_argmax): one (value, id)
        # partial per block (at most one resident wave of the smallest blocks), the last-block
        # ticket (0 between launches: the kernel re-arms it) and the device copy of the chosen
        # id (what a captured step's next embedding would read). Then qkv_rope.cu's int8
        # ticket (u32, likewise re-armed by the kernel).
        self._part_cap = sms * _MAX_BLOCKS_PER_SM
        nbytes = self._part_cap * 8 + 32
        self._scratch_blk = self._cuda_pool.allocate(nbytes, "scratch")
        self._scratch_ptr = self._scratch_blk.ptr
        cupy.cuda.runtime.memset(self._scratch_ptr, 0, nbytes)
        self._part_v = self._scratch_ptr
        self._part_i = self._scratch_ptr + self._part_cap * 4
        self._ticket = self._scratch_ptr + self._part_cap * 8
        self._id_dev = self._ticket + 8
        self._qkv_ticket = self._ticket + 16
        # the sampler's u64 [vocab] weights and f32 [vocab] penalised row (a pool block, taken
        # at the first use), and the fast path's bins with the penalty window rings (another)
        self._wq_blk, self._wq_ptr, self._wq_cap, self._pl_ptr = None, 0, 0, 0
        self._fs_blk, self._fs_ptr, self._epin_blk = None, 0, None
        # a decode batch's greedy ids and fault codes, int32 [rows, 2] of mapped pinned
        # memory that argmax_rows' kernel writes (batch_host_ids; grown for more rows)
        self._bids_blk, self._bids = None, None
        # a decode batch's token ids and index, staged for the step's own copy nodes
        # (pinned; batch_host_inputs)
        self._binp_blk, self._binp = None, None
        # sample_rows' parameters and results per row (mapped pinned, _rows_sampler)
        self._rsmp_blk, self._rsmp = None, None
        self._ring = self._ering = self._estate = None
        self._ering_ptr = self._estate_ptr = 0
        self._cublas_measured = False       # the first cuBLAS call is measured (NVML)
        self._capture_stream = None         # the decode-step capture stream (graph_begin)
        self._capturing = None              # that stream while a capture is open

    _BLOCKS = ("_pinned_blk", "_scratch_blk", "_ds_blk", "_dsb_blk", "_wq_blk", "_fs_blk",
               "_epin_blk", "_bids_blk", "_rsmp_blk", "_binp_blk")

    @property
    def kernels(self) -> KernelChoice:
        """The kernel variant of each op (``KernelChoice``). Assigning another choice (tests
        and benchmarks comparing variants on one model) drops the per-weight launch
        parameters, which depend on the GEMV choice; a captured step keys on it
        (``graph_constants``). Raises ConfigError for a value that is not a KernelChoice."""
        return self._kernels

    @kernels.setter
    def kernels(self, choice: KernelChoice) -> None:
        self._kernels = KernelChoice.of(choice)
        self._winfo = weakref.WeakKeyDictionary()

    def release(self) -> None:
        """Return the backend's scratch blocks to their pools (``Model.free`` calls it after
        the stream is idle; this Ops is not used afterwards). Idempotent."""
        self._id_view = self._smp_view = self._esmp_view = None
        self._id_ptr = self._smp_ptr = self._esmp_ptr = 0
        self._scratch_ptr = self._ds_ptr = self._wq_ptr = self._pl_ptr = self._fs_ptr = 0
        self._ring = self._ering = self._estate = None
        self._bids = self._rsmp = self._binp = None
        self._ering_ptr = self._estate_ptr = 0
        self._ds_cap = self._wq_cap = self._dsb_cap = self._dsb_tick = 0
        for name in self._BLOCKS:
            blk = getattr(self, name, None)
            setattr(self, name, None)
            if blk is not None and not blk.freed:
                blk.pool.free(blk)

    def scratch_bytes(self, pool) -> int:
        """Bytes of this backend's scratch blocks (argmax partials and tickets, split-K
        partials, the sampler's scratch; the mapped host words in the pinned pool) in
        ``pool``."""
        return sum(b.nbytes for b in (getattr(self, n, None) for n in self._BLOCKS)
                   if b is not None and not b.freed and b.pool is pool)

    def __del__(self, _finalizing=sys.is_finalizing):
        # An Ops no Model released (a test's or a benchmark's) gives its blocks back when it
        # dies; the collector may run this while a pool's lock is held, so the pool defers
        # the free. At exit the pools go with the process (the check is bound here: by then
        # the interpreter may have cleared this module's globals, sys among them).
        if _finalizing():
            return
        for name in self._BLOCKS:
            blk = getattr(self, name, None)
            if blk is not None and not blk.freed:
                blk.pool.free_from_finalizer(blk)

    def _fn(self, family: str, kernel: str):
        fn = self._fns.get(kernel)
        if fn is None:
            # module loads take device memory outside the pool: measured, to be named
            with self._cuda_pool.measure_driver("kernel modules"):
                raw = get_module(family).get_function(kernel)
            fn = self._fns[kernel] = Kernel(raw, kernel, self._pdl, self._cuda_pool)
        return fn

    def compile_all(self) -> None:
        """Compile every kernel family now (otherwise each compiles on first use)."""
        with self._cuda_pool.measure_driver("kernel modules"):
            for fam in FAMILIES:
                get_module(fam)

    def to_host(self, arr) -> np.ndarray:
        return cupy.asnumpy(arr) if isinstance(arr, cupy.ndarray) else np.asarray(arr)

    def from_host(self, host: np.ndarray, out) -> None:
        host = np.ascontiguousarray(host, dtype=out.dtype)
        if tuple(host.shape) != tuple(out.shape):
            raise ConfigError(f"from_host: host shape {host.shape} != device shape {out.shape}")
        if isinstance(out, cupy.ndarray):
            out.set(host)
        else:
            out[...] = host

    def synchronize(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    def zero(self, arr) -> None:
        """Zero a contiguous device array with one cudaMemsetAsync on the current stream (no
        kernel launch: KV pages are zeroed one by one as a request gains them)."""
        if not (type(arr) is cupy.ndarray and arr.flags.c_contiguous):
            _dev(arr, "arr", arr.dtype)
        cupy.cuda.runtime.memsetAsync(arr.data.ptr, 0, arr.nbytes,
                                      cupy.cuda.get_current_stream().ptr)

    def zero_ranges(self, ranges) -> None:
        """One cudaMemsetAsync per ``(address, nbytes)`` device range on the current stream
        (``Ops.zero_ranges``: a batch of KV pages is zeroed in one call per contiguous run)."""
        stream = cupy.cuda.get_current_stream().ptr
        memset = cupy.cuda.runtime.memsetAsync
        for ptr, n in ranges:
            memset(ptr, 0, n, stream)

    def upload_array(self, host: np.ndarray, pool):
        """Base upload, plus the 16-byte alignment the vector loads need (block freed if not)."""
        arr, blk = super().upload_array(host, pool)
        try:
            _aligned(arr, "uploaded block")
        except ConfigError:
            pool.free(blk)
            raise
        return arr, blk

    @staticmethod
    def _out(out, name, dtype, t, cols):
        """Validate an output [>= T, cols] buffer; return its first T rows."""
        if not _fast_ok(out, dtype, 2):
            _dev(out, name, dtype, 2)
        if out.shape[0] != t:
            out = _rows(out, name, t)
        if out.shape[1] != cols:
            _shape(out, name, (t, cols))
        return out
