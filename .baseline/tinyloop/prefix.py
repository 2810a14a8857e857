"""Prefix caching for looped models: PrefixCache, ResumeHandle and PrefixPool (seed 001,
"opaque handles that own cache state across calls").

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
- :class:`PrefixPool`: many prefix caches under one model, keyed by (model fingerprint, depth,
  kv_mode, token ids), with LRU eviction of exactly the shortfall under ``max_bytes``.

A request that starts from a cached prefix (``generate``/``stream``/``logits``/``score`` with
``prefix=`` or ``prefix_pool=``) takes the prefix's K/V and residual rows for positions
0..m-1 and prefills only positions m..T-1; equality with an uncached run follows because each
position's K/V and residual depend only on positions <= it (causal attention), and the cached
ones were computed by the same forward.

Pages are shared by reference, never copied (issue 8's paged KV cache): a request that starts
from a prefix takes a reference to each of the prefix's full pages (``RuntimeKVCache.
share_prefix``) and copies only a partly filled last page (copy-on-write), and a PrefixPool
entry takes the finished prompt's full pages the same way. A page is tagged ``prefix_cache``
while any prefix handle holds it and ``kv_cache`` otherwise (``MemoryPool.retag``), so the
memory pool counts a shared page once, under the tag of what keeps it alive longest.

The prefix file format (``PrefixCache.save`` / ``Model.load_prefix``) is specified in
:func:`save_prefix`.

Concurrency: every method that touches pool memory or the model's buffers holds the model's
re-entrant lock; a PrefixPool's entries and counters are guarded by that same lock.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
import weakref
from collections import OrderedDict

import numpy as np

from .config import as_int, parse_size
from .errors import (BadMagicError, ConfigError, FormatError, HandleError, OutOfMemoryError,
                     SizeOverflowError, TokenizerError, TruncatedFileError,
                     UnsupportedVersionError)
from .fileio import write_bytes
from .config import KV_MODES
from .kvcache import DEFAULT_PAGE_SIZE, PageLayout, RuntimeKVCache, room_slots, slot_layers
from .memory import round_size


# -- shared helpers ---------------------------------------------------------------------------
def mode_name(modes: tuple):
    """A handle's public ``kv_mode``: the mode name when every layer uses one, else the
    per-layer tuple."""
    return modes[0] if len(set(modes)) == 1 else tuple(modes)


def _hold(model, page) -> None:
    """A prefix handle takes hold of ``page``: the first holder moves it to prefix_cache."""
    holds = model._prefix_holds
    n = holds.get(page.addr, 0)
    if n == 0:
        model.pool.retag(page.block, "prefix_cache")
    holds[page.addr] = n + 1


def _drop(model, page) -> None:
    """A prefix handle lets go of ``page`` (still live): with no holder left it is a request's
    page again (kv_cache), or freed when the handle's unref is the last."""
    holds = model._prefix_holds
    n = holds[page.addr] - 1
    if n:
        holds[page.addr] = n
    else:
        del holds[page.addr]
        model.pool.retag(page.block, "kv_cache")


def _depth_arg(model, depth) -> int:
    return model.config.check_depth(as_int(depth, "depth") if depth is not None else None)


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
    fails to allocate. Call :meth:`hold_pages` once the pages are written."""

    def __init__(self, model, slot_depth: int, n: int, modes: tuple, snapshot: bool = False):
        ops, pool, cfg = model.ops, model.pool, model.config
        self._model = model
        self.kv = self.rows_block = self.snap = self.rows = None
        self._held: dict = {}                  # addr -> Page this storage holds
        try:
            self.kv = model.new_kv_cache(slot_depth, n, kv_mode=modes)
            pool.retag(self.kv._table_block, "prefix_cache")
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
                    _hold(self._model, page)
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
        out = [self.kv._table_block, self.rows_block]
        return out + ([self.snap._block] if self.snap is not None else [])

    def make_private(self, first_slot: int) -> None:
        """Copy-on-write before rewriting slots first_slot..: shared pages become private.
        All or nothing (``RuntimeKVCache.make_private``): on failure nothing has changed."""
        for old in self.kv.make_private(first_slot):
            del self._held[old.addr]
            _drop(self._model, old)
        self.hold_pages()

    def host_state(self) -> dict:
        """Host copies: ``kv``, one dict per slot of part name -> array ``[n, ...]`` (each
        part's dtype, see ``kvcache.PageLayout``), ``rows`` float32 ``[n, d_model]``, and
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
            out["snapshot"] = np.ascontiguousarray(to_host(self.snap._data))
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
                          self.snap._data)
        self.hold_pages()

    def release(self) -> None:
        kv, rows_block, snap = self.kv, self.rows_block, self.snap
        self.kv = self.rows_block = self.snap = self.rows = None
        held, self._held = self._held, {}
        for page in held.values():              # before the unref: the pages are still live
            _drop(self._model, page)
        if kv is not None:
            kv.release()
        if rows_block is not None:
            rows_block.pool.free(rows_block)
        if snap is not None:
            snap.release()


