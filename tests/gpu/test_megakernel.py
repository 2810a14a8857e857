"""The persistent decode megakernel on the GPU (cuda_src/decode_mega.cu, tinyloop/megakernel.py):
megakernel vs captured graph vs eager give identical tokens (depth 1 -> 4 -> 2 -> 4, prompts
30 -> 600, KV modes fp16 / int8 / mixed), the logit row of a step equals the graph path's bit
for bit and the NumPy reference's within the usual KL / top-1 bounds, page boundaries and
ctx = 1, temperature > 0 through the device sampler, no pool allocation between steps, the
memory under tag ``graphs`` and a failed launch that falls back. The host logic is checked on
the CPU in tests/test_megakernel.py.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import tinyloop
from tinyloop.backends import cuda_available
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.graphs import decode_graphs, decode_step
from tinyloop.kv import DEFAULT_PAGE_SIZE

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

from .conftest import record_decode_steps  # noqa: E402
from .test_cuda_model import (SMALL, _kl_rows, _report, real_model_path,  # noqa: E402,F401
                              real_text_ids, small_path)

RUNS = [(1, 30), (4, 30), (2, 600), (4, 600)]     # (depth, prompt length), in this order
MIXED = {"prelude": "fp16", "recurrent": "int8", "coda": "fp16"}
MODES = ["fp16", "int8", MIXED]
# SmolLM2-135M's layer dims (d 576, 9 / 3 heads of 64, ffn 1536) on a small vocabulary
SMOL = dict(vocab_size=2048, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
            n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4, rope_theta=10000.0)
PATHS = {"mega": {"TINYLOOP_MEGAKERNEL": "1", "TINYLOOP_CUDA_GRAPHS": "1"},
         "graph": {"TINYLOOP_MEGAKERNEL": "0", "TINYLOOP_CUDA_GRAPHS": "1"},
         "eager": {"TINYLOOP_MEGAKERNEL": "0", "TINYLOOP_CUDA_GRAPHS": "0"}}


@pytest.fixture(scope="module", params=["none", "adapter"])
def smol_path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("mega") / f"smol_{request.param}.tlm"
    bits, group = (4, 32) if request.param == "none" else (8, 32)
    write_synthetic(p, synthetic_config(**{**SMOL, "injection": request.param}), seed=11,
                    bits=bits, group_size=group)
    return str(p)


def _use(monkeypatch, path: str) -> None:
    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)


def _runs(m, prompts, monkeypatch, path, **kw) -> list:
    _use(monkeypatch, path)
    return [m.generate(list(map(int, p)), depth=d, **kw).token_ids for d, p in prompts]


def _check_three_paths(m, prompts, monkeypatch, new_tokens=24) -> None:
    want = _runs(m, prompts, monkeypatch, "eager", max_new_tokens=new_tokens)
    st0 = m.graph_stats()
    assert st0["megakernel"]["launches"] == 0 and st0["replays"] == 0
    graph = _runs(m, prompts, monkeypatch, "graph", max_new_tokens=new_tokens)
    assert graph == want
    st1 = m.graph_stats()
    mega = _runs(m, prompts, monkeypatch, "mega", max_new_tokens=new_tokens)
    assert mega == want
    st2 = m.graph_stats()
    assert st2["megakernel"]["failed"] is None
    steps = sum(len(t) - 1 for t in mega)            # decode steps that sampled a kept token
    assert st2["megakernel"]["launches"] >= steps > 0
    assert st2["replays"] == st1["replays"]           # no graph ran in place of the megakernel
    assert m.pool.by_tag()["graphs"] == st2["bytes"] > 0
    _report("megakernel_tokens", model=os.path.basename(m.path), runs=len(prompts),
            launches=st2["megakernel"]["launches"], blocks=st2["megakernel"]["blocks"],
            blocks_per_sm_fit=st2["megakernel"]["blocks_per_sm_fit"])


@pytest.mark.parametrize("mode", MODES, ids=["fp16", "int8", "mixed"])
def test_synthetic_smol_three_paths_identical_tokens(smol_path, monkeypatch, mode):
    """SmolLM2-dims synthetic model (with and without the injection adapter): the same greedy
    tokens from the megakernel, the captured graph and eager, across depth 1 -> 4 -> 2 -> 4
    and prompts of 30 then 600 tokens (page boundaries crossed at every 32 positions)."""
    m = tinyloop.load_model(smol_path, max_seq_len=640, backend="cuda", kv_mode=mode)
    try:
        ids = np.random.default_rng(3).integers(0, SMOL["vocab_size"], 600)
        _check_three_paths(m, [(d, ids[:n]) for d, n in RUNS], monkeypatch)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("mode", ["fp16", MIXED], ids=["fp16", "mixed"])
def test_small_head_dim_32_three_paths_identical_tokens(small_path, monkeypatch, mode):
    """The other synthetic GPU model (head_dim 32, INT4 / INT8 weights, with and without the
    adapter): the megakernel's hd32 instance."""
    m = tinyloop.load_model(small_path, max_seq_len=256, backend="cuda", kv_mode=mode)
    try:
        ids = np.random.default_rng(5).integers(0, SMALL["vocab_size"], 70)
        _check_three_paths(m, [(1, ids[:30]), (3, ids), (2, ids[:45])], monkeypatch)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("mode", MODES, ids=["fp16", "int8", "mixed"])
