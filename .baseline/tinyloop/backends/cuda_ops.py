"""The CUDA backend: the op set of ``base.py`` as RawModule kernels from ``cuda_src/``.

Each kernel family is one ``cuda_src/<family>.cu`` file, compiled through ``cupy.RawModule``
(NVRTC) once per process and device, for the device's own architecture (CuPy derives
``-arch`` from ``cupy.cuda.Device().compute_capability``), and cached. Every op has one host
wrapper that validates dtype, shape and contiguity (errors name the bad value) and then
launches with raw pointers and plain Python ints/floats, so the decode path does no
allocation and no host synchronisation except ``sample``'s one chosen id.

Dtypes: activations float16, residual stream and logits float32; the KV cache is paged
(``kvcache.py``): FP16 K/V, or INT8 codes + FP16 scales, read through a device block table; or
(store-h modes) the normed QKV input h as FP16 / INT8 / INT4 codes (``kv_h.cu``), from which
attention rebuilds K and V chunk by chunk into the phase-5 scratch (``_h_attention``).
Dispatch: T == 1 -> memory-bound GEMV (``gemv.cu``); T > 1 -> tensor-core GEMM
(``gemm.cu``), or cuBLAS (``cupy.matmul``) on the dense FP16 copy ``w.fp16`` when the
weight carries one (``TINYLOOP_FP16_CACHE=1``; see ``make_fp16_cache``).
The RMSNorm -> projection pairs (``rmsnorm_linear``, ``rmsnorm_linear_swiglu``,
``rmsnorm_lm_head``) are one launch at T == 1 (``gemv_norm_*``: the GEMV normalizes the FP32
residual row into shared memory first, bit-identically to ``rmsnorm``) and leave their
``norm`` scratch unwritten; T > 1 composes ``rmsnorm`` with the projection through ``norm``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import sys
import threading
import warnings
import weakref
from importlib import resources
from pathlib import Path

import numpy as np

from ..config import fused_qkv_rope_enabled, pdl_enabled
from ..errors import ConfigError
from ..kvcache import H_MODES
from ..memory import get_pool
from ..quant import QuantWeight
from .base import LOGIT_FAULTS, STEP_POS, STEP_ROPE_MAX, STEP_WORDS, Ops, non_finite_logits

try:
    import cupy
except ImportError:  # the module still imports (for docs / source checks) without CuPy
    cupy = None

FAMILIES = ("dequant", "rmsnorm", "gemv", "gemm", "rope", "attention", "attention_decode",
            "attention_prefill", "elementwise", "sample", "kv_h", "decode_mega", "qkv_rope")
_INCLUDE = '#include "common.cuh"'

# Kernel geometry: the one definition of every launch constant the host and a kernel share.
# ``get_module`` hands a family's entries to NVRTC as ``-DNAME=value``; each .cu file repeats
# the value only as an ``#ifndef NAME`` default so nvcc compiles it standalone
# (.ci/compile_cuda.sh), and tests/test_kernel_geometry.py fails if a default drifts from here.
ATTN_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128)   # attention.cu instantiates one kernel pair each
# attention_prefill.cu (tensor cores) needs head_dim % 16 == 0; other head dims (none built
# today) run the scalar prefill kernel
FA_HEAD_DIMS = tuple(hd for hd in ATTN_HEAD_DIMS if hd % 16 == 0)
MEGA_HEAD_DIMS = (32, 64, 128)    # decode_mega.cu instantiates one megakernel per head dim
GEOMETRY = {
    "gemv": {"GEMV_WARPS": 8},                   # warps (= output rows) per 32*W-thread block
    "gemm": {"BM": 64, "BN": 64,                 # block tile: BM rows of X x BN rows of W
             "GEMM_THREADS": 128},               # 4 warps in 2 x 2
    "attention": {"PF_Q": 64,                    # prefill: query rows per block (4 threads each)
                  "DC_THREADS": 1024,            # decode: threads per block (one query head)
                  "ATTN_HEAD_DIM_ENTRIES": "".join(f"ATTN_ENTRIES({hd})"
                                                   for hd in ATTN_HEAD_DIMS)},
    "attention_prefill": {"FA_WARPS": 4,         # mma prefill: warps (16 query rows each)
                          "FA_HEAD_DIM_ENTRIES": "".join(f"FA_ENTRIES({hd})"
                                                         for hd in FA_HEAD_DIMS)},
    "attention_decode": {"DS_THREADS": 128,      # split-K decode: threads per (head, split)
                         "DS_HEAD_DIM_ENTRIES": "".join(f"DS_ENTRIES({hd})"
                                                        for hd in ATTN_HEAD_DIMS)},
    "sample": {"SMP_THREADS": 1024},             # the temperature sampler's one block
    "decode_mega": {"MK_THREADS": 128,           # megakernel block (= DS_THREADS: an attention
                                                 # unit is one block)
                    "MK_HEAD_DIM_ENTRIES": "".join(f"MK_ENTRIES({hd})" for hd in MEGA_HEAD_DIMS)},
}
# A family whose source #includes other families' .cu files (their device code; entries
# compiled out with TL_DEVICE_ONLY) compiles with their geometry too.
FAMILY_INCLUDES = {"decode_mega": ("dequant", "gemv", "rope", "attention_decode"),
                   "qkv_rope": ("gemv", "rope")}


def nvrtc_options(family: str) -> tuple:
    """The NVRTC options ``family`` compiles with: C++17 and its ``GEOMETRY`` as -D macros
    (part of CuPy's cache key, so a change recompiles)."""
    geo = {}
    for fam in FAMILY_INCLUDES.get(family, ()) + (family,):
        geo.update(GEOMETRY.get(fam, {}))
    return ("--std=c++17",) + tuple(f"-D{k}={v}" for k, v in geo.items())


KV_KERNEL_MODES = ("fp16", "int8")           # attention.cu / rope.cu instantiate each
# the store-h modes: kv_h.cu writes / reads h; attention rebuilds K|V chunk by chunk through
# the layer's own QKV weight (CudaOps._h_attention)
H_KERNEL_MODES = H_MODES
H_KERNEL_GROUP, H_KERNEL_ROTATE = 32, (0, 32)   # one warp per group; Hadamard blocks of 32
H_KERNEL_OUTLIERS = 4                           # kv_h.cu H_MAX_OUTLIERS: h_int4 channels kept
# h_attn_chunk: one block per (query row, head), its warps splitting the chunk's keys: 32 warps
# for a decode row (few blocks: the keys are the parallelism), 8 for prefill rows (many
# blocks); at least 8 (the merge gives each of head_dim <= 256 dimensions a thread)
_H_ATTN_THREADS_DECODE, _H_ATTN_THREADS_PREFILL = 1024, 256
_DECODE_NAMES = {(m, hd): f"attn_decode_{m}_hd{hd}" for m in KV_KERNEL_MODES
                 for hd in ATTN_HEAD_DIMS}
_PREFILL_NAMES = {(m, hd): f"attn_prefill_{m}_hd{hd}" for m in KV_KERNEL_MODES
                  for hd in ATTN_HEAD_DIMS}
_GEMV_ROWS = GEOMETRY["gemv"]["GEMV_WARPS"]
_GEMM_BM, _GEMM_BN = GEOMETRY["gemm"]["BM"], GEOMETRY["gemm"]["BN"]
_GEMM_THREADS = GEOMETRY["gemm"]["GEMM_THREADS"]
_PF_Q = GEOMETRY["attention"]["PF_Q"]
_FA_THREADS = 32 * GEOMETRY["attention_prefill"]["FA_WARPS"]
_FA_Q = 16 * GEOMETRY["attention_prefill"]["FA_WARPS"]    # query rows per block
_FA_NAMES = {(m, hd): f"attn_fa_{m}_hd{hd}" for m in KV_KERNEL_MODES for hd in FA_HEAD_DIMS}
ATTN_PREFILL_VERSIONS = ("mma", "scalar")   # TINYLOOP_ATTN_PREFILL: tensor cores | scalar FP32
_DC_THREADS = GEOMETRY["attention"]["DC_THREADS"]
_DS_THREADS = GEOMETRY["attention_decode"]["DS_THREADS"]
_SPLIT_NAMES = {(m, hd): f"attn_split_{m}_hd{hd}" for m in KV_KERNEL_MODES
                for hd in ATTN_HEAD_DIMS}
ATTN_DECODE_VERSIONS = ("split", "v1")   # TINYLOOP_ATTN_DECODE: split-K (default) | v1
DS_MIN_KEYS = 128       # split-K decode: a split gets at least this many keys of the bucket
DS_MAX_SPLITS = 64      # ... and at most this many splits (the partials scratch)
_DS_TICKETS = 1024      # split-K decode: per-head merge tickets (query heads at most)
# Contexts of at most this many keys run the single-pass decode kernel (attention.cu), not
# split-K. bench_attn_decode.py on the H200 (SmolLM2 dims, fp16/int8 pages of 32): split-K was
# 0.8x the single-pass kernel at ctx 128 (one split there: the same work plus a combine
# launch), 2.1x at 2048, 3.1x at 4096; interpolating in log2(ctx) puts break-even near 200
# keys, between the 128 and 256 buckets, so every context of the 128 bucket (and any rule
# outcome of one split) goes single-pass. The bench's 192 / 256 rows check it.
DS_SINGLE_PASS_MAX = 128
_NORM_MAX_K = 16384     # gemv_norm_*: the FP16 normalized row (2 K bytes) in dynamic shared
                        # memory, <= 32 KiB (under the 48 KiB a launch gets without opt-in)
_NORM_MAX_N = 1 << 30   # gemv_norm_*: int row index in the kernel
_BLOCKS_PER_SM = 8      # 2048 resident threads per SM / 256-thread GEMV blocks
_GEMV2_LPR = (4, 8, 16, 32)       # lanes per row the v2 kernels are built for
_GEMV2_THREADS = (64, 128, 256)   # v2 block sizes (norm_row_v256 needs a divisor of 256)
_THREADS_PER_SM = 2048
_MAX_BLOCKS_PER_SM = 32
GEMV_VERSIONS = ("auto", "v1", "v2")
# The decode GEMV per weight shape (TINYLOOP_GEMV=auto, the default): the first row whose
# min_rows <= N gives (version, v2 lanes per row or None = gemv2_geometry's rule). From the
# H200 per-kernel table at SmolLM2 dims (bench_kernels.py, issue 10): v1 beats v2 on every
# layer shape (qkv 2.22 vs 2.38 us, norm+qkv 3.80 vs 6.05), v2 at 4 lanes per row wins the LM
# head (14.5 vs 20.4 us; norm+head+argmax 22.3 vs 30.7).
GEMV_BY_SHAPE = ((16384, "v2", 4),     # LM-head sized: 49,152 x 576
                 (0, "v1", None))      # every layer shape


def gemv_choice(n: int, setting: dict) -> tuple:
    """(version, forced lanes per row or None) of the decode GEMV over ``n`` output rows under
    ``setting`` (``gemv_settings``): a forced version wins; ``auto`` reads GEMV_BY_SHAPE. A
    forced ``lpr`` overrides the table's."""
    ver, lpr = setting["version"], setting["lpr"]
    if ver == "auto":
        for min_rows, v, l in GEMV_BY_SHAPE:
            if n >= min_rows:
                ver, lpr = v, (lpr if lpr is not None else l)
                break
    return ver, lpr
_SAMPLE_THREADS = GEOMETRY["sample"]["SMP_THREADS"]
_MEGA_THREADS = GEOMETRY["decode_mega"]["MK_THREADS"]
_MEGA_MAX_SMEM = 48 * 1024    # megakernel dynamic shared memory without the opt-in attribute
_SAMPLE_MAX_N = 1 << 22  # sample_topk_topp: u64 sums of 2^40-scaled weights stay < 2^63


def gemv_settings(version: str | None = None, lpr: int | None = None,
                  threads: int | None = None) -> dict:
    """The decode GEMV choice: the arguments, else the environment; validated.

    ``version`` / ``TINYLOOP_GEMV`` = auto (default: per weight shape, ``GEMV_BY_SHAPE``) |
    v2 | v1 (the original one-warp-per-row kernels) forced for every shape; ``lpr`` / ``TINYLOOP_GEMV_LPR`` = 4 | 8 | 16 | 32 forces v2's lanes per row
    (default: per shape, see ``gemv2_geometry``); ``threads`` / ``TINYLOOP_GEMV_THREADS`` =
    64 | 128 | 256 forces its block size. Raises ConfigError naming the bad setting.
    """
    ver = version or os.environ.get("TINYLOOP_GEMV", "") or "auto"
    if ver not in GEMV_VERSIONS:
        raise ConfigError(f"GEMV version (TINYLOOP_GEMV) {ver!r}: expected one of "
                          f"{GEMV_VERSIONS}")
    out = {"version": ver, "lpr": None, "threads": None}
    for var, key, given, allowed in (("TINYLOOP_GEMV_LPR", "lpr", lpr, _GEMV2_LPR),
                                     ("TINYLOOP_GEMV_THREADS", "threads", threads,
                                      _GEMV2_THREADS)):
        raw = given if given is not None else os.environ.get(var, "")
        if raw != "":
            try:
                val = int(raw)
            except (TypeError, ValueError):
                val = None
            if val not in allowed:
                raise ConfigError(f"GEMV {key} ({var}) {raw!r}: expected one of {allowed}")
            out[key] = val
    return out


def attn_decode_setting(version: str | None = None) -> str:
    """The T = 1 attention kernel: ``version`` else ``TINYLOOP_ATTN_DECODE``: ``split``
    (default; split-K, attention_decode.cu, falling back to the single-pass kernel where
    ``decode_splits`` returns 0: contexts of at most DS_SINGLE_PASS_MAX keys) or ``v1`` (one
    block per query head, attention.cu, at every length). Raises ConfigError naming a bad
    value."""
    ver = version or os.environ.get("TINYLOOP_ATTN_DECODE", "") or "split"
    if ver not in ATTN_DECODE_VERSIONS:
        raise ConfigError(f"decode attention (TINYLOOP_ATTN_DECODE) {ver!r}: expected one of "
                          f"{ATTN_DECODE_VERSIONS}")
    return ver


def attn_prefill_setting(version: str | None = None) -> str:
    """The T > 1 attention kernel: ``version`` else ``TINYLOOP_ATTN_PREFILL``: ``mma``
    (default; FlashAttention-2 on tensor cores, attention_prefill.cu, for head dims in
    FA_HEAD_DIMS) or ``scalar`` (the FP32 kernel of attention.cu, the slow reference; also
    what ``mma`` falls back to for other head dims). Raises ConfigError naming a bad value."""
    ver = version or os.environ.get("TINYLOOP_ATTN_PREFILL", "") or "mma"
    if ver not in ATTN_PREFILL_VERSIONS:
        raise ConfigError(f"prefill attention (TINYLOOP_ATTN_PREFILL) {ver!r}: expected one of "
                          f"{ATTN_PREFILL_VERSIONS}")
    return ver


def decode_splits(ctx: int, n_heads: int, sms: int) -> int:
    """Split count of the split-K decode attention for a context of ``ctx`` keys, or 0 for
    the single-pass kernel (``ctx <= DS_SINGLE_PASS_MAX``, or a rule outcome of one split:
    one split does the single-pass work plus a combine launch; see DS_SINGLE_PASS_MAX for the
    measurements). Otherwise from the power-of-two length bucket ``b = max(DS_MIN_KEYS,
    2^ceil(log2 ctx))``: ``b / DS_MIN_KEYS`` splits, capped so n_heads * splits is about two
    blocks per SM and at DS_MAX_SPLITS. A function of the bucket only, so a captured graph
    keyed by the bucket (or by the block table's capacity, whose ctx it passes) launches a
    valid grid for every length in it; each split's page range is computed on the device from
    the real length. The one place the split / single-pass choice is made."""
    if int(ctx) <= DS_SINGLE_PASS_MAX:
        return 0
    bucket = max(DS_MIN_KEYS, 1 << max(0, int(ctx) - 1).bit_length())
    by_sms = -(-2 * int(sms) // max(1, int(n_heads)))
    ns = max(1, min(DS_MAX_SPLITS, bucket // DS_MIN_KEYS, by_sms))
    return 0 if ns == 1 else ns


def gemv2_geometry(n: int, k: int, bits: int, sms: int, lpr: int | None = None,
                   threads: int | None = None, cap_wave: bool = False) -> tuple:
    """(lanes per row, threads per block, blocks) of a v2 GEMV over ``n`` rows of ``k`` inputs.

    Lanes per row: enough that each lane takes at most two 16-byte chunks of the row (the
    loads of a row are then all in flight at once), between 4 and 32. Threads: the largest of
    256 / 128 / 64 that still gives every SM a block (small matrices spread over all ``sms``).
    ``cap_wave``: at most one resident wave of blocks (the RMSNorm-fused kernels, which
    normalize the row once per block and stride over the rest).
    """
    cpr = (k // 2 if bits == 4 else k) // 16
    if lpr is None:
        want = max(1, -(-cpr // 2))
        lpr = min(32, max(4, 1 << (want - 1).bit_length()))
    if threads is None:
        threads = _GEMV2_THREADS[0]
        for nt in reversed(_GEMV2_THREADS):
            if -(-n * lpr // nt) >= sms:
                threads = nt
                break
    blocks = max(1, -(-n * lpr // threads))
    if cap_wave:
        per_sm = min(_MAX_BLOCKS_PER_SM, _THREADS_PER_SM // threads)
        blocks = min(blocks, sms * per_sm)
    return lpr, threads, blocks


def occupancy_estimate(num_regs: int, static_smem: int, dyn_smem: int, threads: int,
                       dev: dict) -> int:
    """Blocks of ``threads`` threads that fit on one SM at once, from the kernel's registers
    per thread and shared memory (static + dynamic, + 1 KiB the runtime reserves per block on
    sm_80+) and the device limits in ``dev`` (CuPy's ``Device().attributes`` names); registers
    are allocated per warp in units of 256. A lower bound of CUDA's occupancy calculator for
    these inputs (it does not model register-file partitioning, which only lowers it
    further when the per-warp rounding is already coarse)."""
    warps = -(-int(threads) // 32)
    per_warp = -(-int(num_regs) * 32 // 256) * 256
    by_regs = int(dev.get("MaxRegistersPerMultiprocessor", 65536)) // max(1, warps * per_warp)
    smem = int(static_smem) + int(dyn_smem) + 1024
    by_smem = int(dev.get("MaxSharedMemoryPerMultiprocessor", 228 * 1024)) // smem
    by_threads = int(dev.get("MaxThreadsPerMultiProcessor", _THREADS_PER_SM)) // int(threads)
    by_blocks = int(dev.get("MaxBlocksPerMultiprocessor", _MAX_BLOCKS_PER_SM))
    return max(0, min(by_regs, by_smem, by_threads, by_blocks))


# --- sources and modules -----------------------------------------------------------------------
def source_dir() -> Path:
    """The folder holding the ``.cu`` files.

    An installed wheel carries them as package data of ``tinyloop.cuda_src`` (pyproject maps
    that package onto the repository's ``cuda_src/``); a source checkout has them at the
    repository root.
    """
    # the checkout this module was imported from first: an editable install elsewhere maps
    # tinyloop.cuda_src onto *its* checkout, whose kernels may not match this code
    repo = Path(__file__).resolve().parents[2] / "cuda_src"
    if (repo / "common.cuh").is_file():
        return repo
    try:
        packaged = resources.files("tinyloop.cuda_src")
        if (packaged / "common.cuh").is_file():
            return Path(str(packaged))
    except ModuleNotFoundError:           # a source checkout: no tinyloop/cuda_src package
        pass
    raise FileNotFoundError(f"CUDA kernel sources not found: neither package tinyloop.cuda_src "
                            f"nor {repo} holds common.cuh (was the wheel built without its "
                            "package data?)")


def load_source(family: str) -> str:
    """The source of ``cuda_src/<family>.cu`` with every ``#include "name"`` of a file in
    ``cuda_src/`` pasted in, recursively, each file once (``#pragma once`` semantics; system
    headers such as ``<cooperative_groups.h>`` stay includes).

    Pasting (rather than ``-I``) keeps CuPy's on-disk cache key covering every header.
    """
    d = source_dir()
    src = (d / f"{family}.cu").read_text(encoding="utf-8")
    if _INCLUDE not in src:
        raise ConfigError(f"cuda_src/{family}.cu does not include common.cuh")
    seen = {f"{family}.cu"}

    def paste(m) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        path = d / name
        if not path.is_file():
            raise ConfigError(f"cuda_src/{family}.cu includes {name!r}, which cuda_src/ "
                              "does not hold")
        return _INCLUDE_RE.sub(paste, path.read_text(encoding="utf-8").replace("#pragma once",
                                                                               ""))

    return _INCLUDE_RE.sub(paste, src)


_INCLUDE_RE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)
_modules: dict = {}           # (device id, family) -> cupy.RawModule
_modules_lock = threading.Lock()


def get_module(family: str):
    """Compile ``family`` for the current device once per process (thread-safe) and return it."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    key = (cupy.cuda.Device().id, family)
    mod = _modules.get(key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cupy.RawModule(code=load_source(family), options=nvrtc_options(family))
                mod.compile()
                _modules[key] = mod
    return mod


# --- programmatic dependent launch (PDL) ------------------------------------------------------
# The kernels a captured decode step may launch with PDL: each calls cuda_src/common.cuh's
# pdl_wait() before it reads anything an earlier kernel writes (TL_PDL_ENTER at its top, or in
# gemv2_body after the weight preload). Name prefixes; tests/test_pdl.py checks each entry's
# source. A kernel outside this list is launched plainly even while PDL is on.
PDL_KERNELS = ("gemv_", "gemv2_", "kv_write_", "attn_split_", "attn_decode_",
               "embed_q", "argmax_f32", "sample_step", "sample_topk_topp", "swiglu_f16",
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


class _PdlLauncher:
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


class _PdlSwitch:
    """Whether launches go through ``_PdlLauncher`` now (on only while a decode step is being
    captured with PDL); shared by one backend's kernels. ``launcher``: None until
    ``CudaOps.pdl_capture`` probes, then the launcher or False (refused)."""

    __slots__ = ("on", "launcher")

    def __init__(self):
        self.on = False
        self.launcher = None


class _Kernel:
    """A RawKernel of a family, called as CuPy's (grid, block, args, shared_mem=); launched
    with PDL while its backend's switch is on and its name is in PDL_KERNELS."""

    __slots__ = ("raw", "name", "pdl", "switch", "pool")

    def __init__(self, raw, name: str, switch: _PdlSwitch, pool=None):
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


# --- validation helpers (one check at the boundary; each message names the bad value) ------
def _dev(arr, name: str, dtype, ndim: int | None = None):
    if not isinstance(arr, cupy.ndarray):
        raise ConfigError(f"{name} must be a cupy.ndarray on the GPU, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ConfigError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ConfigError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ConfigError(f"{name} must be C-contiguous (shape {arr.shape}, "
                          f"strides {arr.strides})")
    return arr


def _shape(arr, name: str, want: tuple) -> None:
    if tuple(arr.shape) != tuple(want):
        raise ConfigError(f"{name} has shape {tuple(arr.shape)}, expected {tuple(want)}")


def _aligned(arr, name: str) -> None:
    if arr.data.ptr % 16:
        raise ConfigError(f"{name} must start on a 16-byte boundary for vector loads "
                          f"(address {arr.data.ptr:#x})")


def _rows(arr, name: str, t: int):
    """``arr[:t]`` for a buffer with at least ``t`` rows (buffers may be sized for max T)."""
    if arr.shape[0] < t:
        raise ConfigError(f"{name} has {arr.shape[0]} rows, need at least {t}")
    return arr if arr.shape[0] == t else arr[:t]


def _weight(w, name: str, in_features: int | None = None) -> QuantWeight:
    if not isinstance(w, QuantWeight):
        raise ConfigError(f"{name} must be a QuantWeight, got {type(w).__name__}")
    if not isinstance(w.qweight, cupy.ndarray):
        raise ConfigError(f"{name}.qweight is on the host ({type(w.qweight).__name__}); "
                          "upload it with CudaOps.upload_weight first")
    if in_features is not None and w.in_features != in_features:
        raise ConfigError(f"{name} has in_features={w.in_features}, but the input has "
                          f"{in_features} columns")
    return w


def _log2g(w: QuantWeight) -> int:
    return int(w.group_size).bit_length() - 1


def _fp16_of(w: QuantWeight):
    return getattr(w, "fp16", None)


_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


def _fast_ok(a, dtype, ndim: int, cols=None, rows=None, aligned: bool = False) -> bool:
    """The hot-path check, one cheap expression: a cupy.ndarray of ``dtype`` with ``ndim``
    dims, C-contiguous; with ``cols`` / ``rows``, that many in the last / first dim; with
    ``aligned``, starting on a 16-byte boundary. On False the caller re-runs the detailed
    checks (``_dev``, ``_shape``, ``_aligned``), which raise with a precise message."""
    return (type(a) is cupy.ndarray and a.dtype == dtype and a.ndim == ndim
            and a.flags.c_contiguous and (cols is None or a.shape[-1] == cols)
            and (rows is None or a.shape[0] == rows) and (not aligned or not a.data.ptr & 15))


class _WInfo:
    """Launch parameters of one device QuantWeight, validated once (cached weakly per weight)."""

    __slots__ = ("n", "k", "lg", "args", "gemv", "gemv_norm", "gemm", "v2", "lpr", "g2",
                 "g2_norm", "g2_argmax", "geo", "__weakref__")

    def __init__(self, ops, w):
        _weight(w, "w")
        for name in ("qweight", "scales", "zeros"):
            _dev(getattr(w, name), f"w.{name}", getattr(w, name).dtype, 2)
            _aligned(getattr(w, name), f"w.{name}")
        self.n, self.k = w.shape
        self.lg = _log2g(w)
        self.args = (w.qweight.data.ptr, w.scales.data.ptr, w.zeros.data.ptr)
        b = w.bits
        self.gemv = {e: ops._fn("gemv", f"gemv_q{b}_{e}") for e in ("f16", "resid", "swiglu",
                                                                      "f32")}
        # RMSNorm-fused GEMVs (T = 1); None when K or N is past what the kernel takes, and
        # the pairs then compose rmsnorm + GEMV instead
        self.gemv_norm = ({e: ops._fn("gemv", f"gemv_norm_q{b}_{e}") for e in ("f16", "swiglu",
                                                                                "f32")}
                          if self.k <= _NORM_MAX_K and self.n <= _NORM_MAX_N else None)
        self.gemm = {e: ops._fn("gemm", f"gemm_q{b}_{e}") for e in ("f16", "resid", "f32")}
        # GEMV v2 (the default decode kernels): needs x in shared memory (K <= _NORM_MAX_K)
        # and int row arithmetic (N * 32 < 2^31)
        st = ops.gemv
        ver, lpr = gemv_choice(self.n, st)
        self.v2 = (ver == "v2" and self.k <= _NORM_MAX_K
                   and self.n * 32 < _NORM_MAX_N)
        self.lpr = self.g2 = self.g2_norm = self.g2_argmax = None
        self.geo: dict = {}                       # (rows, cap_wave) -> (threads, blocks)
        if self.v2:
            self.lpr = gemv2_geometry(self.n, self.k, b, ops.sms, lpr, st["threads"])[0]
            sfx = f"_l{self.lpr}"
            self.g2 = {e: ops._fn("gemv", f"gemv2_q{b}_{e}{sfx}") for e in ("f16", "resid",
                                                                            "swiglu", "f32")}
            self.g2_norm = {e: ops._fn("gemv", f"gemv2_norm_q{b}_{e}{sfx}")
                            for e in ("f16", "swiglu", "f32")}
            self.g2_argmax = ops._fn("gemv", f"gemv2_norm_q{b}_argmax{sfx}")

    def geometry(self, ops, rows: int, cap_wave: bool = False) -> tuple:
        """(threads, blocks) of a v2 launch over ``rows`` output rows."""
        _, nt, nb = gemv2_geometry(rows, self.k, 8, ops.sms, self.lpr, ops.gemv["threads"],
                                   cap_wave)
        return nt, nb


class CudaOps(Ops):
    """Ops on CuPy device arrays inside TinyLoop's CUDA pool (see the module docstring)."""

    name = "cuda"
    device = "cuda"
    act_dtype = np.float16
    kv_dtype = np.float16
    kv_modes = KV_KERNEL_MODES + H_KERNEL_MODES
    fp16_cache_default = False    # the GEMV / GEMM kernels read the packed weights directly
    xp = cupy

    def __init__(self, gemv: str | None = None, gemv_lpr: int | None = None,
                 gemv_threads: int | None = None, attn_decode: str | None = None,
                 attn_prefill: str | None = None):
        """``gemv`` / ``gemv_lpr`` / ``gemv_threads``: the decode GEMV choice (see
        ``gemv_settings``; None reads the environment); ``attn_decode``: the T = 1 attention
        kernel (``attn_decode_setting``); ``attn_prefill``: the T > 1 one
        (``attn_prefill_setting``)."""
        if cupy is None:
            raise ConfigError("CudaOps needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)")
        self._fns: dict = {}
        self._pdl = _PdlSwitch()      # on while a decode step is captured with PDL
        self._winfo = weakref.WeakKeyDictionary()    # device QuantWeight -> _WInfo
        self._heads_seen: set = set()                # (H, Hkv, hd, qkv cols) already checked
        # grid cap of the RMSNorm-fused GEMVs: about one resident wave, so each launch
        # normalizes the row at most this many times (blocks stride over the rows)
        try:
            sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        except Exception:                                # an older CuPy: no .attributes
            sms = int(cupy.cuda.runtime.getDeviceProperties(
                cupy.cuda.Device().id)["multiProcessorCount"])
        self._norm_blocks = max(1, sms * _BLOCKS_PER_SM)
        self.sms = sms
        self._cc = int(cupy.cuda.Device().compute_capability)     # e.g. 90 for sm_90
        self.gemv = gemv_settings(gemv, gemv_lpr, gemv_threads)   # v1 | v2, forced geometry
        self.attn_decode = attn_decode_setting(attn_decode)        # split | v1
        self.attn_prefill = attn_prefill_setting(attn_prefill)     # mma | scalar
        # Every buffer of the backend's own is a pool block under tag "scratch": device
        # scratch in the cuda pool, the mapped host words in the pinned pool (blocks of these
        # process pools, returned by release() or, for an Ops no Model owns, when it dies).
        self._cuda_pool = get_pool("cuda")
        self._pinned_pool = get_pool("pinned")
        # split-K decode attention's partials f32 [n_heads, splits, hd + 2], a pool block
        # taken on the first decode that needs more (an eager step always precedes a capture,
        # so a captured launch never grows it; a capture that did would fail its pool check)
        self._ds_blk, self._ds_ptr, self._ds_cap = None, 0, 0
        self._grid_cap = None          # tests: cap every v2 grid (exercises the row stride)
        # The sampled id and the row's fault code (base.LOGIT_FAULTS) land in 8 bytes of
        # pinned, mapped host memory that the argmax kernels write directly (UVA: the host
        # pointer is valid on the device), so greedy decode allocates nothing and copies
        # nothing back besides these two ints. Then a sampled captured step's parameters
        # f64 [4] = (temperature, top_k, top_p, u): the host writes them before each replay
        # and sample.cu's sample_step reads them when it runs (set_step_sampling /
        # head_sample_step). One pinned block holds both.
        self._pinned_blk = self._pinned_pool.allocate(8 + 32, "scratch")
        self._id_ptr = self._pinned_blk.ptr
        self._id_view = (ctypes.c_int32 * 2).from_address(self._id_ptr)
        self._smp_ptr = self._id_ptr + 8
        self._smp_view = (ctypes.c_double * 4).from_address(self._smp_ptr)
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
        # sample_topk_topp's u64 [vocab] scratch (a pool block, taken at the first use)
        self._wq_blk, self._wq_ptr, self._wq_cap = None, 0, 0
        self._cublas_measured = False       # the first cuBLAS call is measured (NVML)
        self.device_sampling = True         # False: temperature > 0 through _sample_cupy
        self._capture_stream = None         # the decode-step capture stream (graph_begin)
        self._capturing = None              # that stream while a capture is open
        self._mega_fit: dict = {}           # (head_dim, smem) -> megakernel blocks per SM;
                                            # ("why", head_dim, smem) -> mega_why_not

    _BLOCKS = ("_pinned_blk", "_scratch_blk", "_ds_blk", "_wq_blk")

    def release(self) -> None:
        """Return the backend's scratch blocks to their pools (``Model.free`` calls it after
        the stream is idle; this Ops is not used afterwards). Idempotent."""
        self._id_view = self._smp_view = None
        self._id_ptr = self._smp_ptr = self._scratch_ptr = self._ds_ptr = self._wq_ptr = 0
        self._ds_cap = self._wq_cap = 0
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

    def __del__(self):
        # An Ops no Model released (a test's or a benchmark's) gives its blocks back when it
        # dies; the collector may run this while a pool's lock is held, so the pool defers
        # the free. At exit the pools go with the process.
        if sys.is_finalizing():
            return
        for name in self._BLOCKS:
            blk = getattr(self, name, None)
            if blk is not None and not blk.freed:
                blk.pool._free_from_finalizer(blk)

    def _fn(self, family: str, kernel: str):
        fn = self._fns.get(kernel)
        if fn is None:
            # module loads take device memory outside the pool: measured, to be named
            with self._cuda_pool.measure_driver("kernel modules"):
                raw = get_module(family).get_function(kernel)
            fn = self._fns[kernel] = _Kernel(raw, kernel, self._pdl, self._cuda_pool)
        return fn

    def _cublas_matmul(self, a, b, out=None):
        """``cupy.matmul`` (cuBLAS); the first call is measured for the cuBLAS handle and
        workspace it makes (device memory outside the pool)."""
        if self._cublas_measured:
            return cupy.matmul(a, b, out=out)
        with self._cuda_pool.measure_driver("cublas workspace"):
            y = cupy.matmul(a, b, out=out)
        self._cublas_measured = True
        return y

    def compile_all(self) -> None:
        """Compile every kernel family now (otherwise each compiles on first use)."""
        with self._cuda_pool.measure_driver("kernel modules"):
            for fam in FAMILIES:
                get_module(fam)

    # --- memory ------------------------------------------------------------------------------
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
                (n,), (256,), (w.qweight.data.ptr, w.scales.data.ptr, w.zeros.data.ptr, k,
                               _log2g(w), out.data.ptr))
        except BaseException:
            pool.free(blk)
            raise
        return out, blk

    # --- ops ---------------------------------------------------------------------------------
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
                (t,), (256,), (w.qweight.data.ptr, w.scales.data.ptr, w.zeros.data.ptr,
                               ids_ptr, id0, d, vocab, _log2g(w), out.data.ptr))
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
            (t,), (256,), (x.data.ptr, weight.data.ptr, float(eps), d, out.data.ptr))

    def _info(self, w) -> _WInfo:
        info = self._winfo.get(w) if isinstance(w, QuantWeight) else None
        if info is None:
            info = _WInfo(self, w)
            self._winfo[w] = info
        return info

    def _act_in(self, x, info, name="x") -> int:
        """Validate activation input x f16 [T, in] against the weight; return T."""
        if not _fast_ok(x, _F16, 2, info.k, None, True):
            _dev(x, name, np.float16, 2)
            _aligned(x, name)
            raise ConfigError(f"w has in_features={info.k}, but the input has {x.shape[1]} "
                              "columns")
        return x.shape[0]

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

    def _matmul(self, x, w, info, out, epi: str, ldo: int):
        """Launch out (epi: f16 | resid | f32) = x @ W.T; shapes already validated."""
        t = x.shape[0]
        n, k = info.n, info.k
        lg = w.group_size.bit_length() - 1
        if t == 1:
            if info.v2:
                self._gemv2(info, info.g2[epi], n, 0, x, out)
                return
            info.gemv[epi](((n + _GEMV_ROWS - 1) // _GEMV_ROWS,), (32 * _GEMV_ROWS,),
                           (*info.args, x.data.ptr, n, k, 0, lg, out.data.ptr))
            return
        w16 = _fp16_of(w)
        if w16 is not None:
            self._cublas(x, w16, out, epi)
            return
        info.gemm[epi](((n + _GEMM_BN - 1) // _GEMM_BN, (t + _GEMM_BM - 1) // _GEMM_BM),
                       (_GEMM_THREADS,), (*info.args, x.data.ptr, t, n, k, lg, out.data.ptr, ldo))

    def _geo(self, info, rows: int, cap_wave: bool) -> tuple:
        """(threads, blocks) of a v2 launch, cached per weight; ``_grid_cap`` applied."""
        geo = info.geo.get((rows, cap_wave))
        if geo is None:
            geo = info.geo[(rows, cap_wave)] = info.geometry(self, rows, cap_wave)
        nt, nb = geo
        if self._grid_cap is not None and nb > self._grid_cap:
            nb = self._grid_cap
        return nt, nb

    def _gemv2(self, info, fn, rows: int, f: int, x, out) -> None:
        """Launch a v2 GEMV (x f16 [1, K] staged into shared memory) over ``rows`` rows."""
        nt, nb = self._geo(info, rows, False)
        fn((nb,), (nt,), (*info.args, x.data.ptr, rows, info.k, f, info.lg, out.data.ptr),
           shared_mem=2 * info.k)

    def _cublas(self, x, w16, out, epi: str):
        # Prefill only (T > 1): cuBLAS through CuPy on the FP16 cache (FP32 accumulation).
        # The resid / f32 epilogues round the product to FP16 first (one temporary from CuPy's
        # allocator, i.e. the pool's "cupy" tag while a model lives).
        if epi == "f16":
            self._cublas_matmul(x, w16.T, out=out)
            return
        y = self._cublas_matmul(x, w16.T)         # [T, N] f16
        kern = "add_f16_to_f32" if epi == "resid" else "copy_f16_to_f32"
        self._fn("elementwise", kern)(((y.size + 255) // 256,), (256,),
                                      (y.data.ptr, y.size, out.data.ptr))

    def linear(self, x, w, out):
        """out f16 [T, out] = x f16 [T, in] @ W.T."""
        info = self._info(w)
        t = self._act_in(x, info)
        out = self._out(out, "out", _F16, t, info.n)
        self._matmul(x, w, info, out, "f16", info.n)

    def linear_residual(self, x, w, residual):
        """residual f32 [T, out] += x f16 [T, in] @ W.T."""
        info = self._info(w)
        t = self._act_in(x, info)
        if not _fast_ok(residual, _F32, 2, info.n, t):
            _dev(residual, "residual", np.float32, 2)
            _shape(residual, "residual", (t, info.n))
        self._matmul(x, w, info, residual, "resid", info.n)

    def linear_swiglu(self, x, w, tmp, out):
        """out f16 [T, F] = silu(x @ Wg.T) * (x @ Wu.T); W [2F, in] gate rows then up rows.

        T = 1: one fused GEMV (each warp reads its gate and up rows); T > 1: GEMM into
        ``tmp`` f16 [>= T, 2F], then the SwiGLU kernel.
        """
        info = self._info(w)
        t = self._act_in(x, info)
        n2 = info.n
        if n2 % 2:
            raise ConfigError(f"linear_swiglu needs an even out_features (gate|up), got {n2}")
        f = n2 // 2
        out = self._out(out, "out", _F16, t, f)
        if t == 1:
            if info.v2:
                self._gemv2(info, info.g2["swiglu"], f, f, x, out)
                return
            info.gemv["swiglu"](((f + _GEMV_ROWS - 1) // _GEMV_ROWS,), (32 * _GEMV_ROWS,),
                                (*info.args, x.data.ptr, f, info.k, f,
                                 w.group_size.bit_length() - 1, out.data.ptr))
            return
        tmp = self._out(tmp, "tmp", _F16, t, n2)
        self._matmul(x, w, info, tmp, "f16", n2)
        self._fn("elementwise", "swiglu_f16")(
            ((f + 255) // 256, t), (256,), (tmp.data.ptr, f, out.data.ptr))

    # --- the paged KV cache (kvcache.py): ``kv`` is a SlotKV (layout + device block table) -----
    def _kv_table(self, kv, ctx: int):
        """Validate a SlotKV for ``ctx`` positions; return (table ptr, P, part offsets)."""
        lay = kv.layout
        if lay.mode not in self.kv_modes:
            raise ConfigError(f"kv mode {lay.mode!r} has no CUDA kernels yet; this backend "
                              f"runs {self.kv_modes}")
        if lay.stores_h and (lay.group_size != H_KERNEL_GROUP
                             or lay.rotate not in H_KERNEL_ROTATE or lay.d_model % 32
                             or lay.outliers > H_KERNEL_OUTLIERS):
            raise ConfigError(f"kv mode {lay.mode!r} with group_size={lay.group_size}, "
                              f"rotate={lay.rotate}, outliers={lay.outliers}, "
                              f"d_model={lay.d_model} has no CUDA kernel: kv_h.cu takes groups "
                              f"of {H_KERNEL_GROUP}, rotations {H_KERNEL_ROTATE}, at most "
                              f"{H_KERNEL_OUTLIERS} outliers and d_model a multiple of 32")
        tab = kv.table
        if not (type(tab) is cupy.ndarray and tab.dtype == np.int64 and tab.ndim == 1
                and tab.flags.c_contiguous):
            _dev(tab, "kv.table", np.int64, 1)
        p = lay.page_size
        if tab.shape[0] * p < ctx:
            raise ConfigError(f"kv.table has {tab.shape[0]} pages of {p} positions, need "
                              f"{ctx} positions")
        if ctx > 0 and not kv.table_host[(ctx - 1) // p]:
            raise ConfigError(f"position {ctx - 1} has no page: call RuntimeKVCache.ensure "
                              "first")
        return tab.data.ptr, p, lay.kernel_offsets

    def kv_write(self, qkv, h, pos0, theta, n_heads, n_kv_heads, head_dim, kv):
        """Rotate Q in place in ``qkv`` f16 [T, >= (H + 2 Hkv) hd] and store positions
        pos0..pos0+T-1 of slot ``kv`` through its block table: rotated K and V (fp16; a
        rotated K beyond FP16's range saturates at its largest finite value), or int8 codes
        with one FP16 scale per (position, KV head) (``quant.quantize_rows_int8(...,
        saturate=True)``'s rule, bit for bit), or (store-h modes) the rows of ``h`` f16
        [>= T, d_model] (``_h_write``; ``h`` is unused in the K/V modes)."""
        if not _fast_ok(qkv, _F16, 2):
            _dev(qkv, "qkv", np.float16, 2)
        t, ld = qkv.shape
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        if head_dim > 256:
            raise ConfigError(f"head_dim={head_dim} > 256: kv_write keeps <= 4 pairs per lane")
        table, p, offs = self._kv_table(kv, int(pos0) + t)
        if kv.layout.stores_h:
            self._h_write(qkv, h, int(pos0), 0, theta, n_heads, n_kv_heads, head_dim, kv,
                          table, p, offs)
            return
        self._fn("rope", f"kv_write_{kv.layout.mode}")(
            (t,), (128,), (qkv.data.ptr, ld, int(pos0), float(theta), int(n_heads),
                           int(n_kv_heads), int(head_dim), table, p, *offs),
            shared_mem=int(head_dim) * 4)

    def _h_write(self, qkv, h, pos0, step_ptr, theta, n_heads, n_kv_heads, head_dim, kv, table,
                 p, offs) -> None:
        """Store-h write of T = qkv rows: Q rotated in place (rope.cu's Q-only write), then
        the rows of ``h`` f16 [>= T, d_model] stored at positions pos0.. (or, with
        ``step_ptr`` != 0, at the device step state's STEP_POS..) in the slot's mode
        (kv_h.cu ``h_write_*``: FP16 copy, or ``numpy_ops.encode_h``'s INT8 / INT4 parts bit
        for bit). Arguments besides ``h`` already validated."""
        t, ld = qkv.shape
        lay = kv.layout
        d = lay.d_model
        if not _fast_ok(h, _F16, 2, d):
            _dev(h, "h", np.float16, 2)
            _shape(h, "h", (h.shape[0], d))
        h = _rows(h, "h", t)
        where = step_ptr if step_ptr else int(pos0)
        self._fn("rope", "kv_write_step_qonly" if step_ptr else "kv_write_qonly")(
            (t,), (128,), (qkv.data.ptr, ld, where, float(theta), int(n_heads),
                           int(n_kv_heads), int(head_dim), 0, p, 0, 0, 0, 0),
            shared_mem=int(head_dim) * 4)
        self._fn("kv_h", f"h_write_{lay.mode}")(
            (t,), (256,), (h.data.ptr, d, int(pos0), step_ptr, table, p, d, *offs[:3],
                           int(lay.rotate), int(lay.outliers), *lay.outlier_offsets))

    def _h_attention(self, qkv, kv, pos0, n_heads, n_kv_heads, head_dim, out, recon, table,
                     p, offs) -> None:
        """Store-h attention (``kv_attention`` for a slot storing h), chunk by chunk so the
        scratch stays bounded: for each chunk of C = ``recon.chunk`` positions c0..c0+n-1 of
        the context 0..pos0+T-1: dequantize its h rows into ``recon_h`` f16 [n, d]
        (kv_h.cu ``h_read_*``: ``numpy_ops.decode_h``), K|V = h @ w_kv.T into
        ``recon_kv`` f16 [n, 2 kv_dim] (``linear``: the GEMM, or the GEMV when n = 1), RoPE
        on its K columns at positions c0.. (rope.cu's Q-only kernel, kv_write's rule), then
        ``h_attn_chunk``: every query row against the chunk under the causal mask, the
        online-softmax state carried in ``recon_state`` f32 [>= T, H (hd + 2)] and normalised
        into ``out`` after the last chunk. 4 launches per chunk; the chunk count is
        ceil((pos0 + T) / C), computed here on the host (so a store-h step is never
        captured: ``graph_kv_modes``). Raises ConfigError without a CUDA Recon (scratch
        missing or too small, a w_kv of the wrong shape)."""
        t, ld = qkv.shape
        lay = kv.layout
        if recon is None or recon.scratch is None:
            raise ConfigError(f"kv mode {lay.mode!r} stores h: attention needs the layer's "
                              "reconstruction (a kvcache.Recon with the phase-5 scratch)")
        if recon.norm is not None:
            raise ConfigError("a store-h slot holding the raw residual (Recon.norm: a NumPy-"
                              "only measurement) has no CUDA kernels")
        if head_dim > 256 or ld % 2:
            raise ConfigError(f"store-h attention needs head_dim <= 256 and an even qkv row "
                              f"(head_dim={head_dim}, qkv columns={ld})")
        d, kvd, chunk = lay.d_model, int(n_kv_heads) * int(head_dim), int(recon.chunk)
        sc = recon.scratch
        bufs = {}
        for name, dtype, rows, cols in (("recon_h", _F16, chunk, d),
                                        ("recon_kv", _F16, chunk, 2 * kvd),
                                        ("recon_state", _F32, t,
                                         int(n_heads) * (int(head_dim) + 2))):
            arr = sc.get(name) if isinstance(sc, dict) else None
            if arr is None:
                raise ConfigError(f"the reconstruction scratch has no {name!r} (phase 5 of the "
                                  "load plan, plan.recon_plan)")
            if not _fast_ok(arr, dtype, 2, cols, None, True):
                _dev(arr, name, dtype, 2)
                _aligned(arr, name)
                _shape(arr, name, (arr.shape[0], cols))
            bufs[name] = _rows(arr, name, rows)
        hbuf, kvbuf, state = bufs["recon_h"], bufs["recon_kv"], bufs["recon_state"]
        info = self._info(recon.w_kv)
        if (info.n, info.k) != (2 * kvd, d):
            raise ConfigError(f"recon.w_kv has shape {(info.n, info.k)}, expected "
                              f"{(2 * kvd, d)} (the K and V rows of the QKV weight)")
        ctx = int(pos0) + t
        n_chunks = -(-ctx // chunk)
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        read = self._fn("kv_h", f"h_read_{lay.mode}")
        rope = self._fn("rope", "kv_write_qonly")
        attn = self._fn("kv_h", "h_attn_chunk")
        nt = _H_ATTN_THREADS_DECODE if t == 1 else _H_ATTN_THREADS_PREFILL
        smem = (nt // 32) * (int(head_dim) + 2) * 4
        for ci in range(n_chunks):
            c0 = ci * chunk
            n = min(chunk, ctx - c0)
            read((n,), (256,), (table, p, c0, d, *offs[:3], int(lay.outliers),
                                *lay.outlier_offsets, hbuf.data.ptr))
            self.linear(hbuf[:n], recon.w_kv, kvbuf[:n])
            rope((n,), (128,), (kvbuf.data.ptr, 2 * kvd, c0, float(recon.theta),
                                int(n_kv_heads), 0, int(head_dim), 0, p, 0, 0, 0, 0),
                 shared_mem=int(head_dim) * 4)
            attn((t, int(n_heads)), (nt,),
                 (qkv.data.ptr, ld, int(pos0), kvbuf.data.ptr, c0, n, int(n_heads),
                  int(n_kv_heads), int(head_dim), scale_log2, state.data.ptr, int(ci == 0),
                  int(ci == n_chunks - 1), out.data.ptr), shared_mem=smem)

    def _heads_ok(self, n_heads, n_kv_heads, head_dim, ld):
        key = (n_heads, n_kv_heads, head_dim, ld)
        if key not in self._heads_seen:
            self._check_heads(*key)
            self._heads_seen.add(key)

    @staticmethod
    def _check_heads(n_heads, n_kv_heads, head_dim, ld):
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ConfigError(f"n_heads={n_heads} must be a positive multiple of "
                              f"n_kv_heads={n_kv_heads}")
        if head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"head_dim={head_dim} must be positive and even")
        need = (n_heads + 2 * n_kv_heads) * head_dim
        if ld < need:
            raise ConfigError(f"qkv has {ld} columns, need (n_heads + 2*n_kv_heads)*head_dim "
                              f"= {need}")

    def kv_attention(self, qkv, kv, pos0, n_heads, n_kv_heads, head_dim, out, recon=None):
        """out f16 [T, H hd]: causal GQA attention of the (rotated) Q rows of ``qkv`` over
        positions 0..pos0+T-1 of slot ``kv``, read through its device block table (fp16, or
        int8 dequantized in the inner loop). T = 1: decode kernel; T > 1: prefill, on tensor
        cores (attention_prefill.cu) unless ``attn_prefill == "scalar"``, the head dim is not
        in FA_HEAD_DIMS or the rows do not allow its 4-byte loads (then attention.cu's scalar
        kernel). Store-h modes: K/V rebuilt chunk by chunk through ``recon`` (a kvcache.Recon
        with the phase-5 scratch; ``_h_attention``), T = 1 and T > 1 alike."""
        if not _fast_ok(qkv, _F16, 2):
            _dev(qkv, "qkv", np.float16, 2)
        t, ld = qkv.shape
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        if head_dim not in ATTN_HEAD_DIMS:
            raise ConfigError(f"head_dim={head_dim} has no attention kernel; built for "
                              f"{ATTN_HEAD_DIMS}")
        ctx = int(pos0) + t
        table, p, offs = self._kv_table(kv, ctx)
        out = self._out(out, "out", _F16, t, n_heads * head_dim)
        if kv.layout.stores_h:
            self._h_attention(qkv, kv, int(pos0), n_heads, n_kv_heads, head_dim, out, recon,
                              table, p, offs)
            return
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        mode = kv.layout.mode
        if t == 1:
            self._attn_decode(qkv, ctx, 0, table, p, offs, mode, n_heads, n_kv_heads, head_dim,
                              scale_log2, out)
        elif (self.attn_prefill == "mma" and head_dim in FA_HEAD_DIMS and ld % 2 == 0
              and qkv.data.ptr % 4 == 0 and out.data.ptr % 4 == 0 and ctx < 2**30):
            self._fn("attention_prefill", _FA_NAMES[mode, head_dim])(
                (((t + _FA_Q - 1) // _FA_Q) * int(n_heads),), (_FA_THREADS,),
                (qkv.data.ptr, ld, t, int(pos0), table, p, *offs, int(n_heads),
                 int(n_kv_heads), scale_log2, self.sms, out.data.ptr))
        else:
            self._fn("attention", _PREFILL_NAMES[mode, head_dim])(
                ((t + _PF_Q - 1) // _PF_Q, int(n_heads)), (4 * _PF_Q,),
                (qkv.data.ptr, ld, t, int(pos0), table, p, *offs, int(n_heads),
                 int(n_kv_heads), scale_log2, out.data.ptr))

    def _attn_decode(self, qkv, ctx, step_pos, table, p, offs, mode, n_heads, n_kv_heads,
                     head_dim, scale_log2, out, splits=None):
        """One query row: split-K (``attn_split_*``: the partials, then the last block of
        each head merges them) or, with ``attn_decode == "v1"`` or when ``decode_splits`` says
        single-pass (short contexts), the one-block-per-head kernel. ``step_pos``: 0, or the
        device address of the int32 position (ctx = pos + 1 on the device; ``ctx`` is then the
        table's capacity and only picks the split count). ``splits`` forces split-K with that
        count (tests)."""
        ns = int(splits) if splits is not None else decode_splits(ctx, n_heads, self.sms)
        if self.attn_decode == "v1" or ns == 0:
            if step_pos:
                raise ConfigError("TINYLOOP_ATTN_DECODE=v1 reads the context length on the "
                                  "host; the device step state needs the split-K kernel")
            self._fn("attention", _DECODE_NAMES[mode, head_dim])(
                (int(n_heads),), (_DC_THREADS,),
                (qkv.data.ptr, ctx, table, p, *offs, int(n_heads), int(n_kv_heads),
                 scale_log2, out.data.ptr))
            return
        if not 1 <= ns <= DS_MAX_SPLITS:
            raise ConfigError(f"decode attention splits={ns}: expected 1..{DS_MAX_SPLITS}")
        if n_heads > _DS_TICKETS:
            raise ConfigError(f"split-K decode attention takes at most {_DS_TICKETS} query "
                              f"heads, got {n_heads}")
        # the scratch: u32 tickets [_DS_TICKETS] (zero between launches: the merging block of
        # each head re-arms its own), then the partials f32 [n_heads, ns, hd + 2]
        need = 4 * _DS_TICKETS + int(n_heads) * ns * (int(head_dim) + 2) * 4
        if need > self._ds_cap:
            if self._ds_blk is not None:
                self.synchronize()
                blk, self._ds_blk, self._ds_ptr, self._ds_cap = self._ds_blk, None, 0, 0
                blk.free()
            self._ds_blk = self._cuda_pool.allocate(need, "scratch")
            self._ds_ptr = self._ds_blk.ptr
            cupy.cuda.runtime.memset(self._ds_ptr, 0, 4 * _DS_TICKETS)
            self._ds_cap = need
        self._fn("attention_decode", _SPLIT_NAMES[mode, head_dim])(
            (int(n_heads), ns), (_DS_THREADS,),
            (qkv.data.ptr, int(ctx), int(step_pos), table, p, *offs, int(n_heads),
             int(n_kv_heads), scale_log2, self._ds_ptr + 4 * _DS_TICKETS, self._ds_ptr,
             out.data.ptr))

    def inject(self, state, e, w, tmp2, tmp1):
        """state f32 [T, d] = [state, e] @ W.T, W [d, 2d]; e f32 or f16 [T, d].

        ``tmp2`` f16 [>= T, 2d] takes the concatenation; ``tmp1`` f16 [>= T, d] is used only
        on the FP16-cache path."""
        _dev(state, "state", np.float32, 2)
        t, d = state.shape
        if not isinstance(e, cupy.ndarray) or e.dtype not in (np.float32, np.float16):
            raise ConfigError(f"e must be a float32 or float16 cupy.ndarray, got "
                              f"{type(e).__name__} {getattr(e, 'dtype', '')}")
        _dev(e, "e", e.dtype, 2)
        _shape(e, "e", (t, d))
        _weight(w, "w", 2 * d)
        info = self._info(w)
        if w.out_features != d:
            raise ConfigError(f"inject weight has out_features={w.out_features}, need d={d}")
        _dev(tmp2, "tmp2", np.float16, 2)
        tmp2 = _rows(tmp2, "tmp2", t)
        _shape(tmp2, "tmp2", (t, 2 * d))
        _aligned(tmp2, "tmp2")
        kern = "concat_inject_f16" if e.dtype == np.float16 else "concat_inject_f32"
        self._fn("elementwise", kern)(
            ((d + 255) // 256, t), (256,), (state.data.ptr, e.data.ptr, d, tmp2.data.ptr))
        if t > 1 and _fp16_of(w) is not None:
            _dev(tmp1, "tmp1", np.float16, 2)
            tmp1 = _rows(tmp1, "tmp1", t)
            _shape(tmp1, "tmp1", (t, d))
            self._cublas_matmul(tmp2, _fp16_of(w).T, out=tmp1)
            self._fn("elementwise", "copy_f16_to_f32")(
                ((t * d + 255) // 256,), (256,), (tmp1.data.ptr, t * d, state.data.ptr))
            return
        self._matmul(tmp2, w, info, state, "f32", d)

    def lm_head(self, x, w, out):
        """out f32 [T, vocab] = x f16 [T, d] @ W.T."""
        info = self._info(w)
        t = self._act_in(x, info)
        out = self._out(out, "out", _F32, t, info.n)
        self._matmul(x, w, info, out, "f32", info.n)

    # --- RMSNorm fused into the next projection (decode) -----------------------------------------
    # At T == 1 each pair is ONE launch of a gemv_norm_* kernel: every block normalizes the FP32
    # residual row into shared memory exactly as ``rmsnorm`` would (same FP16 values), then runs
    # the GEMV loop on it. ``norm`` is then NOT written (its contents stay whatever they were);
    # callers must not read it after a T == 1 pair. T > 1, or a weight whose K / N the fused
    # kernel does not take, composes ``rmsnorm`` (into ``norm``) with the projection (Ops').
    def _norm_fused(self, x, weight, info) -> bool:
        """True when the pair runs fused: x f32 [1, K], weight f32 [K] on the device and a
        weight the fused kernel takes. T > 1 or a too-large weight: False (compose). A bad
        argument at T == 1 raises with the detailed message."""
        if _fast_ok(x, _F32, 2, info.k, 1) and _fast_ok(weight, _F32, 1, info.k):
            return info.gemv_norm is not None
        _dev(x, "x", np.float32, 2)
        if x.shape[0] != 1:
            return False
        if x.shape[1] != info.k:
            raise ConfigError(f"w has in_features={info.k}, but the input has {x.shape[1]} "
                              "columns")
        _dev(weight, "weight", np.float32, 1)
        _shape(weight, "weight", (info.k,))
        return info.gemv_norm is not None

    def _gemv_norm(self, info, epi: str, x, weight, eps, rows: int, f: int, out) -> None:
        if info.v2:
            nt, nb = self._geo(info, rows, True)
            info.g2_norm[epi]((nb,), (nt,),
                              (x.data.ptr, weight.data.ptr, float(eps), *info.args, rows,
                               info.k, f, info.lg, out.data.ptr), shared_mem=2 * info.k)
            return
        blocks = (rows + _GEMV_ROWS - 1) // _GEMV_ROWS
        if blocks > self._norm_blocks:
            blocks = self._norm_blocks
        info.gemv_norm[epi]((blocks,), (32 * _GEMV_ROWS,),
                            (x.data.ptr, weight.data.ptr, float(eps), *info.args, rows, info.k,
                             f, info.lg, out.data.ptr), shared_mem=2 * info.k)

    def rmsnorm_linear(self, x, weight, eps, w, out, norm):
        """out f16 [T, n] = rmsnorm(x f32 [T, d], weight) @ W.T.

        T == 1: one fused launch, ``norm`` left unwritten; T > 1: rmsnorm into ``norm``
        f16 [>= T, d], then ``linear``."""
        info = self._info(w)
        if not self._norm_fused(x, weight, info):
            return super().rmsnorm_linear(x, weight, eps, w, out, norm)
        out = self._out(out, "out", _F16, 1, info.n)
        self._gemv_norm(info, "f16", x, weight, eps, info.n, 0, out)

    def rmsnorm_linear_swiglu(self, x, weight, eps, w, tmp, out, norm):
        """out f16 [T, F] = swiglu(rmsnorm(x f32 [T, d], weight) @ W.T), W [2F, d] gate rows
        then up rows.

        T == 1: one fused launch (``tmp`` and ``norm`` unused, ``norm`` left unwritten);
        T > 1: rmsnorm into ``norm``, then ``linear_swiglu`` through ``tmp``."""
        info = self._info(w)
        if not self._norm_fused(x, weight, info):
            return super().rmsnorm_linear_swiglu(x, weight, eps, w, tmp, out, norm)
        n2 = info.n
        if n2 % 2:
            raise ConfigError(f"linear_swiglu needs an even out_features (gate|up), got {n2}")
        f = n2 // 2
        out = self._out(out, "out", _F16, 1, f)
        self._gemv_norm(info, "swiglu", x, weight, eps, f, f, out)

    def rmsnorm_lm_head(self, x, weight, eps, w, out, norm):
        """out f32 [T, vocab] = rmsnorm(x f32 [T, d], weight) @ W.T.

        T == 1: one fused launch, ``norm`` left unwritten; T > 1: rmsnorm into ``norm``,
        then ``lm_head``."""
        info = self._info(w)
        if not self._norm_fused(x, weight, info):
            return super().rmsnorm_lm_head(x, weight, eps, w, out, norm)
        out = self._out(out, "out", _F32, 1, info.n)
        self._gemv_norm(info, "f32", x, weight, eps, info.n, 0, out)

    def rmsnorm_lm_head_sample(self, x, weight, eps, w, out, norm, temperature, top_k, top_p,
                               u) -> int:
        """The next token id from rmsnorm(x f32 [1, d], weight) @ W.T; the logits land in
        ``out`` f32 [1, vocab] as ``rmsnorm_lm_head`` writes them.

        Greedy (temperature <= 0) with the v2 GEMV: ONE launch: the LM head's blocks each
        reduce their logits to an argmax partial and the last block picks the id (numpy.argmax's
        rule: first NaN, else first maximum) and writes it with the row's fault code to pinned
        host memory, so only 8 bytes cross per step (one stream synchronisation). Otherwise
        ``rmsnorm_lm_head`` then ``sample``. Raises ConfigError on bad arguments (as those two
        do) and NonFiniteLogitsError for a row ``sample`` would refuse.
        """
        info = self._info(w)
        if temperature > 0.0 or not info.v2 or not self._norm_fused(x, weight, info):
            return super().rmsnorm_lm_head_sample(x, weight, eps, w, out, norm, temperature,
                                                  top_k, top_p, u)
        out = self._out(out, "out", _F32, 1, info.n)
        self.head_argmax_launch(info, x, weight, eps, out, self._id_ptr)
        cupy.cuda.get_current_stream().synchronize()
        self._raise_on_fault()
        return int(self._id_view[0])

    def head_argmax_launch(self, info, x, weight, eps, out, id_host, id_dev=None) -> None:
        """Queue the fused RMSNorm + LM head + argmax (no synchronisation): the id and the
        row's fault code go to the device ints at ``id_dev`` (default ``self._id_dev``; a
        captured decode step passes its step state) and, when ``id_host`` (a mapped pinned
        int [2]) is non-zero, there too. Arguments already validated; ``info.v2`` must
        hold."""
        nt, nb = self._geo(info, info.n, True)
        if nb > self._part_cap:
            nb = self._part_cap
        info.g2_argmax((nb,), (nt,),
                       (x.data.ptr, weight.data.ptr, float(eps), *info.args, info.n, info.k,
                        info.lg, out.data.ptr, self._part_v, self._part_i, self._ticket,
                        self._id_dev if id_dev is None else id_dev, id_host),
                       shared_mem=2 * info.k)

    # --- the captured decode step (tinyloop/graphs.py; step state: backends.base) -----------
    graph_kv_modes = ("fp16", "int8")     # the store-h modes rebuild K/V chunk by chunk, with
                                          # a host loop over the context (the chunk count is
                                          # ceil(ctx / C)): eager only, never captured

    def graph_constants(self) -> tuple:
        """The host-chosen launch constants of a decode step: the GEMV version and forced
        geometry, the test grid cap, the SM count (v2 grids derive from it), the decode
        attention kernel, whether fp16 slots run the fused QKV + RoPE kernel
        (``TINYLOOP_FUSED_QKV_ROPE``) and whether the capture uses PDL (``pdl_capture``)."""
        return (repr(self.gemv), self._grid_cap, self.sms, self.attn_decode,
                fused_qkv_rope_enabled(), self.pdl_capture)

    @property
    def pdl_capture(self) -> bool:
        """Whether a decode-step capture launches PDL_KERNELS with programmatic dependent
        launch: ``TINYLOOP_PDL`` on (``config.pdl_enabled``), a GPU of compute capability
        9.0 or later (griddepcontrol is sm_90 PTX), and a driver that takes the launch: the
        first ask launches one empty kernel that way, outside any capture (a refusal - an old
        driver, no libcuda - warns once and turns PDL off for this backend, so captures use
        plain launches instead of failing)."""
        if self._cc < 90 or not pdl_enabled():
            return False
        if self._pdl.launcher is None:
            self._pdl.launcher = self._pdl_probe()
        return self._pdl.launcher is not False

    def _pdl_probe(self):
        """A working _PdlLauncher, or False (with a warning) when the driver refuses it."""
        if self._capturing is not None:
            raise ConfigError("the PDL probe must run before a capture opens")
        try:
            launcher = _PdlLauncher()
            k = self._fn("elementwise", "copy_f16_to_f32")   # n = 0: touches no memory
            pool, k.pool = k.pool, None        # a first launch: measured, as _Kernel's
            with (pool.measure_driver("kernel modules") if pool is not None
                  else contextlib.nullcontext()):
                launcher.launch(k.raw.kernel.ptr, 1, 32, (0, 0, 0), 0,
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

    def _step_kv(self, kv) -> tuple:
        mode = kv.layout.mode
        if mode not in self.graph_kv_modes:
            raise ConfigError(f"kv mode {mode!r} has no step kernels; a captured decode step "
                              f"runs {self.graph_kv_modes}")
        # pages for every position a replay may reach are the caller's promise
        # (graphs.DecodeGraphs binds a table covering the request's capacity): check page 0
        return self._kv_table(kv, 1)

    def kv_write_step(self, qkv, h, step, theta, n_heads, n_kv_heads, head_dim, kv):
        """``kv_write`` of one row (qkv f16 [1, >= (H + 2 Hkv) hd]) at the position in the
        device step state ``step`` int32 [STEP_WORDS] (read by the kernel: nothing of the
        position is passed from the host, so a captured launch serves every step)."""
        if not _fast_ok(qkv, _F16, 2, None, 1):
            _dev(qkv, "qkv", np.float16, 2)
            _shape(qkv, "qkv", (1, qkv.shape[1]))
        ld = qkv.shape[1]
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        if head_dim > 256:
            raise ConfigError(f"head_dim={head_dim} > 256: kv_write keeps <= 4 pairs per lane")
        if kv.layout.stores_h:            # the position read on the device, as below
            table, p, offs = self._kv_table(kv, 1)
            self._h_write(qkv, h, 0, self._step_ptr(step), theta, n_heads, n_kv_heads,
                          head_dim, kv, table, p, offs)
            return
        table, p, offs = self._step_kv(kv)
        self._fn("rope", f"kv_write_step_{kv.layout.mode}")(
            (1,), (128,), (qkv.data.ptr, ld, self._step_ptr(step), float(theta), int(n_heads),
                           int(n_kv_heads), int(head_dim), table, p, *offs),
            shared_mem=int(head_dim) * 4)

    def rmsnorm_qkv_kv_step(self, x, weight, eps, w, qkv, step, theta, n_heads, n_kv_heads,
                            head_dim, kv) -> bool:
        """``Ops.rmsnorm_qkv_kv_step``: one launch of qkv_rope.cu (RMSNorm + QKV GEMV + RoPE +
        the K/V write at ``step[STEP_POS]``) for an fp16 or int8 slot, with the v1 GEMV the
        pair would use (its RMSNorm-fused kernel), head_dim even and <= STEP_ROPE_MAX, W's
        rows exactly (H + 2 Hkv) hd and ``TINYLOOP_FUSED_QKV_ROPE`` on; False otherwise
        (nothing launched). Bit for bit the memory ``rmsnorm_linear`` + ``kv_write_step``
        leave."""
        if kv.layout.mode not in ("fp16", "int8") or not fused_qkv_rope_enabled():
            return False
        info = self._info(w)
        if info.v2 or head_dim % 2 or head_dim > STEP_ROPE_MAX:
            return False
        if info.n != (n_heads + 2 * n_kv_heads) * head_dim or not self._norm_fused(x, weight,
                                                                                  info):
            return False
        out = self._out(qkv, "qkv", _F16, 1, info.n)
        self._heads_ok(n_heads, n_kv_heads, head_dim, out.shape[1])
        table, p, offs = self._step_kv(kv)
        blocks = min((info.n + _GEMV_ROWS - 1) // _GEMV_ROWS, self._norm_blocks)
        self._fn("qkv_rope", f"qkv_rope_step_q{w.bits}_{kv.layout.mode}")(
            (blocks,), (32 * _GEMV_ROWS,),
            (x.data.ptr, weight.data.ptr, float(eps), *info.args, info.n, info.k, info.lg,
             out.data.ptr, self._step_ptr(step), float(theta), int(n_heads), int(n_kv_heads),
             int(head_dim), table, p, *offs, self._qkv_ticket), shared_mem=2 * info.k)
        return True

    def kv_attention_step(self, qkv, kv, step, n_heads, n_kv_heads, head_dim, out, recon=None):
        """``kv_attention`` of one query row over positions 0..step[STEP_POS] (the context
        length read on the device). Split-K (default): the split count comes from the block
        table's capacity (pages per table are in the graph key), each split's page range from
        the device length; ``TINYLOOP_ATTN_DECODE=v1``: n_heads blocks whatever the length."""
        if kv.layout.stores_h:
            # the chunk count depends on the context length: read it on the host (one
            # synchronisation) and run the eager store-h attention; graphs.DecodeGraphs never
            # captures a store-h step (graph_kv_modes)
            if self._capturing is not None:
                raise ConfigError(f"kv mode {kv.layout.mode!r} cannot be captured: its "
                                  "attention's chunk count is chosen on the host")
            return Ops.kv_attention_step(self, qkv, kv, step, n_heads, n_kv_heads, head_dim,
                                         out, recon)
        if not _fast_ok(qkv, _F16, 2, None, 1):
            _dev(qkv, "qkv", np.float16, 2)
            _shape(qkv, "qkv", (1, qkv.shape[1]))
        self._heads_ok(n_heads, n_kv_heads, head_dim, qkv.shape[1])
        if head_dim not in ATTN_HEAD_DIMS:
            raise ConfigError(f"head_dim={head_dim} has no attention kernel; built for "
                              f"{ATTN_HEAD_DIMS}")
        table, p, offs = self._step_kv(kv)
        out = self._out(out, "out", _F16, 1, n_heads * head_dim)
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        cap = int(kv.table.shape[0]) * kv.layout.page_size
        if self.attn_decode == "split" and decode_splits(cap, n_heads, self.sms):
            self._attn_decode(qkv, cap, self._step_ptr(step) + 4 * STEP_POS, table, p, offs,
                              kv.layout.mode, n_heads, n_kv_heads, head_dim, scale_log2, out)
            return
        self._fn("attention", f"attn_decode_step_{kv.layout.mode}_hd{int(head_dim)}")(
            (int(n_heads),), (_DC_THREADS,),
            (qkv.data.ptr, self._step_ptr(step), table, p, *offs, int(n_heads),
             int(n_kv_heads), scale_log2, out.data.ptr))

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
        self._fn("sample", "argmax_f32")((1,), (1024,), (out.data.ptr, info.n, sp))

    @property
    def graph_sampling(self) -> bool:
        """A captured step can sample (temperature > 0) where sample.cu's device sampler runs
        (``device_sampling``; vocabularies up to 2^22)."""
        return self.device_sampling

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
        vocabulary limit or with ``device_sampling`` off."""
        sp = self._step_ptr(step)
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        info = self._info(w)
        out = self._out(out, "out", _F32, 1, info.n)
        n = info.n
        if not self.device_sampling or n > _SAMPLE_MAX_N:
            raise ConfigError(f"a sampled decode step needs the device sampler (vocabulary "
                              f"<= {_SAMPLE_MAX_N}, device_sampling on); got {n} tokens, "
                              f"device_sampling={self.device_sampling}")
        self._ensure_wq(n)
        self._fn("sample", "sample_step")(
            (1,), (_SAMPLE_THREADS,), (out.data.ptr, n, self._smp_ptr, self._wq_ptr, sp))

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
            (1,), (64,), (self._step_ptr(step), self._id_ptr, float(theta or 0.0), hd))

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

    # --- the decode megakernel (cuda_src/decode_mega.cu; tinyloop/megakernel.py) -------------
    mega_kv_modes = ("fp16", "int8")      # the slot modes decode_mega.cu reads and writes

    def mega_weight_record(self, w) -> tuple:
        """The megakernel's weight record of a device QuantWeight (decode_mega.cu MkW):
        (qweight, scales, zeros pointers, N, K, bits, log2 g, lanes per row). Lanes per row
        are those of the GEMV the graph path launches for ``w`` (v2: its lpr; v1: 32, one
        warp per row), so each output row sums in the same order."""
        info = self._info(w)
        return (*info.args, info.n, info.k, int(w.bits), info.lg,
                info.lpr if info.v2 else 32)

    def mega_splits(self, capacity: int, n_heads: int) -> int:
        """Attention splits of a slot whose block table holds ``capacity`` positions: the
        split count the captured step's ``kv_attention_step`` launches (``decode_splits``)."""
        return decode_splits(capacity, n_heads, self.sms)

    def mega_why_not(self, head_dim: int, smem: int) -> str | None:
        """Why this backend cannot run the megakernel for ``head_dim`` with ``smem`` bytes of
        dynamic shared memory (None: it can). Asked every step: cached."""
        key = ("why", head_dim, smem)
        if key not in self._mega_fit:
            self._mega_fit[key] = self._mega_why_not(head_dim, smem)
        return self._mega_fit[key]

    def _mega_why_not(self, head_dim: int, smem: int) -> str | None:
        if self.attn_decode != "split":
            return "TINYLOOP_ATTN_DECODE=v1 (the megakernel runs the split-K attention)"
        if head_dim not in MEGA_HEAD_DIMS:
            return f"head_dim={head_dim} (megakernels are built for {MEGA_HEAD_DIMS})"
        if smem > _MEGA_MAX_SMEM:
            return f"{smem} bytes of staged activations (at most {_MEGA_MAX_SMEM})"
        try:
            # unknown attribute (an older CuPy): try; a refused launch falls back (megakernel.py)
            coop = int(cupy.cuda.Device().attributes.get("CooperativeLaunch", 1))
        except Exception:                                # an older CuPy: no .attributes
            coop = 1
        if not coop:
            return "the device does not support cooperative launches"
        return None

    def mega_grid(self, head_dim: int, smem: int, per_sm: int) -> tuple:
        """(blocks, blocks per SM that fit) of a megakernel launch: ``per_sm`` blocks per SM
        (0 = as many as fit), never more than fit co-resident (the occupancy: CUDA's
        occupancy API where CuPy exposes it, else computed from the kernel's registers and
        shared memory; the smaller when both exist), so every block reaches every barrier."""
        key = (head_dim, smem)
        fit = self._mega_fit.get(key)
        if fit is None:
            fn = self._fn("decode_mega", f"decode_mega_hd{int(head_dim)}")
            # (a lazily loaded kernel may load at its first attribute query: measured)
            with self._cuda_pool.measure_driver("kernel modules"):
                attrs = fn.attributes
                dev = cupy.cuda.Device().attributes
                fit = occupancy_estimate(attrs["num_regs"], attrs["shared_size_bytes"], smem,
                                         _MEGA_THREADS, dev)
                try:
                    api = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        fn.kernel.ptr, _MEGA_THREADS, smem))
                    fit = min(fit, api)
                except Exception:  # not exposed by this CuPy (or another signature): estimate
                    pass
            self._mega_fit[key] = fit
        if fit < 1:
            raise ConfigError(f"no megakernel block fits on an SM (head_dim={head_dim}, "
                              f"{smem} bytes of shared memory)")
        n = fit if per_sm == 0 else min(fit, per_sm)
        return self.sms * n, fit

    def mega_launch(self, head_dim: int, blocks: int, smem: int, args: tuple) -> None:
        """Queue one megakernel launch (decode_mega_hd{head_dim}) on the current stream with
        cuLaunchCooperativeKernel: the driver refuses (CUDADriverError, nothing queued) a
        grid that cannot be all co-resident, so the kernel's grid barriers cannot deadlock.
        ``args`` in the kernel's order: Python ints (pointers, int64) and floats (double);
        megakernel.py builds them. The module is compiled as every other family (no
        cooperative-groups header or relocatable link: decode_mega.cu's barrier is its own)."""
        fn = self._fn("decode_mega", f"decode_mega_hd{int(head_dim)}")
        vals = [ctypes.c_double(a) if isinstance(a, float) else ctypes.c_int64(int(a))
                for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        pool, fn.pool = fn.pool, None            # the first launch is measured, as _Kernel's
        with (pool.measure_driver("kernel modules") if pool is not None
              else contextlib.nullcontext()):
            cupy.cuda.driver.launchCooperativeKernel(
                fn.kernel.ptr, int(blocks), 1, 1, _MEGA_THREADS, 1, 1, int(smem),
                cupy.cuda.get_current_stream().ptr, ctypes.addressof(params))

    def sample(self, logits, temperature, top_k, top_p, u) -> int:
        """The next token id from f32 logits [vocab] (or [1, vocab]), by
        ``numpy_ops.sample_from_logits``'s rule; only the id crosses to the host.

        temperature <= 0: the argmax kernel writes the id straight to pinned host memory
        (no allocation; one stream synchronisation). Otherwise ``sample.cu``'s one-block
        sampler (fixed-point weights, radix selects: no sort, no CuPy temporaries), or, with
        ``device_sampling = False`` or a vocabulary past 2^22, the CuPy sort path (after the
        argmax kernel, for the fault code). Either way the kernel writes the row's fault code
        beside the id, so a row with a NaN or +inf, or only -inf, raises NonFiniteLogitsError
        as on NumPy (checked once the stream has synchronised; no extra pass over the row).
        Raises ConfigError for u outside [0, 1) or top_k < 0.
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
            self._fn("sample", "argmax_f32")((1,), (1024,), (logits.data.ptr, n, self._id_ptr))
            cupy.cuda.get_current_stream().synchronize()
            self._raise_on_fault()
            return int(self._id_view[0])
        if self.device_sampling and n <= _SAMPLE_MAX_N:
            self.sample_launch(logits, temperature, top_k, top_p, u, self._id_ptr)
            cupy.cuda.get_current_stream().synchronize()
            self._raise_on_fault()
            return int(self._id_view[0])
        self._fn("sample", "argmax_f32")((1,), (1024,), (logits.data.ptr, n, self._id_ptr))
        picked = self._sample_nongreedy(logits, n, temperature, top_k, top_p, u)
        cupy.cuda.get_current_stream().synchronize()     # idle already: int() copied the id
        self._raise_on_fault()
        return picked

    def _raise_on_fault(self) -> None:
        """Raise NonFiniteLogitsError for the fault code an argmax / sampler kernel wrote
        (after a synchronisation)."""
        code = int(self._id_view[1])
        if code:
            raise non_finite_logits(LOGIT_FAULTS[code])

    def sample_launch(self, logits, temperature, top_k, top_p, u, id_host) -> None:
        """Queue ``sample.cu``'s one-block top-k / top-p sampler (temperature > 0) on f32
        logits [n] (validated by ``sample``); the id and the row's fault code go to the
        device ints ``self._id_dev[0..1]`` and, when ``id_host`` is non-zero, to that mapped
        pinned int [2]. Its u64 [n] scratch is taken once (cudaMalloc, outside the pool) and
        grown only for a larger vocabulary."""
        n = logits.shape[0]
        self._ensure_wq(n)
        self._fn("sample", "sample_topk_topp")(
            (1,), (_SAMPLE_THREADS,), (logits.data.ptr, n, float(temperature), int(top_k),
                                       float(top_p), float(u), self._wq_ptr, self._id_dev,
                                       id_host))

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

    @staticmethod
    def _sample_nongreedy(logits, n, temperature, top_k, top_p, u) -> int:
        """The temperature > 0 rule of ``sample_from_logits`` in CuPy array code (sort and
        scans, several temporaries): the path with ``device_sampling = False``, kept as a
        second implementation of the rule."""
        z = logits.astype(cupy.float64) / float(temperature)
        idx = cupy.arange(n, dtype=cupy.float64)
        order = cupy.lexsort(cupy.stack([idx, -z]))            # by value desc, then id asc
        if top_k and top_k < n:
            order = order[:top_k]
        zk = z[order]
        p = cupy.exp(zk - zk[0])
        p /= p.sum()
        n_keep = cupy.asarray(p.size)
        if top_p < 1.0:
            c = cupy.cumsum(p)
            keep = cupy.searchsorted(c, cupy.asarray([top_p], dtype=cupy.float64),
                                     side="left")[0] + 1
            n_keep = cupy.minimum(keep, p.size)
            p = cupy.where(cupy.arange(p.size) < keep, p, 0.0)
            p /= p.sum()
        c = cupy.cumsum(p)
        pick = cupy.searchsorted(c, (u * c[-1]).reshape(1), side="right")[0]
        pick = cupy.minimum(pick, n_keep - 1)
        return int(order[pick])
