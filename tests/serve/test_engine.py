"""The continuous-batching Engine on the NumPy backend: batched requests give their solo
Model.generate / stream results (greedy and seeded sampling, stops, EOS, mixed depths and kv
modes), admission waits for the KV budget, a full queue refuses, cancel frees pages at once,
the PrefixPool is shared, direct generate keeps working, and allocated bytes return to their
value at start."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tinyloop
from tinyloop.errors import ConfigError, EngineStoppedError, QueueFullError
from tinyloop.kv import PrefixPool
from tinyloop.serve import Engine, request_kv_bytes


@pytest.fixture
def model(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy")
    yield m
    tinyloop.free_model(m)


def _prompts(n, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(1, 40))).tolist() for _ in range(n)]


# kwargs of generate: greedy, seeded sampling, a stop string, another depth / kv_mode
KINDS = [dict(), dict(temperature=0.9, top_k=20, seed=7), dict(temperature=1.2, top_p=0.8,
                                                              seed=11),
         dict(stop=["a"]), dict(depth=1), dict(depth=3, kv_mode="int8"),
         dict(kv_mode="h_int8", temperature=0.7, seed=3),
         dict(temperature=0.9, min_p=0.2, seed=13), dict(repetition_penalty=1.8, repeat_last_n=8),
         dict(temperature=0.8, top_p=0.9, repetition_penalty=1.5, seed=17)]


def _graphs_model(path, monkeypatch):
    """The NumPy model of ``path`` with graphs on through the recording fake
    (tests/model/test_graphs.py), so the engine takes the captured-step paths."""
    from ..model.test_graphs import RecordingOps
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = tinyloop.load_model(path, max_seq_len=96, backend="numpy")
    RecordingOps().attach(m)
    return m


def record_prepared(monkeypatch) -> list:
    """Patch ``Model.decode_batch_start`` to note, per call, (the batch's depth, whether it
    launched a prepared batch); returns the list it appends to."""
    from tinyloop.model import Model
    used = []
    real = Model.decode_batch_start

    def start(self, caches, *a, prepared=None, **k):
        used.append((caches[0].depth, prepared is not None))
        return real(self, caches, *a, prepared=prepared, **k)
    monkeypatch.setattr(Model, "decode_batch_start", start)
    return used


def _solo(model, prompt, n, kw):
    res = model.generate(prompt, max_new_tokens=n, **kw)
    pieces = [(t.token_id, t.text, t.finish_reason)
              for t in model.stream(prompt, max_new_tokens=n, **kw)]
    return res, pieces


def test_batched_requests_equal_their_solo_runs_and_memory_returns(model):
    prompts = _prompts(20)
    jobs = [(p, 3 + i % 9, KINDS[i % len(KINDS)]) for i, p in enumerate(prompts)]
    want = [_solo(model, p, n, kw) for p, n, kw in jobs]
    # min-p and the penalty change some of these requests' tokens, so a batch that dropped
    # either filter would differ from the solo runs
    changed = {"min_p": False, "repetition_penalty": False}
    for (p, n, kw), (res, _) in zip(jobs, want):
        for f in changed:
            if f in kw:
                plain = {k: v for k, v in kw.items() if k not in (f, "repeat_last_n")}
                changed[f] |= model.generate(p, max_new_tokens=n, **plain).token_ids \
                    != res.token_ids
    assert all(changed.values()), changed
    before = model.pool.allocated_bytes
    # 5 rows a step and chunks of 8 prompt positions: requests join and leave mid-run
    with Engine(model, max_batch=5, prefill_chunk=8) as eng:
        reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
        got_pieces = [[(t.token_id, t.text, t.finish_reason) for t in r] for r in reqs]
        results = [r.result(timeout=60) for r in reqs]
        assert eng.stats()["steps"] > 0
    for (res, pieces), got, gp in zip(want, results, got_pieces):
        assert (got.token_ids, got.text, got.finish_reason) == \
            (res.token_ids, res.text, res.finish_reason)
        assert gp == pieces
    assert model.pool.allocated_bytes == before
    assert model.pool.by_tag()["kv_cache"] == 0


def test_ignore_eos_runs_past_the_eos_the_request_samples(model):
    """A seeded request whose run samples the model's EOS id: it ends there ("eos"), and with
    ignore_eos it runs all max_new_tokens as Model.generate(ignore_eos=True) does, EOS
    included, beside a request that ends at it."""
    kw = dict(temperature=1.0, seed=3)
    full = model.generate([10, 20, 30], max_new_tokens=12, **kw)
    first = next(i for i in range(1, 12) if full.token_ids[i] not in full.token_ids[:i])
    object.__setattr__(model.config, "eos_token_id", full.token_ids[first])
    want = model.generate([10, 20, 30], max_new_tokens=12, ignore_eos=True, **kw)
    assert want.token_ids == full.token_ids and want.finish_reason == "length"
    with Engine(model, max_batch=4) as eng:
        a = eng.submit([10, 20, 30], max_new_tokens=12, ignore_eos=True, **kw)
        b = eng.submit([10, 20, 30], max_new_tokens=12, **kw)
        ra, rb = a.result(timeout=60), b.result(timeout=60)
    assert (ra.token_ids, ra.text, ra.finish_reason) == (want.token_ids, want.text, "length")
    assert (rb.token_ids, rb.finish_reason) == (full.token_ids[:first], "eos")
    with pytest.raises(ConfigError, match="ignore_eos"):
        Engine(model).submit([1], max_new_tokens=2, ignore_eos="no")


def test_generated_tokens_leave_out_a_row_that_came_back_as_an_error(model, monkeypatch):
    """A batch row whose step came back as an error (planted: non-finite logits on the
    third step's first row) fails its request and adds no token to ``generated_tokens``,
    which then counts exactly the tokens the two requests sampled."""
    from tinyloop.backends.base import LOGIT_FAULTS, non_finite_logits
    from tinyloop.errors import NonFiniteLogitsError
    from tinyloop.model import Model
    real, calls = Model.decode_batch_finish, []

    def finish(self, pending):
        got = list(real(self, pending))
        calls.append(len(got))
        if len(calls) == 3:               # what the step gives a row with a NaN logit
            got[0] = non_finite_logits(LOGIT_FAULTS[1])
        return got
    monkeypatch.setattr(Model, "decode_batch_finish", finish)
    eng = Engine(model, max_batch=2)
    reqs = [eng.submit(p, max_new_tokens=8) for p in _prompts(2, seed=4)]
    with eng:
        for r in reqs:
            r._done.wait(60)
    assert calls[2] == 2                       # the planted step ran both rows
    failed = [r for r in reqs if r._error is not None]
    assert len(failed) == 1 and isinstance(failed[0]._error, NonFiniteLogitsError)
    ok = next(r for r in reqs if r._error is None).result()
    want = len(ok.token_ids) + (ok.finish_reason == "eos") + failed[0].generated
    assert eng.stats()["generated_tokens"] == want
    assert model.pool.by_tag()["kv_cache"] == 0


def test_admission_waits_for_the_kv_budget(model):
    p1, p2 = _prompts(2, seed=1)
    want = [model.generate(p, max_new_tokens=6).token_ids for p in (p1, p2)]
    need = request_kv_bytes(model, max(len(p1), len(p2)) + 6, model.config.default_depth,
                            model.kv_modes)
    eng = Engine(model, kv_budget=need, max_batch=4)
    a = eng.submit(p1, max_new_tokens=6)
    b = eng.submit(p2, max_new_tokens=6)
    assert (a.state, b.state) == ("prefill", "queued")     # b's KV does not fit beside a's
    assert eng.stats()["kv_reserved_bytes"] == a.kv_bytes <= need
    with eng:
        assert [a.result(timeout=60).token_ids, b.result(timeout=60).token_ids] == want
    with pytest.raises(ConfigError, match=r"exceeds the engine's KV budget of \d+ bytes"):
        Engine(model, kv_budget=need).submit(list(range(1, 100)), max_new_tokens=20)


def test_a_full_queue_refuses_and_nothing_is_allocated(model):
    before = model.pool.allocated_bytes
    eng = Engine(model, max_batch=1, max_queue=1)
    a = eng.submit([1, 2, 3], max_new_tokens=4)
    b = eng.submit([4, 5], max_new_tokens=4)
    with pytest.raises(QueueFullError, match=r"queue is full \(1 requests"):
        eng.submit([6], max_new_tokens=4)
    assert model.pool.allocated_bytes == before           # admitted, not started: no pages
    with eng:
        assert a.result(timeout=60).finish_reason == b.result(timeout=60).finish_reason \
            == "length"
    with pytest.raises(EngineStoppedError):
        eng.submit([1], max_new_tokens=1)
    # the start made the model's lazy logit row (model-owned); the requests left nothing
    assert model.pool.allocated_bytes == eng.baseline_allocated


@pytest.fixture
def slow_steps(monkeypatch):
    """Decode steps of at least 5 ms (the NumPy LM head sleeps): a 90-token request outlives
    the test thread's checks however busy the machine is."""
    import time

    from tinyloop.backends.numpy_ops import NumpyOps
    real = NumpyOps.lm_head

    def slow_head(self, x, w, out):
        time.sleep(0.005)
        return real(self, x, w, out)
    monkeypatch.setattr(NumpyOps, "lm_head", slow_head)


def test_cancel_frees_the_requests_pages_at_once(model, slow_steps):
    with Engine(model) as eng:
        before = model.pool.by_tag()["kv_cache"]
        r = eng.submit(list(range(1, 30)), max_new_tokens=90)
        it = iter(r)
        next(it)                                          # it is decoding
        assert model.pool.by_tag()["kv_cache"] > before
        r.cancel()
        assert model.pool.by_tag()["kv_cache"] == before
        res = r.result(timeout=5)
        assert res.finish_reason == "cancelled" and 1 <= len(res.token_ids) < 90
        r.cancel()                                        # idempotent
        q = Engine(model, max_batch=1)                    # a queued request leaves its queue
        q.submit([1], max_new_tokens=2)
        w = q.submit([2], max_new_tokens=2)
        w.cancel()
        assert w.result().finish_reason == "cancelled" and q.stats()["queued"] == 0
        q.stop()


class _LockNeverFree:
    """The model's lock as a scheduler that takes it back step after step makes it for one
    thread: every acquire of ``starved`` fails (a plain ``with`` raises), others get it."""

    def __init__(self, inner, starved):
        self.inner, self.starved = inner, starved

    def acquire(self, blocking=True, timeout=-1):
        if threading.current_thread() is self.starved:
            if not blocking or timeout < 0:
                raise AssertionError("a blocking acquire by the starved thread never returns")
            threading.Event().wait(timeout)
            return False
        return self.inner.acquire(blocking, timeout)

    def release(self):
        self.inner.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def test_cancel_ends_the_request_at_the_next_step_when_the_lock_never_comes_free(
        model, slow_steps):
    with Engine(model) as eng:
        before = model.pool.by_tag()["kv_cache"]
        r = eng.submit(list(range(1, 30)), max_new_tokens=90)
        it = iter(r)
        next(it)
        inner = model._lock
        model._lock = _LockNeverFree(inner, threading.current_thread())
        try:
            r.cancel()                     # the scheduler's next step ends it
        finally:
            model._lock = inner
        assert r.done and model.pool.by_tag()["kv_cache"] == before
        res = r.result(timeout=5)
        assert res.finish_reason == "cancelled" and 1 <= len(res.token_ids) < 90


def test_the_prefix_pool_is_shared_and_its_hits_give_the_solo_text(model):
    head = list(range(1, 50))
    prompts = [head + [60, 61], head + [70], head + [80, 81, 82]]
    want = [model.generate(p, max_new_tokens=5).token_ids for p in prompts]
    before = model.pool.allocated_bytes
    pool = PrefixPool(model)
    with Engine(model, prefix_pool=pool, prefill_chunk=16) as eng:
        first = eng.submit(prompts[0], max_new_tokens=5)
        assert first.result(timeout=60).token_ids == want[0]
        rest = [eng.submit(p, max_new_tokens=5) for p in prompts[1:]]
        got = [r.result(timeout=60) for r in rest]
    assert [g.token_ids for g in got] == want[1:]
    assert all(g.cached_tokens >= len(head) for g in got)
    assert pool.stats()["hits"] >= 2
    assert model.pool.by_tag()["kv_cache"] == 0           # the rows blocks went too
    pool.release()
    assert model.pool.allocated_bytes == before


def test_direct_generate_keeps_working_while_the_engine_serves(model):
    p = _prompts(3, seed=4)
    want = [model.generate(x, max_new_tokens=20).token_ids for x in p]
    with Engine(model) as eng:
        reqs = [eng.submit(x, max_new_tokens=20) for x in p]
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "direct", model.generate(p[0], max_new_tokens=20).token_ids))
        t.start()
        t.join(60)
        assert out["direct"] == want[0]
        assert [r.result(timeout=60).token_ids for r in reqs] == want


