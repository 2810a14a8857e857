"""Kernel sources and their compilation: where the ``.cu`` files are, the one geometry
table, and NVRTC through ``cupy.RawModule``.

Each kernel family is one ``kernels/<family>.cu`` (package data beside this module),
compiled once per process and device for the device's own architecture (CuPy derives
``-arch`` from the device's compute capability) and cached. ``GEOMETRY`` holds every launch
constant of every family: each entry goes to NVRTC as ``-DNAME=value``; a constant the
kernel itself uses is repeated in its .cu only as an ``#ifndef NAME`` default (so nvcc
compiles the file standalone, .ci/compile_cuda.sh), and an entry the kernel does not name is
a block size of a kernel written for any block size (the host launches with it).
tests/kernels/test_kernel_geometry.py checks both.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from ...errors import ConfigError
from ..base import REPEAT_LAST_N_MAX, STATE_ATTEMPTS

try:
    import cupy
except ImportError:  # the package still imports (for docs / source checks) without CuPy
    cupy = None

FAMILIES = ("dequant", "rmsnorm", "gemv", "gemm", "rope", "attention", "attention_decode",
            "attention_prefill", "elementwise", "sample", "kv_h", "qkv_rope", "gemv_mma")
_INCLUDE = '#include "common.cuh"'

ATTN_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128)   # attention.cu instantiates one kernel pair each
# attention_prefill.cu (tensor cores) needs head_dim % 16 == 0; other head dims (none built
# today) run the scalar prefill kernel
FA_HEAD_DIMS = tuple(hd for hd in ATTN_HEAD_DIMS if hd % 16 == 0)

GEOMETRY = {
    "dequant": {"DQ_THREADS": 256},              # embed / dequant_f16: threads per row
    "rmsnorm": {"RMS_THREADS": 256},             # threads per row
    "elementwise": {"EW_THREADS": 256,           # threads per block (one element each)
                    # init_state_f32: base.seeded_state's draws per element
                    "STATE_ATTEMPTS": STATE_ATTEMPTS},
    "gemv": {"GEMV_WARPS": 8,                    # warps (= output rows) per 32*W-thread block
             "GEMV2_MAX_THREADS": 256},          # v2: the largest block (its launch bound)
    "gemv_mma": {"MMA_MAX_WARPS": 16,            # a decode batch's tensor-core GEMV: warps
                                                 # (K splits) per block, at most
                 "TC_ITEMS": 3,                  # gemv_tc_*: (tile, step) items a warp loads
                 "TC_MINB": 2},                  # at once; resident blocks the registers fit
    "gemm": {"BM": 64, "BN": 64,                 # block tile: BM rows of X x BN rows of W
             "GEMM_THREADS": 128},               # 4 warps in 2 x 2
    "rope": {"KVW_THREADS": 128,                 # kv_write*: threads per position row
             "STEP_ADVANCE_THREADS": 64},        # decode_step_advance's one block
    "attention": {"PF_Q": 64,                    # prefill: query rows per block (4 threads each)
                  "DC_THREADS": 1024,            # decode: threads per block (one query head)
                  "ATTN_HEAD_DIM_ENTRIES": "".join(f"ATTN_ENTRIES({hd})"
                                                   for hd in ATTN_HEAD_DIMS)},
    "attention_prefill": {"FA_WARPS": 4,         # mma prefill: warps (16 query rows each)
                          "FA_HEAD_DIM_ENTRIES": "".join(f"FA_ENTRIES({hd})"
                                                         for hd in FA_HEAD_DIMS)},
    "attention_decode": {"DS_THREADS": 128,      # split-K decode: threads per (head, split)
                         "DS_MAX_SPLITS": 64,     # splits per head at most (the partials)
                         "DS_MIN_BLOCKS": 5,      # blocks per SM the registers leave room for
                         "DS_HEAD_DIM_ENTRIES": "".join(f"DS_ENTRIES({hd})"
                                                        for hd in ATTN_HEAD_DIMS)},
    # the argmax's and the sampler's one block; the fast sampler's grid blocks
    "sample": {"SMP_THREADS": 1024, "SMP_FAST_THREADS": 256,
               "SMP_WINDOW_MAX": REPEAT_LAST_N_MAX},     # the longest penalty window
    "kv_h": {"H_THREADS": 256,                   # h_write / h_read: threads per position row
             # h_attn_chunk: one block per (query row, head), its warps splitting the chunk's
             # keys: 32 warps for a decode row (few blocks: the keys are the parallelism), 8
             # for prefill rows (many blocks); at least 8 (the merge gives each of
             # head_dim <= 256 dimensions a thread)
             "H_ATTN_THREADS_DECODE": 1024, "H_ATTN_THREADS_PREFILL": 256,
             "H_MAX_OUTLIERS": 4},               # h_int4: outlier channels per row, at most
}
# A family whose source #includes other families' .cu files (their device code; entries
# compiled out with TL_DEVICE_ONLY) compiles with their geometry too.
FAMILY_INCLUDES = {"qkv_rope": ("gemv", "rope"), "gemv_mma": ("gemv",)}


def nvrtc_options(family: str) -> tuple:
    """The NVRTC options ``family`` compiles with: C++17 and its ``GEOMETRY`` (and that of the
    families it includes) as -D macros (part of CuPy's cache key, so a change recompiles)."""
    geo = {}
    for fam in FAMILY_INCLUDES.get(family, ()) + (family,):
        geo.update(GEOMETRY.get(fam, {}))
    return ("--std=c++17",) + tuple(f"-D{k}={v}" for k, v in geo.items())


def source_dir() -> Path:
    """The folder holding the ``.cu`` / ``.cuh`` files: ``kernels/`` beside this module, in a
    checkout and in an installed wheel alike (package data). Raises FileNotFoundError when it
    lacks ``common.cuh`` (a wheel built without its package data)."""
    d = Path(__file__).resolve().parent / "kernels"
    if not (d / "common.cuh").is_file():
        raise FileNotFoundError(f"CUDA kernel sources not found: {d} holds no common.cuh (was "
                                "the wheel built without its package data?)")
    return d


_INCLUDE_RE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def load_source(family: str) -> str:
    """The source of ``kernels/<family>.cu`` with every ``#include "name"`` of a file in
    ``kernels/`` pasted in, recursively, each file once (``#pragma once`` semantics; system
    headers stay includes). Pasting (rather than ``-I``) keeps CuPy's on-disk cache key
    covering every header. Raises ConfigError for a source without common.cuh or one that
    includes a file ``kernels/`` does not hold."""
    d = source_dir()
    src = (d / f"{family}.cu").read_text(encoding="utf-8")
    if _INCLUDE not in src:
        raise ConfigError(f"kernels/{family}.cu does not include common.cuh")
    seen = {f"{family}.cu"}

    def paste(m) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        path = d / name
        if not path.is_file():
            raise ConfigError(f"kernels/{family}.cu includes {name!r}, which kernels/ "
                              "does not hold")
        return _INCLUDE_RE.sub(paste, path.read_text(encoding="utf-8").replace("#pragma once",
                                                                               ""))

    return _INCLUDE_RE.sub(paste, src)


_modules: dict = {}           # (device id, family) -> cupy.RawModule
_modules_lock = threading.Lock()


def get_module(family: str):
    """Compile ``family`` for the current device once per process (thread-safe) and return
    it. Raises ConfigError for an unknown family."""
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
