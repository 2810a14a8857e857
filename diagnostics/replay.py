"""Replaying a recorded pool trace: TinyLoop's own pool exactly, CuPy's allocators side by side.

:func:`replay_trace` drives the real ``tinyloop.memory.MemoryPool`` -- the class the live run
used, not a model of it -- over :class:`TraceRawAllocator`, a fake raw allocator that hands out
the addresses the live trace recorded, in order. The replay rebuilds the layout the trace
starts from, then repeats every pool call the events show (allocate, a batch that ran out of
memory, free, reserve, empty_cache, set_limit, a plan ``check_room`` refused), and checks after
each one that the replayed pool logged the very events the live pool logged (every field but
the time). So its peaks and its misses *are* the live pool's, and a trace it cannot repeat
raises :class:`ReplayDiverged` naming the first event that differs instead of reporting other
figures.

Nothing is inferred: the pool logs every input its placement decides on (``tinyloop.memory.
events``): the size class a request asked in and a segment has, the call behind each segment
event (an allocation's growth or its retry, a reserve, empty_cache, set_limit) with the request
it served, every limit, and a failed batch's length. What the log cannot hold is the device's
answer to a segment request it refused; the next live event shows it: the raw allocator grants
a segment only where the live pool's next event is that segment and refuses every other
request, as the device (or the limit) did. The bytes a request asked for before rounding are
not replayed (the pool's ``requested_bytes``); nothing the pool decides depends on them.

:func:`replay_policies` adds CuPy's ``MemoryPool`` and ``MemoryAsyncPool`` where CUDA is present.
They replay the alloc / free sequence (:func:`trace_ops`): they have no
size classes or reservations, so ``packed_scope`` and ``reserve()`` mean nothing to them.
"""

from __future__ import annotations

import bisect
import contextlib
import time

from tinyloop.errors import OutOfMemoryError, TinyLoopError
from tinyloop.memory import MemoryEvent, MemoryPool, packed_scope, size_kind
from tinyloop.memory.arena import SMALL_REQUEST_MAX


class ReplayDiverged(TinyLoopError, ValueError):
    """The replayed pool did something the live trace does not show, or the trace lacks what
    the pool logs (names the event)."""


def as_events(events) -> list[MemoryEvent]:
    """``events`` (``MemoryEvent`` or plain tuples of its fields, oldest first) as
    ``MemoryEvent``, the fields a tuple leaves out set to None."""
    return [e if isinstance(e, MemoryEvent) else MemoryEvent(*e) for e in events]


class TraceRawAllocator:
    """A fake raw allocator that hands out the segments a trace recorded.

    While the start layout is rebuilt, :meth:`expect` names the one segment the next malloc
    must make. During the trace, the replay sets ``cursor`` to the first live event of the
    pool call it repeats and ``end`` past its last: ``cursor`` is the next of those events the
    pool has not logged yet. A malloc gets a segment only when that event is a
    ``segment_alloc`` of the size asked for, and raises MemoryError (a refusal) otherwise: the
    live pool either got no segment there (the device or the limit refused it, which logs
    nothing) or got one of another size. A free must be one of the ``segment_free`` events at
    the cursor. ``plan_refused`` makes :meth:`mem_info` report no free device bytes, for a plan
    the live ``check_room`` refused.
    """

    device = "replay"
    device_index = 0

    def __init__(self, events):
        self.events = events
        self.cursor = 0
        self.end = 0
        self.plan_refused = False
        self._expect: tuple[int, int] | None = None

    def expect(self, ptr: int, size: int) -> None:
        self._expect = (ptr, size)

    def malloc(self, nbytes: int):
        if self._expect is not None:
            ptr, size = self._expect
            if nbytes != size:
                raise MemoryError(f"replay: the start layout's segment is {size} bytes")
            self._expect = None
            return ptr, None
        ev = self.events[self.cursor] if self.cursor < self.end else None
        if ev is not None and ev.action == "segment_alloc" and ev.size == nbytes:
            self.cursor += 1
            return ev.address, None
        raise MemoryError(f"replay: the live pool got no {nbytes}-byte segment before event "
                          f"{self.cursor} ({_show(ev)})")

    def free(self, ptr: int, handle) -> None:
        j = self.cursor
        while j < self.end and self.events[j].action == "segment_free":
            if self.events[j].address == ptr:
                ev = self.events[j]
                self.events[j] = self.events[self.cursor]         # keep the run contiguous
                self.events[self.cursor] = ev
                self.cursor += 1
                return
            j += 1
        ev = self.events[self.cursor] if self.cursor < self.end else None
        raise ReplayDiverged(f"replay: the pool returned segment 0x{ptr:x} at event "
                             f"{self.cursor} ({_show(ev)}); the live pool did not")

    def mem_info(self):
        return (0 if self.plan_refused else None), None

    def process_bytes(self):
        return None

    def nvml_process_bytes(self):
        return None

    def array(self, handle, offset, nbytes, shape, dtype, owner):
        raise TypeError("a replayed pool has addresses but no bytes")