def test_stop_ends_running_requests_and_bad_arguments_raise_at_submit(model):
    eng = Engine(model).start()
    before = eng.baseline_allocated
    r = eng.submit(list(range(1, 20)), max_new_tokens=100)
    next(iter(r))
    eng.stop()
    assert r.result(timeout=5).finish_reason == "cancelled"
    assert model.pool.allocated_bytes == before
    with pytest.raises(ConfigError, match="temperature"):
        Engine(model).submit([1], temperature=-1)
    with pytest.raises(ConfigError, match="max_batch"):
        Engine(model, max_batch=0)


def test_a_request_that_runs_out_of_memory_ends_alone_and_frees_its_pages(model,
                                                                         monkeypatch):
    from tinyloop.errors import OutOfMemoryError
    from tinyloop.kv.layouts import slot_layers
    from ..conftest import fail_nth_allocation
    a, b = list(range(1, 31)), list(range(40, 70))        # 30 positions: one page per slot
    want_b = model.generate(b, max_new_tokens=10)
    slots = len(slot_layers(model.config, model.config.default_depth))
    # 1st kv_cache allocation: a's block table (its prefill); then, in a second run, the page
    # for position 32, after both prefills (table + one page per slot each): a's first try,
    # while the step at 31 runs (the engine prepares the next step), then, after b's, a's
    # second try at its own step
    first = 2 * (1 + slots) + 1
    for nth, phase in ((1, "prefill"), ({first, first + 2 * slots}, "decode")):
        eng = Engine(model)
        try:
            with monkeypatch.context() as mp:
                seen = fail_nth_allocation(mp, model.pool, "kv_cache", nth)
                ra = eng.submit(a, max_new_tokens=10)
                rb = eng.submit(b, max_new_tokens=10)
                eng.start()          # both admitted before it starts: they prefill in one
                before = eng.baseline_allocated      # iteration and step together
                with pytest.raises(OutOfMemoryError, match="injected") as e:
                    ra.result(timeout=60)
                assert seen["n"] >= max({nth} if isinstance(nth, int) else nth)
                got = rb.result(timeout=60)
            assert (got.token_ids, got.text) == (want_b.token_ids, want_b.text)
            partial = e.value.partial
            assert partial.finish_reason == "error"
            # the decode failure: the first token (prefill), those fed at positions 30 and
            # 31; position 32 needs the page that failed
            assert len(partial.token_ids) == (0 if phase == "prefill" else 3)
            assert e.value.step == len(partial.token_ids)
            assert model.pool.allocated_bytes == before
        finally:
            eng.stop()