def _orphaned(model, kind: str, n: int, storage: HandleStorage) -> None:
    """weakref.finalize callback of a handle dropped without release(). It may run inside any
    allocation (the garbage collector's choice), so it only queues the storage; the model
    releases queued storage at its next prefix operation or at free (:func:`drain_orphans`)."""
    if storage.kv is not None:
        warnings.warn(f"a {kind} of {n} tokens was garbage-collected without release(); its "
                      f"{storage.nbytes} bytes are freed at the model's next prefix operation",
                      ResourceWarning, stacklevel=2)
        model._prefix_orphans.append(storage)


def drain_orphans(model) -> None:
    """Release the storage of handles that were garbage-collected unreleased (call under the
    model's lock)."""
    while model._prefix_orphans:
        model._prefix_orphans.pop().release()


class _Releasable:
    """``with handle: ...`` releases it at the end."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class PrefixCache(_Releasable):
    """A prefilled prefix at a fixed loop depth. Create with :meth:`Model.prefill` (or
    :meth:`Model.load_prefix`); pass as ``prefix=`` to generate / stream / logits / score.

    Attributes: ``tokens`` (tuple of int ids), ``depth`` (loop iterations it was prefilled
    at), ``kv_mode`` (the KV storage mode name, or a per-layer tuple when layers differ),
    ``nbytes`` (pool bytes it holds: the pages of ``n_slots(depth)`` slots x ``len(tokens)``
    positions -- shared pages counted in full -- its block tables, and float32 ``[n,
    d_model]`` final residual rows; tag ``prefix_cache``). ``release()`` (idempotent) or
    ``with`` frees them; any later use raises HandleError. Freeing the model releases its
    handles.
    """

    kind = "PrefixCache"

    def __init__(self, model, ids: np.ndarray, depth: int, modes: tuple,
                 storage: HandleStorage):
        self._model = model
        self._ids = np.array(ids, dtype=np.int32)
        self._ids.setflags(write=False)
        self._tokens = tuple(int(t) for t in self._ids)
        self._depth = int(depth)
        self._modes = tuple(modes)
        self._st = storage
        self._finalizer = weakref.finalize(self, _orphaned, model, self.kind, len(self._ids),
                                           storage)
        model._handles.add(self)

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
            self._model._handles.discard(self)

    def _model_freed(self) -> None:
        self.release()

    def save(self, path) -> int:
        """Write the prefix to ``path`` (format: :func:`save_prefix`); returns bytes written.
        Raises HandleError after release, OSError from the file system."""
        return save_prefix(self, path)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.nbytes} B"
        return (f"{self.kind}({len(self._ids)} tokens, depth={self._depth}, "
                f"kv_mode={self.kv_mode!r}, {state})")

    # -- internal ---------------------------------------------------------------------------
    def _check(self, model=None) -> None:
        """Raise HandleError when released or tied to another model (call under the lock)."""
        if self._st is None:
            raise HandleError(f"this {self.kind} was released; make a new one")
        if model is not None and model is not self._model:
            raise HandleError(f"this {self.kind} belongs to another Model "
                              f"({self._model.path!r})")
        self._model.check_alive()

    def _restore(self, cache: RuntimeKVCache, m: int) -> None:
        """Start a request's (empty) cache with positions 0..m-1 of the slots it has (full
        pages by reference, a partly filled last page copied) and copy the final residual rows
        into the model's residual buffer. Call under the model lock."""
        kv = self._st.kv
        cache.share_prefix(kv, m, room_slots(self._model.config, self._depth, kv.depth))
        self._model.residual_rows(0, m)[...] = self._st.rows[:m]


def _prompt_ids(model, prompt) -> np.ndarray:
    ids = model.encode_prompt(prompt)
    if len(ids) > model.max_seq_len:
        raise ConfigError(f"prompt ({len(ids)} tokens) exceeds max_seq_len={model.max_seq_len}")
    return ids


def make_prefix(model, prompt, depth=None, kv_mode=None) -> PrefixCache:
    """:meth:`Model.prefill`: prefill ``prompt`` at ``depth`` into a new PrefixCache."""
    model.check_alive()
    depth = _depth_arg(model, depth)
    modes = model.resolve_kv_modes(kv_mode)
    ids = _prompt_ids(model, prompt)
    with model.lock:
        model.check_alive()
        drain_orphans(model)
        st = HandleStorage(model, depth, len(ids), modes)
        try:
            model.forward(ids, 0, depth, st.kv)
            st.rows[...] = model.residual_rows(0, len(ids))
            st.hold_pages()
            return PrefixCache(model, ids, depth, modes, st)
        except BaseException:
            st.release()
            raise


