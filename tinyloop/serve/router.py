"""Several replicas behind one endpoint: worker processes, a prefix-affinity router, restarts.

``tinyloop serve --replicas N``: :class:`ReplicaSet` starts N worker processes
(``replica.worker_main``, each a :class:`~tinyloop.serve.replica.Replica` on its
own loopback port, pinned to its device by ``CUDA_VISIBLE_DEVICES`` in its environment, so
CuPy sees that one device from its first import; on the NumPy backend nothing is pinned), and
:func:`create_router_app` forwards the OpenAI routes to them with an async HTTP client
(httpx2, the maintained continuation of httpx that the ``openai`` client itself uses).

**Routing** (the rule of SGLang's cache-aware router, over hashed blocks as vLLM's prefix
cache keys them): the router tokenizes the prompt (a chat request through the chat template)
and cuts its ids into blocks of ``block_tokens``; block i's key hashes block i's ids with
block i-1's key, so one key stands for the whole prefix up to it. :class:`PrefixIndex` keeps,
per replica, the keys of the prompts routed to it (least recently used dropped past
``max_blocks``), an approximation of what that replica's PrefixPool holds that needs no call
to it. A request goes to the replica that matches the most leading blocks of its prompt,
unless that replica's in-flight count exceeds the least loaded one's by more than
``balance_abs`` (then, and when no replica matches a block, to the least loaded: fewest
requests in flight, ties to the one sent fewest requests so far, then the lowest index);
its keys are then recorded for that replica. A replica that restarts starts with an empty
index (its PrefixPool is new). Balance threshold and block size follow SGLang's router
defaults (``balance_abs_threshold`` 32) and vLLM's block size (16).

**Faults**: a supervisor thread polls each worker (its process's exit status, and ``GET
/health`` with a timeout; ``health_failures`` failed checks in a row kill it) and restarts a
dead one. A request whose replica fails before any of its answer reached the client (the
connection refused or cut before the response, or before a streamed response's first event)
is retried on another replica, at most ``retries`` times; after that, or when no replica is
up, it answers 503 with OpenAI's error object naming the replica. A stream cut after its
first event ends with an SSE error event naming the replica. A response names the replica
that answered in its ``x-tinyloop-replica`` header, and those that failed before it in
``x-tinyloop-failed-replicas``. Every call to a replica has a
connect / read timeout, so no request waits on a stopped worker forever.

``/metrics`` (Prometheus text): ``tinyloop_router_requests{replica, route, status}``,
``tinyloop_router_in_flight{replica}``, ``tinyloop_router_replica_up{replica}``,
``tinyloop_router_restarts{replica}``, ``tinyloop_router_affinity_lookups`` /
``_hits`` and ``tinyloop_router_affinity_hit_rate``, and every replica's own metrics (memory
by tag, tokens, time to first token...) with a ``replica`` label added.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from ..config import child_environment
from ..errors import ConfigError
from .http import BODY_TIMEOUT_S, DISCONNECT_POLL_S, BodyError, read_body
from .replica import READY_KEY, ReplicaSpec, device_ids

BLOCK_TOKENS = 16            # prompt ids per PrefixIndex key
MAX_INDEX_BLOCKS = 1 << 16   # keys kept per replica (least recently used dropped)
BALANCE_ABS = 32             # in-flight requests the affinity may add over the least loaded
HEALTH_INTERVAL_S = 1.0      # supervisor poll period
HEALTH_TIMEOUT_S = 2.0       # one /health call
HEALTH_FAILURES = 3          # failed /health calls in a row that kill a worker
START_TIMEOUT_S = 300.0      # a worker's load and start
RESTART_BACKOFF_MAX_S = 30.0  # the longest wait before restarting a worker that died starting
STOP_TIMEOUT_S = 15.0        # a worker's graceful stop after SIGTERM, before SIGKILL
CONNECT_TIMEOUT_S = 5.0      # a forwarded call's connect
READ_TIMEOUT_S = 300.0       # a forwarded call's wait for the next bytes
METRICS_TIMEOUT_S = 2.0      # one replica's /metrics, for the aggregate

ROUTES = ("/v1/completions", "/v1/chat/completions")
REPLICA_HEADER = "x-tinyloop-replica"          # the replica that answered
FAILED_HEADER = "x-tinyloop-failed-replicas"   # those that failed before it (retries)

# a worker process's program (-c: ``-m tinyloop.serve.replica`` would import the module twice,
# once through the package)
WORKER_CODE = ("import sys; from tinyloop.serve.replica import worker_main; "
               "sys.exit(worker_main(sys.argv[1:]))")


def block_keys(ids, block_tokens: int = BLOCK_TOKENS) -> list:
    """The chained keys of the full blocks of ``ids`` (a sequence of ints): key i hashes
    (key i-1, ids of block i), so equal keys mean equal prefixes up to that block."""
    keys, prev = [], None
    for b in range(len(ids) // block_tokens):
        prev = hash((prev, tuple(int(t) for t in ids[b * block_tokens:(b + 1) * block_tokens])))
        keys.append(prev)
    return keys


def restart_delay(failed_starts: int, interval_s: float) -> float:
    """Seconds before restarting a worker that exited after ``failed_starts`` exits in a
    row before it was up: none for a worker that was up, then ``interval_s * 2**k`` up to
    RESTART_BACKOFF_MAX_S (exponential backoff)."""
    if failed_starts <= 0:
        return 0.0
    return min(RESTART_BACKOFF_MAX_S, interval_s * 2.0 ** failed_starts)


class PrefixIndex:
    """Per replica, the block keys of the prompts routed to it, least recently used dropped
    past ``max_blocks`` (see the module doc). Not thread-safe: the router's event loop owns
    it."""

    def __init__(self, n_replicas: int, max_blocks: int = MAX_INDEX_BLOCKS):
        self.max_blocks = max_blocks
        self.sets = [collections.OrderedDict() for _ in range(n_replicas)]

    def match(self, keys: list) -> list[int]:
        """The leading blocks of ``keys`` each replica holds."""
        out = []
        for s in self.sets:
            n = 0
            for k in keys:
                if k not in s:
                    break
                n += 1
            out.append(n)
        return out

    def insert(self, replica: int, keys: list) -> None:
        s = self.sets[replica]
        for k in keys:
            s[k] = None
            s.move_to_end(k)
        while len(s) > self.max_blocks:
            s.popitem(last=False)

    def clear(self, replica: int) -> None:
        self.sets[replica].clear()


def choose(loads: list[int], matched: list[int], up: list[bool], served=None,
           balance_abs: int = BALANCE_ABS):
    """(replica index, whether the prefix affinity chose it) by the module doc's rule, over
    the replicas that are ``up``: ``loads`` in-flight requests, ``matched`` leading prompt
    blocks held, ``served`` requests sent so far (None: all 0); None when none is up."""
    cand = [i for i in range(len(loads)) if up[i]]
    if not cand:
        return None
    served = [0] * len(loads) if served is None else served
    least = min(cand, key=lambda i: (loads[i], served[i], i))
    best = max(cand, key=lambda i: (matched[i], -loads[i], -served[i], -i))
    if matched[best] > 0 and loads[best] - loads[least] <= balance_abs:
        return best, True
    return least, False


class Worker:
    """One replica's worker process as the router sees it: ``index``, ``device`` (the
    CUDA_VISIBLE_DEVICES value, or None), ``state`` ("starting" | "up" | "down" |
    "stopped"), ``port`` / ``url`` once up, ``proc`` (subprocess.Popen), ``restarts``,
    ``in_flight`` / ``requests`` (the router's counts; its event loop owns them)."""

    def __init__(self, index: int, device):
        self.index, self.device = index, device
        self.state = "down"
        self.proc = None
        self.port = None
        self.error = None
        self.restarts = 0
        self.in_flight = 0
        self.requests = 0
        self.health_failures = 0
        self.started_at = None
        self.failed_starts = 0       # exits before up, in a row (the restart backoff)
        self.respawn_at = None       # monotonic time of the next start while down
        self.generation = 0          # bumps at every start: the index clears on a new one
        self.ready = threading.Event()

    @property
    def url(self):
        return None if self.port is None else f"http://127.0.0.1:{self.port}"

    @property
    def pid(self):
        return None if self.proc is None else self.proc.pid

    @property
    def name(self) -> str:
        return f"replica {self.index}"


class ReplicaSet:
    """N worker processes of one :class:`ReplicaSpec` and the supervisor that restarts them.

    ``ReplicaSet(spec, replicas, devices=None, health_interval_s=1.0, ...)``: ``devices``, a
    list of device ids (replica i gets ``devices[i % len(devices)]`` as its
    CUDA_VISIBLE_DEVICES); None pins replica i to device i unless the backend is numpy. Use
    as a context manager, or :meth:`start` (waits until every worker is up; ConfigError
    naming the worker when one fails to load or start within ``start_timeout_s``) and
    :meth:`close` (SIGTERM, then SIGKILL after ``stop_timeout_s``: no worker is left)."""

    def __init__(self, spec: ReplicaSpec, replicas: int, devices=None, *,
                 health_interval_s: float = HEALTH_INTERVAL_S,
                 health_timeout_s: float = HEALTH_TIMEOUT_S,
                 health_failures: int = HEALTH_FAILURES,
                 start_timeout_s: float = START_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S, restart: bool = True):
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"replicas must be an int >= 1, got {replicas!r}")
        if devices is not None:
            devices = device_ids(devices)
        elif spec.backend != "numpy":
            devices = [str(i) for i in range(replicas)]
        self.spec = spec
        self.workers = [Worker(i, None if devices is None else devices[i % len(devices)])
                        for i in range(replicas)]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.health_failures = health_failures
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.restart = restart
        self._lock = threading.Lock()     # guards each worker's state / proc / port
        self._wake = threading.Event()    # a forwarder suspects a worker: check now
        self._closing = threading.Event()
        self._thread = None

    # -- processes ---------------------------------------------------------------------------
    def _spawn(self, w: Worker) -> None:
        """Start ``w``'s process; a reader thread marks it up on its ready line."""
        env = child_environment({} if w.device is None else {"CUDA_VISIBLE_DEVICES": w.device})
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_CODE, "--spec", self.spec.to_json()],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, text=True)
        with self._lock:
            w.proc, w.port, w.error, w.respawn_at = proc, None, None, None
            w.state, w.health_failures = "starting", 0
            w.started_at = time.monotonic()
            w.generation += 1
            w.ready.clear()
        threading.Thread(target=self._read_ready, args=(w, proc), daemon=True,
                         name=f"tinyloop-replica-{w.index}-stdout").start()

    def _read_ready(self, w: Worker, proc) -> None:
        for line in proc.stdout:          # the ready line, then drain to EOF
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict) or READY_KEY not in msg:
                continue
            with self._lock:
                if w.proc is not proc:
                    continue
                if msg[READY_KEY]:
                    w.port, w.state = int(msg["port"]), "up"
                else:
                    w.error = str(msg.get("error"))
            w.ready.set()
        w.ready.set()

    def _kill(self, w: Worker) -> None:
        """SIGKILL ``w``'s process and reap it."""
        proc = w.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def start(self) -> "ReplicaSet":
        for w in self.workers:
            self._spawn(w)
        try:
            for w in self.workers:
                self._wait_up(w)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name="tinyloop-supervisor")
        self._thread.start()
        return self

    def _wait_up(self, w: Worker) -> None:
        left = self.start_timeout_s - (time.monotonic() - w.started_at)
        w.ready.wait(max(left, 0))
        if w.state != "up":
            rc = w.proc.poll()
            why = w.error or (f"its process exited with status {rc}" if rc is not None
                              else f"it was not up within {self.start_timeout_s} s")
            raise ConfigError(f"{w.name} (device {w.device}) did not start: {why}")

    def close(self) -> None:
        """Stop the supervisor, then every worker (SIGTERM, SIGKILL past the timeout);
        idempotent."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.health_timeout_s + self.health_interval_s + 5)
        for w in self.workers:               # all stop at once, each signalled once
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
            with self._lock:
                w.state = "stopped"

    def __enter__(self) -> "ReplicaSet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- supervision -------------------------------------------------------------------------
    def suspect(self, w: Worker) -> None:
        """A forwarder saw ``w`` fail: check it now rather than at the next poll."""
        self._wake.set()

    def up(self) -> list[bool]:
        with self._lock:
            return [w.state == "up" for w in self.workers]

    def _supervise(self) -> None:
        import httpx2
        with httpx2.Client(timeout=self.health_timeout_s) as client:
            while not self._closing.is_set():
                for w in self.workers:
                    if self._closing.is_set():
                        return
                    self._check(w, client)
                self._wake.wait(self.health_interval_s)
                self._wake.clear()

    def _check(self, w: Worker, client) -> None:
        import httpx2
        now = time.monotonic()
        if w.state in ("up", "starting") and w.proc.poll() is not None:
            rc = w.proc.wait()
            # a worker that dies before it is up waits longer at each try (a model that
            # cannot load does not respawn in a tight loop)
            w.failed_starts = w.failed_starts + 1 if w.state == "starting" else 0
            delay = restart_delay(w.failed_starts, self.health_interval_s)
            print(f"tinyloop router: {w.name} (pid {w.pid}) exited with status {rc}"
                  + (f"; restarting it in {delay:.1f} s" if self.restart else ""),
                  file=sys.stderr, flush=True)
            with self._lock:
                w.state = "down"
            w.respawn_at = now + delay if self.restart else None
        if w.state == "down":
            if w.respawn_at is not None and now >= w.respawn_at:
                w.restarts += 1
                self._spawn(w)
            return
        if w.state == "starting":
            if now - w.started_at > self.start_timeout_s:
                print(f"tinyloop router: {w.name} was not up within {self.start_timeout_s} s;"
                      f" killing it", file=sys.stderr, flush=True)
                self._kill(w)      # the next check handles the exit
            return
        try:
            ok = client.get(w.url + "/health").status_code == 200
        except httpx2.HTTPError:
            ok = False
        w.health_failures = 0 if ok else w.health_failures + 1
        if w.health_failures >= self.health_failures:
            print(f"tinyloop router: {w.name} (pid {w.pid}) failed {w.health_failures} "
                  f"health checks; killing it", file=sys.stderr, flush=True)
            self._kill(w)          # the next check handles the exit


def load_tokenizer(path: str):
    """The tokenizer of the .tlm file at ``path`` (with its chat template), without its
    weights; None when the file has none."""
    from ..format import read_tlm
    from ..tokenizer import Tokenizer
    with read_tlm(path) as f:
        tok_json, cfg, template = f.tokenizer_json, f.config, f.chat_template
    if tok_json is None:
        return None
    return Tokenizer.from_json(tok_json, chat_template=template, bos_token_id=cfg.bos_token_id,
                               eos_token_id=cfg.eos_token_id)


ROUTE_TEXT_CHARS = 1 << 16     # the routing tokenizes at most this much of a text prompt


def prompt_ids(body, chat: bool, tokenizer) -> list:
    """The prompt's leading token ids as the replica will see them, for the routing; [] when
    they cannot be had (the replica then answers the bad request itself). Of a text prompt
    longer than ROUTE_TEXT_CHARS only that much is tokenized, less its last BLOCK_TOKENS ids
    (the cut may split a word): the affinity looks at leading blocks only."""
    if not isinstance(body, dict):
        return []
    try:
        if chat:
            msgs = body.get("messages")
            if tokenizer is None or not tokenizer.chat_template or not isinstance(msgs, list):
                return []
            clean = [{"role": m.get("role"), "content": m.get("content")} for m in msgs
                     if isinstance(m, dict) and isinstance(m.get("content"), str)]
            if sum(len(m["content"]) for m in clean) > ROUTE_TEXT_CHARS:
                return []                 # a long conversation routes by load alone
            return list(tokenizer.apply_chat_template(clean, tokenize=True))
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if tokenizer is None:
                return []
            if len(p) <= ROUTE_TEXT_CHARS:
                return list(tokenizer.encode(p))
            return list(tokenizer.encode(p[:ROUTE_TEXT_CHARS]))[:-BLOCK_TOKENS]
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return p
    except Exception:     # routing is best effort: any failure routes by load alone
        pass
    return []


class Router:
    """The routing state over a :class:`ReplicaSet` (event-loop side): the PrefixIndex, the
    affinity counters and the pick of :func:`choose`."""

    def __init__(self, replica_set: ReplicaSet, tokenizer=None, *,
                 block_tokens: int = BLOCK_TOKENS, balance_abs: int = BALANCE_ABS,
                 max_blocks: int = MAX_INDEX_BLOCKS):
        self.set = replica_set
        self.tokenizer = tokenizer
        self.block_tokens = block_tokens
        self.balance_abs = balance_abs
        n = len(replica_set.workers)
        self.index = PrefixIndex(n, max_blocks)
        self._generation = [w.generation for w in replica_set.workers]
        self.lookups = 0       # requests whose prompt had at least one full block
        self.hits = 0          # of them, those the affinity routed

    def pick(self, keys: list, exclude=()):
        """The Worker for a prompt of block ``keys`` (None when no replica is up)."""
        ws = self.set.workers
        for i, w in enumerate(ws):            # a restarted worker's PrefixPool is empty
            if w.generation != self._generation[i]:
                self.index.clear(i)
                self._generation[i] = w.generation
        up = [u and i not in exclude for i, u in enumerate(self.set.up())]
        matched = self.index.match(keys) if keys else [0] * len(ws)
        got = choose([w.in_flight for w in ws], matched, up, [w.requests for w in ws],
                     self.balance_abs)
        if got is None:
            return None
        i, hit = got
        if keys and not exclude:
            self.lookups += 1
            self.hits += hit
        if keys:
            self.index.insert(i, keys)
        return ws[i]


class ClientGone(Exception):
    """The client of a forwarded request disconnected before its answer."""


class _Relabelled:
    """A prometheus_client collector of the replicas' parsed metric families, each sample
    with a ``replica`` label added."""

    def __init__(self, texts: dict):
        self.texts = texts

    def collect(self):
        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families
        merged = {}
        for rep, text in self.texts.items():
            for fam in text_string_to_metric_families(text):
                m = merged.get(fam.name)
                if m is None:
                    m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    m.add_sample(s.name, {**s.labels, "replica": str(rep)}, s.value,
                                 s.timestamp)
        yield from merged.values()


def create_router_app(replica_set: ReplicaSet, model_name: str, tokenizer=None, *,
                      retries: int = 1, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                      read_timeout_s: float = READ_TIMEOUT_S,
                      body_timeout_s: float = BODY_TIMEOUT_S, **router_kw):
    """The Starlette app of the router over the started ``replica_set`` (see the module
    doc); ``app.state.router`` holds the :class:`Router`. The httpx2 client is made on the
    app's event loop at its first request and closed by :func:`close_router_app`. A request
    body is read as the replicas' server reads it (http.read_body: at most MAX_BODY_BYTES,
    413 past it; whole within ``body_timeout_s`` seconds, 408 past it)."""
    import httpx2
    from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                                   generate_latest)
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from .http import error_response
    router = Router(replica_set, tokenizer, **router_kw)
    ws = replica_set.workers
    reg = CollectorRegistry()
    m_requests = Counter("tinyloop_router_requests", "requests forwarded, by replica, route "
                         "and status", ["replica", "route", "status"], registry=reg)
    m_inflight = Gauge("tinyloop_router_in_flight", "requests in flight by replica",
                       ["replica"], registry=reg)
    m_up = Gauge("tinyloop_router_replica_up", "1 while the replica is up", ["replica"],
                 registry=reg)
    m_restarts = Gauge("tinyloop_router_restarts", "restarts of the replica's worker",
                       ["replica"], registry=reg)
    m_retries = Counter("tinyloop_router_retries", "requests retried on another replica "
                        "after theirs failed before answering", ["replica"], registry=reg)
    m_lookups = Gauge("tinyloop_router_affinity_lookups", "requests with at least one full "
                      "prompt block", registry=reg)
    m_hits = Gauge("tinyloop_router_affinity_hits", "of them, those routed by the prefix "
                   "affinity", registry=reg)
    m_rate = Gauge("tinyloop_router_affinity_hit_rate", "affinity hits over lookups",
                   registry=reg)
    timeout = httpx2.Timeout(connect=connect_timeout_s, read=read_timeout_s,
                             write=connect_timeout_s, pool=connect_timeout_s)
    holder = {}

    def client() -> "httpx2.AsyncClient":
        c = holder.get("client")
        if c is None:
            c = holder["client"] = httpx2.AsyncClient(
                timeout=timeout, limits=httpx2.Limits(max_connections=None,
                                                      max_keepalive_connections=64))
        return c

    def unavailable(msg: str, w=None) -> JSONResponse:
        return error_response(503, msg, kind="unavailable",
                              code=None if w is None else "replica_failed")

    async def health(request: Request):
        up = sum(replica_set.up())
        if up:
            return JSONResponse({"status": "ok", "replicas_up": up, "replicas": len(ws)})
        return unavailable("no replica is up")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "tinyloop"}]})

    async def metrics(request: Request):
        async def one(w):
            if w.state != "up":
                return None
            try:
                r = await client().get(w.url + "/metrics", timeout=METRICS_TIMEOUT_S)
                return r.text if r.status_code == 200 else None
            except httpx2.HTTPError:
                return None
        texts = await asyncio.gather(*(one(w) for w in ws))
        up = replica_set.up()
        for w in ws:
            m_inflight.labels(str(w.index)).set(w.in_flight)
            m_up.labels(str(w.index)).set(1 if up[w.index] else 0)
            m_restarts.labels(str(w.index)).set(w.restarts)
        m_lookups.set(router.lookups)
        m_hits.set(router.hits)
        m_rate.set(router.hits / router.lookups if router.lookups else 0.0)
        body = generate_latest(reg) + generate_latest(
            _Relabelled({w.index: t for w, t in zip(ws, texts) if t is not None}))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def until_gone(request: Request, aw):
        """``aw``'s result, or ClientGone once the client disconnected (``aw`` is then
        cancelled, which drops its connection to the replica: the replica cancels the
        request and frees its pages)."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx2.HTTPError):
                    await task

    def served_by(tried) -> dict:
        """The response headers naming the replica that answered and those that failed."""
        out = {REPLICA_HEADER: str(tried[-1].index)}
        if len(tried) > 1:
            out[FAILED_HEADER] = ",".join(str(t.index) for t in tried[:-1])
        return out

    def failed_message(w, pid, e) -> str:
        return (f"{w.name} (pid {pid}) failed while serving the request: "
                f"{type(e).__name__}: {e}".rstrip(": "))

    async def forward(request: Request):
        route = request.url.path
        try:
            raw = await read_body(request, timeout_s=body_timeout_s)
        except BodyError as e:
            m_requests.labels("none", route, str(e.status)).inc()
            return error_response(e.status, str(e))

        def parse():          # a worker thread: a long prompt tokenizes for a while
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                body = None   # forwarded as it is: the replica answers 400
            return body, prompt_ids(body, route.endswith("chat/completions"),
                                    router.tokenizer)
        body, ids = await asyncio.to_thread(parse)
        keys = block_keys(ids, router.block_tokens)
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        tried, last = [], None
        while len(tried) <= retries:
            w = router.pick(keys, exclude={t.index for t in tried})
            if w is None:
                break
            if tried:
                m_retries.labels(str(tried[-1].index)).inc()
            tried.append(w)
            pid = w.pid                  # the process this request goes to (a restart
            w.in_flight += 1             # gives the worker a new one)
            w.requests += 1
            handed = False               # the stream generator below owns the count
            try:
                req = client().build_request("POST", w.url + route, content=raw,
                                             headers=headers)
                # a non-streamed answer's headers come with its end: wait for the client too
                resp = await until_gone(request, client().send(req, stream=True))
                try:
                    if not stream or resp.status_code != 200:
                        content = await until_gone(request, resp.aread())
                        m_requests.labels(str(w.index), route, str(resp.status_code)).inc()
                        return Response(content, status_code=resp.status_code,
                                        media_type=resp.headers.get("content-type"),
                                        headers=served_by(tried))
                    it = resp.aiter_raw()
                    # the first event: the replica answers
                    first = await until_gone(request, it.__anext__())
                except BaseException:
                    await resp.aclose()
                    raise
                handed = True
            except ClientGone:           # the client left: so does the call to the replica
                m_requests.labels(str(w.index), route, "499").inc()
                return Response(status_code=499)
            except (httpx2.TransportError, StopAsyncIteration) as e:
                last = (w, pid, e)
                replica_set.suspect(w)
                continue                 # nothing reached the client: another replica
            finally:
                if not handed:
                    w.in_flight -= 1
            m_requests.labels(str(w.index), route, "200").inc()

            async def events(w=w, pid=pid, resp=resp, it=it, first=first):
                try:
                    yield first
                    async for chunk in it:
                        yield chunk
                except httpx2.TransportError as e:
                    replica_set.suspect(w)
                    yield ("data: " + json.dumps({"error": {
                        "message": failed_message(w, pid, e), "type": "unavailable",
                        "param": None, "code": "replica_failed"}}) + "\n\n").encode()
                finally:
                    w.in_flight -= 1
                    await resp.aclose()

            return StreamingResponse(events(), status_code=200,
                                     media_type=resp.headers.get("content-type"),
                                     headers={"Cache-Control": "no-cache", **served_by(tried)})
        if last is None:
            m_requests.labels("none", route, "503").inc()
            return unavailable("no replica is up; try again later")
        w, pid, e = last
        m_requests.labels(str(w.index), route, "503").inc()
        return unavailable(failed_message(w, pid, e) + f" (tried {len(tried)} replica"
                           f"{'s' if len(tried) > 1 else ''})", w)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics)]
        + [Route(r, forward, methods=["POST"]) for r in ROUTES])
    app.state.router = router
    app.state.http_client = holder
    return app


async def close_router_app(app) -> None:
    """Close the router app's HTTP client (on its event loop)."""
    c = app.state.http_client.pop("client", None)
    if c is not None:
        await c.aclose()


def serve_replicas(spec: ReplicaSpec, replicas: int, host: str = "127.0.0.1",
                   port: int = 8000, devices=None, **set_kw) -> None:
    """``tinyloop serve --replicas N``: start the workers, serve the router on
    ``host``:``port`` under uvicorn until interrupted, then stop every worker."""
    import uvicorn
    tok = load_tokenizer(spec.model)
    with ReplicaSet(spec, replicas, devices, **set_kw) as rs:
        app = create_router_app(rs, spec.name, tok)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            yield
            await close_router_app(app)

        app.router.lifespan_context = lifespan
        for w in rs.workers:
            print(f"tinyloop router: {w.name} (pid {w.pid}, device {w.device}) on {w.url}",
                  file=sys.stderr, flush=True)
        uvicorn.run(app, host=host, port=port, log_level="info")