def _show(ev) -> str:
    if ev is None:
        return "the end of the trace"
    size = "no limit" if ev.action == "limit" and ev.size is None else f"{ev.size} B"
    extra = ", ".join(f"{k} {v}" for k, v in (("kind", ev.kind), ("cause", ev.cause),
                                               ("request", ev.request)) if v is not None)
    return f"{ev.action} 0x{ev.address:x} {size} tag {ev.tag}" + (f" ({extra})" if extra else "")


class _Replayer:
    """The state of one replay: the pool and the live blocks (address -> Block)."""

    def __init__(self, events):
        self.events = as_events(events)
        self.raw = TraceRawAllocator(list(self.events))
        # one replayed call logs at most a run of segment events and a few more: the ring
        # only needs to hold that much (reading it back stays cheap)
        run = longest = 0
        for e in self.events:
            run = run + 1 if e.action.startswith("segment_") else 0
            longest = max(longest, run)
        # named a cuda pool so that check_room bounds a plan by the driver's free bytes too
        # (the raw allocator reports none where the live check_room refused one)
        self.pool = MemoryPool("cuda", raw_allocator=self.raw,
                               event_capacity=2 * longest + 16)
        self.blocks: dict = {}
        self.misses = 0
        self.ooms = 0

    # --- bookkeeping ----------------------------------------------------------------------
    def _logged(self) -> int:
        return self.pool.events_dropped + len(self.pool.events())

    def _scope(self, rounded: int, kind: str | None, k: int | None):
        """The scope a ``rounded``-byte request of class ``kind`` (event ``k``'s) was made
        in: ``packed_scope`` for a small request in the large class."""
        if kind == "large":
            return packed_scope() if size_kind(rounded) == "small" else contextlib.nullcontext()
        if kind == "small" and size_kind(rounded) == "small":
            return contextlib.nullcontext()
        what = "the start layout's block" if k is None else f"event {k} ({_show(self.events[k])})"
        raise ReplayDiverged(f"replay: {what} records no size class a {rounded}-byte request "
                             f"can have (a trace from a pool that does not log it?)")

    def _allocate(self, rounded: int, tag: str, kind: str, k: int | None):
        with self._scope(rounded, kind, k):
            return self.pool.allocate(rounded, tag=tag)

    def _hold_limit(self, limit: int | None) -> None:
        """Set the replayed pool's limit and keep its fully free segments (the start layout
        keeps its own)."""
        self.pool.set_limit(limit, return_free=False)

    # --- the start layout -----------------------------------------------------------------
    def build_start(self, start: dict) -> None:
        """Rebuild ``start`` (``layout_state``): each segment, in address order, is made by one
        allocation, given back, then tiled in address order with its live blocks and fillers
        for its free ranges (every earlier segment is fully tiled, so each tile lands at the
        next address); the fillers are freed at the end, merging into the start's free
        chunks. Then the start's limit is set.

        A block is asked for in its segment's class, except a large block in a small segment
        (the live pool placed it there when it could not grow): the tiling runs under a limit
        of 0, so such a request takes the segment's free range as the live one did, and no
        segment is ever returned for it."""
        blocks = start.get("blocks", {})
        starts = sorted(blocks)
        fillers = []
        for ptr in sorted(start.get("segments", {})):
            size, kind = start["segments"][ptr]
            self._hold_limit(None)
            self.raw.expect(ptr, size)
            first = min(size, SMALL_REQUEST_MAX) if kind == "small" else size
            self.pool.free(self._allocate(first, "other", kind, None))
            self._hold_limit(0)
            cur, end = ptr, ptr + size
            i = bisect.bisect_left(starts, ptr)
            tiles = []
            while cur < end:
                if i < len(starts) and starts[i] == cur:
                    bsize, tag = blocks[cur]
                    tiles.append((cur, bsize, tag, True))
                    cur += bsize
                    i += 1
                else:
                    nxt = starts[i] if i < len(starts) and starts[i] < end else end
                    gap = nxt - cur
                    step = SMALL_REQUEST_MAX if kind == "small" else gap
                    for off in range(0, gap, step):
                        tiles.append((cur + off, min(step, gap - off), "other", False))
                    cur = nxt
            for addr, bsize, tag, live in tiles:
                b = self._allocate(bsize, tag, "large" if size_kind(bsize) == "large" else kind,
                                   None)
                if b.ptr != addr:
                    raise ReplayDiverged(f"replay: the start layout's block at 0x{addr:x} "
                                         f"landed at 0x{b.ptr:x}")
                if live:
                    self.blocks[addr] = b
                else:
                    fillers.append(b)
        for b in fillers:
            self.pool.free(b)
        # the live pool holds this limit over this layout (set_limit would also return the
        # fully free segments of a layout above it: the live pool did that when the limit
        # came, before these segments became free)
        self._hold_limit(start.get("limit_bytes"))
        self.pool.reset_peak_stats()

    # --- the trace ------------------------------------------------------------------------
    def run(self) -> None:
        """Repeat the trace call by call. A call's events: a free's two; a limit and the
        releases it caused; a run of empty_cache releases; a reserve's releases and segment;
        check_room's oom; an allocation's releases and segments (cause "allocate") up to its
        alloc or oom."""
        ev, n = self.events, len(self.events)
        i = 0
        while i < n:
            e = ev[i]
            if e.action == "free_requested":
                i = self._free(i)
            elif e.action == "limit":
                j = self._releases(i + 1, lambda x: x.cause == "set_limit")
                # the limit event is logged first, without the raw allocator
                i = self._step(i, j, lambda: self.pool.set_limit(e.size), raw_from=i + 1)
            elif e.action == "segment_free" and e.cause == "empty_cache":
                j = self._releases(i, lambda x: x.cause == "empty_cache")
                i = self._step(i, j, self.pool.empty_cache)
            elif e.cause in ("reserve", "reserve_exact"):
                i = self._reserve(i)
            elif e.action == "oom" and e.cause == "check_room":
                i = self._plan_refused(i)
            elif e.action in ("alloc", "oom") or e.cause == "allocate":
                i = self._allocation(i)
            else:
                raise ReplayDiverged(f"replay: event {i} ({_show(e)}) records no cause a "
                                     f"pool call logs it with (a trace from a pool that does "
                                     f"not log its causes?)")

    def _releases(self, j: int, ours) -> int:
        """The end of the run of segment_free events from ``j`` on that ``ours`` claims."""
        ev = self.events
        while j < len(ev) and ev[j].action == "segment_free" and ours(ev[j]):
            j += 1
        return j

    def _reserve(self, i: int) -> int:
        """Repeat the reserve whose first event is ``i``: its releases, then its segment (none
        when it found no room). Two reserves of one request back to back (the first found no
        room) log what one reserve that retried logs, so they are repeated as one."""
        ev, e = self.events, self.events[i]
        if e.request is None:
            raise ReplayDiverged(f"replay: event {i} ({_show(e)}) records no request")

        def ours(x):
            return (x.cause, x.tag, x.request) == (e.cause, e.tag, e.request)
        j = self._releases(i, ours)
        if j < len(ev) and ev[j].action == "segment_alloc" and ours(ev[j]):
            j += 1
        return self._step(i, j, lambda: self.pool.reserve(e.request, e.tag,
                                                          exact=e.cause == "reserve_exact"))

    def _free(self, i: int) -> int:
        ev = self.events
        addr, tag = ev[i].address, ev[i].tag
        blk = self.blocks.pop(addr, None)
        if blk is None:
            raise ReplayDiverged(f"replay: event {i} frees 0x{addr:x}, which the replay does "
                                 f"not hold")
        if blk.tag != tag:                  # the live block was retagged (which logs nothing)
            self.pool.retag(blk, tag)
        return self._step(i, i + 2, lambda: self.pool.free(blk))

    def _allocation(self, i: int) -> int:
        """Repeat the allocation whose first event is ``i``: its releases and segments, then
        its alloc (one block; a batch's blocks are its allocations, one by one) or its oom (a
        block, or a batch of size / request blocks, in the class the event names)."""
        ev, n = self.events, len(self.events)
        k = i
        while k < n and ev[k].action in ("segment_free", "segment_alloc") \
                and ev[k].cause == "allocate":
            k += 1
        if k == n or ev[k].action not in ("alloc", "oom") or ev[k].cause not in (None,
                                                                                 "allocate"):
            raise ReplayDiverged(f"replay: the allocation's events from {i} on end in "
                                 f"{_show(ev[k] if k < n else None)}, not its alloc or oom")
        e = ev[k]
        if e.action == "alloc":
            released = sum(x.size for x in ev[i:k] if x.action == "segment_free")
            grew = any(x.action == "segment_alloc" for x in ev[i:k])
            free_before = self.pool.reserved_bytes - released - self.pool.allocated_bytes
            out = {}

            def do():
                out["b"] = self._allocate(e.size, e.tag, e.kind, k)
            nxt = self._step(i, k + 1, do)
            self.blocks[out["b"].ptr] = out["b"]
            if grew and e.size <= free_before:
                self.misses += 1            # analyze_trace's definition of a miss
            return nxt
        if not e.request or e.size % e.request:
            raise ReplayDiverged(f"replay: event {k} ({_show(e)}) records no request that "
                                 f"its size is a whole number of")
        count = e.size // e.request

        def attempt():
            try:
                with self._scope(e.request, e.kind, k):
                    if count == 1:
                        self.pool.allocate(e.request, e.tag)
                    else:
                        self.pool.allocate_many(e.request, count, e.tag)
            except OutOfMemoryError:
                return
            raise ReplayDiverged(f"replay: event {k} is an out-of-memory the replay did not "
                                 f"hit ({count} blocks of {e.request} B fitted)")
        self.ooms += 1
        return self._step(i, k + 1, attempt)

    def _plan_refused(self, k: int) -> int:
        """Repeat a plan ``check_room`` refused (event ``k``): one phase of the event's bytes
        and tag. The live refusal came from the limit or the driver's free bytes, which the
        trace does not record; with the raw allocator reporting none free, the replayed pool
        refuses whenever the live one did (its room is at most the live one's)."""
        e = self.events[k]

        def attempt():
            self.raw.plan_refused = True
            try:
                self.pool.check_room([("plan", e.tag, e.size)], "the replayed plan")
            except OutOfMemoryError:
                return
            finally:
                self.raw.plan_refused = False
            raise ReplayDiverged(f"replay: event {k} is a refused plan the replay admitted")
        self.ooms += 1
        return self._step(k, k + 1, attempt)

    def _step(self, i: int, j: int, call, raw_from: int | None = None) -> int:
        """Run ``call`` with the raw allocator's cursor at ``raw_from`` (default ``i``) and end
        at ``j``; check that the pool logged exactly live events ``i..j-1`` (a run of
        segment_free in any order); return ``j``."""
        before = self._logged()
        self.raw.cursor, self.raw.end = (i if raw_from is None else raw_from), j
        try:
            call()
        except OutOfMemoryError as e:
            ev = self.raw.events[i] if i < len(self.events) else None
            raise ReplayDiverged(f"replay: out of memory at event {i}, where the live pool "
                                 f"logged {_show(ev)}: {e}") from None
        new = self._logged() - before
        got = [tuple(x[1:]) for x in self.pool.events()[-new:]] if new > 0 else []
        want = [tuple(x[1:]) for x in self.raw.events[i:j]]
        if got != want:
            first = next((x for x, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
            shown = [_show(MemoryEvent(0.0, *x)) if x else None for x in
                     (want[first] if first < len(want) else None,
                      got[first] if first < len(got) else None)]
            raise ReplayDiverged(f"replay: at event {i + first} the live pool logged "
                                 f"{shown[0] or 'nothing more'}, the replay "
                                 f"{shown[1] or 'nothing'}")
        return j


def replay_trace(events, start: dict | None = None) -> dict:
    """Replay ``events`` (``MemoryEvent`` tuples, oldest first) on a fresh ``MemoryPool`` over
    a :class:`TraceRawAllocator`, from ``start`` (``layout_state``: its segments, live blocks
    and limit; empty if None). Returns::

        {"name": "tinyloop pool", "skipped": False, "peak_allocated_bytes",
         "peak_reserved_bytes", "final_reserved_bytes", "misses", "ooms", "replay_s",
         "peak_reserved_over_peak_allocated", "exact": True}

    ``misses`` counts allocations that grew the pool although its free bytes covered them
    (the definition of ``analyze_trace``). Raises :class:`ReplayDiverged` when the pool logs
    an event the trace does not have, or the trace lacks a field the pool logs."""
    t0 = time.perf_counter()
    rp = _Replayer(events)
    rp.build_start(start or {"segments": {}, "blocks": {}})
    rp.run()
    s = rp.pool.stats()
    return {"name": "tinyloop pool", "skipped": False, "exact": True,
            "peak_allocated_bytes": s.peak_allocated_bytes,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "final_reserved_bytes": s.reserved_bytes, "misses": rp.misses, "ooms": rp.ooms,
            "replay_s": time.perf_counter() - t0,
            "peak_reserved_over_peak_allocated": (s.peak_reserved_bytes / s.peak_allocated_bytes
                                                  if s.peak_allocated_bytes else None)}


class _CupyPolicy:
    """CuPy's default MemoryPool (a fresh instance: best fit over 512-byte bins, split and
    merge within a cudaMalloc'd chunk) or MemoryAsyncPool (cudaMallocAsync's pool), fed the
    trace's alloc / free sequence."""

    def __init__(self, kind: str):
        import cupy
        self.cupy = cupy
        if kind == "default":
            self.name = "cupy MemoryPool"
            self.pool = cupy.cuda.MemoryPool()
        else:
            self.name = "cupy MemoryAsyncPool"
            self.pool = cupy.cuda.MemoryAsyncPool()

    def alloc(self, size, tag):
        return self.pool.malloc(size)

    def free(self, h):
        pass                    # dropping the MemoryPointer returns it (done by the caller)

    def reserved_bytes(self):
        return int(self.pool.total_bytes())

    def used_bytes(self):
        return int(self.pool.used_bytes())

    def close(self):
        self.cupy.cuda.Device().synchronize()
        self.pool.free_all_blocks()


def replay_ops(policy, ops) -> dict:
    """Feed ``ops`` (``trace_ops``) to ``policy`` (alloc(size, tag) -> handle, free(handle),
    reserved_bytes(), used_bytes(), name); its peaks and misses (an alloc that grew the
    reservation although its free bytes covered it), counted from the ``("start",)`` marker."""
    handles: dict = {}
    peak_used = peak_res = 0
    misses = 0
    counting = not any(op[0] == "start" for op in ops)
    t0 = time.perf_counter()
    for op in ops:
        if op[0] == "start":
            counting = True
            peak_used, peak_res = policy.used_bytes(), policy.reserved_bytes()
        elif op[0] == "alloc":
            _, key, size, tag = op
            before_res = policy.reserved_bytes()
            before_free = before_res - policy.used_bytes()
            handles[key] = policy.alloc(size, tag)
            if counting and policy.reserved_bytes() > before_res and size <= before_free:
                misses += 1
        else:
            h = handles.pop(op[1])
            policy.free(h)
            del h
        if counting:
            peak_used = max(peak_used, policy.used_bytes())
            peak_res = max(peak_res, policy.reserved_bytes())
    elapsed = time.perf_counter() - t0
    final_res = policy.reserved_bytes()
    handles.clear()
    return {"name": policy.name, "skipped": False, "exact": False,
            "peak_allocated_bytes": peak_used, "peak_reserved_bytes": peak_res,
            "final_reserved_bytes": final_res, "misses": misses, "replay_s": elapsed,
            "peak_reserved_over_peak_allocated": peak_res / peak_used if peak_used else None}


def trace_ops(events, start: dict | None = None) -> list[tuple]:
    """The alloc / free sequence of a trace as ``("alloc", key, size, tag)`` /
    ``("free", key)``: first an alloc for every block live in ``start`` and a ``("start",)``
    marker (replays count misses from there on), then the trace's own. Frees of blocks the
    trace never saw allocated are dropped."""
    ops, live, serial = [], {}, 0
    for ptr, (size, tag) in sorted((start or {}).get("blocks", {}).items()):
        serial += 1
        live[ptr] = serial
        ops.append(("alloc", serial, size, tag))
    ops.append(("start",))
    for ev in events:
        action, addr, size, tag = ev[1], ev[2], ev[3], ev[4]
        if action == "alloc":
            serial += 1
            live[addr] = serial
            ops.append(("alloc", serial, size, tag))
        elif action == "free_completed" and addr in live:
            ops.append(("free", live.pop(addr)))
    return ops


def replay_policies(events, start: dict | None = None, *,
                    cuda: bool | None = None) -> list[dict]:
    """The trace replayed against each policy: TinyLoop's pool (:func:`replay_trace`; when it
    diverges, ``skipped`` with the reason), then CuPy's two where CUDA is present (``cuda=None``
    detects it; ``skipped`` + ``reason`` otherwise). One dict per policy."""
    from tinyloop.backends import cuda_available
    out = []
    try:
        out.append(replay_trace(events, start))
    except ReplayDiverged as e:
        out.append({"name": "tinyloop pool", "skipped": True, "reason": str(e)})
    if cuda is None:
        cuda = cuda_available()
    ops = trace_ops(events, start) if cuda else None
    for kind, name in (("default", "cupy MemoryPool"), ("async", "cupy MemoryAsyncPool")):
        if not cuda:
            try:
                import cupy  # noqa: F401
                why = "CuPy is installed but sees no CUDA device"
            except ImportError:
                why = "CuPy is not installed (pip install cupy-cuda12x) and there is no GPU"
            out.append({"name": name, "skipped": True,
                        "reason": f"{why}: the CuPy allocators can only be replayed on a GPU"})
            continue
        try:
            pol = _CupyPolicy(kind)
        except Exception as e:      # cudaMallocAsync unsupported here: report it, don't hide it
            out.append({"name": name, "skipped": True, "reason": f"{type(e).__name__}: {e}"})
            continue
        try:
            out.append(replay_ops(pol, ops))
        except MemoryError as e:    # CuPy's OutOfMemoryError: the device is too full to replay
            out.append({"name": name, "skipped": True,
                        "reason": f"out of memory while replaying: {e}"})
        finally:
            pol.close()
    return out
