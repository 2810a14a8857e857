"""What a Model's KV state outlives a call in: the live request caches and prefix handles.

One KVRegistry per Model. Freeing the model releases, in this order, every live prefix handle
(PrefixCache, ResumeHandle, PrefixPool), the storage of handles that were garbage-collected
unreleased, then every RuntimeKVCache a live request still holds (a stream suspended at a
``yield``, or a generator never closed): the handles' release needs their pages still live.
Guarded by the model's lock.
"""

from __future__ import annotations

import weakref


class KVRegistry:
    """The live caches and handles of one Model, and the orphaned handle storage.

    ``track_cache(cache)`` / ``add_handle(h)`` / ``discard_handle(h)`` record them (weakly: a
    dropped object leaves by itself); ``orphan(storage)`` queues the storage of a handle the
    garbage collector finalized unreleased, released at the next :meth:`drain` (each
    ``Model.new_kv_cache``, a handle upgrade or pool clear, :meth:`release_all`), never
    inside the collector's callback (which may run in the middle of any allocation)."""

    def __init__(self):
        self._caches = weakref.WeakSet()
        self._handles = weakref.WeakSet()
        self._orphans: list = []

    def track_cache(self, cache) -> None:
        self._caches.add(cache)

    def add_handle(self, handle) -> None:
        self._handles.add(handle)

    def discard_handle(self, handle) -> None:
        self._handles.discard(handle)

    @property
    def handles(self) -> list:
        """The live handles (PrefixCache, ResumeHandle, PrefixPool)."""
        return list(self._handles)

    def orphan(self, storage) -> None:
        self._orphans.append(storage)

    @property
    def orphans(self) -> int:
        """Orphaned storages not released yet."""
        return len(self._orphans)

    def drain(self) -> None:
        """Release the storage of handles that were garbage-collected unreleased."""
        while self._orphans:
            self._orphans.pop().release()

    def release_all(self) -> None:
        """Release every handle, the orphans, then every live cache (the model is being
        freed)."""
        for h in list(self._handles):
            h.release()
        self.drain()
        for cache in list(self._caches):
            cache.release()
