"""The paged KV cache and its storage modes on the NumPy reference (issue 8).

References: the unpaged attention (``NumpyOps.rope_kv`` + ``NumpyOps.attention`` over dense
[ctx, Hkv, hd] arrays), slow per-row quantizers written here in float32 Python, and the
pool's own counters.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.backends.numpy_ops import NumpyOps
from tinyloop.config import KV_MODES, ModelConfig
from tinyloop.errors import ConfigError, HandleError
from tinyloop.kvcache import (PART_ALIGN, PageAllocator, PageLayout, RuntimeKVCache,
                              kv_bytes_per_token, resolve_kv_modes)
from tinyloop.memory import MemoryPool
from tinyloop.quant import quantize_rows_int8

from .conftest import TINY

SMOL = ModelConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                   ffn_dim=1536, n_prelude=4, n_recurrent=4, n_coda=4, max_depth=8)
ONE = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, n_prelude=1, n_recurrent=0, n_coda=0)


# --- layouts --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", KV_MODES)
@pytest.mark.parametrize("p", [1, 16, 32, 33])
def test_page_layout_parts_are_aligned_and_disjoint(mode, p):
    lay = PageLayout.for_config(SMOL, mode, p)
    end = 0
    for part in lay.parts:
        assert part.offset % PART_ALIGN == 0 and part.offset >= end
        assert part.shape[0] == p
        end = part.offset + part.nbytes
    assert end <= lay.page_bytes and lay.page_bytes % PART_ALIGN == 0


def test_bytes_per_token_by_hand():
    # SmolLM2 dims: 3 KV heads x 64, d_model 576; h groups of 32 -> 18 groups
    want = {"fp16": 2 * 3 * 64 * 2, "int8": 2 * 3 * 64 + 2 * 3 * 2, "h_fp16": 576 * 2,
            "h_int8": 576 + 18 * 2, "h_int4": 576 // 2 + 2 * 18 * 2}
    for mode, b in want.items():
        assert PageLayout.for_config(SMOL, mode, 32).bytes_per_token == b, mode
    # the surprise the issue asks to say plainly: storing h in FP16 is larger than FP16 K/V
    assert want["h_fp16"] > want["fp16"]
    # 12 slots at depth 1, 4 + 4*8 + 4 = 40 at depth 8
    assert kv_bytes_per_token(SMOL, 1, ("int8",) * 12) == 12 * want["int8"]
    mixed = resolve_kv_modes({"prelude": "fp16", "recurrent": "h_int4", "coda": "int8"}, SMOL)
    assert kv_bytes_per_token(SMOL, 8, mixed) == (4 * want["fp16"] + 32 * want["h_int4"]
                                                  + 4 * want["int8"])


def test_mode_names_are_checked():
    with pytest.raises(ConfigError, match="h_int4"):
        resolve_kv_modes("int3", SMOL)
    with pytest.raises(ConfigError, match="coda"):
        resolve_kv_modes({"middle": "fp16"}, SMOL)
    with pytest.raises(ConfigError, match="12 physical layers"):
        resolve_kv_modes(["fp16"] * 3, SMOL)
    assert resolve_kv_modes(["int8"] * 12, SMOL) == ("int8",) * 12
    with pytest.raises(ConfigError, match="d_model=48"):
        PageLayout("h_int4", 32, 2, 16, 48)


def test_kv_mode_env(monkeypatch):
    from tinyloop.config import kv_mode_from_env
    monkeypatch.setenv("TINYLOOP_KV_MODE", " INT8 ")
    assert kv_mode_from_env() == "int8"
    monkeypatch.setenv("TINYLOOP_KV_MODE", "fp8")
    with pytest.raises(ConfigError, match="TINYLOOP_KV_MODE"):
        kv_mode_from_env()
    monkeypatch.delenv("TINYLOOP_KV_MODE")
    assert kv_mode_from_env() == "fp16"


# --- quantization conventions -----------------------------------------------------------------
def slow_int8_row(x):
    """One row, element by element in float32: s = fp16(amax / 127); q = rint(x / s)."""
    x = [np.float32(v) for v in x]
    amax = max(abs(v) for v in x)
    s = np.float16(np.float32(amax) / np.float32(127.0))
    s32 = np.float32(s)
    q = [0 if s32 == 0 else int(np.clip(np.rint(v / s32), -127, 127)) for v in x]
    return q, s


def test_quantize_rows_int8_matches_slow_reference():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((50, 64)) * rng.uniform(1e-3, 300, (50, 1))).astype(np.float32)
    x[3] = 0.0
    q, s = quantize_rows_int8(x)
    for r in range(x.shape[0]):
        qr, sr = slow_int8_row(x[r])
        assert q[r].tolist() == qr and s[r] == sr


def _fresh_slot(mode, p=4, capacity=16, cfg=ONE):
    ops, pool = NumpyOps(), MemoryPool("host")
    alloc = PageAllocator(ops, pool)
    cache = RuntimeKVCache(ops, pool, cfg, 1, capacity, (mode,) * cfg.n_layers, alloc, p)
    return ops, pool, alloc, cache


@pytest.mark.parametrize("amax", [300.0, 0.02])
def test_int8_row_survives_within_half_a_step(amax):
    """A V row spanning +-amax is stored and read back within half a quantization step:
    neither clipped (300) nor zeroed (0.02)."""
    ops, pool, _, cache = _fresh_slot("int8")
    cfg = ONE
    rng = np.random.default_rng(2)
    qkv = np.zeros((3, cfg.qkv_dim), np.float32)
    v = rng.uniform(-amax, amax, (3, cfg.kv_dim)).astype(np.float32)
    v[:, 0] = amax
    qkv[:, cfg.q_dim + cfg.kv_dim:] = v
    cache.ensure(3)
    ops.kv_write(qkv, None, 0, 1e4, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cache.slot(0))
    _, vr = ops.kv_rows(cache.slot(0), 0, 3, cfg.n_kv_heads, cfg.head_dim)
    vr = vr.reshape(3, -1)
    step = np.abs(v).reshape(3, cfg.n_kv_heads, -1).max(-1).repeat(cfg.head_dim, 1) / 127
    assert (np.abs(vr - v) <= 0.5 * step * (1 + 2e-3) + 1e-12).all()
    assert np.abs(vr).max() >= 0.99 * amax              # not clipped, not zeroed
    cache.release()
    assert pool.allocated_bytes == 0


@pytest.mark.parametrize("mode", ["h_fp16", "h_int8", "h_int4"])
def test_h_rows_survive_within_half_a_step(mode):
    ops, pool, _, cache = _fresh_slot(mode)
    cfg = ONE
    rng = np.random.default_rng(3)
    h = (rng.standard_normal((5, cfg.d_model)) * [[300.0], [0.02], [1.0], [5.0], [0.0]]
         ).astype(np.float32)
    qkv = np.zeros((5, cfg.qkv_dim), np.float32)
    cache.ensure(5)
    ops.kv_write(qkv, h, 0, 1e4, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cache.slot(0))
    from tinyloop.backends.numpy_ops import decode_h
    lay = cache.slot(0).layout
    got = decode_h(ops._load_rows(cache.slot(0), 0, 5), lay)
    if lay.rotate:      # quantized in the Hadamard-rotated basis: the bound holds there
        from tinyloop.kvcache import hadamard_matrix, hadamard_rotate
        hm = hadamard_matrix(lay.rotate)
        np.testing.assert_allclose(hm @ hm, np.eye(lay.rotate), atol=1e-12)
        h, got = hadamard_rotate(h, lay.rotate), hadamard_rotate(got, lay.rotate)
    g = h.reshape(5, -1, lay.group_size)
    if mode == "h_fp16":
        np.testing.assert_array_equal(got, h.astype(np.float16).astype(np.float32))
    else:
        span = (np.abs(g).max(-1) / 127) if mode == "h_int8" else \
            (g.max(-1) - g.min(-1)) / 15
        step = span.repeat(lay.group_size, 1)
        # half a step, plus the FP16 rounding of the zero for INT4
        tol = 0.5 * step * (1 + 2e-3) + (np.abs(h) * 2 ** -11 if mode == "h_int4" else 0)
        assert (np.abs(got - h) <= tol + 1e-5 * np.abs(h).max(-1, keepdims=True)).all()
    assert (got[4] == 0).all()
    cache.release()


def test_hadamard_rotate_matches_a_slow_sequential_sum():
    """hadamard_rotate == the rule cuda_src/kv_h.cu hadamard32 computes, written slowly: for
    output channel j of a block, the float64 sum over i = 0..31 in order of
    (-1)^popcount(i & j) x_i, divided by sqrt(32), rounded once to float32 (so h_int4 codes
    agree on both backends). Also orthonormal: applying it twice gives x back."""
    from tinyloop.kvcache import hadamard_rotate
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((6, 64)) * [[300.0], [0.02], [1.0], [1e-3], [6e3], [0.0]]
         ).astype(np.float16).astype(np.float32)
    want = np.empty_like(x)
    for r in range(x.shape[0]):
        for b in range(0, 64, 32):
            for j in range(32):
                acc = 0.0
                for i in range(32):
                    v = float(x[r, b + i])
                    acc += -v if bin(i & j).count("1") % 2 else v
                want[r, b + j] = np.float32(acc / np.sqrt(32.0))
    got = hadamard_rotate(x, 32)
    np.testing.assert_array_equal(got, want)
    back = hadamard_rotate(got, 32)
    assert (np.abs(back - x) <= 1e-6 * np.abs(x).max(-1, keepdims=True)).all()


def test_recon_scratch_plan_holds_the_cuda_softmax_state():
    """Phase 5: recon_h / recon_kv on both backends; recon_state float32 [scratch rows,
    n_heads (head_dim + 2)] only on CUDA, lazy exactly when no default mode stores h."""
    from tinyloop import plan as planmod
    from tinyloop.format import expected_tensors
    layout = {n: (4, 32) for n, (kind, _) in expected_tensors(SMOL).items() if kind == "quant"}
    for backend, store_h in (("cuda", True), ("cuda", False), ("numpy", True)):
        p5 = {e.name: e for e in planmod.load_plan(SMOL, layout, 1000, 300, np.float16,
                                                   backend=backend, store_h=store_h)
              if e.phase == 5}
        assert p5["recon_h"].shape == (256, 576) and p5["recon_kv"].shape == (256, 384)
        if backend == "numpy":
            assert "recon_state" not in p5
            continue
        st = p5["recon_state"]
        assert (st.shape, st.dtype, st.tag, st.lazy) == ((300, 9 * 66), "float32", "scratch",
                                                         not store_h)


# --- attention through the block table == unpaged reference -----------------------------------
@pytest.mark.parametrize("p", [1, 4, 5, 9, 32])
def test_paged_fp16_equals_unpaged_reference(p):
    """Prefill of 9 (a multiple of 9, crossing pages of 4 and 5), then 4 decode steps past page
    boundaries: identical outputs to dense [ctx, Hkv, hd] K/V (NumpyOps.rope_kv/attention)."""
    ops, pool, alloc, cache = _fresh_slot("fp16", p=p, capacity=13)
    cfg = ONE
    rng = np.random.default_rng(p)
    qkv = rng.standard_normal((13, cfg.qkv_dim)).astype(np.float32)
    kd = np.full((13, cfg.n_kv_heads, cfg.head_dim), np.nan, np.float32)
    vd = kd.copy()
    out = np.full((13, cfg.q_dim), np.nan, np.float32)
    want = out.copy()
    pos = 0
    for n in (9, 1, 1, 1, 1):
        a, b = qkv[pos:pos + n].copy(), qkv[pos:pos + n].copy()
        cache.ensure(pos + n)
        ops.kv_write(a, None, pos, 1e4, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                     cache.slot(0))
        ops.kv_attention(a, cache.slot(0), pos, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                         out[pos:pos + n])
        ops.rope_kv(b, pos, 1e4, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kd, vd)
        ops.attention(b, kd, vd, pos, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                      want[pos:pos + n])
        pos += n
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    assert alloc.live_pages == cache.n_slots * -(-13 // p)
    cache.release()
    assert alloc.live_pages == 0 and pool.allocated_bytes == 0
    with pytest.raises(HandleError):
        cache.slot(0)


def test_pages_are_reference_counted():
    ops, pool, alloc, cache = _fresh_slot("int8", p=4, capacity=8)
    cache.ensure(8)
    shared = cache._pages[0][0]
    alloc.ref(shared)                      # a second holder (a prefix cache, issue 9)
    cache.release()
    assert alloc.live_pages == 1 and pool.allocated_bytes == shared.block.nbytes
    alloc.unref(shared)
    assert alloc.live_pages == 0 and pool.allocated_bytes == 0
    with pytest.raises(HandleError):
        alloc.unref(shared)


# --- the real forward -------------------------------------------------------------------------
@pytest.fixture
def tiny(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    yield m
    tinyloop.free_model(m)


def _logits_with_page(m, ids, depth, p, kv_mode=None):
    """Teacher-forced prefill of ids[:-3] then 3 cached decode steps; logits of every step."""
    cfg = m.config
    rows = []
    row = np.empty((1, cfg.vocab_size), np.float32)
    with m.new_kv_cache(depth, len(ids), kv_mode=kv_mode, page_size=p) as cache:
        n0 = len(ids) - 3
        m.forward(np.asarray(ids[:n0], np.int32), 0, depth, cache)
        m.head(n0 - 1, 1, row)
        rows.append(row.copy())
        for i in range(n0, len(ids)):
            m.forward(np.asarray(ids[i:i + 1], np.int32), i, depth, cache)
            m.head(i, 1, row)
            rows.append(row.copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("mode", KV_MODES)
@pytest.mark.parametrize("n", [16, 19])
def test_paged_forward_equals_one_page_per_slot(tiny, mode, n):
    """Pages of 8 (prompt 13 / 16 = exact multiple of 8, then decode across the boundary)
    give the same logits as one page spanning the whole request (the unpaged layout)."""
    ids = np.random.default_rng(n).integers(0, TINY["vocab_size"], n)
    paged = _logits_with_page(tiny, ids, 2, 8, mode)
    flat = _logits_with_page(tiny, ids, 2, 64, mode)
    np.testing.assert_allclose(paged, flat, rtol=1e-5, atol=1e-5)


def test_fp16_mode_equals_dense_forward(tiny, monkeypatch):
    """The whole model with the paged fp16 cache equals the same model run over dense K/V
    planes through the unpaged reference ops."""
    ids = np.random.default_rng(5).integers(0, TINY["vocab_size"], 21)
    paged = tiny.logits(ids, depth=3)
    ops = tiny._ops
    dense = {}

    def write(qkv, h, pos0, theta, nh, nkv, hd, kv):
        k, v = dense.setdefault(id(kv), (np.zeros((64, nkv, hd), np.float32),
                                         np.zeros((64, nkv, hd), np.float32)))
        ops.rope_kv(qkv, pos0, theta, nh, nkv, hd, k, v)

    def attend(qkv, kv, pos0, nh, nkv, hd, out, recon=None):
        k, v = dense[id(kv)]
        ops.attention(qkv, k, v, pos0, nh, nkv, hd, out)

    monkeypatch.setattr(ops, "kv_write", write)
    monkeypatch.setattr(ops, "kv_attention", attend)
    np.testing.assert_allclose(paged, tiny.logits(ids, depth=3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", KV_MODES)
def test_first_request_is_bit_identical_to_later_ones(tiny_model_path, mode):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy", kv_mode=mode)
    try:
        ids = np.random.default_rng(7).integers(0, TINY["vocab_size"], 37)
        runs = [m.logits(ids, depth=2) for _ in range(3)]
        gens = [m.generate(ids[:20], max_new_tokens=8, depth=2).token_ids for _ in range(3)]
    finally:
        tinyloop.free_model(m)
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])
    assert gens[0] == gens[1] == gens[2]


def test_mixed_mode_dict_and_per_call_override(tiny):
    ids = np.random.default_rng(8).integers(0, TINY["vocab_size"], 30)
    mixed = {"prelude": "fp16", "recurrent": "int8", "coda": "h_int8"}
    modes = tiny.resolve_kv_modes(mixed)
    assert modes == ("fp16", "int8", "int8", "h_int8")
    with tiny.new_kv_cache(3, 30, kv_mode=mixed) as cache:
        assert [lay.mode for lay in cache.layouts] == ["fp16"] + ["int8"] * 6 + ["h_int8"]
    ref = tiny.logits(ids, depth=3)
    got = tiny.logits(ids, depth=3, kv_mode=mixed)
    assert np.isfinite(got).all() and not np.array_equal(got, ref)
    # a layer-per-layer sequence naming the same modes gives the same logits
    np.testing.assert_array_equal(tiny.logits(ids, depth=3, kv_mode=list(modes)), got)
    lp, lq = (np.exp(x - x.max(-1, keepdims=True)) for x in (ref, got))
    lp /= lp.sum(-1, keepdims=True)
    lq /= lq.sum(-1, keepdims=True)
    assert (np.abs(lp - lq).sum(-1) < 0.1).all()


def test_kv_bytes_per_token_matches_the_pool(tiny):
    pool = tiny.pool
    for mode in KV_MODES:
        for t in (5, 32, 45):
            before = pool.by_tag()["kv_cache"]
            with tiny.new_kv_cache(3, t, kv_mode=mode) as cache:
                cache.ensure(t)
                held = pool.by_tag()["kv_cache"] - before
                lay = cache.layouts[0]
                per_tok = tiny.kv_bytes_per_token(3, mode)
                page_block = -(-lay.page_bytes // 512) * 512
                assert 0 <= held - per_tok * t <= cache.n_slots * page_block, (mode, t)
            assert pool.by_tag()["kv_cache"] == before


def test_bad_kv_mode_raises_before_any_work(tiny):
    with pytest.raises(ConfigError, match="fp16"):
        tiny.generate([1, 2, 3], max_new_tokens=2, kv_mode="fp8")
    with pytest.raises(ConfigError, match="fp16"):
        tiny.logits([1, 2, 3], kv_mode="q4")
    with pytest.raises(ConfigError, match="fp16"):
        tinyloop.load_model(tiny.path, max_seq_len=8, backend="numpy", kv_mode="nope")


@pytest.mark.parametrize("mode", ["fp16", "int8", "h_int4"])
def test_varied_length_trace_does_not_fragment(tiny_model_path, fresh_pools, mode):
    """40 requests, prompts of 1..700 tokens, max_seq_len 1024, on a fresh host pool, load
    included: peak reserved - peak allocated <= max(2 MiB, 5% of the requests' own peak)."""
    from tinyloop.memory import get_pool
    pool = get_pool("host")
    m = tinyloop.load_model(tiny_model_path, max_seq_len=1024, backend="numpy", kv_mode=mode)
    try:
        rng = np.random.default_rng(0)
        request_peak = 0
        for _ in range(40):
            n = int(rng.integers(1, 701))
            g = int(rng.integers(1, 9))
            pool.reset_peak_stats()
            m.generate(rng.integers(0, TINY["vocab_size"], n).tolist(), max_new_tokens=g,
                       depth=int(rng.integers(1, 3)))
            request_peak = max(request_peak,
                               pool.stats().peak_allocated_bytes - m.vram_usage_bytes())
    finally:
        tinyloop.free_model(m)
    st = pool.stats()
    # peaks over the whole run (load included): the pool keeps them until reset, so take the
    # run's high-water marks from the event log instead of the last per-request reset
    alloc = reserved = peak_a = peak_r = 0
    for ev in pool.events():
        if ev.action == "alloc":
            alloc += ev.size
        elif ev.action == "free_completed":
            alloc -= ev.size
        elif ev.action == "segment_alloc":
            reserved += ev.size
        elif ev.action == "segment_free":
            reserved -= ev.size
        peak_a, peak_r = max(peak_a, alloc), max(peak_r, reserved)
    assert pool.events_dropped == 0 and st.allocated_bytes == 0
    slack = peak_r - peak_a
    assert request_peak > 0
    assert slack <= max(2 << 20, 0.05 * request_peak), (slack, peak_r, peak_a, request_peak)