# -- ResumeHandle -----------------------------------------------------------------------------
class ResumeHandle(PrefixCache):
    """A prefix prefilled at ``depth`` that can be deepened up to ``max_depth``. Create with
    :meth:`Model.resume_handle`; pass as ``prefix=`` to continue from it at ``rh.depth``.

    Besides a PrefixCache's storage it holds K/V room for ``n_slots(max_depth)`` slots and the
    residual snapshot (tag ``resume``, float32 ``[1 or 2, n, d_model]``, see
    :class:`ResidualSnapshot`). The slots are laid out as at ``max_depth`` with the coda's in
    the last ones whatever the depth (``kvcache.room_slots``), so every slot keeps the page
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
            self._check()
            if not self._depth < depth <= self._max_depth:
                raise ConfigError(f"upgrade depth={depth} must be in {self._depth + 1}.."
                                  f"{self._max_depth} (the handle is at depth {self._depth}, "
                                  f"max_depth {self._max_depth})")
            n = len(self._ids)
            cfg = self._model.config
            drain_orphans(self._model)
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


def make_resume_handle(model, prompt, depth=None, max_depth=None, kv_mode=None) -> ResumeHandle:
    """:meth:`Model.resume_handle`: prefill at ``depth`` keeping what upgrades need."""
    model.check_alive()
    cfg = model.config
    depth = _depth_arg(model, depth)
    max_depth = cfg.max_depth if max_depth is None else as_int(max_depth, "max_depth")
    if not depth <= max_depth <= cfg.max_depth:
        raise ConfigError(f"max_depth={max_depth} must be in {depth}..{cfg.max_depth} "
                          f"(depth={depth}, the model's max_depth={cfg.max_depth})")
    modes = model.resolve_kv_modes(kv_mode)
    ids = _prompt_ids(model, prompt)
    n = len(ids)
    with model.lock:
        model.check_alive()
        drain_orphans(model)
        st = HandleStorage(model, max_depth, n, modes, snapshot=True)
        try:
            model.forward(ids, 0, depth, st.kv.at_depth(depth), snapshot=st.snap)
            st.rows[...] = model.residual_rows(0, n)
            st.hold_pages()
            return ResumeHandle(model, ids, depth, modes, st, max_depth)
        except BaseException:
            st.release()
            raise


# -- PrefixPool -------------------------------------------------------------------------------
_KEY_MAGIC = b"TLPK\x02"


def encode_key(fingerprint: bytes, depth: int, modes, ids) -> bytes:
    """The pool key as bytes: an injective encoding of (model fingerprint, depth, KV modes,
    token ids), so two different keys never compare equal.

    Layout: ``b"TLPK\x02"``, the 32-byte fingerprint, u32 depth, u16 count of modes, each
    mode as u8 length + ASCII (one per physical layer, or one name), u32 token count, then the
    ids as little-endian u32. Every variable-length field is length-prefixed and the rest are
    fixed-width, so the bytes decode back to one key only.
    """
    if len(fingerprint) != 32:
        raise ConfigError(f"a model fingerprint has 32 bytes, got {len(fingerprint)}")
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    parts = [_KEY_MAGIC, fingerprint, struct.pack("<IH", depth, len(modes))]
    for m in modes:
        b = m.encode("ascii")
        parts += [struct.pack("<B", len(b)), b]
    ids = np.asarray(ids)
    parts += [struct.pack("<I", ids.size), ids.astype("<u4").tobytes()]
    return b"".join(parts)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixPool(_Releasable):
    """Many prefix caches for one model, with LRU eviction under a byte budget.

    ``PrefixPool(model, max_bytes=None)``: ``max_bytes`` is an int, a size string ("64M"), or
    None (unbounded). Pass as ``prefix_pool=`` to generate / stream / logits / score: the
    request reuses the longest cached prefix of its prompt among entries with the same key
    (model fingerprint, depth, kv_mode; see :func:`encode_key`) -- token granular: with the
    paged cache, full pages by reference and the partly matched last page copy-on-write --
    and the finished prompt is inserted as a new entry (replacing entries it extends, which it
    contains). Inserting evicts the least recently used entries whose bytes cover exactly the
    shortfall (oldest first, stopping as soon as the new entry fits); an entry larger than
    ``max_bytes`` is not inserted. The new entry is made before any entry goes, so an insert
    that fails (out of memory) leaves the entries as they were.

    ``stats()`` gives hits, misses, hit_tokens, evictions, entries, bytes, max_bytes (and
    inserts, replaced, rejected: entries over max_bytes or that did not fit the memory pool's
    budget -- an insert never fails the request). ``bytes`` is what the memory pool holds
    under tag ``prefix_cache`` for this pool's entries: their block tables and rows, and every
    page they hold counted once however many entries share it. Eviction counts bytes the same
    way: an evicted entry frees only the pages no remaining entry (nor the new one) holds.
    ``clear()`` frees every entry; ``release()`` (or ``with``, or freeing the model) clears it
    for good. Raises ConfigError for a bad budget or a model that is not a live Model,
    HandleError when used with another model or after release.
    """

    def __init__(self, model, max_bytes=None):
        if not (callable(getattr(model, "resolve_kv_modes", None))
                and isinstance(getattr(model, "_handles", None), weakref.WeakSet)):
            raise ConfigError(f"PrefixPool needs a tinyloop Model, got {type(model).__name__}")
        model.check_alive()
        if max_bytes is not None:
            if isinstance(max_bytes, str):
                max_bytes = parse_size(max_bytes, name="max_bytes")
            elif isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)):
                raise ConfigError(f"max_bytes must be None, an int or a size string, "
                                  f"got {max_bytes!r}")
            max_bytes = int(max_bytes)
            if max_bytes < 0:
                raise ConfigError(f"max_bytes must be >= 0, got {max_bytes}")
        model.fingerprint                # hashed now: a changed model file fails here, not later
        self._model = model
        self._max_bytes = max_bytes
        self._entries: OrderedDict[bytes, PrefixCache] = OrderedDict()  # LRU: oldest first
        self._bytes = 0          # tables + rows of the entries + their distinct pages
        self._page_refs: dict = {}   # addr -> entries holding that page (guarded by model.lock)
        self._released = False
        self._counts = dict(hits=0, misses=0, hit_tokens=0, evictions=0, inserts=0,
                            replaced=0, rejected=0)
        model._handles.add(self)

    @property
    def model(self):
        return self._model

    @property
    def max_bytes(self):
        return self._max_bytes

    def key(self, tokens, depth: int, kv_mode=None) -> bytes:
        """This pool's key for ``tokens`` at ``depth``/``kv_mode`` (None: the model's default;
        see :func:`encode_key`)."""
        return encode_key(self._model.fingerprint, depth,
                          self._model.resolve_kv_modes(kv_mode),
                          self._model.check_token_ids(tokens, "tokens"))

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        """Counters and holdings: hits, misses, hit_tokens, evictions, inserts, replaced,
        rejected (entries over max_bytes), entries, bytes, max_bytes."""
        with self._model.lock:
            return dict(self._counts, entries=len(self._entries), bytes=self._bytes,
                        max_bytes=self._max_bytes)

    def clear(self) -> None:
        """Release every entry (bytes back to 0); the counters stay."""
        with self._model.lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
            self._bytes = 0
            self._page_refs = {}
            for e in entries:
                e.release()
            drain_orphans(self._model)

    def release(self) -> None:
        """Clear and refuse further use (idempotent)."""
        with self._model.lock:
            self.clear()
            self._released = True
            self._model._handles.discard(self)

    def _model_freed(self) -> None:
        self.release()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PrefixPool({s['entries']} entries, {s['bytes']} B of "
                f"{'unbounded' if s['max_bytes'] is None else s['max_bytes']}, "
                f"{s['hits']} hits / {s['misses']} misses)")

    # -- under the model lock ---------------------------------------------------------------
    def _check(self, model) -> None:
        if self._released:
            raise HandleError("this PrefixPool was released (or its model freed)")
        if model is not self._model:
            raise HandleError(f"this PrefixPool belongs to another Model "
                              f"({self._model.path!r}); make one per model")

    def _lookup(self, ids: np.ndarray, depth: int, modes: tuple):
        """(entry, m): the entry sharing the longest prefix of ``ids`` at ``depth``/``modes``
        and that length (0 and None on a miss). Counts the hit or miss; refreshes its LRU."""
        best, best_m = None, 0
        for e in self._entries.values():
            if e._depth == depth and e._modes == modes:
                m = _common_prefix(e._ids, ids)
                if m > best_m:
                    best, best_m = e, m
        if best is None:
            self._counts["misses"] += 1
            return None, 0
        self._counts["hits"] += 1
        self._counts["hit_tokens"] += best_m
        self._entries.move_to_end(self._key_of(best))
        return best, best_m

    def _key_of(self, e: PrefixCache) -> bytes:
        return encode_key(self._model.fingerprint, e._depth, e._modes, e._ids)

    def entry_bytes(self, n_tokens: int, depth: int, kv_mode=None) -> int:
        """Pool bytes an entry of ``n_tokens`` positions at ``depth`` holds when it shares no
        page with another entry: its pages, its block tables, its final residual rows."""
        model = self._model
        cfg = model.config
        modes = model.resolve_kv_modes(kv_mode)
        cache_slots = slot_layers(cfg, depth)
        pages = -(-n_tokens // _page_size(model))
        page_bytes = sum(round_size(_layout(model, modes[li]).page_bytes) for li in cache_slots)
        return (pages * page_bytes + round_size(len(cache_slots) * pages * 8)
                + round_size(n_tokens * cfg.d_model * 4))

    def _add(self, key: bytes, e: PrefixCache) -> None:
        self._entries[key] = e
        self._bytes += e._st.fixed_bytes()
        for addr, page in e._st.pages().items():
            n = self._page_refs.get(addr, 0)
            if n == 0:
                self._bytes += page.block.nbytes
            self._page_refs[addr] = n + 1

    def _remove(self, key: bytes) -> PrefixCache:
        e = self._entries.pop(key)
        self._bytes -= e._st.fixed_bytes()
        for addr, page in e._st.pages().items():
            n = self._page_refs[addr] - 1
            if n:
                self._page_refs[addr] = n
            else:
                del self._page_refs[addr]
                self._bytes -= page.block.nbytes
        e.release()
        return e

    def _insert(self, ids: np.ndarray, depth: int, modes: tuple, cache: RuntimeKVCache) -> None:
        """Insert the request's prompt (its K/V in ``cache`` positions 0..T-1, its final rows in
        the model's residual buffer): the entry takes the full pages by reference and copies
        a partly filled last page. The new entry is made first, so an insert that fails
        (OutOfMemoryError: counted as rejected; anything else: raised) leaves the entries as
        they were. Then entries it extends are dropped (it contains them), and the least
        recently used entries go, oldest first, until the pool is back within max_bytes."""
        model = self._model
        key = encode_key(model.fingerprint, depth, modes, ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        n = len(ids)
        if self._max_bytes is not None and self.entry_bytes(n, depth, modes) > self._max_bytes:
            self._counts["rejected"] += 1              # larger than the whole budget
            return
        try:
            st = HandleStorage(model, depth, n, modes)
            try:
                st.kv.share_prefix(cache, n)
            except BaseException:
                st.release()
                raise
        except OutOfMemoryError:
            # a cache insert is best-effort: under a memory budget the request still succeeds
            self._counts["rejected"] += 1
            return
        try:
            st.rows[...] = model.residual_rows(0, n)
            st.hold_pages()
            entry = PrefixCache(model, ids, depth, modes, st)
        except BaseException:
            st.release()
            raise
        # nothing below allocates: the entry is in, and the pool only lets go of entries
        self._add(key, entry)
        self._counts["inserts"] += 1
        for k, e in list(self._entries.items()):
            if (k != key and e._depth == depth and e._modes == modes and len(e) <= n
                    and _common_prefix(e._ids, ids) == len(e)):
                self._remove(k)
                self._counts["replaced"] += 1
        if self._max_bytes is not None:
            # an evicted entry frees only the pages no other entry (the new one included) holds
            while self._bytes > self._max_bytes:
                oldest = next(iter(self._entries))
                if oldest == key:                      # the new entry is the newest
                    break
                self._remove(oldest)
                self._counts["evictions"] += 1


def _page_size(model) -> int:
    return DEFAULT_PAGE_SIZE


def _layout(model, mode: str) -> PageLayout:
    return model.kv_page_layout(mode, _page_size(model))


# -- requests that start from a cache (called by generate.py) ---------------------------------
def check_prefix_args(model, ids: np.ndarray, depth, kv_mode, prefix, prefix_pool):
    """Validate ``prefix=`` / ``prefix_pool=`` for a request of ``ids``; return the resolved
    (depth, modes: one KV mode per physical layer). A prefix fixes both: a different explicit
    depth or kv_mode is a ConfigError (never a silent re-prefill), as is a prompt that does
    not start with the prefix's tokens (the message names the first position that differs)."""
    if prefix is not None and prefix_pool is not None:
        raise ConfigError("pass prefix= or prefix_pool=, not both")
    if prefix is not None:
        if not isinstance(prefix, PrefixCache):
            raise ConfigError(f"prefix must be a PrefixCache or ResumeHandle, got "
                              f"{type(prefix).__name__}")
        with model.lock:
            prefix._check(model)
            p_depth, p_modes = prefix._depth, prefix._modes
        if depth is not None and _depth_arg(model, depth) != p_depth:
            raise ConfigError(f"depth={depth} differs from the prefix's depth {p_depth}; "
                              f"prefill the prefix at that depth (or upgrade a ResumeHandle)")
        if kv_mode is not None and model.resolve_kv_modes(kv_mode) != p_modes:
            raise ConfigError(f"kv_mode={kv_mode!r} differs from the prefix's kv_mode "
                              f"{mode_name(p_modes)!r}")
        n = len(prefix)
        if len(ids) < n:
            raise ConfigError(f"the prompt ({len(ids)} tokens) is shorter than the prefix "
                              f"({n} tokens); it must start with the prefix's tokens")
        m = _common_prefix(prefix._ids, ids)
        if m < n:
            raise ConfigError(f"the prompt differs from the prefix at position {m} (prompt "
                              f"token {int(ids[m])}, prefix token {int(prefix._ids[m])}); "
                              f"it must start with the prefix's {n} tokens")
        return p_depth, p_modes
    depth = _depth_arg(model, depth)
    modes = model.resolve_kv_modes(kv_mode)
    if prefix_pool is not None:
        if not isinstance(prefix_pool, PrefixPool):
            raise ConfigError(f"prefix_pool must be a PrefixPool, got "
                              f"{type(prefix_pool).__name__}")
        with model.lock:
            prefix_pool._check(model)
    return depth, modes


