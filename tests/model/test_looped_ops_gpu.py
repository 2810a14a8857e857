"""The CUDA kernels of the looped architectures' ops (embedding scale, Q/K/V bias, the
residual-stream norms, the post-branch and sandwich norms, the seeded initial state) against
the NumPy reference, at the published models' widths: Ouro-1.4B (d 2048, 16 heads of 128, no
KV grouping), Huginn-3.5B (d 5280, which is not a multiple of 64, 55 heads of 96) and
Nanbeige4.2-3B (d 3072, 48 query heads of 128 over 8 KV heads: benchmarks/bench_looped.py's
published dims). Attention at those
head shapes, every decode and prefill kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.base import STATE_TRUNCATE, STEP_POS, STEP_WORDS, seeded_state  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402

from ..kernels.test_kernels_gpu import (F16_RTOL, _paged_attention_case, assert_close,  # noqa: E402
                                        dev_weight, f16, poisoned, rand_weight, rms)

WIDTHS = [2048, 5280, 3072]                       # Ouro-1.4B, Huginn-3.5B, Nanbeige4.2-3B
# (d, in_features of the branch's last projection, bits, group): the O projections and the
# down projections (FFN 5632, 17920, 10752; Nanbeige's O projection reads 48 x 128 = 6144);
# Huginn's 5280 takes groups of 32 only
BRANCHES = [(2048, 2048, 4, 128), (2048, 5632, 4, 64), (5280, 5280, 4, 32),
            (5280, 17920, 8, 128), (3072, 6144, 8, 64), (3072, 10752, 4, 128)]
# (query heads, KV heads, head dim)
HEAD_SHAPES = [(16, 16, 128), (55, 55, 96), (48, 8, 128)]


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("d", WIDTHS)
def test_scale(ops, ref, rng, t, d):
    x = (rng.standard_normal((t, d)) * 0.02).astype(np.float32)
    want = x.copy()
    ref.scale(want, 72.66)
    dx = cupy.asarray(x)
    ops.scale(dx, 72.66)
    assert_close(dx, want, atol=0.0, rtol=1e-7, what="scale")     # one float32 product


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("h,hkv,hd", HEAD_SHAPES)
def test_add_bias(ops, ref, rng, t, h, hkv, hd):
    n = (h + 2 * hkv) * hd
    xh, x = f16(rng, t, n)
    bias = (rng.standard_normal(n) * 0.5).astype(np.float32)
    ref.add_bias(x, bias)
    dx = cupy.asarray(xh)
    ops.add_bias(dx, cupy.asarray(bias))
    # the sum of two exact values rounded once to FP16
    assert_close(dx, x, atol=2.0 ** -24, rtol=2.0 ** -11, what="add_bias")


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("d", WIDTHS)
def test_norm_residual(ops, ref, rng, t, d):
    x = (rng.standard_normal((t, d)) * 3).astype(np.float32)
    wt = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    want = x.copy()
    ref.norm_residual(want, wt, 1e-6)
    dx = cupy.asarray(x)
    ops.norm_residual(dx, cupy.asarray(wt), 1e-6)
    # float accumulation of the mean square over d terms, then float32 products
    assert_close(dx, want, atol=1e-6, rtol=2e-5, what="norm_residual")


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("d,k,bits,g", BRANCHES)
def test_linear_norm_residual(ops, ref, rng, t, d, k, bits, g):
    """A "pre_post" branch: residual += rmsnorm(x @ W.T). The CUDA product is rounded to FP16
    before the norm (half an FP16 ulp of each element) besides the GEMV's own error."""
    w = rand_weight(rng, d, k, bits, g)
    dw = dev_weight(ops, w)
    xh, x = f16(rng, t, k)
    wt = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    res0 = rng.standard_normal((t, d)).astype(np.float32)
    want = res0.copy()
    ref.linear_norm_residual(x, w, wt, 1e-6, want, np.empty((t, d), np.float32))
    res = cupy.asarray(res0)
    tmp = poisoned((t + 2, d), cupy.float16)           # >= T rows, as the model's scratch
    ops.linear_norm_residual(cupy.asarray(xh), dw, cupy.asarray(wt), 1e-6, res, tmp)
    delta = want - res0
    assert_close(res, want, atol=4e-3 * rms(delta) + F16_RTOL * np.abs(delta), rtol=1e-6,
                 what=f"linear_norm_residual d={d} k={k} q{bits}/g{g}")


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("d,k,bits,g", BRANCHES)
def test_linear_residual_norm(ops, ref, rng, t, d, k, bits, g):
    """A "sandwich" branch: residual = rmsnorm(residual + x @ W.T)."""
    w = rand_weight(rng, d, k, bits, g)
    dw = dev_weight(ops, w)
    xh, x = f16(rng, t, k)
    wt = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    res0 = rng.standard_normal((t, d)).astype(np.float32)
    want = res0.copy()
    ref.linear_residual_norm(x, w, wt, 1e-6, want)
    res = cupy.asarray(res0)
    ops.linear_residual_norm(cupy.asarray(xh), dw, cupy.asarray(wt), 1e-6, res)
    assert_close(res, want, atol=4e-3 * rms(want), rtol=F16_RTOL,
                 what=f"linear_residual_norm d={d} k={k} q{bits}/g{g}")


