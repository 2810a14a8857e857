"""GGUF (llama architecture) -> .tlm conversion.

The GGUF file is read with the ``gguf`` package's ``GGUFReader`` (never parsed by hand). Each
weight is mapped as follows (see docs/format.md, "GGUF mapping"):

- Q4_1 (block of 32: ``d`` f16, ``m`` f16, 16 bytes ``qs``; element j in the low nibble of
  ``qs[j]``, element j+16 in the high nibble) -> INT4, g = 32, scale = d, zero = m, nibbles
  repacked to TinyLoop's order (byte k holds elements 2k (low) and 2k+1 (high)). Lossless.
- Q8_0 (block of 32: ``d`` f16, 32 int8) -> INT8, g = 32, scale = d, zero = 0. Lossless.
- Q4_0 (block of 32: ``d`` f16, 16 bytes of nibbles, value = d * (q - 8)) -> INT8 codes q - 8,
  g = 32, scale = d, zero = 0. Lossless.
- F32 / F16 / BF16 matrices -> :func:`tinyloop.quant.quantize` with the ``bits`` and
  ``group_size`` options (lossy, as any quantization is).
- any other type the ``gguf`` package can dequantize (K-quants, IQ*, Q5_*, ...) ->
  ``gguf.quants.dequantize`` then INT8, g = 32 (lossy, close); listed in the metadata.
- 1-D norm weights stay float32.

"Lossless" means: dequantizing the .tlm weight (``q * scale + zero`` in float32) gives exactly
the float32 values of ``gguf.quants.dequantize`` (up to the sign of zero: ``-0.0 + 0`` is
``+0.0``); tests/test_convert_gguf.py checks it for every tensor of the real model.

Q, K and V rows are fused into ``blk.{i}.attn_qkv`` and gate, up rows into
``blk.{i}.ffn_gate_up`` with :func:`tinyloop.quant.concat_rows` (no requantization).

RoPE: llama GGUF files store Q and K rows already permuted for GGML's "normal" (interleaved
pair) RoPE, which is what TinyLoop's forward uses (tinyloop/backends/numpy_ops.py), so the rows
are copied as they are.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ..config import GROUP_SIZES, ModelConfig
from ..errors import ConfigError, ConversionError, TokenizerError
from ..format import write_tlm
from ..quant import QuantWeight, concat_rows, pack_int4, quantize

CONVERTER_VERSION = 1   # bump when the output of convert_gguf changes for the same input

_BLOCK = 32             # elements per Q4_0 / Q4_1 / Q8_0 block
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


# --------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------
def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _require(reader, key: str):
    v = _field(reader, key)
    if v is None:
        raise ConversionError(f"GGUF metadata key {key!r} is missing")
    return v


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConversionError(f"{name} must be an int, got {v!r}")
    return v


# --------------------------------------------------------------------------------------------
# Converter
# --------------------------------------------------------------------------------------------
def convert_gguf(src, dst, *, recurrent=(10, 20), default_depth: int = 1, max_depth: int = 8,
                 bits: int = 4, group_size: int = 32) -> ModelConfig:
    """Convert a llama-architecture GGUF file ``src`` into the .tlm file ``dst``.

    ``recurrent`` is a half-open range ``(start, end)`` of the GGUF's layers that becomes the
    recurrent block: P = start prelude layers, R = end - start recurrent layers, C = n - end
    coda layers; layers keep their order (GGUF layer i is .tlm ``blk.{i}``). ``None`` makes a
    plain model (P = n, R = C = 0, max_depth 1). ``default_depth`` and ``max_depth`` go into the
    header (depth 1 is exactly the source model). ``bits`` (4 or 8) and ``group_size``
    (32/64/128) apply only to F32/F16/BF16 matrices; Q4_1/Q8_0/Q4_0 convert losslessly with
    g = 32.

    Returns the ModelConfig written. Raises ConversionError for a non-llama file, a bad
    ``recurrent`` range or option, missing/unexpected tensors or metadata, and unsupported
    tokenizers. The output is written atomically (temp file + rename).
    """
    gguf = _gguf()
    src = os.fspath(src)
    if bits not in (4, 8):
        raise ConversionError(f"bits must be 4 or 8, got {bits!r}")
    if group_size not in GROUP_SIZES:
        raise ConversionError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    try:
        reader = gguf.GGUFReader(src)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{src}: cannot read as GGUF: {e}") from None

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{src}: architecture {arch!r} is not supported; only 'llama' "
                              "GGUF files can be converted")
    n_layers = int(_require(reader, "llama.block_count"))
    d_model = int(_require(reader, "llama.embedding_length"))
    ffn_dim = int(_require(reader, "llama.feed_forward_length"))
    n_heads = int(_require(reader, "llama.attention.head_count"))
    n_kv_heads = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, "llama.attention.key_length", d_model // n_heads))
    if int(_field(reader, "llama.attention.value_length", head_dim)) != head_dim:
        raise ConversionError(f"{src}: key_length != value_length is not supported")
    rope_dims = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConversionError(f"{src}: partial RoPE (rope.dimension_count={rope_dims} < "
                              f"head_dim={head_dim}) is not supported")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ConversionError(f"{src}: RoPE scaling ({scaling!r} / rope_freqs) is not supported")
    rope_theta = float(_field(reader, "llama.rope.freq_base", 10000.0))
    norm_eps = float(_require(reader, "llama.attention.layer_norm_rms_epsilon"))

    # -- the recurrent block ------------------------------------------------------------------
    if recurrent is None:
        p, r, c = n_layers, 0, 0
        if max_depth != 1 or default_depth != 1:
            raise ConversionError("without a recurrent block, default_depth and max_depth "
                                  "must be 1")
    else:
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

    # -- tensors --------------------------------------------------------------------------------
    tensors_by_name = {t.name: t for t in reader.tensors}
    lossy: dict[str, str] = {}

    def take(name: str):
        t = tensors_by_name.pop(name, None)
        if t is None:
            raise ConversionError(f"{src}: tensor {name!r} is missing")
        return t

    def matrix(name: str) -> QuantWeight:
        t = take(name)
        if len(t.shape) != 2:
            raise ConversionError(f"{src}: tensor {name!r} has shape {list(t.shape)}, "
                                  "expected a matrix")
        in_features, rows = (int(x) for x in t.shape)   # GGML order: ne0 = in_features
        qt = t.tensor_type
        T = gguf.GGMLQuantizationType
        if qt == T.Q4_1:
            return q4_1_to_quant(t.data, rows, in_features)
        if qt == T.Q8_0:
            return q8_0_to_quant(t.data, rows, in_features)
        if qt == T.Q4_0:
            return q4_0_to_quant(t.data, rows, in_features)
        try:
            w = gguf.quants.dequantize(t.data, qt).reshape(rows, in_features)
        except NotImplementedError as e:
            raise ConversionError(f"{src}: tensor {name!r}: {e}") from None
        if qt in (T.F32, T.F16, T.BF16):
            if in_features % group_size:
                raise ConversionError(f"{src}: {name!r} in_features={in_features} is not a "
                                      f"multiple of group_size={group_size}")
            lossy[name] = f"{qt.name} -> INT{bits} g{group_size}"
            return quantize(w, bits=bits, group_size=group_size)
        lossy[name] = f"{qt.name} -> dequantize -> INT8 g32"
        return quantize(w, bits=8, group_size=32)

    def vector(name: str, n: int) -> np.ndarray:
        t = take(name)
        if [int(x) for x in t.shape] != [n]:
            raise ConversionError(f"{src}: tensor {name!r} has shape {list(t.shape)}, "
                                  f"expected [{n}]")
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(n)

    def fuse(name: str, parts: list[str]) -> QuantWeight:
        qws = [matrix(n) for n in parts]
        try:
            return concat_rows(qws)
        except ConfigError as e:
            raise ConversionError(f"{src}: cannot fuse {parts} into {name}: {e} (use "
                                  "group_size=32 to match the quantized tensors)") from None

    out: dict[str, object] = {}
    out["token_embd"] = matrix("token_embd.weight")
    vocab_size = out["token_embd"].out_features
    out["output_norm"] = vector("output_norm.weight", d_model)
    tied = "output.weight" not in tensors_by_name
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
        raise ConversionError(f"{src}: tensors this converter does not understand: "
                              f"{sorted(tensors_by_name)[:8]}")

    # -- tokenizer ------------------------------------------------------------------------------
    from ..tokenizer import build_tokenizer_json_from_gguf
    try:
        tokenizer_json = build_tokenizer_json_from_gguf(reader)
    except TokenizerError as e:
        raise ConversionError(f"{src}: {e}") from None
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_tokens != vocab_size:
        raise ConversionError(f"{src}: the tokenizer has {n_tokens} tokens but token_embd has "
                              f"{vocab_size} rows")
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", -1))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", -1))
    chat_template = _field(reader, "tokenizer.chat_template", "") or ""

    try:
        cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                          n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim,
                          n_prelude=p, n_recurrent=r, n_coda=c,
                          default_depth=default_depth, max_depth=max_depth,
                          rope_theta=rope_theta, norm_eps=norm_eps, injection="none",
                          tied_head=tied, bos_token_id=bos, eos_token_id=eos)
    except ConfigError as e:
        raise ConversionError(f"{src}: {e}") from None
    metadata = {
        "source": os.path.basename(src),
        "source_sha256": _sha256(src),
        "source_format": "gguf",
        "source_name": _field(reader, "general.name", ""),
        "converter": "tinyloop.convert.gguf",
        "converter_version": CONVERTER_VERSION,
        "options": {"recurrent": None if recurrent is None else [p, p + r],
                    "default_depth": default_depth, "max_depth": max_depth, "bits": bits,
                    "group_size": group_size},
        "lossy_tensors": lossy,
    }
    write_tlm(dst, cfg, out, tokenizer_json=tokenizer_json, chat_template=chat_template,
              metadata=metadata)
    return cfg
