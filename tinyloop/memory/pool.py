"""``MemoryPool``: the arena (offset arithmetic) wrapped with a raw allocator, tags, statistics,
a budget, an event log and a lock. ``Block`` (``block.py``) is what ``allocate`` returns.

The layering follows RMM's resource adaptors: ``arena.Arena`` only splits and merges integer
ranges; ``budget`` says what a limit is and builds the out-of-memory error; ``events`` holds the
event log; this module decides when to ask the raw allocator for a segment, when to give one
back, and keeps the counters, all under one lock. The counters stay here, in the pool's own
fields: they are updated on every allocation, and a separate object would add an attribute
load per update to the hot path.

Streams: the pool hands a freed block to the next request at once, which is safe because every
TinyLoop kernel and every CuPy operation runs on one stream per device (the current stream),
the model's forward synchronises before a request's caches are freed, and cudaFree synchronises
the device before a segment goes back.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
import time

from ..errors import ConfigError
from .arena import Arena, round_size, segment_size, size_kind
from .block import Block
from .budget import (check_limit, crosses, out_of_memory, plan_out_of_memory,
                     plan_room)
from .events import DEFAULT_EVENT_CAPACITY, EventLog, MemoryEvent, events_logged
from .stats import MemoryStats, fmt_bytes
from .tags import TAGS, check_tag, current_tag, packed

_TAG_SET = frozenset(TAGS)
_now = time.time

__all__ = ["MemoryPool", "Block", "MemoryEvent", "DEFAULT_EVENT_CAPACITY"]


class MemoryPool:
    """A caching pool over one device's raw allocator. Thread-safe.

    ``MemoryPool("host")`` / ``MemoryPool("cuda")`` build their raw allocator;
    ``MemoryPool(raw_allocator=FakeRawAllocator())`` gives tests an isolated pool. The
    process-wide pools come from ``tinyloop.memory.get_pool``.
    """

    def __init__(self, device: str | None = None, *, raw_allocator=None,
                 limit_bytes: int | None = None, event_capacity: int = DEFAULT_EVENT_CAPACITY):
        if raw_allocator is None:
            if device in (None, "host"):
                from .raw import HostRawAllocator
                raw_allocator = HostRawAllocator()
            elif device == "cuda":
                from .raw import CudaRawAllocator
                raw_allocator = CudaRawAllocator()
            elif device == "pinned":
                from .raw import PinnedRawAllocator
                raw_allocator = PinnedRawAllocator()
            else:
                raise ConfigError(f"unknown device {device!r}; expected 'host', 'cuda' or "
                                  "'pinned'")
        self._raw = raw_allocator
        self.device = device if device is not None else raw_allocator.device
        self.device_index = raw_allocator.device_index

        # _lock guards every field below. Invariants, true whenever _lock is free:
        # - _allocated_bytes == sum of live chunk sizes; _requested_bytes == sum of their
        #   blocks' requested_bytes; _by_tag[t] == sum of live chunk sizes tagged t;
        # - _reserved_bytes == sum of arena segment sizes == _allocated_bytes + free chunk bytes;
        #   every arena segment is one live raw allocation, and every raw allocation the pool
        #   made and did not free is an arena segment;
        # - _peak_* >= the current figure; counters only grow (reset_peak touches peaks only);
        # - _limit_bytes is None or _reserved_bytes only crosses it if it was set below it;
        # - the event log holds the last events_logged(_num_allocs, _num_frees,
        #   _num_segment_allocs, _num_segment_releases, _num_ooms, _num_limit_sets) events:
        #   every _log_event call comes with its counter step (see events.py).
        self._lock = threading.Lock()
        self._arena = Arena()
        self._allocated_bytes = 0
        self._requested_bytes = 0
        self._reserved_bytes = 0
        self._live_blocks = 0
        self._by_tag = dict.fromkeys(TAGS, 0)
        self._peak_by_tag = dict.fromkeys(TAGS, 0)
        self._peak_allocated_bytes = 0
        self._peak_reserved_bytes = 0
        self._num_allocs = 0
        self._num_frees = 0
        self._num_segment_allocs = 0
        self._num_segment_releases = 0
        self._num_ooms = 0
        self._num_alloc_retries = 0
        self._num_limit_sets = 0
        self._limit_bytes: int | None = None
        self._event_log = EventLog(event_capacity)
        self._log_event = self._event_log.append       # a MemoryEvent's fields (events.py)
        # Frees requested by finalizers (a CuPy temporary dropped by the garbage collector)
        # while _lock was taken, possibly by this very thread: drained under _lock by the next
        # call. deque.append / popleft are atomic, so this needs no lock of its own.
        self._deferred: collections.deque = collections.deque()
        # Device bytes the driver gives this process outside the pool, by what took them
        # (stats.DRIVER_LINES; guarded by _lock): the driver's figure when the raw allocator
        # was made (the CUDA context), then what measure_driver saw each load or first use
        # take beyond the pool's own segments.
        self._driver_bytes: dict[str, int] = {}
        context = getattr(raw_allocator, "context_bytes", None)
        if context is not None:
            self._driver_bytes["cuda context"] = context
        if limit_bytes is not None:
            self.set_limit(limit_bytes)

    # --- allocation -------------------------------------------------------------------------
    def allocate(self, nbytes: int, tag: str | None = None) -> Block:
        """A block of at least ``nbytes`` bytes (rounded up to 512) tagged ``tag``.

        ``tag=None`` takes ``current_tag()``. Where the block comes from (the rule
        ``_make_room`` implements): the best-fit free range of the request's size class; else a
        new segment; else the best-fit free range of the other class. So a request is served
        whenever one free range of the pool holds it, or a new segment of its size fits in the
        limit once every fully free segment is returned (and the device grants it). Raises
        ``tinyloop.OutOfMemoryError`` otherwise, naming the largest free range and why no
        segment could be added; ConfigError for an unknown tag, ValueError for nbytes < 0.
        """
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if tag is None:
            tag = current_tag()
        elif tag not in _TAG_SET:
            check_tag(tag)                                  # raises ConfigError
        rounded = round_size(nbytes)
        kind = "large" if packed() else size_kind(rounded)
        with self._lock:
            if self._deferred:
                self._drain_deferred()
            chunk = self._arena.take(rounded, kind)
            if chunk is None:
                reasons: list = []
                room = self._make_room(rounded, kind, tag, reasons)
                if room is None:
                    raise self._oom_locked(nbytes, rounded, 1, 0, tag, kind, reasons)
                chunk = self._arena.take(rounded, *room)
                assert chunk is not None, "the room made must fit the request"
            blk = Block(self, chunk, nbytes, tag)
            chunk.owner = blk
            self._allocated_bytes += rounded
            self._requested_bytes += nbytes
            self._live_blocks += 1
            self._num_allocs += 1
            by_tag = self._by_tag[tag] + rounded
            self._by_tag[tag] = by_tag
            if self._allocated_bytes > self._peak_allocated_bytes:
                self._peak_allocated_bytes = self._allocated_bytes
            if by_tag > self._peak_by_tag[tag]:
                self._peak_by_tag[tag] = by_tag
            self._log_event((_now(), "alloc", chunk.ptr, rounded, tag, kind))
        return blk

    def allocate_many(self, nbytes: int, n: int, tag: str | None = None) -> list[Block]:
        """``n`` blocks of ``nbytes`` each, all or nothing: what ``n`` calls of
        :meth:`allocate` would return (same addresses, sizes, tag, counters, peaks and one
        ``alloc`` event per block, in the same order), made under one lock hold.

        The size-class lookup, the tag check and the statistics update run once per batch;
        the arena carves each best-fit free chunk into a run of blocks at once
        (``Arena.take_run``); a segment is added whenever the class runs out, exactly as the
        one-by-one path would add it. The blocks come back in allocation order, so
        address-contiguous runs are neighbours in the list (``block.contiguous_runs``).
        Raises ``tinyloop.OutOfMemoryError`` when not all ``n`` fit: the blocks carved so far
        are given back first (nothing stays allocated, no ``alloc`` event is logged; segments
        added for the batch stay cached, as after any failed allocation), and the error names
        the batch (``n`` blocks, the total bytes, how many fitted) with the pool's figures as
        they are after that give-back. ConfigError for an unknown tag, ValueError for
        nbytes < 0 or n < 0.
        """
        nbytes = operator.index(nbytes)
        n = operator.index(n)
        if nbytes < 0 or n < 0:
            raise ValueError(f"cannot allocate {n} blocks of {nbytes} bytes")
        if tag is None:
            tag = current_tag()
        elif tag not in _TAG_SET:
            check_tag(tag)                                  # raises ConfigError
        if n == 0:
            return []
        rounded = round_size(nbytes)
        kind = "large" if packed() else size_kind(rounded)
        arena = self._arena
        with self._lock:
            if self._deferred:
                self._drain_deferred()
            # The events of added segments are staged, then logged in the order the one-by-one
            # path logs them (each segment_alloc before the allocs carved from it); on a
            # failure only they (and the oom) are logged, no alloc of a block given back.
            log = self._log_event
            staged: list = []
            marks = []                  # (events staged, chunks carved) after each carve
            self._log_event = staged.append
            chunks: list = []
            reasons: list = []
            try:
                chunks = arena.take_run(rounded, n, kind)
                marks.append((0, len(chunks)))
                while len(chunks) < n:
                    # what the one-by-one path does for its next block: its class's free
                    # ranges (empty by now, unless room was made there), else make room
                    room = self._make_room(rounded, kind, tag, reasons)
                    if room is None:
                        break
                    more = arena.take_run(rounded, n - len(chunks), *room, one_range=True)
                    assert more, "the room made must fit the request"
                    chunks += more
                    more = arena.take_run(rounded, n - len(chunks), kind)
                    chunks += more
                    marks.append((len(staged), len(chunks)))
            except BaseException:
                for c in reversed(chunks):
                    arena.give_back(c)
                for e in staged:
                    log(e)
                raise
            finally:
                self._log_event = log
            if len(chunks) < n:
                fitted = len(chunks)
                for c in reversed(chunks):
                    arena.give_back(c)
                for e in staged:
                    log(e)
                raise self._oom_locked(nbytes, rounded, n, fitted, tag, kind, reasons)
            now, pool = _now(), self
            blocks = []
            append = blocks.append
            e0 = c0 = 0
            for ne, nc in marks:
                for e in staged[e0:ne]:
                    log(e)
                for c in chunks[c0:nc]:
                    blk = Block(pool, c, nbytes, tag)
                    c.owner = blk
                    append(blk)
                    log((now, "alloc", c.ptr, rounded, tag, kind))
                e0, c0 = ne, nc
            total = rounded * n
            self._allocated_bytes += total
            self._requested_bytes += nbytes * n
            self._live_blocks += n
            self._num_allocs += n
            by_tag = self._by_tag[tag] + total
            self._by_tag[tag] = by_tag
            if self._allocated_bytes > self._peak_allocated_bytes:
                self._peak_allocated_bytes = self._allocated_bytes
            if by_tag > self._peak_by_tag[tag]:
                self._peak_by_tag[tag] = by_tag
        return blocks

    def free_many(self, blocks) -> None:
        """Return every block of ``blocks`` to the pool under one lock hold (what ``free`` of
        each would do, in order). Raises ValueError, before freeing anything, for a block of
        another pool, an already freed block or a block listed twice."""
        blocks = list(blocks)
        for blk in blocks:
            if not isinstance(blk, Block) or blk.pool is not self:
                raise ValueError(f"{blk!r} does not belong to this {self.device} pool")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("free_many: a block is listed twice")
        with self._lock:
            if self._deferred:
                self._drain_deferred()
            for blk in blocks:
                if blk.freed:
                    raise ValueError(f"double free of {blk!r}")
            # neighbours in list order (a slot's pages, a batch in allocation order) go back
            # to the arena as one run: the same end state and events as one free each
            log, arena, i, n = self._log_event, self._arena, 0, len(blocks)
            while i < n:
                chunk = blocks[i].chunk
                run = [chunk]
                j = i + 1
                while j < n and blocks[j].chunk is not None \
                        and blocks[j].chunk.prev is run[-1]:
                    run.append(blocks[j].chunk)
                    j += 1
                if len(run) == 1:
                    self._free_locked(blocks[i])
                else:
                    freed = requested = 0
                    arena.give_back_run(run)
                    by_tag = self._by_tag
                    for blk in blocks[i:j]:
                        ptr, nb, tag = blk.ptr, blk.nbytes, blk.tag
                        t = _now()              # one clock read: the free is synchronous
                        log((t, "free_requested", ptr, nb, tag))
                        blk.freed = True
                        blk.chunk = None
                        freed += nb
                        requested += blk.requested_bytes
                        by_tag[tag] -= nb
                        log((t, "free_completed", ptr, nb, tag))
                    self._requested_bytes -= requested
                    self._allocated_bytes -= freed
                    self._live_blocks -= j - i
                    self._num_frees += j - i
                i = j

    def reserve(self, nbytes: int, tag: str | None = None, exact: bool = False) -> bool:
        """Make sure one free "large" chunk of at least ``nbytes`` (rounded to 512) exists,
        adding one segment if not (rounded up to 2 MiB, or of exactly the request when that
        crosses the limit or the device refuses it, or always with ``exact``; every fully
        free segment is returned first when that can make room): a load that knows its total
        asks for it once, so its tensors (allocated inside ``packed_scope``) share one segment
        and leave one rounding tail instead of one per tensor. Best effort: returns False
        (nothing raised, no out-of-memory counted or logged) when no such segment can be had,
        so the caller's own allocations then fit or raise naming their own tags; True
        otherwise."""
        rounded = round_size(operator.index(nbytes))
        tag = current_tag() if tag is None else check_tag(tag)
        with self._lock:
            if self._deferred:
                self._drain_deferred()
            if self._arena.largest_free_of("large") >= rounded:
                return True
            return self._grow_locked(rounded, "large", tag, [], exact)

    def check_room(self, phases, what: str) -> None:
        """Raise OutOfMemoryError before anything is allocated when ``phases`` (``(label,
        tag, nbytes)`` in allocation order, nbytes as the pool rounds them) cannot fit however
        they are packed: their total is above the limit minus the live blocks (and, on CUDA,
        above the driver's free bytes plus the pool's own free bytes; ``budget.plan_room``).
        The error names ``what`` (e.g. "loading model.tlm"), each phase's bytes, the room and
        the phase that does not fit; it is counted and logged as an out-of-memory."""
        phases = list(phases)
        total = sum(b for _, _, b in phases)
        with self._lock:
            if self._deferred:
                self._drain_deferred()
            device_free = self._raw.mem_info()[0]
            room = plan_room(allocated_bytes=self._allocated_bytes,
                             reserved_bytes=self._reserved_bytes, limit_bytes=self._limit_bytes,
                             device=self.device, device_free_bytes=device_free)
            if room is None or total <= room:
                return
            err = plan_out_of_memory(self.device, what, phases, room,
                                     allocated_bytes=self._allocated_bytes,
                                     reserved_bytes=self._reserved_bytes,
                                     limit_bytes=self._limit_bytes,
                                     device_free_bytes=device_free)
            self._num_ooms += 1
            self._log_event((_now(), "oom", 0, total, err.tag, None, "check_room", None))
        raise err

    def _add_segment(self, size: int, kind: str, tag: str, reasons: list, cause: str,
                     request: int) -> bool:
        """Add one ``size``-byte segment of class ``kind`` from the raw allocator for the
        ``request``-byte (rounded) request of ``tag`` made by ``cause`` (events.CAUSES), or
        append why not to ``reasons`` and return False. Holds _lock."""
        if crosses(self._limit_bytes, self._reserved_bytes, size):
            reasons.append(f"a new {fmt_bytes(size)} segment would take reserved bytes to "
                           f"{self._reserved_bytes + size}, past the {self._limit_bytes}-byte "
                           f"limit")
            return False
        try:
            ptr, handle = self._raw.malloc(size)
        except MemoryError as e:                    # the device (or host) is full
            reasons.append(f"the raw allocator refused a {fmt_bytes(size)} segment ({e})")
            return False
        self._arena.add_segment(ptr, size, kind, handle)
        self._reserved_bytes += size
        self._num_segment_allocs += 1
        self._peak_reserved_bytes = max(self._peak_reserved_bytes, self._reserved_bytes)
        self._log_event((_now(), "segment_alloc", ptr, size, tag, kind, cause, request))
        return True

    def _release_could_help(self, rounded: int) -> bool:
        """Whether returning the fully free segments may let a ``rounded``-byte segment in:
        there are some, and the limit (if any) has room for it once they are gone (the device
        may still refuse). Holds _lock."""
        free_seg = self._arena.free_segment_bytes()
        return free_seg > 0 and not crosses(self._limit_bytes, self._reserved_bytes - free_seg,
                                            rounded)

    def _grow_locked(self, rounded: int, kind: str, tag: str, reasons: list,
                     exact: bool = False) -> bool:
        """Add a segment of class ``kind`` that fits ``rounded`` bytes: the class's segment
        size, else (or only, with ``exact``) exactly ``rounded``; if none can be had, return
        every fully free segment (when that can make room) and try once more. False, with
        the refusals in ``reasons``, when no segment can be had. Holds _lock."""
        sizes = [rounded] if exact else [segment_size(rounded)]
        if rounded < sizes[0]:
            sizes.append(rounded)
        cause = "reserve_exact" if exact else "reserve"
        if any(self._add_segment(size, kind, tag, reasons, cause, rounded) for size in sizes):
            return True
        if not self._release_could_help(rounded):
            return False
        released = self._release_free_segments(tag, cause, rounded)
        self._num_alloc_retries += 1
        reasons.append(f"then {fmt_bytes(released)} of cached free segments went back")
        return any(self._add_segment(size, kind, tag, reasons, cause, rounded) for size in sizes)

    def _make_room(self, rounded: int, kind: str, tag: str, reasons: list):
        """Where a ``rounded``-byte block of class ``kind`` comes from when that class has no
        free range that fits: ``(class, partly_used_only)`` to take it from, or None, with
        every refusal appended to ``reasons``. Holds _lock. In order:

        1. a new segment of the class's size (the classes stay apart while the pool grows);
        2. a free range of the other class in a segment that already holds live blocks (those
           bytes are pinned anyway, so using them costs no new segment);
        3. a new segment of exactly ``rounded`` bytes (the class's size did not fit);
        4. every fully free segment returned (when that can make room), then 1 and 3 again;
        5. any free range of the other class (a fully free segment that was kept because
           returning it could not make room under the limit).
        """
        other = "small" if kind == "large" else "large"
        arena = self._arena
        seg_size = segment_size(rounded)
        if self._add_segment(seg_size, kind, tag, reasons, "allocate", rounded):
            return kind, False
        if arena.fits(rounded, other, partly_used_only=True):
            return other, True
        if rounded < seg_size and self._add_segment(rounded, kind, tag, reasons, "allocate",
                                                    rounded):
            return kind, False
        if self._release_could_help(rounded):
            released = self._release_free_segments(tag, "allocate", rounded)
            self._num_alloc_retries += 1
            reasons.append(f"then {fmt_bytes(released)} of cached free segments went back")
            if self._add_segment(seg_size, kind, tag, reasons, "allocate", rounded):
                return kind, False
            if rounded < seg_size and self._add_segment(rounded, kind, tag, reasons,
                                                        "allocate", rounded):
                return kind, False
        if arena.fits(rounded, other):
            return other, False
        return None

    def _oom_locked(self, nbytes: int, rounded: int, n: int, fitted: int, tag: str, kind: str,
                    reasons: list):
        """Count and log an out-of-memory and build its error: ``n`` blocks of ``nbytes``
        (``rounded`` in the pool, size class ``kind``) were asked for and ``fitted`` of them had
        been carved (and given back) when no room was left. Holds _lock; the figures are the
        pool's now."""
        self._num_ooms += 1
        self._log_event((_now(), "oom", 0, rounded * n, tag, kind, "allocate", rounded))
        return out_of_memory(self.device, nbytes, rounded, tag, reasons, n=n, fitted=fitted,
                             allocated_bytes=self._allocated_bytes,
                             reserved_bytes=self._reserved_bytes,
                             limit_bytes=self._limit_bytes,
                             device_free_bytes=self._raw.mem_info()[0],
                             largest_free_bytes=self._arena.largest_free(),
                             free_segment_bytes=self._arena.free_segment_bytes(),
                             by_tag=self._by_tag)

    # --- free -------------------------------------------------------------------------------
    def free(self, blk: Block) -> None:
        """Return ``blk`` to the pool (its segment stays cached). Raises ValueError on a double
        free or a block of another pool."""
        if not isinstance(blk, Block) or blk.pool is not self:
            raise ValueError(f"{blk!r} does not belong to this {self.device} pool")
        with self._lock:
            if self._deferred:
                self._drain_deferred()
            self._free_locked(blk)

    def _free_locked(self, blk: Block) -> None:
        if blk.freed:
            raise ValueError(f"double free of {blk!r}")
        chunk = blk.chunk
        log = self._log_event
        log((_now(), "free_requested", blk.ptr, blk.nbytes, blk.tag))
        self._arena.give_back(chunk)
        blk.freed = True
        blk.chunk = None
        self._allocated_bytes -= blk.nbytes
        self._requested_bytes -= blk.requested_bytes
        self._by_tag[blk.tag] -= blk.nbytes
        self._live_blocks -= 1
        self._num_frees += 1
        log((_now(), "free_completed", blk.ptr, blk.nbytes, blk.tag))

    def retag(self, blk: Block, tag: str) -> None:
        """Move ``blk``'s bytes to ``tag`` (e.g. a KV page a prefix cache now shares goes from
        ``kv_cache`` to ``prefix_cache``): the by-tag figures follow what the block is for
        now. Raises ValueError for a freed block or one of another pool, ConfigError for an
        unknown tag."""
        if not isinstance(blk, Block) or blk.pool is not self:
            raise ValueError(f"{blk!r} does not belong to this {self.device} pool")
        if tag not in _TAG_SET:
            check_tag(tag)                                  # raises ConfigError
        with self._lock:
            if blk.freed:
                raise ValueError(f"cannot retag {blk!r}: it was freed")
            if blk.tag == tag:
                return
            self._by_tag[blk.tag] -= blk.nbytes
            by_tag = self._by_tag[tag] + blk.nbytes
            self._by_tag[tag] = by_tag
            if by_tag > self._peak_by_tag[tag]:
                self._peak_by_tag[tag] = by_tag
            blk.tag = tag          # no event: the trace's alloc/free pairs stay as they were

    @property
    def raw(self):
        """The raw allocator the pool's segments come from (``memory.raw``): views of a
        block's bytes and the device's figures go through it."""
        return self._raw

    def free_from_finalizer(self, blk: Block) -> None:
        """Free ``blk`` from a finalizer, which may run while this thread holds _lock."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain_deferred()
                if not blk.freed:
                    self._free_locked(blk)
            finally:
                self._lock.release()
        else:
            self._deferred.append(blk)

    def _drain_deferred(self) -> None:
        while self._deferred:
            blk = self._deferred.popleft()
            if not blk.freed:
                self._free_locked(blk)

    # --- cache and budget -------------------------------------------------------------------
    def _release_free_segments(self, tag: str | None, cause: str,
                               request: int | None = None) -> int:
        """Return every fully free segment to the raw allocator for ``cause`` (events.CAUSES;
        ``tag`` and ``request``: the request that needs the room, if any); bytes released.
        Holds _lock."""
        released = 0
        for seg in self._arena.free_segments():
            self._raw.free(seg.ptr, seg.handle)      # first: if it raises, the arena is intact
            self._arena.remove_segment(seg)
            seg.handle = None       # the host pool's buffer goes now, not at the next gc
            self._reserved_bytes -= seg.size
            self._num_segment_releases += 1
            released += seg.size
            self._log_event((_now(), "segment_free", seg.ptr, seg.size, tag, seg.kind, cause,
                             request))
        return released

    def empty_cache(self) -> int:
        """Return every fully free segment to the driver; live blocks are never touched.
        Returns the bytes released (reserved_bytes drops by that much)."""
        with self._lock:
            self._drain_deferred()
            return self._release_free_segments(None, "empty_cache")

    @property
    def limit_bytes(self) -> int | None:
        return self._limit_bytes

    def set_limit(self, limit, *, return_free: bool = True) -> None:
        """Cap reserved_bytes at ``limit`` (bytes; a "2G" / "50%" string; or None for none).

        The limit is rounded up to whole 512-byte blocks (``budget.check_limit``;
        ``limit_bytes`` reports the rounded value), so one request of exactly the limit fits an
        empty pool. A limit below what is reserved now first returns the cached free segments
        (``return_free=False`` keeps them: the state a pool reaches when blocks are freed under
        such a limit, which ``diagnostics.replay`` rebuilds); live blocks stay, and later
        allocations that need a new segment fail until enough is freed. Logs a ``limit`` event.
        """
        total = self._raw.mem_info()[1] if isinstance(limit, str) else None
        limit = check_limit(limit, total)
        with self._lock:
            self._limit_bytes = limit
            self._num_limit_sets += 1
            self._log_event((_now(), "limit", 0, limit, None, None, "set_limit", None))
            if return_free and limit is not None and self._reserved_bytes > limit:
                self._release_free_segments(None, "set_limit")

    # --- the driver's bytes outside the pool -----------------------------------------------
    @contextlib.contextmanager
    def measure_driver(self, label: str):
        """Attribute to ``label`` (one of ``stats.DRIVER_LINES``: "kernel modules", "cublas
        workspace", "cuda graphs") the device bytes the driver gives this process while the
        block runs beyond what the pool reserved meanwhile: NVML's process figure after minus
        before, minus the change in reserved_bytes. Negative when the block gave bytes back
        (a graph destroyed). Records nothing where the raw allocator has no such figure. Not
        for blocks that overlap on two threads (each would count the other's bytes)."""
        before = self._raw.nvml_process_bytes()
        reserved = self._reserved_bytes
        try:
            yield
        finally:
            after = self._raw.nvml_process_bytes()
            if before is not None and after is not None:
                delta = (after - before) - (self._reserved_bytes - reserved)
                with self._lock:
                    self._driver_bytes[label] = self._driver_bytes.get(label, 0) + delta

    def driver_bytes(self) -> dict:
        """label -> device bytes attributed outside the pool (each at least 0)."""
        with self._lock:
            return {k: max(0, v) for k, v in self._driver_bytes.items()}

    # --- statistics -------------------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    def by_tag(self) -> dict:
        """tag -> bytes of live blocks (tags with no live block included, as 0)."""
        with self._lock:
            return dict(self._by_tag)

    def reset_peak_stats(self) -> None:
        """Set every peak to its current figure."""
        with self._lock:
            self._peak_allocated_bytes = self._allocated_bytes
            self._peak_reserved_bytes = self._reserved_bytes
            self._peak_by_tag = dict(self._by_tag)

    def stats(self) -> MemoryStats:
        """A ``MemoryStats`` of this pool now (driver figures are queried after the lock)."""
        with self._lock:
            self._drain_deferred()
            pool_free = self._reserved_bytes - self._allocated_bytes
            largest = self._arena.largest_free()
            fields = dict(
                device=self.device, device_index=self.device_index,
                allocated_bytes=self._allocated_bytes, requested_bytes=self._requested_bytes,
                reserved_bytes=self._reserved_bytes, pool_free_bytes=pool_free,
                limit_bytes=self._limit_bytes,
                by_tag=dict(self._by_tag), peak_by_tag=dict(self._peak_by_tag),
                peak_allocated_bytes=self._peak_allocated_bytes,
                peak_reserved_bytes=self._peak_reserved_bytes,
                num_allocs=self._num_allocs, num_frees=self._num_frees,
                num_segment_allocs=self._num_segment_allocs,
                num_segment_releases=self._num_segment_releases,
                num_ooms=self._num_ooms, num_alloc_retries=self._num_alloc_retries,
                active_blocks=self._live_blocks, segments=len(self._arena.segments),
                largest_free_block_bytes=largest,
                external_fragmentation=(1.0 - largest / pool_free) if pool_free else 0.0,
                driver_bytes={k: max(0, v) for k, v in self._driver_bytes.items()})
        device_free, device_total = self._raw.mem_info()
        return MemoryStats(device_free_bytes=device_free, device_total_bytes=device_total,
                           process_bytes=self._raw.process_bytes(),
                           nvml_process_bytes=self._raw.nvml_process_bytes(), **fields)

    # --- introspection: event log and layout ------------------------------------------------
    def events(self) -> list[MemoryEvent]:
        """The event log, oldest first (a ring buffer: at most ``event_capacity`` entries)."""
        with self._lock:
            return self._event_log.events()

    @property
    def events_dropped(self) -> int:
        """Events pushed out of the ring buffer since the pool was made."""
        with self._lock:
            return events_logged(self._num_allocs, self._num_frees, self._num_segment_allocs,
                                 self._num_segment_releases, self._num_ooms,
                                 self._num_limit_sets) - len(self._event_log)

    def layout(self) -> list[dict]:
        """Every segment in address order, with the blocks that tile it::

            [{"address", "size", "kind", "blocks": [{"address", "size", "live",
              "requested_bytes", "tag"}]}]   # free ranges have live=False, tag None
        """
        with self._lock:
            self._drain_deferred()
            return self._arena.layout()

    def _check(self) -> None:
        """Assert the arena's and the counters' invariants (for tests; O(blocks))."""
        with self._lock:
            self._arena.check()
            live = [c for s in self._arena.segments.values() for c in s.chunks() if not c.free]
            assert self._allocated_bytes == sum(c.size for c in live)
            assert self._requested_bytes == sum(c.owner.requested_bytes for c in live)
            assert self._live_blocks == len(live)
            assert self._reserved_bytes == sum(s.size for s in self._arena.segments.values())
            assert self._reserved_bytes == self._allocated_bytes + self._arena.free_bytes()
            for t in TAGS:
                assert self._by_tag[t] == sum(c.size for c in live if c.owner.tag == t), t
                assert self._peak_by_tag[t] >= self._by_tag[t]
            assert self._peak_allocated_bytes >= self._allocated_bytes
            assert self._peak_reserved_bytes >= self._reserved_bytes

    def __repr__(self):
        return (f"MemoryPool({self.device}, allocated={fmt_bytes(self._allocated_bytes)}, "
                f"reserved={fmt_bytes(self._reserved_bytes)})")
