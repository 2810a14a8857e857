"""GGUF (llama and Nanbeige architectures) -> .tlm conversion.

Files from outside are hostile: :func:`tinyloop.convert.gguf_check.check_gguf` first walks the
header with overflow-safe bounds checks (every count, length, offset and size against the file
length, tensor dims and types, alignment), and only then does the ``gguf`` package's
``GGUFReader`` parse it; metadata values are read with their GGUF type checked, norm weights
and scales must be finite, and the tokenizer's vocab and merges must agree. Every failure is
a ConversionError naming the field. Each weight is mapped as follows (see docs/format.md,
"GGUF mapping"):

- Q4_1 (block of 32: ``d`` f16, ``m`` f16, 16 bytes ``qs``; element j in the low nibble of
  ``qs[j]``, element j+16 in the high nibble) -> INT4, g = 32, scale = d, zero = m, nibbles
  repacked to TinyLoop's order (byte k holds elements 2k (low) and 2k+1 (high)). Lossless.
- Q8_0 (block of 32: ``d`` f16, 32 int8) -> INT8, g = 32, scale = d, zero = 0. Lossless.
- Q4_0 (block of 32: ``d`` f16, 16 bytes of nibbles, value = d * (q - 8)) -> INT8 codes q - 8,
  g = 32, scale = d, zero = 0. Lossless.
- Q5_0 (block of 32: ``d`` f16, ``qh`` u32 of fifth bits, 16 bytes of nibbles, value =
  d * (q - 16)) -> INT8 codes q - 16, g = 32, scale = d, zero = 0. Lossless.
- Q5_1 (block of 32: ``d`` f16, ``m`` f16, ``qh`` u32, 16 bytes of nibbles, value = d * q + m)
  -> INT8 codes q (0..31), g = 32, scale = d, zero = m. Lossless.
- Q4_K, Q5_K, Q6_K (super-blocks of 256 whose sub-block scales are ``d * sc``: products that an
  f16 scale cannot hold), F32, F16, BF16 matrices -> exact dequantization
  (``gguf.quants.dequantize``), then :func:`tinyloop.quant.quantize` with the ``bits`` and
  ``group_size`` options (lossy, as any quantization is; listed in ``lossy_tensors``).
- 1-D norm weights stay float32.
- any other type (Q2_K, Q3_K, IQ*, TQ*, MXFP4, ...) is refused: a ConversionError naming the
  tensor and its type, raised from the header before any tensor is converted.

"Lossless" means: dequantizing the .tlm weight (``q * scale + zero`` in float32) gives exactly
the float32 values of ``gguf.quants.dequantize`` (up to the sign of zero: ``-0.0 + 0`` is
``+0.0``); tests/convert/test_convert_gguf.py checks it for every tensor of the real model and
tests/convert/test_gguf_kquants.py for files made by llama.cpp's quantizer, where
``gguf.quants.dequantize`` itself is checked bit for bit against a decoder written from ggml's
block layouts (tests/ggml_blocks.py). The metadata's ``source_types`` records every source
tensor's GGML type.

Q, K and V rows are fused into ``blk.{i}.attn_qkv`` and gate, up rows into
``blk.{i}.ffn_gate_up`` with :func:`tinyloop.quant.concat_rows` (no requantization).

Architectures (``general.architecture``): ``llama``, and ``nanbeige`` (llama.cpp's
src/models/nanbeige.cpp): llama's keys under ``nanbeige.``, llama's tensors and RoPE, and the
whole stack trained to run ``nanbeige.num_loops`` times with shared weights, ``output_norm``
at each loop boundary unless ``nanbeige.skip_loop_final_norm``. It becomes a whole-stack loop
(P = 0, R = layers, C = 0, ``loop_norm = not skip_loop_final_norm``) whose default and
maximum depth are ``num_loops``; depth k runs the stack k times with the boundary norm
between passes, which is what llama.cpp computes for the same file with ``num_loops = k``.

RoPE: llama GGUF files store Q and K rows already permuted for GGML's "normal" (interleaved
pair) RoPE, which is what TinyLoop's forward uses (tinyloop/backends/numpy_ops.py), so the rows
are copied as they are.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np

from ..config import GROUP_SIZES, ModelConfig
from ..errors import ConfigError, ConversionError, FormatError, TokenizerError
from ..fileio import open_regular
from ..format import write_tlm
from ..quant import QuantWeight, concat_rows, non_finite_message, pack_int4, quantize
from .gguf_check import check_gguf

CONVERTER_VERSION = 3   # bump when the output of convert_gguf changes for the same input

_BLOCK = 32             # elements per Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConversionError("reading GGUF files needs the 'gguf' package: "
                              "pip install gguf") from None
    return gguf


# --------------------------------------------------------------------------------------------
# Block repacking (vectorised over the raw block bytes)
# --------------------------------------------------------------------------------------------
def _blocks(data: np.ndarray, rows: int, in_features: int, block_bytes: int) -> np.ndarray:
    """Raw uint8 tensor bytes -> ``[rows, n_blocks, block_bytes]``."""
    n_blocks = in_features // _BLOCK
    raw = np.ascontiguousarray(data).view(np.uint8)
    if raw.size != rows * n_blocks * block_bytes:
        raise ConversionError(f"tensor data has {raw.size} bytes, expected "
                              f"{rows * n_blocks * block_bytes} for [{rows}, {in_features}]")
    return raw.reshape(rows, n_blocks, block_bytes)


def q4_1_to_quant(data: np.ndarray, rows: int, in_features: int) -> QuantWeight:
    """GGUF Q4_1 bytes of a ``[rows, in_features]`` matrix -> INT4 QuantWeight (g = 32)."""
    b = _blocks(data, rows, in_features, 20)                      # [rows, nb, 20]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]   # [rows, nb]
    m = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[:, :, 0]
    qs = b[:, :, 4:20]                                            # [rows, nb, 16]
    # GGML order: element j (0..15) in the low nibble of qs[j], element j+16 in its high nibble
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)          # [rows, nb, 32]
    packed = pack_int4(codes.reshape(rows, in_features))          # byte k: 2k low, 2k+1 high
    return QuantWeight(4, _BLOCK, packed, d.copy(), m.copy())


def q8_0_to_quant(data: np.ndarray, rows: int, in_features: int) -> QuantWeight:
    """GGUF Q8_0 bytes of a ``[rows, in_features]`` matrix -> INT8 QuantWeight (g = 32)."""
    b = _blocks(data, rows, in_features, 34)                      # [rows, nb, 34]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]   # [rows, nb]
    q = np.ascontiguousarray(b[:, :, 2:34]).view(np.int8)         # [rows, nb, 32]
    return QuantWeight(8, _BLOCK, q.reshape(rows, in_features), d.copy(), np.zeros_like(d))


def q4_0_to_quant(data: np.ndarray, rows: int, in_features: int) -> QuantWeight:
    """GGUF Q4_0 bytes -> INT8 QuantWeight with codes q - 8 (g = 32); lossless."""
    b = _blocks(data, rows, in_features, 18)                      # [rows, nb, 18]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]
    qs = b[:, :, 2:18]                                            # [rows, nb, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int8) - np.int8(8)
    return QuantWeight(8, _BLOCK, codes.reshape(rows, in_features), d.copy(), np.zeros_like(d))


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes 0..31, int8 ``[rows, nb, 32]``, from ``qh`` ``[rows, nb, 4]`` (a
    little-endian u32: bit j is the fifth bit of element j) and ``qs`` ``[rows, nb, 16]``
    (element j in the low nibble of ``qs[j]``, element j+16 in the high nibble)."""
    bits = np.unpackbits(qh, axis=2, bitorder="little")          # [rows, nb, 32]: bit j
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)            # [rows, nb, 32]
    return (low | (bits << 4)).astype(np.int8)


