"""The decode batch's CUDA kernels (rope.cu ``kv_write_batch_*``, attention_decode.cu
``attn_split_batch_*``, attention.cu ``attn_decode_batch_*``) against the NumPy reference's
per-row ``kv_write`` / ``kv_attention``: B rows, each at its own position (0, page boundaries,
long contexts) over its own request's block table, read from the step's device index
(``kv.cache.batch_index``), in fp16 and int8 pages, GQA and not, full and sliding-window.
Bounds are the single-row decode tests' (tests/kernels/test_kernels_gpu.py)."""

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

from tinyloop.backends.cuda import attention as cuda_attention  # noqa: E402
from tinyloop.config import ModelConfig  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.kv.cache import BatchSlot, batch_index  # noqa: E402
from tinyloop.memory import MemoryPool  # noqa: E402

from ..kv.test_batch_kv import P, _caches  # noqa: E402  (pages for positions 0..pos)
from .test_kernels_gpu import (F16_RTOL, SESSION_SEED, FakeCudaPool, assert_close,  # noqa: E402
                               copy_pages, poisoned, rms)

# B = 1, 3 and 32 rows; positions at 0, on both sides of page boundaries (P = 16), short and
# long contexts in one batch (the longest picks the split count, the others use fewer splits)
POSITIONS = {
    "one_at_0": [0],
    "one_long": [2100],
    "three": [0, 15, 16],
    "three_mixed": [31, 1000, 32],
    "thirty_two": [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 100, 127, 128, 129, 255, 256,
                   257, 300, 511, 512, 700, 1000, 1023, 1024, 1500, 2047, 2048, 2100, 5, 9],
}
HEADS = [(9, 3, 64), (4, 4, 96), (6, 2, 128), (8, 8, 64)]


def _cfg(h, hkv, hd) -> ModelConfig:
    return ModelConfig(vocab_size=8, d_model=64, n_heads=h, n_kv_heads=hkv, head_dim=hd,
                       ffn_dim=8, n_prelude=1, n_recurrent=0, n_coda=0)


def _rows(ops, caches, positions) -> BatchSlot:
    """The BatchSlot of slot 0 of every cache, with its device index (one upload)."""
    host = batch_index(caches, positions, 1)
    dev = cupy.asarray(host)
    return BatchSlot([c.slot(0) for c in caches], positions, dev[0], dev[1])


def _qkv(rng, n, h, hkv, hd):
    return rng.standard_normal((n, (h + 2 * hkv) * hd)).astype(np.float32)


