"""The pool's core: integer offset arithmetic over segments. No I/O, no locks, no statistics.

An ``Arena`` holds segments (address ranges handed to it by the pool, which got them from a raw
allocator) and tiles each segment with chunks, live or free, ordered by address. Allocation is
best fit over the free chunks of one size class (smallest chunk that fits, lowest address on a
tie), splitting the chunk so the tail stays free; freeing merges a chunk with its free
neighbours in the same segment (never across segments, even when two segments happen to be
adjacent in memory: each came from its own raw allocation and goes back as one).

Size classes (every number below is a choice, with its reason):

- ``ALIGNMENT = 512`` bytes: every request is rounded up to a multiple of 512 (and at least
  512). cudaMalloc returns 256-byte aligned memory; 512 keeps every block start aligned for any
  dtype, for 128-byte coalesced loads and for 16-byte vector loads, and it is the rounding of
  PyTorch's caching allocator (``kMinBlockSize``), so our figures compare with theirs.
- ``SMALL_REQUEST_MAX = 1 MiB``: requests up to this size are "small" (scratch, logits of a
  decode step, per-request metadata). They are packed together into shared segments.
- ``SMALL_SEGMENT_BYTES = 2 MiB``: the size of a shared segment for small requests. It is the GPU
  large-page size (cudaMalloc hands out 2 MiB pages), so a smaller segment would waste the rest
  of the page, and it holds at least two maximal small blocks, so packing always helps.
- Larger requests ("large": weights, KV caches, prefill logits) get a segment of their own,
  rounded up to ``LARGE_SEGMENT_ROUND = 2 MiB`` (the same page granularity: the driver would
  round anyway, and the tail becomes a reusable free chunk instead of invisible slack).
- Small and large requests share no segment while the pool can grow: a long-lived 4 KiB block
  must not pin a 1 GiB segment that ``empty_cache`` could otherwise return (the reason PyTorch
  keeps two pools). When the budget or the device allows no new segment, a request takes a free
  range of the other class (``MemoryPool`` decides when; the arena only filters): bytes the pool
  already holds serve any request they fit.

Chunks in the large class are split exactly, so a reused large segment's tail stays free for
the next large request; best fit keeps a small large request out of a huge free chunk whenever a
closer fit exists.
"""

from __future__ import annotations

import bisect

ALIGNMENT = 512
SMALL_REQUEST_MAX = 1 << 20
SMALL_SEGMENT_BYTES = 2 << 20
LARGE_SEGMENT_ROUND = 2 << 20
KINDS = ("small", "large")


