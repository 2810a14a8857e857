"""The overlapped engine step (tinyloop/serve/engine.py, "Overlap") under adversarial
schedules: the tokens a step accepts stream while the next step runs, the next step's host
half is prepared meanwhile (``Model.decode_batch_prepare``), and a request a stop string ends
while a step reads its cache ends after that step. Each request must still give its solo
``Model.generate`` / ``Model.stream`` run (ids, text, pieces, finish reason), its pages must
be freed at its end, and the engine's counters must be right, under random schedules, EOS
mid-batch, stop strings at the first tokens, cancels from another thread, page faults,
stop(), the PrefixPool and direct generate calls. The captured-batch path (prepared batches,
staged inputs) runs on the CPU through test_graphs.py's recording fake.
"""

from __future__ import annotations

import collections
import random
import threading
import time

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.errors import OutOfMemoryError
from tinyloop.graphs import decode_graphs
from tinyloop.kv import PrefixPool
from tinyloop.kv.cache import RuntimeKVCache
from tinyloop.serve import Engine
from tinyloop.serve.engine import allocated_outside_graphs

from ..conftest import TINY
from ..model.test_graphs import RecordingOps
from .test_engine import _solo, record_prepared

EOS = 51        # a token the tiny model samples now and then, mid-run (checked below)


@pytest.fixture(scope="module")
def eos_model_path(tmp_path_factory):
    """tiny_model_path's weights (same seed) with an end-of-sequence id it actually samples."""
    path = tmp_path_factory.mktemp("models") / "tiny_eos.tlm"
    write_synthetic(path, synthetic_config(**TINY, eos_token_id=EOS), seed=11)
    return str(path)


def _load(path, graphs, monkeypatch, max_seq_len=96):
    """The NumPy model; ``graphs``: with the recording fake attached and graphs on, so batches
    run the captured path (prepared batches, staged inputs) and lone rows the captured step."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1" if graphs else "0")
    m = tinyloop.load_model(path, max_seq_len=max_seq_len, backend="numpy")
    if graphs:
        RecordingOps().attach(m)
    return m


def _pieces(r):
    return [(t.token_id, t.text, t.finish_reason) for t in r]


def _serve_beside(eng, reqs, side):
    """Wait for the started engine's ``reqs`` while a thread runs ``side()``; stops the
    engine. Returns ([(GenerationResult, pieces)], stats before the stop)."""
    t = threading.Thread(target=side)
    t.start()
    try:
        got = [(r.result(timeout=60), _pieces(r)) for r in reqs]
        t.join(60)
        return got, eng.stats()
    finally:
        eng.stop()


def _random_jobs(m, seed, n):
    """``n`` random requests: prompt lengths 1..29, max_new_tokens 1, 2, 3 or up to 19,
    greedy or seeded sampling (top-k, min-p), a repetition penalty, depths 1..4, kv modes,
    and stop strings taken from the request's own solo text (so they hit)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for _ in range(n):
        p = rng.integers(1, 256, int(rng.integers(1, 30))).tolist()
        mx = int(rng.choice([1, 2, 3, int(rng.integers(4, 20))]))
        kw = {}
        if rng.random() < 0.5:
            kw.update(temperature=float(rng.choice([0.7, 1.0, 1.5])),
                      seed=int(rng.integers(100)))
            if rng.random() < 0.3:
                kw["top_k"] = int(rng.integers(1, 20))
            if rng.random() < 0.3:
                kw["min_p"] = 0.1
        if rng.random() < 0.2:
            kw.update(repetition_penalty=1.5, repeat_last_n=6)
        if rng.random() < 0.4:
            kw["depth"] = int(rng.integers(1, 5))
        if rng.random() < 0.3:
            kw["kv_mode"] = str(rng.choice(["int8", "h_int8", "fp16"]))
        stop = []
        if rng.random() < 0.5:
            text = m.generate(p, max_new_tokens=mx, stop=[], **kw).text
            chars = [c for c in text if c != "\ufffd"]
            if chars:
                c = chars[int(rng.integers(len(chars)))]
                stop = [c] if rng.random() < 0.7 else [c + "zz", c]
        kw["stop"] = stop
        jobs.append((p, mx, kw))
    return jobs


