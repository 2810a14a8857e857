"""The captured decode batch (graphs.DecodeGraphs.run_batch, Model.decode_batch) on the CPU,
through the recording fake of tests/model/test_graphs.py: a replay reads the token ids and
the step's index uploaded before it (as the CUDA batch kernels read them on the device), so
graphs on and off give the same ids and logits bit for bit while requests join, leave and
trade places between steps of one batch size. The GPU counterpart is
tests/model/test_decode_batch_gpu.py::test_batch_graphs_on_and_off_agree."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.graphs import decode_graphs

from ..conftest import TINY
from .test_decode_batch import ARCH
from .test_graphs import RecordingOps

# the requests of each step, by index: B = 3 three times (eager, capture, replay), then B = 3
# over other requests (a replay over other caches and positions), B = 5, B = 2, B = 3 again
SCHEDULE = [(0, 1, 2), (0, 1, 2), (0, 1, 2), (3, 1, 4), (0, 1, 2, 3, 4), (4, 0), (2, 4, 3),
            (1, 2, 0)]
LENGTHS = (7, 12, 3, 20, 9)


@pytest.fixture(scope="module")
def arch_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "arch.tlm"
    write_synthetic(path, synthetic_config(**TINY, **ARCH), seed=5)
    return str(path)


def _run(model, depth, kv_mode, sampling_of, seed=0, split=False):
    """Decode SCHEDULE's steps over 5 prefilled requests; every step's picks (and the logits
    of the steps with no sampling) in order. ``split``: the sampled steps run as
    ``decode_batch_start``, host work, ``decode_batch_finish``; "prepared": and a sampled
    step's host half is made while the step before it runs (``decode_batch_prepare``), as
    the serving engine runs them."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, n) for n in LENGTHS]
    graphs = decode_graphs(model)
    caches = [model.new_kv_cache(depth, max(LENGTHS) + len(SCHEDULE) + 1, kv_mode=kv_mode)
              for _ in prompts]
    out = []
    try:
        for c, p in zip(caches, prompts):
            model.forward(np.asarray(p, np.int32), 0, depth, c)
        pos = list(LENGTHS)
        tokens = [int(p[-1]) for p in prompts]
        prepared = None
        for step, rows in enumerate(SCHEDULE):
            args = ([caches[i] for i in rows], [tokens[i] for i in rows], [pos[i] for i in rows])
            nxt = SCHEDULE[step + 1] if step + 1 < len(SCHEDULE) else None
            if split == "prepared" and step % 3 != 2:
                pending = model.decode_batch_start(*args, depth, graphs=graphs,
                                                   sampling=[sampling_of(step, i) for i in rows],
                                                   prepared=prepared)
                prepared = None
                if nxt is not None and (step + 1) % 3 != 2:   # the next step, sampled
                    prepared = model.decode_batch_prepare(
                        [caches[i] for i in nxt], [pos[i] + (i in rows) for i in nxt],
                        depth, graphs=graphs)
                picks = model.decode_batch_finish(pending)
                out.append(picks)
            elif step % 3 == 2:         # every third step returns the logits
                logits = model.decode_batch(*args, depth, graphs=graphs)
                out.append(logits)
                picks = [int(np.argmax(r)) for r in logits]
            elif split:
                pending = model.decode_batch_start(*args, depth, graphs=graphs,
                                                   sampling=[sampling_of(step, i) for i in rows])
                np.sort(rng.random(1 << 16))        # host work while the step runs
                picks = model.decode_batch_finish(pending)
                out.append(picks)
            else:
                picks = model.decode_batch(*args, depth, graphs=graphs,
                                           sampling=[sampling_of(step, i) for i in rows])
                out.append(picks)
            for i, t in zip(rows, picks):
                tokens[i], pos[i] = t, pos[i] + 1
    finally:
        for c in caches:
            c.release()
    return out


def _greedy(step, i):
    return (0.0, 0, 1.0, 0.0)