def prefill_request(model, ids: np.ndarray, depth: int, modes: tuple, cache: RuntimeKVCache,
                    prefix=None, prefix_pool=None) -> int:
    """Fill ``cache`` and the residual rows 0..T-1 for a request's prompt, starting from the
    prefix (or the pool's longest match); insert the prompt into the pool. Returns the number
    of positions that came from a cache. The prefilled positions run in the forward's
    absolutely aligned chunks (``Model._chunks``), so every row equals that of an uncached
    run. Call under the model's lock."""
    m, src = 0, None
    drain_orphans(model)
    if prefix is not None:
        prefix._check(model)
        if (prefix._depth, prefix._modes) != (depth, tuple(modes)):
            raise ConfigError(f"the {prefix.kind} changed to depth {prefix._depth} after this "
                              f"call began at depth {depth} (an upgrade() ran in between)")
        m, src = len(prefix), prefix
    elif prefix_pool is not None:
        prefix_pool._check(model)
        src, m = prefix_pool._lookup(ids, depth, tuple(modes))
    if m:
        src._restore(cache, m)
    if m < len(ids):
        model.forward(ids[m:], m, depth, cache)
    if prefix_pool is not None and m < len(ids):
        prefix_pool._insert(ids, depth, tuple(modes), cache)
    return m


