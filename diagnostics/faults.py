"""Planted faults: real pool allocations that make a run leak or cache without bound, so the
leak verdict can be checked against a known answer.

- :class:`PlantedLeak` keeps ``bytes_per_request`` allocated after every request (tag "other"),
  held in a list like a forgotten per-request object: ``allocated_bytes`` grows by
  ``round_size(bytes_per_request)`` per request (the pool rounds to 512 bytes).
- :class:`PlantedCache` grows the pool's cached-but-free reservation by ``bytes_per_request``
  on average per request: ``allocated_bytes`` at request end is unchanged, ``reserved_bytes``
  grows. How it forces the pool to reserve (see ``tinyloop.memory.arena``): the pool only asks
  the raw allocator for a segment when no free chunk of the request's size class fits, so the
  plant allocates equal pieces (holding them) until the pool has to add segments, then frees
  them all. Every earlier free chunk that could fit a piece (the model's cached free space and
  the plant's own earlier segments) is filled first, so the new segments are real growth; freed,
  they stay cached as free segments. Pieces are 1 MiB "small" requests (2 MiB shared segments)
  when ``bytes_per_request`` < 2 MiB, else a multiple of 2 MiB (a "large" segment of exactly
  that size), so the reservation grows in those quanta: a 1 MiB/request cache shows as a 2 MiB
  step every other request. ``empty_cache()`` gives the plant's segments back, like any cached
  segment.
"""

from __future__ import annotations

from tinyloop.memory import SMALL_REQUEST_MAX, SMALL_SEGMENT_BYTES

PLANT_TAG = "other"


class PlantedLeak:
    """After each request, allocate ``bytes_per_request`` (tag "other") and never free it."""

    def __init__(self, pool, bytes_per_request: int):
        if bytes_per_request < 0:
            raise ValueError(f"--plant-leak must be >= 0 bytes, got {bytes_per_request}")
        self.pool = pool
        self.bytes_per_request = int(bytes_per_request)
        self.blocks: list = []

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def after_request(self) -> None:
        if self.bytes_per_request:
            self.blocks.append(self.pool.allocate(self.bytes_per_request, tag=PLANT_TAG))

    def release(self) -> None:
        """Free every held block (the end of a run, so the process pool is left clean)."""
        blocks, self.blocks = self.blocks, []
        for b in blocks:
            self.pool.free(b)


class PlantedCache:
    """After each request, grow the pool's free cached reservation to ``k * bytes_per_request``
    (k = requests so far) beyond what it was when the plant started; see the module docstring."""

    def __init__(self, pool, bytes_per_request: int):
        if bytes_per_request < 0:
            raise ValueError(f"--plant-cache must be >= 0 bytes, got {bytes_per_request}")
        self.pool = pool
        self.bytes_per_request = int(bytes_per_request)
        if self.bytes_per_request < SMALL_SEGMENT_BYTES:
            self.piece_bytes = SMALL_REQUEST_MAX                       # small class, 2 MiB segs
        else:
            self.piece_bytes = self.bytes_per_request // SMALL_SEGMENT_BYTES * SMALL_SEGMENT_BYTES
        self.requests = 0
        self.grown_bytes = 0       # reserved bytes the plant made the pool add, in total

    def after_request(self) -> None:
        self.requests += 1
        target = self.requests * self.bytes_per_request
        if not self.bytes_per_request or self.grown_bytes >= target:
            return
        held = []
        try:
            while self.grown_bytes < target:
                before = self.pool.reserved_bytes
                held.append(self.pool.allocate(self.piece_bytes, tag=PLANT_TAG))
                self.grown_bytes += max(0, self.pool.reserved_bytes - before)
        finally:
            for b in held:
                self.pool.free(b)

    def release(self) -> None:
        """Nothing is held: the plant's segments are ordinary cached free segments."""