def _serve(m, jobs, **engine_kw):
    """Run ``jobs`` on a new engine, all admitted before its scheduler starts; returns
    ([(result, pieces)], stats, engine)."""
    eng = Engine(m, **engine_kw)
    with m.lock:
        reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
        eng.start()
    try:
        got = [(r.result(timeout=60), _pieces(r)) for r in reqs]
        st = eng.stats()
    finally:
        eng.stop()
    return got, st, eng


def _check_solo(got, want, st, m, eng, kv_base=0):
    for (res, pieces), (w, wp) in zip(got, want):
        assert (res.token_ids, res.text, res.finish_reason) == \
            (w.token_ids, w.text, w.finish_reason)
        assert pieces == wp
    # every sampled token counts, an EOS too (as the engine counts it), nothing else
    assert st["generated_tokens"] == sum(len(w.token_ids) + (w.finish_reason == "eos")
                                         for w, _ in want)
    assert st["finished"] == dict(collections.Counter(w.finish_reason for w, _ in want))
    assert m.pool.by_tag().get("kv_cache", 0) == kv_base
    assert allocated_outside_graphs(m.pool) == eng.baseline_allocated


# -- failures found ----------------------------------------------------------------------------

def test_a_stop_string_held_when_a_row_drops_to_the_serial_step_keeps_the_solo_tokens(
        eos_model_path, monkeypatch):
    """Three rows (serial_rows=2) step as a batch; B's step-k token completes its stop string,
    but that token is only held (it streams during the next batch). At step k + 1 row C fails
    to gain its page, so the two rows left run the captured single-row step, which streams
    nothing first: B runs one step more, its extra token lands in ``token_ids`` (and in
    ``generated_tokens``) before the stop string is found at the iteration's end. B must give
    its solo run: the tokens up to the one that completed the stop string."""
    m = _load(eos_model_path, True, monkeypatch)
    try:
        rng = np.random.default_rng(3)
        a, c, b = [rng.integers(1, 256, 12).tolist() for _ in range(3)]
        want_a = m.generate(a, max_new_tokens=16, stop=[])
        want_b = m.generate(b, max_new_tokens=16, stop=["i"])
        assert want_b.finish_reason == "stop"
        k = len(want_b.token_ids) - 1          # the decode step that sampled B's stop token
        assert 1 <= k < 15 and want_a.finish_reason == "length"
        made = []
        make, real_ensure = m.new_kv_cache, RuntimeKVCache.ensure

        def new_kv_cache(*a_, **kw):
            made.append(make(*a_, **kw))
            return made[-1]

        def ensure(self, n):                   # C runs out of pages at decode step k + 1
            if len(made) >= 3 and self is made[2] and n >= len(c) + k + 1:
                raise OutOfMemoryError("injected", requested_bytes=1, tag="kv_cache")
            return real_ensure(self, n)
        m.new_kv_cache = new_kv_cache
        monkeypatch.setattr(RuntimeKVCache, "ensure", ensure)
        eng = Engine(m, max_batch=4, prefill_chunk=96, serial_rows=2)
        with m.lock:                           # admitted and prefilled in this order
            ra = eng.submit(a, max_new_tokens=16, stop=[])
            rb = eng.submit(b, max_new_tokens=16, stop=["i"])
            rc = eng.submit(c, max_new_tokens=16, stop=[])
            eng.start()
        try:
            got_b, got_a = rb.result(timeout=60), ra.result(timeout=60)
            with pytest.raises(OutOfMemoryError, match="injected") as e:
                rc.result(timeout=60)
            st = eng.stats()
        finally:
            eng.stop()
        assert got_a.token_ids == want_a.token_ids
        assert (got_b.text, got_b.finish_reason) == (want_b.text, "stop")
        assert got_b.token_ids == want_b.token_ids
        assert st["generated_tokens"] == (len(want_a.token_ids) + len(want_b.token_ids)
                                          + len(e.value.partial.token_ids))
    finally:
        tinyloop.free_model(m)