# -- prefix files -----------------------------------------------------------------------------
PREFIX_MAGIC = b"TLPREFIX"
PREFIX_VERSION = 3
# version 2 stored a ResumeHandle's coda K/V in the slots after its depth's iterations (in the
# page layout of the recurrent layers there); its PrefixCache files and ResumeHandles at
# max_depth have the same bytes as version 3 and are still read
_READ_VERSIONS = (2, 3)
_HEADER = struct.Struct("<8sI32sBBHHH16sIIIIIII32sQ")
# magic, version, fingerprint, kind (0 PrefixCache, 1 ResumeHandle), fp16-mode K/V dtype (0 f32,
# 1 f16), depth, max_depth, snapshot planes, kv_mode (ASCII name or "mixed", NUL padded),
# n_tokens, n_slots, n_kv_heads, head_dim, d_model, vocab_size, n_layers, SHA-256 of the
# modes table and the payload, payload bytes. Then the modes table: n_layers x 8 bytes (ASCII,
# NUL padded), one KV mode per physical layer. Then the payload.
_MODE_BYTES = 8
_KV_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2")}


def _payload_layout(cfg, kind: int, depth: int, max_depth: int, planes: int, n: int,
                    modes: tuple, kv_dtype: np.dtype) -> list[tuple[str, tuple, np.dtype]]:
    """The payload's arrays in order (name, shape, dtype); sizes are exact Python ints.

    tokens (u32 [n]); for every slot s of the K/V (``n_slots(max_depth)`` for a ResumeHandle,
    else ``n_slots(depth)``, in the order of ``slot_layers``: a ResumeHandle's coda slots are
    the last ones whatever its depth, ``kvcache.room_slots``), every part of its layer's page
    layout (``kvcache.PageLayout``) for positions 0..n-1 (``[n, ...]``); rows (f32 [n,
    d_model]); for a ResumeHandle the snapshot (f32 [planes, n, d_model]).
    """
    out = [("tokens", (n,), np.dtype("<u4"))]
    for s, li in enumerate(slot_layers(cfg, max_depth if kind == 1 else depth)):
        lay = PageLayout.for_config(cfg, modes[li], 1, kv_dtype)
        for part in lay.parts:
            out.append((f"kv.{s}.{part.name}", (n,) + tuple(part.shape[1:]),
                        np.dtype(part.dtype).newbyteorder("<")))
    out.append(("rows", (n, cfg.d_model), np.dtype("<f4")))
    if kind == 1:
        out.append(("snapshot", (planes, n, cfg.d_model), np.dtype("<f4")))
    return out


