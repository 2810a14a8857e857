"""Replicas behind one router (``tinyloop serve --replicas N``) on the NumPy backend: worker
processes of a tiny model on loopback ports, the official ``openai`` client against the
router (both APIs, streamed and not, greedy text equal to the solo run), the prefix-affinity
routing, /metrics with a ``replica`` label, a worker killed mid-load (its requests retried
or failed naming it, none hanging; it comes back; the survivors' allocated bytes return to
their baseline) and a shutdown that leaves no worker process."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx2 = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

import tinyloop  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.serve.http import ServerThread  # noqa: E402
from tinyloop.serve.replica import ReplicaSpec  # noqa: E402
from tinyloop.serve.router import (FAILED_HEADER, REPLICA_HEADER, PrefixIndex,  # noqa: E402
                                   RESTART_BACKOFF_MAX_S, ReplicaSet, block_keys,
                                   choose, create_router_app, load_tokenizer,
                                   restart_delay)

from .replica_helpers import _allocated, _replica_metrics, _wait  # noqa: E402

MAX_SEQ_LEN = 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tinyloop.__file__)))


@pytest.fixture(scope="module")
def solo(chat_model_path):
    """The model loaded in this process: the solo runs the replicas must equal."""
    m = tinyloop.load_model(chat_model_path, max_seq_len=MAX_SEQ_LEN, backend="numpy")
    yield m
    tinyloop.free_model(m)


@pytest.fixture(scope="module")
def cluster(chat_model_path):
    """(ReplicaSet of 3 workers, router app, router server, openai client)."""
    spec = ReplicaSpec(model=chat_model_path, backend="numpy", max_seq_len=MAX_SEQ_LEN,
                       max_batch=8, max_queue=64, model_name="tiny", engine_prefill_chunk=32)
    with ReplicaSet(spec, 3, health_interval_s=0.2, stop_timeout_s=10) as rs:
        app = create_router_app(rs, "tiny", load_tokenizer(chat_model_path),
                                read_timeout_s=60)
        with ServerThread(app) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                   timeout=60)
            yield rs, app, srv, client


def _prompt(i: int, n: int = 40) -> str:
    """A prompt of n letters; different i < 676: different first two letters, so a different
    first block (letter j is 7 r + 3 j + j // 5 + q (j + 1) mod 26 for i = 26 q + r: two
    prompts agreeing on letters 0 and 1 agree on q, then, 7 being invertible mod 26, on r)."""
    q, r = divmod(i, 26)
    return "".join(chr(97 + (r * 7 + j * 3 + j // 5 + q * (j + 1)) % 26) for j in range(n))


# -- the pure routing rule ------------------------------------------------------------------

def test_block_keys_chain_the_prefix():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    ka, kb = block_keys(a, 16), block_keys(b, 16)
    assert len(ka) == 2 and len(block_keys(a[:15], 16)) == 0
    assert ka == kb                           # the first 32 ids agree: both full blocks
    c = [7] + list(range(1, 40))
    kc = block_keys(c, 16)
    assert kc[0] != ka[0] and kc[1] != ka[1]  # a change in block 0 changes every later key


def test_prefix_index_matches_leading_blocks_and_forgets_the_oldest():
    idx = PrefixIndex(2, max_blocks=3)
    k = block_keys(list(range(64)), 16)       # 4 keys
    idx.insert(1, k[:2])
    assert idx.match(k) == [0, 2]
    assert idx.match([k[1]]) == [0, 1] and idx.match(k[1:]) == [0, 1]
    idx.insert(1, k)                          # 4 keys into 3 places: k[0] goes
    assert idx.match(k) == [0, 0] and idx.match(k[1:]) == [0, 3]
    idx.clear(1)
    assert idx.match(k) == [0, 0]


@pytest.mark.parametrize("loads, matched, up, served, want", [
    ([0, 0, 0], [0, 0, 0], [True] * 3, [5, 2, 7], (1, False)),      # least served among idle
    ([3, 1, 2], [0, 0, 0], [True] * 3, None, (1, False)),           # least loaded
    ([3, 1, 2], [0, 0, 2], [True] * 3, None, (2, True)),            # the longest prefix
    ([3, 1, 2], [1, 0, 2], [True, True, False], None, (0, True)),   # down: the next longest
    ([40, 1, 2], [2, 0, 0], [True] * 3, None, (1, False)),          # too far above the least
    ([1, 1], [0, 0], [False, False], None, None),                   # none up
])
def test_choose_follows_the_affinity_then_the_load(loads, matched, up, served, want):
    assert choose(loads, matched, up, served, balance_abs=32) == want


# -- the cluster ----------------------------------------------------------------------------

def test_both_apis_through_the_router_equal_the_solo_run(cluster, solo):
    rs, app, srv, client = cluster
    prompt = "The quick brown fox"
    want = solo.generate(prompt, max_new_tokens=12).text
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    s = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == want
    msgs = [{"role": "user", "content": "hi there"}]
    ids = solo.tokenizer.apply_chat_template(msgs, tokenize=True)
    want = solo.generate(ids, max_new_tokens=9).text
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9,
                                       temperature=0)
    assert r.choices[0].message.content == want
    s = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s) == want
    # a replica's own 400 passes through, naming the field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_repeated_prefix_lands_on_one_replica_and_distinct_ones_spread(cluster):
    rs, app, srv, client = cluster
    router = app.state.router
    before = [w.requests for w in rs.workers]
    hits0, lookups0 = router.hits, router.lookups
    shared = _prompt(1, 48)                     # three full blocks of 16 byte tokens
    for tail in ("one", "two", "three", "four"):
        client.completions.create(model="tiny", prompt=shared + tail, max_tokens=2,
                                  temperature=0)
    got = [w.requests - b for w, b in zip(rs.workers, before)]
    assert sorted(got) == [0, 0, 4], got        # all four on one replica
    assert (router.hits - hits0, router.lookups - lookups0) == (3, 4)
    # different first blocks: the least loaded / least served replica each time
    before = [w.requests for w in rs.workers]
    for i in range(6):
        client.completions.create(model="tiny", prompt=_prompt(10 + i), max_tokens=2,
                                  temperature=0)
    got = [w.requests - b for w, b in zip(rs.workers, before)]
    assert sum(n >= 1 for n in got) >= 2, got
    # the router's /metrics: its own counters and each replica's figures, labelled
    fams = _replica_metrics(srv.url)
    rate = fams[("tinyloop_router_affinity_hit_rate", ())]
    assert rate == pytest.approx(router.hits / router.lookups)
    for w in rs.workers:
        lab = (("replica", str(w.index)),)
        assert fams[("tinyloop_router_replica_up", lab)] == 1
        weights = fams[("tinyloop_pool_allocated_bytes", (("replica", str(w.index)),
                                                          ("tag", "weights")))]
        assert weights == _replica_metrics(w.url)[("tinyloop_pool_allocated_bytes",
                                                    (("tag", "weights"),))] > 0


def _stream(url, prompt, n, first_chunk, seen: dict, key):
    """A streamed completion read with httpx2: (replica header, text, error message or
    None); ``seen[key]`` is the replica header, and ``first_chunk`` is set, once a text
    event arrived."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True}
    text, err = [], None
    with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                err = ev["error"]["message"]
                break
            text.append(ev["choices"][0]["text"])
            if text[-1]:
                seen[key] = int(r.headers[REPLICA_HEADER])
                first_chunk.set()
        return int(r.headers[REPLICA_HEADER]), "".join(text), err