def test_a_page_that_another_requests_end_frees_in_time_does_not_fail_a_request(
        eos_model_path, monkeypatch):
    """A device whose KV memory holds A and B but not B's next page while A lives (a fake
    that refuses a kv_cache allocation past a cap; the engine has no budget to know it): A
    ends at step 4 (max_new_tokens) and frees its pages; B needs its next page at step 5.
    The engine tries that page while step 4 runs (``_prepare_next``), before A's end is
    known, and keeps the refusal (``_page_error``) to fail B at step 5; and A's pages are
    freed only while step 5 runs (its held tokens stream then), after step 5's own page
    gains. The engine before the overlap freed A at step 4's end and served B. B alone
    fits: its solo run must come out."""
    from tinyloop.serve import request_kv_bytes
    m = _load(eos_model_path, False, monkeypatch)
    try:
        a, b = list(range(1, 21)), list(range(60, 88))     # 20 and 28 prompt positions
        want_b = m.generate(b, max_new_tokens=20, stop=[])
        assert m.generate(a, max_new_tokens=5, stop=[]).finish_reason == "length"
        assert want_b.finish_reason == "length"
        depth, modes = m.config.default_depth, m.kv_modes
        # A's whole cache (one page a slot) + B's (two pages a slot: position 32 on), less one
        cap = request_kv_bytes(m, 25, depth, modes) + request_kv_bytes(m, 48, depth, modes) - 1
        pool = m.pool
        real, real_many = pool.allocate, pool.allocate_many

        def room(nbytes, tag):
            from tinyloop.memory import current_tag, round_size
            if (tag or current_tag()) == "kv_cache" and \
                    pool.by_tag().get("kv_cache", 0) + round_size(nbytes) > cap:
                raise OutOfMemoryError("no room", requested_bytes=nbytes, tag="kv_cache")

        def allocate(nbytes, tag=None):
            room(nbytes, tag)
            return real(nbytes, tag)

        def allocate_many(nbytes, n, tag=None):
            room(nbytes * n, tag)
            return real_many(nbytes, n, tag)
        monkeypatch.setattr(pool, "allocate", allocate)
        monkeypatch.setattr(pool, "allocate_many", allocate_many)
        assert m.generate(b, max_new_tokens=20, stop=[]).token_ids == want_b.token_ids
        eng = Engine(m, max_batch=4, prefill_chunk=96, serial_rows=0)
        with m.lock:
            ra = eng.submit(a, max_new_tokens=5, stop=[])
            rb = eng.submit(b, max_new_tokens=20, stop=[])
            eng.start()
        try:
            assert ra.result(timeout=60).finish_reason == "length"
            got = rb.result(timeout=60)
        finally:
            eng.stop()
        assert got.token_ids == want_b.token_ids
    finally:
        tinyloop.free_model(m)


def test_a_prepare_for_more_rows_while_a_batch_is_in_flight_keeps_its_buffers(
        eos_model_path, monkeypatch):
    """decode_batch_prepare says it runs while another batch is in flight. A prepare for more
    rows than the captured batch's buffers hold grows them (``DecodeGraphs.batch_buffers``:
    the old logits block freed, a larger one taken), so the in-flight batch's logits, which
    its finish reads (the sampled rows draw from them), are memory the pool handed out again
    (on the NumPy pool the new block starts where the freed one did). Its buffers must stay
    its own until the finish (or the prepare must refuse)."""
    m = _load(eos_model_path, True, monkeypatch, max_seq_len=64)
    caches = [m.new_kv_cache(2, 16) for _ in range(6)]
    try:
        g = decode_graphs(m)
        for c in caches:
            m.forward(np.array([3, 4], np.int32), 0, 2, c)
        with m.lock:
            pending = m.decode_batch_start(caches[:1], [5], [2], 2,
                                           sampling=[(0.9, 0, 1.0, 0.3)], graphs=g)
            held = g.batch_logits
            assert np.shares_memory(pending.logits, held)
            try:
                m.decode_batch_prepare(caches[1:], [2] * 5, 2, graphs=g)
            except tinyloop.errors.ConfigError:
                pass                           # refusing is a fix too
            finally:
                m.decode_batch_finish(pending)
            assert g.batch_logits is held or not np.shares_memory(pending.logits,
                                                                  g.batch_logits)
    finally:
        for c in caches:
            c.release()
        tinyloop.free_model(m)


# -- checks that hold --------------------------------------------------------------------------

