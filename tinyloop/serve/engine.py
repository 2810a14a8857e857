"""The serving engine: continuous batching of many requests over one Model.

An :class:`Engine` owns a scheduler thread. Requests join and leave at any decode step: each
iteration of the scheduler admits waiting requests, runs one prefill chunk of the oldest
request still prefilling (at most ``prefill_chunk`` prompt positions, so a long prompt never
stalls the others by more than one chunk), then one decode step for every group of decoding
requests (``Model.decode_batch``: requests of one depth and kv_mode share a step; at most
``max_batch`` rows). Each step holds the model's lock, so direct ``Model.generate`` /
``stream`` calls keep working between two steps.

**Admission and back-pressure**: a request is admitted when a batch slot is free and the KV
cache of its whole length (prompt + max_new_tokens, from ``Model.request_plan``, as the pool
rounds it) fits in what the admitted requests left of the KV budget; otherwise it waits in a
bounded FIFO queue (a full queue raises :class:`~tinyloop.errors.QueueFullError` at submit).
A request that could never fit the budget is refused at submit (ConfigError).

**Few decoding requests** (at most ``serial_rows``) run their steps one after another as the
captured decode step where the backend can (``graphs.decode_step``, what ``Model.generate``
runs): a replayed step costs a fraction of an eager batched one, so below some batch size
replaying each row beats batching them (docs/architecture.md, "Serving"); more share
``Model.decode_batch``. Both pick a token by the same rule from the same drawn uniform.

**Overlap**: a batched step runs on the device while the host streams the tokens the step
before accepted and prepares the next step (``Model.decode_batch_prepare``); after the step
the host only takes the new ids, and the next step, when its rows and positions are the
prepared ones, launches at once (``Model.decode_batch_start(prepared=)``). A token's text
therefore streams at the next launch; a request a stop string ends while a step that reads
its cache runs ends after that step, with that step's token dropped.

**Memory**: every request's pages are tagged ``kv_cache`` (``prefix_cache`` while a
PrefixPool entry holds them) and freed when it ends, is cancelled, or the engine stops; a
request that inserts into the engine's PrefixPool keeps its prompt's final residual rows in a
block of its own (tag ``kv_cache``) until the insert. After :meth:`Engine.stop` the pool's
allocated bytes outside tag ``graphs`` (:func:`allocated_outside_graphs`: the captured decode
step's model-owned blocks, made at its first use and kept for later requests, as after
``Model.generate``) are what they were at :meth:`Engine.start` (the model's lazy logit row is
made at start), plus whatever the PrefixPool's entries hold.

**Sampling**: a request draws its uniforms from ``numpy.random.default_rng(seed)``, one per
sampled token, in order, as ``Model.generate`` does, and its text streams by the same rule
(``generate.StreamText``), so a seeded request gives the same tokens and text alone or
batched (on the NumPy backend a batched step equals each request's solo step bit for bit).
"""

from __future__ import annotations

import collections
import copy
import gc
import itertools
import queue
import threading
import time
import warnings

import numpy as np

from ..config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_REPEAT_LAST_N, parse_size
from ..config import as_int
from ..errors import (ConfigError, EngineStoppedError, ModelFreedError, QueueFullError,
                      TinyLoopError)
from ..generate import (GenerationResult, StreamText, check_request, insert_prompt, located,
                        restore_prefix)
from ..graphs import decode_graphs, decode_step
from ..memory import round_size

DEFAULT_MAX_BATCH = 32       # rows of one decode step
DEFAULT_SERIAL_ROWS = 2      # rows replayed one by one before batching (docs/architecture.md)
DEFAULT_MAX_QUEUE = 256      # requests waiting for admission
DEFAULT_PREFILL_CHUNK = 256  # prompt positions one scheduler iteration prefills

_END = object()              # the last item of a request's token queue
# The engines of this process running with freeze_gc, and whether they froze the heap first
# (gc.freeze is process-wide: the last of them to stop unfreezes it, the first one's stop
# would unfreeze it under the others)
_GC_FREEZE = {"engines": 0, "owned": False}
_GC_FREEZE_LOCK = threading.Lock()


