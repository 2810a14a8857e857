"""INT4/INT8 group quantization of weight matrices (NumPy; the oracle for the GPU kernels).

A :class:`QuantWeight` holds a matrix ``W`` of shape ``[out_features, in_features]`` (one row
per output feature, as in ``y = x @ W.T``) as integer codes ``q`` plus one FP16 ``scale`` and
one FP16 ``zero`` per group of ``group_size`` consecutive input elements of a row:

    w[o, i] = float32(q[o, i]) * float32(scale[o, i // g]) + float32(zero[o, i // g])

evaluated in float32 in exactly that order (a product, then a sum), which is how the ``gguf``
package dequantizes Q4_1 (``d * q + m``) and Q8_0 (``d * q``, zero = 0). So GGUF Q4_1 and Q8_0
blocks (g = 32) convert losslessly.

Code layouts:
- INT4 (``bits=4``): unsigned codes 0..15, two per byte, ``qweight`` uint8 ``[out, in // 2]``;
  byte k of a row holds element 2k in its low nibble and element 2k+1 in its high nibble.
- INT8 (``bits=8``): signed codes -128..127, ``qweight`` int8 ``[out, in]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import GROUP_SIZES
from .errors import ConfigError


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A group-quantized matrix; see the module docstring for the layout.

    Attributes: ``bits`` (4 or 8), ``group_size`` (32, 64 or 128), ``qweight`` (uint8
    ``[out, in//2]`` for INT4, int8 ``[out, in]`` for INT8), ``scales`` and ``zeros`` (float16
    ``[out, in // group_size]``). Arrays may be host (NumPy) or device (CuPy) arrays.
    ``fp16`` is an optional dense float16 ``[out, in]`` copy on the device (the FP16 weight
    cache, ``TINYLOOP_FP16_CACHE``) that prefill GEMMs may use instead of the codes.
    """

    bits: int
    group_size: int
    qweight: object
    scales: object
    zeros: object
    fp16: object = None

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.qweight.shape
        return (int(rows), int(cols) * (2 if self.bits == 4 else 1))

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.qweight.nbytes + self.scales.nbytes + self.zeros.nbytes)

    def check(self) -> None:
        """Raise ConfigError if the parts disagree with each other."""
        check_quant_parts(self.bits, self.group_size, tuple(self.qweight.shape),
                          str(self.qweight.dtype), tuple(self.scales.shape),
                          str(self.scales.dtype), tuple(self.zeros.shape), str(self.zeros.dtype))


