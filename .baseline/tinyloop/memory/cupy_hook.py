"""Route CuPy's own allocations (temporaries of cupy operations) through a TinyLoop pool.

This module owns every rule about CuPy's allocator:

- ``install_cupy_allocator(pool=None, tag="cupy")`` makes ``cupy.cuda.set_allocator`` point at
  a function that takes a block from ``pool`` under ``tag`` and wraps it in a ``MemoryPointer``
  whose owner frees the block when CuPy drops the memory. It returns a ``CupyAllocatorInstall``
  token; ``token.uninstall()`` (or leaving its ``with``) removes exactly that install, wherever
  it sits among later installs, so one installer can never remove another's::

      with install_cupy_allocator(pool):
          y = cupy.exp(x)            # y's buffer is a pool block tagged "cupy"

- ``route_cupy_allocations(pool)`` is the reference-counted form a CUDA ``Model`` uses: CuPy is
  routed through ``pool`` while at least one holder's ``CupyRouting`` is unreleased, and the
  install is removed when the last one is released.
"""

from __future__ import annotations

import threading

from ..errors import BackendUnavailableError
from .tags import check_tag

# _lock guards _stack and _routes. Invariants while it is free:
# - _stack lists the live installs bottom to top; CuPy's current allocator is
#   _stack[-1].allocate when _stack is non-empty, and each install's ``previous`` is the
#   allocator that was current just below it (the one restored when it is removed);
# - _routes maps id(pool) -> [install, holders] with holders >= 1 and install in _stack.
_lock = threading.Lock()
_stack: list = []
_routes: dict = {}


def _cupy(what: str):
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailableError(f"{what} needs CuPy: {e}") from None
    return cupy


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
    """One install of the pool allocator (the token ``install_cupy_allocator`` returns).

    ``uninstall()`` removes this install only (idempotent; False when already removed);
    ``with`` it to uninstall on exit. ``pool`` and ``tag`` say where CuPy's memory goes.
    """

    def __init__(self, pool, tag: str, allocate, previous, cupy_module):
        self.pool = pool
        self.tag = tag
        self.allocate = allocate      # the function CuPy calls
        self.previous = previous      # the allocator restored when this install is removed
        self._cupy = cupy_module      # kept, so removing imports nothing (see _remove_locked)

    @property
    def installed(self) -> bool:
        with _lock:
            return any(i is self for i in _stack)

    def uninstall(self) -> bool:
        with _lock:
            return _remove_locked(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()


def _install_locked(cupy, pool, tag: str) -> CupyAllocatorInstall:
    device_index = pool.device_index

    def allocate(nbytes: int):
        blk = pool.allocate(nbytes, tag)
        mem = cupy.cuda.UnownedMemory(blk.ptr, blk.nbytes, _BlockOwner(blk), device_index)
        return cupy.cuda.MemoryPointer(mem, 0)

    inst = CupyAllocatorInstall(pool, tag, allocate, cupy.cuda.get_allocator(), cupy)
    cupy.cuda.set_allocator(allocate)
    _stack.append(inst)
    return inst


def _remove_locked(inst: CupyAllocatorInstall) -> bool:
    """Take ``inst`` out of the stack: restore its ``previous`` if it is on top, else hand its
    ``previous`` to the install just above it. False if it is not installed. Imports nothing:
    a CUDA model freed while the interpreter shuts down releases its routing through here."""
    for i, cur in enumerate(_stack):
        if cur is inst:
            break
    else:
        return False
    if i == len(_stack) - 1:
        inst._cupy.cuda.set_allocator(inst.previous)
    else:
        _stack[i + 1].previous = inst.previous
    del _stack[i]
    return True


def install_cupy_allocator(pool=None, tag: str = "cupy") -> CupyAllocatorInstall:
    """Send CuPy's allocations to ``pool`` (default: the process's cuda pool) under ``tag``.

    Returns the install's token. Raises BackendUnavailableError without CuPy, ConfigError for
    an unknown tag.
    """
    cupy = _cupy("install_cupy_allocator")
    check_tag(tag)
    if pool is None:
        from .registry import get_pool
        pool = get_pool("cuda")
    with _lock:
        return _install_locked(cupy, pool, tag)


def uninstall_cupy_allocator(install: CupyAllocatorInstall | None = None) -> bool:
    """Remove ``install`` (default: the latest install); False if it is not installed.

    Blocks CuPy still holds stay live and return to the pool when CuPy drops them.
    """
    with _lock:
        if install is None:
            if not _stack:
                return False
            install = _stack[-1]
        return _remove_locked(install)


def cupy_allocator_installed() -> bool:
    """True while any install is live."""
    with _lock:
        return bool(_stack)


class CupyRouting:
    """One holder's share of ``route_cupy_allocations``; ``release()`` is idempotent."""

    __slots__ = ("pool", "_key")

    def __init__(self, pool, key):
        self.pool = pool
        self._key = key

    @property
    def active(self) -> bool:
        return self._key is not None

    def release(self) -> None:
        with _lock:
            key, self._key = self._key, None
            if key is None:
                return
            route = _routes.get(key)
            if route is None:            # dropped by _reset_for_tests
                return
            route[1] -= 1
            if route[1] == 0:
                del _routes[key]
                _remove_locked(route[0])


def route_cupy_allocations(pool, tag: str = "cupy") -> CupyRouting:
    """Route CuPy's allocations through ``pool`` until every returned ``CupyRouting`` is
    released (the first holder installs the allocator, the last release removes that install
    and nothing else). Raises BackendUnavailableError without CuPy."""
    cupy = _cupy("route_cupy_allocations")
    check_tag(tag)
    with _lock:
        key = (id(pool), tag)
        route = _routes.get(key)
        if route is None:          # (the install holds ``pool``, so its id stays unique)
            route = _routes[key] = [_install_locked(cupy, pool, tag), 0]
        route[1] += 1
        return CupyRouting(pool, key)


def _reset_for_tests() -> None:
    """Remove every install and routing (tests only)."""
    with _lock:
        while _stack:
            _remove_locked(_stack[-1])
        _routes.clear()