@pytest.mark.parametrize("graphs", [False, True])
def test_random_schedules_give_every_request_its_solo_run(eos_model_path, monkeypatch,
                                                          graphs):
    """Random mixes (EOS mid-run, stop strings, lengths 1 to 19, sampling, penalties, depths,
    kv modes) on random engine shapes (max_batch 1..6, serial_rows 0..3, prefill chunks):
    each request gives its solo run, the counters are right and the memory returns."""
    m = _load(eos_model_path, graphs, monkeypatch)
    try:
        reasons = collections.Counter()
        for seed in range(12):
            jobs = _random_jobs(m, seed, 10)
            want = [_solo(m, *j) for j in jobs]
            reasons.update(w.finish_reason for w, _ in want)
            rng = np.random.default_rng(1000 + seed)
            kw = dict(max_batch=int(rng.integers(1, 7)), serial_rows=int(rng.integers(0, 4)),
                      prefill_chunk=int(rng.choice([8, 16, 64])))
            got, st, eng = _serve(m, jobs, **kw)
            _check_solo(got, want, st, m, eng)
        assert reasons["eos"] >= 3 and reasons["stop"] >= 10 and reasons["length"] >= 10
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("graphs", [False, True])
def test_stops_at_the_first_tokens_and_several_in_one_step(eos_model_path, monkeypatch,
                                                           graphs):
    """Stop strings completed by the prefill's token, by the first and second decoded tokens,
    and by the same step's token in four requests at once; max_new_tokens 1 and 2; every
    request gives its solo run (the in-flight stops drop their next token)."""
    m = _load(eos_model_path, graphs, monkeypatch)
    try:
        rng = np.random.default_rng(21)
        jobs = []
        while len(jobs) < 12:
            p = rng.integers(1, 256, int(rng.integers(2, 20))).tolist()
            res = m.generate(p, max_new_tokens=10, stop=[])
            if res.finish_reason != "length":
                continue
            texts = [m.tokenizer.decode([t]) for t in res.token_ids]
            i = len(jobs) % 4                   # the token index the stop string ends at
            ch = texts[i][:1] if i < 3 else texts[5][:1]
            if not ch or ch == "\ufffd" or any(ch in t for t in texts[:(i if i < 3 else 5)]):
                continue
            jobs.append((p, 10, dict(stop=[ch])))
        jobs += [(jobs[0][0], 1, dict(stop=[])), (jobs[1][0], 2, dict(stop=[])),
                 (jobs[2][0], 1, dict(stop=jobs[2][2]["stop"])),
                 (jobs[3][0], 2, dict(temperature=0.8, seed=4, stop=[]))]
        want = [_solo(m, *j) for j in jobs]
        assert [len(w.token_ids) for w, _ in want[:4]] == [1, 2, 3, 6]
        assert sum(w.finish_reason == "stop" and len(w.token_ids) == 6 for w, _ in want) >= 3
        for serial_rows in (0, 2):
            got, st, eng = _serve(m, jobs, max_batch=16, prefill_chunk=64,
                                  serial_rows=serial_rows)
            _check_solo(got, want, st, m, eng)
    finally:
        tinyloop.free_model(m)


