"""The pool's event log: a ring buffer of ``MemoryEvent`` tuples, oldest first.

The pool appends plain tuples ``(time, action, address, size, tag)`` through ``EventLog.append``
(the ring's own ``deque.append``: nothing else runs per event) and keeps no event counter of its
own: every event comes with exactly one counter step the pool keeps anyway (alloc: one event per
``num_allocs``; free: two per ``num_frees``; segment_alloc / segment_free / oom: one per
``num_segment_allocs`` / ``num_segment_releases`` / ``num_ooms``), so the total and the number
the ring dropped are derived from those counters.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

DEFAULT_EVENT_CAPACITY = 16384        # ~1.5 MB of tuples; a decode step logs a handful


class MemoryEvent(NamedTuple):
    """One entry of the pool's event log. ``time`` is ``time.time()`` seconds."""
    time: float
    action: str       # alloc | free_requested | free_completed | segment_alloc | segment_free | oom
    address: int
    size: int         # bytes (the rounded block size; the segment size for segment events)
    tag: str | None   # the block's tag; for segment events, the tag of the request that caused it


def events_logged(num_allocs: int, num_frees: int, num_segment_allocs: int,
                  num_segment_releases: int, num_ooms: int) -> int:
    """Events a pool has logged since it was made, from its counters (see the module doc)."""
    return num_allocs + 2 * num_frees + num_segment_allocs + num_segment_releases + num_ooms


class EventLog:
    """A ring of at most ``capacity`` (>= 1) raw event tuples. Not locked: the pool calls it
    under its own lock."""

    __slots__ = ("capacity", "append", "_ring")

    def __init__(self, capacity: int = DEFAULT_EVENT_CAPACITY):
        self.capacity = max(1, capacity)
        self._ring: collections.deque = collections.deque(maxlen=self.capacity)
        self.append = self._ring.append       # (time, action, address, size, tag)

    def __len__(self) -> int:
        return len(self._ring)

    def events(self) -> list[MemoryEvent]:
        """The held events as ``MemoryEvent``, oldest first."""
        return [MemoryEvent(*e) for e in self._ring]