def _mixed(step, i):
    """Greedy rows and seeded sampled rows (one with top-k, min-p and a repetition penalty)."""
    u = float(np.random.default_rng(100 * step + i).random())
    if i % 3 == 0:
        return (0.0, 0, 1.0, 0.0)
    if i % 3 == 1:
        return (0.8, 0, 0.9, u)
    return (0.7, 7, 1.0, u, 0.05, 1.3, [1, 2, 3, 5])


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, np.ndarray):
            np.testing.assert_array_equal(g, w)
        else:
            assert g == w


@pytest.mark.parametrize("kv_mode", ["fp16", "int8"])
@pytest.mark.parametrize("sampling_of", [_greedy, _mixed], ids=["greedy", "mixed"])
def test_batch_graphs_match_eager(arch_path, monkeypatch, kv_mode, sampling_of):
    """Graphs off, then on: identical picks and logits at depths 1 and 3 of a Huginn-like
    stack (seeded state read per row, a sliding-window layer), the captured batches padded
    to their bucket with copies of their first row (which write that row's own K/V values
    again); B = 3 is captured once and replayed for other requests."""
    m = RecordingOps().attach(tinyloop.load_model(arch_path, max_seq_len=64, backend="numpy"))
    try:
        for depth in (1, 3):
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
            launched = m.ops.launched
            want = _run(m, depth, kv_mode, sampling_of)
            before = m.graph_stats()
            assert m.ops.launched == launched            # graphs off: nothing replayed
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
            got = _run(m, depth, kv_mode, sampling_of)
            _same(got, want)
            _same(_run(m, depth, kv_mode, sampling_of, split=True), want)
            _same(_run(m, depth, kv_mode, sampling_of, split="prepared"), want)
            st = m.graph_stats()
            # B = 3 runs padded to 4 rows (eager, capture, then replays), 5 to 8, 2 as is
            batch_keys = [k for k in st["keys"] if k[0] == "batch" and k[2] == depth]
            assert {k[1] for k in batch_keys} == {2, 4, 8}
            assert st["captures"] - before["captures"] >= 1
            assert st["replays"] - before["replays"] >= 4
    finally:
        tinyloop.free_model(m)


def test_a_prepared_batch_is_for_its_own_caches_and_positions(arch_path, monkeypatch):
    """decode_batch_start refuses a PreparedBatch for other caches, positions or depth, or
    without sampling; decode_batch_prepare returns None where the batch does not run as a
    graph (graphs off)."""
    from tinyloop.errors import ConfigError
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = RecordingOps().attach(tinyloop.load_model(arch_path, max_seq_len=64, backend="numpy"))
    caches = [m.new_kv_cache(1, 16) for _ in range(3)]
    try:
        graphs = decode_graphs(m)
        for c in caches:
            m.forward(np.array([3, 4], np.int32), 0, 1, c)
        p = m.decode_batch_prepare(caches[:2], [2, 2], 1, graphs=graphs)
        greedy = [(0.0, 0, 1.0, 0.0)] * 2
        for bad in (dict(caches=caches[1:], positions=[2, 2]),
                    dict(caches=caches[:2], positions=[2, 3]),
                    dict(caches=caches[:2], positions=[2, 2], depth=2),
                    dict(caches=caches[:2], positions=[2, 2], sampling=None)):
            kw = dict(tokens=[5, 6], depth=1, sampling=greedy, graphs=graphs, prepared=p)
            kw.update(bad)
            with pytest.raises(ConfigError, match="prepared"):
                m.decode_batch_start(**kw)
        got = m.decode_batch_finish(m.decode_batch_start(caches[:2], [5, 6], [2, 2], 1,
                                                         sampling=greedy, graphs=graphs,
                                                         prepared=p))
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        assert m.decode_batch_prepare(caches[:2], [3, 3], 1, graphs=graphs) is None
        for c in caches[:2]:       # the same step again, eagerly, on fresh caches
            c.release()
        again = [m.new_kv_cache(1, 16) for _ in range(2)]
        caches[:2] = again
        for c in again:
            m.forward(np.array([3, 4], np.int32), 0, 1, c)
        assert m.decode_batch(again, [5, 6], [2, 2], 1, sampling=greedy) == got
    finally:
        for c in caches:
            c.release()
        tinyloop.free_model(m)


