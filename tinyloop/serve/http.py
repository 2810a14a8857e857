"""An OpenAI-compatible HTTP server over the serving :class:`~tinyloop.serve.engine.Engine`
(Starlette + uvicorn, metrics through prometheus_client: the ``serve`` extra).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI's request and
response objects; ``"stream": true`` sends server-sent events, ``data: {chunk}`` lines ending
with ``data: [DONE]``; chat prompts go through the model's chat template,
``Tokenizer.apply_chat_template(..., tokenize=True)`` as ``tinyloop run`` does), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format: requests by route
and status, prompt and generated tokens, queue length, active requests, time to first token,
the memory pool's allocated bytes by tag). Extra request fields: ``top_k``, ``min_p``,
``repetition_penalty``, ``depth``, ``kv_mode``, ``ignore_eos`` (as vLLM's: the
end-of-generation tokens end nothing). Bad input answers 400 with OpenAI's error object naming the field (``{"error":
{"message", "type": "invalid_request_error", "param", "code"}}``); a full queue 429; a stopped
engine or a request the memory could not take 503. A client that disconnects before its
request ends cancels it (its pages are freed at once).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import (ConfigError, EngineStoppedError, OutOfMemoryError, QueueFullError,
                      TinyLoopError, TokenizerError)
from ..generate import check_text_length
from ..memory import TAGS

DISCONNECT_POLL_S = 0.25     # how often a waiting handler checks its client is still there

# a request field -> the engine argument its check names
_ARG_OF_FIELD = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "seed": "seed", "stop": "stop", "depth": "depth", "kv_mode": "kv_mode",
                 "ignore_eos": "ignore_eos", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty"}

# the engine's finish reasons in OpenAI's words
_FINISH = {"length": "length", "eos": "stop", "stop": "stop", "cancelled": "stop"}


MAX_BODY_BYTES = 16 << 20      # a request body past this answers 413 (read no further)
MAX_STOPS, MAX_STOP_CHARS = 16, 1024   # stop strings a request may give, and their length
BODY_TIMEOUT_S = 30.0          # a body not whole by then answers 408 (its connection freed)
MAX_MESSAGE_CHARS = 2000       # an error message is cut there (it may quote the bad value)


class BodyError(Exception):
    """The request body could not be read whole; ``status`` is the HTTP answer."""
    status = 400


class BodyTooLarge(BodyError):
    """A request body past the server's limit: answered 413."""
    status = 413