def allocated_outside_graphs(pool) -> int:
    """``pool``'s allocated bytes less those under tag ``graphs`` (the captured decode step's
    tables and step state, which the model keeps between requests): what an engine's run
    returns to."""
    return pool.allocated_bytes - pool.by_tag().get("graphs", 0)


def request_kv_bytes(model, n_positions: int, depth: int, modes) -> int:
    """Pool bytes a request's KV cache of ``n_positions`` positions takes at ``depth`` /
    ``modes``: ``Model.request_plan``'s block tables and pages, each page one pool block
    rounded as the pool rounds it (``memory.round_size``)."""
    total = 0
    for e in model.request_plan(n_positions, depth, kv_mode=modes):
        if e.name.startswith("kv_pages_"):
            n, page_bytes = e.shape
            total += n * round_size(page_bytes)
        else:
            total += round_size(e.nbytes)
    return total


class EngineRequest:
    """A request submitted to an :class:`Engine` (made by :meth:`Engine.submit`).

    Iterate it for its :class:`~tinyloop.generate.StreamToken` pieces as they are sampled
    (the pieces ``Model.stream`` yields); :meth:`result` waits for the GenerationResult
    (``finish_reason`` "length" | "eos" | "stop" | "cancelled"); an error that ended it is
    raised there and at the end of the iteration, carrying ``partial``. :meth:`cancel` ends
    it and frees its pages at once. ``state``: "queued" | "prefill" | "decode" | "done".
    Times (``time.perf_counter``): ``submitted_at``, ``first_token_at``, ``finished_at``."""

    def __init__(self, engine, rid: int, req, kv_bytes: int):
        self.id = rid
        self.args = req              # the checked arguments (generate.check_request)
        self.kv_bytes = kv_bytes     # the budget it holds while admitted
        self.state = "queued"
        self.submitted_at = time.perf_counter()
        self.first_token_at = None
        self.finished_at = None
        self.tokens: queue.Queue = queue.Queue()
        self.notify = None           # called (engine thread) after each put: an event loop's
                                     # wake-up (tinyloop.serve.http)
        self._engine = engine
        self._rng = np.random.default_rng(req.seed)
        self._text = StreamText(engine.model.tokenizer, req.stops, req.max_new_tokens)
        self._new: list[int] = []
        self._cache = None
        self._rows = None            # (array, block): prompt residual rows for the pool insert
        self._pos = 0                # prompt positions prefilled, then the decode position
        self._last = None            # the token the next decode step feeds
        self._held: list = []        # accepted tokens not yet streamed (None: EOS)
        self._final = False          # the last accepted token ends it: no more steps
        self._cancel = False         # cancel() asked: the next step under the lock ends it
        self._ending = None          # (reason, pieces): a stop string ended it while a step
                                     # that reads its cache was in flight
        self._cached = 0             # prompt positions restored from the PrefixPool
        self._prefill_ms = 0.0
        self._prefill_t0 = None
        self._decode_t0 = None
        self._result = None
        self._error = None
        self._done = threading.Event()

    # -- the caller's side -------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list:
        return self.args.ids.tolist()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def finish_reason(self):
        return None if self._result is None else self._result.finish_reason

    @property
    def outcome(self):
        """The GenerationResult once the request ended (set before ``Engine.on_finish``
        runs), else None; never waits, never raises."""
        return self._result

    @property
    def generated(self) -> int:
        """New tokens sampled so far (an end-of-sequence token is not one); grows while the
        request decodes, read without waiting."""
        return len(self._new)

    @property
    def ttft_s(self):
        """Seconds from submit to the first sampled token (None before it)."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.submitted_at

    def __iter__(self):
        while True:
            item = self.tokens.get()
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def drain(self) -> tuple[list, bool]:
        """The pieces queued so far, without waiting, and whether the request has ended (its
        last piece is among them); for callers that wait elsewhere (``notify``)."""
        out = []
        while True:
            try:
                item = self.tokens.get_nowait()
            except queue.Empty:
                return out, False
            if item is _END:
                return out, True
            out.append(item)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The GenerationResult once the request ended (waits up to ``timeout`` seconds;
        TimeoutError past it); raises the error that ended it."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """End the request now ("cancelled"): it leaves the queue or its batch, and its pages
        are freed before this returns (it waits for the step in flight). Idempotent."""
        self._engine.cancel(self)

    # -- the engine's side (under the model's lock once admitted) ----------------------------
    def _put(self, item) -> None:
        self.tokens.put(item)
        if self.notify is not None:
            self.notify()

    def _draw(self) -> float:
        """One uniform per sampled token, drawn as Model.generate draws it."""
        return float(self._rng.random()) if self.args.temperature > 0 else 0.0

    def _recent(self, pos: int):
        """The repetition-penalty window of the step sampling at ``pos``: the ids of positions
        max(0, pos + 1 - repeat_last_n) .. pos (prompt, then generated), as Model.generate
        takes it; None when the request has no penalty."""
        a = self.args
        if a.repetition_penalty == 1.0:
            return None
        lo, n = max(0, pos + 1 - a.repeat_last_n), len(a.ids)
        # the window's prompt part then its generated part, without copying the whole context
        return np.concatenate([a.ids[lo:min(n, pos + 1)],
                               np.asarray(self._new[max(0, lo - n):max(0, pos + 1 - n)],
                                          np.int32)]).astype(np.int32, copy=False)

    def _sampling(self) -> tuple:
        """(temperature, top_k, top_p, u, min_p, repetition_penalty, recent ids) of the next
        decode step: ``Ops.sample``'s arguments."""
        a = self.args
        return (a.temperature, a.top_k, a.top_p, self._draw(), a.min_p, a.repetition_penalty,
                self._recent(self._pos))

    def _gen_result(self, reason: str, text: str, now: float | None = None) -> GenerationResult:
        """The request's GenerationResult; ``now``: the decode's end (default: now)."""
        now = time.perf_counter() if now is None else now
        decode_ms = 0.0 if self._decode_t0 is None else (now - self._decode_t0) * 1e3
        n = len(self._new)
        tps = (n - 1) / (decode_ms / 1e3) if n > 1 and decode_ms > 0 else 0.0
        a = self.args
        return GenerationResult(token_ids=list(self._new), text=text,
                                prompt_token_ids=a.ids.tolist(), finish_reason=reason,
                                depth=a.depth, prefill_ms=self._prefill_ms,
                                decode_ms=decode_ms, decode_tokens_per_s=tps,
                                cached_tokens=self._cached)

    def _free(self) -> None:
        """Free the request's KV cache and rows block (idempotent)."""
        cache, self._cache = self._cache, None
        rows, self._rows = self._rows, None
        try:
            if cache is not None:
                cache.release()
        finally:
            if rows is not None:
                self._engine.model.pool.free(rows[1])

    def _finish(self, reason: str, text: str, pieces=(), error=None) -> None:
        end = time.perf_counter()        # the decode's end: the release below is teardown
        self._free()
        self.state = "done"
        self.finished_at = time.perf_counter()
        self._result = self._gen_result(reason, text, end)
        if error is not None:
            # one error may end every request of a step: each gets its own copy and partial
            error = copy.copy(error).with_traceback(error.__traceback__)
            error.partial = self._gen_result("error", text, end)
            self._error = error
        self._engine.finished(self)     # its slot and budget return, counters move
        for p in pieces:
            self._put(p)
        self._done.set()            # before the end marker: a reader that sees it can read
        self._put(_END)             # the result

    def _fail(self, e: TinyLoopError) -> None:
        self._push_held()
        if self.done:
            return
        try:
            self._engine.model.check_alive()
        except ModelFreedError as freed:  # free_model under the request: that is the cause
            e = freed                     # (not the cache released by it that a step met)
        pos = self._pos if self.state == "decode" else len(self.args.ids) - 1
        err = located(e, len(self._new), pos)
        self._finish("error", self._text.partial_text(), error=err)

    def _accept(self, nxt) -> None:
        """Take the token the last step sampled without streaming it: it becomes the next
        step's input, and an EOS or the ``max_new_tokens``-th token marks the request
        final (no further step runs it). Its text and pieces wait for :meth:`_push_held`,
        which the engine runs while the next step is on the device."""
        if isinstance(nxt, TinyLoopError):
            self._fail(nxt)
            return
        if self.first_token_at is None:
            now = time.perf_counter()
            self.first_token_at = now
            self._decode_t0 = now
        if self._engine.model.is_end_of_generation(nxt) and not self.args.ignore_eos:
            self._held.append(None)             # EOS: releases what the text holds, ends
            self._final = True
            return
        self._new.append(nxt)
        self._held.append(nxt)
        self._last = nxt
        self._final = len(self._new) >= self.args.max_new_tokens

    def _push_held(self, in_flight: bool = False) -> None:
        """Stream the accepted tokens' pieces and end the request at EOS, a stop string or
        max_new_tokens. ``in_flight``: a step that reads this request's cache is on the
        device, so a stop string found now ends the request only after that step
        (``_ending``); its token is then dropped."""
        held, self._held = self._held, []
        for nxt in held:
            if self.done:
                return
            if nxt is None:
                pieces = self._text.eos()
                self._finish("eos", self._text.text, pieces)
                return
            pieces, reason = self._text.push(nxt)
            if reason is not None:
                if in_flight:
                    self._ending = (reason, pieces)
                else:
                    self._finish(reason, self._text.text, pieces)
                return
            for p in pieces:
                self._put(p)

    def _take(self, nxt) -> None:
        """Accept the token and stream it at once (``_accept``, ``_push_held``)."""
        self._accept(nxt)
        self._push_held()