def _gather(kv) -> dict:
    """Every part of every page of a slot, concatenated in position order, on the host (one
    copy per part)."""
    pages = [kv.page_parts(i) for i in range(len([a for a in kv.table_host if a]))]
    out = {}
    for part in kv.layout.parts:
        rows = [pg[part.name] for pg in pages]
        on_device = isinstance(rows[0], cupy.ndarray)
        out[part.name] = (cupy.asnumpy(cupy.concatenate(rows)) if on_device
                          else np.concatenate(rows))
    return out


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("case", list(POSITIONS))
def test_kv_write_batch_matches_numpy_and_the_single_row_kernel(ops, ref, rng, mode, h, hkv,
                                                                hd, case):
    """Rotated Q and the stored row of each request's position against NumPy's per-row
    kv_write (kv_write's bounds: fp16 K within FP16 rounding, V exact; int8 V codes and
    scales exact, K codes within one), and every page byte equal to what the single-row
    CUDA kv_write stores (the same device code at the same position)."""
    positions = POSITIONS[case]
    theta = 10000.0 if hd != 128 else 500000.0
    cfg = _cfg(h, hkv, hd)
    q = _qkv(rng, len(positions), h, hkv, hd).astype(np.float16)
    q32 = q.astype(np.float32)
    host = MemoryPool("host")
    c_ref = _caches(ref, host, cfg, mode, positions)
    pool = FakeCudaPool()
    c_dev = _caches(ops, pool, cfg, mode, positions)
    c_one = _caches(ops, pool, cfg, mode, positions)
    want_q = q32.copy()
    for i, (c, p) in enumerate(zip(c_ref, positions)):
        ref.kv_write(want_q[i:i + 1], None, p, theta, h, hkv, hd, c.slot(0))
    got_q = cupy.asarray(q)
    ops.kv_write_batch(got_q, None, _rows(ops, c_dev, positions), theta, h, hkv, hd)
    one_q = cupy.asarray(q)
    for i, (c, p) in enumerate(zip(c_one, positions)):
        ops.kv_write(one_q[i:i + 1], None, p, theta, h, hkv, hd, c.slot(0))
    assert_close(got_q, want_q, atol=1e-3, rtol=F16_RTOL, what=f"batch rope q ({case})")
    np.testing.assert_array_equal(cupy.asnumpy(got_q), cupy.asnumpy(one_q))
    for i, p in enumerate(positions):
        got, one, want = (_gather(c[i].slot(0)) for c in (c_dev, c_one, c_ref))
        for name in got:                    # the single-row kernel's bytes, every page
            np.testing.assert_array_equal(got[name], one[name], err_msg=f"row {i} {name}")
        if mode == "fp16":
            assert_close(got["k"][p], want["k"][p], atol=1e-3, rtol=F16_RTOL,
                         what=f"row {i} k")
            assert_close(got["v"][p], want["v"][p], atol=0, rtol=0, what=f"row {i} v")
        else:
            for name in ("v", "v_scale"):
                np.testing.assert_array_equal(got[name][p], want[name][p],
                                              err_msg=f"row {i} {name}")
            assert np.abs(got["k"][p].astype(int) - want["k"][p].astype(int)).max() <= 1
            np.testing.assert_allclose(got["k_scale"][p].astype(np.float32),
                                       want["k_scale"][p].astype(np.float32), rtol=2e-3)
        for name, arr in got.items():       # nothing but the row's own position is written
            others = arr.copy()
            others[p] = 0
            assert not others.any(), f"row {i}: {name} written outside position {p}"
        assert got["v"][p].any()


