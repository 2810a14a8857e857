"""The captured decode step (tinyloop/graphs.py) on the CPU, through a recording fake.

``RecordingOps`` is the NumPy reference with a graph API: between ``graph_begin`` and
``graph_end`` every op call is recorded instead of run (and a host transfer, a
synchronisation or an allocation through the ops fails, as it cannot happen inside a CUDA
capture); ``graph_launch`` replays the recorded calls in order. Replaying it for every step
checks the step-state logic itself: who advances the position, that the id is read from the
state, the keys, rebinding to a new request, eviction and release. The same checks run on the
GPU with CuPy's stream capture in tests/model/test_cuda_graphs.py.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import tinyloop
from tinyloop import graphs as graphmod
from tinyloop.backends.base import STEP_ID, STEP_POS
from tinyloop.backends.numpy_ops import NumpyOps
from tinyloop.config import KV_MODES
from tinyloop.errors import ConfigError, GraphCaptureError, NonFiniteLogitsError
from tinyloop.kv.cache import BatchSlot

from ..conftest import TINY

# Ops a capture may not run (a CUDA capture forbids synchronous transfers and waits; the pool
# must not allocate): the fake fails loudly if the step calls one while recording.
_FORBIDDEN = {"to_host", "from_host", "synchronize", "empty", "upload_array", "upload_weight",
              "zero", "step_host_buffer", "make_fp16_cache", "step_pos"}


class FakeGraph:
    def __init__(self, calls):
        self.calls = calls
        self.freed = False


class RecordingOps(NumpyOps):
    """NumpyOps whose op calls are recorded while a capture is open (see the module doc)."""

    graph_kv_modes = KV_MODES
    graph_sampling = True

    def __init__(self):
        super().__init__()
        self._rec = None
        self.launched = 0
        self.aborted = 0
        self.graphs: list = []
        self._slots_at: dict = {}      # block-table address -> SlotKV (attach)

    def attach(self, model):
        """Make this the ``model``'s ops, and register every KV cache the model makes from
        now on by its block tables' addresses, so a replayed decode batch finds each row's
        slot through the step's index as the CUDA kernels do (``_live``). Returns the model."""
        model._ops = self
        make = model.new_kv_cache

        def new_kv_cache(*a, **k):
            c = make(*a, **k)
            for s, addr in enumerate(c.table_addresses()):
                self._slots_at[int(addr)] = c.kv_of(s)
            return c
        model.new_kv_cache = new_kv_cache
        return model

    def _live(self, rows):
        """A decode batch's rows as the step's index holds them when the op runs: a CUDA batch
        kernel reads every row's position and block table from the index, so a replay serves
        the rows uploaded before it, not those of the capture."""
        if rows.positions_dev is None:
            return rows
        slots = [self._slots_at[int(a)] for a in rows.tables_dev]
        return BatchSlot(slots, [int(p) for p in rows.positions_dev], rows.positions_dev,
                         rows.tables_dev)

    def kv_write_batch(self, qkv, h, rows, *a, **k):
        return NumpyOps.kv_write_batch(self, qkv, h, self._live(rows), *a, **k)

    def kv_attention_batch(self, qkv, rows, *a, **k):
        return NumpyOps.kv_attention_batch(self, qkv, self._live(rows), *a, **k)

    def init_state_rows(self, out, positions, std, seed, positions_dev=None):
        if positions_dev is not None:
            positions = [int(p) for p in positions_dev]
        return NumpyOps.init_state_rows(self, out, positions, std, seed, positions_dev)

    def __getattribute__(self, name):
        rec = object.__getattribute__(self, "_rec")
        attr = object.__getattribute__(self, name)
        if rec is None or name.startswith("_") or name.startswith("graph_") \
                or name == "decode_batch_scope" or not callable(attr):   # host state only
            return attr
        if name in _FORBIDDEN:
            raise AssertionError(f"ops.{name} called during a capture")

        def record(*a, **k):
            rec.append((attr, a, k))
        return record

    def graph_begin(self):
        assert self._rec is None, "capture inside a capture"
        self._rec = []

    def graph_end(self):
        rec, self._rec = self._rec, None
        g = FakeGraph(rec)
        self.graphs.append(g)
        return g

    def graph_abort(self):
        if self._rec is not None:
            self.aborted += 1
        self._rec = None

    def graph_launch(self, g):
        assert not g.freed and self._rec is None
        self.launched += 1
        for fn, a, k in g.calls:
            fn(*a, **k)

    def graph_free(self, g):
        assert not g.freed, "graph freed twice"
        g.freed = True

    def graph_constants(self):
        return ("fake",)