class Engine:
    """Continuous batching over one Model (see the module doc).

    ``Engine(model, max_batch=32, max_queue=256, prefill_chunk=256, kv_budget=None,
    prefix_pool=None, serial_rows=2, freeze_gc=True)``: ``max_batch`` rows per decode step
    (and admitted requests); ``serial_rows``: up to this many decoding rows step one by one
    through the captured decode step (0: always ``decode_batch``); ``freeze_gc``: at start,
    collect and then freeze every object alive (``gc.freeze``, as vLLM does after its
    start-up), so the collections the scheduler's allocations trigger scan only what was made
    since, not the whole heap (a full collection stalls every request's step); the last such
    engine of the process to stop unfreezes them if the first one froze the first ones;
    ``max_queue`` requests waiting for admission; ``prefill_chunk`` prompt positions per
    scheduler iteration; ``kv_budget`` bytes (int or size string) the admitted requests' KV
    caches may take together (None: the pool's limit minus what is allocated at start, or no
    bound when the pool has no limit); ``prefix_pool``: a PrefixPool every request looks up
    and inserts into. Use as a context manager or call :meth:`start` / :meth:`stop`. Raises
    ConfigError for bad arguments.
    """

    def __init__(self, model, *, max_batch: int = DEFAULT_MAX_BATCH,
                 max_queue: int = DEFAULT_MAX_QUEUE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_budget=None,
                 prefix_pool=None, serial_rows: int = DEFAULT_SERIAL_ROWS,
                 freeze_gc: bool = True):
        model.check_alive()
        self.freeze_gc = bool(freeze_gc)
        self._froze_gc = False
        self.model = model
        self.max_batch = as_int(max_batch, "max_batch")
        self.max_queue = as_int(max_queue, "max_queue")
        self.prefill_chunk = as_int(prefill_chunk, "prefill_chunk")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        self.serial_rows = as_int(serial_rows, "serial_rows")
        if self.serial_rows < 0:
            raise ConfigError(f"serial_rows must be >= 0, got {self.serial_rows}")
        if isinstance(kv_budget, str):
            kv_budget = parse_size(kv_budget, name="kv_budget")
        elif kv_budget is not None:
            kv_budget = as_int(kv_budget, "kv_budget")
            if kv_budget < 0:
                raise ConfigError(f"kv_budget must be >= 0, got {kv_budget}")
        self._budget_arg = kv_budget
        self.kv_budget = kv_budget
        self.prefix_pool = prefix_pool
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()   # guarded by _cond
        self._active: list[EngineRequest] = []                  # guarded by _cond
        self._reserved = 0               # budget bytes held by admitted requests (_cond)
        self._ids = itertools.count(1)
        self._thread = None
        self._stopping = False
        self._counts = collections.Counter()   # finish reasons (_cond)
        self.prompt_tokens = 0           # prompt positions prefilled (not restored)
        self.generated_tokens = 0        # tokens sampled
        self.steps = 0                   # decode steps run
        self.baseline_allocated = None   # allocated_outside_graphs(pool) at start
        self.on_finish = None            # callback(request) after a request ends
        self._deferred: list = []        # requests whose accepted tokens wait to stream
                                         # (engine thread)
        self._pushed = False             # whether this iteration streamed them
        self._prepared: dict = {}        # (depth, kv_mode) -> that group's next step,
                                         # Model.decode_batch_prepare's (engine thread)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Start the scheduler thread (once). Makes the model's lazy logit row and the
        decode batch's scratch (``Model.reserve_decode_batch``) first, so the
        pool's allocated bytes outside tag ``graphs`` at start (``baseline_allocated``,
        :func:`allocated_outside_graphs`) are what it returns to."""
        if self._thread is not None:
            raise ConfigError("this Engine was started already")
        with self.model.lock:
            self.model.check_alive()
            self.model.logit_row()
            # no scratch grows mid-run
            self.model.reserve_decode_batch(self.max_batch, decode_graphs(self.model))
            pool = self.model.pool
            self.baseline_allocated = allocated_outside_graphs(pool)
            if self._budget_arg is None and pool.limit_bytes is not None:
                self.kv_budget = max(0, pool.limit_bytes - pool.allocated_bytes)
        if self.freeze_gc:
            with _GC_FREEZE_LOCK:
                if _GC_FREEZE["engines"] == 0:
                    _GC_FREEZE["owned"] = gc.get_freeze_count() == 0
                _GC_FREEZE["engines"] += 1
                self._froze_gc = True
                gc.collect()
                gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="tinyloop-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the scheduler: every request still queued or running ends "cancelled" and
        its pages are freed; later submits raise EngineStoppedError. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            left = list(self._queue) + list(self._active)
        for r in left:
            self.cancel(r)
        self._prepared.clear()            # they refer to the requests' released caches
        if self._froze_gc:
            with _GC_FREEZE_LOCK:
                self._froze_gc = False
                _GC_FREEZE["engines"] -= 1
                if _GC_FREEZE["engines"] == 0 and _GC_FREEZE["owned"]:
                    _GC_FREEZE["owned"] = False
                    gc.unfreeze()

    def __enter__(self) -> "Engine":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests ----------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               depth: int | None = None, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop=None,
               kv_mode=None, min_p: float = 0.0, repetition_penalty: float = 1.0,
               repeat_last_n: int = DEFAULT_REPEAT_LAST_N,
               ignore_eos: bool = False) -> EngineRequest:
        """Queue a request; returns its :class:`EngineRequest` at once. Arguments and their
        checks are ``Model.generate``'s (ConfigError / TokenizerError at the call;
        ``ignore_eos``: the end-of-generation tokens end nothing). Raises
        ConfigError when its KV cache alone exceeds the KV budget, QueueFullError when
        ``max_queue`` requests wait already, EngineStoppedError once stopped."""
        req = check_request(self.model, prompt, max_new_tokens, depth, temperature, top_k,
                            top_p, seed, stop, kv_mode, None, self.prefix_pool, min_p,
                            repetition_penalty, repeat_last_n, ignore_eos=ignore_eos)
        if req.exit is not None:
            raise ConfigError("depth='auto' is not taken by the engine: a batched decode step "
                              "runs every request of its group at one fixed depth")
        total = len(req.ids) + req.max_new_tokens
        need = request_kv_bytes(self.model, max(total, 1), req.depth, req.kv_mode)
        if self.prefix_pool is not None:
            need += round_size(len(req.ids) * self.model.config.d_model * 4)
        if self.kv_budget is not None and need > self.kv_budget:
            raise ConfigError(f"the request's KV cache ({len(req.ids)} prompt + "
                              f"{req.max_new_tokens} new positions: {need} bytes) exceeds "
                              f"the engine's KV budget of {self.kv_budget} bytes")
        r = EngineRequest(self, next(self._ids), req, need)
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("the engine is stopped; no request is taken")
            if req.max_new_tokens == 0:
                pass                                  # ends at once below, takes nothing
            elif not self._queue and self._fits(r):
                self._admit(r)
            elif len(self._queue) >= self.max_queue:
                raise QueueFullError(f"the engine's queue is full ({self.max_queue} requests "
                                     f"wait for a batch slot or KV budget); try again later")
            else:
                self._queue.append(r)
            self._cond.notify_all()
        if req.max_new_tokens == 0:
            r._finish("length", "")
        return r

    def cancel(self, r: EngineRequest) -> None:
        """End ``r`` now ("cancelled") and free its pages (see EngineRequest.cancel)."""
        with self._cond:
            if r in self._queue:
                self._queue.remove(r)
                queued = True
            else:
                queued = False
        if queued:
            r._finish("cancelled", r._text.partial_text())
            return
        # the model's lock is not fair: a busy scheduler can take it back step after step,
        # so the scheduler ends a request marked here at its next step under the lock, and
        # this waits for whichever of the two comes first
        r._cancel = True
        lock = self.model.lock
        while not r.done:
            if lock.acquire(timeout=0.002):   # waits for the step in flight
                try:
                    self._end_cancelled(r)
                finally:
                    lock.release()

    @staticmethod
    def _end_cancelled(r: EngineRequest) -> None:
        """End ``r`` "cancelled" unless it is done. Under the model's lock."""
        r._push_held()                        # its accepted tokens stream first
        if not r.done:
            r._finish("cancelled", r._text.partial_text())

    def finished(self, r: EngineRequest) -> None:
        """Bookkeeping when ``r`` ended (called by the request): its slot and budget return."""
        with self._cond:
            if r in self._active:
                self._active.remove(r)
                self._reserved -= r.kv_bytes
            self._counts[r.finish_reason] += 1
            self._cond.notify_all()
        if self.on_finish is not None:
            try:
                self.on_finish(r)
            except Exception as e:      # a metrics callback must not end the scheduler
                warnings.warn(f"Engine.on_finish raised {e!r}", RuntimeWarning, stacklevel=2)

    def _fits(self, r: EngineRequest) -> bool:
        if len(self._active) >= self.max_batch:
            return False
        return self.kv_budget is None or self._reserved + r.kv_bytes <= self.kv_budget

    def _admit(self, r: EngineRequest) -> None:
        self._active.append(r)
        self._reserved += r.kv_bytes
        r.state = "prefill"

    def stats(self) -> dict:
        """``queued``, ``active``, ``kv_reserved_bytes``, ``kv_budget_bytes``, ``finished``
        (count by finish reason), ``prompt_tokens``, ``generated_tokens``, ``steps``."""
        with self._cond:
            return {"queued": len(self._queue), "active": len(self._active),
                    "kv_reserved_bytes": self._reserved, "kv_budget_bytes": self.kv_budget,
                    "finished": dict(self._counts), "prompt_tokens": self.prompt_tokens,
                    "generated_tokens": self.generated_tokens, "steps": self.steps}

    # -- the scheduler -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._queue and self._fits(self._queue[0]):
                    self._admit(self._queue.popleft())
                while not self._active and not self._stopping:
                    self._cond.wait()
                    while self._queue and self._fits(self._queue[0]):
                        self._admit(self._queue.popleft())
                if self._stopping:
                    return
                active = list(self._active)
            try:
                self._iteration(active)
            except Exception as e:          # a fault outside the requests' own errors: end
                err = TinyLoopError(f"the engine's step failed: {e!r}")    # them, go on
                with self.model.lock:
                    for r in active:
                        if not r.done:
                            r._fail(err)

    def _iteration(self, active: list) -> None:
        """One scheduler iteration over the admitted requests ``active``: prefill, then one
        decode step per group."""
        # at most prefill_chunk prompt positions per iteration, oldest request first
        budget = self.prefill_chunk
        for r in active:
            if budget <= 0:
                break
            if r.state == "prefill":
                budget -= self._prefill_chunk(r, budget)
        groups: dict = {}
        for r in active:
            if r.state == "decode":
                groups.setdefault((r.args.depth, r.args.kv_mode), []).append(r)
        self._pushed = False
        for key, group in groups.items():
            for b0 in range(0, len(group), self.max_batch):
                self._decode(key, group[b0:b0 + self.max_batch])
        # requests this iteration's steps ended (EOS, max_new_tokens) stream their last
        # tokens now, so their pages and budget return before the next admission and the
        # next page gains
        ending = [r for r in active if r._final and not r.done]
        if ending or (self._deferred and not self._pushed):
            with self.model.lock:
                for r in ending:
                    r._push_held()
                if not self._pushed:          # no step ran to overlap the others
                    self._push_deferred()

    def _prefill_chunk(self, r: EngineRequest, budget: int) -> int:
        """One chunk of ``r``'s prompt, at most ``budget`` positions; after the last one, its
        first token. Returns the positions it prefilled."""
        model, a = self.model, r.args
        ids = a.ids
        done = 0
        with model.lock:
            if r._cancel:
                self._end_cancelled(r)
            if r.done:
                return 0
            try:
                model.check_alive()
                if r._cache is None:
                    r._prefill_t0 = time.perf_counter()
                    r._cache = model.new_kv_cache(a.depth, len(ids) + a.max_new_tokens,
                                                  kv_mode=a.kv_mode,
                                                  kv_iterations=a.kv_iterations)
                    r._pos = r._cached = restore_prefix(model, ids, a.depth, a.kv_mode,
                                                        r._cache, None, self.prefix_pool)
                    if self.prefix_pool is not None and r._cached < len(ids):
                        ops = model.ops
                        r._rows = ops.empty(model.pool, (len(ids), model.config.d_model),
                                            np.float32, "kv_cache")
                        if r._cached:
                            ops.copy(model.residual_rows(0, r._cached), r._rows[0][:r._cached])
                if r._pos < len(ids):
                    # chunks end at absolute multiples of prefill_chunk; under "latest" a
                    # chunk's positions read each other's current iteration, so the prompt
                    # runs in the model's own chunks (Model.chunk_rows), as generate runs it
                    if r._cache.kv_iterations == "latest":
                        step = model.chunk_rows
                        end = min(len(ids), (r._pos // step + 1) * step)
                    else:
                        end = min(len(ids), r._pos + budget,
                                  (r._pos // self.prefill_chunk + 1) * self.prefill_chunk)
                    model.forward(ids[r._pos:end], r._pos, a.depth, r._cache)
                    if r._rows is not None:
                        model.ops.copy(model.residual_rows(r._pos, end - r._pos),
                                       r._rows[0][r._pos:end])
                    self.prompt_tokens += end - r._pos
                    done = end - r._pos
                    r._pos = end
                if r._pos < len(ids):
                    return done
                if r._rows is not None:
                    insert_prompt(model, ids, a.depth, a.kv_mode, r._cache, self.prefix_pool,
                                  r._rows[0])
                    rows, r._rows = r._rows, None
                    model.pool.free(rows[1])
                u = r._draw()
                filters = {}
                if a.min_p > 0.0:
                    filters["min_p"] = a.min_p
                recent = r._recent(len(ids) - 1)
                if recent is not None:
                    filters.update(repetition_penalty=a.repetition_penalty, recent_ids=recent)
                nxt = model.head_sample(len(ids) - 1, model.logit_row(), a.temperature,
                                        a.top_k, a.top_p, u, **filters)
            except TinyLoopError as e:
                r._fail(e)
                return max(done, 1)
            r._prefill_ms = (time.perf_counter() - r._prefill_t0) * 1e3
            r.state = "decode"
            r._pos = len(ids)
            self.generated_tokens += 1
            r._take(nxt)
        return max(done, 1)        # a full PrefixPool hit still took one step

    def _decode_one(self, r: EngineRequest, sampling: tuple):
        """One request's step through the captured decode step (``graphs.decode_step``): the
        next id, the TinyLoopError the step raised (the row ends with it, as a batch row
        would), or None where the backend does not capture it. Under the model's lock."""
        t, k, p, u, min_p, penalty, recent = sampling
        try:
            return decode_step(self.model, r._cache, r._last, r._pos, t, k, p, u, min_p,
                               penalty, recent,
                               r.args.repeat_last_n if recent is not None else 0)
        except TinyLoopError as e:
            return e

    def _push_deferred(self, in_flight=()) -> None:
        """Stream what the requests accepted in earlier steps (``EngineRequest._push_held``),
        oldest first; ``in_flight``: the requests of the step on the device now. Under the
        model's lock."""
        self._pushed = True
        deferred, self._deferred = self._deferred, []
        for r in deferred:
            r._push_held(r in in_flight)

    def _prepare_next(self, key, rows: list) -> None:
        """While ``rows``' step runs: the host half of their next step
        (``Model.decode_batch_prepare``), for those this step leaves decoding unless it
        samples their EOS; the next step uses it when its rows and positions are these."""
        nxt = []
        for r in rows:
            if r._ending is not None or len(r._new) + 1 >= r.args.max_new_tokens:
                continue
            try:
                r._cache.ensure(r._pos + 2)      # the next step's page
            except TinyLoopError:                # its own step tries again when due (other
                continue                         # requests' ends may free pages by then)
            nxt.append(r)
        if not nxt:
            return
        try:
            got = self.model.decode_batch_prepare(
                [r._cache for r in nxt], [r._pos + 1 for r in nxt], key[0],
                graphs=decode_graphs(self.model))
        except TinyLoopError:        # the next step's own checks end the request at fault
            return
        if got is not None:
            self._prepared[key] = got

    def _decode(self, key, group: list) -> None:
        """One decode step of ``group`` (the requests of one ``key``: depth and kv_mode). A
        batched step runs on the device while the host streams the tokens earlier steps
        accepted (``_push_deferred``) and prepares this group's next step
        (``_prepare_next``); the tokens of this step are accepted after it and streamed while
        the next one runs."""
        model = self.model
        with model.lock:
            for r in group:
                if r._cancel:
                    self._end_cancelled(r)
            live = [r for r in group if not r.done and not r._final]
            if len(live) <= self.serial_rows:
                # the captured single-row step reads on the host at once: nothing overlaps it,
                # and a request may end before it runs
                self._push_deferred()
                live = [r for r in live if not r.done]
            rows = []
            for r in live:
                try:
                    r._cache.ensure(r._pos + 1)   # a page that does not fit ends this request
                except TinyLoopError as e:
                    r._fail(e)
                    continue
                rows.append(r)
            if len(rows) <= self.serial_rows < len(live):
                # page failures left few enough rows for the single-row step: as above
                self._push_deferred()
                rows = [r for r in rows if not r.done]
            if not rows:
                return
            sampling = [r._sampling() for r in rows]     # draws each row's uniform once
            got: list = [None] * len(rows)
            if len(rows) <= self.serial_rows:
                for i, r in enumerate(rows):
                    got[i] = self._decode_one(r, sampling[i])
            rest = [i for i, g in enumerate(got) if g is None]   # not captured: one batch
            if rest:
                batch_rows = [rows[i] for i in rest]
                caches, pos = [r._cache for r in batch_rows], [r._pos for r in batch_rows]
                prepared = self._prepared.pop(key, None)
                if prepared is not None and (prepared.caches[:prepared.n] != caches
                                             or prepared.positions[:prepared.n] != pos):
                    prepared = None              # the batch changed since it was prepared
                try:
                    pending = model.decode_batch_start(
                        caches, [r._last for r in batch_rows], pos, key[0],
                        sampling=[sampling[i] for i in rest], graphs=decode_graphs(model),
                        prepared=prepared)
                    try:
                        self._push_deferred(set(batch_rows))
                        self._prepare_next(key, batch_rows)
                    finally:
                        batch = model.decode_batch_finish(pending)
                except TinyLoopError as e:       # the batch's rows end; the replayed ones go on
                    failed = set(rest)
                    for i in rest:
                        r = rows[i]
                        if r._ending is not None:     # it had ended before the step failed
                            r._finish(r._ending[0], r._text.text, r._ending[1])
                        else:
                            r._fail(e)
                    rows = [r for i, r in enumerate(rows) if i not in failed]
                    got = [g for i, g in enumerate(got) if i not in failed]
                else:
                    for i, nxt in zip(rest, batch):
                        got[i] = nxt
            if not rows:
                return
            self.steps += 1
            for r, nxt in zip(rows, got):
                if r._ending is not None:        # a stop string ended it while this step ran:
                    reason, pieces = r._ending   # its token is dropped
                    r._finish(reason, r._text.text, pieces)
                    continue
                if r.done:
                    continue
                r._pos += 1
                if not isinstance(nxt, TinyLoopError):      # an error row sampled nothing
                    self.generated_tokens += 1
                r._accept(nxt)
                if r._held:
                    self._deferred.append(r)
