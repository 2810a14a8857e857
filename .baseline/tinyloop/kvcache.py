"""The paged KV cache: page layouts, the page allocator, and RuntimeKVCache (seed 001,
"Per-request memory"; issue 8).

A request's attention state lives in fixed-size **pages** of ``P`` positions (``page_size``)
for one attention slot (layer, iteration). Slot indices follow ``docs/architecture.md``
(prelude i -> i; recurrent j at iteration t -> P + t*R + j; coda c -> P + R*depth + c). A
request holds one **block table** per slot (the page addresses of positions 0..P-1, P..2P-1,
...) and gains pages as it grows, so it owns at most one partly filled page per slot
(vLLM's PagedAttention, Kwon et al. 2023). Every page is one pool block of the same size for a
given layout (tag ``kv_cache``), so pages of finished requests are reused exactly and the pool's
figures count the cache page by page. Each page carries a reference count, so a prefix's pages
can be shared by reference (issue 9) and are freed when the last holder lets go.

Storage modes (one per physical layer; ``PageLayout`` gives every part's byte offset):

=========  ==============================================================================
``fp16``    K and V rows at the backend's KV dtype (float16 on CUDA, float32 on the NumPy
            reference) ``[P, n_kv_heads, head_dim]`` each.
``int8``    K and V as int8 codes ``[P, n_kv_heads, head_dim]`` plus one float16 scale per
            (position, KV head) ``[P, n_kv_heads]``: symmetric, ``s = fp16(max|x| / 127)``
            (the division in float32, then one rounding to FP16), ``q = clip(rint(x / s),
            -127, 127)`` against the rounded ``s`` (``quant.quantize_rows_int8``,
            ``saturate=True``); a row of zeros gets ``s = 0`` and codes 0. Read as
            ``float32(q) * float32(s)``.
``h_fp16``  the RMS-normed input of the layer's QKV projection ``h`` (float16 ``[P, d_model]``);
            attention rebuilds K = RoPE(h Wk^T) and V = h Wv^T from it, chunk by chunk.
``h_int8``  h quantized per token in groups of ``H_GROUP`` (int8 codes + float16 scales,
            symmetric, as the INT8 weights: ``quant.quantize``).
``h_int4``  per token, the ``H_OUTLIERS`` channels of largest |h| kept as float16 (index and
            value), then h in groups of ``H_GROUP``: packed 4-bit codes + float16 scale and
            zero (asymmetric min/max, as the INT4 weights), each group in the plain or the
            Hadamard basis, whichever reconstructs it better (``numpy_ops.encode_h``).
=========  ==============================================================================

Why the normed input rather than the raw residual: see ``docs/kv_modes.md`` (measured on the
embedded model: the residual's outlier channels make its INT8/INT4 codes far worse, and
rebuilding from it costs one more RMSNorm per chunk).

What FP16 cannot hold (both backends, every FP16 part): no finite value is stored as an
infinity. Scales and zeros are clamped to FP16's largest finite value (``quant.F16_MAX``), so
values beyond what they reach saturate (int8: +-127 x 65504); FP16 K/V/h values are clamped
the same way (``quant.saturate_f16``). A quantization unit (an int8 row, an h group) holding a
NaN or an infinity gets a NaN scale and codes 0, so it reads back as NaN - that unit only, the
fault staying visible downstream; FP16 parts (and h_int4's outlier channels) keep NaN and
infinities as they are.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .config import KV_MODES, ModelConfig
from .errors import ConfigError, HandleError
from .memory import packed_scope
from .memory.block import contiguous_runs

H_MODES = ("h_fp16", "h_int8", "h_int4")
SLOT_KINDS = ("prelude", "recurrent", "coda")
DEFAULT_PAGE_SIZE = 32      # positions per page: see docs/kv_modes.md "Page size"
H_GROUP = 32                # group size of the h_int8 / h_int4 per-token quantization
PART_ALIGN = 16             # every part of a page starts on a 16-byte boundary (vector loads)


def _align(n: int, a: int = PART_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Part:
    """One array inside a page: ``name``, byte ``offset`` from the page start, ``shape``
    (leading axis = the page's P positions), numpy ``dtype`` name."""

    name: str
    offset: int
    shape: tuple
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of one page of ``page_size`` positions for storage ``mode``.

    Identical on both backends except the ``fp16`` mode's K/V dtype (``kv_dtype``: float16 on
    CUDA, float32 on the NumPy reference), so stored codes compare byte for byte. Parts, in
    order, each 16-byte aligned:

    - fp16:   ``k``, ``v``   kv_dtype ``[P, Hkv, hd]``
    - int8:   ``k``, ``v``   int8 ``[P, Hkv, hd]``; ``k_scale``, ``v_scale`` float16 ``[P, Hkv]``
    - h_fp16: ``h``          float16 ``[P, d]``
    - h_int8: ``h``          int8 ``[P, d]``; ``h_scale`` float16 ``[P, d / g]``
    - h_int4: ``h``          uint8 ``[P, d / 2]`` (two codes a byte, low nibble first);
      ``h_scale``, ``h_zero`` float16 ``[P, d / g]`` (a scale's sign bit set: that group was
      quantized in the Hadamard basis); ``h_oidx`` uint16 / ``h_oval`` float16 ``[P, k]``:
      the k = ``outliers`` channels kept as float16

    Raises ConfigError for an unknown mode, a page size < 1, or (h_int*) a d_model that is not
    a multiple of the group size.
    """

    mode: str
    page_size: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    kv_dtype: str = "float16"
    group_size: int = H_GROUP
    rotate: int = 0      # h_int4: block size of the Hadamard basis a group may be quantized
                         # in (0 = never); see hadamard_rotate
    outliers: int = 0    # h_int4: channels per position kept as float16 (H_OUTLIERS)

    def __post_init__(self):
        check_mode(self.mode)
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) \
                or self.page_size < 1:
            raise ConfigError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if self.mode in ("h_int8", "h_int4") and self.d_model % self.group_size:
            raise ConfigError(f"kv mode {self.mode!r} quantizes h in groups of "
                              f"{self.group_size}, but d_model={self.d_model} is not a "
                              "multiple of it")
        if self.rotate and (self.mode != "h_int4" or self.rotate != self.group_size):
            raise ConfigError(f"a Hadamard basis (rotate={self.rotate}) needs kv mode "
                              f"'h_int4' and blocks of the group size {self.group_size}")
        if self.outliers and (self.mode != "h_int4" or not 0 < self.outliers < self.d_model):
            raise ConfigError(f"outliers={self.outliers} needs kv mode 'h_int4' and fewer "
                              f"than d_model={self.d_model} channels")

    @classmethod
    def for_config(cls, cfg: ModelConfig, mode: str, page_size: int = DEFAULT_PAGE_SIZE,
                   kv_dtype="float16") -> "PageLayout":
        rotate = H_ROTATE.get(mode, 0)
        outliers = min(H_OUTLIERS.get(mode, 0), cfg.d_model - 1)
        return cls(mode, page_size, cfg.n_kv_heads, cfg.head_dim, cfg.d_model,
                   np.dtype(kv_dtype).name, rotate=rotate, outliers=outliers)

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        p, hk, hd, d, g = self.page_size, self.n_kv_heads, self.head_dim, self.d_model, \
            self.group_size
        if self.mode == "fp16":
            spec = [("k", (p, hk, hd), self.kv_dtype), ("v", (p, hk, hd), self.kv_dtype)]
        elif self.mode == "int8":
            spec = [("k", (p, hk, hd), "int8"), ("v", (p, hk, hd), "int8"),
                    ("k_scale", (p, hk), "float16"), ("v_scale", (p, hk), "float16")]
        elif self.mode == "h_fp16":
            spec = [("h", (p, d), "float16")]
        elif self.mode == "h_int8":
            spec = [("h", (p, d), "int8"), ("h_scale", (p, d // g), "float16")]
        else:  # h_int4
            spec = [("h", (p, d // 2), "uint8"), ("h_scale", (p, d // g), "float16"),
                    ("h_zero", (p, d // g), "float16")]
            if self.outliers:
                spec += [("h_oidx", (p, self.outliers), "uint16"),
                         ("h_oval", (p, self.outliers), "float16")]
        out, off = [], 0
        for name, shape, dtype in spec:
            part = Part(name, off, shape, dtype)
            out.append(part)
            off = _align(off + part.nbytes)
        return tuple(out)

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise ConfigError(f"kv mode {self.mode!r} pages have no part {name!r}; parts: "
                          f"{[p.name for p in self.parts]}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (parts plus alignment padding)."""
        last = self.parts[-1]
        return _align(last.offset + last.nbytes)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position occupies in one slot: codes, scales and zeros, no padding."""
        return sum(p.nbytes for p in self.parts) // self.page_size

    @cached_property
    def kernel_offsets(self) -> tuple[int, int, int, int]:
        """Byte offsets the CUDA kernels take: (K codes, V codes, K scales, V scales) for the
        K/V modes (0 where a part is absent); (h codes, h scales, h zeros, 0) for h modes."""
        names = (("h", "h_scale", "h_zero", None) if self.stores_h
                 else ("k", "v", "k_scale", "v_scale"))
        have = {p.name: p.offset for p in self.parts}
        return tuple(have.get(n, 0) if n else 0 for n in names)

    @cached_property
    def outlier_offsets(self) -> tuple[int, int]:
        """Byte offsets of the h_int4 outlier parts (``h_oidx``, ``h_oval``); (0, 0) when
        the layout keeps none."""
        have = {p.name: p.offset for p in self.parts}
        return (have.get("h_oidx", 0), have.get("h_oval", 0))

    @property
    def stores_h(self) -> bool:
        return self.mode in H_MODES

    @cached_property
    def _view_spec(self) -> tuple:
        return tuple((p.name, p.offset, p.offset + p.nbytes, np.dtype(p.dtype), p.shape)
                     for p in self.parts)

    def views(self, page_u8) -> dict:
        """Typed views of each part of a page given as a flat uint8 array (NumPy or CuPy)."""
        return {name: page_u8[a:b].view(dt).reshape(shape)
                for name, a, b, dt, shape in self._view_spec}


# h_int4 (measured in docs/kv_modes.md): the Hadamard basis a group may be quantized in
# (QuaRot, Ashkboos et al. 2024; blocks of this many channels, one group each), and the
# channels of largest |h| per position kept as float16 instead (the outliers that would
# otherwise set their group's range; LLM.int8(), Dettmers et al. 2022, keeps them apart too).
H_ROTATE = {"h_int4": 32}
H_OUTLIERS = {"h_int4": 2}


def hadamard_matrix(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of two), float64."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard_rotate(x: np.ndarray, block: int) -> np.ndarray:
    """Rotate float rows ``x`` [..., d] by a block-diagonal orthonormal Hadamard (blocks of
    ``block`` channels). The Sylvester matrix is symmetric and orthonormal, so the same call
    undoes it. float32 out, the shape of ``x``.

    Output j of a block: the float64 sum over i = 0, 1, .. in that order of
    (-1)^popcount(i & j) x_i, one division by sqrt(block), one rounding to float32 (a finite
    sum beyond float32's range saturates at its largest value): cuda_src/kv_h.cu
    ``hadamard32`` computes the same in the same order, so both backends store the same
    h_int4 codes."""
    x = np.asarray(x, np.float64)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    signs = np.rint(hadamard_matrix(block) * np.sqrt(block))     # the +-1 Sylvester matrix
    acc = np.zeros_like(blocks)
    with np.errstate(invalid="ignore"):                          # inf - inf: NaN, as there
        for i in range(block):                                   # the kernel's order
            acc += blocks[..., i:i + 1] * signs[i]
    y = acc / np.sqrt(block)
    f32_max = float(np.finfo(np.float32).max)
    y = np.where(np.isfinite(y), np.clip(y, -f32_max, f32_max), y)
    return y.reshape(x.shape).astype(np.float32)


def check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in KV_MODES:
        raise ConfigError(f"unknown KV cache mode {mode!r}; expected one of {KV_MODES} "
                          "(or 'auto' for load_model / per-call kv_mode)")
    return mode


def resolve_kv_modes(spec, cfg: ModelConfig) -> tuple[str, ...]:
    """One mode per physical layer (``cfg.n_layers``) from a user's ``kv_mode``.

    ``spec``: a mode name (every layer), a dict ``{"prelude": m, "recurrent": m, "coda": m}``
    (missing kinds default to ``"fp16"``), or a sequence of one mode per physical layer.
    ``"auto"`` (alone or as a dict value) picks per slot kind from ``AUTO_TABLE``. Raises
    ConfigError naming the bad value.
    """
    kinds = (["prelude"] * cfg.n_prelude + ["recurrent"] * cfg.n_recurrent
             + ["coda"] * cfg.n_coda)
    if isinstance(spec, str):
        if spec == "auto":
            return tuple(AUTO_TABLE[k] for k in kinds)
        return (check_mode(spec),) * cfg.n_layers
    if isinstance(spec, dict):
        unknown = set(spec) - set(SLOT_KINDS)
        if unknown:
            raise ConfigError(f"kv_mode dict keys must be among {SLOT_KINDS}, got "
                              f"{sorted(map(str, unknown))}")
        by_kind = {k: spec.get(k, "fp16") for k in SLOT_KINDS}
        for k, m in by_kind.items():
            by_kind[k] = AUTO_TABLE[k] if m == "auto" else check_mode(m)
        return tuple(by_kind[k] for k in kinds)
    if isinstance(spec, (list, tuple)):
        if len(spec) != cfg.n_layers:
            raise ConfigError(f"kv_mode sequence has {len(spec)} entries, the model has "
                              f"{cfg.n_layers} physical layers")
        return tuple(check_mode(m) for m in spec)
    raise ConfigError(f"kv_mode must be a mode name, a dict by slot kind or a sequence of "
                      f"modes, got {spec!r}; modes: {KV_MODES} or 'auto'")


# kv_mode="auto": per slot kind, the mode with the fewest bytes per token whose measured mean
# KL against fp16 on the embedded model at depth 4 stays within AUTO_KL_BOUND on every text
# kind of benchmarks/kv_quality.py (docs/kv_modes.md has the table this is read from;
# tests/test_kvcache.py checks the two agree). h_int4 is over it, so auto never picks it.
AUTO_KL_BOUND = 5e-3
AUTO_TABLE = {"prelude": "int8", "recurrent": "int8", "coda": "int8"}


def slot_layers(cfg: ModelConfig, depth: int) -> list[int]:
    """The physical layer of every slot at ``depth`` (slot order of docs/architecture.md)."""
    p, r = cfg.n_prelude, cfg.n_recurrent
    return (list(range(p)) + [p + j for _ in range(depth) for j in range(r)]
            + [p + r + c for c in range(cfg.n_coda)])


def room_slots(cfg: ModelConfig, depth: int, room: int) -> list[int]:
    """The slot of a cache laid out for ``room`` iterations (``slot_layers(cfg, room)``) that
    holds every slot at ``depth`` <= ``room``: the prelude and iterations 0..depth-1 at their
    own index, the coda at the end (``P + R*room + c``), so each slot's pages keep the layout
    of their own layer kind at every depth. Raises ConfigError for depth > room."""
    if not 0 <= depth <= room:
        raise ConfigError(f"depth {depth} is outside a cache laid out for 0..{room} iterations")
    p, r = cfg.n_prelude, cfg.n_recurrent
    return list(range(p + r * depth)) + [p + r * room + c for c in range(cfg.n_coda)]


def kv_bytes_per_token(cfg: ModelConfig, depth: int, modes, kv_dtype="float16") -> int:
    """Bytes one position occupies over all slots at ``depth`` (page rounding excluded)."""
    per_layer = [PageLayout.for_config(cfg, m, 1, kv_dtype).bytes_per_token for m in modes]
    return sum(per_layer[li] for li in slot_layers(cfg, depth))


# --- pages ------------------------------------------------------------------------------------
class Page:
    """One page: a pool block of ``layout.page_bytes`` and its reference count.

    ``addr`` is the device (or host) address the block tables hold; ``parts`` are typed views
    of the page's parts (see PageLayout). ``refs`` counts holders (requests, prefix caches);
    the page goes back to the pool when it drops to 0.
    """

    __slots__ = ("block", "addr", "layout", "refs", "_u8", "_parts")

    def __init__(self, block, layout: PageLayout, u8=None):
        self.block = block
        self.addr = block.ptr
        self.layout = layout
        self.refs = 1
        self._u8 = u8             # the page's bytes as uint8, or None: viewed on first use
        self._parts = None

    @property
    def parts(self) -> dict:
        """Typed views of the page's parts, made on first use (the CUDA kernels read pages by
        address and never need them; the NumPy reference and the tests do)."""
        if self._parts is None:
            if self.refs <= 0:
                raise HandleError("page was released")
            if self._u8 is None:
                self._u8 = self.block.array((self.layout.page_bytes,), np.uint8)
            self._parts = self.layout.views(self._u8)
        return self._parts


@contextlib.contextmanager
def gc_paused():
    """Hold off Python's cyclic garbage collector inside the block (restored after, unless it
    was off already). A batch of pages makes 4 tracked objects per page (chunk, block, page,
    event): 7,680 for a 2,048-token prefill at depth 1, ~11 young-generation collections and
    now and then a full one over every live object of the process, all before the prefill's
    first kernel. Paused, the collection runs after the batch, while the GPU works. Measured
    on the 2-core CI host with the real model loaded (NumPy backend, 45 ensure(2048) each
    way, a loaded machine): the worst case drops from 41-45 ms (a full collection inside the
    batch) to 12-17 ms; the medians (7-9 ms) move within the noise."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PageAllocator:
    """Hands out pages as pool blocks (one block per page, tag ``kv_cache`` unless given),
    zeroed at allocation, with a reference count each. One per Model (pages may outlive the
    request that wrote them when shared). ``page(addr)`` maps a block-table entry back to its
    Page (how the NumPy reference reads through the block table)."""

    def __init__(self, ops, pool):
        self._ops = ops
        self._pool = pool
        self._pages: dict[int, Page] = {}       # addr -> live Page

    def alloc(self, layout: PageLayout, tag: str = "kv_cache") -> Page:
        """A fresh zeroed page (refs = 1); raises the pool's OutOfMemoryError.

        The one-page path (one pool allocation, one view, one memset): the slow reference that
        ``alloc_many`` is tested against."""
        with packed_scope():                    # pages share segments with the model's
            u8, blk = self._ops.empty(self._pool, (layout.page_bytes,), np.uint8, tag)
        try:
            self._ops.zero(u8)
            page = Page(blk, layout, u8)
        except BaseException:
            self._pool.free(blk)
            raise
        self._pages[page.addr] = page
        return page

    def alloc_many(self, layout: PageLayout, n: int, tag: str = "kv_cache") -> list[Page]:
        """``n`` fresh zeroed pages (refs = 1 each), all or nothing: the pages ``n`` calls of
        :meth:`alloc` would return (same addresses in the same order, one pool block and one
        ``alloc`` event each), from one ``MemoryPool.allocate_many`` and one memset per
        address-contiguous run (``Ops.zero_ranges``). Views are made on first use of
        ``Page.parts``. Raises the pool's OutOfMemoryError with nothing allocated."""
        with packed_scope(), gc_paused():
            blocks = self._pool.allocate_many(layout.page_bytes, n, tag)
            try:
                self._ops.zero_ranges(contiguous_runs(blocks))
            except BaseException:
                self._pool.free_many(blocks)
                raise
            pages = [Page(b, layout) for b in blocks]
            self._pages.update((p.addr, p) for p in pages)
        return pages

    def ref(self, page: Page) -> Page:
        if page.refs <= 0:
            raise HandleError("page was already released")
        page.refs += 1
        return page

    def unref(self, page: Page) -> None:
        if page.refs <= 0:
            raise HandleError("page released twice")
        page.refs -= 1
        if page.refs == 0:
            del self._pages[page.addr]
            page._u8 = page._parts = None
            self._pool.free(page.block)

    def unref_many(self, pages) -> None:
        """:meth:`unref` of every page in ``pages`` (a page may appear more than once, one
        reference each), the pages reaching 0 freed under one pool lock hold. Raises
        HandleError, before changing anything, when a page would be released twice."""
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            drops[id(p)] = drops.get(id(p), 0) + 1
            if drops[id(p)] > p.refs:
                raise HandleError("page released twice")
        dead = []
        for p in pages:
            p.refs -= 1
            if p.refs == 0:
                del self._pages[p.addr]
                p._u8 = p._parts = None
                dead.append(p.block)
        self._pool.free_many(dead)

    def page(self, addr: int) -> Page:
        try:
            return self._pages[int(addr)]
        except KeyError:
            raise HandleError(f"block table entry {int(addr):#x} is not a live page") from None

    @property
    def live_pages(self) -> int:
        return len(self._pages)


