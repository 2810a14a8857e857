"""Replaying a recorded pool trace: TinyLoop's own pool exactly, CuPy's allocators side by side.

:func:`replay_trace` drives the real ``tinyloop.memory.MemoryPool`` -- the class the live run
used, not a model of it -- over :class:`TraceRawAllocator`, a fake raw allocator that hands out
the addresses the live trace recorded, in order. The replay rebuilds the layout the trace
starts from, then repeats every operation the events show (allocate, free, reserve,
empty_cache, an out-of-memory retry), and checks after each one that the replayed pool logged
the very events the live pool logged (action, address, size, tag). So its peaks and its misses
*are* the live pool's, and a trace it cannot repeat raises :class:`ReplayDiverged` naming the
first event that differs instead of reporting other figures.

What the events do not say, the replay takes from elsewhere: the size class ("small" /
"large") of a segment comes from the layouts seen while the trace was collected
(:func:`segment_kinds`; a block made in ``packed_scope`` sits in a "large" segment whatever its
size), and a ``reserve()`` is told from an allocation's own growth by the rule of
:func:`grows_for_alloc`. The bytes a request asked for before rounding are not in the events
(the pool's ``requested_bytes`` is not replayed); nothing the pool decides depends on them.

:func:`replay_policies` adds CuPy's ``MemoryPool`` and ``MemoryAsyncPool`` where CUDA is present.
They replay the alloc / free sequence (:func:`diagnostics.fragment.trace_ops`): they have no
size classes or reservations, so ``packed_scope`` and ``reserve()`` mean nothing to them.
"""

from __future__ import annotations

import bisect
import contextlib
import time

from tinyloop.errors import OutOfMemoryError
from tinyloop.memory import MemoryPool, packed_scope, size_kind
from tinyloop.memory.arena import SMALL_REQUEST_MAX, segment_size


class ReplayDiverged(ValueError):
    """The replayed pool did something the live trace does not show (names the event)."""


def grows_for_alloc(segment_event, alloc_event, kind: str, largest_free_same_kind: int) -> bool:
    """Whether ``segment_event`` (a ``segment_alloc``) followed by ``alloc_event`` (an alloc
    into that segment, of size class ``kind``) is the allocation's own growth (True) or a
    ``reserve()`` the allocation then used (False). A reserve makes "large" segments only; an
    allocation's segment carries its own tag and is ``segment_size(rounded)`` or, when that
    does not fit, exactly ``rounded`` bytes; and it grows only when no free chunk of its class
    fits it (``largest_free_same_kind``: the largest such chunk before the segment came)."""
    seg_size, seg_tag = segment_event[3], segment_event[4]
    rounded, tag = alloc_event[3], alloc_event[4]
    if kind == "small":
        return True
    if seg_tag != tag or seg_size not in (segment_size(rounded), rounded):
        return False
    return largest_free_same_kind < rounded


def segment_kinds(events, snapshots) -> dict:
    """{index of a ``segment_alloc`` event: its segment's size class}, for the segments some
    snapshot saw alive. ``snapshots``: ``(position, {segment address: kind})`` pairs, a
    position being how many of ``events`` had happened when the layout was read (0: the
    start; ``len(events)``: the end). A segment made and returned between two snapshots is
    left out (its class is unknown)."""
    snaps = sorted(snapshots, key=lambda s: s[0])
    positions = [p for p, _ in snaps]
    freed_at: dict[int, int] = {}
    out = {}
    for i in range(len(events) - 1, -1, -1):          # latest first: each alloc's own free
        action, addr = events[i][1], events[i][2]
        if action == "segment_free":
            freed_at[addr] = i
        elif action == "segment_alloc":
            end = freed_at.pop(addr, len(events))         # alive after events[:p], i < p <= end
            j = bisect.bisect_right(positions, i)
            while j < len(snaps) and positions[j] <= end:
                kind = snaps[j][1].get(addr)
                if kind is not None:
                    out[i] = kind
                    break
                j += 1
    return out


