"""An independent NumPy dequantizer of GGML blocks, written from ggml's block layouts
(ggml/src/ggml-common.h) and dequantize_row_* loops (ggml/src/ggml-quants.c), to check the
``gguf`` package's ``gguf.quants.dequantize`` that the converter relies on.

Each function takes the raw bytes of ``n_blocks`` blocks as uint8 ``[n_blocks, block_bytes]``
and returns float32 ``[n_blocks, block_elements]``, evaluating each element with the C code's
float32 operations in the C code's order (no fused multiply-add).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
F32 = np.float32


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The ggml_half at byte ``at`` of every block, as float32 ``[n_blocks]``."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16)[:, 0].astype(F32)


def q4_0(b):        # d | qs[16]; element j low nibble of qs[j], j+16 high nibble
    d, qs = _f16(b, 0), b[:, 2:18].astype(np.int32)
    x = np.concatenate([(qs & 0x0F) - 8, (qs >> 4) - 8], axis=1)
    return x.astype(F32) * d[:, None]


def q4_1(b):        # d | m | qs[16]
    d, m, qs = _f16(b, 0), _f16(b, 2), b[:, 4:20].astype(np.int32)
    x = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return x.astype(F32) * d[:, None] + m[:, None]


def _q5_codes(qh_bytes, qs):
    qh = qh_bytes.astype(np.uint32)
    qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)   # little-endian
    j = np.arange(16, dtype=np.uint32)
    xh0 = ((qh[:, None] >> j) << 4) & 0x10
    xh1 = (qh[:, None] >> (j + 12)) & 0x10
    qs = qs.astype(np.uint32)
    return np.concatenate([(qs & 0x0F) | xh0, (qs >> 4) | xh1], axis=1).astype(np.int32)


def q5_0(b):        # d | qh[4] | qs[16]; value d * (q - 16)
    d = _f16(b, 0)
    x = _q5_codes(b[:, 2:6], b[:, 6:22]) - 16
    return x.astype(F32) * d[:, None]


def q5_1(b):        # d | m | qh[4] | qs[16]; value d * q + m
    d, m = _f16(b, 0), _f16(b, 2)
    x = _q5_codes(b[:, 4:8], b[:, 8:24])
    return x.astype(F32) * d[:, None] + m[:, None]


def q8_0(b):        # d | qs[32] int8
    d = _f16(b, 0)
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(F32) * d[:, None]


def _scale_min_k4(j: int, q: np.ndarray):
    """get_scale_min_k4: the 6-bit scale and min of sub-block ``j`` from scales[12]."""
    q = q.astype(np.int32)
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    return ((q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4),
            (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4))


def _k_scales(b):
    """d1, m1 per 32-element sub-block: float32 ``[n_blocks, 8]`` each (d * sc, dmin * m)."""
    d, dmin, scales = _f16(b, 0), _f16(b, 2), b[:, 4:16]
    d1, m1 = [], []
    for j in range(8):
        sc, m = _scale_min_k4(j, scales)
        d1.append(d * sc.astype(F32))
        m1.append(dmin * m.astype(F32))
    return np.stack(d1, axis=1), np.stack(m1, axis=1)


def q4_k(b):        # d | dmin | scales[12] | qs[128]
    d1, m1 = _k_scales(b)
    qs = b[:, 16:144].astype(np.int32)
    out = np.empty((len(b), QK_K), F32)
    for c in range(4):                       # 64 elements per 32 bytes of qs
        q = qs[:, 32 * c:32 * c + 32]
        lo, hi = 2 * c, 2 * c + 1
        out[:, 64 * c:64 * c + 32] = d1[:, lo:lo + 1] * (q & 0xF).astype(F32) - m1[:, lo:lo + 1]
        out[:, 64 * c + 32:64 * c + 64] = (d1[:, hi:hi + 1] * (q >> 4).astype(F32)
                                           - m1[:, hi:hi + 1])
    return out


def q5_k(b):        # d | dmin | scales[12] | qh[32] | qs[128]
    d1, m1 = _k_scales(b)
    qh = b[:, 16:48].astype(np.int32)
    qs = b[:, 48:176].astype(np.int32)
    out = np.empty((len(b), QK_K), F32)
    for c in range(4):
        ql = qs[:, 32 * c:32 * c + 32]
        u1, u2 = 1 << (2 * c), 2 << (2 * c)
        lo, hi = 2 * c, 2 * c + 1
        q_lo = (ql & 0xF) + np.where(qh & u1, 16, 0)
        q_hi = (ql >> 4) + np.where(qh & u2, 16, 0)
        out[:, 64 * c:64 * c + 32] = d1[:, lo:lo + 1] * q_lo.astype(F32) - m1[:, lo:lo + 1]
        out[:, 64 * c + 32:64 * c + 64] = d1[:, hi:hi + 1] * q_hi.astype(F32) - m1[:, hi:hi + 1]
    return out


def q6_k(b):        # ql[128] | qh[64] | scales[16] int8 | d
    ql_all, qh_all = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc_all = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(F32)
    d = _f16(b, 208)
    out = np.empty((len(b), QK_K), F32)
    for half in range(2):                    # n = 0, 128
        ql, qh = ql_all[:, 64 * half:64 * half + 64], qh_all[:, 32 * half:32 * half + 32]
        sc = sc_all[:, 8 * half:8 * half + 8]
        for l in range(32):
            is_ = l // 16
            q1 = ((ql[:, l] & 0xF) | (((qh[:, l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, l + 32] & 0xF) | (((qh[:, l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, l] >> 4) | (((qh[:, l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, l + 32] >> 4) | (((qh[:, l] >> 6) & 3) << 4)) - 32
            y = out[:, 128 * half:128 * half + 128]
            y[:, l] = d * sc[:, is_] * q1.astype(F32)
            y[:, l + 32] = d * sc[:, is_ + 2] * q2.astype(F32)
            y[:, l + 64] = d * sc[:, is_ + 4] * q3.astype(F32)
            y[:, l + 96] = d * sc[:, is_ + 6] * q4.astype(F32)
    return out


# type name -> (elements per block, bytes per block, decoder, byte offsets of its f16 fields)
BLOCKS = {
    "Q4_0": (32, 18, q4_0, (0,)),
    "Q4_1": (32, 20, q4_1, (0, 2)),
    "Q5_0": (32, 22, q5_0, (0,)),
    "Q5_1": (32, 24, q5_1, (0, 2)),
    "Q8_0": (32, 34, q8_0, (0,)),
    "Q4_K": (QK_K, 144, q4_k, (0, 2)),
    "Q5_K": (QK_K, 176, q5_k, (0, 2)),
    "Q6_K": (QK_K, 210, q6_k, (208,)),
}


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Raw tensor bytes (any shape of uint8) of GGML type ``type_name`` -> flat float32."""
    elems, nbytes, fn, _ = BLOCKS[type_name]
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, nbytes)
    return fn(b).reshape(-1)
