"""Prefix handles: PrefixCache and ResumeHandle (seed 001, "opaque handles that own cache
state across calls"), their pool storage, and loading them from a prefix file.

- :class:`PrefixCache` (``model.prefill(prompt, depth, kv_mode)``): a prefilled prefix at a fixed
  loop depth. It owns the prefix's K/V for every slot of that depth and the final residual rows
  of its positions (float32 ``[n, d_model]``, so ``logits``/``score`` can give the prefix's own
  rows through the head and a prompt equal to the prefix needs no forward), tag
  ``prefix_cache``.
- :class:`ResumeHandle` (``model.resume_handle(prompt, depth=d, max_depth=D)``): a PrefixCache
  whose K/V has room for D iterations, plus a residual snapshot (tag ``resume``): for every
  prompt position the state after iteration d and, when the model injects the prelude output
  (``inject.adapter``), the state entering the recurrent block. ``upgrade(d2)`` runs only
  iterations d+1..d2 and the coda (``Model.deepen``).

A request that starts from a handle (``generate.prefill_request``) takes the handle's K/V and
residual rows for positions 0..m-1 (:meth:`PrefixCache.restore`) and prefills only positions
m..T-1; equality with an uncached run follows because each position's K/V and residual depend
only on positions <= it (causal attention), and the cached ones were computed by the same
forward. Pages are shared by reference, never copied: the request's cache takes a reference to
each full page (``RuntimeKVCache.share_prefix``) and copies only a partly filled last page
(copy-on-write). A handle's storage holds its pages (``PageAllocator.hold``: tag
``prefix_cache`` while any handle holds a page).

Concurrency: every method that touches pool memory or the model's buffers holds the model's
re-entrant lock.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np

from .. import tlpx
from ..config import as_int
from ..errors import ConfigError, HandleError
from .cache import RuntimeKVCache
from .layouts import mode_name, room_slots
from .pages import HELD_TAG


class Releasable:
    """``with handle: ...`` releases it at the end."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class ResidualSnapshot:
    """Per-position residual states of a prompt for depth upgrades (tag ``resume``).

    One pool block of float32 ``[k, n, d_model]``: plane 0 is the state after the last
    recurrent iteration run; plane 1 (only when ``with_entry``, i.e. the model injects the
    prelude output) is the state entering the recurrent block.
    """

    def __init__(self, ops, pool, n: int, d_model: int, with_entry: bool):
        k = 2 if with_entry else 1
        self._data, self._block = ops.empty(pool, (k, n, d_model), np.float32, "resume")
        self.with_entry = with_entry

    @property
    def nbytes(self) -> int:
        return 0 if self._block is None else self._block.nbytes

    @property
    def block(self):
        """The snapshot's pool block (None once released)."""
        return self._block

    @property
    def data(self):
        """The float32 ``[planes, n, d_model]`` array (None once released)."""
        return self._data

    def put_state(self, pos0: int, x) -> None:
        self._data[0, pos0:pos0 + x.shape[0]] = x

    def get_state(self, pos0: int, out) -> None:
        out[...] = self._data[0, pos0:pos0 + out.shape[0]]

    def put_entry(self, pos0: int, x) -> None:
        if self.with_entry:
            self._data[1, pos0:pos0 + x.shape[0]] = x

    def get_entry(self, pos0: int, out) -> None:
        out[...] = self._data[1, pos0:pos0 + out.shape[0]]

    def release(self) -> None:
        if self._block is not None:
            blk, self._block, self._data = self._block, None, None
            blk.pool.free(blk)