def test_eos_mid_batch_on_the_captured_batch(eos_model_path, monkeypatch):
    """Requests that sample EOS at different steps of a captured batch (greedy and sampled)
    end "eos" with their solo pieces (the EOS releases a held piece), while the rest go on
    and the steady steps keep launching prepared batches."""
    m = _load(eos_model_path, True, monkeypatch)
    try:
        rng = np.random.default_rng(5)
        eos_jobs, other = [], []
        for s in range(400):
            p = rng.integers(1, 256, int(rng.integers(3, 25))).tolist()
            kw = dict(temperature=1.0, seed=s, stop=[]) if s % 2 else dict(stop=[])
            res = m.generate(p, max_new_tokens=16, **kw)
            if res.finish_reason == "eos" and len(res.token_ids) >= 2:
                if len({len(r.token_ids) for _, _, r in eos_jobs} | {len(res.token_ids)}) \
                        > len(eos_jobs):
                    eos_jobs.append((p, kw, res))
            elif res.finish_reason == "length" and len(other) < 3:
                other.append((p, kw, res))
            if len(eos_jobs) >= 3 and len(other) >= 3:
                break
        assert len(eos_jobs) >= 3, "no EOS samples mid-run: pick another EOS id"
        jobs = [(p, 16, kw) for p, kw, _ in eos_jobs + other]
        want = [_solo(m, *j) for j in jobs]
        used = record_prepared(monkeypatch)
        got, st, eng = _serve(m, jobs, max_batch=8, prefill_chunk=96, serial_rows=0)
        _check_solo(got, want, st, m, eng)
        assert sum(p for _, p in used) >= len(used) // 2
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("graphs", [False, True])
def test_cancels_from_another_thread_end_only_their_requests(eos_model_path, monkeypatch,
                                                             graphs):
    """A thread cancels a third of the requests at random moments while batched (and
    prepared) steps run: each cancel returns with the request done; a cancelled request's
    ids and pieces are a prefix of its solo run's; every other request gives its solo run;
    no page stays allocated and the counters count exactly the tokens the requests kept."""
    m = _load(eos_model_path, graphs, monkeypatch)
    try:
        for seed in range(4):
            jobs = [(p, max(n, 30) if i % 2 else n, kw)
                    for i, (p, n, kw) in enumerate(_random_jobs(m, 50 + seed, 12))]
            want = [_solo(m, *j) for j in jobs]
            rnd = random.Random(seed)
            eng = Engine(m, max_batch=rnd.randint(2, 8), serial_rows=rnd.randint(0, 3),
                         prefill_chunk=16)
            with m.lock:
                reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
                eng.start()
            faults = []

            def killer():
                for r in reqs[::3]:
                    time.sleep(rnd.random() * 0.004)
                    try:
                        r.cancel()
                        if r.state != "done" or not r.done:
                            faults.append(("not done after cancel", r.id))
                    except Exception as e:      # noqa: BLE001 - any escape is the fault
                        faults.append(repr(e))
            got, st = _serve_beside(eng, reqs, killer)
            assert faults == []
            for (res, pieces), (w, wp) in zip(got, want):
                if res.finish_reason == "cancelled":
                    assert res.token_ids == w.token_ids[:len(res.token_ids)]
                    assert pieces == wp[:len(pieces)]
                else:
                    assert (res.token_ids, res.text, res.finish_reason, pieces) == \
                        (w.token_ids, w.text, w.finish_reason, wp)
            assert st["generated_tokens"] == sum(len(r.token_ids) + (r.finish_reason == "eos")
                                                 for r, _ in got)
            assert m.pool.by_tag().get("kv_cache", 0) == 0
            assert allocated_outside_graphs(m.pool) == eng.baseline_allocated
    finally:
        tinyloop.free_model(m)