def _nbytes(shape, dtype) -> int:
    size = dtype.itemsize
    for s in shape:
        size *= int(s)          # Python ints: no overflow
    return size


def _modes_table(modes: tuple) -> bytes:
    return b"".join(m.encode("ascii").ljust(_MODE_BYTES, b"\0") for m in modes)


def save_prefix(handle: PrefixCache, path) -> int:
    """Write ``handle`` to ``path``; returns the bytes written.

    Format (little-endian): the fixed header ``_HEADER`` (magic ``TLPREFIX``, version 3, the
    model's 32-byte fingerprint, the kind, the fp16-mode K/V dtype, depth, max_depth, snapshot
    planes, kv_mode, token count, slots, n_kv_heads, head_dim, d_model, vocab_size, n_layers,
    the SHA-256 of what follows the header and the payload's length), the modes table (one KV
    mode per physical layer), then the payload of :func:`_payload_layout`: every page part of
    every slot for the prefix's positions, gathered through the block tables.

    Written through ``fileio.atomic_write`` (a fresh temporary file beside ``path``, fsync,
    atomic rename): a reader of ``path`` sees the old file or the new one, never a part, and
    concurrent saves to one path leave one complete file. Raises HandleError after release,
    FileWriteError (an OSError naming ``path``) when the file system fails; nothing is left
    behind and the handle is unchanged.
    """
    model = handle._model
    with model.lock:
        handle._check()
        cfg = model.config
        kind = 1 if isinstance(handle, ResumeHandle) else 0
        dt_code = next(c for c, d in _KV_DTYPES.items() if d == np.dtype(model.ops.kv_dtype))
        state = handle._st.host_state()
        modes = handle._modes
        max_depth = handle._max_depth if kind == 1 else handle._depth
        n = len(handle)
        planes = state["snapshot"].shape[0] if kind == 1 else 0
        layout = _payload_layout(cfg, kind, handle._depth, max_depth, planes, n, modes,
                                 _KV_DTYPES[dt_code])
        arrays = {"tokens": handle._ids, "rows": state["rows"],
                  "snapshot": state.get("snapshot")}
        for s, parts in enumerate(state["kv"]):
            for name, arr in parts.items():
                arrays[f"kv.{s}.{name}"] = arr
        parts = [np.ascontiguousarray(arrays[name], dtype=dt) for name, _, dt in layout]
        for (name, shape, _), arr in zip(layout, parts):
            assert arr.shape == shape, (name, arr.shape, shape)
        depth, slots = handle._depth, len(state["kv"])
    table = _modes_table(modes)
    h = hashlib.sha256(table)
    for p in parts:
        h.update(memoryview(p).cast("B"))
    payload_len = sum(p.nbytes for p in parts)
    mode = mode_name(modes)
    mode = (mode if isinstance(mode, str) else "mixed").encode("ascii")
    header = _HEADER.pack(PREFIX_MAGIC, PREFIX_VERSION, model.fingerprint, kind, dt_code,
                          depth, max_depth, planes, mode, n, slots, cfg.n_kv_heads,
                          cfg.head_dim, cfg.d_model, cfg.vocab_size, cfg.n_layers, h.digest(),
                          payload_len)
    chunks = [header, table] + [memoryview(p).cast("B") for p in parts]
    return write_bytes(path, chunks, "the prefix file")