class HandleStorage:
    """What a handle holds in the pool: a paged RuntimeKVCache for the slots of ``slot_depth``
    iterations x n positions (its block tables and the pages it holds: tag ``prefix_cache``),
    the final residual rows (float32 ``[n, d_model]``, tag ``prefix_cache``) and, for a
    ResumeHandle, a ResidualSnapshot (tag ``resume``). Nothing stays allocated when a part
    fails to allocate. Call :meth:`hold_pages` once the pages are written: the storage then
    holds them (``PageAllocator.hold``) until it lets go of them."""

    def __init__(self, model, slot_depth: int, n: int, modes: tuple, snapshot: bool = False,
                 kv_iterations: str = "all"):
        ops, pool, cfg = model.ops, model.pool, model.config
        self._model = model
        self.kv = self.rows_block = self.snap = self.rows = None
        self._held: dict = {}                  # addr -> Page this storage holds
        try:
            self.kv = model.new_kv_cache(slot_depth, n, kv_mode=modes,
                                         kv_iterations=kv_iterations)
            self.kv.retag_tables(HELD_TAG)
            self.rows, self.rows_block = ops.empty(pool, (n, cfg.d_model), np.float32,
                                                   "prefix_cache")
            if snapshot:
                self.snap = ResidualSnapshot(ops, pool, n, cfg.d_model,
                                             with_entry=model.injects)
        except BaseException:
            self.release()
            raise

    def hold_pages(self) -> None:
        """Hold every page of the cache not held yet (tags them prefix_cache)."""
        for s in range(self.kv.n_slots):
            for page in self.kv.page_list(s):
                if page.addr not in self._held:
                    self.kv.allocator.hold(page)
                    self._held[page.addr] = page

    def pages(self) -> dict:
        """addr -> Page of every page this storage holds."""
        return dict(self._held)

    def fixed_bytes(self) -> int:
        """Bytes that are this storage's alone: block tables, rows, snapshot."""
        return sum(b.nbytes for b in self.blocks)

    @property
    def nbytes(self) -> int:
        """Pool bytes held: tables, rows, snapshot and every page (shared ones in full)."""
        return self.fixed_bytes() + sum(p.block.nbytes for p in self._held.values())

    @property
    def blocks(self) -> list:
        """The pool blocks this storage owns alone (pages are reference counted)."""
        out = [self.kv.table_block, self.rows_block]
        return out + ([self.snap.block] if self.snap is not None else [])

    def make_private(self, first_slot: int) -> None:
        """Copy-on-write before rewriting slots first_slot..: shared pages become private.
        All or nothing (``RuntimeKVCache.make_private``): on failure nothing has changed."""
        alloc = self.kv.allocator
        for old in self.kv.make_private(first_slot):
            del self._held[old.addr]
            alloc.drop(old)
        self.hold_pages()

    def host_state(self) -> dict:
        """Host copies: ``kv``, one dict per slot of part name -> array ``[n, ...]`` (each
        part's dtype, see ``kv.layouts.PageLayout``), ``rows`` float32 ``[n, d_model]``, and
        ``snapshot`` float32 ``[planes, n, d_model]`` when there is one."""
        to_host = self._model.ops.to_host
        n = self.kv.capacity
        kv = []
        for s in range(self.kv.n_slots):
            pages = self.kv.page_list(s)
            kv.append({part.name: np.concatenate([to_host(pg.parts[part.name])
                                                  for pg in pages])[:n]
                       for part in self.kv.layouts[s].parts})
        out = {"kv": kv, "rows": np.ascontiguousarray(to_host(self.rows))}
        if self.snap is not None:
            out["snapshot"] = np.ascontiguousarray(to_host(self.snap.data))
        return out

    def load_host_state(self, state: dict) -> None:
        """Write arrays shaped as :meth:`host_state` gives them into fresh pages (cast to
        each part's dtype), then hold the pages."""
        ops = self._model.ops
        n = self.kv.capacity
        self.kv.ensure(n)
        p = self.kv.page_size
        for s in range(self.kv.n_slots):
            for k, page in enumerate(self.kv.page_list(s)):
                lo, hi = k * p, min(n, (k + 1) * p)
                for part in self.kv.layouts[s].parts:
                    dst = page.parts[part.name]
                    src = np.asarray(state["kv"][s][part.name][lo:hi], dtype=dst.dtype)
                    host = np.zeros(dst.shape, dtype=dst.dtype)
                    host[:hi - lo] = src
                    ops.from_host(host, dst)
        ops.from_host(np.ascontiguousarray(state["rows"], dtype=np.float32), self.rows)
        if self.snap is not None:
            ops.from_host(np.ascontiguousarray(state["snapshot"], dtype=np.float32),
                          self.snap.data)
        self.hold_pages()

    def release(self) -> None:
        kv, rows_block, snap = self.kv, self.rows_block, self.snap
        self.kv = self.rows_block = self.snap = self.rows = None
        held, self._held = self._held, {}
        for page in held.values():              # before the unref: the pages are still live
            kv.allocator.drop(page)
        if kv is not None:
            kv.release()
        if rows_block is not None:
            rows_block.pool.free(rows_block)
        if snap is not None:
            snap.release()


def _orphaned(model, kind: str, n: int, storage: HandleStorage) -> None:
    """weakref.finalize callback of a handle dropped without release(). It may run inside any
    allocation (the garbage collector's choice), so it only queues the storage; the model
    releases queued storage when it next makes a KV cache (a request, a handle) or at free
    (``KVRegistry.drain``)."""
    if storage.kv is not None:
        warnings.warn(f"a {kind} of {n} tokens was garbage-collected without release(); its "
                      f"{storage.nbytes} bytes are freed at the model's next request",
                      ResourceWarning, stacklevel=2)
        model.kv_registry.orphan(storage)