def check_quant_parts(bits, group_size, q_shape, q_dtype, s_shape, s_dtype, z_shape, z_dtype):
    """Validate a QuantWeight's parts from their shapes/dtypes; raise ConfigError."""
    if bits not in (4, 8):
        raise ConfigError(f"bits must be 4 or 8, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    want_q = "uint8" if bits == 4 else "int8"
    if q_dtype != want_q:
        raise ConfigError(f"INT{bits} qweight must be {want_q}, got {q_dtype}")
    if len(q_shape) != 2:
        raise ConfigError(f"qweight must be 2-D, got shape {q_shape}")
    rows = q_shape[0]
    cols = q_shape[1] * (2 if bits == 4 else 1)
    if cols % group_size:
        raise ConfigError(f"in_features={cols} is not a multiple of group_size={group_size}")
    want_s = (rows, cols // group_size)
    for name, shp, dt in (("scales", s_shape, s_dtype), ("zeros", z_shape, z_dtype)):
        if tuple(shp) != want_s:
            raise ConfigError(f"{name} shape {tuple(shp)} != expected {want_s}")
        if dt != "float16":
            raise ConfigError(f"{name} must be float16, got {dt}")


def first_non_finite(a, chunk: int = 1 << 20) -> tuple[tuple[int, ...], float] | None:
    """(index, value) of the first NaN or infinite element of the host float array ``a`` in
    C order, or None when every element is finite. Scans ``chunk`` elements at a time, so a
    memory-mapped weight is never copied whole."""
    a = np.asarray(a)
    flat = a.reshape(-1)
    for i in range(0, flat.size, chunk):
        bad = ~np.isfinite(flat[i:i + chunk])
        if bad.any():
            k = i + int(np.argmax(bad))
            return tuple(int(j) for j in np.unravel_index(k, a.shape)), float(flat[k])
    return None


def non_finite_message(name: str, a) -> str | None:
    """"``name``[i, j] is nan" for the first non-finite element of ``a``, or None. Used by the
    converter, the writer and the reader, which each raise their own error with it."""
    hit = first_non_finite(a)
    if hit is None:
        return None
    idx, v = hit
    return (f"{name}[{', '.join(map(str, idx))}] is {v}: a norm weight, scale or zero must be "
            "finite")


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 ``[out, in]`` (in even) -> packed uint8 ``[out, in // 2]``."""
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] % 2:
        raise ConfigError(f"pack_int4 needs [out, even in], got {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ConfigError("INT4 codes must lie in 0..15")
    c = codes.astype(np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """packed uint8 ``[out, in // 2]`` -> uint8 codes ``[out, in]``."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def codes(w: QuantWeight) -> np.ndarray:
    """The integer codes as an int32-compatible array ``[out, in]`` (uint8 or int8)."""
    return unpack_int4(w.qweight) if w.bits == 4 else np.asarray(w.qweight)


def dequantize(w: QuantWeight, rows: slice | np.ndarray | None = None) -> np.ndarray:
    """float32 ``[out, in]`` (or the selected rows) with w = q*scale + zero, in float32."""
    qw, sc, zr = np.asarray(w.qweight), np.asarray(w.scales), np.asarray(w.zeros)
    if rows is not None:
        qw, sc, zr = qw[rows], sc[rows], zr[rows]
    q = unpack_int4(qw) if w.bits == 4 else qw
    g = w.group_size
    n_out, n_in = q.shape
    qf = q.astype(np.float32).reshape(n_out, n_in // g, g)  # [out, groups, g]
    deq = qf * sc.astype(np.float32)[:, :, None] + zr.astype(np.float32)[:, :, None]
    return deq.reshape(n_out, n_in)


F16_MAX = 65504.0           # FP16's largest finite value


def saturate_scales(s: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """float32 scales (or zeros) ``s`` as the KV cache stores them: clamped to
    +-``F16_MAX`` where ``finite`` (the unit's inputs are all finite), NaN where not."""
    return np.where(finite, np.clip(s, -F16_MAX, F16_MAX), np.float32(np.nan)).astype(np.float32)


def saturate_f16(x: np.ndarray) -> np.ndarray:
    """float16 of float ``x`` with finite values clamped to +-``F16_MAX`` (no finite value
    becomes infinite); NaN and infinities are kept."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(x), np.clip(x, -F16_MAX, F16_MAX), x).astype(np.float16)


def quantize(w: np.ndarray, bits: int = 4, group_size: int = 32) -> QuantWeight:
    """Quantize float ``[out, in]`` per group with round-to-nearest.

    INT4: asymmetric min/max (scale = (max-min)/15, zero = min), codes 0..15, as GGUF Q4_1.
    INT8: symmetric absmax (scale = absmax/127, zero = 0), codes -127..127, as GGUF Q8_0.
    Scales/zeros are rounded to FP16 first and codes are chosen against the rounded values.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ConfigError(f"quantize needs a 2-D matrix, got shape {w.shape}")
    if bits not in (4, 8):
        raise ConfigError(f"bits must be 4 or 8, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if w.shape[1] % group_size:
        raise ConfigError(f"in_features={w.shape[1]} is not a multiple of group_size={group_size}")
    n_out, n_in = w.shape
    grp = w.reshape(n_out, n_in // group_size, group_size)
    if bits == 4:
        lo = grp.min(axis=2)
        hi = grp.max(axis=2)
        scale = ((hi - lo) / 15.0).astype(np.float16)
        zero = lo.astype(np.float16)
        s32 = scale.astype(np.float32)[:, :, None]
        z32 = zero.astype(np.float32)[:, :, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s32 > 0, np.rint((grp - z32) / s32), 0.0)
        q = np.clip(q, 0, 15).astype(np.uint8).reshape(n_out, n_in)
        return QuantWeight(4, group_size, pack_int4(q), scale, zero)
    q, scale = quantize_rows_int8(grp)
    return QuantWeight(8, group_size, q.reshape(n_out, n_in), scale, np.zeros_like(scale))


def quantize_rows_int8(x: np.ndarray, saturate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax INT8 over the last axis: ``(codes int8 [..., n], scales f16 [...])``.

    ``s = fp16(float32(max|x|) / 127)`` (the division in float32, then one rounding to FP16);
    ``q = clip(rint(float32(x) / float32(s)), -127, 127)``, chosen against the rounded ``s``
    (rint: round half to even); a row of zeros gets ``s = 0`` and codes 0. Read back as
    ``float32(q) * float32(s)``. The INT8 weights (GGUF Q8_0) and the ``int8`` KV cache mode
    (``cuda_src/rope.cu`` computes the same, bit for bit) both use it.

    ``saturate`` (the KV cache's rule, ``saturate_scales``): a scale above FP16's largest
    finite value is clamped to it, so a row with max|x| above ``127 * F16_MAX`` saturates
    to +-127 codes instead of getting an infinite scale; a row holding a NaN or an infinity
    gets a NaN scale and codes 0 (it reads back as NaN, that row only). Without it (the
    weights) such rows get a non-finite scale, which the converter rejects.
    """
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        s = amax / np.float32(127.0)
        scale = (saturate_scales(s, np.isfinite(amax)) if saturate else s).astype(np.float16)
    s32 = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 > 0, np.rint(x / s32), np.float32(0.0))
    return np.clip(q, -127, 127).astype(np.int8), scale


def int4_to_int8(w: QuantWeight) -> QuantWeight:
    """Losslessly widen INT4 codes (0..15) to INT8 codes with the same scales/zeros."""
    if w.bits == 8:
        return w
    return QuantWeight(8, w.group_size, unpack_int4(w.qweight).astype(np.int8),
                       np.asarray(w.scales), np.asarray(w.zeros))


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack QuantWeights along out_features (e.g. Q, K, V -> QKV) without requantizing.

    Mixed INT4/INT8 parts are widened to INT8 (lossless); group sizes must agree.
    """
    if not parts:
        raise ConfigError("concat_rows needs at least one part")
    gs = {p.group_size for p in parts}
    ins = {p.in_features for p in parts}
    if len(gs) != 1 or len(ins) != 1:
        raise ConfigError(f"cannot concatenate QuantWeights with group sizes {gs} / in {ins}")
    bits = max(p.bits for p in parts)
    if bits == 8:
        parts = [int4_to_int8(p) for p in parts]
    return QuantWeight(bits, parts[0].group_size,
                       np.concatenate([np.asarray(p.qweight) for p in parts], axis=0),
                       np.concatenate([np.asarray(p.scales) for p in parts], axis=0),
                       np.concatenate([np.asarray(p.zeros) for p in parts], axis=0))