def test_a_fault_in_a_step_ends_its_requests_each_with_its_partial(model, monkeypatch):
    from tinyloop.errors import TinyLoopError
    real = type(model).decode_batch_start
    calls = {"n": 0}

    def flaky(self, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted")
        return real(self, *args, **kw)

    monkeypatch.setattr(type(model), "decode_batch_start", flaky)
    eng = Engine(model)        # both admitted before the scheduler starts: one batch
    rs = [eng.submit(p, max_new_tokens=20) for p in ([1, 2, 3], [4, 5])]
    with eng:
        errs = []
        for r in rs:
            with pytest.raises(TinyLoopError, match="step failed.*planted") as e:
                r.result(timeout=60)
            errs.append(e.value)
        assert errs[0] is not errs[1]
        assert [len(e.partial.token_ids) for e in errs] == [3, 3]   # prefill + 2 steps
        assert errs[0].partial.prompt_token_ids == [1, 2, 3]
        assert errs[1].partial.prompt_token_ids == [4, 5]
        assert model.pool.by_tag()["kv_cache"] == 0
        # the engine goes on serving
        monkeypatch.setattr(type(model), "decode_batch_start", real)
        assert eng.submit([7, 8], max_new_tokens=4).result(timeout=60).token_ids == \
            model.generate([7, 8], max_new_tokens=4).token_ids


def test_the_engine_serves_a_latest_policy_model_as_its_solo_runs(tiny_model_path):
    """A model loaded with kv_iterations="latest" (one K/V slot per recurrent layer): batched
    requests at depth 3 give their solo runs' ids, and use that policy's smaller caches; the
    engine refuses depth='auto' by name."""
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy",
                            kv_iterations="latest")
    try:
        jobs = [(p, 5, dict(depth=3, **kw)) for p, kw in
                zip(_prompts(6, seed=4), [dict(), dict(temperature=0.9, seed=2)] * 3)]
        want = [m.generate(p, max_new_tokens=n, **kw).token_ids for p, n, kw in jobs]
        assert want != [m.generate(p, max_new_tokens=n, kv_iterations="all", **kw).token_ids
                        for p, n, kw in jobs]            # the policy changes what is read
        with Engine(m, max_batch=4, prefill_chunk=8) as eng:
            reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
            assert [r.result(timeout=60).token_ids for r in reqs] == want
            assert reqs[0].kv_bytes == request_kv_bytes(m, len(jobs[0][0]) + 5, 3, m.kv_modes)
            with pytest.raises(ConfigError, match="depth='auto' is not taken by the engine"):
                eng.submit([1, 2, 3], max_new_tokens=2, depth="auto")
    finally:
        tinyloop.free_model(m)


