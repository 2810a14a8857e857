"""The runtime KV cache: a request's block tables over refcounted pages (seed 001,
"Per-request memory").

A request holds one **block table** per slot (the page addresses of positions 0..P-1, P..2P-1,
...) and gains pages as it grows, so it owns at most one partly filled page per slot (vLLM's
PagedAttention, Kwon et al. 2023). The pages belong to the model's PageAllocator
(``kv.pages``), which counts their references, so a prefix's pages are shared by reference and
freed when the last cache lets go. ``SlotKV`` is what the attention ops receive for one slot;
``DepthView`` shows a cache laid out for more iterations at a smaller depth; ``Recon`` is what a
store-h slot's attention needs to rebuild K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, HandleError
from .layouts import (DEFAULT_PAGE_SIZE, PageLayout, check_kv_iterations, room_slots,
                      slot_layers, slot_map)
from .pages import Page, PageAllocator, copy_page

class SlotKV:
    """What the attention ops receive for one slot: the page ``layout``, the block ``table``
    (int64 page addresses ``[max_pages]``, on the backend's device, at a fixed address for the
    request's life), its host mirror ``table_host``, and the ``allocator`` resolving addresses
    (NumPy reference)."""

    __slots__ = ("layout", "table", "table_host", "allocator")

    def __init__(self, layout, table, table_host, allocator):
        self.layout = layout
        self.table = table
        self.table_host = table_host
        self.allocator = allocator

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def page_parts(self, i: int) -> dict:
        """The typed part views of page ``i`` of this slot, through the block table."""
        return self.allocator.page(self.table_host[i]).parts


class BatchSlot:
    """One attention slot of a decode batch, as ``Ops.kv_write_batch`` /
    ``Ops.kv_attention_batch`` receive it (``rows``): row i is ``slots[i]`` (a SlotKV) at
    position ``positions[i]`` (a host int); every row's slot has the page ``layout`` of
    ``slots[0]`` (the scheduler groups requests by kv_mode). ``max_pos``: the largest
    position. ``positions_dev`` / ``tables_dev``: int64 ``[B]`` arrays on the backend's device
    (views of the step's :func:`batch_index`, uploaded once per step): the positions, and the
    address of each row's block table (``slots[i].table``), which the CUDA batch kernels read
    instead of per-row arguments; None where no index was built (the per-row reference path
    reads only the host fields)."""

    __slots__ = ("layout", "slots", "positions", "max_pos", "positions_dev", "tables_dev")

    def __init__(self, slots, positions, positions_dev=None, tables_dev=None):
        self.layout = slots[0].layout
        self.slots = slots
        self.positions = positions
        self.max_pos = max(positions)
        self.positions_dev = positions_dev
        self.tables_dev = tables_dev

    def __len__(self) -> int:
        return len(self.slots)


def batch_index(caches, positions, n_slots: int) -> np.ndarray:
    """The host index of one decode batch step, int64 ``[1 + n_slots, B]``: row 0 holds the
    positions, row 1 + s the block-table address of forward slot s (the "all" order) of every
    request (:meth:`RuntimeKVCache.table_addresses`). Uploaded once per step, it gives every
    layer slot's ``BatchSlot.positions_dev`` / ``tables_dev`` as views. Raises ConfigError for
    a position without a page (``RuntimeKVCache.ensure`` not run up to it) or a cache laid out
    for another slot count."""
    out = np.empty((1 + n_slots, len(caches)), np.int64)
    out[0] = positions
    for i, (c, p) in enumerate(zip(caches, positions)):
        addrs = c.table_addresses()
        if addrs.shape[0] != n_slots:
            raise ConfigError(f"batch_index: request {i}'s cache has {addrs.shape[0]} forward "
                              f"slots, the batch runs {n_slots}")
        if not 0 <= p < c.length:
            raise ConfigError(f"batch_index: request {i} has pages for positions "
                              f"0..{c.length - 1}, not {p}: call RuntimeKVCache.ensure first")
        out[1:, i] = addrs
    return out


class RuntimeKVCache:
    """A request's paged KV cache over ``n_slots`` slots for up to ``capacity`` positions.

    ``modes``: one storage mode per physical layer (see ``resolve_kv_modes``);
    ``kv_iterations``: the iteration KV policy (``layouts.KV_ITERATIONS``: "all" keeps
    ``P + R*depth + C`` slots, "latest" ``P + R + C``). Slots ``0..n_slots-1`` are the cache's
    own; :meth:`kv_of` takes the forward's slot names (the "all" order) to them. Pages are gained
    by :meth:`ensure` as positions are written; the block tables (one pool block, tag
    ``kv_cache``, int64 ``[n_slots, ceil(capacity / P)]``) are made once and never move.
    Use as a context manager or call :meth:`release`; after release any access raises
    HandleError. Raises ConfigError for a bad mode / capacity, and the pool's
    OutOfMemoryError when a page does not fit (pages taken so far stay owned and are freed by
    release).
    """

    def __init__(self, ops, pool, cfg: ModelConfig, depth: int, capacity: int, modes,
                 allocator: PageAllocator, page_size: int = DEFAULT_PAGE_SIZE,
                 kv_iterations: str = "all"):
        if capacity < 1:
            raise ConfigError(f"KV cache capacity must be >= 1, got {capacity}")
        if len(modes) != cfg.n_layers:
            raise ConfigError(f"need one kv mode per physical layer ({cfg.n_layers}), got "
                              f"{len(modes)}")
        self.depth = depth
        self.capacity = capacity
        self.page_size = page_size
        self.modes = tuple(modes)
        self.config = cfg
        self.kv_iterations = check_kv_iterations(kv_iterations)
        self.layer_of_slot = slot_layers(cfg, depth, kv_iterations)
        self.slot_of = slot_map(cfg, depth, kv_iterations)   # forward's slot -> own slot
        self.n_slots = len(self.layer_of_slot)
        kv_dtype = np.dtype(ops.kv_dtype).name
        layouts = {m: PageLayout.for_config(cfg, m, page_size, kv_dtype) for m in set(modes)}
        self.layouts = [layouts[modes[li]] for li in self.layer_of_slot]
        self.max_pages = -(-capacity // page_size)
        self._ops, self._pool, self._alloc = ops, pool, allocator
        self.table_host = np.zeros((self.n_slots, self.max_pages), np.int64)
        self._table, self._table_block = ops.empty(pool, self.table_host.shape, np.int64,
                                                   "kv_cache")
        self._pages: list[list[Page]] = [[] for _ in range(self.n_slots)]
        self.length = 0               # positions with pages (a multiple of P, or capacity)
        self._addrs = None            # table_addresses(), made on first use
        try:
            self._ops.from_host(self.table_host, self._table)
            self._slots = [SlotKV(self.layouts[s], self._table[s], self.table_host[s],
                                  allocator) for s in range(self.n_slots)]
        except BaseException:
            self.release()
            raise

    @property
    def mode(self) -> str:
        """The mode name when every layer uses one mode, else "mixed"."""
        return self.modes[0] if len(set(self.modes)) == 1 else "mixed"

    @property
    def nbytes(self) -> int:
        """Pool bytes this cache holds: its block tables and its pages."""
        if self._table_block is None:
            return 0
        return self._table_block.nbytes + sum(p.block.nbytes for ps in self._pages for p in ps)

    @property
    def allocator(self) -> PageAllocator:
        """The PageAllocator that owns this cache's pages (their references and holders)."""
        return self._alloc

    @property
    def table_block(self):
        """The pool block of the block tables (None once released)."""
        return self._table_block

    def retag_tables(self, tag: str) -> None:
        """Move the block tables' pool block to ``tag`` (a prefix handle's: prefix_cache)."""
        self._alive()
        self._pool.retag(self._table_block, tag)

    def _alive(self) -> None:
        if self._table_block is None:
            raise HandleError("RuntimeKVCache used after release()")

    def check_alive(self) -> None:
        """Raise HandleError once the cache is released."""
        self._alive()

    def ensure(self, n_positions: int) -> None:
        """Own pages for positions 0..n_positions-1 in every slot: gains whole pages, one
        ``PageAllocator.alloc_many`` per page layout for all slots together, and refreshes the
        device block table with one upload if anything changed. On OutOfMemoryError the
        layouts allocated before stay owned (release() frees them); the failed layout's batch
        leaves nothing."""
        self._alive()
        if n_positions > self.capacity:
            raise ConfigError(f"{n_positions} positions exceed the cache's capacity "
                              f"{self.capacity}")
        need = -(-n_positions // self.page_size)
        if need <= len(self._pages[-1]):          # slots fill in order: the last is last
            return
        wants: dict[PageLayout, list] = {}        # layout -> [(slot, pages it lacks)]
        for s in range(self.n_slots):
            k = need - len(self._pages[s])
            if k > 0:
                wants.setdefault(self.layouts[s], []).append((s, k))
        try:
            for lay, slots in wants.items():
                self._take(lay, slots)
            self.length = min(need * self.page_size, self.capacity)
        finally:
            self._ops.from_host(self.table_host, self._table)

    def _take(self, layout: PageLayout, slots) -> list:
        """Append fresh zeroed pages of ``layout`` to each ``(slot, count)`` of ``slots`` (one
        batch), entering them in the host block table; returns [(slot, first index, pages)]."""
        got = self._alloc.alloc_many(layout, sum(k for _, k in slots))
        out, i = [], 0
        for s, k in slots:
            mine, i = got[i:i + k], i + k
            pages = self._pages[s]
            have = len(pages)
            pages.extend(mine)
            self.table_host[s, have:have + k] = [p.addr for p in mine]
            out.append((s, have, mine))
        return out

    def slot(self, s: int) -> SlotKV:
        self._alive()
        return self._slots[s]

    def table_addresses(self) -> np.ndarray:
        """int64 ``[len(slot_of)]``: the address of the block table of every forward slot s
        (``kv_of(s).table``: row ``slot_of[s]`` of the one table block, which never moves),
        as the CUDA batch kernels read it (:func:`batch_index`). Computed once."""
        self._alive()
        if self._addrs is None:
            row_bytes = self.max_pages * np.dtype(np.int64).itemsize
            self._addrs = (self._table_block.ptr
                           + np.asarray(self.slot_of, np.int64) * row_bytes)
        return self._addrs

    def kv_of(self, s: int) -> SlotKV:
        """The SlotKV holding the forward's slot ``s`` (the "all" order at ``depth``:
        ``slot_map``)."""
        self._alive()
        return self._slots[self.slot_of[s]]

    def page_list(self, s: int) -> list:
        """The Pages slot ``s`` holds, in position order (read-only use)."""
        self._alive()
        return list(self._pages[s])

    def at_depth(self, depth: int) -> "DepthView":
        """This cache, laid out for ``self.depth`` iterations, seen as a cache at ``depth`` <=
        ``self.depth`` (see :class:`DepthView`)."""
        return DepthView(self, depth)

    def share_prefix(self, src: "RuntimeKVCache", m: int, src_slots=None) -> None:
        """Start this empty cache with positions 0..m-1 of ``src`` in every slot it has: slot
        s takes ``src`` slot ``src_slots[s]`` (default s; a cache laid out for more iterations
        passes ``room_slots``), which needs the same page layout and m positions.

        Full pages are shared by reference (refcount + 1; neither holder writes them again:
        writes go to positions >= m). A partly filled last page is copy-on-write: copied into a
        fresh page of this cache's own, whose positions from m on this cache then overwrites.
        Raises ConfigError for a cache that already holds pages or mismatched caches; on an
        OutOfMemoryError the pages taken so far stay owned and release() frees them.
        """
        self._alive()
        src._alive()
        p = self.page_size
        if any(self._pages):
            raise ConfigError("share_prefix needs an empty cache (no pages yet)")
        src_slots = list(range(self.n_slots) if src_slots is None else src_slots)
        if (src.page_size != p or len(src_slots) != self.n_slots
                or not all(0 <= i < src.n_slots for i in src_slots)
                or [src.layouts[i] for i in src_slots] != self.layouts
                or not 0 <= m <= min(self.capacity, src.capacity)
                or any(-(-m // p) > len(src._pages[i]) for i in src_slots)):
            raise ConfigError(f"cannot share {m} positions x {self.n_slots} slots from a cache of "
                              f"{src.capacity} x {src.n_slots} (pages of {src.page_size})")
        full, part = divmod(m, p)
        try:
            for s, i in enumerate(src_slots):
                pages, src_pages = self._pages[s], src._pages[i]
                for k in range(full):
                    pages.append(self._alloc.ref(src_pages[k]))
                self.table_host[s, :full] = [pg.addr for pg in src_pages[:full]]
            if part:                               # copy-on-write last pages, one batch each
                wants: dict[PageLayout, list] = {}
                for s in range(self.n_slots):
                    wants.setdefault(self.layouts[s], []).append((s, 1))
                for lay, slots in wants.items():
                    for s, _, (page,) in self._take(lay, slots):
                        copy_page(src._pages[src_slots[s]][full], page)
        finally:
            self.length = min(len(self._pages[0]) * p, self.capacity)
            self._ops.from_host(self.table_host, self._table)

    def make_private(self, first_slot: int) -> list:
        """Copy-on-write before rewriting slots ``first_slot``..: every page of those slots
        that another holder shares (refs > 1) is replaced by a private copy (fresh pages in one
        batch per layout). Returns the pages let go of (still live: their other holders keep
        them).

        All or nothing: every copy is allocated and filled before any is installed, so on any
        failure (OutOfMemoryError from a batch, an error copying or uploading the block table)
        the cache holds exactly the pages it held before, the fresh ones are freed, and the
        error propagates."""
        self._alive()
        wants: dict[PageLayout, list] = {}       # layout -> [(slot, index)] of shared pages
        for s in range(first_slot, self.n_slots):
            for k, old in enumerate(self._pages[s]):
                if old.refs > 1:
                    wants.setdefault(self.layouts[s], []).append((s, k))
        fresh: list = []                          # (slot, index, new page)
        try:
            for lay, where in wants.items():
                got = self._alloc.alloc_many(lay, len(where))
                fresh += [(s, k, new) for (s, k), new in zip(where, got)]
            for s, k, new in fresh:
                copy_page(self._pages[s][k], new)
        except BaseException:
            self._alloc.unref_many(new for _, _, new in fresh)
            raise
        dropped = []
        for s, k, new in fresh:
            dropped.append(self._pages[s][k])
            self._pages[s][k] = new
            self.table_host[s, k] = new.addr
        try:
            if fresh:
                self._ops.from_host(self.table_host, self._table)
        except BaseException:                     # put the shared pages back
            for (s, k, new), old in zip(fresh, dropped):
                self._pages[s][k] = old
                self.table_host[s, k] = old.addr
            try:
                self._ops.from_host(self.table_host, self._table)
            finally:
                self._alloc.unref_many(new for _, _, new in fresh)
            raise
        self._alloc.unref_many(dropped)
        return dropped

    def release(self) -> None:
        """Drop this request's reference to every page and free the block tables
        (idempotent)."""
        if self._table_block is None:
            return
        pages, self._pages = self._pages, []
        self._slots = []
        self._table = None
        blk, self._table_block = self._table_block, None
        try:
            self._alloc.unref_many(p for ps in pages for p in ps)
        finally:
            self._pool.free(blk)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class DepthView:
    """A RuntimeKVCache laid out for ``cache.depth`` iterations, seen as a cache at ``depth``
    <= ``cache.depth``: slot s at ``depth`` is the cache's slot ``slots[s]``
    (:func:`room_slots`: the coda stays in the last slots, laid out for the coda's layers).
    What a ResumeHandle's forward and deepen write through; ``ensure`` gains pages for every
    slot of the cache. Raises ConfigError for depth > cache.depth."""

    __slots__ = ("cache", "depth", "slots")

    def __init__(self, cache: RuntimeKVCache, depth: int):
        self.cache = cache
        self.depth = depth
        self.slots = room_slots(cache.config, depth, cache.depth)

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def ensure(self, n_positions: int) -> None:
        self.cache.ensure(n_positions)

    def slot(self, s: int) -> SlotKV:
        return self.cache.kv_of(self.slots[s])

    kv_of = slot          # the forward's slot names, as RuntimeKVCache.kv_of takes them


def copy_position(src: SlotKV, dst: SlotKV, pos: int) -> None:
    """Copy position ``pos``'s stored row (every part of its page: K/V codes, scales, or h)
    from slot ``src`` into slot ``dst`` (same page layout), on the pages' device. What an
    early-exiting token leaves in the deeper iterations' slots (``Model.forward_auto``).
    Raises ConfigError for slots of two layouts."""
    if src.layout != dst.layout:
        raise ConfigError("copy_position needs two slots of one page layout")
    i, r = divmod(pos, src.page_size)
    a, b = src.page_parts(i), dst.page_parts(i)
    for name in a:
        b[name][r] = a[name][r]


@dataclass(frozen=True)
class Recon:
    """What a store-h slot's attention needs to rebuild K and V: ``w_kv`` (the K and V rows of
    the layer's QKV weight, a QuantWeight ``[2 kv_dim, d]``), RoPE ``theta``, the
    reconstruction ``chunk`` (positions rebuilt at a time; bounds the scratch), ``scratch``
    (the backend's reconstruction buffers, or None on the NumPy reference), and ``bias``
    (float32 ``[2 kv_dim]``: the K and V rows of a ``qkv_bias`` model's bias, or None)."""

    w_kv: object
    theta: float
    chunk: int
    scratch: object = None
    bias: object = None

