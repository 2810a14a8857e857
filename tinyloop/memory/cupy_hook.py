"""Route CuPy's own allocations (temporaries of cupy operations) through the cuda pool.

``install_cupy_allocator()`` makes ``cupy.cuda.set_allocator`` point at a function that takes a
block from the pool under tag "cupy" and wraps it in a ``MemoryPointer`` whose owner frees the
block when CuPy drops the memory; ``uninstall_cupy_allocator()`` restores the allocator that was
there before. Installs nest (a stack); the value returned by ``install`` is also a context
manager that uninstalls on exit::

    with install_cupy_allocator():
        y = cupy.exp(x)            # y's buffer is a pool block tagged "cupy"
"""

from __future__ import annotations

import threading

from ..errors import BackendUnavailableError
from .tags import check_tag

_lock = threading.Lock()
_stack: list = []          # guarded by _lock: (our allocator, the allocator it replaced, the
                           # cupy module), in install order


class _BlockOwner:
    """Kept alive by CuPy's ``UnownedMemory``; frees the block when CuPy lets go of it."""

    __slots__ = ("blk",)

    def __init__(self, blk):
        self.blk = blk

    def __del__(self):
        # May run inside the garbage collector while this thread holds the pool's lock:
        # the pool defers the free in that case.
        self.blk.pool._free_from_finalizer(self.blk)


class CupyAllocatorInstall:
    """Returned by ``install_cupy_allocator``; ``with`` it to uninstall on exit."""

    def __init__(self, pool, tag):
        self.pool = pool
        self.tag = tag

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        uninstall_cupy_allocator()


def install_cupy_allocator(pool=None, tag: str = "cupy") -> CupyAllocatorInstall:
    """Send CuPy's allocations to ``pool`` (default: the process's cuda pool) under ``tag``.

    Raises BackendUnavailableError without CuPy, ConfigError for an unknown tag.
    """
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailableError(f"install_cupy_allocator needs CuPy: {e}") from None

    from .registry import get_pool
    check_tag(tag)
    pool = get_pool("cuda") if pool is None else pool
    device_index = pool.device_index

    def allocate(nbytes: int):
        blk = pool.allocate(nbytes, tag)
        mem = cupy.cuda.UnownedMemory(blk.ptr, blk.nbytes, _BlockOwner(blk), device_index)
        return cupy.cuda.MemoryPointer(mem, 0)

    with _lock:
        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(allocate)
        _stack.append((allocate, previous, cupy))
    return CupyAllocatorInstall(pool, tag)


def uninstall_cupy_allocator() -> bool:
    """Restore the allocator the latest install replaced; False if none is installed.

    Blocks CuPy still holds stay live and return to the pool when CuPy drops them. Imports
    nothing (the entry keeps the cupy module), so it is safe while the interpreter shuts down.
    """
    with _lock:
        if not _stack:
            return False
        _, previous, cupy = _stack.pop()
        cupy.cuda.set_allocator(previous)
        return True


def cupy_allocator_installed() -> bool:
    with _lock:
        return bool(_stack)