def test_norm_ops_name_a_bad_weight(ops, rng):
    x = cupy.zeros((2, 64), cupy.float32)
    with pytest.raises(ConfigError, match="weight"):
        ops.norm_residual(x, cupy.ones(32, cupy.float32), 1e-6)
    with pytest.raises(ConfigError, match="bias"):
        ops.add_bias(cupy.zeros((2, 64), cupy.float16), cupy.ones(63, cupy.float32))


# --- the seeded initial state -----------------------------------------------------------------
# Device double-precision log1p / cos are within 2 ulp of the host's: after the float32
# rounding the states agree to a float32 ulp or two.
STATE_RTOL = 2.0 ** -22


@pytest.mark.parametrize("pos0,t", [(0, 1), (0, 40), (2047, 3), (100_000, 2)])
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("seed", [0, 12345, 2**64 - 1])
def test_init_state_matches_the_host_draw(ops, pos0, t, d, seed):
    std = 0.02 * 72.66
    want = seeded_state(pos0, t, d, std, seed)
    out = poisoned((t, d), cupy.float32)
    ops.init_state(out, pos0, std, seed)
    got = cupy.asnumpy(out)
    assert np.abs(got).max() <= STATE_TRUNCATE * std * (1 + 1e-6)
    assert_close(got, want, atol=1e-7 * std, rtol=STATE_RTOL, what=f"init_state seed={seed}")


@pytest.mark.parametrize("pos", [0, 5, 4095])
def test_init_state_step_reads_the_device_position(ops, pos):
    d, std, seed = 5280, 1.0, 7
    state = np.zeros(STEP_WORDS, np.int32)
    state[STEP_POS] = pos
    out = poisoned((1, d), cupy.float32)
    ops.init_state_step(out, cupy.asarray(state), std, seed)
    assert_close(out, seeded_state(pos, 1, d, std, seed), atol=1e-7, rtol=STATE_RTOL,
                 what=f"init_state_step pos={pos}")


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_init_state_rows_reads_each_rows_device_position(ops, seed):
    """A decode batch's seeded state: row i at positions[i], read from the device index in
    one launch (elementwise.cu init_state_rows_f32), against the host draw row by row; and
    without the device positions, the per-row launches."""
    positions, d, std = [0, 5, 4095, 31, 32, 100_000], 5280, 0.5
    want = np.concatenate([seeded_state(p, 1, d, std, seed) for p in positions])
    for dev in (cupy.asarray(np.array(positions, np.int64)), None):
        out = poisoned((len(positions), d), cupy.float32)
        ops.init_state_rows(out, positions, std, seed, dev)
        assert_close(out, want, atol=1e-7 * std, rtol=STATE_RTOL,
                     what=f"init_state_rows seed={seed} device positions={dev is not None}")
    out = cupy.zeros((len(positions), d), cupy.float32)
    with pytest.raises(ConfigError, match="positions_dev must be a contiguous device int64"):
        ops.init_state_rows(out, positions, std, seed,
                            cupy.asarray(np.array(positions, np.int32)))
    with pytest.raises(ConfigError, match="5 positions for 6 rows"):
        ops.init_state_rows(out, positions[:5], std, seed)


def test_init_state_refuses_a_bad_seed(ops):
    out = cupy.zeros((1, 64), cupy.float32)
    with pytest.raises(ConfigError, match="seed"):
        ops.init_state(out, 0, 1.0, -1)
    with pytest.raises(ConfigError, match="seed"):
        ops.init_state(out, 0, 1.0, 2**64)