def test_real_model_three_paths_identical_tokens(real_model_path, real_text_ids, monkeypatch,
                                                 mode):
    """Real SmolLM2 (TINYLOOP_TEST_MODEL or the default model; skipped when absent)."""
    m = tinyloop.load_model(real_model_path, max_seq_len=640, backend="cuda", kv_mode=mode)
    try:
        _check_three_paths(m, [(d, real_text_ids[:n]) for d, n in RUNS], monkeypatch,
                           new_tokens=32)
    finally:
        tinyloop.free_model(m)


def _step_logits(m, prompt, depth, monkeypatch, path) -> np.ndarray:
    """The logit row of the first decode step after ``prompt`` (generate's last step with
    max_new_tokens=2 is that decode step; the row stays in ``logit_row``)."""
    _use(monkeypatch, path)
    m.generate(list(map(int, prompt)), max_new_tokens=2, depth=depth)
    return m.ops.to_host(m.logit_row())[0].copy()


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_step_logits_bitwise_and_against_the_reference(smol_path, monkeypatch, mode):
    """One decode step's logit row: megakernel == captured graph bit for bit (the same device
    arithmetic, the same attention splits), the eager path's argmax, and the NumPy reference
    of the same sequence within the CUDA-vs-NumPy bounds of tests/gpu/test_cuda_model.py."""
    ids = np.random.default_rng(8).integers(0, SMOL["vocab_size"], 45)
    cu = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda", kv_mode=mode)
    ref = tinyloop.load_model(smol_path, max_seq_len=256, backend="numpy", kv_mode=mode)
    try:
        for depth in (1, 3):
            rows = {p: _step_logits(cu, ids, depth, monkeypatch, p) for p in PATHS}
            assert cu.graph_stats()["megakernel"]["launches"] > 0
            diff = float(np.abs(rows["mega"] - rows["graph"]).max())
            # eager picks its attention split count from the context length, the graph and
            # the megakernel from the table's capacity: close, not bit-identical
            ediff = float(np.abs(rows["mega"] - rows["eager"]).max())
            _report("megakernel_logits", mode=mode, depth=depth, max_abs_vs_graph=diff,
                    max_abs_vs_eager=ediff)
            assert np.array_equal(rows["mega"], rows["graph"]), diff
            assert int(rows["mega"].argmax()) == int(rows["eager"].argmax())
            _use(monkeypatch, "eager")
            first = cu.generate(list(map(int, ids)), max_new_tokens=1, depth=depth).token_ids
            want = ref.logits(np.append(ids, first).astype(np.int32), depth=depth)[-1]
            got = rows["mega"]
            kl = float(_kl_rows(want[None], got[None]).mean())
            assert np.isfinite(got).all() and int(got.argmax()) == int(want.argmax())
            assert kl < 5e-3, kl
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_page_boundaries_and_ctx_one(smol_path, monkeypatch, mode):
    """Decode steps across page boundaries (prompts of P-1, P, P+1 and 2P-1 tokens, six steps
    each) and a step at position 0 (context length 1, through graphs.decode_step on an empty
    cache) give the eager tokens."""
    m = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda", kv_mode=mode)
    P = DEFAULT_PAGE_SIZE
    try:
        ids = np.random.default_rng(2).integers(0, SMOL["vocab_size"], 2 * P)
        prompts = [(2, ids[:n]) for n in (P - 1, P, P + 1, 2 * P - 1)]
        want = _runs(m, prompts, monkeypatch, "eager", max_new_tokens=6)
        assert _runs(m, prompts, monkeypatch, "mega", max_new_tokens=6) == want
        for depth in (1, 4):
            tok = int(ids[0])
            _use(monkeypatch, "eager")
            cache = m.new_kv_cache(depth, 8)
            try:
                m.forward(np.array([tok], np.int32), 0, depth, cache)
                eager = m.head_sample(0, m.logit_row(), 0.0, 0, 1.0, 0.0)
            finally:
                cache.release()
            _use(monkeypatch, "mega")
            n0 = m.graph_stats()["megakernel"]["launches"]
            cache = m.new_kv_cache(depth, 8)
            try:
                with m.lock:
                    got = decode_step(m, cache, tok, 0, 0.0)
            finally:
                cache.release()
            assert m.graph_stats()["megakernel"]["launches"] == n0 + 1
            assert got == eager
    finally:
        tinyloop.free_model(m)


