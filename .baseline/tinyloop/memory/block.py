"""``Block``: one live allocation of a ``MemoryPool`` (what ``pool.allocate`` returns)."""

from __future__ import annotations

import numpy as np


class Block:
    """A live allocation of ``nbytes`` (``requested_bytes`` rounded up to 512) at ``ptr``.

    ``array(shape, dtype)`` views its bytes (NumPy on the host arena, CuPy on the cuda arena);
    ``free()`` returns it to the pool (a second ``free`` raises ValueError).
    """

    __slots__ = ("pool", "ptr", "nbytes", "requested_bytes", "tag", "freed", "_chunk",
                 "__weakref__")

    def __init__(self, pool, chunk, requested_bytes: int, tag: str):
        self.pool = pool
        self.ptr = chunk.ptr
        self.nbytes = chunk.size
        self.requested_bytes = requested_bytes
        self.tag = tag
        self.freed = False
        self._chunk = chunk

    @property
    def device(self) -> str:
        return self.pool.device

    def array(self, shape, dtype):
        """A ``shape``/``dtype`` array over the first bytes of this block.

        Raises ValueError when the view needs more than ``requested_bytes`` or the block was
        freed. The array does not keep the block live: free the block only once it is unused.
        """
        if self.freed:
            raise ValueError(f"{self!r} was freed; it has no bytes to view")
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n > self.requested_bytes:
            raise ValueError(f"a {shape} {dtype} view needs {n} bytes but the block was "
                             f"requested with {self.requested_bytes}")
        seg = self._chunk.segment
        return self.pool._raw.array(seg.handle, self.ptr - seg.ptr, n, shape, dtype, self)

    def free(self) -> None:
        self.pool.free(self)

    def __repr__(self):
        state = "freed" if self.freed else "live"
        return (f"Block({self.pool.device}, ptr=0x{self.ptr:x}, nbytes={self.nbytes}, "
                f"requested={self.requested_bytes}, tag={self.tag!r}, {state})")


def contiguous_runs(blocks) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each maximal run of neighbours in ``blocks`` (a list of live
    blocks) that tile one segment back to back, in list order: one memset or copy per run
    instead of one per block. Blocks of two segments never share a run, even when the segments
    happen to be adjacent in memory. Every byte of every block is in exactly one run."""
    runs: list[tuple[int, int]] = []
    start = end = 0
    seg = None
    for blk in blocks:
        s = blk._chunk.segment
        if blk.ptr == end and s is seg:
            end += blk.nbytes
            continue
        if seg is not None:
            runs.append((start, end - start))
        start, end, seg = blk.ptr, blk.ptr + blk.nbytes, s
    if seg is not None:
        runs.append((start, end - start))
    return runs