def _fake_model(path, max_seq_len=700, kv_mode="fp16"):
    m = tinyloop.load_model(path, max_seq_len=max_seq_len, backend="numpy", kv_mode=kv_mode)
    RecordingOps().attach(m)
    return m


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], n).tolist()


RUNS = [(1, 30), (4, 30), (2, 600), (4, 600)]     # (depth, prompt length), in this order


@pytest.mark.parametrize("mode", KV_MODES)
def test_graphs_on_and_off_give_identical_tokens(tiny_model_path, monkeypatch, mode):
    """Depth 1 -> 4 -> 2 -> 4, prompts of 30 then 600 tokens, each KV mode: the replayed step
    gives the eager path's tokens; depth 4's second request replays the graph captured for the
    first (rebound to the new request's pages), so three keys give three captures."""
    m = _fake_model(tiny_model_path, kv_mode=mode)
    try:
        want = []
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        for depth, n in RUNS:
            want.append(m.generate(_prompt(n, depth), max_new_tokens=6, depth=depth).token_ids)
        assert m.graph_stats()["captures"] == 0 and m.ops.launched == 0
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        res = [m.generate(_prompt(n, depth), max_new_tokens=6, depth=depth) for depth, n in RUNS]
        assert [r.token_ids for r in res] == want
        st = m.graph_stats()
        assert st["captures"] == 3 and st["graphs"] == 3
        assert sorted(k[0] for k in st["keys"]) == [1, 2, 4]
        # decode steps: every new token after the first, and the step that sampled EOS; the
        # first step under each of the 3 keys runs eagerly, every other one is a replay
        steps = sum(len(r.token_ids) - 1 + (r.finish_reason == "eos") for r in res)
        assert m.ops.launched == st["replays"] == steps - 3
    finally:
        tinyloop.free_model(m)


def test_latest_policy_steps_replay_the_eager_tokens(tiny_model_path, monkeypatch):
    """kv_iterations="latest": the captured step reads the slot map as the eager forward does
    (one slot per recurrent layer), so graphs on and off give the same tokens, and "all" and
    "latest" at one depth are two keys."""
    m = _fake_model(tiny_model_path, max_seq_len=64)
    try:
        p = _prompt(20, 7)
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = m.generate(p, max_new_tokens=8, depth=3, kv_iterations="latest").token_ids
        other = m.generate(p, max_new_tokens=8, depth=3).token_ids
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        assert m.generate(p, max_new_tokens=8, depth=3,
                          kv_iterations="latest").token_ids == want
        assert m.generate(p, max_new_tokens=8, depth=3).token_ids == other
        keys = m.graph_stats()["keys"]
        assert sorted(k[3] for k in keys) == ["all", "latest"] and m.ops.launched > 0
        with m.new_kv_cache(3, 40, kv_iterations="latest") as c:
            g = graphmod.decode_graphs(m)
            assert len(g.key(c)[1]) == c.n_slots == m.config.n_slots(1)
    finally:
        tinyloop.free_model(m)


SAMPLED = [dict(temperature=0.9, top_k=0, top_p=1.0, seed=1),
           dict(temperature=0.7, top_k=20, top_p=0.9, seed=2),
           dict(temperature=1.3, top_k=3, top_p=0.5, seed=3)]


