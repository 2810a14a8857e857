"""One pool per device, created on demand, and the module-level functions that pick a pool.

``device=None`` in ``memory_stats`` / ``memory_report`` / ``export_snapshot`` means the cuda pool
if one was created, else the host pool. In ``empty_cache`` / ``reset_peak_memory_stats`` it means
every pool that exists; in ``set_memory_limit`` every pool that exists and every pool created
later (overriding ``TINYLOOP_MEMORY_LIMIT``).
"""

from __future__ import annotations

import threading

from ..config import memory_limit_from_env
from ..errors import ConfigError
from .pool import MemoryPool
from .snapshot import write_snapshot
from .stats import MemoryStats

DEVICES = ("host", "cuda", "pinned")
_UNSET = object()

_lock = threading.Lock()
_pools: dict[str, MemoryPool] = {}      # guarded by _lock: at most one pool per device
_default_limit = _UNSET                 # guarded by _lock: set_memory_limit(..., device=None)


def get_pool(device: str = "host") -> MemoryPool:
    """The process's pool for ``device`` ("host" | "cuda" | "pinned": page-locked host memory
    the device can address, for the CUDA backend's mapped results), made on first use.

    A new pool's budget is ``set_memory_limit``'s default if one was given, else
    ``TINYLOOP_MEMORY_LIMIT`` (a percentage is of the device's total memory). Raises
    ConfigError for another device name, BackendUnavailableError for "cuda" or "pinned"
    without CuPy.
    """
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; expected one of {DEVICES}")
    with _lock:
        pool = _pools.get(device)
        if pool is None:
            pool = MemoryPool(device)
            if _default_limit is _UNSET:
                limit = memory_limit_from_env(pool._raw.mem_info()[1])
            else:
                limit = _default_limit
            if limit is not None:
                pool.set_limit(limit)
            _pools[device] = pool
        return pool


def _pool_for(device: str | None) -> MemoryPool:
    if device is None:
        with _lock:
            device = "cuda" if "cuda" in _pools else "host"
    return get_pool(device)


def _pools_for(device: str | None) -> list[MemoryPool]:
    if device is not None:
        return [get_pool(device)]
    with _lock:
        return list(_pools.values())


def memory_stats(device: str | None = None) -> MemoryStats:
    """The ``MemoryStats`` of ``device``'s pool (None: cuda if it exists, else host)."""
    return _pool_for(device).stats()


def memory_report(device: str | None = None) -> str:
    """A readable table of ``memory_stats(device)``, "unattributed" line included."""
    return _pool_for(device).stats().report()


def reset_peak_memory_stats(device: str | None = None) -> None:
    """Set the peak figures (allocated, reserved, per tag) to their current values."""
    for pool in _pools_for(device):
        pool.reset_peak_stats()


def empty_cache(device: str | None = None) -> int:
    """Return every fully free segment to the driver; never touches live blocks.

    Returns the bytes released. Weights and caches stay loaded: this lowers reserved_bytes,
    not allocated_bytes.
    """
    return sum(pool.empty_cache() for pool in _pools_for(device))


def set_memory_limit(limit, device: str | None = None) -> None:
    """Cap the pool's reserved bytes: an int, a string like "2G" or "50%", or None (no cap).

    The cap is rounded up to a multiple of 512 bytes, the pool's block size, so one request
    of exactly the cap fits an empty pool (``MemoryPool.set_limit``).

    An allocation that would cross the cap first returns cached segments and retries, then
    raises ``tinyloop.OutOfMemoryError``. Raises ConfigError on a bad value.
    """
    global _default_limit
    if device is None:
        with _lock:
            _default_limit = limit
            pools = list(_pools.values())
        for pool in pools:
            pool.set_limit(limit)
    else:
        get_pool(device).set_limit(limit)


def export_snapshot(path, device: str | None = None) -> dict:
    """Write the pool's segments and event log for PyTorch's memory viewer (pickle protocol
    4; see ``tinyloop.memory.snapshot``) and return the snapshot dict."""
    return write_snapshot(_pool_for(device), path)


def _reset_for_tests() -> None:
    """Forget every process pool (returning their cached segments) and every limit default.
    Blocks still live keep their old pool."""
    global _default_limit
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
        _default_limit = _UNSET
    for pool in pools:
        pool.empty_cache()