async def read_body(request, limit: int | None = None,
                    timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, read at most ``limit`` bytes far (default MAX_BODY_BYTES; the
    declared length checked first, then the bytes as they arrive: a chunked body has none)
    and for at most ``timeout_s`` seconds. Raises BodyTooLarge past the limit and
    BodyTimeout past the time (a client sending a byte now and then would hold its
    connection forever)."""
    limit = MAX_BODY_BYTES if limit is None else limit
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is {int(declared)} bytes; this server takes at "
                           f"most {limit}")
    buf = bytearray()

    async def receive():
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > limit:
                raise BodyTooLarge(f"the request body is over {limit} bytes, the most this "
                                   "server takes")
    try:
        await asyncio.wait_for(receive(), timeout_s)
    except ClientDisconnect:
        raise BodyAbandoned("the client closed the connection before its body was whole") \
            from None
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not arrive whole within {timeout_s:g} s "
                          f"({len(buf)} bytes came)") from None
    return bytes(buf)


async def read_json(request, limit: int | None = None, timeout_s: float = BODY_TIMEOUT_S):
    """:func:`read_body` parsed as JSON (on a worker thread: a 16 MB body parses for a
    while); BadRequest for a body that is not JSON or nests too deeply."""
    raw = await read_body(request, limit, timeout_s)
    try:
        return await asyncio.to_thread(json.loads, raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("the request body nests too deeply") from None


class BodyAbandoned(BodyError):
    """The client left before its request body was whole (nobody to answer: counted 499)."""
    status = 499


class BodyTimeout(BodyError):
    """The request body was not whole within the server's body timeout (answered 408)."""
    status = 408


class BadRequest(Exception):
    """A request field failed its check: answered 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, param=None, kind: str = "invalid_request_error",
                   code=None) -> JSONResponse:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``; the
    message cut at MAX_MESSAGE_CHARS."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, name: str, check, what: str, default=None):
    """``body[name]`` (``default`` when absent or null) after ``check(value)``; BadRequest
    naming ``name`` otherwise."""
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise BadRequest(f"'{name}' must be {what}, got {json.dumps(v)[:80]}", name)
    return v


def _stop_field(body: dict):
    v = body.get("stop")
    if v is None or v == "":
        return None
    if isinstance(v, str):
        v = [v]
    if (isinstance(v, list) and len(v) <= MAX_STOPS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v)):
        return v or None
    raise BadRequest(f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} "
                     f"non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")


def sampling_args(body: dict) -> dict:
    """The engine arguments of an OpenAI request body (BadRequest naming a bad field)."""
    if body.get("n") not in (None, 1):
        raise BadRequest("only 'n' = 1 is supported", "n")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
        if body.get(name):
            raise BadRequest(f"'{name}' is not supported by this server", name)
    if body.get("best_of") not in (None, 1):
        raise BadRequest("only 'best_of' = 1 is supported", "best_of")
    # OpenAI's additive penalties and logit biases change the pick: refused, not ignored
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(f"'{name}' is not supported by this server (the multiplicative "
                             "'repetition_penalty' is)", name)
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported by this server", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("only 'response_format' {\"type\": \"text\"} is supported",
                         "response_format")
    # max_completion_tokens (OpenAI's newer name) wins unless it is absent or null
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(field)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 0):
        raise BadRequest(f"'{field}' must be an integer >= 0, got {json.dumps(max_tokens)}",
                         field)
    kv_mode = body.get("kv_mode")
    if kv_mode is not None and not isinstance(kv_mode, (str, dict, list)):
        raise BadRequest("'kv_mode' must be a mode name, a dict by slot kind or a list per "
                         "layer", "kv_mode")
    return dict(
        max_new_tokens=16 if max_tokens is None else max_tokens,
        temperature=_field(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
                           "a number in [0, 2]", 1.0),
        top_p=_field(body, "top_p", lambda v: _is_number(v) and 0 <= v <= 1,
                     "a number in [0, 1]", 1.0),
        top_k=_field(body, "top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0", 0),
        min_p=_field(body, "min_p", lambda v: _is_number(v) and 0 <= v <= 1,
                     "a number in [0, 1]", 0.0),
        repetition_penalty=_field(body, "repetition_penalty",
                                  lambda v: _is_number(v) and v > 0, "a number > 0", 1.0),
        seed=_field(body, "seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        depth=_field(body, "depth", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        stop=_stop_field(body), kv_mode=kv_mode,
        ignore_eos=_field(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false",
                          False))


def completion_prompt(body: dict, model):
    """The prompt of a /v1/completions body: text, one-element list of text, or token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return p
    if p is None:
        raise BadRequest("'prompt' is required", "prompt")
    raise BadRequest("'prompt' must be a string, a list of one string, or a list of token "
                     "ids (one prompt per request)", "prompt")


def chat_prompt(body: dict, model) -> list:
    """The token ids of a /v1/chat/completions body's ``messages`` through the model's chat
    template."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects",
                         "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'",
                             f"messages[{i}].role")
        c = m.get("content")
        if isinstance(c, list):          # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text"
                       and isinstance(x.get("text"), str) for x in c):
                raise BadRequest(f"'messages[{i}].content' parts must be text parts",
                                 f"messages[{i}].content")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise BadRequest(f"'messages[{i}].content' must be a string",
                             f"messages[{i}].content")
        for name, v in (("role", m["role"]), ("content", c)):
            try:                         # a lone surrogate (JSON "\ud800") is no UTF-8
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(f"'messages[{i}].{name}' is not valid Unicode text: "
                                 f"{e.reason} at index {e.start}",
                                 f"messages[{i}].{name}") from None
        clean.append({"role": m["role"], "content": c})
    tok = model.tokenizer
    if tok is None or not tok.chat_template:
        raise BadRequest("this model has no chat template; use /v1/completions", "messages")
    try:
        # the rendered text, checked before it is encoded (check_text_length; a template
        # may trim what the messages hold, so the messages alone prove nothing)
        return tok.apply_chat_template(
            clean, tokenize=True,
            check=lambda text: check_text_length(model, text, 0, "the rendered 'messages'"))
    except TokenizerError as e:
        raise BadRequest(f"the chat template failed on 'messages': {e}", "messages") from None
    except ConfigError as e:
        raise BadRequest(str(e), "messages") from None


# generate.check_request's length message: "prompt (N tokens) + ..." or "(at least N tokens"
_PROMPT_TOKENS_RE = re.compile(r"prompt \((?:at least )?(\d+) tokens")


def _param_of(message: str):
    """The request field an engine check's message names (its argument's name)."""
    for field, arg in _ARG_OF_FIELD.items():
        if message.startswith(arg) or f" {arg}" in message or f"{arg}=" in message:
            return field
    if "kv mode" in message.lower() or "kv cache mode" in message.lower():
        return "kv_mode"
    return None


class Metrics:
    """The server's Prometheus metrics (one registry per app)."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tinyloop_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("tinyloop_prompt_tokens",
                                     "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("tinyloop_generated_tokens",
                                        "tokens generated by finished requests", registry=r)
        self.finished = Counter("tinyloop_finished_requests",
                                "engine requests by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("tinyloop_time_to_first_token_seconds",
                              "seconds from submit to the first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.queue = Gauge("tinyloop_queue_length", "requests waiting for admission",
                           registry=r)
        self.active = Gauge("tinyloop_active_requests", "requests admitted (prefill or "
                            "decode)", registry=r)
        self.pool = Gauge("tinyloop_pool_allocated_bytes", "the memory pool's allocated "
                          "bytes by tag", ["tag"], registry=r)
        engine.on_finish = self.on_finish

    def on_finish(self, r) -> None:
        """The engine's callback when a request ends (engine or caller thread)."""
        self.finished.labels(r.finish_reason).inc()
        if r.ttft_s is not None:
            self.ttft.observe(r.ttft_s)
        res = r.outcome
        self.prompt_tokens.inc(len(res.prompt_token_ids) - res.cached_tokens)
        self.generated_tokens.inc(len(res.token_ids))

    def render(self) -> bytes:
        st = self.engine.stats()
        self.queue.set(st["queued"])
        self.active.set(st["active"])
        by_tag = self.engine.model.pool.by_tag()
        for tag in TAGS:
            self.pool.labels(tag).set(by_tag.get(tag, 0))
        return generate_latest(self.registry)