@pytest.mark.parametrize("mode", KV_MODES)
def test_sampled_steps_replay_the_eager_tokens(tiny_model_path, monkeypatch, mode):
    """temperature > 0 inside the captured step: depths 1 -> 4 -> 2 -> 4 with prompts of 30
    and 600 tokens, under three sampling settings, give the eager path's tokens (one u per
    token from the seeded host RNG on both paths). The parameters are read when the replay
    runs, so depth 4's graph, captured under the second setting, replays the first setting
    for the last run; sampled and greedy steps of one depth are two keys."""
    m = _fake_model(tiny_model_path, kv_mode=mode)
    try:
        runs = [(kw, d, n) for kw, (d, n) in zip(SAMPLED + SAMPLED[:1], RUNS)]
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = [m.generate(_prompt(n, d), max_new_tokens=8, depth=d, **kw).token_ids
                for kw, d, n in runs]
        assert m.graph_stats()["captures"] == 0
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        got = [m.generate(_prompt(n, d), max_new_tokens=8, depth=d, **kw).token_ids
               for kw, d, n in runs]
        assert got == want
        # the tokens really were sampled: greedy gives something else for some run
        greedy = [m.generate(_prompt(n, d), max_new_tokens=8, depth=d).token_ids
                  for _, d, n in runs[:2]]
        assert greedy != want[:2]
        st = m.graph_stats()
        assert st["captures"] == 5                    # sampled at depths 1, 4, 2; greedy 1, 4
        assert sorted((k[0], k[-1]) for k in st["keys"]) == [
            (1, False), (1, True), (2, True), (4, False), (4, True)]
    finally:
        tinyloop.free_model(m)


FILTERED = [dict(temperature=0.9, top_p=0.95, min_p=0.05, repetition_penalty=1.6, seed=1),
            dict(temperature=0.0, repetition_penalty=2.0, repeat_last_n=6, seed=2),
            dict(temperature=1.1, top_k=20, min_p=0.1, seed=3),
            dict(temperature=0.8, top_k=10, top_p=0.9, repetition_penalty=0.7,
                 repeat_last_n=3, seed=4)]


def test_filtered_and_penalised_steps_replay_the_eager_tokens(tiny_model_path, monkeypatch):
    """min-p and the repetition penalty (greedy and sampled) inside the captured step, the
    window ring seeded once per request and then kept by the step itself: the eager path's
    tokens, one graph per (depth, penalised, sampled) key; the penalty changes the tokens."""
    m = _fake_model(tiny_model_path)
    try:
        runs = [(kw, d, n) for kw, (d, n) in zip(FILTERED, RUNS)]
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = [m.generate(_prompt(n, d), max_new_tokens=12, depth=d, **kw).token_ids
                for kw, d, n in runs]
        greedy = m.generate(_prompt(RUNS[1][1], RUNS[1][0]), max_new_tokens=12,
                            depth=RUNS[1][0]).token_ids
        assert greedy != want[1]
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        got = [m.generate(_prompt(n, d), max_new_tokens=12, depth=d, **kw).token_ids
               for kw, d, n in runs]
        assert got == want
        keys = sorted((k[0], k[-2], k[-1]) for k in m.graph_stats()["keys"])
        assert keys == [(1, True, True), (2, False, True), (4, True, True)]
        # a second penalised request on a captured key: the ring is seeded again
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        again = m.generate(_prompt(RUNS[0][1], RUNS[0][0]), max_new_tokens=12,
                           depth=RUNS[0][0], **FILTERED[0]).token_ids
        assert again == want[0]
    finally:
        tinyloop.free_model(m)


def test_sampling_parameters_are_checked(tiny_model_path):
    m = _fake_model(tiny_model_path)
    try:
        ops = m.ops
        for bad, match in [((0.0, 0, 1.0, 0.5), "temperature > 0"),
                           ((float("nan"), 0, 1.0, 0.5), "temperature > 0"),
                           ((1.0, 0, 1.0, 1.0), r"u must lie in \[0, 1\)"),
                           ((1.0, -1, 1.0, 0.5), "top_k must be"),
                           ((1.0, 2.5, 1.0, 0.5), "top_k must be"),
                           ((1.0, 0, -0.1, 0.5), "top_p must be")]:
            with pytest.raises(ConfigError, match=match):
                ops.set_step_sampling(*bad)
        ops.set_step_sampling(0.5, 7, 0.25, 0.0)
        assert ops._step_sampling == (0.5, 7, 0.25, 0.0)
        with m.new_kv_cache(1, 40) as c:
            with pytest.raises(ConfigError, match="u must lie"):
                graphmod.decode_graphs(m).step(c, 1, 0, (1.0, 0, 1.0, 2.0))
    finally:
        tinyloop.free_model(m)


