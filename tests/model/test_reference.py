"""The NumPy reference forward against independent oracles.

- depth d equals an explicitly unrolled model (the block's layers listed d times, the adapter
  applied before each repetition), computed here from scratch: full-sequence attention with
  a mask, RoPE through complex multiplication, no KV cache, no buffers;
- decoding with the KV cache equals a full re-prefill at every step;
- prefill_chunk > 0 gives the same logits as unchunked.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.synthetic import synthetic_config
from tinyloop.format import expected_tensors, read_tlm
from tinyloop.quant import dequantize

from ..conftest import TINY


def _unrolled_logits(path: str, ids: np.ndarray, depth: int) -> np.ndarray:
    """An independent float64 forward of the unrolled network (no cache, no chunking)."""
    with read_tlm(path) as f:
        cfg = f.config
        W = {n: (dequantize(f.quant_weight(n)).astype(np.float64) if k == "quant"
                 else np.asarray(f.array(n), dtype=np.float64))
             for n, (k, _) in expected_tensors(cfg).items()}
    T, H, Hk, hd = len(ids), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rope(x):                                    # x [T, heads, hd]; complex-number form
        z = x[..., 0::2] + 1j * x[..., 1::2]
        freq = cfg.rope_theta ** (-np.arange(hd // 2) * 2.0 / hd)
        z = z * np.exp(1j * np.arange(T)[:, None, None] * freq[None, None, :])
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    def layer(x, i):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm"]) @ W[p + "attn_qkv"].T
        q = rope(h[:, :H * hd].reshape(T, H, hd))
        k = rope(h[:, H * hd:(H + Hk) * hd].reshape(T, Hk, hd))
        v = h[:, (H + Hk) * hd:].reshape(T, Hk, hd)
        k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
        p_ = np.exp(s - s.max(-1, keepdims=True))
        p_ /= p_.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p_, v).reshape(T, H * hd) @ W[p + "attn_output"].T
        gu = norm(x, W[p + "ffn_norm"]) @ W[p + "ffn_gate_up"].T
        g, u = gu[:, :cfg.ffn_dim], gu[:, cfg.ffn_dim:]
        return x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down"].T

    P, R = cfg.n_prelude, cfg.n_recurrent
    x = W["token_embd"][ids]
    for i in range(P):
        x = layer(x, i)
    e = x.copy()
    for _ in range(depth):                          # the unrolled block, listed depth times
        if cfg.injection == "adapter":
            x = np.concatenate([x, e], axis=1) @ W["inject.adapter"].T
        for j in range(R):
            x = layer(x, P + j)
    for c in range(cfg.n_coda):
        x = layer(x, P + R + c)
    head = W["token_embd"] if cfg.tied_head else W["output"]
    return norm(x, W["output_norm"]) @ head.T


@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_adapter_path"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_depth_equals_unrolled_model(request, fixture, depth):
    path = request.getfixturevalue(fixture)
    ids = np.random.default_rng(depth).integers(0, TINY["vocab_size"], 23)
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    try:
        got = m.logits(ids, depth=depth)
    finally:
        tinyloop.free_model(m)
    want = _unrolled_logits(path, ids, depth)
    assert got.dtype == np.float32 and got.shape == (23, TINY["vocab_size"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_depth_changes_the_output(tiny_adapter_path):
    """Guard against a loop that silently ignores depth."""
    ids = np.arange(10)
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=32, backend="numpy")
    try:
        a, b = m.logits(ids, depth=1), m.logits(ids, depth=3)
    finally:
        tinyloop.free_model(m)
    assert np.abs(a - b).max() > 1e-2


def test_unrolled_file_equals_looped_file(tmp_path):
    """A plain (R=0) file whose layers are the block repeated equals the looped file."""
    from tinyloop.convert.synthetic import synthetic_weights
    from tinyloop.format import write_tlm
    cfg = synthetic_config(**TINY)
    w = synthetic_weights(cfg, seed=5)
    depth = 3
    order = [0] + [1, 2] * depth + [3]            # P=1, R=2 (layers 1-2) x3, C=1
    flat = synthetic_config(**{**TINY, "n_prelude": len(order), "n_recurrent": 0,
                               "n_coda": 0, "max_depth": 1})
    fw = {k: v for k, v in w.items() if not k.startswith("blk.")}
    for new_i, old_i in enumerate(order):
        for k, v in w.items():
            if k.startswith(f"blk.{old_i}."):
                fw[f"blk.{new_i}." + k.split(".", 2)[2]] = v
    write_tlm(tmp_path / "flat.tlm", flat, fw)
    write_tlm(tmp_path / "loop.tlm", cfg, w)
    ids = np.arange(3, 40, 2)
    a = tinyloop.load_model(tmp_path / "loop.tlm", max_seq_len=32, backend="numpy")
    b = tinyloop.load_model(tmp_path / "flat.tlm", max_seq_len=32, backend="numpy")
    try:
        np.testing.assert_allclose(a.logits(ids, depth=depth), b.logits(ids), rtol=1e-5,
                                   atol=1e-5)
    finally:
        tinyloop.free_model(a)
        tinyloop.free_model(b)


@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_adapter_path"])
def test_cached_decode_equals_reprefill(request, fixture):
    """Every greedy step with the KV cache matches argmax of a full re-prefill."""
    path = request.getfixturevalue(fixture)
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    try:
        prompt = [5, 17, 250, 3, 99]
        res = m.generate(prompt, max_new_tokens=12, depth=2)
        seq = list(prompt)
        for tok in res.token_ids:
            full = m.logits(seq, depth=2)[-1]
            assert tok == int(np.argmax(full))
            seq.append(tok)
    finally:
        tinyloop.free_model(m)


def test_decode_logits_match_prefill_logits(tiny_adapter_path):
    """The logit row after each cached decode step equals the re-prefill's last row."""
    m = tinyloop.load_model(tiny_adapter_path, max_seq_len=64, backend="numpy")
    try:
        seq = [7, 8, 9, 10]
        cache = m.new_kv_cache(3, 16)
        row = np.empty((1, TINY["vocab_size"]), np.float32)
        with cache:
            m.forward(np.array(seq, np.int32), 0, 3, cache)
            for step in range(6):
                m.head(len(seq) - 1, 1, row)
                want = m.logits(seq, depth=3)[-1]
                np.testing.assert_allclose(row[0], want, rtol=1e-5, atol=1e-5)
                nxt = int(np.argmax(row[0]))
                seq.append(nxt)
                m.forward(np.array([nxt], np.int32), len(seq) - 1, 3, cache)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("chunk", [1, 4, 7, 16])