class TraceRawAllocator:
    """A fake raw allocator that hands out the segments a trace recorded.

    While the start layout is rebuilt, :meth:`expect` names the one segment the next malloc
    must make. During the trace, ``cursor`` is the index of the next live event the pool has
    not logged yet: a malloc succeeds only when that event is a ``segment_alloc`` of the size
    asked for (the pool asks for a segment's preferred size first, then exactly its request;
    the one the live pool got is the one that succeeds), and raises MemoryError when the live
    pool got no segment there (the next event is its release of cached segments, or its
    out-of-memory); a free must be one of the ``segment_free`` events at the cursor.
    """

    device = "fake"
    device_index = 0

    def __init__(self, events):
        self.events = events
        self.cursor = 0
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
        ev = self.events[self.cursor] if self.cursor < len(self.events) else None
        if ev is not None and ev[1] == "segment_alloc":
            if ev[3] != nbytes:
                raise MemoryError(f"replay: the live pool got {ev[3]} bytes here, not {nbytes}")
            self.cursor += 1
            return ev[2], None
        if ev is not None and ev[1] in ("segment_free", "oom"):
            raise MemoryError(f"replay: the live pool got no segment here (event "
                              f"{self.cursor} is {ev[1]})")
        raise ReplayDiverged(f"replay: the pool asked for a {nbytes}-byte segment before event "
                             f"{self.cursor} ({_show(ev)}); the live pool did not")

    def free(self, ptr: int, handle) -> None:
        j = self.cursor
        while j < len(self.events) and self.events[j][1] == "segment_free":
            if self.events[j][2] == ptr:
                ev = self.events[j]
                self.events[j] = self.events[self.cursor]         # keep the run contiguous
                self.events[self.cursor] = ev
                self.cursor += 1
                return
            j += 1
        ev = self.events[self.cursor] if self.cursor < len(self.events) else None
        raise ReplayDiverged(f"replay: the pool returned segment 0x{ptr:x} at event "
                             f"{self.cursor} ({_show(ev)}); the live pool did not")

    def mem_info(self):
        return None, None

    def process_bytes(self):
        return None

    def nvml_process_bytes(self):
        return None

    def array(self, handle, offset, nbytes, shape, dtype, owner):
        raise TypeError("a replayed pool has addresses but no bytes")


def _show(ev) -> str:
    if ev is None:
        return "the end of the trace"
    return f"{ev[1]} 0x{ev[2]:x} {ev[3]} B tag {ev[4]}"


def _largest_free_by_kind(pool, exclude=()) -> dict:
    """{size class: its largest free chunk} in ``pool``, leaving out the segments at the
    addresses in ``exclude``."""
    best = {"small": 0, "large": 0}
    for seg in pool.layout():
        if seg["address"] in exclude:
            continue
        for b in seg["blocks"]:
            if not b["live"]:
                best[seg["kind"]] = max(best[seg["kind"]], b["size"])
    return best