def test_a_killed_replica_fails_or_retries_its_requests_and_comes_back(cluster, solo):
    """Nine requests, streamed and not by turns, submitted one at a time so each goes to the
    least loaded replica (three each); once every stream has text, SIGKILL a replica that
    holds both kinds: its streams end with an error event naming
    it, its other requests are retried on a survivor and give the solo text, every other
    request gives its solo text, none hangs; it restarts and serves; the survivors'
    allocated bytes return to their baseline."""
    rs, app, srv, client = cluster
    for i in range(6):              # every replica warm, then its baseline with nothing running
        client.completions.create(model="tiny", prompt=_prompt(30 + i), max_tokens=2,
                                  temperature=0)
    _wait(lambda: all(w.in_flight == 0 for w in rs.workers))
    base = {w.index: _allocated(w.url) for w in rs.workers}
    n_new = 600                     # each request outlives the placement of all nine
    prompts = [_prompt(50 + i) for i in range(9)]
    want = [solo.generate(p, max_new_tokens=n_new).text for p in prompts]
    firsts = [threading.Event() for _ in prompts]
    seen = {}

    def plain(p):
        r = client.completions.with_raw_response.create(model="tiny", prompt=p,
                                                        max_tokens=n_new, temperature=0)
        return (int(r.headers[REPLICA_HEADER]), r.parse().choices[0].text,
                r.headers.get(FAILED_HEADER))

    with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
        futs, placed = [], []
        for i, p in enumerate(prompts):
            loads = [w.in_flight for w in rs.workers]
            futs.append(ex.submit(_stream, srv.url, p, n_new, firsts[i], seen, i) if i % 2 == 0
                        else ex.submit(plain, p))
            _wait(lambda: sum(w.in_flight for w in rs.workers) == i + 1, 30,
                  f"request {i} in flight", poll=0.002)
            placed.append(next(w.index for w, n in zip(rs.workers, loads) if w.in_flight > n))
        assert sorted(w.in_flight for w in rs.workers) == [3, 3, 3]
        for i in range(0, len(prompts), 2):
            assert firsts[i].wait(60), f"stream {i} had no text"
            assert seen[i] == placed[i]
        assert not any(f.done() for f in futs)
        # five streams over three replicas of three requests: one holds both kinds
        victim = next(w for w in rs.workers
                      if {i % 2 for i, r in enumerate(placed) if r == w.index} == {0, 1})
        old_pid = victim.pid
        os.kill(old_pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futs]           # none hangs
    n_err = n_retried = 0
    for i, res in enumerate(results):
        if i % 2 == 0:
            rep, text, err = res
            if rep == victim.index:
                assert err is not None and f"replica {victim.index} (pid {old_pid})" in err
                assert want[i].startswith(text)        # what it sent was the solo text
                n_err += 1
            else:
                assert err is None and text == want[i]
        else:
            rep, text, failed = res
            assert rep != victim.index and text == want[i]
            if failed is not None:
                assert failed == str(victim.index)
                n_retried += 1
    assert n_err >= 1 and n_retried >= 1, (n_err, n_retried)
    # it comes back, on a new process, and serves again
    _wait(lambda: victim.state == "up" and victim.pid != old_pid, 60, "the restart")
    assert victim.restarts >= 1
    r = client.completions.create(model="tiny", prompt="after", max_tokens=3, temperature=0)
    assert r.choices[0].text == solo.generate("after", max_new_tokens=3).text
    # the survivors' allocated bytes are back at their baseline
    for w in rs.workers:
        if w is not victim:
            _wait(lambda w=w: w.in_flight == 0 and _allocated(w.url) == base[w.index], 30,
                  f"{w.name}'s allocated bytes back at baseline")
    fams = _replica_metrics(srv.url)
    assert fams[("tinyloop_router_restarts", (("replica", str(victim.index)),))] >= 1


