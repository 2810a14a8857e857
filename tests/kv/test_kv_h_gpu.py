"""The store-h KV modes on CUDA: kv_h.cu's write against ``numpy_ops.encode_h``
(identical codes, scales and zeros), the chunked reconstruction attention against
``NumpyOps.kv_attention``, and whole models against the NumPy reference (synthetic SmolLM2
dims: d_model 576, 9 heads, 3 KV heads of 64).

Inputs are fresh every session (TINYLOOP_TEST_SEED, tests/conftest.py). The reference sees
the same FP16 values the GPU gets. The attention bounds allow for what the CUDA path rounds
and the reference does not: the dequantized h rows and the rebuilt K|V are FP16 there.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

import cupy  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.backends.base import STEP_POS, STEP_WORDS  # noqa: E402
from tinyloop.convert.synthetic import synthetic_config, write_synthetic  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.kv import Recon  # noqa: E402

from ..kernels.test_kernels_gpu import (SESSION_SEED, assert_close, dev_weight,  # noqa: E402
                                        f16, gather, kv_pair, poisoned, qkv_rows,
                                        rand_weight, rms)
from ..model.test_cuda_model import _kl_rows, _report  # noqa: E402

H_MODES = ("h_fp16", "h_int8", "h_int4")


def h_pair(ops, ref, mode, h, hkv, hd, d, capacity, page_size):
    """The same one-slot paged store-h cache on both backends: (numpy cache, cuda cache)."""
    return kv_pair(ops, ref, mode, h, hkv, hd, capacity, page_size, d_model=d)


def h_rows(rng, t, d):
    """FP16 rows h [t, d] (and their float32 values): random rows of mixed scale, plus (when
    t >= 4) a row spanning +-300, a row whose largest magnitude is 0.02, a zero row and a
    row with one outlier channel per group."""
    scale = rng.choice([0.02, 1.0, 30.0], size=(t, 1))
    h = (rng.standard_normal((t, d)) * scale).astype(np.float16)
    if t >= 4:
        h[0] = np.linspace(-300.0, 300.0, d).astype(np.float16)[rng.permutation(d)]
        r = rng.standard_normal(d)
        h[1] = (r / np.abs(r).max() * 0.02).astype(np.float16)
        h[2] = 0
        h[3, ::32] = 40.0
    return h, h.astype(np.float32)


HD = [(9, 3, 64, 576), (4, 4, 32, 128), (6, 2, 128, 256), (3, 1, 16, 64)]


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("h,hkv,hd,d", HD)
@pytest.mark.parametrize("t,pos0", [(1, 0), (1, 37), (40, 0), (70, 5), (3, 4093)])
@pytest.mark.parametrize("p", [16, 32])
def test_h_write_codes_match_numpy(ops, ref, rng, mode, h, hkv, hd, d, t, pos0, p):
    """kv_h.cu stores the codes, scales and zeros numpy_ops.encode_h stores, byte for byte,
    at positions pos0..pos0+T-1 only (pages are zeroed at allocation); Q is rotated as
    kv_write rotates it."""
    qh, q = qkv_rows(rng, t, h, hkv, hd)
    hh, hf = h_rows(rng, t, d)
    c_ref, c_dev = h_pair(ops, ref, mode, h, hkv, hd, d, pos0 + t + 2, p)
    qkv_ref = q.copy()
    ref.kv_write(qkv_ref, hf, pos0, 1e4, h, hkv, hd, c_ref.slot(0))
    qkv = cupy.asarray(qh)
    ops.kv_write(qkv, cupy.asarray(hh), pos0, 1e4, h, hkv, hd, c_dev.slot(0))
    assert_close(qkv, qkv_ref, atol=1e-3, rtol=2e-3, what="rope q (+ untouched k|v)")
    n = pos0 + t + 2
    got, want = gather(c_dev.slot(0), n, True), gather(c_ref.slot(0), n, False)
    rows = slice(pos0, pos0 + t)
    for name in want:
        np.testing.assert_array_equal(got[name][rows], want[name][rows],
                                      err_msg=f"{mode} part {name} (seed {SESSION_SEED})")
        others = got[name].copy()
        others[rows] = 0
        assert not others.view(np.uint8).any(), f"h write touched {name} outside the rows"


def h_read_rows(ops, kv, n):
    """kv_h.cu's read of positions 0..n-1 of slot ``kv`` (what attention rebuilds K|V from):
    f16 [n, d] on the host."""
    lay = kv.layout
    table, p, offs = ops._kv_table(kv, n)
    out = cupy.full((n, lay.d_model), np.nan, cupy.float16)
    ops._fn("kv_h", f"h_read_{lay.mode}")(
        (n,), (256,), (table, p, 0, lay.d_model, *offs[:3], int(lay.outliers),
                       *lay.outlier_offsets, out.data.ptr))
    return cupy.asnumpy(out)


def special_h_rows(rng, d):
    """FP16 rows h [11, d] FP16 can only just hold or not at all: +-65504 (the Hadamard basis
    sums them past FP16's range), values near FP16's largest, subnormals, a zero row, a row
    on a 4-bit grid, one outlier per group, and rows holding NaN, +inf and -inf."""
    h = (rng.standard_normal((11, d)) * 1.0).astype(np.float16)
    h[0] = np.where(rng.uniform(size=d) < 0.5, -65504.0, 65504.0)
    h[1] = rng.uniform(3e4, 65504.0, d) * np.sign(rng.uniform(-1, 1, d))
    h[2] = rng.uniform(-6e-6, 6e-6, d)                     # FP16 subnormals
    h[3] = 0
    codes = rng.integers(0, 16, d)
    codes[::32], codes[1::32] = 0, 15
    h[4] = codes * 0.25 - 1.5
    h[5, ::32] = 900.0
    h[6, 40] = np.nan
    h[7, 70 % d] = np.inf                                  # columns inside any d >= 64
    h[8, [3, 99 % d]] = [-np.inf, np.nan]
    h[9, :] = 65504.0
    h[9, 5] = -65504.0
    h[10] = rng.uniform(-1, 1, d) * 1e-3
    return h


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("d", [576, 128, 64])
def test_h_special_values_match_numpy(ops, ref, rng, mode, d):
    """Rows FP16 can only just hold (scales and zeros that saturate), subnormals, zero rows
    and rows holding NaN / inf: kv_h.cu stores the bytes numpy_ops.encode_h stores (NaN
    scales as one bit pattern), and its read (the reconstruction's input, FP16) equals
    numpy_ops.decode_h of those bytes rounded to FP16 with quant.saturate_f16, NaN for NaN."""
    from tinyloop.backends.numpy_ops import decode_h
    from tinyloop.quant import saturate_f16
    hh = special_h_rows(rng, d)
    t = hh.shape[0]
    qh, q = qkv_rows(rng, t, 9, 3, 64)
    c_ref, c_dev = h_pair(ops, ref, mode, 9, 3, 64, d, t, 16)
    ref.kv_write(q.copy(), hh.astype(np.float32), 0, 1e4, 9, 3, 64, c_ref.slot(0))
    ops.kv_write(cupy.asarray(qh), cupy.asarray(hh), 0, 1e4, 9, 3, 64, c_dev.slot(0))
    got, want = gather(c_dev.slot(0), t, True), gather(c_ref.slot(0), t, False)
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8),
                                      err_msg=f"{mode} part {name} (seed {SESSION_SEED})")
    lay = c_ref.slot(0).layout
    for name, arr in got.items():
        if arr.dtype == np.float16 and name != "h":
            bad = ~np.isfinite(arr)
            assert not bad[[0, 1, 2, 3, 4, 5, 9, 10]].any(), f"{name}: a finite row overflowed"
    back = h_read_rows(ops, c_dev.slot(0), t)
    expect = saturate_f16(decode_h(want, lay))
    np.testing.assert_array_equal(back, expect, err_msg=f"{mode} read (seed {SESSION_SEED})")
    assert np.isfinite(back[[0, 1, 2, 3, 4, 5, 9, 10]].astype(np.float32)).all()


@pytest.mark.parametrize("d", [576, 128])
def test_h_int4_read_matches_decode(ops, ref, rng, d):
    """Random rows of mixed scale (groups in both bases, outliers anywhere): kv_h.cu's read
    equals numpy_ops.decode_h of the same bytes rounded to FP16, and reads the row outliers
    back as their FP16 values."""
    from tinyloop.backends.numpy_ops import decode_h
    from tinyloop.quant import saturate_f16
    t = 40
    hh, hf = h_rows(rng, t, d)
    qh, _ = qkv_rows(rng, t, 9, 3, 64)
    _, c_dev = h_pair(ops, ref, "h_int4", 9, 3, 64, d, t, 32)
    ops.kv_write(cupy.asarray(qh), cupy.asarray(hh), 0, 1e4, 9, 3, 64, c_dev.slot(0))
    parts = gather(c_dev.slot(0), t, True)
    lay = c_dev.slot(0).layout
    back = h_read_rows(ops, c_dev.slot(0), t)
    np.testing.assert_array_equal(back, saturate_f16(decode_h(parts, lay)))
    idx = parts["h_oidx"].astype(np.int64)
    np.testing.assert_array_equal(np.take_along_axis(back, idx, 1),
                                  np.take_along_axis(hh, idx, 1))
    flags = parts["h_scale"].view(np.uint16) & 0x8000
    assert flags.any() and not flags.all()             # both bases in use on these rows


@pytest.mark.parametrize("mode", H_MODES)
def test_h_write_step_reads_the_device_position(ops, ref, rng, mode):
    """kv_write_step writes at the step state's STEP_POS what kv_write writes there."""
    h, hkv, hd, d, pos = 9, 3, 64, 576, 45
    qh, _ = qkv_rows(rng, 1, h, hkv, hd)
    hh, _ = h_rows(rng, 1, d)
    _, a = h_pair(ops, ref, mode, h, hkv, hd, d, 64, 32)
    _, b = h_pair(ops, ref, mode, h, hkv, hd, d, 64, 32)
    q1, q2 = cupy.asarray(qh), cupy.asarray(qh)
    ops.kv_write(q1, cupy.asarray(hh), pos, 1e4, h, hkv, hd, a.slot(0))
    state = np.zeros(STEP_WORDS, np.int32)
    state[STEP_POS] = pos
    ops.kv_write_step(q2, cupy.asarray(hh), cupy.asarray(state), 1e4, h, hkv, hd, b.slot(0))
    assert cupy.array_equal(q1, q2)
    ga, gb = gather(a.slot(0), 64, True), gather(b.slot(0), 64, True)
    for name in ga:
        np.testing.assert_array_equal(ga[name], gb[name], err_msg=name)


def _recon_pair(ops, rng, h, hkv, hd, d, chunk, t, bits=4, g=32):
    """A random K|V weight [2 kv_dim, d] and the Recon of each backend (the CUDA one with its
    scratch: recon_h / recon_kv of ``chunk`` rows, recon_state of ``t`` rows, all poisoned)."""
    w = rand_weight(rng, 2 * hkv * hd, d, bits, g)
    scratch = {"recon_h": poisoned((chunk, d), cupy.float16),
               "recon_kv": poisoned((chunk, 2 * hkv * hd), cupy.float16),
               "recon_state": poisoned((t, h * (hd + 2)), cupy.float32)}
    return (Recon(w, 1e4, chunk), Recon(dev_weight(ops, w), 1e4, chunk, scratch))


def _h_attention_case(ops, ref, rng, mode, h, hkv, hd, d, t, pos0, p, chunk, step=False,
                      window=0):
    """The NumPy cache is filled by its kv_write over positions 0..ctx-1; its pages are copied
    byte for byte into the CUDA pages, so both attentions rebuild K|V from the same codes.
    ``window``: both sliding-window."""
    ctx = pos0 + t
    c_ref, c_dev = h_pair(ops, ref, mode, h, hkv, hd, d, ctx, p)
    _, allq = qkv_rows(rng, ctx, h, hkv, hd, extra=8)    # a padded qkv row
    _, hf = f16(rng, ctx, d)                              # scores of order 1: no near-ties
    ref.kv_write(allq.copy(), hf, 0, 1e4, h, hkv, hd, c_ref.slot(0))
    for i in range(-(-ctx // p)):
        src, dst = c_ref.slot(0).page_parts(i), c_dev.slot(0).page_parts(i)
        for name, arr in src.items():
            dst[name].set(np.ascontiguousarray(arr))
    r_ref, r_dev = _recon_pair(ops, rng, h, hkv, hd, d, chunk, t)
    qh = allq[pos0:].astype(np.float16)
    want = np.empty((t, h * hd), np.float32)
    ref.kv_attention(qh.astype(np.float32), c_ref.slot(0), pos0, h, hkv, hd, want, r_ref,
                     window=window)
    out = poisoned((t, h * hd), cupy.float16)
    if step:
        state = np.zeros(STEP_WORDS, np.int32)
        state[STEP_POS] = pos0
        ops.kv_attention_step(cupy.asarray(qh), c_dev.slot(0), cupy.asarray(state), h, hkv, hd,
                              out, r_dev, window=window)
    else:
        ops.kv_attention(cupy.asarray(qh), c_dev.slot(0), pos0, h, hkv, hd, out, r_dev,
                         window=window)
    assert_close(out, want, atol=1.2e-2 * rms(want), rtol=1e-2,
                 what=f"{mode} attention T={t} pos0={pos0} P={p} chunk={chunk} step={step} "
                      f"window={window} (seed {SESSION_SEED})")


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("h,hkv,hd,d", HD)
@pytest.mark.parametrize("t,pos0", [(2, 0), (67, 0), (300, 0), (64, 37), (33, 300)])
@pytest.mark.parametrize("p,chunk", [(16, 48), (32, 256), (32, 64)])
def test_h_attention_prefill(ops, ref, rng, mode, h, hkv, hd, d, t, pos0, p, chunk):
    """Prefill rows against contexts of one to seven reconstruction chunks (chunk not a
    multiple of P too), query rows starting inside a chunk."""
    _h_attention_case(ops, ref, rng, mode, h, hkv, hd, d, t, pos0, p, chunk)


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("h,hkv,hd,d", HD)
@pytest.mark.parametrize("ctx", [1, 2, 31, 32, 33, 255, 256, 257, 1000])
def test_h_attention_decode(ops, ref, rng, mode, h, hkv, hd, d, ctx):
    """One query row (the GEMV rebuilds a one-row chunk at ctx = 1 and 257)."""
    _h_attention_case(ops, ref, rng, mode, h, hkv, hd, d, 1, ctx - 1, 32, 256)


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("ctx", [1, 300])
def test_h_attention_step(ops, ref, rng, mode, ctx):
    """kv_attention_step on a store-h slot reads the context length from the step state."""
    _h_attention_case(ops, ref, rng, mode, 9, 3, 64, 576, 1, ctx - 1, 32, 256, step=True)


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("h,hkv,hd,d", [HD[0], HD[2]])
@pytest.mark.parametrize("window", [1, 5, 64, 10**6])
@pytest.mark.parametrize("t,pos0", [(1, 299), (67, 0), (200, 0), (64, 37), (33, 300)])
def test_h_attention_sliding_window(ops, ref, rng, mode, h, hkv, hd, d, window, t, pos0):
    """Store-h attention (h_attn_chunk) with a window, chunks of 48 over pages of 16: the
    chunks wholly before the first row's window are not rebuilt, and a later row's window can
    start past chunks the launch still runs (T = 200, window 1 / 5: a row meets two chunks
    holding none of its keys, so a carried state with no key meets parts with none, which
    must stay empty, not NaN)."""
    _h_attention_case(ops, ref, rng, mode, h, hkv, hd, d, t, pos0, 16, 48, window=window)


@pytest.mark.parametrize("mode", H_MODES)
@pytest.mark.parametrize("window", [5, 200])
def test_h_attention_step_sliding_window(ops, ref, rng, mode, window):
    """kv_attention_step on a store-h slot passes the layer's window on."""
    _h_attention_case(ops, ref, rng, mode, 9, 3, 64, 576, 1, 299, 32, 64, step=True,
                      window=window)


def test_h_attention_refuses_missing_or_short_scratch(ops, ref, rng):
    c_ref, c_dev = h_pair(ops, ref, "h_int8", 9, 3, 64, 576, 64, 32)
    r_ref, r_dev = _recon_pair(ops, rng, 9, 3, 64, 576, 32, 4)
    qh, _ = qkv_rows(rng, 8, 9, 3, 64)
    q = cupy.asarray(qh)
    out = cupy.empty((8, 576), cupy.float16)
    with pytest.raises(ConfigError, match="reconstruction"):
        ops.kv_attention(q, c_dev.slot(0), 0, 9, 3, 64, out, None)
    with pytest.raises(ConfigError, match="recon_state has 4 rows, need at least 8"):
        ops.kv_attention(q, c_dev.slot(0), 0, 9, 3, 64, out, r_dev)
    no_state = Recon(r_dev.w_kv, 1e4, 32, {k: v for k, v in r_dev.scratch.items()
                                           if k != "recon_state"})
    with pytest.raises(ConfigError, match="recon_state"):
        ops.kv_attention(q[:1], c_dev.slot(0), 0, 9, 3, 64, out[:1], no_state)


# --- whole models ------------------------------------------------------------------------------
SMOL = dict(vocab_size=2048, n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4)


@pytest.fixture(scope="module")
def smol_path(tmp_path_factory):
    """A synthetic model at SmolLM2's attention dims (d 576, 9 heads, 3 KV heads of 64)."""
    p = tmp_path_factory.mktemp("kvh") / "smol_dims.tlm"
    write_synthetic(p, synthetic_config(**SMOL), seed=5, bits=4, group_size=32)
    return str(p)


MIXED = {"prelude": "h_int8", "recurrent": "int8", "coda": "h_int4"}


@pytest.mark.parametrize("mode", list(H_MODES) + [MIXED])
@pytest.mark.parametrize("chunk", [0, 200])
def test_h_modes_match_reference(smol_path, mode, chunk):
    """Logits of a 600-token prompt (three reconstruction chunks of 256, 19 pages of 32) at
    depth 1 and 3, CUDA against NumPy in the same mode; prefill_chunk=200 makes prefill
    chunks start inside a reconstruction chunk. Then greedy decode across the 256 boundary."""
    ids = np.random.default_rng(11).integers(0, SMOL["vocab_size"], 600)
    # CUDA quantizes the FP16 activation row, NumPy the float32 one: a value within 2^-11 of
    # a rounding boundary takes the neighbouring code. An INT8 flip moves K/V by 1/127 of the
    # group's range, an INT4 flip by 1/15 of it, so h_int4 (alone or in the mixed dict) gets
    # a looser top-1 floor and a shorter common decode prefix on this flat random model; the
    # KL bound (5e-3, a tenth of h_int4's own budget against fp16) is the same for all. The
    # greedy decode comparison across backends is left out for h_int4: with ~10% of top-1
    # picks differing on this flat model the first token already differs (measured on the
    # H200); CUDA's own prefill-vs-decode agreement is test_h_prefill_and_decode_agree's.
    int4 = "h_int4" in (mode.values() if isinstance(mode, dict) else [mode])
    top1_min, agree_min = (0.85, None) if int4 else (0.95, 12)
    ref = tinyloop.load_model(smol_path, max_seq_len=700, prefill_chunk=chunk,
                              backend="numpy", kv_mode=mode)
    cu = tinyloop.load_model(smol_path, max_seq_len=700, prefill_chunk=chunk,
                             backend="cuda", kv_mode=mode)
    try:
        for depth in (1, 3):
            want, got = ref.logits(ids, depth=depth), cu.logits(ids, depth=depth)
            kl = float(_kl_rows(want, got).mean())
            top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
            _report("h_mode_vs_reference", mode=str(mode), chunk=chunk, depth=depth,
                    top1=top1, kl=kl)
            assert np.isfinite(got).all() and top1 >= top1_min and kl < 5e-3, (mode, depth,
                                                                                kl, top1)
        if agree_min is None:
            return
        prompt = list(ids[:245])
        a = cu.generate(prompt, max_new_tokens=24, depth=3)
        b = ref.generate(prompt, max_new_tokens=24, depth=3)
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), 24)
        assert n >= agree_min, (a.token_ids, b.token_ids)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


def _long_run(cu, n_prompt: int, new: int, depth: int, need: int):
    """(prompt, result) of the first seeded random prompt whose greedy run decodes at least
    ``need`` tokens before EOS (a random model may pick EOS early)."""
    for seed in range(12, 24):
        prompt = list(np.random.default_rng(seed).integers(0, SMOL["vocab_size"], n_prompt))
        r = cu.generate(prompt, max_new_tokens=new, depth=depth)
        if len(r.token_ids) >= need:
            return prompt, r
    raise AssertionError(f"no prompt decoded {need} tokens before EOS")


@pytest.mark.parametrize("mode", list(H_MODES) + [MIXED])
def test_h_prefill_and_decode_agree(smol_path, mode):
    """Greedy decode (T = 1 reconstruction, crossing the 256-position chunk and several
    pages) picks the tokens the prefill logits of the same sequence pick."""
    cu = tinyloop.load_model(smol_path, max_seq_len=400, backend="cuda", kv_mode=mode)
    try:
        prompt, r = _long_run(cu, 240, 40, 2, 20)
        gen = list(r.token_ids)
        want = gen + ([cu.config.eos_token_id] if r.finish_reason == "eos" else [])
        rows = cu.logits(prompt + gen, depth=2)[len(prompt) - 1:][:len(want)]
        agree = float(np.mean(rows.argmax(-1) == np.array(want)))
        _report("h_prefill_vs_decode", mode=str(mode), agree=agree, n=len(gen))
        assert agree >= 0.9, (mode, agree)
    finally:
        tinyloop.free_model(cu)


@pytest.mark.parametrize("mode", ["h_int4", MIXED])
def test_h_first_request_is_bit_identical(smol_path, mode):
    """No page or scratch is read before it is written: three identical requests give
    identical logits (the state scratch is reused across layers and requests)."""
    cu = tinyloop.load_model(smol_path, max_seq_len=600, backend="cuda", kv_mode=mode)
    try:
        ids = np.random.default_rng(13).integers(0, SMOL["vocab_size"], 520)
        runs = [cu.logits(ids, depth=3) for _ in range(3)]
    finally:
        tinyloop.free_model(cu)
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])


