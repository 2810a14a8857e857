"""The NumPy reference backend: the oracle every CUDA kernel is checked against.

Written for clarity, in float32, with float64 where it matters (RMSNorm's mean square, RoPE
angles, attention scores and softmax sums). Matrix products run as float32 BLAS products of
the dequantized weights; with the weight cache (``make_fp16_cache``; on by default on this
backend, ``TINYLOOP_FP16_CACHE=0`` turns it off) the dequantized float32 matrices are kept in
the pool under tag "fp16_cache" instead of being dequantized on every call. See ``base.py`` for the conventions shared by all ops.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..kv.layouts import hadamard_rotate
from ..quant import (QuantWeight, dequantize, pack_int4, quantize_rows_int8, saturate_f16,
                     saturate_scales, unpack_int4)
from .base import Ops, logit_fault, non_finite_logits


def rope_tables(positions: np.ndarray, head_dim: int, theta: float):
    """cos/sin ``[T, head_dim // 2]`` (float64) for interleaved-pair RoPE.

    Angle of pair i at position p: p * theta ** (-2i / head_dim) (Su et al., RoFormer, eq. 34;
    GGML's ``rope`` "normal" mode).
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` ``[T, heads, head_dim]`` by interleaved pairs; returns float32."""
    x0 = x[..., 0::2].astype(np.float64)
    x1 = x[..., 1::2].astype(np.float64)
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty(x.shape, dtype=np.float32)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def encode_h(h: np.ndarray, layout) -> dict:
    """Store-h page parts for float32 rows ``h`` [T, d] in ``layout``'s mode.

    h_fp16: float16. h_int8: per-token groups of ``layout.group_size``, symmetric absmax as
    the INT8 weights (``quant.quantize_rows_int8``). h_int4: ``encode_h_int4``. What FP16
    cannot hold saturates (``quant.saturate_f16``, ``saturate=True``): finite values stay
    finite, a group holding a NaN or an infinity gets a NaN scale and reads back as NaN."""
    h = np.asarray(h, dtype=np.float32)
    if layout.mode == "h_fp16":
        return {"h": saturate_f16(h)}
    if layout.mode == "h_int4":
        return encode_h_int4(h, layout)
    n, d = h.shape
    q, sc = quantize_rows_int8(h.reshape(n, d // layout.group_size, layout.group_size),
                               saturate=True)
    return {"h": q.reshape(n, d), "h_scale": sc}


def decode_h(rows: dict, layout) -> np.ndarray:
    """float32 ``[n, d]`` rows of h from store-h page parts (the inverse of encode_h:
    ``float32(q) * float32(s)`` for h_int8, ``decode_h_int4`` for h_int4)."""
    if layout.mode == "h_fp16":
        return rows["h"].astype(np.float32)
    if layout.mode == "h_int4":
        return decode_h_int4(rows, layout)
    zeros = np.zeros_like(rows["h_scale"])
    return dequantize(QuantWeight(8, layout.group_size, rows["h"], rows["h_scale"], zeros))


# --- h_int4 ------------------------------------------------------------------------------------
ROT_FLAG = 0x8000        # an h_int4 scale's sign bit: its group is stored in the Hadamard basis


def select_outliers(h: np.ndarray, k: int) -> np.ndarray:
    """int64 ``[n, k]``: per row of float32 ``h`` [n, d], the k channels of largest |h|,
    largest first (ties: the lower channel first; NaN ranks below every number)."""
    key = np.where(np.isnan(h), np.float32(-1.0), np.abs(h))
    return np.argsort(-key, axis=1, kind="stable")[:, :k]


def quantize_int4_groups(x: np.ndarray):
    """Asymmetric min/max INT4 of each group of float32 ``x`` [..., g], as the INT4 weights
    (``quant.quantize``) with the KV cache's saturation: ``s = fp16(clamp((hi - lo) / 15))``,
    ``z = fp16(clamp(lo))`` (clamped to +-F16_MAX), ``q = clip(rint((x - z) / s), 0, 15)``
    against the rounded s and z, codes 0 where s = 0; a group holding a NaN or an infinity
    gets NaN scale and zero and codes 0. Returns (codes uint8 [..., g], scale f16 [...],
    zero f16 [...], back float32 [..., g] = q * s + z in float32)."""
    finite = np.isfinite(x).all(axis=-1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        lo, hi = x.min(axis=-1), x.max(axis=-1)
        scale = saturate_scales((hi - lo) / np.float32(15.0), finite).astype(np.float16)
        zero = saturate_scales(lo, finite).astype(np.float16)
        s32 = scale.astype(np.float32)[..., None]
        z32 = zero.astype(np.float32)[..., None]
        q = np.where(s32 > 0, np.rint((x - z32) / s32), np.float32(0.0))
        q = np.clip(q, 0, 15).astype(np.float32)
        back = q * s32 + z32
    return q.astype(np.uint8), scale, zero, back


def warp_sum(x: np.ndarray) -> np.ndarray:
    """float32 sum over the last axis (32 lanes) in the order of common.cuh ``warp_sum``: the
    xor butterfly over offsets 16, 8, 4, 2, 1 (lane 0's result)."""
    lanes = np.arange(x.shape[-1])
    v = np.asarray(x, np.float32)
    o = x.shape[-1] // 2
    while o:
        v = v + v[..., lanes ^ o]
        o //= 2
    return v[..., 0]


def encode_h_int4(h: np.ndarray, layout) -> dict:
    """h_int4 page parts of float32 rows ``h`` [n, d] (cuda/kernels/kv_h.cu ``h_write_h_int4``
    stores the same bytes for the same FP16 rows).

    1. The ``layout.outliers`` channels of largest |h| per row (``select_outliers``) are kept
       as float16 (``h_oidx``, ``h_oval``; ``quant.saturate_f16``); decode writes them back
       over whatever their group reconstructs there.
    2. Each group of ``layout.group_size`` channels is quantized by ``quantize_int4_groups``
       in up to four ways: its values as they are or with its outlier channels set to 0
       (they are stored apart), each in the plain basis or (``layout.rotate``) the Hadamard
       one (``kv.layouts.hadamard_rotate``). The way whose reconstruction (rotated back) has the
       smallest float32 sum of squared errors over the group's other channels (``warp_sum``;
       a non-finite sum counts as infinite) is stored, the first such in that order on a
       tie; a Hadamard group's scale carries ``ROT_FLAG``. So an outlier no longer sets its
       group's range, and a group that the rotation would spoil (values already on a 4-bit
       grid, or one outlier it would smear over the group) stays plain.
    """
    n, d = h.shape
    g, k = layout.group_size, layout.outliers
    x = h.reshape(n, d // g, g)
    mask = np.zeros((n, d), bool)
    parts = {}
    if k:
        idx = select_outliers(h, k)
        np.put_along_axis(mask, idx, True, axis=1)
        parts["h_oidx"] = idx.astype(np.uint16)
        parts["h_oval"] = saturate_f16(np.take_along_axis(h, idx, axis=1))
    mask = mask.reshape(x.shape)
    inputs = [x, np.where(mask, np.float32(0.0), x)]
    ways = [(v, False) for v in inputs] + ([(v, True) for v in inputs] if layout.rotate else [])
    got, sse = [], []
    for v, rot in ways:
        codes, sc, zr, back = quantize_int4_groups(hadamard_rotate(v, g) if rot else v)
        if rot:
            back = hadamard_rotate(back, g)
            sc = (sc.view(np.uint16) | np.uint16(ROT_FLAG)).view(np.float16)
        with np.errstate(over="ignore", invalid="ignore"):
            err = np.where(mask, np.float32(0.0), back - x)
            e = warp_sum(err * err)
        sse.append(np.where(np.isnan(e), np.float32(np.inf), e))
        got.append((codes, sc, zr))
    best = np.argmin(np.stack(sse), axis=0)[None]                  # [1, n, groups]: first min
    codes, sc, zr = (np.stack([w[i] for w in got]) for i in range(3))
    codes = np.take_along_axis(codes, best[..., None], axis=0)[0]
    parts.update(h=pack_int4(codes.reshape(n, d)),
                 h_scale=np.take_along_axis(sc, best, axis=0)[0],
                 h_zero=np.take_along_axis(zr, best, axis=0)[0])
    return parts


def decode_h_int4(rows: dict, layout) -> np.ndarray:
    """float32 ``[n, d]`` from h_int4 parts: ``float32(q) * |s| + z`` per group (float32
    product, then sum), rotated back where the scale carries ``ROT_FLAG``, then the outlier
    channels overwritten with their float16 values."""
    g = layout.group_size
    q = unpack_int4(rows["h"]).astype(np.float32)
    n, d = q.shape
    bits = rows["h_scale"].view(np.uint16)
    rot = (bits & ROT_FLAG) != 0
    s32 = (bits & ~np.uint16(ROT_FLAG)).view(np.float16).astype(np.float32)[..., None]
    z32 = rows["h_zero"].astype(np.float32)[..., None]
    back = q.reshape(n, d // g, g) * s32 + z32
    if rot.any():
        back = np.where(rot[..., None], hadamard_rotate(back, g), back)
    out = back.reshape(n, d)
    if layout.outliers:
        np.put_along_axis(out, rows["h_oidx"].astype(np.int64),
                          rows["h_oval"].astype(np.float32), axis=1)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def penalize_logits(logits: np.ndarray, repetition_penalty: float, recent_ids) -> np.ndarray:
    """The repetition penalty of the sampling rule (CTRL, Keskar et al. 2019, as HF
    ``RepetitionPenaltyLogitsProcessor`` and llama.cpp's ``penalty_repeat`` apply it): a copy of
    float32 ``logits [vocab]`` where every distinct id of ``recent_ids`` (ints, the request's
    last tokens) has ``l / penalty`` if ``l > 0`` else ``l * penalty``, in float32 arithmetic
    (one IEEE-rounded division or product); each id once however often it occurs. Penalty 1
    or no ids: the logits unchanged."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if repetition_penalty == 1.0 or recent_ids is None or len(recent_ids) == 0:
        return out
    ids = np.unique(np.asarray(recent_ids, dtype=np.int64))
    v = out[ids]
    pen = np.float32(repetition_penalty)
    out[ids] = np.where(v > 0, v / pen, v * pen)
    return out


def sample_from_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       u: float, min_p: float = 0.0, repetition_penalty: float = 1.0,
                       recent_ids=None) -> int:
    """Pick a token id from float32 logits ``[vocab]``; the reference sampling rule.

    In order (HF transformers' order; llama.cpp applies temperature last instead, which moves
    the top-p and min-p cuts): the repetition penalty over the distinct ids of ``recent_ids``
    (``penalize_logits``; 1 = off). temperature == 0: argmax (lowest id on ties). Otherwise:
    divide by temperature (float64); keep the ``top_k`` largest (0 = all); softmax; keep the
    smallest prefix of tokens sorted by (probability desc, id asc) whose mass reaches
    ``top_p`` (at least one token, so top_p = 0 or top_k = 1 is greedy); then min-p (Nguyen et
    al. 2024, HF ``MinPLogitsWarper``): keep tokens with p >= min_p * p_max, i.e.
    ``exp(z - z_max) >= min_p`` (0 = off; the top token always stays); renormalise; return the
    token whose cumulative mass interval contains ``u`` (uniform in [0, 1), drawn on the host).

    Raises NonFiniteLogitsError when a logit is NaN or +inf, or every logit is -inf (-inf
    alone is a masked token and is never sampled).
    """
    logits = np.asarray(logits, dtype=np.float32)
    fault = logit_fault(float(np.max(logits)))
    if fault:
        raise non_finite_logits(fault)
    logits = penalize_logits(logits, repetition_penalty, recent_ids)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / float(temperature)
    order = np.lexsort((np.arange(z.size), -z))           # by value desc, then id asc
    if top_k and top_k < z.size:
        order = order[:top_k]
    zk = z[order]
    w = np.exp(zk - zk[0])
    p = w / w.sum()
    if top_p < 1.0:
        c = np.cumsum(p)
        keep = int(np.searchsorted(c, top_p, side="left")) + 1
        order, w, p = order[:keep], w[:keep], p[:keep] / p[:keep].sum()
    if min_p > 0.0:
        keep = w >= min_p
        order, p = order[keep], p[keep] / p[keep].sum()
    c = np.cumsum(p)
    idx = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(idx, order.size - 1)])


class NumpyOps(Ops):
    """Reference ops on host NumPy arrays (activations float32, KV cache float32)."""

    name = "numpy"
    device = "host"
    act_dtype = np.float32
    kv_dtype = np.float32
    fp16_cache_default = True     # otherwise every call dequantizes its weight again
    xp = np

    def embed(self, w, ids, out):
        rows = np.asarray(ids, dtype=np.int64)
        out[...] = w.fp16[rows] if w.fp16 is not None else dequantize(w, rows=rows)

    def rmsnorm(self, x, weight, eps, out):
        x64 = np.asarray(x, dtype=np.float64)
        ms = np.mean(x64 * x64, axis=-1, keepdims=True)
        out[...] = (x64 / np.sqrt(ms + eps) * np.asarray(weight, dtype=np.float64))

    def make_fp16_cache(self, w: QuantWeight, pool, tag: str | None = "fp16_cache"):
        """The NumPy backend's weight cache: the dequantized float32 ``[out, in]`` matrix in a
        pool block under ``tag`` (None: the current tag_scope); returns (array, block)."""
        arr, blk = self.empty(pool, w.shape, np.float32, tag)
        try:
            arr[...] = dequantize(w)
        except BaseException:
            pool.free(blk)
            raise
        return arr, blk

    @staticmethod
    def _dense(w: QuantWeight) -> np.ndarray:
        return w.fp16 if w.fp16 is not None else dequantize(w)

    @classmethod
    def _matmul(cls, x, w: QuantWeight) -> np.ndarray:
        # float32 BLAS product of the dequantized matrix (same values with or without the
        # cache); sums of <= a few thousand terms keep ~1e-6 relative accuracy. A row's
        # product must not depend on the other rows of the call (a position's logits may not
        # depend on where a request's chunk began, a decode batch's row equals the request
        # alone): a GEMM's rounding depends on the row's place in the kernel's tiles and on
        # the row count (OpenBLAS's Zen kernels differ for nearly every row count and offset),
        # so each row is its own product of one row (a stacked matmul: the same BLAS call
        # for every row, whatever the call's row count).
        x = np.asarray(x, dtype=np.float32)
        dense = cls._dense(w)
        return np.matmul(x[:, None, :], dense.T)[:, 0, :]

    def linear(self, x, w, out):
        out[...] = self._matmul(x, w)

    def linear_residual(self, x, w, residual):
        residual += self._matmul(x, w).astype(np.float32)

    def linear_swiglu(self, x, w, tmp, out):
        gu = self._matmul(x, w)
        f = gu.shape[1] // 2
        out[...] = silu(gu[:, :f]) * gu[:, f:]

    def rope_kv(self, qkv, pos0, theta, n_heads, n_kv_heads, head_dim, k_cache, v_cache):
        t = qkv.shape[0]
        qd, kd = n_heads * head_dim, n_kv_heads * head_dim
        cos, sin = rope_tables(np.arange(pos0, pos0 + t), head_dim, theta)
        q = qkv[:, :qd].reshape(t, n_heads, head_dim)            # [T, H, hd]
        k = qkv[:, qd:qd + kd].reshape(t, n_kv_heads, head_dim)  # [T, Hkv, hd]
        v = qkv[:, qd + kd:qd + 2 * kd].reshape(t, n_kv_heads, head_dim)
        qkv[:, :qd] = apply_rope(q, cos, sin).reshape(t, qd)
        k_cache[pos0:pos0 + t] = apply_rope(k, cos, sin)
        v_cache[pos0:pos0 + t] = v

    def attention(self, qkv, k_cache, v_cache, pos0, n_heads, n_kv_heads, head_dim, out):
        t = qkv.shape[0]
        q = qkv[:, :n_heads * head_dim].reshape(t, n_heads, head_dim).astype(np.float64)
        ctx = pos0 + t
        k = np.asarray(k_cache[:ctx], dtype=np.float64)         # [ctx, Hkv, hd]
        v = np.asarray(v_cache[:ctx], dtype=np.float64)
        group = n_heads // n_kv_heads
        scale = 1.0 / np.sqrt(head_dim)
        # causal mask: query row i (absolute position pos0 + i) sees keys 0..pos0 + i
        mask = np.arange(ctx)[None, :] > (pos0 + np.arange(t))[:, None]   # [T, ctx]
        res = np.empty((t, n_heads, head_dim), dtype=np.float64)
        for h in range(n_heads):
            kh = k[:, h // group, :]                                    # [ctx, hd]
            s = (q[:, h, :] @ kh.T) * scale                             # [T, ctx]
            s[mask] = -np.inf
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            res[:, h, :] = p @ v[:, h // group, :]
        out[...] = res.reshape(t, n_heads * head_dim)

    # --- the paged KV cache (tinyloop/kv) ------------------------------------------------------
    def kv_write(self, qkv, h, pos0, theta, n_heads, n_kv_heads, head_dim, kv):
        """Rotate Q in place in ``qkv`` [T, >= (H + 2 Hkv) hd] and store positions
        pos0..pos0+T-1 of slot ``kv`` (a kv.cache.SlotKV) through its block table, in its
        layout's mode: rotated K and V (fp16; int8 with per-(position, KV head) scales,
        ``quant.quantize_rows_int8(..., saturate=True)``), or the rows of ``h`` [T, d] (h
        modes: ``encode_h``). The pages must exist (RuntimeKVCache.ensure)."""
        t = qkv.shape[0]
        lay = kv.layout
        qd, kd = n_heads * head_dim, n_kv_heads * head_dim
        cos, sin = rope_tables(np.arange(pos0, pos0 + t), head_dim, theta)
        q = qkv[:, :qd].reshape(t, n_heads, head_dim)            # [T, H, hd]
        qkv[:, :qd] = apply_rope(q, cos, sin).reshape(t, qd)
        if lay.mode == "fp16":
            k = qkv[:, qd:qd + kd].reshape(t, n_kv_heads, head_dim)  # [T, Hkv, hd]
            parts = {"k": apply_rope(k, cos, sin),
                     "v": qkv[:, qd + kd:qd + 2 * kd].reshape(t, n_kv_heads, head_dim)}
            if lay.kv_dtype == "float16":                      # pages laid out as on CUDA
                parts = {n: saturate_f16(x) for n, x in parts.items()}
        elif lay.mode == "int8":
            k = qkv[:, qd:qd + kd].reshape(t, n_kv_heads, head_dim)
            kq, ks = quantize_rows_int8(apply_rope(k, cos, sin), saturate=True)
            vq, vs = quantize_rows_int8(qkv[:, qd + kd:qd + 2 * kd].reshape(
                t, n_kv_heads, head_dim), saturate=True)
            parts = {"k": kq, "v": vq, "k_scale": ks, "v_scale": vs}
        else:
            parts = encode_h(np.asarray(h, dtype=np.float32)[:t], lay)
        self._store_rows(kv, pos0, parts)

    @staticmethod
    def _store_rows(kv, pos0, parts: dict) -> None:
        p = kv.page_size
        t = next(iter(parts.values())).shape[0]
        pos = pos0
        while pos < pos0 + t:
            i, r = divmod(pos, p)
            n = min(p - r, pos0 + t - pos)
            page = kv.page_parts(i)
            for name, rows in parts.items():
                page[name][r:r + n] = rows[pos - pos0:pos - pos0 + n]
            pos += n

    def _load_rows(self, kv, c0: int, c1: int) -> dict:
        """Parts of positions c0..c1-1 of slot ``kv`` gathered through its block table."""
        p = kv.page_size
        names = [part.name for part in kv.layout.parts]
        chunks = {n: [] for n in names}
        pos = c0
        while pos < c1:
            i, r = divmod(pos, p)
            n = min(p - r, c1 - pos)
            page = kv.page_parts(i)
            for name in names:
                chunks[name].append(page[name][r:r + n])
            pos += n
        return {n: np.concatenate(v) for n, v in chunks.items()}

    def kv_rows(self, kv, c0: int, c1: int, n_kv_heads: int, head_dim: int, recon=None):
        """K and V (float64 ``[c1 - c0, Hkv, hd]``) of positions c0..c1-1 as attention reads
        them: dequantized codes, or (h modes) rebuilt from the stored h through ``recon``
        (K = RoPE(h Wk^T), V = h Wv^T)."""
        lay = kv.layout
        rows = self._load_rows(kv, c0, c1)
        n = c1 - c0
        if lay.mode == "fp16":
            return (rows["k"].astype(np.float64), rows["v"].astype(np.float64))
        if lay.mode == "int8":
            k = rows["k"].astype(np.float32) * rows["k_scale"].astype(np.float32)[..., None]
            v = rows["v"].astype(np.float32) * rows["v_scale"].astype(np.float32)[..., None]
            return k.astype(np.float64), v.astype(np.float64)
        if recon is None:
            raise ConfigError(f"kv mode {lay.mode!r} stores h: attention needs the layer's "
                              "reconstruction (its QKV weight and RoPE theta)")
        h = decode_h(rows, lay)                                    # float32 [n, d]
        kvd = n_kv_heads * head_dim
        kv_rows = self._matmul(h, recon.w_kv)                      # [n, 2 kv_dim]
        bias = getattr(recon, "bias", None)                        # the K and V bias rows
        if bias is not None:
            kv_rows += np.asarray(bias, np.float32)
        cos, sin = rope_tables(np.arange(c0, c1), head_dim, recon.theta)
        k = apply_rope(kv_rows[:, :kvd].reshape(n, n_kv_heads, head_dim), cos, sin)
        v = kv_rows[:, kvd:2 * kvd].reshape(n, n_kv_heads, head_dim)
        return k.astype(np.float64), v.astype(np.float64)

    def kv_attention(self, qkv, kv, pos0, n_heads, n_kv_heads, head_dim, out, recon=None,
                     window: int = 0):
        """Causal GQA attention of the (rotated) Q rows of ``qkv`` [T, ...] over positions
        0..pos0+T-1 of slot ``kv``, read through its block table chunk by chunk (chunks of
        ``recon.chunk`` positions for h modes, else of one page) with an online-softmax merge
        across chunks (Milakov & Gimelshein 2018), in float64. out [T, H hd]. ``window`` > 0:
        the query at position p reads keys p-window+1..p only (chunks wholly before every
        query's window are skipped)."""
        t = qkv.shape[0]
        q = qkv[:, :n_heads * head_dim].reshape(t, n_heads, head_dim).astype(np.float64)
        q *= 1.0 / np.sqrt(head_dim)
        ctx = pos0 + t
        group = n_heads // n_kv_heads
        qg = q.reshape(t, n_kv_heads, group, head_dim)             # [T, Hkv, G, hd]
        m = np.full((t, n_kv_heads, group), -np.inf)
        l = np.zeros((t, n_kv_heads, group))
        acc = np.zeros((t, n_kv_heads, group, head_dim))
        qpos = pos0 + np.arange(t)
        step = recon.chunk if (kv.layout.stores_h and recon is not None) else \
            max(kv.page_size, 256 // kv.page_size * kv.page_size)
        first = 0 if window <= 0 else max(0, pos0 - window + 1) // step * step
        for c0 in range(first, ctx, step):
            c1 = min(ctx, c0 + step)
            k, v = self.kv_rows(kv, c0, c1, n_kv_heads, head_dim, recon)  # [n, Hkv, hd]
            s = np.einsum("tkgd,nkd->tkgn", qg, k)                 # [T, Hkv, G, n]
            future = np.arange(c0, c1)[None, :] > qpos[:, None]    # [T, n]
            if window > 0:                                         # and keys left behind
                future |= np.arange(c0, c1)[None, :] <= qpos[:, None] - window
            s = np.where(future[:, None, None, :], -np.inf, s)
            m_new = np.maximum(m, s.max(axis=-1))
            # rows whose every key so far is masked keep m = -inf: no contribution yet
            safe = np.where(np.isfinite(m_new), m_new, 0.0)
            alpha = np.where(np.isfinite(m), np.exp(m - safe), 0.0)
            p = np.exp(s - safe[..., None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + np.einsum("tkgn,nkd->tkgd", p, v)
            m = m_new
        out[...] = (acc / l[..., None]).reshape(t, n_heads * head_dim)

    def inject(self, state, e, w, tmp2, tmp1):
        cat = np.concatenate([state, e], axis=1)                       # [T, 2d]
        state[...] = self._matmul(cat, w)

    def lm_head(self, x, w, out):
        out[...] = self._matmul(x, w)

    def scale(self, x, s):
        x *= np.float32(s)

    def add_bias(self, x, bias):
        x += np.asarray(bias, np.float32)

    def norm_residual(self, x, weight, eps):
        self.rmsnorm(x, weight, eps, x)         # rmsnorm reads x into float64 first

    def linear_norm_residual(self, x, w, weight, eps, residual, tmp):
        tmp[...] = self._matmul(x, w)
        self.rmsnorm(tmp, weight, eps, tmp)
        residual += tmp

    def linear_residual_norm(self, x, w, weight, eps, residual):
        residual += self._matmul(x, w).astype(np.float32)
        self.rmsnorm(residual, weight, eps, residual)

    def sample(self, logits, temperature, top_k, top_p, u, min_p=0.0, repetition_penalty=1.0,
               recent_ids=None):
        return sample_from_logits(logits, temperature, top_k, top_p, u, min_p,
                                  repetition_penalty, recent_ids)