def q5_0_to_quant(data: np.ndarray, rows: int, in_features: int) -> QuantWeight:
    """GGUF Q5_0 bytes -> INT8 QuantWeight with codes q - 16 (g = 32); lossless."""
    b = _blocks(data, rows, in_features, 22)                      # [rows, nb, 22]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]
    codes = _q5_codes(b[:, :, 2:6], b[:, :, 6:22]) - np.int8(16)
    return QuantWeight(8, _BLOCK, codes.reshape(rows, in_features), d.copy(), np.zeros_like(d))


def q5_1_to_quant(data: np.ndarray, rows: int, in_features: int) -> QuantWeight:
    """GGUF Q5_1 bytes -> INT8 QuantWeight with codes q (g = 32), zero = m; lossless."""
    b = _blocks(data, rows, in_features, 24)                      # [rows, nb, 24]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]
    m = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[:, :, 0]
    codes = _q5_codes(b[:, :, 4:8], b[:, :, 8:24])
    return QuantWeight(8, _BLOCK, codes.reshape(rows, in_features), d.copy(), m.copy())


# GGML type name -> the lossless block repacker; the types after it are dequantized exactly
# and quantized again with the ``bits`` / ``group_size`` options
EXACT_TYPES = {"Q4_1": q4_1_to_quant, "Q8_0": q8_0_to_quant, "Q4_0": q4_0_to_quant,
               "Q5_0": q5_0_to_quant, "Q5_1": q5_1_to_quant}
REQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = tuple(EXACT_TYPES) + REQUANTIZED_TYPES


# --------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_WANT = {"int": ("an integer", _INT_TYPES), "float": ("a number", _INT_TYPES | {"FLOAT32",
                                                                                "FLOAT64"}),
         "str": ("a string", {"STRING"}), "bool": ("true or false", {"BOOL"})}
_REQUIRED = object()
MAX_DIM = (1 << 31) - 1     # any dimension or count read from metadata stays below this
ARCHITECTURES = ("llama", "nanbeige")
MAX_LOOPS = 4096            # ModelConfig's bound on max_depth
# llama.cpp's LLAMA_MAX_LAYERS: it refuses a Nanbeige file whose layers * num_loops exceed it
MAX_LOOPED_LAYERS = 512
_AUTO = object()            # convert_gguf's ``recurrent`` when not given


def _meta(reader, layout, key: str, kind: str, default=_REQUIRED):
    """Metadata ``key`` checked to be of ``kind`` ("int" | "float" | "str" | "bool"): ints within
    0..MAX_DIM, floats finite. Raises ConversionError naming the key."""
    vtype = layout.keys.get(key)
    if vtype is None:
        if default is _REQUIRED:
            raise ConversionError(f"GGUF metadata key {key!r} is missing")
        return default
    what, types = _WANT[kind]
    if vtype not in types:
        raise ConversionError(f"GGUF metadata key {key!r} must be {what}, got a {vtype}")
    v = reader.fields[key].contents()
    if kind == "int" and not 0 <= v <= MAX_DIM:
        raise ConversionError(f"GGUF metadata key {key!r} = {v} is outside 0..{MAX_DIM}")
    if kind == "float" and not math.isfinite(v):
        raise ConversionError(f"GGUF metadata key {key!r} = {v} is not finite")
    return v