def create_app(engine, model_name: str = "tinyloop", *,
               body_timeout_s: float = BODY_TIMEOUT_S) -> Starlette:
    """The Starlette app serving ``engine`` (started by the caller) as model ``model_name``;
    ``app.state.engine`` / ``app.state.metrics`` hold them. ``body_timeout_s``: seconds a
    request body may take to arrive (408 past it)."""
    model = engine.model
    metrics = Metrics(engine)

    def counted(route: str, resp: Response) -> Response:
        metrics.requests.labels(route, str(resp.status_code)).inc()
        return resp

    async def health(request: Request):
        if engine.running:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine is not running", kind="unavailable")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "tinyloop"}]})

    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def submit(body, chat: bool):
        """The EngineRequest of a body (BadRequest naming a bad field), made on a worker
        thread: tokenizing a long prompt or rendering a chat template would hold up every
        other client on the event loop."""
        return await asyncio.to_thread(submit_now, body, chat)

    def submit_now(body, chat: bool):
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if not isinstance(body.get("stream", False), bool):
            raise BadRequest("'stream' must be a boolean", "stream")
        opts = body.get("stream_options")
        if opts is not None:
            if not body.get("stream"):
                raise BadRequest("'stream_options' is only allowed when 'stream' is true",
                                 "stream_options")
            # include_obfuscation (OpenAI's padding against side channels): accepted, and
            # nothing to pad here
            if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"} \
                    or not all(isinstance(v, bool) for v in opts.values()):
                raise BadRequest("'stream_options' must be {\"include_usage\": true or "
                                 "false}", "stream_options")
        args = sampling_args(body)
        prompt = chat_prompt(body, model) if chat else completion_prompt(body, model)
        try:
            return engine.submit(prompt, **args)
        except TokenizerError as e:
            raise BadRequest(str(e), "messages" if chat else "prompt") from None
        except ConfigError as e:
            msg = str(e)
            param = _param_of(msg)
            too_long = _PROMPT_TOKENS_RE.match(msg)
            if too_long and int(too_long.group(1)) > model.max_seq_len:
                param = None                  # the prompt alone does not fit
            elif too_long and param == "max_tokens" and \
                    body.get("max_completion_tokens") is not None:
                param = "max_completion_tokens"   # the field the request gave
            if param is None and ("prompt" in msg or "KV budget" in msg):
                param = "messages" if chat else "prompt"
            raise BadRequest(msg, param) from None

    async def pieces(request: Request, r):
        """The request's StreamToken pieces as they come; cancels it when the client leaves
        (or the handler is cancelled) before it ended."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:        # the loop closed: nobody waits any more
                pass

        r.notify = notify
        ended = False
        checked = time.monotonic()
        try:
            while True:
                wake.clear()
                got, ended = r.drain()
                for p in got:
                    yield p
                if ended:
                    return
                # every DISCONNECT_POLL_S, also while tokens keep coming (a non-streamed
                # answer writes nothing until its end, so only this check sees the client go)
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                try:
                    await asyncio.wait_for(wake.wait(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            if not ended:
                # off the event loop: cancel waits for the engine's step in flight
                threading.Thread(target=r.cancel, daemon=True).start()

    def usage(res) -> dict:
        n_p, n_c = len(res.prompt_token_ids), len(res.token_ids)
        return {"prompt_tokens": n_p, "completion_tokens": n_c, "total_tokens": n_p + n_c}

    async def generate(request: Request, chat: bool):
        route = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            body = await read_json(request, timeout_s=body_timeout_s)
            r = await submit(body, chat)
        except BodyError as e:
            return counted(route, error_response(e.status, str(e)))
        except BadRequest as e:
            return counted(route, error_response(400, str(e), e.param))
        except QueueFullError as e:
            return counted(route, error_response(429, str(e), kind="rate_limit_exceeded"))
        except EngineStoppedError as e:
            return counted(route, error_response(503, str(e), kind="unavailable"))
        rid = ("chatcmpl-" if chat else "cmpl-") + f"{r.id}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        # OpenAI's stream_options.include_usage: "usage": null on every chunk, then a last
        # chunk with no choices and the request's usage
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text, reason=None, first=False, usage_of=None) -> str:
            if usage_of is not None:
                choices = []
            elif chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                if reason is not None:
                    delta = {}
                choices = [{"index": 0, "delta": delta, "finish_reason": reason}]
            else:
                choices = [{"index": 0, "text": text, "logprobs": None,
                            "finish_reason": reason}]
            out = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                   "model": model_name, "choices": choices}
            if with_usage:
                out["usage"] = None if usage_of is None else usage(usage_of)
            return "data: " + json.dumps(out) + "\n\n"

        if body.get("stream"):
            async def events():
                first = True
                try:
                    async for p in pieces(request, r):
                        if p.text or first:
                            yield chunk(p.text, None, first)
                            first = False
                finally:
                    if not r.done:          # the client left (the send failed): end it
                        threading.Thread(target=r.cancel, daemon=True).start()
                try:
                    res = r.result(0)
                except TinyLoopError as e:
                    yield "data: " + json.dumps({"error": {
                        "message": str(e), "type": "server_error", "param": None,
                        "code": None}}) + "\n\n"
                    return
                except TimeoutError:          # the client left: nothing more to send
                    return
                if first:
                    yield chunk("", None, True)
                yield chunk("", _FINISH.get(res.finish_reason, "stop"))
                if with_usage:
                    yield chunk("", usage_of=res)
                yield "data: [DONE]\n\n"

            metrics.requests.labels(route, "200").inc()
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in pieces(request, r):
            pass
        try:
            res = r.result(0)
        except TimeoutError:                  # the client left before the end
            return counted(route, error_response(499, "the client closed the request"))
        except OutOfMemoryError as e:
            return counted(route, error_response(503, str(e), kind="unavailable"))
        except TinyLoopError as e:
            return counted(route, error_response(500, str(e), kind="server_error"))
        reason = _FINISH.get(res.finish_reason, "stop")
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": res.text},
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": reason}
        return counted(route, JSONResponse({"id": rid, "object": obj, "created": created,
                                            "model": model_name, "choices": [choice],
                                            "usage": usage(res)}))

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", prometheus),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"])])
    app.state.engine = engine
    app.state.metrics = metrics
    return app


class ServerThread:
    """uvicorn serving ``app`` on ``host``:``port`` (0: an ephemeral port) in a thread, for
    tests and benchmarks: ``with ServerThread(app) as s: s.url``. Raises ConfigError when
    the server does not start within ``timeout`` seconds."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level="warning", lifespan="off"))
        self.host, self.timeout = host, timeout
        self.thread = threading.Thread(target=self.server.run, name="tinyloop-http",
                                       daemon=True)
        self.port = None

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > self.timeout:
                raise ConfigError(f"the HTTP server did not start on {self.host}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout)


def serve(model, host: str = "127.0.0.1", port: int = 8000, *, max_batch: int = 32,
          max_queue: int = 256, model_name: str | None = None, prefix_cache=None,
          **engine_kw) -> None:
    """Serve ``model`` until interrupted (``tinyloop serve``): an Engine over it and the app
    under uvicorn on ``host``:``port``; ``prefix_cache`` (bytes or a size string): a
    PrefixPool of that budget every request shares. The engine stops (freeing every request)
    and the PrefixPool is released at the end."""
    import os

    import uvicorn

    from ..kv.pool import PrefixPool
    from .engine import Engine
    name = model_name or os.path.splitext(os.path.basename(model.path))[0]
    pool = None if prefix_cache is None else PrefixPool(model, prefix_cache)
    try:
        with Engine(model, max_batch=max_batch, max_queue=max_queue, prefix_pool=pool,
                    **engine_kw) as engine:
            uvicorn.run(create_app(engine, name), host=host, port=port, log_level="info")
    finally:
        if pool is not None:
            pool.release()