def test_prefill_chunk_matches_unchunked(tiny_adapter_path, chunk):
    ids = np.random.default_rng(chunk).integers(0, TINY["vocab_size"], 30)
    full = tinyloop.load_model(tiny_adapter_path, max_seq_len=32, backend="numpy")
    part = tinyloop.load_model(tiny_adapter_path, max_seq_len=32, prefill_chunk=chunk,
                               backend="numpy")
    try:
        np.testing.assert_allclose(part.logits(ids, depth=2), full.logits(ids, depth=2),
                                   rtol=1e-5, atol=3e-5)
        np.testing.assert_allclose(part.score(ids, depth=2), full.score(ids, depth=2),
                                   rtol=1e-5, atol=3e-5)
        a = full.generate(ids[:9].tolist(), max_new_tokens=8, depth=2)
        b = part.generate(ids[:9].tolist(), max_new_tokens=8, depth=2)
        assert a.token_ids == b.token_ids
    finally:
        tinyloop.free_model(full)
        tinyloop.free_model(part)


def test_score_is_log_softmax_of_logits(tiny_model_path):
    ids = np.array([1, 2, 3, 50, 60, 70, 299])
    m = tinyloop.load_model(tiny_model_path, max_seq_len=16, backend="numpy")
    try:
        lg = m.logits(ids).astype(np.float64)
        s = m.score(ids)
    finally:
        tinyloop.free_model(m)
    want = [lg[t, ids[t + 1]] - np.log(np.exp(lg[t]).sum()) for t in range(len(ids) - 1)]
    np.testing.assert_allclose(s, want, rtol=1e-9, atol=1e-9)
    assert (s < 0).all()