def _attention_case(ops, ref, rng, mode, h, hkv, hd, positions, window):
    """Each row's NumPy cache filled by kv_write (positions 0..pos, its own random rows),
    its pages copied byte for byte into the row's CUDA pages (fp16: rounded to FP16 on both
    sides), the rotated query rounded to FP16 for both; NumPy's per-row kv_attention against
    one kv_attention_batch. Returns the reference rows."""
    cfg = _cfg(h, hkv, hd)
    host = MemoryPool("host")
    c_ref = _caches(ref, host, cfg, mode, positions)
    c_dev = _caches(ops, FakeCudaPool(), cfg, mode, positions)
    queries = []
    for c_r, c_d, p in zip(c_ref, c_dev, positions):
        rows = _qkv(rng, p + 1, h, hkv, hd).astype(np.float16).astype(np.float32)
        ref.kv_write(rows, None, 0, 1e4, h, hkv, hd, c_r.slot(0))     # rotates Q in place
        copy_pages(c_r.slot(0), c_d.slot(0), mode, -(-(p + 1) // P))
        queries.append(rows[p])
    q = np.stack(queries).astype(np.float16)
    want = np.empty((len(positions), h * hd), np.float32)
    for i, (c, p) in enumerate(zip(c_ref, positions)):
        ref.kv_attention(q[i:i + 1].astype(np.float32), c.slot(0), p, h, hkv, hd,
                         want[i:i + 1], window=window)
    out = poisoned((len(positions), h * hd), cupy.float16)
    ops.kv_attention_batch(cupy.asarray(q), _rows(ops, c_dev, positions), h, hkv, hd, out,
                           window=window)
    assert_close(out, want, atol=2e-3 * rms(want), rtol=F16_RTOL,
                 what=f"{mode} batch attention positions={positions} window={window} "
                      f"(seed {SESSION_SEED})")
    return want


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("case", list(POSITIONS))
@pytest.mark.parametrize("window", [0, 5, 64])
def test_attention_batch_split_rule(ops, ref, rng, monkeypatch, mode, h, hkv, hd, case, window):
    """Split-K with the host's split rule over n_heads * B blocks."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="split"))
    _attention_case(ops, ref, rng, mode, h, hkv, hd, POSITIONS[case], window)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", [(9, 3, 64), (6, 2, 128)])
@pytest.mark.parametrize("case", ["three", "three_mixed", "thirty_two"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("splits", [1, 3, 16, 64])
def test_attention_batch_forced_splits(ops, ref, rng, monkeypatch, mode, h, hkv, hd, case,
                                       window, splits):
    """A forced split count: rows of a few keys leave most splits empty (n_used per row),
    long rows merge up to 64 partials through their own tickets."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="split"))
    monkeypatch.setattr(cuda_attention, "decode_splits", lambda *a: splits)
    _attention_case(ops, ref, rng, mode, h, hkv, hd, POSITIONS[case], window)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("case", list(POSITIONS))
@pytest.mark.parametrize("window", [0, 5])
def test_attention_batch_v1(ops, ref, rng, monkeypatch, mode, h, hkv, hd, case, window):
    """KernelChoice(attn_decode="v1"): attention.cu's one-block-per-head kernel, grid
    (n_heads, B)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="v1"))
    _attention_case(ops, ref, rng, mode, h, hkv, hd, POSITIONS[case], window)


def test_attention_batch_reuses_its_tickets_across_launches(ops, ref, rng, monkeypatch):
    """Many merging launches in a row over one scratch block: every (row, head) ticket is
    re-armed by its merging block, so later launches merge right too; a larger batch grows
    the block (and zeroes its tickets)."""
    monkeypatch.setattr(ops, "kernels", dataclasses.replace(ops.kernels, attn_decode="split"))
    monkeypatch.setattr(cuda_attention, "decode_splits", lambda *a: 8)
    for positions in ([700, 300, 1000], [700, 300, 1000], POSITIONS["thirty_two"] * 2):
        _attention_case(ops, ref, rng, "fp16", 9, 3, 64, positions, 0)


def test_a_window_changes_the_batch_output(ops, ref, rng):
    """The window cases test a real mask (test_kernels_gpu.py's
    test_a_window_changes_the_output, for a batch)."""
    seed = int(rng.integers(1 << 30))
    pos = [299, 40, 1000]
    want = _attention_case(ops, ref, np.random.default_rng(seed), "fp16", 9, 3, 64, pos, 5)
    full = _attention_case(ops, ref, np.random.default_rng(seed), "fp16", 9, 3, 64, pos, 0)
    assert np.abs(want - full).max() > 10 * (2e-3 * rms(full) + F16_RTOL * np.abs(full).max())


def test_batch_wrappers_refuse_bad_rows_by_name(ops, rng):
    cfg = _cfg(4, 2, 64)
    caches = _caches(ops, FakeCudaPool(), cfg, "fp16", [3, 4])
    rows = _rows(ops, caches, [3, 4])
    qkv = cupy.zeros((2, 8 * 64), cupy.float16)
    out = cupy.zeros((2, 4 * 64), cupy.float16)
    with pytest.raises(ConfigError, match="got 3"):
        ops.kv_write_batch(cupy.zeros((3, 8 * 64), cupy.float16), None, rows, 1e4, 4, 2, 64)
    with pytest.raises(ConfigError, match="got 3"):
        ops.kv_attention_batch(cupy.zeros((3, 8 * 64), cupy.float16), rows, 4, 2, 64, out)
    bad = BatchSlot(rows.slots, rows.positions, rows.positions_dev.astype(cupy.int32),
                    rows.tables_dev)
    with pytest.raises(ConfigError, match="rows.positions_dev must be a contiguous device "
                                          "int64 array"):
        ops.kv_write_batch(qkv, None, bad, 1e4, 4, 2, 64)
    bad = BatchSlot(rows.slots, rows.positions, rows.positions_dev, rows.tables_dev[:1])
    with pytest.raises(ConfigError, match="rows.tables_dev"):
        ops.kv_attention_batch(qkv, bad, 4, 2, 64, out)
    with pytest.raises(ConfigError, match="window"):
        ops.kv_attention_batch(qkv, rows, 4, 2, 64, out, window=-1)
