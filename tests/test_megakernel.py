"""The decode megakernel's host logic (tinyloop/megakernel.py) on the CPU: the slot schedule
against what ``Model._stack`` actually runs, the descriptor packing, the occupancy estimate,
the eligibility rules and the settings. The kernel itself runs in tests/gpu/test_megakernel.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop import megakernel as mk
from tinyloop.backends import cuda_ops
from tinyloop.backends.cuda_ops import DS_MAX_SPLITS, occupancy_estimate
from tinyloop.config import MEGA_BLOCKS_PER_SM, megakernel_blocks_per_sm, megakernel_enabled
from tinyloop.errors import ConfigError


def _recorded_stack(m, depth: int, monkeypatch) -> list[tuple]:
    """The ops ``Model._stack`` issues at ``depth``: layers (with the KV slot index, passed
    through ``kv_of``), the prelude-output copy and the injections, by recording them."""
    rec: list[tuple] = []
    monkeypatch.setattr(m, "_layer", lambda li, kv, *a, **k: rec.append(("layer", li, kv)))
    # the ops instance may be shared by every model of the backend: undone after the test
    monkeypatch.setattr(m._ops, "copy", lambda src, dst: rec.append(("save_e",)))
    monkeypatch.setattr(m._ops, "inject", lambda *a, **k: rec.append(("inject",)))
    v = {"inject": object(), "cat": None, "norm": None}
    m._stack(object(), v, depth, lambda s: s, 0, None)
    return rec


@pytest.mark.parametrize("which", ["plain", "adapter"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_schedule_is_the_order_model_stack_runs(tiny_model_path, tiny_adapter_path, which,
                                                depth, monkeypatch):
    path = tiny_model_path if which == "plain" else tiny_adapter_path
    m = tinyloop.load_model(path, max_seq_len=32, backend="numpy")
    try:
        cfg = m.config
        want = _recorded_stack(m, depth, monkeypatch)
        got = mk.stack_schedule(cfg.n_prelude, cfg.n_recurrent, cfg.n_coda, depth, m.injects)
        assert got == want
        assert sum(op[0] == "inject" for op in got) == (depth if m.injects else 0)
        # every KV slot of the depth appears once, in slot order
        slots = [op[2] for op in got if op[0] == "layer"]
        assert slots == list(range(cfg.n_prelude + cfg.n_recurrent * depth + cfg.n_coda))
    finally:
        tinyloop.free_model(m)


def test_schedule_without_a_recurrent_block():
    assert mk.stack_schedule(2, 0, 1, 3, True) == [("layer", 0, 0), ("layer", 1, 1),
                                                     ("layer", 2, 2)]


def test_pack_program_layout():
    sched = [("layer", 0, 0), ("save_e",), ("inject",), ("layer", 1, 1), ("layer", 2, 2)]
    recs = {s: (1000 + s, 16, s % 2, 10 + s, 20 + s, 30 + s, 40 + s, 5 + s) for s in range(3)}
    prog = mk.pack_program(sched, recs.__getitem__)
    assert prog.dtype == np.int64 and prog.shape == (5, mk.OP_WORDS)
    assert prog[0, :10].tolist() == [mk.OP_LAYER, 0, 1000, 16, 0, 10, 20, 30, 40, 5]
    assert prog[1].tolist() == [mk.OP_SAVE_E] + [0] * (mk.OP_WORDS - 1)
    assert prog[2].tolist() == [mk.OP_INJECT] + [0] * (mk.OP_WORDS - 1)
    assert prog[3, :10].tolist() == [mk.OP_LAYER, 1, 1001, 16, 1, 11, 21, 31, 41, 6]
    assert prog[4, :3].tolist() == [mk.OP_LAYER, 2, 1002]
    assert not prog[:, 10:].any()
    with pytest.raises(ValueError, match="slot record of slot 0 has 3 fields"):
        mk.pack_program([("layer", 0, 0)], lambda s: (1, 2, 3))


class _Arr:
    def __init__(self, ptr):
        self.ptr = ptr


class _LW:
    def __init__(self, i):
        self.attn_norm, self.ffn_norm = _Arr(100 * i + 1), _Arr(100 * i + 2)
        self.attn_qkv, self.attn_output = ("qkv", i), ("o", i)
        self.ffn_gate_up, self.ffn_down = ("gu", i), ("down", i)


def _wrec(w):
    name, i = w
    base = {"qkv": 1, "o": 2, "gu": 3, "down": 4, "embed": 5, "head": 6, "adapter": 7}[name]
    return tuple(base * 1000 + i * 10 + j for j in range(mk.W_WORDS))


def test_pack_layers_and_model_layout():
    out = mk.pack_layers([_LW(0), _LW(1)], _wrec, lambda a: a.ptr)
    assert out.shape == (2, mk.LAYER_WORDS) and out.dtype == np.int64
    assert out[1, :2].tolist() == [101, 102]
    assert not out[:, 2:8].any()
    for j, name in enumerate(("qkv", "o", "gu", "down")):
        assert out[1, 8 + 8 * j:16 + 8 * j].tolist() == list(_wrec((name, 1)))
    model = mk.pack_model(("embed", 0), ("head", 0), _Arr(77), ("adapter", 0), _wrec,
                          lambda a: a.ptr)
    assert model.shape == (mk.MODEL_WORDS,)
    assert model[0:8].tolist() == list(_wrec(("embed", 0)))
    assert model[8:16].tolist() == list(_wrec(("head", 0)))
    assert model[16] == 77 and not model[17:24].any()
    assert model[24:32].tolist() == list(_wrec(("adapter", 0)))
    plain = mk.pack_model(("embed", 0), ("head", 0), _Arr(77), None, _wrec, lambda a: a.ptr)
    assert not plain[24:].any()


def test_smem_and_shape_rules():
    assert mk.smem_bytes(576, 576, 1536) == 2 * 1536          # SmolLM2: the SwiGLU row
    assert mk.smem_bytes(1024, 1024, 1536) == 2 * 2048        # the [x, e] concatenation

    class C:
        d_model, q_dim, ffn_dim, n_heads, n_kv_heads = 576, 576, 1536, 9, 3
    assert mk.shape_why_not(C) is None
    C.ffn_dim = 1540
    assert "multiples of 8" in mk.shape_why_not(C)
    C.ffn_dim, C.n_kv_heads = 1536, 4
    assert "not a multiple" in mk.shape_why_not(C)


def _occ_by_hand(regs, smem, threads, regs_sm=65536, smem_sm=233472, thr_sm=2048, blk_sm=32):
    # the same rule spelled out: 256-register allocation units per warp
    warps = (threads + 31) // 32
    per_warp = ((regs * 32 + 255) // 256) * 256
    return min(regs_sm // (warps * per_warp), smem_sm // (smem + 1024), thr_sm // threads,
               blk_sm)


@pytest.mark.parametrize("regs,static,dyn,threads", [(166, 10640, 3072, 128),
                                                     (32, 0, 0, 128), (255, 0, 0, 1024),
                                                     (64, 40000, 8192, 256)])
def test_occupancy_estimate(regs, static, dyn, threads):
    dev = {"MaxRegistersPerMultiprocessor": 65536, "MaxSharedMemoryPerMultiprocessor": 233472,
           "MaxThreadsPerMultiProcessor": 2048, "MaxBlocksPerMultiprocessor": 32}
    got = occupancy_estimate(regs, static, dyn, threads, dev)
    assert got == _occ_by_hand(regs, static + dyn, threads)
    if (regs, threads) == (166, 128):
        assert got == 3                  # 21 x 256 registers per warp, 4 warps: 3 blocks
    if (regs, threads) == (32, 128):
        assert got == 16                 # thread-limited
    if threads == 1024:
        assert got == 0                  # 255 registers x 1024 threads do not fit


def test_settings(monkeypatch):
    monkeypatch.delenv("TINYLOOP_MEGAKERNEL", raising=False)
    monkeypatch.delenv("TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM", raising=False)
    assert megakernel_enabled() is False                 # off by default (measured slower)
    monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "1")
    assert megakernel_enabled() is True
    assert megakernel_blocks_per_sm() == MEGA_BLOCKS_PER_SM
    monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "0")
    assert megakernel_enabled() is False
    monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "maybe")
    with pytest.raises(ConfigError, match="TINYLOOP_MEGAKERNEL='maybe'"):
        megakernel_enabled()
    for raw, want in (("0", 0), ("1", 1), ("32", 32)):
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM", raw)
        assert megakernel_blocks_per_sm() == want
    for raw in ("33", "-1", "two"):
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM", raw)
        with pytest.raises(ConfigError, match="TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM"):
            megakernel_blocks_per_sm()


def test_partials_capacity_matches_the_backend():
    assert mk.DS_MAX_SPLITS == DS_MAX_SPLITS


class _FakeCache:
    def __init__(self, modes, page_size=16):
        self.modes = tuple(modes)
        self.page_size = page_size


def test_why_not(tiny_model_path, monkeypatch):
    monkeypatch.delenv("TINYLOOP_MEGAKERNEL", raising=False)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    try:
        mega = mk.MegaDecode(m)
        assert mega.why_not(_FakeCache(["fp16"])) == "TINYLOOP_MEGAKERNEL=0"   # the default
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "1")
        assert "numpy backend has no megakernel" in mega.why_not(_FakeCache(["fp16"]))
        # a backend with the kernel: the modes, then what the backend says
        ops = m._ops          # possibly shared by every NumPy model: monkeypatch undoes it
        monkeypatch.setattr(ops, "mega_kv_modes", ("fp16", "int8"), raising=False)
        said, splits = [], []

        def mega_splits(cap, n_heads):          # the backend's decode_splits rule
            splits.append((cap, n_heads))
            return cuda_ops.decode_splits(cap, n_heads, 132)
        monkeypatch.setattr(ops, "mega_splits", mega_splits, raising=False)
        monkeypatch.setattr(ops, "mega_why_not",
                            lambda hd, smem: said.append((hd, smem)) or None, raising=False)
        # a 32-position table: the captured step attends single-pass, the megakernel cannot
        assert "32-position block table" in mega.why_not(_FakeCache(["fp16"]))
        assert splits == [(32, m.config.n_heads)] and not said
        m.max_seq_len = 1000                    # 63 pages of 16: split-K
        assert mega.why_not(_FakeCache(["fp16", "int8", "fp16"])) is None
        assert splits[-1] == (1008, m.config.n_heads)
        cfg = m.config
        assert said == [(cfg.head_dim, mk.smem_bytes(cfg.d_model, cfg.q_dim, cfg.ffn_dim))]
        assert "['h_int8']" in mega.why_not(_FakeCache(["fp16", "h_int8"]))
        monkeypatch.setattr(ops, "mega_why_not", lambda hd, smem: "no cooperative launch")
        assert mega.why_not(_FakeCache(["int8"])) == "no cooperative launch"
        monkeypatch.setattr(ops, "mega_why_not", lambda hd, smem: None)
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "0")
        assert mega.why_not(_FakeCache(["fp16"])) == "TINYLOOP_MEGAKERNEL=0"
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "1")
        with pytest.warns(RuntimeWarning, match="megakernel launch failed"):
            mega.disable(RuntimeError("cooperative launch too large"))
        assert "cooperative launch too large" in mega.why_not(_FakeCache(["fp16"]))
        assert mega.stats()["failed"] == mega.failed
    finally:
        tinyloop.free_model(m)


def test_numpy_backend_decodes_as_before(tiny_model_path, monkeypatch):
    # no megakernel on NumPy: the graph / eager path is untouched, at every temperature
    monkeypatch.delenv("TINYLOOP_MEGAKERNEL", raising=False)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        a = m.generate([1, 2, 3], max_new_tokens=5, temperature=0.8, seed=3).token_ids
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL", "0")
        b = m.generate([1, 2, 3], max_new_tokens=5, temperature=0.8, seed=3).token_ids
        assert a == b
        assert m.graph_stats()["megakernel"]["launches"] == 0
    finally:
        tinyloop.free_model(m)
