"""The pool's event log: a ring buffer of ``MemoryEvent`` tuples, oldest first.

The pool appends plain tuples (``MemoryEvent``'s fields in order; the trailing ones it leaves
out are None) through ``EventLog.append`` (the ring's own ``deque.append``: nothing else runs
per event) and keeps no event counter of its own: every event comes with exactly one counter
step the pool keeps anyway (alloc: one event per ``num_allocs``; free: two per ``num_frees``;
segment_alloc / segment_free / oom / limit: one per ``num_segment_allocs`` /
``num_segment_releases`` / ``num_ooms`` / limit set), so the total and the number the ring
dropped are derived from those counters.

The log holds every input the pool's placement decides on, so a trace can be repeated exactly
(``diagnostics.replay``): the size class each request asked in and each segment has
(``kind``), why a segment came or went (``cause``, with the ``request`` it served), the limit
(``limit`` events) and a batch's length (an oom's ``size`` over its ``request``). A raw
allocation the device refused logs nothing: the next event shows what the pool did instead.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

DEFAULT_EVENT_CAPACITY = 16384        # ~1.5 MB of tuples; a decode step logs a handful


# why a segment event or an oom was logged: the pool call behind it ("allocate" covers
# allocate_many too: a batch is its blocks' allocations, and only its oom names its length)
CAUSES = ("allocate", "reserve", "reserve_exact", "empty_cache", "set_limit", "check_room")


class MemoryEvent(NamedTuple):
    """One entry of the pool's event log. ``time`` is ``time.time()`` seconds.

    ``action``: alloc | free_requested | free_completed | segment_alloc | segment_free | oom |
    limit. ``size``: bytes: the rounded block size; the segment size for segment events; the
    rounded bytes asked for (a batch's total) for an oom; the new limit for a limit event (None:
    no limit). ``tag``: the block's tag; for segment events and ooms, the tag of the request
    that caused them (None for empty_cache / set_limit). ``kind``: the size class ("small" |
    "large"): the one an alloc or oom request asked in ("large" inside ``packed_scope``; the
    block may sit in a segment of the other class when the pool could not grow), the segment's
    own for segment events; None for frees, limits and ``check_room``'s oom. ``cause``: one of
    :data:`CAUSES` for segment events, ooms and limits, else None. ``request``: the rounded
    bytes per block (a reserve's rounded bytes) of the request behind a segment event or an
    allocation's oom, else None.
    """
    time: float
    action: str
    address: int
    size: int | None
    tag: str | None
    kind: str | None = None
    cause: str | None = None
    request: int | None = None


def events_logged(num_allocs: int, num_frees: int, num_segment_allocs: int,
                  num_segment_releases: int, num_ooms: int, num_limit_sets: int = 0) -> int:
    """Events a pool has logged since it was made, from its counters (see the module doc)."""
    return (num_allocs + 2 * num_frees + num_segment_allocs + num_segment_releases + num_ooms
            + num_limit_sets)


class EventLog:
    """A ring of at most ``capacity`` (>= 1) raw event tuples. Not locked: the pool calls it
    under its own lock."""

    __slots__ = ("capacity", "append", "_ring")

    def __init__(self, capacity: int = DEFAULT_EVENT_CAPACITY):
        self.capacity = max(1, capacity)
        self._ring: collections.deque = collections.deque(maxlen=self.capacity)
        self.append = self._ring.append       # a MemoryEvent's fields as a tuple

    def __len__(self) -> int:
        return len(self._ring)

    def events(self) -> list[MemoryEvent]:
        """The held events as ``MemoryEvent``, oldest first."""
        return [MemoryEvent(*e) for e in self._ring]