@pytest.mark.parametrize("mode", ["h_int8", MIXED])
def test_h_decode_steps_allocate_nothing_but_pages(smol_path, mode):
    """Once prefill is done, decode steps allocate nothing from the pool except KV pages (tag
    kv_cache) at page boundaries: the reconstruction runs in the phase-5 scratch; the store-h
    steps run eagerly, never captured (graph_kv_modes)."""
    cu = tinyloop.load_model(smol_path, max_seq_len=400, backend="cuda", kv_mode=mode)
    try:
        assert not set(cu.resolve_kv_modes()) <= set(cu.ops.graph_kv_modes)
        assert cu.pool.by_tag().get("scratch", 0) > 0
        prompt, _ = _long_run(cu, 250, 30, 2, 12)
        it = iter(cu.stream(prompt, max_new_tokens=30, depth=2))
        next(it)                                   # prefill and the first token
        start = cu.pool.events_dropped + len(cu.pool.events())
        n = sum(1 for _ in it)
        end = cu.pool.events_dropped + len(cu.pool.events())
        assert n >= 10
        assert start >= cu.pool.events_dropped
        between = cu.pool.events()[start - cu.pool.events_dropped:end - cu.pool.events_dropped]
        bad = [e for e in between if e.action in ("alloc", "segment_alloc")
               and e.tag != "kv_cache"]
        assert not bad, bad
        assert cu.graph_stats()["captures"] == 0
    finally:
        tinyloop.free_model(cu)


def test_inspect_plan_sizes_the_state_scratch(smol_path):
    """Phase 5 on CUDA holds recon_state [scratch rows, n_heads * (head_dim + 2)] float32."""
    cu = tinyloop.load_model(smol_path, max_seq_len=400, prefill_chunk=128, backend="cuda",
                             kv_mode="h_fp16")
    try:
        (e,) = [e for e in cu.plan if e.name == "recon_state"]
        assert e.phase == 5 and e.tag == "scratch" and not e.lazy
        assert e.shape == (128, 9 * 66) and e.dtype == "float32"
    finally:
        tinyloop.free_model(cu)