def test_a_lone_request_runs_the_captured_step(tiny_model_path, monkeypatch):
    """On a backend with graphs (test_graphs.py's recording fake), a lone request's steps
    replay the captured decode step: the tokens are generate's (greedy and seeded sampled
    with a penalty), the replays count them, and the bytes outside tag graphs return to the
    engine's baseline while the graphs' blocks stay with the model."""
    from tinyloop.serve.engine import allocated_outside_graphs

    m = _graphs_model(tiny_model_path, monkeypatch)
    try:
        prompt = _prompts(1, seed=7)[0][:30]
        kw = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 3, "repetition_penalty": 1.2}]
        want = [m.generate(prompt, max_new_tokens=12, stop=[], **k).token_ids for k in kw]
        with Engine(m, max_batch=4, prefill_chunk=96) as eng:
            before = m.graph_stats()["replays"]
            got = [eng.submit(prompt, max_new_tokens=12, stop=[], **k).result(timeout=120)
                   .token_ids for k in kw]
            replays = m.graph_stats()["replays"] - before
        assert got == want
        assert replays == sum(len(t) - 1 for t in got)     # every decode step replayed
        assert allocated_outside_graphs(m.pool) == eng.baseline_allocated
        assert m.pool.by_tag()["graphs"] > 0
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("serial_rows", [0, 2, 16])
def test_few_rows_replay_one_by_one_and_more_share_a_batch(tiny_model_path, monkeypatch,
                                                          serial_rows):
    """Four concurrent requests on a backend with graphs (the recording fake): with
    serial_rows >= 4 every decode step of every row is a replay of the captured step; with
    fewer, the steps where more rows decode run as decode_batch. Either way each request's
    tokens are its solo generate's (greedy and seeded sampled)."""
    m = _graphs_model(tiny_model_path, monkeypatch)
    try:
        prompts = [p[:24] for p in _prompts(4, seed=11)]
        kws = [{}, {"temperature": 0.7, "seed": 2}, {}, {"temperature": 0.9, "top_k": 9,
                                                        "seed": 5}]
        want = [m.generate(p, max_new_tokens=10, stop=[], **k).token_ids
                for p, k in zip(prompts, kws)]
        # all four admitted before the scheduler starts, so they decode together however
        # slowly this thread submits
        eng = Engine(m, max_batch=4, prefill_chunk=96, serial_rows=serial_rows)
        before = m.graph_stats()["replays"]
        with m.lock:
            reqs = [eng.submit(p, max_new_tokens=10, stop=[], **k)
                    for p, k in zip(prompts, kws)]
            eng.start()
        try:
            got = [r.result(timeout=120).token_ids for r in reqs]
            replays = m.graph_stats()["replays"] - before
        finally:
            eng.stop()
        assert got == want
        steps = sum(len(t) - 1 for t in got)
        if serial_rows >= 4:
            assert replays == steps
        else:
            assert replays < steps          # some steps ran as a batch
    finally:
        tinyloop.free_model(m)