def _token_id(reader, layout, key: str, n_tokens: int) -> int:
    """A bos/eos id: -1 when absent, else within the vocab."""
    v = _meta(reader, layout, key, "int", -1)
    if not -1 <= v < n_tokens:
        raise ConversionError(f"GGUF metadata key {key!r} = {v} is not a token id of the "
                              f"{n_tokens}-token vocab")
    return v


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _nanbeige_loop(meta, n_layers: int) -> tuple[int, bool]:
    """(``nanbeige.num_loops``, ``nanbeige.skip_loop_final_norm``), defaults 1 and false as
    llama.cpp's; the loop count within 1..MAX_LOOPS and layers * loops within
    MAX_LOOPED_LAYERS. Raises ConversionError naming the key."""
    key = "nanbeige.num_loops"
    loops = meta(key, "int", 1)
    if not 1 <= loops <= MAX_LOOPS:
        raise ConversionError(f"GGUF metadata key {key!r} = {loops} is outside 1..{MAX_LOOPS}")
    if n_layers * loops > MAX_LOOPED_LAYERS:
        raise ConversionError(f"GGUF metadata key {key!r} = {loops} times the {n_layers} "
                              f"layers makes {n_layers * loops} layer passes, more than the "
                              f"{MAX_LOOPED_LAYERS} llama.cpp allows")
    return loops, bool(meta("nanbeige.skip_loop_final_norm", "bool", False))


def _is_pair(v, pair: tuple[int, int]) -> bool:
    try:
        a, b = v
    except (TypeError, ValueError):
        return False
    return all(not isinstance(x, bool) and isinstance(x, int) for x in (a, b)) and \
        (a, b) == pair


def _check_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConversionError(f"{name} must be an int, got {v!r}")
    return v


# --------------------------------------------------------------------------------------------
# Converter
# --------------------------------------------------------------------------------------------
def convert_gguf(src, dst, *, recurrent=_AUTO, default_depth: int | None = None,
                 max_depth: int | None = None, bits: int = 4,
                 group_size: int = 32) -> ModelConfig:
    """Convert a llama or Nanbeige GGUF file ``src`` into the .tlm file ``dst``.

    llama: ``recurrent`` is a half-open range ``(start, end)`` of the GGUF's layers that
    becomes the recurrent block (default ``(10, 20)``): P = start prelude layers, R = end -
    start recurrent layers, C = n - end coda layers; layers keep their order (GGUF layer i is
    .tlm ``blk.{i}``). ``None`` makes a plain model (P = n, R = C = 0, depths 1).
    ``default_depth`` (default 1) and ``max_depth`` (default 8, or 1 for a plain model) go
    into the header (depth 1 is exactly the source model).

    Nanbeige: the file's own loop, the whole stack (``recurrent`` not given, ``None`` or
    ``(0, n)``); ``default_depth`` defaults to ``nanbeige.num_loops`` and ``max_depth`` to the
    larger of the two (depth k = k passes of the stack, see the module docstring).

    ``bits`` (4 or 8) and ``group_size``
    (32/64/128) apply to the matrices that are quantized again (``REQUANTIZED_TYPES``: F32,
    F16, BF16, Q4_K, Q5_K, Q6_K, after exact dequantization); Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
    convert losslessly with g = 32 (``EXACT_TYPES``).

    Returns the ModelConfig written. Raises ConversionError (its message starts with ``src``
    and names the field) for a file that is not well-formed GGUF (``check_gguf``: truncated,
    sizes or offsets past the end, more than 4 dims, a tensor whose ne0 is not a multiple of
    its type's block, ...), a tensor of a GGML type outside ``SUPPORTED_TYPES`` (naming the
    tensor and the type), a file of another architecture, a bad
    ``recurrent`` range or option, missing/unexpected tensors, metadata of the wrong type,
    non-finite norm weights or scales, unsupported or inconsistent tokenizers, and a Nanbeige
    loop count outside 1..MAX_LOOPS or whose layers * loops exceed MAX_LOOPED_LAYERS (the key
    named). The dims, the loop and the tokenizer are checked from the header before any
    tensor is converted. The output
    is written atomically (temp file + rename).
    """
    gguf = _gguf()
    src = os.fspath(src)
    if bits not in (4, 8):
        raise ConversionError(f"bits must be 4 or 8, got {bits!r}")
    if group_size not in GROUP_SIZES:
        raise ConversionError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    layout = check_gguf(src)                  # structure first: raises ConversionError
    try:
        reader = gguf.GGUFReader(src)
    except Exception as e:     # the structure passed check_gguf: a limit of the reader itself
        raise ConversionError(f"{src}: the gguf package cannot read this file: "
                              f"{type(e).__name__}: {e}") from None
    try:
        return _convert(gguf, reader, layout, src, dst, recurrent, default_depth, max_depth,
                        bits, group_size)
    except ConversionError as e:
        msg = str(e)
        raise ConversionError(msg if msg.startswith(src) else f"{src}: {msg}") from None


