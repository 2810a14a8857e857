"""The captured decode step on the GPU (tinyloop/graphs.py, CudaOps' graph API and step
kernels): graphs on vs off give identical tokens, the capture allocates nothing, a failure
during capture leaves the stream usable, the ``graphs`` memory goes with the model, and the
step kernels (position read from the device) equal the host-position kernels bit for bit.
The same step-state logic runs on the CPU through a recording fake in tests/model/test_graphs.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tinyloop
from tinyloop.backends import cuda_available
from tinyloop.config import KV_MODES

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.base import STEP_POS, STEP_WORDS  # noqa: E402
from tinyloop.backends.cuda import CudaOps  # noqa: E402
from tinyloop.backends.cuda.sampling import _SAMPLE_THREADS as SMP  # noqa: E402

from ..conftest import record_decode_steps  # noqa: E402
from ..kernels.test_kernels_gpu import HEADS, f16, gather, kv_pair  # noqa: E402
from .test_graphs import capture_events, check_fault_inside_a_replay  # noqa: E402

RUNS = [(1, 30), (4, 30), (2, 600), (4, 600)]     # (depth, prompt length), in this order


def expected_graph_counts(depths, results) -> tuple[int, int]:
    """(captures, replays) that requests at ``depths`` with ``results`` (GenerationResult,
    in order) must give: a request's decode steps are its new tokens after the first, plus
    the step that sampled EOS; under each key the first step runs eagerly, the second
    captures, and every step from the second on is a replay."""
    seen: dict = {}
    for d, r in zip(depths, results):
        seen[d] = seen.get(d, 0) + len(r.token_ids) - 1 + (r.finish_reason == "eos")
    return sum(n >= 2 for n in seen.values()), sum(max(0, n - 1) for n in seen.values())


def _load(path, mode, max_seq_len=640):
    if mode not in CudaOps.kv_modes:
        pytest.skip(f"kv mode {mode} has no CUDA kernels on this branch yet")
    return tinyloop.load_model(path, max_seq_len=max_seq_len, backend="cuda", kv_mode=mode)


@pytest.mark.parametrize("mode", KV_MODES)
def test_graphs_on_and_off_give_identical_tokens(real_model_path, real_text_ids, monkeypatch,
                                                 mode):
    """Real SmolLM2, depth 1 -> 4 -> 2 -> 4, prompts of 30 then 600 tokens: identical greedy
    tokens with graphs on and off. A capturable mode captures one graph per depth (three) and
    replays depth 4's for the second request; a mode the step kernels do not cover runs
    eagerly both times."""
    m = _load(real_model_path, mode)
    try:
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = [m.generate(real_text_ids[:n], max_new_tokens=32, depth=d).token_ids
                for d, n in RUNS]
        assert m.graph_stats()["captures"] == 0
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        res = [m.generate(real_text_ids[:n], max_new_tokens=32, depth=d) for d, n in RUNS]
        assert [r.token_ids for r in res] == want
        st = m.graph_stats()
        if mode in m.ops.graph_kv_modes:
            caps, replays = expected_graph_counts([d for d, _ in RUNS], res)
            assert caps == 3 and (st["captures"], st["graphs"], st["replays"]) == (3, 3, replays)
            assert m.pool.by_tag()["graphs"] == st["bytes"] > 0
        else:
            assert st["captures"] == 0
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_pdl_capture_gives_bit_identical_logits(real_model_path, real_text_ids, monkeypatch,
                                                mode):
    """Programmatic dependent launch in the capture (KernelChoice.pdl, launch.PDL_KERNELS): the
    same requests (depth 1 -> 4 -> 2 -> 4, prompts of 30 and 600 tokens) give, step by step,
    the same ids and bit-identical logit rows with PDL on and off (a kernel reading its
    predecessor's output before it completed would show here), each setting under its own
    graph key."""
    m = _load(real_model_path, mode)
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    seen = record_decode_steps(m, monkeypatch)
    try:
        got, constants = {}, set()
        for pdl in ("0", "1"):
            monkeypatch.setattr(m.ops, "kernels",
                                dataclasses.replace(m.ops.kernels, pdl=pdl == "1"))
            constants.add(m.ops.graph_constants())
            seen.clear()
            for d, n in RUNS:
                m.generate(real_text_ids[:n], max_new_tokens=24, depth=d)
            got[pdl] = [(nxt, row) for nxt, row, _ in seen]
        assert len(got["1"]) == len(got["0"]) > 40
        for (a, ra), (b, rb) in zip(got["0"], got["1"]):
            assert a == b
            np.testing.assert_array_equal(ra, rb)
        keys = m.graph_stats()["keys"]
        if m.ops.pdl_capture is False:
            pytest.skip("PDL needs compute capability 9.0 (the PDL=1 run captured plainly)")
        # the graph key's launch constants (graphs.DecodeGraphs.key: index 5) differ only in
        # pdl_capture; the three depths run under each
        assert len(constants) == 2 and {k[5] for k in keys} == constants and len(keys) == 6
    finally:
        tinyloop.free_model(m)


def test_a_driver_refusing_pdl_turns_it_off_with_a_warning(monkeypatch):
    """The first ``pdl_capture`` probes one PDL launch outside any capture; a refusal (here a
    launcher whose launch raises, as an old driver's would) warns once and leaves captures
    with plain launches, instead of failing every capture."""
    from tinyloop.backends.cuda import launch

    def refuse(self, *args, **kwargs):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE (simulated)")
    ok = CudaOps()
    if ok._cc < 90:
        pytest.skip("PDL needs compute capability 9.0")
    assert ok.pdl_capture is True and ok._pdl.launcher not in (None, False)
    monkeypatch.setattr(launch.PdlLauncher, "launch", refuse)
    ops = CudaOps()
    with pytest.warns(RuntimeWarning, match="programmatic dependent launch is unavailable"):
        assert ops.pdl_capture is False
    assert ops.pdl_capture is False and ops._pdl.launcher is False     # no second probe
    ops.graph_begin()                        # a capture opens and closes with plain launches
    assert ops._pdl.on is False
    ops.graph_abort()


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_sampled_steps_pick_by_the_reference_rule(real_model_path, real_text_ids, monkeypatch,
                                                  mode):
    """temperature > 0 inside the captured step (sample.cu's sample_step, parameters read at
    run time from pinned memory): depth 1 -> 4 -> 2 -> 4, prompts of 30 and 600 tokens, four
    sampling settings; every in-graph pick equals numpy_ops.sample_from_logits of that step's
    own logit row (read back after the step) with the request's k-th u from
    numpy.random.default_rng(seed), and one graph per (depth, sampled) key serves every
    setting. (Tokens are not compared with the eager path: its attention split count follows
    the context, the graph's the table, so the logits differ in the last bits and a sampled
    pick near a cumulative-mass boundary may differ; greedy tokens are compared above.)"""
    from tinyloop.backends.numpy_ops import sample_from_logits
    settings = [dict(temperature=0.9, top_k=0, top_p=1.0, seed=1),
                dict(temperature=0.7, top_k=40, top_p=0.9, seed=2),
                dict(temperature=1.3, top_k=5, top_p=0.5, seed=3),
                dict(temperature=0.9, top_k=0, top_p=1.0, seed=4)]
    m = _load(real_model_path, mode)
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    seen = record_decode_steps(m, monkeypatch)
    try:
        res = []
        for kw, (d, n) in zip(settings, RUNS):
            seen.clear()
            r = m.generate(real_text_ids[:n], max_new_tokens=24, depth=d, **kw)
            res.append(r)
            us = np.random.default_rng(kw["seed"]).random(len(r.token_ids) + 1)
            steps = len(r.token_ids) - 1 + (r.finish_reason == "eos")
            assert len(seen) == steps > 0
            for k, (nxt, row, u) in enumerate(seen):
                assert u == us[k + 1]               # draw 0 sampled the prefill's token
                want = sample_from_logits(row, kw["temperature"], kw["top_k"], kw["top_p"], u)
                assert nxt == want, (kw, d, n, k)
        caps, replays = expected_graph_counts([d for d, _ in RUNS], res)
        st = m.graph_stats()
        assert (st["captures"], st["replays"]) == (caps, replays) and caps == 3
        assert all(k[-1] is True for k in st["keys"])
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("sampler", ["fast", "reference"])
def test_sampled_steps_with_every_option_pick_by_the_rule(real_model_path, real_text_ids,
                                                          monkeypatch, sampler):
    """top-k, top-p, min-p and the repetition penalty inside the captured step (the window
    ring kept on the device): every in-graph pick equals numpy_ops.sample_from_logits of
    that step's own logit row with the request's u and its window of the last repeat_last_n
    tokens; one graph per (penalised, sampled) key serves every setting."""
    from tinyloop.backends.cuda import KernelChoice
    from tinyloop.backends.numpy_ops import sample_from_logits
    settings = [dict(temperature=0.8, top_p=0.9, seed=1),
                dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=2),
                dict(temperature=1.0, top_k=40, min_p=0.1, seed=3),
                dict(temperature=0.7, top_k=50, top_p=0.95, repetition_penalty=1.2,
                     repeat_last_n=8, seed=4),
                dict(temperature=0.0, repetition_penalty=1.5, repeat_last_n=16, seed=5)]
    m = tinyloop.load_model(real_model_path, max_seq_len=640, backend="cuda",
                            kernels=KernelChoice(sampler=sampler))
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    seen = record_decode_steps(m, monkeypatch, filters=True)
    try:
        for kw in settings:
            seen.clear()
            r = m.generate(real_text_ids[:30], max_new_tokens=24, **kw)
            steps = len(r.token_ids) - 1 + (r.finish_reason == "eos")
            assert len(seen) == steps > 0
            everything = list(real_text_ids[:30]) + r.token_ids
            last_n = kw.get("repeat_last_n", 64)
            for k, (nxt, row, u, min_p, pen, recent) in enumerate(seen):
                pos = 30 + k
                if kw.get("repetition_penalty", 1.0) != 1.0:
                    assert recent == everything[max(0, pos + 1 - last_n):pos + 1]
                want = sample_from_logits(row, kw["temperature"], kw.get("top_k", 0),
                                          kw.get("top_p", 1.0), u, min_p, pen, recent)
                assert nxt == want, (kw, k)
        st = m.graph_stats()
        assert sorted((k[-2], k[-1]) for k in st["keys"]) == [(False, True), (True, True)]
    finally:
        tinyloop.free_model(m)


def test_penalised_greedy_graphs_on_and_off_give_identical_tokens(real_model_path,
                                                                  real_text_ids, monkeypatch):
    """Greedy decoding with the repetition penalty: the captured step (penalty kernel, ring
    on the device, argmax of the penalised row) gives the eager path's tokens."""
    m = _load(real_model_path, "fp16")
    try:
        kw = dict(max_new_tokens=32, repetition_penalty=1.4, repeat_last_n=24)
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = [m.generate(real_text_ids[:n], depth=d, **kw).token_ids for d, n in RUNS]
        plain = m.generate(real_text_ids[:30], max_new_tokens=32, depth=1).token_ids
        assert want[0] != plain                           # the penalty changes the tokens
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        assert [m.generate(real_text_ids[:n], depth=d, **kw).token_ids
                for d, n in RUNS] == want
        assert m.graph_stats()["captures"] == 3
    finally:
        tinyloop.free_model(m)


def test_sample_step_kernel_equals_the_sampler(ops, rng):
    """head_sample_step's kernel (parameters from pinned memory, id into the step state)
    picks sample_from_logits's token, as ops.sample does, for a range of settings."""
    from tinyloop.backends.numpy_ops import sample_from_logits
    vocab = 49152
    step = cupy.zeros(STEP_WORDS, cupy.int32)
    for trial in range(24):
        logits = (rng.standard_normal(vocab) * rng.choice([0.5, 3.0, 10.0])).astype(np.float32)
        temperature = float(rng.choice([0.3, 0.7, 1.0, 2.0]))
        top_k = int(rng.choice([0, 1, 5, 40, vocab]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 1e-6]))
        u = float(rng.random()) if trial else 0.0
        dev = cupy.asarray(logits)
        ops.set_step_sampling(temperature, top_k, top_p, u)
        ops._ensure_wq(vocab)
        ops._fn("sample", "sample_step")((1,), (SMP,), (dev.data.ptr, vocab, ops._smp_ptr,
                                                         ops._wq_ptr, step.data.ptr))
        got = cupy.asnumpy(step)
        want = sample_from_logits(logits, temperature, top_k, top_p, u)
        assert (int(got[0]), int(got[1])) == (want, 0), (trial, temperature, top_k, top_p, u)
        assert ops.sample(dev, temperature, top_k, top_p, u) == want


def test_mixed_modes_and_the_adapter_model(small_path, monkeypatch):
    """fp16 prelude/coda with an int8 recurrent block, on both synthetic models (one with the
    injection adapter, whose prelude-output copy is captured too)."""
    mode = {"prelude": "fp16", "recurrent": "int8", "coda": "fp16"}
    m = tinyloop.load_model(small_path, max_seq_len=120, backend="cuda", kv_mode=mode)
    try:
        ids = np.random.default_rng(5).integers(0, 512, 70)
        res = []
        for depth in (1, 3):
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
            want = m.generate(list(ids), max_new_tokens=24, depth=depth).token_ids
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
            res.append(m.generate(list(ids), max_new_tokens=24, depth=depth))
            assert res[-1].token_ids == want
        st = m.graph_stats()
        assert (st["captures"], st["replays"]) == expected_graph_counts((1, 3), res)
    finally:
        tinyloop.free_model(m)


def test_capture_makes_no_pool_allocation(real_model_path, real_text_ids, monkeypatch):
    """The pool's event log holds no alloc / segment_alloc between capture begin and end."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _load(real_model_path, "fp16")
    try:
        between = capture_events(
            m, lambda: m.generate(real_text_ids[:40], max_new_tokens=8, depth=2))
        assert not [e for e in between if e.action in ("alloc", "segment_alloc")], between
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("how", ["python", "cuda"])
def test_a_failure_during_capture_leaves_the_stream_usable(real_model_path, real_text_ids,
                                                           monkeypatch, how):
    """A Python exception in the middle of the captured launches, or a CUDA error that
    invalidates the capture (a synchronous copy to the host while capturing): the error
    reaches the caller, the capture is ended, the default stream is current again, and the
    next request captures and replays with the eager tokens."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _load(real_model_path, "fp16")
    ops, real = m.ops, m.decode_step_ops
    ids = real_text_ids[:50]

    def broken(step, x, depth, slots, host_out, sampled=False):
        if ops._capturing is not None:
            ops.embed(m._embed, step[:1], x)          # some launches already captured
            if how == "python":
                raise RuntimeError("injected failure during capture")
            cupy.asnumpy(step)                        # not permitted while capturing
        real(step, x, depth, slots, host_out, sampled)
    m.decode_step_ops = broken
    try:
        with pytest.raises(Exception) as ei:
            m.generate(ids, max_new_tokens=8, depth=2)
        if how == "python":
            assert "injected failure" in str(ei.value)
        assert ops._capturing is None
        assert not ops._capture_stream.is_capturing()
        assert cupy.cuda.get_current_stream() == cupy.cuda.Stream.null
        assert m.graph_stats()["graphs"] == 0
        del m.decode_step_ops
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = m.generate(ids, max_new_tokens=8, depth=2).token_ids
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        assert m.generate(ids, max_new_tokens=8, depth=2).token_ids == want
        assert m.graph_stats()["graphs"] == 1
    finally:
        tinyloop.free_model(m)


def test_graphs_memory_is_tagged_and_released_with_the_model(real_model_path, real_text_ids,
                                                             monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _load(real_model_path, "int8")
    pool = m.pool
    try:
        for depth in (1, 3):
            m.generate(real_text_ids[:20], max_new_tokens=6, depth=depth)
        st = m.graph_stats()
        assert st["graphs"] == 2 and pool.by_tag()["graphs"] == st["bytes"] > 0
    finally:
        tinyloop.free_model(m)
    assert pool.by_tag().get("graphs", 0) == 0


def test_a_fault_inside_a_replay_names_step_and_position(small_path, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = tinyloop.load_model(small_path, max_seq_len=64, backend="cuda")
    try:
        check_fault_inside_a_replay(m, [5, 6, 7, 8, 9])
    finally:
        tinyloop.free_model(m)


# --- the step kernels against the host-position kernels -----------------------------------------
@pytest.mark.parametrize("mode", ["fp16", "int8"])
@pytest.mark.parametrize("h,hkv,hd", HEADS)
@pytest.mark.parametrize("pos", [0, 31, 32, 75])
def test_step_kernels_equal_host_position_kernels(ops, ref, rng, mode, h, hkv, hd, pos):
    """kv_write_step / kv_attention_step with the position in the step state write the same
    page bytes and attend to the same output, bit for bit, as kv_write / kv_attention with it
    as an argument (those are checked against NumPy in test_kernels.py)."""
    cap = pos + 5
    _, a = kv_pair(ops, ref, mode, h, hkv, hd, cap, 32)
    _, b = kv_pair(ops, ref, mode, h, hkv, hd, cap, 32)
    hist = cupy.asarray(f16(rng, pos, (h + 2 * hkv) * hd)[0]) if pos else None
    if hist is not None:                     # the same earlier positions in both caches
        for c in (a, b):
            ops.kv_write(hist.copy(), None, 0, 1e4, h, hkv, hd, c.slot(0))
    qh, _ = f16(rng, 1, (h + 2 * hkv) * hd)
    q1, q2 = cupy.asarray(qh), cupy.asarray(qh)
    step = cupy.zeros(STEP_WORDS, cupy.int32)
    step[STEP_POS] = pos
    ops.kv_write(q1, None, pos, 1e4, h, hkv, hd, a.slot(0))
    ops.kv_write_step(q2, None, step, 1e4, h, hkv, hd, b.slot(0))
    np.testing.assert_array_equal(cupy.asnumpy(q1), cupy.asnumpy(q2))
    ga, gb = gather(a.slot(0), cap, True), gather(b.slot(0), cap, True)
    for name in ga:
        np.testing.assert_array_equal(ga[name], gb[name], err_msg=name)
    o1 = cupy.empty((1, h * hd), cupy.float16)
    o2 = cupy.empty((1, h * hd), cupy.float16)
    ops.kv_attention(q1, a.slot(0), pos, h, hkv, hd, o1)
    ops.kv_attention_step(q2, b.slot(0), step, h, hkv, hd, o2)
    np.testing.assert_array_equal(cupy.asnumpy(o1), cupy.asnumpy(o2))
    host = ops.step_host_buffer()
    step[0], step[1] = 1234, 0
    ops.step_advance(step, host)
    cupy.cuda.get_current_stream().synchronize()
    assert int(step[STEP_POS]) == pos + 1 and (int(host[0]), int(host[1])) == (1234, 0)
    a.release()
    b.release()