class PrefixCache(Releasable):
    """A prefilled prefix at a fixed loop depth. Create with :meth:`Model.prefill` (or
    :meth:`Model.load_prefix`); pass as ``prefix=`` to generate / stream / logits / score.

    Attributes: ``tokens`` (tuple of int ids), ``depth`` (loop iterations it was prefilled
    at), ``kv_mode`` (the KV storage mode name, or a per-layer tuple when layers differ),
    ``nbytes`` (pool bytes it holds: the pages of ``n_slots(depth)`` slots x ``len(tokens)``
    positions -- shared pages counted in full -- its block tables, and float32 ``[n,
    d_model]`` final residual rows; tag ``prefix_cache``), ``exit_key``: (exit rule,
    threshold, max depth) of a prefix prefilled at depth="auto" (its positions ran at the max
    depth, ``tinyloop.adaptive``; only requests under the same rule take it), else None; a
    saved one loads as a fixed-depth prefix at its max depth. ``release()`` (idempotent) or
    ``with`` frees them; any later use raises HandleError. Freeing the model releases its
    handles.
    """

    kind = "PrefixCache"

    def __init__(self, model, ids: np.ndarray, depth: int, modes: tuple,
                 storage: HandleStorage, exit_key: tuple | None = None):
        self._model = model
        self._ids = np.array(ids, dtype=np.int32)
        self._ids.setflags(write=False)
        self._tokens = tuple(int(t) for t in self._ids)
        self._depth = int(depth)
        self._modes = tuple(modes)
        self._exit_key = exit_key
        self._policy = storage.kv.kv_iterations
        self._st = storage
        self._finalizer = weakref.finalize(self, _orphaned, model, self.kind, len(self._ids),
                                           storage)
        model.kv_registry.add_handle(self)

    # -- public surface ---------------------------------------------------------------------
    @property
    def tokens(self) -> tuple:
        return self._tokens

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def kv_mode(self):
        return mode_name(self._modes)

    @property
    def exit_key(self) -> tuple | None:
        return self._exit_key

    @property
    def kv_iterations(self) -> str:
        """The iteration KV policy its K/V is kept under ("all" | "latest")."""
        return self._policy

    @property
    def nbytes(self) -> int:
        """Pool bytes held (0 once released)."""
        return 0 if self._st is None else self._st.nbytes

    @property
    def released(self) -> bool:
        return self._st is None

    def __len__(self) -> int:
        return len(self._ids)

    def release(self) -> None:
        """Free the handle's pool memory (idempotent); later use raises HandleError."""
        with self._model.lock:
            if self._st is None:
                return
            self._finalizer.detach()
            st, self._st = self._st, None
            st.release()
            self._model.kv_registry.discard_handle(self)

    def save(self, path) -> int:
        """Write the prefix to ``path`` (format: ``tinyloop.tlpx.write_prefix``); returns the
        bytes written. Raises HandleError after release, FileWriteError (an OSError naming
        ``path``) when the file system fails; nothing is left behind and the handle is
        unchanged."""
        model = self._model
        if self._policy != "all":
            raise ConfigError("a prefix kept under kv_iterations='latest' cannot be saved "
                              "(the .tlpx format holds one slot per iteration)")
        with model.lock:
            self.check()
            state = self._st.host_state()
            max_depth = getattr(self, "max_depth", self._depth)
            fingerprint = model.fingerprint
        return tlpx.write_prefix(path, fingerprint=fingerprint, cfg=model.config,
                                 resume=isinstance(self, ResumeHandle),
                                 kv_dtype=model.ops.kv_dtype, depth=self._depth,
                                 max_depth=max_depth, ids=self._ids, modes=self._modes,
                                 state=state)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.nbytes} B"
        return (f"{self.kind}({len(self._ids)} tokens, depth={self._depth}, "
                f"kv_mode={self.kv_mode!r}, {state})")

    # -- the kv package's and the request's surface (call under the model's lock) ----------
    @property
    def model(self):
        return self._model

    @property
    def ids(self) -> np.ndarray:
        """The prefix's token ids, int32 ``[n]`` (read-only)."""
        return self._ids

    @property
    def modes(self) -> tuple:
        """One KV mode per physical layer."""
        return self._modes

    @property
    def storage(self) -> "HandleStorage | None":
        """What the handle holds in the pool (None once released)."""
        return self._st

    def check(self, model=None) -> None:
        """Raise HandleError when released or tied to another model (call under the lock)."""
        if self._st is None:
            raise HandleError(f"this {self.kind} was released; make a new one")
        if model is not None and model is not self._model:
            raise HandleError(f"this {self.kind} belongs to another Model "
                              f"({self._model.path!r})")
        self._model.check_alive()

    def restore(self, cache: RuntimeKVCache, m: int, rows_out) -> None:
        """Start a request's (empty) cache with positions 0..m-1 of the slots it has (full
        pages by reference, a partly filled last page copied) and copy their final residual
        rows into ``rows_out`` (float32 ``[m, d_model]``). Raises HandleError after release,
        ConfigError for a cache of another depth or layout. Call under the model's lock."""
        self.check()
        kv = self._st.kv
        cache.share_prefix(kv, m, None if self._policy == "latest" else
                           room_slots(self._model.config, self._depth, kv.depth))
        rows_out[...] = self._st.rows[:m]