def test_serial_rows_must_not_be_negative(model):
    with pytest.raises(ConfigError, match="serial_rows"):
        Engine(model, serial_rows=-1)


def test_a_steps_tokens_stream_while_the_next_step_runs(model, monkeypatch):
    """The host streams step k's pieces between step k + 1's decode_batch_start and its
    finish; a request a stop string ends while a step that reads its cache is in flight ends
    after that step (its cache still live at the finish) with its solo run's tokens, text and
    pieces; every request's pages are freed at its end."""
    cls = type(model)
    real_start, real_finish = cls.decode_batch_start, cls.decode_batch_finish
    events, in_flight, live_at_finish, ended_in_flight = [], [], [], [0]

    def start(self, caches, *a, **k):
        events.append("start")
        in_flight.append(list(caches))
        return real_start(self, caches, *a, **k)

    def finish(self, pending):
        caches = in_flight.pop()
        for c in caches:
            try:
                c.check_alive()              # raises HandleError once the cache is released
                live_at_finish.append(True)
            except tinyloop.errors.HandleError:
                live_at_finish.append(False)
        ended_in_flight[0] += sum(r._ending is not None for r in reqs)
        events.append("finish")
        return real_finish(self, pending)

    prompts = _prompts(12, seed=5)
    kws = []
    for i, p in enumerate(prompts):     # odd requests stop at a character of their text
        text = model.generate(p, max_new_tokens=24, stop=[]).text
        cut = [ch for ch in text[4:] if ch != "\ufffd"]
        kws.append(dict(stop=[cut[0]]) if i % 2 and cut else {})
    want = [_solo(model, p, 24, kw) for p, kw in zip(prompts, kws)]
    assert sum(res.finish_reason == "stop" for res, _ in want) >= 3
    monkeypatch.setattr(cls, "decode_batch_start", start)
    monkeypatch.setattr(cls, "decode_batch_finish", finish)
    before = model.pool.by_tag().get("kv_cache", 0)
    eng = Engine(model, max_batch=12, prefill_chunk=512, serial_rows=0)
    reqs = [eng.submit(p, max_new_tokens=24, **kw) for p, kw in zip(prompts, kws)]
    for r in reqs:
        r.notify = lambda: events.append("piece")
    with eng:
        got = [(r.result(timeout=120), [(t.token_id, t.text, t.finish_reason) for t in r])
               for r in reqs]
    for (res, pieces), (want_res, want_pieces) in zip(got, want):
        assert res.token_ids == want_res.token_ids
        assert res.text == want_res.text and res.finish_reason == want_res.finish_reason
        assert pieces == want_pieces
    # pieces were handed out while a step was in flight
    inside, overlapped = False, 0
    for e in events:
        if e == "start":
            inside = True
        elif e == "finish":
            inside = False
        elif inside:
            overlapped += 1
    assert overlapped > 0
    assert ended_in_flight[0] > 0 and all(live_at_finish)
    assert model.pool.by_tag().get("kv_cache", 0) == before