def test_batch_replay_reads_the_uploaded_inputs(arch_path, monkeypatch):
    """A planted fault: token ids not refreshed after a batch size's first step (its first
    upload kept) give other picks than eager, so the agreement above rests on the upload
    before each replay."""
    m = RecordingOps().attach(tinyloop.load_model(arch_path, max_seq_len=64, backend="numpy"))
    try:
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = _run(m, 1, "fp16", _greedy)
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        real, first = m._launch_prepared, {}

        def stale(prepared, ids, sampling):
            return real(prepared, first.setdefault(len(prepared.caches), list(ids)), sampling)
        m._launch_prepared = stale
        got = _run(m, 1, "fp16", _greedy)
        assert got[1] != want[1]
    finally:
        tinyloop.free_model(m)


def test_batch_graphs_release_with_the_model(arch_path, monkeypatch):
    """The batch logits block and every batch graph are tag ``graphs`` and go at free; a
    reserve sizes the block once, so later batches of at most that size allocate nothing."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = RecordingOps().attach(tinyloop.load_model(arch_path, max_seq_len=64, backend="numpy"))
    ops = m.ops
    try:
        m.reserve_decode_batch(5, decode_graphs(m))
        held = m.pool.by_tag().get("graphs", 0)
        assert held >= 5 * m.config.vocab_size * 4
        allocs = m.pool.stats().num_allocs
        _run(m, 1, "fp16", _greedy)
        # the run's allocations are its caches' pages and tables, none for the batch step
        assert m.pool.by_tag().get("graphs", 0) == held
        assert m.pool.stats().num_allocs > allocs
    finally:
        tinyloop.free_model(m)
    assert all(g.freed for g in ops.graphs)


def test_sample_rows_refuses_a_row_outside_the_batch(arch_path):
    """Ops.sample_rows names a bad entry (a row index outside the logits, too few fields)
    before it draws any row."""
    from tinyloop.errors import ConfigError
    m = tinyloop.load_model(arch_path, max_seq_len=64, backend="numpy")
    try:
        lg = np.zeros((3, m.config.vocab_size), np.float32)
        assert m.ops.sample_rows(lg, [(2, 0.0, 0, 1.0, 0.0)]) == [0]
        for bad in ([(3, 0.0, 0, 1.0, 0.0)], [(-1, 0.0, 0, 1.0, 0.0)], [(0, 0.0, 0)]):
            with pytest.raises(ConfigError, match="sample_rows"):
                m.ops.sample_rows(lg, bad)
    finally:
        tinyloop.free_model(m)


def test_batch_buckets():
    """1, 2, then multiples of 4, never past the scratch rows."""
    from tinyloop.graphs import batch_bucket
    assert [batch_bucket(n, 64) for n in range(1, 14)] == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12,
                                                           12, 12, 16]
    assert batch_bucket(31, 30) == 30 and batch_bucket(64, 64) == 64


@pytest.mark.parametrize("bad", [np.zeros(4, np.int64), np.zeros(3, np.int32)])
def test_copy_host_inputs_refuses_another_dtype_or_size(bad):
    """Ops.copy_host_inputs copies bytes as they are: a host array of another dtype or size
    than the device array is refused by name, not cast or cut."""
    from tinyloop.backends.numpy_ops import NumpyOps
    from tinyloop.errors import ConfigError
    out = np.full(4, 7, np.int32)
    with pytest.raises(ConfigError, match="copy_host_inputs"):
        NumpyOps().copy_host_inputs(bad, out)
    assert (out == 7).all()
    NumpyOps().copy_host_inputs(np.arange(4, dtype=np.int32), out)
    assert out.tolist() == [0, 1, 2, 3]