def load_prefix(model, path) -> PrefixCache:
    """:meth:`Model.load_prefix`: read a prefix file written by :func:`save_prefix`.

    Every header field is checked against the model and against the file's length (Python
    ints, so no overflow) before anything is allocated; the SHA-256 of the modes table and the
    payload is checked before anything is uploaded. Raises BadMagicError,
    UnsupportedVersionError, TruncatedFileError (shorter than the header or its payload),
    SizeOverflowError (trailing bytes, absurd counts), FormatError (another model's
    fingerprint, dims that differ from the model's, an unknown kind/dtype/KV mode, a depth
    outside the model's range, a checksum mismatch), ConfigError (a KV mode this backend cannot
    run), TokenizerError (ids outside the vocabulary), and the file system's OSError unchanged
    (FileNotFoundError, PermissionError, IsADirectoryError, ...; ``filename`` is ``path``).
    Version 2 files are read where their bytes equal version 3's (see ``_READ_VERSIONS``).
    On any failure nothing stays allocated and no other handle or pool entry is touched.
    """
    model.check_alive()
    cfg = model.config
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER.size:
                raise TruncatedFileError(f"{path}: {size} bytes is shorter than the "
                                         f"{_HEADER.size}-byte prefix header")
            (magic, version, fingerprint, kind, dt_code, depth, max_depth, planes, mode_raw, n,
             slots, n_kv_heads, head_dim, d_model, vocab_size, n_layers, digest,
             payload_len) = _HEADER.unpack(f.read(_HEADER.size))
            if magic != PREFIX_MAGIC:
                raise BadMagicError(f"{path}: not a TinyLoop prefix file (magic {magic!r})")
            if version not in _READ_VERSIONS:
                raise UnsupportedVersionError(f"{path}: prefix file version {version}; this "
                                              f"reader reads versions {_READ_VERSIONS}")
            if fingerprint != model.fingerprint:
                raise FormatError(f"{path}: saved by another model (fingerprint "
                                  f"{fingerprint.hex()[:16]}..., this model's is "
                                  f"{model.fingerprint.hex()[:16]}...)")
            if kind not in (0, 1) or dt_code not in _KV_DTYPES:
                raise FormatError(f"{path}: unknown kind {kind} / K/V dtype code {dt_code}")
            dims = dict(n_kv_heads=n_kv_heads, head_dim=head_dim, d_model=d_model,
                        vocab_size=vocab_size, n_layers=n_layers)
            for name, val in dims.items():
                if val != getattr(cfg, name):
                    raise FormatError(f"{path}: {name}={val} but the model has "
                                      f"{getattr(cfg, name)}")
            if not 1 <= depth <= max_depth <= cfg.max_depth or (kind == 0 and max_depth != depth):
                raise FormatError(f"{path}: depth {depth} / max_depth {max_depth} outside the "
                                  f"model's 1..{cfg.max_depth}")
            if version == 2 and depth != max_depth:
                raise UnsupportedVersionError(f"{path}: a version 2 ResumeHandle below its "
                                              f"max_depth ({depth} < {max_depth}) stored its coda "
                                              f"in another slot order; make it again with "
                                              f"resume_handle() and save it")
            if not 1 <= n <= model.max_seq_len:
                raise SizeOverflowError(f"{path}: {n} tokens; this model takes 1.."
                                        f"{model.max_seq_len} (max_seq_len)")
            want_planes = (2 if model.injects else 1) if kind == 1 else 0
            if planes != want_planes:
                raise FormatError(f"{path}: {planes} snapshot planes, expected {want_planes}")
            want_slots = cfg.n_slots(max_depth if kind == 1 else depth)
            if slots != want_slots:
                raise FormatError(f"{path}: {slots} K/V slots, expected {want_slots}")
            if size - _HEADER.size < n_layers * _MODE_BYTES:
                raise TruncatedFileError(f"{path}: the file ends inside its KV modes table")
            table = f.read(n_layers * _MODE_BYTES)
            try:
                modes = tuple(table[i:i + _MODE_BYTES].rstrip(b"\0").decode("ascii")
                              for i in range(0, len(table), _MODE_BYTES))
            except UnicodeDecodeError:
                raise FormatError(f"{path}: the KV modes table is not ASCII") from None
            bad = [m for m in modes if m not in KV_MODES]
            if bad:
                raise FormatError(f"{path}: unknown KV mode(s) {sorted(set(bad))}")
            try:
                mode_field = mode_raw.rstrip(b"\0").decode("ascii")
            except UnicodeDecodeError:
                raise FormatError(f"{path}: kv_mode field is not ASCII") from None
            if mode_field != (modes[0] if len(set(modes)) == 1 else "mixed"):
                raise FormatError(f"{path}: kv_mode {mode_field!r} contradicts the modes table")
            layout = _payload_layout(cfg, kind, depth, max_depth, planes, n, modes,
                                     _KV_DTYPES[dt_code])
            want = sum(_nbytes(s, d) for _, s, d in layout)
            if payload_len != want:
                raise SizeOverflowError(f"{path}: header says {payload_len} payload bytes; its "
                                        f"counts need {want}")
            rest = size - _HEADER.size - len(table)
            if rest < want:
                raise TruncatedFileError(f"{path}: {size} bytes; header, modes and payload need "
                                         f"{_HEADER.size + len(table) + want}")
            if rest > want:
                raise SizeOverflowError(f"{path}: {rest - want} trailing bytes after the payload")
            payload = f.read(want)
    except OSError as e:          # a failed read names the file too, like a failed open
        if e.filename is None:
            e.filename = path
        raise
    if len(payload) != want:
        raise TruncatedFileError(f"{path}: the file shrank while being read")
    if hashlib.sha256(table + payload).digest() != digest:
        raise FormatError(f"{path}: checksum mismatch (the file is corrupted)")
    arrays, off = {}, 0
    for name, shape, dt in layout:
        nb = _nbytes(shape, dt)
        arrays[name] = np.frombuffer(payload, dtype=dt, count=nb // dt.itemsize,
                                     offset=off).reshape(shape)
        off += nb
    ids = arrays["tokens"]
    if (ids >= cfg.vocab_size).any():
        i = int(np.argmax(ids >= cfg.vocab_size))
        raise TokenizerError(f"{path}: token {i} = {int(ids[i])} is outside the vocabulary "
                             f"of {cfg.vocab_size}")
    ids = ids.astype(np.int32)
    modes = model.resolve_kv_modes(modes)           # ConfigError: a mode this backend lacks
    state = {"rows": arrays["rows"], "snapshot": arrays.get("snapshot"),
             "kv": [{part.name: arrays[f"kv.{s}.{part.name}"]
                     for part in PageLayout.for_config(cfg, modes[li], 1).parts}
                    for s, li in enumerate(slot_layers(cfg, max_depth if kind == 1
                                                       else depth))]}
    with model.lock:
        model.check_alive()
        drain_orphans(model)
        st = HandleStorage(model, max_depth, n, modes, snapshot=kind == 1)
        try:
            st.load_host_state(state)
            if kind == 1:
                return ResumeHandle(model, ids, depth, modes, st, max_depth)
            return PrefixCache(model, ids, depth, modes, st)
        except BaseException:
            st.release()
            raise
