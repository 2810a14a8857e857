"""TinyLoop's memory pool: every model, buffer and request allocation goes through here.

    pool = get_pool("host" | "cuda" | "pinned")   # one pool per device, made on first use
    blk = pool.allocate(nbytes, tag=None)    # -> Block (.ptr .nbytes .requested_bytes .tag)
    arr = blk.array(shape, dtype)            # numpy (host) / cupy (cuda) view of the block
    pool.free(blk)                           # or blk.free(); a double free raises ValueError
    with tag_scope("weights"): ...           # default tag for allocations inside
    pool.reserve(nbytes); with packed_scope(): ...   # one segment for a planned set of blocks

    memory_stats() / memory_report() / reset_peak_memory_stats() / empty_cache()
    set_memory_limit("4G")                   # or TINYLOOP_MEMORY_LIMIT=4G / 80%
    export_snapshot("mem.pickle")            # open in https://pytorch.org/memory_viz
    with install_cupy_allocator(): ...       # CuPy temporaries go through the pool ("cupy")
    with pool.measure_driver("kernel modules"): ...   # name the driver's bytes (NVML)

Modules: ``arena`` (offset arithmetic and the size classes, with their reasons), ``pool``
(MemoryPool, Block), ``raw`` (host / cuda / pinned / fake raw allocators: the only callers of
a raw allocation function), ``stats`` (MemoryStats and the report, with the driver's lines),
``snapshot`` (PyTorch memory-viz export), ``cupy_hook`` (CuPy's allocator through a pool: a
token per install, and the reference-counted routing a CUDA model holds), ``registry`` (one
pool per device and the module-level functions), ``tags``.
"""

from __future__ import annotations

from ..errors import OutOfMemoryError
from .arena import ALIGNMENT, SMALL_REQUEST_MAX, SMALL_SEGMENT_BYTES, round_size, size_kind
from . import cupy_hook, registry
from .cupy_hook import (CupyAllocatorInstall, CupyRouting, install_cupy_allocator,
                        route_cupy_allocations, uninstall_cupy_allocator)
from .pool import Block, MemoryEvent, MemoryPool
from .raw import CudaRawAllocator, FakeRawAllocator, HostRawAllocator, PinnedRawAllocator
from .registry import (empty_cache, export_snapshot, get_pool, memory_report,
                       memory_stats, reset_peak_memory_stats, set_memory_limit)
from .snapshot import pool_snapshot
from .stats import MemoryStats
from .tags import TAGS, current_tag, packed_scope, tag_scope

__all__ = [
    "TAGS", "current_tag", "tag_scope", "packed_scope", "Block", "MemoryPool", "MemoryEvent", "MemoryStats",
    "get_pool", "memory_stats", "memory_report", "reset_peak_memory_stats", "empty_cache",
    "set_memory_limit", "export_snapshot", "pool_snapshot", "install_cupy_allocator",
    "uninstall_cupy_allocator", "route_cupy_allocations", "CupyAllocatorInstall", "CupyRouting",
    "OutOfMemoryError", "HostRawAllocator", "CudaRawAllocator", "PinnedRawAllocator",
    "FakeRawAllocator", "ALIGNMENT", "SMALL_REQUEST_MAX", "SMALL_SEGMENT_BYTES", "round_size",
    "size_kind",
    "_reset_pools_for_tests",
]


def _reset_pools_for_tests() -> None:
    """Tests only: remove every CuPy install and routing, then forget every process pool
    (returning their cached segments) and every limit default. Live blocks keep their pool."""
    cupy_hook._reset_for_tests()
    registry._reset_for_tests()
