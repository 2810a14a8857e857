"""The NumPy reference backend: the oracle every CUDA kernel is checked against.

Written for clarity, in float32, with float64 where it matters (RMSNorm's mean square, RoPE
angles, attention scores and softmax sums). Matrix products run as float32 BLAS products of
the dequantized weights; with the weight cache (``make_fp16_cache``; on by default on this
backend, ``TINYLOOP_FP16_CACHE=0`` turns it off) the dequantized float32 matrices are kept in
the pool under tag "fp16_cache" instead of being dequantized on every call. See ``base.py`` for the conventions shared by all ops.
"""

from __future__ import annotations

import numpy as np

from ..quant import QuantWeight, dequantize
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


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sample_from_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       u: float) -> int:
    """Pick a token id from float32 logits ``[vocab]``; the reference sampling rule.

    temperature == 0: argmax (lowest id on ties). Otherwise: divide by temperature; keep the
    ``top_k`` largest (0 = all); softmax; keep the smallest prefix of tokens sorted by
    (probability desc, id asc) whose mass reaches ``top_p`` (at least one token, so top_p = 0
    or top_k = 1 is greedy); renormalise; return the token whose cumulative mass interval
    contains ``u`` (uniform in [0, 1), drawn on the host).

    Raises NonFiniteLogitsError when a logit is NaN or +inf, or every logit is -inf (-inf
    alone is a masked token and is never sampled).
    """
    logits = np.asarray(logits, dtype=np.float32)
    fault = logit_fault(float(np.max(logits)))
    if fault:
        raise non_finite_logits(fault)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / float(temperature)
    order = np.lexsort((np.arange(z.size), -z))           # by value desc, then id asc
    if top_k and top_k < z.size:
        order = order[:top_k]
    zk = z[order]
    p = np.exp(zk - zk[0])
    p /= p.sum()
    if top_p < 1.0:
        c = np.cumsum(p)
        keep = int(np.searchsorted(c, top_p, side="left")) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
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
        # cache); sums of <= a few thousand terms keep ~1e-6 relative accuracy
        return np.asarray(x, dtype=np.float32) @ cls._dense(w).T

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

    def inject(self, state, e, w, tmp2, tmp1):
        cat = np.concatenate([state, e], axis=1)                       # [T, 2d]
        state[...] = self._matmul(cat, w)

    def lm_head(self, x, w, out):
        out[...] = self._matmul(x, w)

    def sample(self, logits, temperature, top_k, top_p, u):
        return sample_from_logits(logits, temperature, top_k, top_p, u)
