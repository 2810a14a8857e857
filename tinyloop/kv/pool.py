"""PrefixPool: many prefix caches under one model, keyed by (model fingerprint, depth, kv_mode,
token ids), with LRU eviction of exactly the shortfall under ``max_bytes``.

A request with ``prefix_pool=`` (``generate.prefill_request``) restores the entry sharing the
longest prefix of its prompt (:meth:`PrefixPool.lookup`, then ``PrefixCache.restore``) and
inserts the finished prompt (:meth:`PrefixPool.insert`): the entry takes the prompt's full
pages by reference and copies a partly filled last page. The pool's entries and counters are
guarded by the model's lock.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import numpy as np

from ..config import parse_size
from ..errors import ConfigError, HandleError, OutOfMemoryError
from ..memory import round_size
from .cache import RuntimeKVCache
from .handles import HandleStorage, PrefixCache, Releasable
from .layouts import DEFAULT_PAGE_SIZE, slot_layers
from .registry import KVRegistry

_KEY_MAGIC = b"TLPK\x02"
_KEY_MAGIC_POLICY = b"TLPK\x03"     # a key whose iteration KV policy is not "all"


def encode_key(fingerprint: bytes, depth: int, modes, ids, kv_iterations: str = "all") -> bytes:
    """The pool key as bytes: an injective encoding of (model fingerprint, depth, KV modes,
    token ids, iteration KV policy), so two different keys never compare equal.

    Layout: ``b"TLPK\x02"`` ("all") or ``b"TLPK\x03"`` then the policy as u8 length + ASCII
    (any other policy), the 32-byte fingerprint, u32 depth, u16 count of modes, each
    mode as u8 length + ASCII (one per physical layer, or one name), u32 token count, then the
    ids as little-endian u32. Every variable-length field is length-prefixed and the rest are
    fixed-width, so the bytes decode back to one key only.
    """
    if len(fingerprint) != 32:
        raise ConfigError(f"a model fingerprint has 32 bytes, got {len(fingerprint)}")
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    parts = [_KEY_MAGIC]
    if kv_iterations != "all":
        b = kv_iterations.encode("ascii")
        parts = [_KEY_MAGIC_POLICY, struct.pack("<B", len(b)), b]
    parts += [fingerprint, struct.pack("<IH", depth, len(modes))]
    for m in modes:
        b = m.encode("ascii")
        parts += [struct.pack("<B", len(b)), b]
    ids = np.asarray(ids)
    parts += [struct.pack("<I", ids.size), ids.astype("<u4").tobytes()]
    return b"".join(parts)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two 1-D id arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixPool(Releasable):
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
                and isinstance(getattr(model, "kv_registry", None), KVRegistry)):
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
        model.kv_registry.add_handle(self)

    @property
    def model(self):
        return self._model

    @property
    def max_bytes(self):
        return self._max_bytes

    def key(self, tokens, depth: int, kv_mode=None, kv_iterations=None) -> bytes:
        """This pool's key for ``tokens`` at ``depth``/``kv_mode``/``kv_iterations`` (None:
        the model's defaults; see :func:`encode_key`)."""
        return encode_key(self._model.fingerprint, depth,
                          self._model.resolve_kv_modes(kv_mode),
                          self._model.check_token_ids(tokens, "tokens"),
                          self._model.resolve_kv_iterations(kv_iterations))

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
            self._model.kv_registry.drain()

    def release(self) -> None:
        """Clear and refuse further use (idempotent)."""
        with self._model.lock:
            self.clear()
            self._released = True
            self._model.kv_registry.discard_handle(self)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PrefixPool({s['entries']} entries, {s['bytes']} B of "
                f"{'unbounded' if s['max_bytes'] is None else s['max_bytes']}, "
                f"{s['hits']} hits / {s['misses']} misses)")

    # -- the request's surface (call under the model's lock) --------------------------------
    def check(self, model) -> None:
        """Raise HandleError when released or used with another model."""
        if self._released:
            raise HandleError("this PrefixPool was released (or its model freed)")
        if model is not self._model:
            raise HandleError(f"this PrefixPool belongs to another Model "
                              f"({self._model.path!r}); make one per model")

    def lookup(self, ids: np.ndarray, depth: int, modes: tuple, kv_iterations: str = "all"):
        """(entry, m): the entry sharing the longest prefix of ``ids`` at ``depth``/``modes``
        under ``kv_iterations`` and that length (0 and None on a miss; under "latest" the
        length is cut to a multiple of ``Model.chunk_rows``, so the request's own positions
        run in the chunks an uncached run gives them). Counts the hit or miss; refreshes its
        LRU."""
        best, best_m = None, 0
        for e in self._entries.values():
            if e.depth == depth and e.modes == modes and e.kv_iterations == kv_iterations:
                m = common_prefix(e.ids, ids)
                if kv_iterations != "all":          # generate.reusable_positions' rule
                    m -= m % self._model.chunk_rows
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
        return encode_key(self._model.fingerprint, e.depth, e.modes, e.ids, e.kv_iterations)

    def entry_bytes(self, n_tokens: int, depth: int, kv_mode=None, kv_iterations=None) -> int:
        """Pool bytes an entry of ``n_tokens`` positions at ``depth`` under ``kv_iterations``
        (None: the model's default) holds when it shares no page with another entry: its
        pages, its block tables, its final residual rows."""
        model = self._model
        cfg = model.config
        modes = model.resolve_kv_modes(kv_mode)
        cache_slots = slot_layers(cfg, depth, model.resolve_kv_iterations(kv_iterations))
        pages = -(-n_tokens // DEFAULT_PAGE_SIZE)
        page_bytes = sum(round_size(model.kv_page_layout(modes[li], DEFAULT_PAGE_SIZE).page_bytes)
                         for li in cache_slots)
        return (pages * page_bytes + round_size(len(cache_slots) * pages * 8)
                + round_size(n_tokens * cfg.d_model * 4))

    def _add(self, key: bytes, e: PrefixCache) -> None:
        self._entries[key] = e
        self._bytes += e.storage.fixed_bytes()
        for addr, page in e.storage.pages().items():
            n = self._page_refs.get(addr, 0)
            if n == 0:
                self._bytes += page.block.nbytes
            self._page_refs[addr] = n + 1

    def _remove(self, key: bytes) -> PrefixCache:
        e = self._entries.pop(key)
        self._bytes -= e.storage.fixed_bytes()
        for addr, page in e.storage.pages().items():
            n = self._page_refs[addr] - 1
            if n:
                self._page_refs[addr] = n
            else:
                del self._page_refs[addr]
                self._bytes -= page.block.nbytes
        e.release()
        return e

    def insert(self, ids: np.ndarray, depth: int, modes: tuple, cache: RuntimeKVCache,
               rows) -> None:
        """Insert the request's prompt (its K/V in ``cache`` positions 0..T-1, under the cache's
        iteration KV policy, its final residual rows ``rows``, float32 ``[T, d_model]``): the
        entry takes the full pages by
        reference and copies a partly filled last page. The new entry is made first, so an
        insert that fails (OutOfMemoryError: counted as rejected; anything else: raised) leaves
        the entries as they were. Then entries it extends are dropped (it contains them), and
        the least recently used entries go, oldest first, until the pool is back within
        max_bytes."""
        model = self._model
        policy = cache.kv_iterations
        key = encode_key(model.fingerprint, depth, modes, ids, policy)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        n = len(ids)
        if self._max_bytes is not None and \
                self.entry_bytes(n, depth, modes, policy) > self._max_bytes:
            self._counts["rejected"] += 1              # larger than the whole budget
            return
        try:
            st = HandleStorage(model, depth, n, modes, kv_iterations=policy)
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
            st.rows[...] = rows
            st.hold_pages()
            entry = PrefixCache(model, ids, depth, modes, st)
        except BaseException:
            st.release()
            raise
        # nothing below allocates: the entry is in, and the pool only lets go of entries
        self._add(key, entry)
        self._counts["inserts"] += 1
        for k, e in list(self._entries.items()):
            if (k != key and e.depth == depth and e.modes == modes
                    and e.kv_iterations == policy and len(e) <= n
                    and common_prefix(e.ids, ids) == len(e)):
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