def _convert(gguf, reader, layout, src, dst, recurrent, default_depth, max_depth, bits,
             group_size) -> ModelConfig:
    def meta(key, kind, default=_REQUIRED):
        return _meta(reader, layout, key, kind, default)

    arch = meta("general.architecture", "str", None)
    if arch not in ARCHITECTURES:
        raise ConversionError(f"architecture {arch!r} is not supported; only "
                              f"{' and '.join(map(repr, ARCHITECTURES))} GGUF files can be "
                              "converted")
    n_layers = meta(f"{arch}.block_count", "int")
    d_model = meta(f"{arch}.embedding_length", "int")
    ffn_dim = meta(f"{arch}.feed_forward_length", "int")
    n_heads = meta(f"{arch}.attention.head_count", "int")
    if n_heads == 0:
        raise ConversionError(f"GGUF metadata key '{arch}.attention.head_count' is 0")
    n_kv_heads = meta(f"{arch}.attention.head_count_kv", "int", n_heads)
    head_dim = meta(f"{arch}.attention.key_length", "int", d_model // n_heads)
    if meta(f"{arch}.attention.value_length", "int", head_dim) != head_dim:
        raise ConversionError("key_length != value_length is not supported")
    rope_dims = meta(f"{arch}.rope.dimension_count", "int", head_dim)
    if rope_dims != head_dim:
        raise ConversionError(f"partial RoPE (rope.dimension_count={rope_dims} < "
                              f"head_dim={head_dim}) is not supported")
    # llama.cpp scales RoPE positions by 1 / factor whatever the type key says (its default
    # type is "linear"): a factor other than 0 (unset) or 1 changes the forward
    factor = float(meta(f"{arch}.rope.scaling.factor", "float",
                        meta(f"{arch}.rope.scale_linear", "float", 0.0)))
    if factor not in (0.0, 1.0):
        raise ConversionError(f"RoPE scaling factor {factor!r} ({arch}.rope.scaling.factor / "
                              "rope.scale_linear) is not supported")
    scaling = meta(f"{arch}.rope.scaling.type", "str", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in {t.name for t in
                                                                   layout.tensors}:
        raise ConversionError(f"RoPE scaling ({scaling!r} / rope_freqs) is not supported")
    rope_theta = float(meta(f"{arch}.rope.freq_base", "float", 10000.0))
    norm_eps = float(meta(f"{arch}.attention.layer_norm_rms_epsilon", "float"))

    # -- the recurrent block ------------------------------------------------------------------
    facts = {}
    if arch == "nanbeige":
        loops, skip_norm = _nanbeige_loop(meta, n_layers)
        if not (recurrent is _AUTO or recurrent is None
                or _is_pair(recurrent, (0, n_layers))):
            raise ConversionError(f"a Nanbeige GGUF loops its whole stack of {n_layers} "
                                  f"layers: recurrent must be (0, {n_layers}) or not given, "
                                  f"got {recurrent!r}")
        p, r, c = 0, n_layers, 0
        default_depth = loops if default_depth is None else default_depth
        max_depth = max(loops, default_depth) if max_depth is None else max_depth
        facts["loop_norm"] = not skip_norm
    elif recurrent is None:
        p, r, c = n_layers, 0, 0
        default_depth = 1 if default_depth is None else default_depth
        max_depth = 1 if max_depth is None else max_depth
        if max_depth != 1 or default_depth != 1:
            raise ConversionError("without a recurrent block, default_depth and max_depth "
                                  "must be 1")
    else:
        recurrent = (10, 20) if recurrent is _AUTO else recurrent
        default_depth = 1 if default_depth is None else default_depth
        max_depth = 8 if max_depth is None else max_depth
        try:
            start, end = recurrent
        except (TypeError, ValueError):
            raise ConversionError(f"recurrent must be a (start, end) pair of layer indices, "
                                  f"got {recurrent!r}") from None
        start, end = _check_int("recurrent start", start), _check_int("recurrent end", end)
        if not 0 <= start < end <= n_layers:
            raise ConversionError(f"recurrent=({start}, {end}) is not a non-empty range "
                                  f"[start, end) within the model's {n_layers} layers "
                                  f"(need 0 <= start < end <= {n_layers})")
        p, r, c = start, end - start, n_layers - end
    _check_int("default_depth", default_depth)
    _check_int("max_depth", max_depth)
    if not 1 <= default_depth <= max_depth:
        raise ConversionError(f"need 1 <= default_depth ({default_depth}) <= max_depth "
                              f"({max_depth})")

    # -- the config, from the header alone (before any tensor is converted) -------------------
    infos = {t.name: t for t in layout.tensors}
    emb = infos.get("token_embd.weight")
    if emb is None:
        raise ConversionError("tensor 'token_embd.weight' is missing")
    if len(emb.dims) != 2:
        raise ConversionError(f"tensor 'token_embd.weight' has shape {list(emb.dims)}, "
                              "expected a matrix")
    vocab_size = emb.dims[1]                                # GGML order: ne1 = rows
    tied = "output.weight" not in infos
    from ..tokenizer import build_tokenizer_json_from_gguf
    try:
        tokenizer_json = build_tokenizer_json_from_gguf(reader)
    except TokenizerError as e:
        raise ConversionError(str(e)) from None
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_tokens != vocab_size:
        raise ConversionError(f"the tokenizer has {n_tokens} tokens but token_embd has "
                              f"{vocab_size} rows")
    bos = _token_id(reader, layout, "tokenizer.ggml.bos_token_id", n_tokens)
    eos = _token_id(reader, layout, "tokenizer.ggml.eos_token_id", n_tokens)
    chat_template = meta("tokenizer.chat_template", "str", "")
    try:
        cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                          n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim,
                          n_prelude=p, n_recurrent=r, n_coda=c,
                          default_depth=default_depth, max_depth=max_depth,
                          rope_theta=rope_theta, norm_eps=norm_eps, injection="none",
                          tied_head=tied, bos_token_id=bos, eos_token_id=eos, **facts)
    except ConfigError as e:
        raise ConversionError(str(e)) from None

    T = gguf.GGMLQuantizationType
    for info in layout.tensors:                  # every type, before any tensor is converted
        name_of_type = T(info.ggml_type).name
        if name_of_type not in SUPPORTED_TYPES:
            raise ConversionError(f"tensor {info.name!r} has GGML type {name_of_type}, which "
                                  f"this converter does not read (it reads "
                                  f"{', '.join(SUPPORTED_TYPES)})")

    # -- tensors --------------------------------------------------------------------------------
    tensors_by_name = {t.name: t for t in reader.tensors}
    lossy: dict[str, str] = {}

    def take(name: str):
        t = tensors_by_name.pop(name, None)
        if t is None:
            raise ConversionError(f"tensor {name!r} is missing")
        return t

    def finite(name: str, what: str, a) -> None:
        bad = non_finite_message(what, a)
        if bad:
            raise ConversionError(f"tensor {name!r}: {bad}")

    def raw(name: str, t) -> np.ndarray:
        """The tensor's bytes, whose count the checked header fixed (element count / block
        elements * block bytes, within the file): the reader must agree before decoding."""
        want = infos[name].nbytes
        data = t.data
        if data.nbytes != want:
            raise ConversionError(f"tensor {name!r}: the reader gives {data.nbytes} bytes, the "
                                  f"header's {T(infos[name].ggml_type).name} shape needs {want}")
        return data

    def matrix(name: str) -> QuantWeight:
        t = take(name)
        if len(t.shape) != 2:
            raise ConversionError(f"tensor {name!r} has shape {list(t.shape)}, expected a "
                                  "matrix")
        in_features, rows = (int(x) for x in t.shape)   # GGML order: ne0 = in_features
        qt = t.tensor_type
        data = raw(name, t)
        if qt.name in EXACT_TYPES:
            w = EXACT_TYPES[qt.name](data, rows, in_features)
        else:
            dense = gguf.quants.dequantize(data, qt).reshape(rows, in_features)
            finite(name, "weight", dense)     # before quantize: it would hide the element
            if in_features % group_size:
                raise ConversionError(f"{name!r} in_features={in_features} is not a "
                                      f"multiple of group_size={group_size}")
            lossy[name] = f"{qt.name} -> INT{bits} g{group_size}"
            w = quantize(dense, bits=bits, group_size=group_size)
        finite(name, "scales", w.scales)      # GGUF block scales, or from a huge dense value
        finite(name, "zeros", w.zeros)
        return w

    def vector(name: str, n: int) -> np.ndarray:
        t = take(name)
        if [int(x) for x in t.shape] != [n]:
            raise ConversionError(f"tensor {name!r} has shape {list(t.shape)}, expected [{n}]")
        v = gguf.quants.dequantize(raw(name, t), t.tensor_type).astype(np.float32).reshape(n)
        finite(name, "weight", v)
        return v

    def fuse(name: str, parts: list[str]) -> QuantWeight:
        qws = [matrix(n) for n in parts]
        try:
            return concat_rows(qws)
        except ConfigError as e:
            raise ConversionError(f"cannot fuse {parts} into {name}: {e} (use group_size=32 "
                                  "to match the quantized tensors)") from None

    out: dict[str, object] = {}
    out["token_embd"] = matrix("token_embd.weight")
    out["output_norm"] = vector("output_norm.weight", d_model)
    if not tied:
        out["output"] = matrix("output.weight")
    for i in range(n_layers):
        g = f"blk.{i}."
        out[g + "attn_norm"] = vector(g + "attn_norm.weight", d_model)
        out[g + "attn_qkv"] = fuse(g + "attn_qkv", [g + "attn_q.weight", g + "attn_k.weight",
                                                    g + "attn_v.weight"])
        out[g + "attn_output"] = matrix(g + "attn_output.weight")
        out[g + "ffn_norm"] = vector(g + "ffn_norm.weight", d_model)
        out[g + "ffn_gate_up"] = fuse(g + "ffn_gate_up", [g + "ffn_gate.weight",
                                                          g + "ffn_up.weight"])
        out[g + "ffn_down"] = matrix(g + "ffn_down.weight")
    if tensors_by_name:
        raise ConversionError(f"tensors this converter does not understand: "
                              f"{sorted(tensors_by_name)[:8]}")

    metadata = {
        "source": os.path.basename(src),
        "source_sha256": _sha256(src),
        "source_format": "gguf",
        "source_name": meta("general.name", "str", ""),
        "source_architecture": arch,
        # a plain llama's layers, never trained to run more than once: depths above 1
        # degrade the text (tinyloop.model.loop_is_artificial); Nanbeige's are trained to loop
        "loop": "trained" if arch == "nanbeige" else "artificial",
        "converter": "tinyloop.convert.gguf",
        "converter_version": CONVERTER_VERSION,
        "options": {"recurrent": [p, p + r] if r else None,
                    "default_depth": default_depth, "max_depth": max_depth, "bits": bits,
                    "group_size": group_size},
        "lossy_tensors": lossy,
        "source_types": {t.name: T(t.ggml_type).name for t in layout.tensors},
    }
    try:
        write_tlm(dst, cfg, out, tokenizer_json=tokenizer_json, chat_template=chat_template,
                  metadata=metadata)
    except FormatError as e:     # the converted tensors disagree with the dims in the header
        raise ConversionError(str(e)) from None
    return cfg