def copy_page(src: Page, dst: Page) -> None:
    """Copy every byte of page ``src`` into ``dst`` (same layout), on the pages' device."""
    n = src.layout.page_bytes
    if dst.layout != src.layout:
        raise ConfigError("copy_page needs two pages of one layout")
    dst.block.array((n,), np.uint8)[...] = src.block.array((n,), np.uint8)


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


class RuntimeKVCache:
    """A request's paged KV cache over ``n_slots`` slots for up to ``capacity`` positions.

    ``modes``: one storage mode per physical layer (see ``resolve_kv_modes``). Pages are gained
    by :meth:`ensure` as positions are written; the block tables (one pool block, tag
    ``kv_cache``, int64 ``[n_slots, ceil(capacity / P)]``) are made once and never move.
    Use as a context manager or call :meth:`release`; after release any access raises
    HandleError. Raises ConfigError for a bad mode / capacity, and the pool's
    OutOfMemoryError when a page does not fit (pages taken so far stay owned and are freed by
    release).
    """

    def __init__(self, ops, pool, cfg: ModelConfig, depth: int, capacity: int, modes,
                 allocator: PageAllocator, page_size: int = DEFAULT_PAGE_SIZE):
        if capacity < 1:
            raise ConfigError(f"KV cache capacity must be >= 1, got {capacity}")
        if len(modes) != cfg.n_layers:
            raise ConfigError(f"need one kv mode per physical layer ({cfg.n_layers}), got "
                              f"{len(modes)}")
        self.depth = depth
        self.capacity = capacity
        self.page_size = page_size
        self.modes = tuple(modes)
        self._cfg = cfg
        self.layer_of_slot = slot_layers(cfg, depth)
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

    def _alive(self) -> None:
        if self._table_block is None:
            raise HandleError("RuntimeKVCache used after release()")

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

    def ensure_one_by_one(self, n_positions: int) -> None:
        """The slow reference of :meth:`ensure` (tests and ``benchmarks/bench_pages.py``):
        slot by slot, one ``PageAllocator.alloc`` per page (one pool allocation, one view, one
        memset each). Gives the same pages in the same order as :meth:`ensure` on a pool in the
        same state (one layout)."""
        self._alive()
        if n_positions > self.capacity:
            raise ConfigError(f"{n_positions} positions exceed the cache's capacity "
                              f"{self.capacity}")
        need = -(-n_positions // self.page_size)
        if need <= len(self._pages[-1]):
            return
        try:
            for s in range(self.n_slots):
                pages, lay = self._pages[s], self.layouts[s]
                while len(pages) < need:
                    page = self._alloc.alloc(lay)
                    self.table_host[s, len(pages)] = page.addr
                    pages.append(page)
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
        self.slots = room_slots(cache._cfg, depth, cache.depth)

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def ensure(self, n_positions: int) -> None:
        self.cache.ensure(n_positions)

    def slot(self, s: int) -> SlotKV:
        return self.cache.slot(self.slots[s])


@dataclass(frozen=True)
class Recon:
    """What a store-h slot's attention needs to rebuild K and V: ``w_kv`` (the K and V rows of
    the layer's QKV weight, a QuantWeight ``[2 kv_dim, d]``), RoPE ``theta``, the
    reconstruction ``chunk`` (positions rebuilt at a time; bounds the scratch), and ``scratch``
    (the backend's reconstruction buffers, or None on the NumPy reference)."""

    w_kv: object
    theta: float
    chunk: int
    scratch: object = None
    norm: tuple | None = None     # (weight, eps): the stored h is the raw residual (measured
                                  # alternative, NumPy only: docs/kv_modes.md), RMSNorm first