class _Replayer:
    """The state of one replay: the pool, its segments (address -> (size, kind)) and the live
    blocks (address -> Block)."""

    def __init__(self, events, kinds: dict):
        self.events = [tuple(e[:5]) for e in events]
        self.raw = TraceRawAllocator(list(self.events))
        self.kinds = kinds
        # one replayed operation logs at most a run of segment events and a few more: the
        # ring only needs to hold that much (reading it back stays cheap)
        run = longest = 0
        for e in self.events:
            run = run + 1 if e[1].startswith("segment_") else 0
            longest = max(longest, run)
        self.pool = MemoryPool(raw_allocator=self.raw, event_capacity=2 * longest + 16)
        self.segs: dict[int, tuple[int, str]] = {}
        self.seg_starts: list[int] = []
        self.blocks: dict = {}
        self.misses = 0
        self.ooms = 0

    # --- bookkeeping ----------------------------------------------------------------------
    def _logged(self) -> int:
        return self.pool.events_dropped + len(self.pool.events())

    def _add_seg(self, ptr: int, size: int, kind: str) -> None:
        self.segs[ptr] = (size, kind)
        bisect.insort(self.seg_starts, ptr)

    def _kind_at(self, addr: int) -> str | None:
        i = bisect.bisect_right(self.seg_starts, addr) - 1
        if i >= 0:
            size, kind = self.segs[self.seg_starts[i]]
            if addr < self.seg_starts[i] + size:
                return kind
        return None

    def _allocate(self, rounded: int, tag: str, kind: str):
        scope = packed_scope() if kind == "large" and size_kind(rounded) == "small" \
            else contextlib.nullcontext()
        with scope:
            return self.pool.allocate(rounded, tag=tag)

    # --- the start layout -----------------------------------------------------------------
    def build_start(self, start: dict) -> None:
        """Rebuild ``start`` (``layout_state``): each segment, in address order, is made by one
        allocation, given back, then tiled in address order with its live blocks and fillers
        for its free ranges (every earlier segment is fully tiled, so each tile lands at the
        next address); the fillers are freed at the end, merging into the start's free
        chunks."""
        blocks = start.get("blocks", {})
        starts = sorted(blocks)
        fillers = []
        for ptr in sorted(start.get("segments", {})):
            size, kind = start["segments"][ptr]
            self.raw.expect(ptr, size)
            first = min(size, SMALL_REQUEST_MAX) if kind == "small" else size
            self.pool.free(self._allocate(first, "other", kind))
            self._add_seg(ptr, size, kind)
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
                b = self._allocate(bsize, tag, kind)
                if b.ptr != addr:
                    raise ReplayDiverged(f"replay: the start layout's block at 0x{addr:x} "
                                         f"landed at 0x{b.ptr:x}")
                if live:
                    self.blocks[addr] = b
                else:
                    fillers.append(b)
        for b in fillers:
            self.pool.free(b)
        self.pool.reset_peak_stats()

    # --- the trace ------------------------------------------------------------------------
    def run(self) -> None:
        ev, n = self.events, len(self.events)
        i = 0
        while i < n:
            action = ev[i][1]
            if action == "segment_free":
                j = i
                while j < n and ev[j][1] == "segment_free":
                    j += 1
                if j < n and ev[j][1] in ("segment_alloc", "oom"):
                    i = self._op(i, j)         # the release is the next operation's retry
                else:
                    i = self._step(i, j, self.pool.empty_cache)
            else:
                i = self._op(i, i)

    def _op(self, i: int, k: int) -> int:
        """Replay the operation whose first event is ``i`` and whose own (non-release) event
        is ``k`` (``i < k`` when a release of cached segments came first). Returns the index
        of the next event."""
        ev = self.events
        t, action, addr, size, tag = ev[k]
        if action == "alloc":
            kind = self._kind_at(addr)
            if kind is None:
                raise ReplayDiverged(f"replay: event {k} ({_show(ev[k])}) is in no segment")
            return self._alloc(i, k + 1, size, tag, kind)
        if action == "free_requested":             # its free_completed follows at once
            blk = self.blocks.pop(addr, None)
            if blk is None or i != k:
                raise ReplayDiverged(f"replay: event {k} frees 0x{addr:x}, which the replay "
                                     f"does not hold")
            return self._step(k, k + 2, lambda: self.pool.free(blk))
        if action == "segment_alloc":
            nxt = ev[k + 1] if k + 1 < len(ev) else None
            into = (nxt is not None and nxt[1] == "alloc" and addr <= nxt[2] < addr + size)
            kind = self.kinds.get(k)
            released = {e[2] for e in ev[i:k]}
            # The free chunks once the release before it (if any) is done. A release right
            # before a new segment is the request's own retry (the raw allocator refused, the
            # pool gave its cached segments back and asked again) unless the request fitted a
            # chunk before it: then the release was an operation of its own (empty_cache(), or
            # a reserve() that found no room and gave up, which logs nothing else).
            after = _largest_free_by_kind(self.pool, exclude=released)
            if into:
                r = nxt[3]
                akind = kind or ("large" if size_kind(r) == "large"
                                 or size > segment_size(SMALL_REQUEST_MAX) else "small")
                if grows_for_alloc(ev[k], nxt, akind, after[akind]):
                    if i < k and _largest_free_by_kind(self.pool)[akind] >= r:
                        i = self._step(i, k, self.pool.empty_cache)   # a release of its own
                    if r <= self.pool.reserved_bytes - self.pool.allocated_bytes \
                            - self._released(i, k):
                        self.misses += 1
                    self._add_seg(addr, size, akind)
                    return self._alloc(i, k + 2, r, nxt[4], akind)
            j = k
            while j < len(ev) and ev[j][1] in ("segment_alloc", "segment_free"):
                j += 1
            if j < len(ev) and ev[j][1] == "oom":
                r = ev[j][3]
                staged = [x for x in range(k, j) if ev[x][1] == "segment_alloc"]
                if all(ev[x][3] in (segment_size(r), r) for x in staged):
                    return self._failed(i, j, staged)
            if i < k and _largest_free_by_kind(self.pool)["large"] >= size:
                i = self._step(i, k, self.pool.empty_cache)       # a release of its own
            self._add_seg(addr, size, "large")
            return self._step(i, k + 1, lambda: self.pool.reserve(size, tag))
        if action == "oom":
            return self._failed(i, k, [])
        return self._diverged(k)

    def _failed(self, i: int, k: int, staged: list) -> int:
        """Replay an allocation that ran out of memory at event ``k`` (``oom``), after the
        segments at events ``staged`` (a batch keeps the segments it added before failing).
        The events do not say the request's size class or, for a batch, its length; neither
        changes what a failure leaves behind (its releases and staged segments, all logged),
        so the replay asks for a batch of that size one block longer than the class has room
        for, in the class the staged segments have (else the one with less room; for a tie,
        "large": TinyLoop's batches are KV pages in ``packed_scope``)."""
        ev = self.events
        r, tag = ev[k][3], ev[k][4]
        released = {e[2] for e in ev[i:k] if e[1] == "segment_free"}
        room = {"small": 0, "large": 0}
        for seg in self.pool.layout():
            if seg["address"] not in released:
                for b in seg["blocks"]:
                    if not b["live"]:
                        room[seg["kind"]] += b["size"] // r
        kind = next((self.kinds[x] for x in staged if x in self.kinds), None)
        if size_kind(r) == "large":
            kind = "large"
        elif kind is None:
            kind = "small" if room["small"] < room["large"] else "large"
        n = room[kind] + sum(ev[x][3] // r for x in staged) + 1
        scope = packed_scope() if kind == "large" else contextlib.nullcontext()

        def attempt():
            try:
                with scope:
                    blocks = self.pool.allocate_many(r, n, tag)
            except OutOfMemoryError:
                return
            raise ReplayDiverged(f"replay: event {k} is an out-of-memory the replay did not "
                                 f"hit (it placed {len(blocks)} blocks of {r} B)")
        self.ooms += 1
        for x in staged:
            self._add_seg(ev[x][2], ev[x][3], kind)
        return self._step(i, k + 1, attempt)

    def _released(self, i: int, k: int) -> int:
        return sum(e[3] for e in self.events[i:k] if e[1] == "segment_free")

    def _alloc(self, i: int, j: int, rounded: int, tag: str, kind: str) -> int:
        out = {}

        def do():
            out["b"] = self._allocate(rounded, tag, kind)
        nxt = self._step(i, j, do)
        self.blocks[out["b"].ptr] = out["b"]
        return nxt

    def _step(self, i: int, j: int, call) -> int:
        """Run ``call`` with the raw allocator's cursor at ``i``; check that the pool logged
        exactly live events ``i..j-1`` (a run of segment_free in any order); return ``j``."""
        before = self._logged()
        self.raw.cursor = i
        try:
            call()
        except OutOfMemoryError as e:
            ev = self.raw.events[i] if i < len(self.events) else None
            raise ReplayDiverged(f"replay: out of memory at event {i}, where the live pool "
                                 f"logged {_show(ev)}: {e}") from None
        got = [tuple(e[1:5]) for e in self.pool.events()[-(self._logged() - before):]] \
            if self._logged() > before else []
        want = [tuple(e[1:5]) for e in self.raw.events[i:j]]
        if got != want:
            first = next((x for x, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
            raise ReplayDiverged(f"replay: at event {i + first} the live pool logged "
                                 f"{want[first] if first < len(want) else 'nothing more'}, "
                                 f"the replay {got[first] if first < len(got) else 'nothing'}")
        for e in want:
            if e[0] == "segment_free":
                del self.segs[e[1]]
                self.seg_starts.remove(e[1])
        return j

    def _diverged(self, k: int):
        raise ReplayDiverged(f"replay: cannot repeat event {k} ({_show(self.events[k])})")


def replay_trace(events, start: dict | None = None, *, kinds: dict | None = None) -> dict:
    """Replay ``events`` (``MemoryEvent`` tuples, oldest first) on a fresh ``MemoryPool`` over
    a :class:`TraceRawAllocator`, from ``start`` (``layout_state``; empty if None), with the
    segment classes ``kinds`` (:func:`segment_kinds`). Returns::

        {"name": "tinyloop pool", "skipped": False, "peak_allocated_bytes",
         "peak_reserved_bytes", "final_reserved_bytes", "misses", "ooms", "replay_s",
         "peak_reserved_over_peak_allocated", "exact": True}

    ``misses`` counts allocations that grew the pool although its free bytes covered them
    (the definition of ``analyze_trace``). Raises :class:`ReplayDiverged` when the pool logs
    an event the trace does not have."""
    t0 = time.perf_counter()
    rp = _Replayer(events, kinds or {})
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


def replay_policies(events, start: dict | None = None, *, kinds: dict | None = None,
                    cuda: bool | None = None) -> list[dict]:
    """The trace replayed against each policy: TinyLoop's pool (:func:`replay_trace`; when it
    diverges, ``skipped`` with the reason), then CuPy's two where CUDA is present (``cuda=None``
    detects it; ``skipped`` + ``reason`` otherwise). One dict per policy."""
    from tinyloop.backends import cuda_available
    from .fragment import trace_ops
    out = []
    try:
        out.append(replay_trace(events, start, kinds=kinds))
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