def round_size(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` occupies: a multiple of ALIGNMENT, at least ALIGNMENT."""
    if nbytes <= ALIGNMENT:
        return ALIGNMENT
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def size_kind(rounded: int) -> str:
    """The size class of a ``rounded`` request: "small" (packed into shared segments) or
    "large" (a segment of its own). The one definition of the rule; the pool, the arena's
    segments and ``diagnostics.fragment`` all ask here."""
    return "small" if rounded <= SMALL_REQUEST_MAX else "large"


def segment_size(rounded: int) -> int:
    """The segment size the pool asks the raw allocator for, to serve a ``rounded`` request."""
    if size_kind(rounded) == "small":
        return SMALL_SEGMENT_BYTES
    return (rounded + LARGE_SEGMENT_ROUND - 1) // LARGE_SEGMENT_ROUND * LARGE_SEGMENT_ROUND


class Segment:
    """One raw allocation: ``[ptr, ptr + size)``. ``first`` is its lowest chunk."""

    __slots__ = ("ptr", "size", "kind", "first", "handle")

    def __init__(self, ptr: int, size: int, kind: str, handle=None):
        self.ptr = ptr
        self.size = size
        self.kind = kind
        self.first: Chunk | None = None
        self.handle = handle        # whatever the raw allocator needs to view the bytes

    def chunks(self):
        c = self.first
        while c is not None:
            yield c
            c = c.next

    def __repr__(self):
        return f"Segment(ptr=0x{self.ptr:x}, size={self.size}, kind={self.kind})"


class Chunk:
    """A range ``[ptr, ptr + size)`` of one segment; ``free`` or live (then ``owner`` is set)."""

    __slots__ = ("ptr", "size", "segment", "prev", "next", "free", "owner")

    def __init__(self, ptr: int, size: int, segment: Segment, free: bool = True):
        self.ptr = ptr
        self.size = size
        self.segment = segment
        self.prev: Chunk | None = None
        self.next: Chunk | None = None
        self.free = free
        self.owner = None

    @property
    def offset(self) -> int:
        return self.ptr - self.segment.ptr

    def __repr__(self):
        state = "free" if self.free else "live"
        return f"Chunk(ptr=0x{self.ptr:x}, size={self.size}, {state})"


def _drop(c: Chunk) -> None:
    """Cut every link of a chunk that merging removed from its segment, so nothing it pointed
    at (its neighbours, its segment and the segment's buffer) waits for the cycle collector."""
    c.prev = c.next = c.segment = c.owner = None


class Arena:
    """Segments tiled by chunks; best fit with splitting and coalescing.

    Invariants (checked by ``check``):
    - the chunks of a segment are linked in address order, contiguous, and cover it exactly;
    - no two neighbouring chunks are both free (coalescing is eager);
    - ``_free[kind]`` holds ``(size, ptr)`` of exactly the free chunks of segments of that
      kind, sorted; ``_free_chunk[ptr]`` maps those ptrs to their chunks.
    """

    def __init__(self):
        self.segments: dict[int, Segment] = {}          # segment ptr -> Segment
        self._free: dict[str, list] = {k: [] for k in KINDS}
        self._free_chunk: dict[int, Chunk] = {}

    # --- free lists -----------------------------------------------------------------------
    def _insert_free(self, c: Chunk) -> None:
        bisect.insort(self._free[c.segment.kind], (c.size, c.ptr))
        self._free_chunk[c.ptr] = c

    def _remove_free(self, c: Chunk) -> None:
        lst = self._free[c.segment.kind]
        i = bisect.bisect_left(lst, (c.size, c.ptr))
        assert lst[i] == (c.size, c.ptr), "free list out of sync"
        del lst[i]
        del self._free_chunk[c.ptr]

    # --- segments -------------------------------------------------------------------------
    def add_segment(self, ptr: int, size: int, kind: str, handle=None) -> Segment:
        """Adopt ``[ptr, ptr + size)`` as one free chunk of class ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"segment kind {kind!r} is not one of {KINDS}")
        if size <= 0 or size % ALIGNMENT:
            raise ValueError(f"segment size {size} is not a positive multiple of {ALIGNMENT}")
        if ptr in self.segments:
            raise ValueError(f"segment 0x{ptr:x} is already in the arena")
        seg = Segment(ptr, size, kind, handle)
        seg.first = Chunk(ptr, size, seg)
        self.segments[ptr] = seg
        self._insert_free(seg.first)
        return seg

    def free_segments(self) -> list[Segment]:
        """Segments with no live chunk (one free chunk covering the whole segment)."""
        return [s for s in self.segments.values() if s.first.free and s.first.next is None]

    def remove_segment(self, seg: Segment) -> None:
        """Drop a fully free segment; raises ValueError if any of its chunks is live.

        The segment and its chunk point at each other: both links are cut here, so the pair
        (and the raw allocator's ``handle``, the host pool's buffer) is freed the moment the
        caller drops it, without waiting for the cycle collector."""
        if not (seg.first.free and seg.first.next is None):
            raise ValueError(f"{seg!r} still has live blocks")
        self._remove_free(seg.first)
        del self.segments[seg.ptr]
        seg.first.segment = None
        seg.first = None

    # --- chunks ---------------------------------------------------------------------------
    def _fit_index(self, lst: list, rounded: int, partly_used_only: bool) -> int:
        """Index in the sorted free list ``lst`` of the best fit for ``rounded`` bytes (the
        smallest chunk that fits, lowest address on a tie), or ``len(lst)``.
        ``partly_used_only`` skips chunks that are a whole segment (no live block there)."""
        i = bisect.bisect_left(lst, (rounded, -1))
        if partly_used_only:
            chunk = self._free_chunk
            while i < len(lst):
                c = chunk[lst[i][1]]
                if c.prev is not None or c.next is not None:
                    break
                i += 1
        return i

    def fits(self, rounded: int, kind: str, partly_used_only: bool = False) -> bool:
        """Whether class ``kind`` has a free chunk of at least ``rounded`` bytes (in a segment
        that also holds live blocks, with ``partly_used_only``)."""
        lst = self._free[kind]
        return self._fit_index(lst, rounded, partly_used_only) < len(lst)

    def take(self, rounded: int, kind: str, partly_used_only: bool = False) -> Chunk | None:
        """Best-fit a live chunk of exactly ``rounded`` bytes from class ``kind``, or None
        (``partly_used_only``: only from segments that already hold live blocks)."""
        lst = self._free[kind]
        i = self._fit_index(lst, rounded, partly_used_only) if partly_used_only else \
            bisect.bisect_left(lst, (rounded, -1))
        if i == len(lst):
            return None
        size, ptr = lst[i]
        del lst[i]
        c = self._free_chunk.pop(ptr)
        if size > rounded:                      # split: the tail stays free
            tail = Chunk(ptr + rounded, size - rounded, c.segment)
            tail.prev, tail.next = c, c.next
            if c.next is not None:
                c.next.prev = tail
            c.next = tail
            c.size = rounded
            self._insert_free(tail)
        c.free = False
        return c

    def take_run(self, rounded: int, n: int, kind: str, partly_used_only: bool = False,
                 one_range: bool = False) -> list[Chunk]:
        """Up to ``n`` live chunks of exactly ``rounded`` bytes from class ``kind``: the chunks
        ``n`` calls of :meth:`take` would return, in that order, or fewer (possibly none) when
        the class runs out of chunks that fit. ``partly_used_only`` as in :meth:`take`;
        ``one_range``: carve the best-fit free chunk only, not the next one after it.

        Why one carve per free chunk is the same as ``n`` takes: after ``take`` splits the
        best-fit chunk ``(S, p)``, its tail ``(S - rounded, p + rounded)`` sorts before every
        other free chunk that fits (those are all >= ``(S, p)``), so the next ``take`` splits
        the tail again while it still fits. So the run takes ``min(n, S // rounded)``
        address-contiguous chunks from the best fit, links them in one pass and inserts one
        tail into the free list, instead of one bisect insertion per chunk.
        """
        out: list[Chunk] = []
        lst = self._free[kind]
        key = (rounded, -1)
        while len(out) < n:
            i = self._fit_index(lst, rounded, True) if partly_used_only else \
                bisect.bisect_left(lst, key)
            if i == len(lst):
                break
            size, ptr = lst[i]
            del lst[i]
            c = self._free_chunk.pop(ptr)
            k = min(n - len(out), size // rounded)
            seg, nxt = c.segment, c.next
            c.size = rounded
            c.free = False
            out.append(c)
            prev, p = c, ptr + rounded
            for _ in range(k - 1):
                d = Chunk(p, rounded, seg, False)
                d.prev = prev
                prev.next = d
                out.append(d)
                prev, p = d, p + rounded
            rest = size - k * rounded
            if rest:                            # the tail stays free
                tail = Chunk(p, rest, seg)
                tail.prev = prev
                prev.next = tail
                tail.next = nxt
                if nxt is not None:
                    nxt.prev = tail
                self._insert_free(tail)
            else:
                prev.next = nxt
                if nxt is not None:
                    nxt.prev = prev
            if one_range:
                break
        return out

    def give_back(self, c: Chunk) -> Chunk:
        """Mark a live chunk free and merge it with free neighbours; return the merged chunk."""
        if c.free:
            raise ValueError(f"{c!r} is already free")
        c.free = True
        c.owner = None
        return self._merge(c)

    def give_back_run(self, run: list) -> Chunk:
        """Give back live chunks that are neighbours in one segment (``run[i + 1]`` is
        ``run[i].next``) as one: the arena ends as after one ``give_back`` per chunk (free
        chunks are always fully merged), with one free-list update instead of one per chunk.
        Raises ValueError, changing nothing, for a free chunk or chunks that are not
        neighbours."""
        for a, b in zip(run, run[1:]):
            if a.next is not b:
                raise ValueError(f"{b!r} does not follow {a!r}")
        for c in run:
            if c.free:
                raise ValueError(f"{c!r} is already free")
        first, last = run[0], run[-1]
        for c in run:
            c.free = True
            c.owner = None
        first.size = last.ptr + last.size - first.ptr
        first.next = last.next
        if last.next is not None:
            last.next.prev = first
        for c in run[1:]:                       # absorbed: no links left to or from them
            _drop(c)
        return self._merge(first)

    def _merge(self, c: Chunk) -> Chunk:
        """Merge the newly free chunk ``c`` with its free neighbours and list the result."""
        nxt = c.next
        if nxt is not None and nxt.free:        # absorb the next chunk
            self._remove_free(nxt)
            c.size += nxt.size
            c.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = c
            _drop(nxt)
        prv = c.prev
        if prv is not None and prv.free:        # be absorbed by the previous chunk
            self._remove_free(prv)
            prv.size += c.size
            prv.next = c.next
            if c.next is not None:
                c.next.prev = prv
            _drop(c)
            c = prv
        self._insert_free(c)
        return c

    # --- queries --------------------------------------------------------------------------
    def largest_free(self) -> int:
        return max((lst[-1][0] for lst in self._free.values() if lst), default=0)

    def largest_free_of(self, kind: str) -> int:
        lst = self._free[kind]
        return lst[-1][0] if lst else 0

    def free_segment_bytes(self) -> int:
        """Bytes of the segments with no live block (what returning them would release)."""
        return sum(s.size for s in self.free_segments())

    def free_bytes(self) -> int:
        return sum(size for lst in self._free.values() for size, _ in lst)

    def layout(self) -> list[dict]:
        """Every segment in address order with the chunks that tile it (``MemoryPool.layout``'s
        format; a live chunk's ``owner`` gives its ``requested_bytes`` and ``tag``)."""
        out = []
        for ptr in sorted(self.segments):
            seg = self.segments[ptr]
            blocks = [{"address": c.ptr, "size": c.size, "live": not c.free,
                       "requested_bytes": 0 if c.free else c.owner.requested_bytes,
                       "tag": None if c.free else c.owner.tag} for c in seg.chunks()]
            out.append({"address": ptr, "size": seg.size, "kind": seg.kind, "blocks": blocks})
        return out

    def check(self) -> None:
        """Assert every invariant listed in the class docstring (for tests; O(chunks))."""
        seen_free = set()
        for seg in self.segments.values():
            c, expect, prev = seg.first, seg.ptr, None
            assert c is not None and c.prev is None
            while c is not None:
                assert c.segment is seg and c.ptr == expect and c.size > 0, (seg, c)
                assert c.size % ALIGNMENT == 0 and c.prev is prev, (seg, c)
                if c.free:
                    assert prev is None or not prev.free, f"unmerged free neighbours at {c!r}"
                    assert self._free_chunk.get(c.ptr) is c, c
                    seen_free.add((seg.kind, c.size, c.ptr))
                expect, prev, c = expect + c.size, c, c.next
            assert expect == seg.ptr + seg.size, f"chunks do not cover {seg!r}"
        listed = {(k, s, p) for k, lst in self._free.items() for s, p in lst}
        assert listed == seen_free and len(self._free_chunk) == len(listed)
        for lst in self._free.values():
            assert lst == sorted(lst)
