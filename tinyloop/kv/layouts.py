"""Page layouts of the paged KV cache: the five storage modes, the byte layout of one page, the
slot order of a looped pass (per iteration KV policy) and ``kv_mode`` resolution.

A request's attention state lives in fixed-size pages of ``P`` positions (``page_size``) for
one attention slot (layer, iteration). Slot indices follow ``docs/architecture.md`` (prelude
i -> i; recurrent j at iteration t -> P + t*R + j; coda c -> P + R*depth + c).

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

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..config import KV_MODES, ModelConfig
from ..errors import ConfigError

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
    sum beyond float32's range saturates at its largest value): backends/cuda/kernels/kv_h.cu
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
# tests/kv/test_kvcache.py checks the two agree). h_int4 is over it, so auto never picks it.
AUTO_KL_BOUND = 5e-3
AUTO_TABLE = {"prelude": "int8", "recurrent": "int8", "coda": "int8"}


# Iteration KV policies: how many K/V slots a recurrent layer keeps.
#  "all":    one slot per iteration (P + R*depth + C slots): iteration t of recurrent layer j
#            reads and writes slot P + t*R + j, so it attends to the earlier positions'
#            iteration-t K/V (Ouro's KV index ``current_ut * num_hidden_layers + layer_idx``).
#  "latest": one slot per recurrent layer (P + R + C slots), written by every iteration: an
#            iteration of layer j writes its positions' K/V into slot P + j and attends to
#            whatever that slot holds for the earlier positions, which is their last
#            iteration's K/V once their forward ended (Huginn's ``compress-s4`` step index
#            ``(step - 2) % 4 + 2`` over its 4 core blocks: seal-rg/recurrent-pretraining
#            ``raven_modeling_minimal.py`` HuginnStaticCache / HuginnDynamicCache.update).
#            Positions of one forward chunk see each other's current-iteration K/V (they are
#            written before the chunk's attention reads them), so a prompt's result depends on
#            where its chunks begin (``Model._chunks``: absolute multiples of the scratch rows).
# No "first_last" policy: no published measurement of it was found.
KV_ITERATIONS = ("all", "latest")


def check_kv_iterations(policy) -> str:
    """``policy`` when it is one of KV_ITERATIONS; ConfigError naming it otherwise."""
    if not isinstance(policy, str) or policy not in KV_ITERATIONS:
        raise ConfigError(f"unknown kv_iterations policy {policy!r}; expected one of "
                          f"{KV_ITERATIONS}")
    return policy


def slot_layers(cfg: ModelConfig, depth: int, kv_iterations: str = "all") -> list[int]:
    """The physical layer of every slot a cache at ``depth`` holds: prelude i -> i, then
    (``"all"``) recurrent j at iteration t -> P + t*R + j, coda c -> P + R*depth + c, or
    (``"latest"``) one slot per recurrent layer P + j, coda P + R + c (docs/architecture.md)."""
    check_kv_iterations(kv_iterations)
    p, r = cfg.n_prelude, cfg.n_recurrent
    held = depth if kv_iterations == "all" else min(depth, 1)
    return (list(range(p)) + [p + j for _ in range(held) for j in range(r)]
            + [p + r + c for c in range(cfg.n_coda)])


def slot_map(cfg: ModelConfig, depth: int, kv_iterations: str = "all") -> list[int]:
    """For every slot of the ``"all"`` order at ``depth`` (prelude i, recurrent P + t*R + j,
    coda P + R*depth + c: the indices the forward names), the slot of a ``kv_iterations``
    cache at ``depth`` that holds it: the identity for ``"all"``; for ``"latest"`` P + t*R + j
    -> P + j and the coda -> P + R + c."""
    check_kv_iterations(kv_iterations)
    p, r, n = cfg.n_prelude, cfg.n_recurrent, cfg.n_slots(depth)
    if kv_iterations == "all" or depth <= 1:
        return list(range(n))
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


def kv_bytes_per_token(cfg: ModelConfig, depth: int, modes, kv_dtype="float16",
                       kv_iterations: str = "all") -> int:
    """Bytes one position occupies over all slots of a ``kv_iterations`` cache at ``depth``
    (``slot_layers``; page rounding excluded)."""
    per_layer = [PageLayout.for_config(cfg, m, 1, kv_dtype).bytes_per_token for m in modes]
    return sum(per_layer[li] for li in slot_layers(cfg, depth, kv_iterations))


def mode_name(modes: tuple):
    """The public name of per-layer ``modes``: the mode name when every layer uses one, else
    the per-layer tuple."""
    return modes[0] if len(set(modes)) == 1 else tuple(modes)