def test_one_decode_batch_is_in_flight_at_a_time(model):
    """decode_batch_start refuses a second batch before the first's finish; the finish
    returns what decode_batch returns."""
    caches = [model.new_kv_cache(2, 16) for _ in range(2)]
    try:
        for c, t in zip(caches, [3, 4]):
            model.forward(np.array([t], np.int32), 0, 2, c)
        args = (caches, [5, 6], [1, 1], 2)
        sampling = [(0.0, 0, 1.0, 0.0)] * 2
        pending = model.decode_batch_start(*args, sampling=sampling)
        with pytest.raises(ConfigError, match="in flight"):
            model.decode_batch_start(*args, sampling=sampling)
        got = model.decode_batch_finish(pending)
        assert model.decode_batch_finish(pending) == got
        logits = model.decode_batch(*args)          # the same step again, by logits
        assert got == [int(np.argmax(row)) for row in logits]
    finally:
        for c in caches:
            c.release()


def test_steady_steps_launch_what_the_step_before_prepared(tiny_model_path, monkeypatch):
    """With graphs (the recording fake), a decode step whose rows and positions are the ones
    its predecessor prepared (``Model.decode_batch_prepare``, made while that step ran)
    launches the prepared batch; requests that reach max_new_tokens leave it without a new
    preparation (known ahead). Each request's tokens are its solo run's."""
    m = _graphs_model(tiny_model_path, monkeypatch)
    try:
        prompts = [p[:20] for p in _prompts(6, seed=3)]
        lengths = [6, 9, 12, 12, 12, 12]
        want = [m.generate(p, max_new_tokens=n, stop=[]).token_ids
                for p, n in zip(prompts, lengths)]
        used = record_prepared(monkeypatch)
        eng = Engine(m, max_batch=6, prefill_chunk=512, serial_rows=0)
        reqs = [eng.submit(p, max_new_tokens=n, stop=[]) for p, n in zip(prompts, lengths)]
        with eng:                   # all admitted before the scheduler starts: one batch
            got = [r.result(timeout=120).token_ids for r in reqs]
        assert got == want
        # 11 steps after the prefill's first token; every one but the first was prepared,
        # also those after a request reached its length (6, 9 tokens: known ahead)
        assert [p for _, p in used] == [False] + [True] * (max(lengths) - 2)
    finally:
        tinyloop.free_model(m)