def test_stop_while_prepared_steps_run_frees_everything(eos_model_path, monkeypatch):
    """Engine.stop() while batched, prepared steps run: every request ends (cancelled, or
    its own end if the tokens it had accepted end it) with a prefix of its solo ids, the
    engine thread ends, and the bytes outside tag graphs return to the baseline."""
    m = _load(eos_model_path, True, monkeypatch)
    try:
        jobs = [(list(range(1 + i, 12 + 2 * i)), 60, dict(stop=[])) for i in range(6)]
        want = [m.generate(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
        eng = Engine(m, max_batch=6, serial_rows=0).start()
        reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
        first = next(iter(reqs[-1]))
        assert first.token_id == want[-1].token_ids[0]
        eng.stop(timeout=30)
        assert not eng.running
        for r, w in zip(reqs, want):
            res = r.result(timeout=5)
            assert res.token_ids == w.token_ids[:len(res.token_ids)]
            assert res.finish_reason in ("cancelled", w.finish_reason)
        assert m.pool.by_tag().get("kv_cache", 0) == 0
        assert allocated_outside_graphs(m.pool) == eng.baseline_allocated
    finally:
        tinyloop.free_model(m)


def test_direct_generate_between_prepared_steps_changes_no_ones_tokens(eos_model_path,
                                                                       monkeypatch):
    """Direct generate calls from another thread (the captured single-row step, and a
    five-row decode_batch of the model's own) run between the engine's prepared steps: both
    give their solo results and so does every engine request."""
    m = _load(eos_model_path, True, monkeypatch)
    try:
        jobs = [(list(range(3 + i, 20 + i)), 24, dict(stop=[], temperature=0.9, seed=i))
                for i in range(5)]
        want = [_solo(m, *j) for j in jobs]
        direct = [(list(range(100 + i, 110 + i)), 12) for i in range(3)]
        want_direct = [m.generate(p, max_new_tokens=n, stop=[]).token_ids for p, n in direct]
        caches = [m.new_kv_cache(1, 8) for _ in range(5)]
        for c in caches:
            m.forward(np.array([7, 8], np.int32), 0, 1, c)
        side_kv = m.pool.by_tag()["kv_cache"]
        greedy = [(0.0, 0, 1.0, 0.0)] * 5
        want_batch = m.decode_batch(caches, [9] * 5, [2] * 5, 1, sampling=greedy,
                                    graphs=decode_graphs(m))
        out, faults = [], []

        def side():
            try:
                for p, n in direct:
                    out.append(m.generate(p, max_new_tokens=n, stop=[]).token_ids)
                    out.append(m.decode_batch(caches, [9] * 5, [2] * 5, 1, sampling=greedy,
                                              graphs=decode_graphs(m)))
            except Exception as e:          # noqa: BLE001 - any escape is the fault
                faults.append(repr(e))
        eng = Engine(m, max_batch=5, serial_rows=0, prefill_chunk=8)
        with m.lock:
            reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
            eng.start()
        got, st = _serve_beside(eng, reqs, side)
        try:
            assert faults == []
            assert out[0::2] == want_direct and all(b == want_batch for b in out[1::2])
            _check_solo(got, want, st, m, eng, kv_base=side_kv)   # the side caches live on
        finally:
            for c in caches:
                c.release()
    finally:
        tinyloop.free_model(m)


def test_the_prefix_pool_with_prepared_steps_and_eviction(eos_model_path, monkeypatch):
    """Requests sharing prompt prefixes through a small PrefixPool (entries evicted while
    others decode) on the captured batch path: each gives its solo run without the pool,
    and after stop only the pool's entries hold bytes beyond the baseline."""
    m = _load(eos_model_path, True, monkeypatch)
    try:
        rng = np.random.default_rng(9)
        stems = [rng.integers(1, 256, 36).tolist() for _ in range(3)]
        jobs = [(stems[i % 3] + rng.integers(1, 256, int(rng.integers(1, 6))).tolist(), 10,
                 dict(stop=[]) if i % 2 else dict(temperature=0.8, seed=i, stop=[]))
                for i in range(9)]
        want = [_solo(m, *j) for j in jobs]
        with PrefixPool(m, max_bytes="160K") as pool:     # two entries of ~75K
            got, st, eng = _serve(m, jobs, max_batch=4, prefill_chunk=16, serial_rows=0,
                                  prefix_pool=pool)
            assert pool.stats()["hits"] > 0 and pool.stats()["evictions"] > 0
            for (res, pieces), (w, wp) in zip(got, want):
                assert (res.token_ids, res.text, res.finish_reason, pieces) == \
                    (w.token_ids, w.text, w.finish_reason, wp)
            assert m.pool.by_tag().get("kv_cache", 0) == 0
            assert allocated_outside_graphs(m.pool) == \
                eng.baseline_allocated + m.pool.by_tag().get("prefix_cache", 0)
    finally:
        tinyloop.free_model(m)


def test_a_model_freed_while_served_ends_requests_and_refuses_cleanly(
        eos_model_path, monkeypatch):
    """free_model while prepared steps run: every request ends (its solo ids' prefix, or
    ModelFreedError carrying a partial, not the HandleError of a cache free_model released),
    none hangs, a later submit ends with an error, stop() returns (and again is a no-op), and
    a new engine refuses the freed model."""
    m = _load(eos_model_path, True, monkeypatch)
    jobs = [(list(range(1 + i, 12 + i)), 60, dict(stop=[])) for i in range(4)]
    want = [m.generate(p, max_new_tokens=n, **kw).token_ids for p, n, kw in jobs]
    eng = Engine(m, max_batch=4, serial_rows=0).start()
    reqs = [eng.submit(p, max_new_tokens=n, **kw) for p, n, kw in jobs]
    next(iter(reqs[0]))
    tinyloop.free_model(m)
    for r, w in zip(reqs, want):
        try:
            ids = r.result(timeout=30).token_ids
        except tinyloop.errors.TinyLoopError as e:
            assert isinstance(e, tinyloop.errors.ModelFreedError), repr(e)
            ids = e.partial.token_ids
        assert ids == w[:len(ids)]
    with pytest.raises(tinyloop.errors.TinyLoopError):
        eng.submit([1, 2], max_new_tokens=3).result(timeout=30)
    eng.stop(timeout=30)
    assert not eng.running
    eng.stop()
    with pytest.raises(tinyloop.errors.ModelFreedError):
        Engine(m).start()