def test_adapter_model_replays_the_injection(tiny_adapter_path, monkeypatch):
    """The injection adapter's copy of the prelude output is an op, so replay redoes it."""
    m = _fake_model(tiny_adapter_path)
    try:
        ids = _prompt(20, 3)
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = m.generate(ids, max_new_tokens=8, depth=3).token_ids
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        assert m.generate(ids, max_new_tokens=8, depth=3).token_ids == want
        assert m.graph_stats()["replays"] == 6
    finally:
        tinyloop.free_model(m)


def test_the_device_state_advances_itself(tiny_model_path, monkeypatch):
    """After a replay the state holds the next id and pos + 1, written by the step's own
    ops: the host writes the state only when it differs from what it expects."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake_model(tiny_model_path, max_seq_len=64)
    writes = []
    real = NumpyOps.from_host

    def from_host(self, host, out):
        if (sys._getframe(1).f_code.co_name == "_prepare"
                and out is graphmod.decode_graphs(m).step_state):
            writes.append(np.array(host))              # written by DecodeGraphs.step
        real(self, host, out)
    monkeypatch.setattr(RecordingOps, "from_host", from_host, raising=False)
    try:
        r = m.generate(_prompt(10, 5), max_new_tokens=7, depth=2)
        eos = r.finish_reason == "eos"
        state = np.array(graphmod.decode_graphs(m).step_state)
        assert state[STEP_ID] == (m.config.eos_token_id if eos else r.token_ids[-1])
        assert state[STEP_POS] == 10 + len(r.token_ids) - 1 + eos
        assert len(writes) == 1 and writes[0][STEP_POS] == 10   # only the first decode step
        assert writes[0][STEP_ID] == r.token_ids[0]
    finally:
        tinyloop.free_model(m)


def capture_events(m, run) -> list:
    """The pool events logged between the capture's begin and end while ``run()`` decodes on
    ``m`` (exactly one capture expected). Counts events by absolute number: the log is a ring
    shared with earlier tests, so old events drop out; the capture's own must all be kept."""
    ops, marks = m.ops, []
    begin, end = ops.graph_begin, ops.graph_end

    def logged():            # events ever logged
        return m.pool.events_dropped + len(m.pool.events())

    def graph_begin():
        marks.append(logged())
        begin()

    def graph_end():
        g = end()
        marks.append(logged())
        return g
    ops.graph_begin, ops.graph_end = graph_begin, graph_end
    try:
        run()
    finally:
        del ops.graph_begin, ops.graph_end
    dropped = m.pool.events_dropped
    assert len(marks) == 2 and marks[0] >= dropped    # the capture's events are all kept
    between = m.pool.events()[marks[0] - dropped:marks[1] - dropped]
    assert len(between) == marks[1] - marks[0]
    return between