# -- ResumeHandle -----------------------------------------------------------------------------
class ResumeHandle(PrefixCache):
    """A prefix prefilled at ``depth`` that can be deepened up to ``max_depth``. Create with
    :meth:`Model.resume_handle`; pass as ``prefix=`` to continue from it at ``rh.depth``.

    Besides a PrefixCache's storage it holds K/V room for ``n_slots(max_depth)`` slots and the
    residual snapshot (tag ``resume``, float32 ``[1 or 2, n, d_model]``, see
    :class:`ResidualSnapshot`). The slots are laid out as at ``max_depth`` with the coda's in
    the last ones whatever the depth (``kv.layouts.room_slots``), so every slot keeps the page
    layout of its own layer kind under a per-kind ``kv_mode``. Using it as a prefix never
    changes it, so restore-and-decode cycles repeat exactly.
    """

    kind = "ResumeHandle"

    def __init__(self, model, ids, depth, modes, storage: HandleStorage, max_depth: int):
        super().__init__(model, ids, depth, modes, storage)
        self._max_depth = int(max_depth)

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def upgrade(self, depth: int) -> "ResumeHandle":
        """Deepen to ``depth`` (current depth < depth <= max_depth): runs recurrent iterations
        depth_now+1..depth and the coda over every position, nothing else; afterwards the
        handle equals a fresh ``resume_handle(prompt, depth=depth)``. Returns self.

        Raises ConfigError for a depth outside (depth, max_depth], HandleError after release,
        OutOfMemoryError when the private copies of pages that requests share do not fit: then
        nothing has changed (the handle stays at its depth, no byte stays allocated). If the
        forward itself fails part-way the handle is released (never left half-deepened).
        """
        depth = as_int(depth, "depth")
        with self._model.lock:
            self.check()
            if not self._depth < depth <= self._max_depth:
                raise ConfigError(f"upgrade depth={depth} must be in {self._depth + 1}.."
                                  f"{self._max_depth} (the handle is at depth {self._depth}, "
                                  f"max_depth {self._max_depth})")
            n = len(self._ids)
            cfg = self._model.config
            self._model.kv_registry.drain()
            # requests restored from this handle share its pages: the slots the upgrade
            # rewrites get private copies first (all or nothing, so a failure changes nothing)
            self._st.make_private(cfg.n_prelude + cfg.n_recurrent * self._depth)
            try:
                self._model.deepen(0, n, self._depth, depth, self._st.kv.at_depth(depth),
                                   self._st.snap)
                self._st.rows[...] = self._model.residual_rows(0, n)
            except BaseException:
                self.release()
                raise
            self._depth = depth
        return self

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", max_depth={self._max_depth})"


def load_prefix(model, path) -> PrefixCache:
    """:meth:`Model.load_prefix`: a PrefixCache or ResumeHandle from a prefix file.

    The file is read and checked in full first (``tlpx.read_prefix``: every field against the
    model and the file's length, the checksum), then its KV modes against the backend, and only
    then is anything allocated. Raises what ``tlpx.read_prefix`` raises, ConfigError (a KV mode
    this backend cannot run), ModelFreedError, OutOfMemoryError; on any failure nothing stays
    allocated and no other handle or pool entry is touched.
    """
    model.check_alive()
    f = tlpx.read_prefix(path, cfg=model.config, fingerprint=model.fingerprint,
                         max_seq_len=model.max_seq_len, injects=model.injects)
    modes = model.resolve_kv_modes(f.modes)          # ConfigError: a mode this backend lacks
    with model.lock:
        model.check_alive()
        st = HandleStorage(model, f.max_depth, len(f.ids), modes, snapshot=f.resume)
        try:
            st.load_host_state(f.state)
            if f.resume:
                return ResumeHandle(model, f.ids, f.depth, modes, st, f.max_depth)
            return PrefixCache(model, f.ids, f.depth, modes, st)
        except BaseException:
            st.release()
            raise