# --- attention at the real head shapes ----------------------------------------------------------
@pytest.mark.parametrize("version", ["v1", "split"])
@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEAD_SHAPES)
@pytest.mark.parametrize("ctx", [1, 33, 700, 2049])
def test_decode_attention_at_real_heads(ops, ref, rng, monkeypatch, version, mode, h, hkv, hd,
                                        ctx):
    """Both decode kernels, eager and from the device step state (v1's one block per head
    gives head dim 96 slices that do not fill the block: its leftover threads must not add
    keys twice)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode=version))
    for step in (False, True):
        _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, 1, ctx - 1, 32, step=step)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEAD_SHAPES)
@pytest.mark.parametrize("t,pos0", [(67, 0), (33, 300)])
def test_scalar_prefill_attention_at_real_heads(ops, ref, rng, monkeypatch, mode, h, hkv, hd,
                                                t, pos0):
    """The scalar prefill kernel (the tensor-core kernel at these heads: test_attn_prefill.py's
    bounds; the models run it through tests/gpu/test_looped_cuda.py)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_prefill="scalar"))
    _paged_attention_case(ops, ref, rng, mode, h, hkv, hd, t, pos0, 32)


@pytest.mark.parametrize("window", [-1, 2**31, 2.0, True, None])
def test_a_bad_window_is_refused_by_name(ops, rng, window):
    """A window that is not an int in 0..2^31-1 is named before anything is read (a negative
    one would otherwise run as full attention)."""
    qkv = cupy.zeros((1, 3 * 64), cupy.float16)
    out = cupy.zeros((1, 64), cupy.float16)
    with pytest.raises(ConfigError, match=r"attention window=.*0 = full attention"):
        ops.kv_attention(qkv, None, 0, 1, 1, 64, out, window=window)
    with pytest.raises(ConfigError, match=r"attention window=.*0 = full attention"):
        ops.kv_attention_step(qkv, None, None, 1, 1, 64, out, window=window)


# --- the Q/K/V bias inside the fused decode-step prologue ---------------------------------------
@pytest.mark.parametrize("ops", ["v1"], indirect=True)      # the fused kernel's GEMV: auto
                                                            # runs tc (no fusion) at d >= 3072
@pytest.mark.parametrize("h,hkv,hd,d", [(16, 16, 128, 2048), (55, 55, 96, 5280),
                                        (48, 8, 128, 3072)])
@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_qkv_rope_step_with_bias_equals_the_unfused_ops(ops, ref, rng, h, hkv, hd, d, mode):
    """qkv_rope.cu with a bias leaves qkv and the page row at the step's position bit for bit
    as rmsnorm_linear + add_bias + kv_write_step do, on v1 (under auto an INT4 QKV of K >=
    3072, as Huginn's, runs tc and the step takes that pair instead)."""
    from ..kernels.test_kernels_gpu import gather, kv_pair
    pos, theta = 45, 50000.0
    n = (h + 2 * hkv) * hd
    w = dev_weight(ops, rand_weight(rng, n, d, 4, 32))
    wt = cupy.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
    x = cupy.asarray(rng.standard_normal((1, d)).astype(np.float32))
    bias = cupy.asarray((rng.standard_normal(n) * 0.5).astype(np.float32))
    state = np.zeros(STEP_WORDS, np.int32)
    state[STEP_POS] = pos
    step = cupy.asarray(state)
    got, want = {}, {}
    for fused, out in ((True, got), (False, want)):
        _, c = kv_pair(ops, ref, mode, h, hkv, hd, pos + 1, 32, d_model=d)
        qkv = poisoned((1, n), cupy.float16)
        if fused:
            assert ops.rmsnorm_qkv_kv_step(x, wt, 1e-6, w, qkv, step, theta, h, hkv, hd,
                                           c.slot(0), bias=bias)
        else:
            ops.rmsnorm_linear(x, wt, 1e-6, w, qkv, cupy.empty((1, d), cupy.float16))
            ops.add_bias(qkv, bias)
            ops.kv_write_step(qkv, None, step, theta, h, hkv, hd, c.slot(0))
        out["qkv"] = cupy.asnumpy(qkv)
        rows = gather(c.slot(0), pos + 1, dev=True)
        out.update({part: r[pos] for part, r in rows.items()})
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    with pytest.raises(ConfigError, match="bias"):
        _, c = kv_pair(ops, ref, mode, h, hkv, hd, pos + 1, 32, d_model=d)
        ops.rmsnorm_qkv_kv_step(x, wt, 1e-6, w, poisoned((1, n), cupy.float16), step, theta,
                                h, hkv, hd, c.slot(0), bias=bias[:-1])