def test_the_engine_freezes_the_heap_it_starts_with_and_unfreezes_it_at_stop(model):
    """freeze_gc (the default): the objects alive at start leave the collector's generations
    (gc.freeze) while the engine runs, and come back at stop; False leaves the collector as
    it is. Requests are served either way."""
    import gc
    before = gc.get_freeze_count()      # 0 unless something else froze objects first
    with Engine(model) as eng:
        during = gc.get_freeze_count()
        assert during > before
        assert eng.submit([1, 2, 3], max_new_tokens=3).result(timeout=60).token_ids == \
            model.generate([1, 2, 3], max_new_tokens=3).token_ids
    # an engine that froze the first objects unfreezes at stop; else it leaves them frozen
    after = gc.get_freeze_count()
    assert after == (0 if before == 0 else during)
    with Engine(model, freeze_gc=False) as eng:
        assert gc.get_freeze_count() == after
        eng.submit([1, 2, 3], max_new_tokens=3).result(timeout=60)
    assert gc.get_freeze_count() == after


def test_the_heap_stays_frozen_until_the_last_engine_stops(model, tiny_model_path):
    """gc.freeze is process-wide: with two engines running, the first one's stop leaves the
    heap frozen under the second (both serve on); the second's stop unfreezes it."""
    import gc
    before = gc.get_freeze_count()
    other = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        a, b = Engine(model).start(), Engine(other).start()
        frozen = gc.get_freeze_count()
        assert frozen > before
        a.stop()           # the heap stays frozen (a few frozen objects die with a's state)
        assert gc.get_freeze_count() > before + (frozen - before) // 2
        assert b.submit([1, 2, 3], max_new_tokens=3).result(timeout=60).token_ids == \
            other.generate([1, 2, 3], max_new_tokens=3).token_ids
        b.stop()
        b.stop()                                # idempotent: no second release
        if before == 0:                         # the engines froze the heap: now it is not
            assert gc.get_freeze_count() == 0
            with Engine(model) as c:            # a later engine freezes afresh
                assert gc.get_freeze_count() > 0
                c.submit([4, 5], max_new_tokens=2).result(timeout=60)
            assert gc.get_freeze_count() == 0
    finally:
        tinyloop.free_model(other)


def test_each_group_launches_its_own_prepared_step(tiny_model_path, monkeypatch):
    """Two groups (depths 2 and 3) stepping in turn each keep the step they prepared: after
    both groups' first steps every step launches a prepared batch, and each request gives
    its solo run's tokens."""
    m = _graphs_model(tiny_model_path, monkeypatch)
    try:
        prompts = [p[:16] for p in _prompts(6, seed=8)]
        depths = [2, 3, 2, 3, 2, 3]
        want = [m.generate(p, max_new_tokens=8, depth=d, stop=[]).token_ids
                for p, d in zip(prompts, depths)]
        used = record_prepared(monkeypatch)
        eng = Engine(m, max_batch=6, prefill_chunk=512, serial_rows=0)
        reqs = [eng.submit(p, max_new_tokens=8, depth=d, stop=[])
                for p, d in zip(prompts, depths)]
        with eng:                   # all admitted before the scheduler starts
            got = [r.result(timeout=120).token_ids for r in reqs]
        assert got == want
        # 7 steps a group after the prefill's first token, the groups in turn
        assert [d for d, _ in used] == [2, 3] * 7
        assert [p for _, p in used] == [False, False] + [True] * 12
    finally:
        tinyloop.free_model(m)


def test_decode_time_ends_before_the_release(model, monkeypatch):
    """A request's decode_ms ends when its last token is known: a KV cache release that takes
    1,000 s by the engine module's clock leaves it under a second."""
    from tinyloop.serve import engine as engine_mod

    from ..conftest import slow_kv_release
    clock = slow_kv_release(monkeypatch, engine_mod)
    with Engine(model, max_batch=2) as eng:
        r = eng.submit([10, 20, 30], max_new_tokens=6).result(timeout=60)
    assert clock.shift >= 1000.0                                 # the release did run
    assert len(r.token_ids) == 6 and 0.0 < r.decode_ms < 1000.0