def test_sampling_through_the_megakernel(smol_path, monkeypatch):
    """temperature > 0: the kernel writes the logit row, the device sampler picks from it; each
    pick equals numpy_ops.sample_from_logits of that row with the request's k-th u (the
    eager path's logits differ in the last bits - its split count follows the context - so
    sampled tokens are not compared with it; greedy tokens are, above)."""
    from tinyloop.backends.numpy_ops import sample_from_logits
    m = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda")
    seen = record_decode_steps(m, monkeypatch)
    try:
        ids = list(map(int, np.random.default_rng(4).integers(0, SMOL["vocab_size"], 40)))
        for temperature, top_k, top_p in ((0.8, 0, 1.0), (1.2, 40, 0.9)):
            kw = dict(max_new_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=7, depth=2)
            _use(monkeypatch, "mega")
            n0 = m.graph_stats()["megakernel"]["launches"]
            seen.clear()
            got = m.generate(ids, **kw).token_ids
            assert m.graph_stats()["megakernel"]["launches"] - n0 >= len(got) - 1
            us = np.random.default_rng(7).random(len(got) + 1)
            assert len(seen) >= len(got) - 1 > 0
            for k, (nxt, row, u) in enumerate(seen):
                assert u == us[k + 1]
                assert nxt == sample_from_logits(row, temperature, top_k, top_p, u), k
    finally:
        tinyloop.free_model(m)


def test_steps_make_no_pool_allocation(smol_path, monkeypatch):
    """After the first megakernel step of a key (its program and the model's records and
    scratch), the pool's event log holds no alloc / segment_alloc between launches."""
    _use(monkeypatch, "mega")
    m = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda")
    mega, marks = decode_graphs(m).mega, []
    real = mega.launch

    def launch(*a, **k):
        marks.append(m.pool.events_dropped + len(m.pool.events()))
        real(*a, **k)
    mega.launch = launch
    try:
        m.generate([5, 6, 7, 8], max_new_tokens=12, depth=3)
        assert len(marks) >= 10
        dropped = m.pool.events_dropped
        assert marks[1] >= dropped
        between = m.pool.events()[marks[1] - dropped:marks[-1] - dropped]
        assert not [e for e in between if e.action in ("alloc", "segment_alloc")], between
    finally:
        del mega.launch
        tinyloop.free_model(m)


def test_memory_is_tagged_graphs_and_released_with_the_model(smol_path, monkeypatch):
    _use(monkeypatch, "mega")
    m = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda", kv_mode="int8")
    pool = m.pool
    try:
        for depth in (1, 3):
            m.generate([1, 2, 3], max_new_tokens=5, depth=depth)
        st = m.graph_stats()
        assert st["megakernel"]["launches"] > 0 and st["graphs"] == 0
        assert pool.by_tag()["graphs"] == st["bytes"] > 0
        fit = st["megakernel"]["blocks_per_sm_fit"]
        assert 1 <= fit and st["megakernel"]["blocks"] <= m.ops.sms * fit
    finally:
        tinyloop.free_model(m)
    assert pool.by_tag().get("graphs", 0) == 0


@pytest.mark.parametrize("per_sm", ["1", "0"])
def test_grid_setting(smol_path, monkeypatch, per_sm):
    """One block per SM, and as many as fit: the same tokens."""
    m = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda")
    try:
        want = _runs(m, [(2, [9, 8, 7, 6])], monkeypatch, "eager", max_new_tokens=10)
        monkeypatch.setenv("TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM", per_sm)
        assert _runs(m, [(2, [9, 8, 7, 6])], monkeypatch, "mega", max_new_tokens=10) == want
        st = m.graph_stats()["megakernel"]
        n = 1 if per_sm == "1" else st["blocks_per_sm_fit"]
        assert st["blocks"] == m.ops.sms * n
    finally:
        tinyloop.free_model(m)


def test_a_failed_launch_falls_back_to_the_graph(smol_path, monkeypatch):
    """A launch that raises (here: injected) turns the megakernel off for the model with one
    RuntimeWarning naming the error; that step and the next run as the captured graph with
    the same tokens."""
    m = tinyloop.load_model(smol_path, max_seq_len=256, backend="cuda")
    try:
        want = _runs(m, [(2, [4, 5, 6])], monkeypatch, "graph", max_new_tokens=10)
        r0 = m.graph_stats()["replays"]

        def broken(*a, **k):
            raise RuntimeError("injected cooperative launch failure")
        monkeypatch.setattr(m.ops, "mega_launch", broken)
        _use(monkeypatch, "mega")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = m.generate([4, 5, 6], max_new_tokens=10, depth=2).token_ids
            again = m.generate([4, 5, 6], max_new_tokens=10, depth=2).token_ids
        assert got == again == want[0]
        msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
        assert len([s for s in msgs if "injected cooperative launch failure" in s]) == 1
        st = m.graph_stats()
        assert "injected" in st["megakernel"]["failed"] and st["replays"] > r0
    finally:
        tinyloop.free_model(m)