def test_capture_allocates_nothing_from_the_pool(tiny_model_path, monkeypatch):
    """The pool's event log shows no allocation between capture begin and end."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake_model(tiny_model_path, max_seq_len=64)
    try:
        between = capture_events(
            m, lambda: m.generate(_prompt(12, 1), max_new_tokens=5, depth=1))
        assert not [e for e in between if e.action in ("alloc", "segment_alloc")]
    finally:
        tinyloop.free_model(m)


def test_a_capture_that_allocates_is_refused(tiny_model_path, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake_model(tiny_model_path, max_seq_len=64)
    real = m.decode_step_ops
    leaked = []

    def step_ops(*a):
        if m.ops._rec is not None:
            leaked.append(m.pool.allocate(1000, "scratch"))
        real(*a)
    m.decode_step_ops = step_ops
    try:
        kv0 = m.pool.by_tag().get("kv_cache", 0)
        with pytest.raises(GraphCaptureError, match="allocated from the pool"):
            m.generate(_prompt(12, 1), max_new_tokens=5, depth=1)
        assert m.graph_stats()["graphs"] == 0 and m.ops.graphs[-1].freed
        assert m.pool.by_tag().get("kv_cache", 0) == kv0          # the request was released
        for b in leaked:
            m.pool.free(b)
        del m.decode_step_ops
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = m.generate(_prompt(12, 1), max_new_tokens=5, depth=1).token_ids
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        assert m.generate(_prompt(12, 1), max_new_tokens=5, depth=1).token_ids == want
    finally:
        tinyloop.free_model(m)


def test_a_failure_during_capture_ends_it_and_the_next_request_works(tiny_model_path,
                                                                     monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake_model(tiny_model_path, max_seq_len=64)
    real = m.decode_step_ops

    def broken(*a):
        if m.ops._rec is not None:
            m.ops.to_host(a[0])               # a host read inside the capture: refused
        real(*a)
    m.decode_step_ops = broken
    try:
        with pytest.raises(AssertionError, match="to_host called during a capture"):
            m.generate(_prompt(12, 2), max_new_tokens=5, depth=1)
        assert m.ops.aborted == 1 and m.ops._rec is None
        assert m.graph_stats()["graphs"] == 0
        del m.decode_step_ops
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = m.generate(_prompt(12, 2), max_new_tokens=5, depth=1).token_ids
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        assert m.generate(_prompt(12, 2), max_new_tokens=5, depth=1).token_ids == want
        assert m.graph_stats()["graphs"] == 1
    finally:
        tinyloop.free_model(m)


def test_keys_separate_depth_mode_and_constants(tiny_model_path):
    m = _fake_model(tiny_model_path, max_seq_len=64)
    g = graphmod.decode_graphs(m)
    try:
        keys = set()
        for depth in (1, 2):
            for mode in ("fp16", "int8"):
                with m.new_kv_cache(depth, 40, kv_mode=mode) as c:
                    keys.add(g.key(c))
        assert len(keys) == 4
        with m.new_kv_cache(1, 40, kv_mode={"prelude": "fp16", "recurrent": "int8",
                                            "coda": "fp16"}) as c:
            mixed = g.key(c)
            assert mixed not in keys and mixed[1][0] == "fp16" and mixed[1][1] == "int8"
        with m.new_kv_cache(1, 40, page_size=16) as c:
            assert g.key(c) not in keys and g.key(c)[2] == 16
        with m.new_kv_cache(1, 10) as c:           # capacity is not part of the key
            assert g.key(c) in keys
        m.ops.graph_constants = lambda: ("other geometry",)
        with m.new_kv_cache(1, 40) as c:
            assert g.key(c) not in keys
    finally:
        tinyloop.free_model(m)


def test_eligibility(tiny_model_path, monkeypatch):
    m = _fake_model(tiny_model_path, max_seq_len=64)
    g = graphmod.decode_graphs(m)
    try:
        with m.new_kv_cache(1, 40) as c:
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
            assert g.eligible(c, 0.0) and g.eligible(c, 0.7)
            m.ops.graph_sampling = False             # a backend that cannot sample in-step
            assert g.eligible(c, 0.0) and not g.eligible(c, 0.7)
            m.ops.graph_sampling = True
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
            assert not g.eligible(c, 0.0)
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "sometimes")
            with pytest.raises(ConfigError, match="TINYLOOP_CUDA_GRAPHS='sometimes'"):
                g.eligible(c, 0.0)
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
            m.ops.graph_kv_modes = ("fp16",)
            assert g.eligible(c, 0.0)
        with m.new_kv_cache(1, 40, kv_mode="int8") as c:
            assert not g.eligible(c, 0.0)
        with pytest.raises(ConfigError, match="outside the request's capacity 40"):
            with m.new_kv_cache(1, 40) as c:
                g.step(c, 1, 40)
    finally:
        tinyloop.free_model(m)


def test_plain_numpy_backend_never_captures(tiny_model_path, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        m.generate(_prompt(8, 1), max_new_tokens=4)
        assert m.graph_stats()["graphs"] == 0 and m.pool.by_tag().get("graphs", 0) == 0
    finally:
        tinyloop.free_model(m)


def test_lru_eviction_and_release_free_the_graphs_blocks(tiny_model_path, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    monkeypatch.setattr(graphmod, "MAX_GRAPHS", 2)
    m = _fake_model(tiny_model_path, max_seq_len=64)
    pool = m.pool
    try:
        for depth in (1, 2, 3):
            m.generate(_prompt(8, depth), max_new_tokens=4, depth=depth)
        st = m.graph_stats()
        assert [k[0] for k in st["keys"]] == [2, 3] and st["graphs"] == 2
        assert m.ops.graphs[0].freed and not m.ops.graphs[1].freed
        assert pool.by_tag()["graphs"] == st["bytes"] > 0
        # the table of a key: int64 [slots, ceil(64 / 32)]; one state block beside them
        slots = {2: 1 + 2 * 2 + 1, 3: 1 + 2 * 3 + 1}
        tables = sum(-(-(slots[d] * 2 * 8) // 512) * 512 for d in (2, 3))
        assert st["bytes"] == tables + graphmod.decode_graphs(m)._state_block.nbytes
    finally:
        tinyloop.free_model(m)
    assert all(g.freed for g in m.ops.graphs)
    assert pool.by_tag().get("graphs", 0) == 0


def check_fault_inside_a_replay(m, prompt) -> None:
    """A logit row that turns NaN inside a replayed step raises NonFiniteLogitsError naming
    that step and position (the fault code travels through the step state); the request's KV
    cache is released and, the fault gone, the graph path gives the eager tokens again."""
    os.environ["TINYLOOP_CUDA_GRAPHS"] = "0"
    want = m.generate(prompt, max_new_tokens=6, depth=2).token_ids
    os.environ["TINYLOOP_CUDA_GRAPHS"] = "1"
    kv0 = m.pool.by_tag().get("kv_cache", 0)
    g = graphmod.decode_graphs(m)
    real, calls = g.step, []
    good = m.ops.to_host(m._output_norm).copy()

    def step(cache, token, pos, sampling=None):
        calls.append(pos)
        if len(calls) == 3:                  # warm-up, capture + replay, then this replay
            m._output_norm[...] = np.nan
        return real(cache, token, pos, sampling)
    g.step = step
    try:
        with pytest.raises(NonFiniteLogitsError) as ei:
            m.generate(prompt, max_new_tokens=6, depth=2)
        assert g.replays >= 2
        e = ei.value
        assert (e.kind, e.step, e.position) == ("nan", 3, len(prompt) + 2)
        assert m.pool.by_tag().get("kv_cache", 0) == kv0
    finally:
        del g.step
        m.ops.from_host(good, m._output_norm)
    assert m.generate(prompt, max_new_tokens=6, depth=2).token_ids == want


def test_a_fault_inside_a_replay_names_step_and_position(tiny_model_path, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake_model(tiny_model_path, max_seq_len=64)
    try:
        check_fault_inside_a_replay(m, _prompt(9, 4))
    finally:
        tinyloop.free_model(m)


def test_captured_graph_replayed_outside_step_then_resynchronised(tiny_model_path,
                                                                 monkeypatch):
    """DecodeGraphs.captured: None until the key's second step captures, then the graph a
    benchmark replays alone. Replays launched outside ``step`` advance the device position
    past what the host expects; after ``forget_device_state`` the next step writes its own
    token and position and returns the token an eager step at that position returns."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake_model(tiny_model_path, max_seq_len=64)
    prompt = np.array(_prompt(10, 7), np.int32)
    try:
        g = graphmod.decode_graphs(m)
        with m.lock, m.new_kv_cache(1, 40) as cache:
            m.forward(prompt, 0, 1, cache)
            tok, pos = 11, 10
            tok = graphmod.decode_step(m, cache, tok, pos, 0.0)     # eager
            assert g.captured(cache) is None
            pos += 1
            tok = graphmod.decode_step(m, cache, tok, pos, 0.0)     # captured
            pos += 1
            graph = g.captured(cache)
            assert graph is not None and g.captured(cache, sampled=True) is None
            for _ in range(3):                                      # outside step
                m.ops.graph_launch(graph)
            assert int(g.step_state[STEP_POS]) == pos + 3
            g.forget_device_state()
            got = graphmod.decode_step(m, cache, tok, pos, 0.0)
            assert int(g.step_state[STEP_POS]) == pos + 1
        # the same request again, every step eager (a key's first step after a release)
        with m.lock, m.new_kv_cache(1, 40) as cache:
            m.forward(prompt, 0, 1, cache)
            t = 11
            for p in range(10, pos + 1):
                g.release()
                t = graphmod.decode_step(m, cache, t, p, 0.0)
        assert got == t
    finally:
        tinyloop.free_model(m)