def _cancelled(url: str) -> float:
    """Requests the replicas behind the router at ``url`` ended "cancelled"."""
    return sum(v for (name, labels), v in _replica_metrics(url).items()
               if name == "tinyloop_finished_requests_total"
               and ("reason", "cancelled") in labels)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_through_the_router_frees_the_replicas_pages(cluster, stream):
    """The client closes its connection mid-request: the router drops its call, and the
    replica cancels the request and frees its pages. A non-streamed request's worker is
    stopped (SIGSTOP) across the close, so the request is still decoding when it resumes."""
    rs, app, srv, client = cluster
    _wait(lambda: all(w.in_flight == 0 for w in rs.workers))
    base = {w.index: _allocated(w.url) for w in rs.workers}
    cancelled = _cancelled(srv.url)
    body = {"model": "tiny", "prompt": _prompt(90 + stream), "max_tokens": 900,
            "temperature": 0, "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    stopped = None
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()                         # the first event: it is decoding
    else:
        # polled every 2 ms: the request must still be decoding when its worker stops
        _wait(lambda: sum(w.in_flight for w in rs.workers) == 1, 30, "the request in flight",
              poll=0.002)
        stopped = next(w for w in rs.workers if w.in_flight == 1)
        # the replica's engine holds it (queued or admitted), so the close reaches a request
        # (its finished-requests counters would count earlier tests' requests too)
        _wait(lambda: sum(_replica_metrics(stopped.url).get((name, ()), 0)
                          for name in ("tinyloop_active_requests", "tinyloop_queue_length"))
              == 1, 30, "the request admitted", poll=0.002)
        os.kill(stopped.pid, signal.SIGSTOP)
    try:
        conn.sock.close()                       # the client leaves
        conn.close()
        _wait(lambda: all(w.in_flight == 0 for w in rs.workers), 30, "the router's count")
    finally:
        if stopped is not None:
            os.kill(stopped.pid, signal.SIGCONT)
    for w in rs.workers:
        _wait(lambda w=w: _allocated(w.url) == base[w.index], 30,
              f"{w.name}'s allocated bytes back at baseline")
    _wait(lambda: _cancelled(srv.url) == cancelled + 1, 30, "the replica's cancel")


def test_killing_the_router_process_ends_its_workers(chat_model_path, tmp_path):
    """The workers watch their parent: a router killed with SIGKILL leaves none behind."""
    code = (f"import sys, time; sys.path.insert(0, {ROOT!r})\n"
            "from tinyloop.serve.replica import ReplicaSpec\n"
            "from tinyloop.serve.router import ReplicaSet\n"
            f"rs = ReplicaSet(ReplicaSpec(model={chat_model_path!r}, backend='numpy', "
            "max_seq_len=64), 2).start()\n"
            "print(' '.join(str(w.pid) for w in rs.workers), flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    _wait(lambda: not any(_alive(p) for p in pids), 30, "the workers' exit")


def test_the_cli_serves_replicas_and_stops_them_on_sigint(chat_model_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", chat_model_path,
                             "--replicas", "2", "--backend", "numpy", "--max-seq-len", "64",
                             "--port", str(port), "--model-name", "tiny"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx2.get(url + "/health", timeout=5).json().get("replicas_up") == 2
            except httpx2.HTTPError:
                return False
        _wait(up, 120, "the router and its replicas")
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2).choices
        kids = _children(proc.pid)
        assert len(kids) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert not any(_alive(p) for p in kids)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_close_leaves_no_worker_process(chat_model_path):
    spec = ReplicaSpec(model=chat_model_path, backend="numpy", max_seq_len=64)
    rs = ReplicaSet(spec, 2, devices=["3", "5"], health_interval_s=0.2).start()
    pids = [w.pid for w in rs.workers]
    try:
        # pinned by CUDA_VISIBLE_DEVICES in each worker's environment, as given
        for w, dev in zip(rs.workers, ["3", "5"]):
            with open(f"/proc/{w.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert env[b"CUDA_VISIBLE_DEVICES"] == dev.encode()
            assert httpx2.get(w.url + "/health", timeout=10).json() == {"status": "ok"}
    finally:
        rs.close()
    for w, pid in zip(rs.workers, pids):
        assert w.proc.returncode == 0, w.proc.returncode     # a clean stop, not a kill
        assert not os.path.exists(f"/proc/{pid}"), pid       # reaped: no child left
        assert w.state == "stopped"


def test_restart_delay_backs_off_exponentially():
    assert restart_delay(0, 0.5) == 0.0                  # it was up: at once
    assert [restart_delay(k, 0.5) for k in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert restart_delay(40, 0.5) == RESTART_BACKOFF_MAX_S


def test_a_worker_that_cannot_restart_backs_off_then_returns(chat_model_path, tmp_path):
    """The model file goes away and the worker is killed: each restart fails, waits longer
    (down between tries), and once the file is back the worker comes up again."""
    path = tmp_path / "m.tlm"
    path.write_bytes(open(chat_model_path, "rb").read())
    spec = ReplicaSpec(model=str(path), backend="numpy", max_seq_len=64)
    with ReplicaSet(spec, 1, health_interval_s=0.1) as rs:
        w = rs.workers[0]
        path.rename(tmp_path / "away.tlm")
        os.kill(w.pid, signal.SIGKILL)
        _wait(lambda: w.failed_starts >= 2, 60, "two failed restarts")
        assert w.state in ("down", "starting")
        (tmp_path / "away.tlm").rename(path)
        _wait(lambda: w.state == "up", 60, "the worker back up")
        assert w.restarts >= 3
        assert httpx2.get(w.url + "/health", timeout=10).status_code == 200


def test_a_worker_that_cannot_load_fails_start_naming_it(tmp_path):
    bad = tmp_path / "missing.tlm"
    spec = ReplicaSpec(model=str(bad), backend="numpy", max_seq_len=64)
    with pytest.raises(ConfigError, match=r"replica 0 .*did not start: .*missing\.tlm"):
        ReplicaSet(spec, 1, start_timeout_s=60).start()


@pytest.mark.parametrize("kw, word", [(dict(replicas=0), "replicas"),
                                      (dict(replicas=2, devices=["a"]), "devices")])
def test_replica_set_refuses_bad_arguments_by_name(chat_model_path, kw, word):
    spec = ReplicaSpec(model=chat_model_path, backend="numpy", max_seq_len=64)
    with pytest.raises(ConfigError, match=word):
        ReplicaSet(spec, **kw)


def test_device_ids_take_lists_and_comma_strings():
    """One rule for device ids (ReplicaSet's devices, the CLI's --devices): ints or digit
    strings, or one string of them separated by commas; anything else names the argument."""
    from tinyloop.serve.replica import device_ids
    assert device_ids([0, "3", " 1 "]) == ["0", "3", "1"]
    assert device_ids("2, 0") == ["2", "0"]
    for bad in ([], "", "0,", "-1", ["a"], [1.5]):
        with pytest.raises(ConfigError, match=r"^--devices must be device ids \(0,1,...\), "
                                              r"got " + re.escape(repr(bad)) + "$"):
            device_ids(bad, "--devices")


def test_replica_spec_round_trips_and_checks():
    s = ReplicaSpec(model="/x.tlm", backend="numpy", max_batch=3, kv_budget="1M")
    assert ReplicaSpec.from_json(s.to_json()) == s and s.name == "x"
    with pytest.raises(ConfigError, match="max_batch"):
        ReplicaSpec(model="/x.tlm", max_batch=0)
    with pytest.raises(ConfigError, match="replica spec"):
        ReplicaSpec.from_json(json.dumps({"model": "/x.tlm", "bogus": 1}))


def test_a_stalled_worker_times_out_answers_503_and_is_replaced(chat_model_path, solo):
    """SIGSTOP the only worker: a request to it gives up at the read timeout with 503
    naming it (no other replica to retry on), the failed health checks kill it, it restarts
    and serves the solo text. The health checks may kill it only once the router has chosen
    it for the request: a kill before that would answer "no replica is up" instead, and
    after it the read timeout and the kill give the same answer, whichever comes first."""
    spec = ReplicaSpec(model=chat_model_path, backend="numpy", max_seq_len=64,
                       model_name="tiny")
    with ReplicaSet(spec, 1, health_interval_s=0.2, health_timeout_s=0.5,
                    health_failures=10 ** 9) as rs:
        app = create_router_app(rs, "tiny", load_tokenizer(chat_model_path), read_timeout_s=1)
        with ServerThread(app) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                   timeout=30)
            w = rs.workers[0]
            old_pid = w.pid
            os.kill(old_pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with ThreadPoolExecutor(max_workers=1) as ex:
                fut = ex.submit(client.completions.create, model="tiny", prompt="x",
                                max_tokens=2)
                _wait(lambda: w.in_flight == 1 or fut.done(), 30, "the request at the router",
                      poll=0.002)
                rs.health_failures = 2              # from now on the health checks kill it
                with pytest.raises(openai.InternalServerError) as e:
                    fut.result(timeout=60)
            assert time.monotonic() - t0 < 20
            assert e.value.status_code == 503
            assert f"replica 0 (pid {old_pid})" in e.value.message
            assert e.value.body["code"] == "replica_failed"
            _wait(lambda: w.state == "up" and w.pid != old_pid, 60, "the replacement")
            r = client.completions.create(model="tiny", prompt="back", max_tokens=3,
                                          temperature=0)
            assert r.choices[0].text == solo.generate("back", max_new_tokens=3).text
        assert not os.path.exists(f"/proc/{old_pid}")


def test_no_replica_up_answers_503(chat_model_path):
    spec = ReplicaSpec(model=chat_model_path, backend="numpy", max_seq_len=64)
    with ReplicaSet(spec, 1, health_interval_s=0.2, restart=False) as rs:
        app = create_router_app(rs, "tiny")
        with ServerThread(app) as srv:
            os.kill(rs.workers[0].pid, signal.SIGKILL)
            _wait(lambda: rs.workers[0].state == "down", 30, "the worker marked down")
            r = httpx2.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert r.status_code == 503 and "no replica is up" in r.json()["error"]["message"]
            assert httpx2.get(srv.url + "/health", timeout=10).status_code == 503


def test_the_router_reads_bodies_with_the_servers_limits(cluster, chat_model_path):
    """A body that never arrives whole answers 408 past body_timeout_s (it held the
    router's connection forever), one past MAX_BODY_BYTES 413 unread, and a body nesting too
    deeply for json goes to a replica, which answers 400 (the router's own parse raised
    RecursionError: a bare 500)."""
    from tinyloop.serve.http import MAX_BODY_BYTES

    from .test_http import _slow_body
    rs, app, srv, client = cluster
    quick_app = create_router_app(rs, "tiny", load_tokenizer(chat_model_path),
                                  body_timeout_s=0.3)
    with ServerThread(quick_app) as quick:
        status, out = _slow_body(quick.port)
        assert status == 408 and "within 0.3 s" in out["error"]["message"]
    # a client leaving mid-body is counted 499 (the router's own ClientGone hid the error)
    key = ("tinyloop_router_requests_total",
           (("replica", "none"), ("route", "/v1/completions"), ("status", "499")))
    before = _replica_metrics(srv.url).get(key, 0)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    _wait(lambda: _replica_metrics(srv.url).get(key, 0) == before + 1, 30, "the 499")
    r = httpx2.post(srv.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                    headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
    r = httpx2.post(srv.url + "/v1/completions", content=b" " * (MAX_BODY_BYTES + 1),
                    headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_the_router_forwards_what_it_cannot_tokenize_and_a_huge_prompt_quickly(cluster):
    """A lone surrogate in a prompt or message raised a TypeError in the router's own
    tokenizing (a bare 500): routed by load, the replica answers 400 naming the field. A
    3 MB prompt is tokenized only ROUTE_TEXT_CHARS far for the routing, and the replica
    refuses it by its length, without encoding it (check_text_length)."""
    rs, app, srv, client = cluster
    for path, body, param in [
            ("/v1/completions", {"prompt": "a\ud800"}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
             "messages[0].content")]:
        r = httpx2.post(srv.url + path, content=json.dumps({"model": "tiny", **body}),
                        headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    t0 = time.monotonic()
    r = httpx2.post(srv.url + "/v1/completions", timeout=60,
                    json={"model": "tiny", "prompt": "ab " * 1_000_000, "max_tokens": 1})
    assert r.status_code == 400 and "character limit" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 30
    assert all(w.state == "up" for w in rs.workers)
