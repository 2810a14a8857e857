"""Requests over a Model: generate / stream / teacher-forced logits / score, and the prefills
that make prefix handles.

This module owns a request, in one route: check every argument; get the KV (a fresh
RuntimeKVCache sized for the call, tag ``kv_cache``, started from a PrefixCache / ResumeHandle
/ PrefixPool through the ``kv`` package when one is given: :func:`prefill_request`); prefill;
then decode, one token at a time, through the captured decode step where the backend has one
(``graphs.decode_step``) or the eager forward + head. A request without a prefix touches no
prefix code. It uses only the Model's public surface (``lock``, ``check_alive``,
``check_token_ids``, ``encode_prompt``, ``request_plan``, ``resolve_kv_modes``,
``new_kv_cache``, ``kv_registry``, ``residual_rows``, ``logit_row``, ``forward``, ``head``,
``head_sample``, ``extra``, ``ops``, ``pool``); ``model.py`` imports this module, never the
reverse. Each call holds the model's lock while it computes and releases its cache when
it ends, however it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .adaptive import ExitRule, exit_rule_for
from .backends.base import check_filters, is_finite_number, is_integral_number, non_finite_logits
from .config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_REPEAT_LAST_N
from .config import as_int as _as_int
from .errors import ConfigError, NonFiniteLogitsError, OutOfMemoryError, TinyLoopError
from .graphs import decode_step, decode_step_auto
from .kv.handles import HandleStorage, PrefixCache, ResumeHandle
from .kv.layouts import mode_name
from .kv.pool import PrefixPool, common_prefix


@dataclass
class GenerationResult:
    """What :func:`generate` returns (and :attr:`Stream.result` holds once a stream ended).

    ``token_ids`` (new tokens only), ``text`` (their decoded text, cut before a stop string),
    ``prompt_token_ids``, ``finish_reason`` ("length" | "eos" | "stop"; "error" in the
    ``partial`` result an error carries, ``TinyLoopError.partial``), ``depth``,
    ``prefill_ms``, ``decode_ms`` (from the prefill's end to the moment the last token is
    known, before the KV cache's release), ``decode_tokens_per_s`` (new tokens after the
    first over the decode time; 0.0 when fewer than 2 tokens), ``cached_tokens`` (prompt
    positions taken from a PrefixCache / ResumeHandle / PrefixPool instead of prefilled), and
    ``depths``: the depth of the forward whose logits each new token was sampled from (the
    first token's is the prompt's; at a fixed depth every entry is ``depth``; at
    depth="auto" ``depth`` is the max depth and :attr:`mean_depth` the mean of ``depths``).
    At depth="auto" ``extra`` holds ``exit_rule`` ((rule, threshold, max_depth)) and
    ``exit_values``: per decode position run, the statistic each check compared with the
    threshold (``adaptive.ExitRule.values``).
    """

    token_ids: list
    text: str
    prompt_token_ids: list
    finish_reason: str
    depth: int
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    depths: list = field(default_factory=list)

    @property
    def mean_depth(self) -> float:
        """The mean of ``depths`` (0.0 without new tokens)."""
        return float(np.mean(self.depths)) if self.depths else 0.0


@dataclass
class StreamToken:
    """One streamed token: its id, the text it completes (may be empty: mid-character, held
    back while it may still become a stop string, or the token that completed a stop string),
    and ``finish_reason`` ("length" | "eos" | "stop") on the last piece when the stream knows
    it is the last as it yields it, else None (the last token before an EOS is yielded before
    the EOS is known, when nothing was held back: :attr:`Stream.finish_reason` says it)."""

    token_id: int
    text: str
    finish_reason: str | None = None


SAMPLING_EPS = 1e-5     # temperatures below it sample greedily (check_request)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating))
            and not isinstance(v, (bool, np.bool_)))


def check_sampling(max_new_tokens, temperature, top_k, top_p, min_p=0.0,
                   repetition_penalty=1.0, repeat_last_n=DEFAULT_REPEAT_LAST_N) -> None:
    """Raise ConfigError naming the first bad sampling argument (NumPy scalars are fine)."""
    if (not _is_number(max_new_tokens) or not is_integral_number(max_new_tokens)
            or max_new_tokens < 0):
        raise ConfigError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r:.80}")
    if not _is_number(temperature) or not is_finite_number(temperature) or temperature < 0:
        raise ConfigError(f"temperature must be a finite number >= 0, got {temperature!r:.80}")
    if not _is_number(top_k) or not is_integral_number(top_k) or top_k < 0:
        raise ConfigError(f"top_k must be an int >= 0 (0 = off), got {top_k!r:.80}")
    if not _is_number(top_p) or not 0 <= top_p <= 1:
        raise ConfigError(f"top_p must be in [0, 1] (0 = greedy), got {top_p!r:.80}")
    check_filters(min_p, repetition_penalty, repeat_last_n)


def _normalise_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
    stop = list(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return stop


@dataclass(frozen=True)
class _Request:
    """A generation request whose arguments passed every check (:func:`check_request`)."""

    ids: np.ndarray            # int32 [T] prompt ids
    max_new_tokens: int
    depth: int                 # the fixed depth, or at depth="auto" the max depth
    kv_mode: tuple             # one KV mode per physical layer
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    repeat_last_n: int
    seed: int | None
    stops: list
    prefix: object
    prefix_pool: object
    kv_iterations: str = "all"  # the iteration KV policy (kv.layouts.KV_ITERATIONS)
    exit: ExitRule | None = None   # depth="auto": the exit rule (tinyloop.adaptive)
    ignore_eos: bool = False       # end-of-generation tokens end nothing: tokens like any other


def kv_iterations_arg(model, kv_iterations, prefix=None, prefix_pool=None) -> str:
    """The iteration KV policy of a request: ``kv_iterations`` or the load's default; a
    ``prefix`` fixes it (its ``kv_iterations``). Raises ConfigError for an unknown policy or
    one that differs from the prefix's."""
    if isinstance(prefix, PrefixCache):
        if kv_iterations is not None and \
                model.resolve_kv_iterations(kv_iterations) != prefix.kv_iterations:
            raise ConfigError(f"kv_iterations={kv_iterations!r} differs from the prefix's "
                              f"{prefix.kv_iterations!r}")
        return prefix.kv_iterations
    return model.resolve_kv_iterations(kv_iterations)


def reusable_positions(model, m: int, kv_iterations: str) -> int:
    """How many of ``m`` cached positions a request reuses: all of them under "all"; under
    "latest" the largest multiple of the forward's chunk rows (``Model.chunk_rows``) <= m,
    so the positions after them run in the chunks an uncached run gives them (a chunk's
    positions read each other's current-iteration K/V, a restored position holds its last
    iteration's) and the request equals its uncached run."""
    if kv_iterations == "all":
        return m
    return m - m % model.chunk_rows


def check_request(model, prompt, max_new_tokens, depth, temperature, top_k, top_p, seed,
                  stop, kv_mode, prefix, prefix_pool, min_p=0.0, repetition_penalty=1.0,
                  repeat_last_n=DEFAULT_REPEAT_LAST_N, kv_iterations=None, exit_rule=None,
                  exit_threshold=None, max_depth=None, ignore_eos=False) -> _Request:
    """Every argument check of generate / stream, in one place, before any work: both raise
    the same error for the same bad argument, at the call."""
    model.check_alive()
    if not isinstance(ignore_eos, (bool, np.bool_)):
        raise ConfigError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    cfg = model.config
    rule = exit_rule_for(cfg, depth, exit_rule, exit_threshold, max_depth)
    rule = _prefix_rule(prefix, depth, rule)
    if rule is not None:
        if prefix_pool is not None:
            raise ConfigError("depth='auto' runs without prefix_pool= (a pool's entries are "
                              "not keyed by an exit rule; pass prefix= a PrefixCache "
                              "prefilled at depth='auto')")
        depth = rule.max_depth
    if depth is not None:
        cfg.check_depth(_as_int(depth, "depth"))
    max_new_tokens = _as_int(max_new_tokens, "max_new_tokens")
    check_sampling(max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
                   repeat_last_n)
    if seed is not None:
        seed = _as_int(seed, "seed")
        if seed < 0:
            raise ConfigError(f"seed must be None or an int >= 0, got {seed}")
    stops = _normalise_stop(stop)
    model.resolve_kv_modes(kv_mode)          # a bad kv_mode raises before any work
    policy = kv_iterations_arg(model, kv_iterations, prefix, prefix_pool)
    if isinstance(prompt, str) and model.tokenizer is not None:
        check_text_length(model, prompt, max_new_tokens, "prompt")
    ids = model.encode_prompt(prompt)
    depth, modes = check_prefix_args(model, ids, depth, kv_mode, prefix, prefix_pool)
    total = len(ids) + max_new_tokens
    if total > model.max_seq_len:
        raise ConfigError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                          f"({max_new_tokens!s:.80}) = {total!s:.80} exceeds "
                          f"max_seq_len={model.max_seq_len}")
    # a temperature below SAMPLING_EPS is greedy (as vLLM's _SAMPLING_EPS): logits over it
    # leave float range; a top_k past the vocabulary keeps it all, as 0 does
    temperature = 0.0 if temperature < SAMPLING_EPS else float(temperature)
    top_k = min(int(top_k), cfg.vocab_size)
    return _Request(ids, max_new_tokens, depth, tuple(modes), temperature, top_k,
                    float(top_p), float(min_p), float(repetition_penalty), int(repeat_last_n),
                    seed, stops, prefix, prefix_pool, policy, rule, bool(ignore_eos))


MAX_CHARS_PER_POSITION = 256    # a text over max_seq_len times this is refused unencoded


def check_text_length(model, text: str, max_new_tokens: int, what: str) -> None:
    """Refuse, before encoding (a long text takes seconds and gigabytes to encode), a text
    that cannot fit ``max_seq_len`` with ``max_new_tokens``: at least
    ``Tokenizer.min_tokens(text)`` tokens, or over MAX_CHARS_PER_POSITION characters a
    position (a length only bytes the model drops, at no token, could bring back into the
    window). ``what`` names the text in the ConfigError."""
    n = model.max_seq_len
    if len(text) > n * MAX_CHARS_PER_POSITION:
        raise ConfigError(f"{what} of {len(text)} characters is over the "
                          f"{n * MAX_CHARS_PER_POSITION}-character limit "
                          f"({MAX_CHARS_PER_POSITION} a position of max_seq_len={n})")
    lo = model.tokenizer.min_tokens(text)
    if lo + max_new_tokens > n:
        raise ConfigError(f"{what} (at least {lo} tokens: {len(text)} characters) + "
                          f"max_new_tokens ({max_new_tokens!s:.80}) exceeds max_seq_len={n}")


def _prefix_rule(prefix, depth, rule: ExitRule | None) -> ExitRule | None:
    """The request's exit rule given its ``prefix``: a PrefixCache prefilled at depth="auto"
    fixes its rule (a request without a depth takes it; one at depth="auto" must name the
    same rule, threshold and max depth), and one prefilled at a fixed depth takes no rule.
    Raises ConfigError on a mismatch."""
    key = getattr(prefix, "exit_key", None) if isinstance(prefix, PrefixCache) else None
    if key is None:
        if rule is not None and prefix is not None:
            raise ConfigError("this prefix was prefilled at a fixed depth; a depth='auto' "
                              "request needs one prefilled at depth='auto' under its rule")
        return rule
    if rule is None and depth is None:
        return ExitRule(*key)
    if rule is None or rule.key != key:
        got = "a fixed depth" if rule is None else f"{rule.key}"
        raise ConfigError(f"the prefix was prefilled at depth='auto' under (exit_rule, "
                          f"exit_threshold, max_depth) = {key}; this request asks for {got}")
    return rule


class Stream:
    """What :func:`stream` returns: an iterator of :class:`StreamToken` (``next``, ``for``,
    ``close()``). Once it ended, :attr:`result` is the GenerationResult :func:`generate` would
    have returned (also the ``StopIteration`` value) and :attr:`finish_reason` says why it
    ended; both are None before. An error that ends it part-way carries the partial result
    (``TinyLoopError.partial``)."""

    def __init__(self, gen):
        self._gen = gen
        self._result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> StreamToken:
        try:
            return next(self._gen)
        except StopIteration as e:
            if e.value is not None:
                self._result = e.value
            raise

    def close(self) -> None:
        """Stop the stream now, releasing its KV cache (idempotent)."""
        self._gen.close()

    @property
    def result(self) -> GenerationResult | None:
        return self._result

    @property
    def finish_reason(self) -> str | None:
        return None if self._result is None else self._result.finish_reason


def stream(model, prompt, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, depth=None, temperature=0.0,
           top_k=0, top_p=1.0, seed=None, stop=None, kv_mode=None, *, prefix=None,
           prefix_pool=None, min_p=0.0, repetition_penalty=1.0,
           repeat_last_n=DEFAULT_REPEAT_LAST_N, kv_iterations=None, exit_rule=None,
           exit_threshold=None, max_depth=None, ignore_eos=False) -> Stream:
    """A :class:`Stream` of StreamToken, one per new token. Sampling rule: see
    ``backends.numpy_ops.sample_from_logits`` (the uniform draws come from
    ``numpy.random.default_rng(seed)`` on the host, so both backends sample alike): the
    repetition penalty (``repetition_penalty``, 1 = off; it applies to greedy decoding too)
    over the distinct tokens of the request's last ``repeat_last_n`` positions (prompt and
    generated, up to the one sampled from; 0 = off; default DEFAULT_REPEAT_LAST_N), then
    temperature, top-k, top-p, min-p (``min_p``: keep p >= min_p * p_max; 0 = off). A
    temperature below SAMPLING_EPS (1e-5) picks greedily, as 0 does (vLLM's rule: dividing
    by it would take the logits past float range).

    Every argument is checked here, at the call (the same checks and errors as
    :func:`generate`); the work starts at the first ``next``.

    Stops at ``max_new_tokens``, at an end-of-generation token (not yielded;
    ``Model.end_of_generation_ids``: the EOS token, the tokenizer's ``eog_ids`` where
    llama.cpp stops, and a Hugging Face folder's generation_config.json ids), or once the
    decoded text contains a ``stop`` string (the text is cut before the earliest one).
    ``ignore_eos``: those tokens end nothing and are yielded like any other token, so a run
    without stop strings always makes ``max_new_tokens`` tokens (what a decode benchmark
    needs: vLLM's ``SamplingParams.ignore_eos``, llama.cpp's ``--ignore-eos``). The yielded ids are
    :func:`generate`'s ``token_ids`` (the token that completed a stop string included, with
    the text before the stop string) and their texts joined equal its ``text``: a token's text
    leaves out the tail that could still grow into a stop string (or is part of a UTF-8
    character split across tokens); that tail comes with a later token once it cannot, and
    such a token is yielded only after the next one is known, so a tail left at EOS still
    arrives with it.

    Raises, at the call: ConfigError (bad arguments, prompt + max_new_tokens > max_seq_len),
    TokenizerError (ids out of range / no tokenizer for text), ModelFreedError, HandleError
    (a released prefix). At a ``next``: ModelFreedError (the model was freed while the stream
    was open), NonFiniteLogitsError (logits with NaN or +inf, or all -inf), OutOfMemoryError
    (both name the ``step``, 0 for the first new token, and the ``position`` sampled from),
    HandleError (the prefix was released meanwhile); each carries ``partial``, the
    GenerationResult of the tokens so far.

    ``kv_iterations``: the iteration KV policy ("all" | "latest"; default the load's;
    :func:`kv_iterations_arg` says which combinations are refused).

    ``depth="auto"``: each decode position runs recurrent iterations until ``exit_rule``
    ("gate" | "kl" | "state") with ``exit_threshold`` exits, at most ``max_depth`` (default
    the model's); the prompt runs at ``max_depth``. :mod:`tinyloop.adaptive` states each rule,
    its source and what an early exit leaves in the K/V cache; the steps run eagerly (no
    captured graph). Not with ``prefix`` / ``prefix_pool`` (ConfigError).

    ``prefix`` (a PrefixCache / ResumeHandle the prompt's ids start with; it fixes depth and
    kv_mode) or ``prefix_pool`` (a PrefixPool: the longest cached prefix is reused and the
    prompt inserted): only the positions after the cached ones are prefilled
    (:func:`prefill_request`); the tokens equal those of an uncached run.

    The model's lock is held only while a token is computed, never across a ``yield``: each
    step touches only this request's KV cache and the residual row of its own position, so
    other callers may run between two steps of an open stream. The KV cache is made at the
    first step and released as soon as the last token is known (before it is yielded), when
    the stream is closed, or by ``free_model``.
    """
    req = check_request(model, prompt, max_new_tokens, depth, temperature, top_k, top_p, seed,
                        stop, kv_mode, prefix, prefix_pool, min_p, repetition_penalty,
                        repeat_last_n, kv_iterations, exit_rule, exit_threshold, max_depth,
                        ignore_eos)
    return Stream(_run(model, req))


def _run(model, req: _Request):
    """The generation loop behind :func:`stream` and :func:`generate`: yields StreamToken,
    returns the GenerationResult."""
    tok = model.tokenizer
    ids = req.ids
    total = len(ids) + req.max_new_tokens
    temperature, top_k, top_p = req.temperature, req.top_k, req.top_p
    min_p, last_n = req.min_p, req.repeat_last_n
    penalty = req.repetition_penalty if last_n > 0 else 1.0
    history = [int(t) for t in ids] if penalty != 1.0 else None   # prompt, then new tokens
    rng = np.random.default_rng(req.seed)
    new: list[int] = []
    depths: list[int] = []     # the depth each token in ``new`` was sampled at
    ran = req.depth            # the depth of the last forward whose row is sampled
    cache = None
    cached = 0
    prefill_ms = 0.0
    t1 = None                  # when the prefill ended
    t2 = None                  # when the last token was known (before the cache's release)

    def result(reason: str, text: str) -> GenerationResult:
        extra = {}
        if req.exit is not None:        # depth="auto": what each decode position compared
            extra = {"exit_rule": req.exit.key, "exit_values": [list(v) for v in
                                                                req.exit.values]}
        end = time.perf_counter() if t2 is None else t2
        decode_ms = 0.0 if t1 is None else (end - t1) * 1e3
        n = len(new)
        tps = (n - 1) / (decode_ms / 1e3) if n > 1 and decode_ms > 0 else 0.0
        return GenerationResult(token_ids=list(new), text=text,
                                prompt_token_ids=ids.tolist(), finish_reason=reason,
                                depth=req.depth, prefill_ms=prefill_ms, decode_ms=decode_ms,
                                decode_tokens_per_s=tps, cached_tokens=cached,
                                depths=list(depths), extra=extra)

    if req.max_new_tokens == 0:
        return result("length", "")

    def step(step_ids, pos0: int) -> int:
        """Forward ``step_ids`` at ``pos0`` (the prompt: from the cached prefix on), then
        head + sample, atomically under the lock."""
        nonlocal cache, cached, ran
        with model.lock:
            model.check_alive()
            if cache is None:
                cache = model.new_kv_cache(req.depth, total, kv_mode=req.kv_mode,
                                           kv_iterations=req.kv_iterations)
            row = model.logit_row()
            pos = pos0 + len(step_ids) - 1
            # one u per sampled token, drawn the same way on every path (graph or eager)
            u = float(rng.random()) if temperature > 0 else 0.0
            # the penalty window: the tokens of the last ``last_n`` positions through pos
            recent = (np.asarray(history[max(0, pos + 1 - last_n):pos + 1], np.int32)
                      if history is not None else None)
            filters = {}
            if min_p > 0.0:
                filters["min_p"] = min_p
            if recent is not None:
                filters.update(repetition_penalty=penalty, recent_ids=recent)
            if pos0 == 0:
                cached = prefill_request(model, step_ids, req.depth, req.kv_mode, cache,
                                         req.prefix, req.prefix_pool)
            elif req.exit is not None:
                # the parts of the step replay as graphs where the backend can
                got = decode_step_auto(model, cache, int(step_ids[0]), pos0, req.exit,
                                       temperature, top_k, top_p, u, min_p, penalty, recent,
                                       last_n)
                if got is not None:
                    nxt, ran = got
                    return nxt
                ran = model.forward_auto(int(step_ids[0]), pos0, cache, req.exit)
            else:
                if len(step_ids) == 1:
                    # a decode step runs as the captured step where the backend can
                    nxt = decode_step(model, cache, int(step_ids[0]), pos0, temperature,
                                      top_k, top_p, u, min_p, penalty, recent, last_n)
                    if nxt is not None:
                        return nxt
                model.forward(step_ids, pos0, req.depth, cache)
            return model.head_sample(pos, row, temperature, top_k, top_p, u, **filters)

    st = StreamText(tok, req.stops, req.max_new_tokens)
    pos = len(ids) - 1  # the position the current step samples from
    try:
        t0 = time.perf_counter()
        nxt = step(ids, 0)
        t1 = time.perf_counter()
        prefill_ms = (t1 - t0) * 1e3
        pos = len(ids)
        one = np.empty(1, dtype=np.int32)
        while True:
            if model.is_end_of_generation(nxt) and not req.ignore_eos:
                t2 = time.perf_counter()     # the decode's end: the release is teardown
                pieces = st.eos()
                cache.release()
                res = result("eos", st.text)
                yield from pieces
                return res
            new.append(nxt)
            depths.append(ran)
            if history is not None:
                history.append(nxt)
            pieces, reason = st.push(nxt)
            if reason is not None:
                t2 = time.perf_counter()
                cache.release()              # free the request's memory before the last yield
                res = result(reason, st.text)
                yield from pieces
                return res
            yield from pieces
            one[0] = nxt
            nxt = step(one, pos)
            pos += 1
    except TinyLoopError as e:
        partial = result("error", st.partial_text())
        err = located(e, len(new), pos)
        err.partial = partial
        if err is e:
            raise
        raise err.with_traceback(e.__traceback__) from None
    finally:
        if cache is not None:
            cache.release()


class StreamText:
    """The text of a request's new tokens as it streams: what each token adds that no stop
    string can still claim, and when the request ends (``stream``'s rule, shared with the
    serving engine so a request streams the same pieces alone or batched).

    ``push(id)`` takes a new token that is not EOS and returns ``(pieces, reason)``: the
    StreamTokens to hand out now (a token whose text ends in what may still become a stop
    string or a split UTF-8 character waits for the next one) and the finish reason
    ("stop": the text contains a stop string, cut before the earliest; "length": the
    ``max_new_tokens``-th token) or None. ``eos()`` returns the pieces an EOS releases.
    ``text`` is the text so far (the whole text once it ended)."""

    def __init__(self, tokenizer, stops: list, max_new_tokens: int):
        self.stops = stops
        self.max_new_tokens = max_new_tokens
        self.text = ""         # decoded text of the tokens (cut before a stop string once hit)
        self.count = 0         # tokens pushed
        self.dec = tokenizer.stream() if tokenizer is not None else None
        self.sent = 0          # characters of ``text`` already handed out
        self.pending = None    # (id, text) of a token whose piece waits for the next token:
                               # its text ends in what may become a stop string or a split
                               # character, and if the next token is EOS that tail goes with it

    def _flush(self) -> str:
        return self.dec.flush() if self.dec is not None else ""

    def eos(self) -> list:
        self.text += self._flush()
        if self.pending is None:
            return []
        return [StreamToken(self.pending[0], self.pending[1] + self.text[self.sent:], "eos")]

    def push(self, nxt: int):
        self.count += 1
        start = len(self.text)
        self.text += self.dec.push(nxt) if self.dec is not None else ""  # holds split UTF-8
        cut = _first_stop(self.text, self.stops, start)
        out = []
        if cut is not None or self.count >= self.max_new_tokens:
            if cut is not None:
                reason, self.text = "stop", self.text[:cut]
            else:
                reason = "length"
                self.text += self._flush()
            if self.pending is not None:
                out.append(StreamToken(*self.pending))
            out.append(StreamToken(nxt, self.text[self.sent:], reason))
            return out, reason
        # hand out only text no stop string can still claim: hold back the longest tail that
        # is the start of a stop string
        held = _stop_prefix_len(self.text, self.stops)
        safe = max(self.sent, len(self.text) - held)
        piece, self.sent = self.text[self.sent:safe], safe
        if self.pending is not None:
            out.append(StreamToken(*self.pending))
            self.pending = None
        if held or (self.dec is not None and self.dec.holding):
            self.pending = (nxt, piece)
        else:
            out.append(StreamToken(nxt, piece))
        return out, None

    def partial_text(self) -> str:
        """The text so far with whatever the decoder still holds (an error's partial)."""
        return self.text + self._flush()


def located(e: TinyLoopError, step: int, position: int) -> TinyLoopError:
    """``e`` with the generation step and the position it samples from, for the errors that
    carry them (NonFiniteLogitsError, OutOfMemoryError) and do not have them yet; else ``e``."""
    if isinstance(e, NonFiniteLogitsError) and e.step is None:
        return non_finite_logits(e.kind, step=step, position=position)
    if isinstance(e, OutOfMemoryError) and e.step is None:
        what = ("the prefill" if step == 0 else "decode") + f" step {step}"
        return OutOfMemoryError(
            f"{what} (the token sampled from position {position}): {e}",
            requested_bytes=e.requested_bytes, tag=e.tag, allocated_bytes=e.allocated_bytes,
            reserved_bytes=e.reserved_bytes, limit_bytes=e.limit_bytes,
            device_free_bytes=e.device_free_bytes, device=e.device, step=step,
            position=position)
    return e


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string occurrence that ends past ``text[:start]`` begins."""
    hits = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string.
    Only tails starting with the stop string's first character are compared, earliest (the
    longest) first, each by one C-level startswith: no slice of the stop string per length
    (which cost O(len(stop)^2) a token)."""
    best, n = 0, len(text)
    for s in stops:
        m = min(len(s) - 1, n)
        if m <= best:
            continue
        i = text.find(s[0], n - m)
        while i != -1 and n - i > best:
            if s.startswith(text[i:]):
                best = n - i
                break
            i = text.find(s[0], i + 1)
    return best


def generate(model, prompt, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, depth=None, temperature=0.0,
             top_k=0, top_p=1.0, seed=None, stop=None, kv_mode=None, *, prefix=None,
             prefix_pool=None, min_p=0.0, repetition_penalty=1.0,
             repeat_last_n=DEFAULT_REPEAT_LAST_N, kv_iterations=None, exit_rule=None,
             exit_threshold=None, max_depth=None, ignore_eos=False) -> GenerationResult:
    """Run :func:`stream` to completion and return its GenerationResult (the same code: the
    same tokens, text and finish reason, the same argument checks and errors).

    Holds the model's lock for the whole call (the lock is re-entrant, so the stream's
    per-token acquisitions nest): concurrent generate/logits/score calls on one Model run one
    after another, never interleaved.
    """
    s = stream(model, prompt, max_new_tokens, depth, temperature, top_k, top_p, seed, stop,
               kv_mode, prefix=prefix, prefix_pool=prefix_pool, min_p=min_p,
               repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n,
               kv_iterations=kv_iterations, exit_rule=exit_rule, exit_threshold=exit_threshold,
               max_depth=max_depth, ignore_eos=ignore_eos)
    with model.lock:
        for _ in s:
            pass
    return s.result


def teacher_forced_logits(model, token_ids, depth=None, kv_mode=None, *, prefix=None,
                          prefix_pool=None, kv_iterations=None) -> np.ndarray:
    """float32 ``[T, vocab]`` next-token logits at every position (see Model.logits).

    With ``prefix`` / ``prefix_pool`` the cached positions are restored, not recomputed: their
    rows come from the cached final residuals through the head."""
    model.check_alive()
    cfg = model.config
    if depth == "auto":
        raise ConfigError("depth='auto' decides each decode position's depth: it runs in "
                          "generate / stream; logits / score take a fixed depth")
    if depth is not None:
        cfg.check_depth(_as_int(depth, "depth"))
    ids = model.encode_prompt(token_ids)         # text or ids; empty: [BOS]
    if len(ids) > model.max_seq_len:
        raise ConfigError(f"{len(ids)} tokens exceed max_seq_len={model.max_seq_len}")
    policy = kv_iterations_arg(model, kv_iterations, prefix, prefix_pool)
    depth, kv_mode = check_prefix_args(model, ids, depth, kv_mode, prefix, prefix_pool)
    out = np.empty((len(ids), cfg.vocab_size), dtype=np.float32)
    with model.lock:
        model.check_alive()
        ops = model.ops
        block = {e.name: e for e in model.request_plan(len(ids), depth, logits=True,
                                                       kv_mode=kv_mode)}["logits"]
        rows = block.shape[0]
        with model.new_kv_cache(depth, len(ids), kv_mode=kv_mode,
                                kv_iterations=policy) as cache:
            block_arr, blk = ops.empty(model.pool, block.shape, block.dtype, block.tag)
            try:
                prefill_request(model, ids, depth, kv_mode, cache, prefix, prefix_pool)
                # the final rows of every position are in the residual buffer now: the head
                # runs over row blocks at absolute multiples of ``rows``, so a position's
                # logits come from the same block whichever positions came from a cache
                for r0 in range(0, len(ids), rows):
                    n = min(rows, len(ids) - r0)
                    view = block_arr.reshape(-1)[:n * cfg.vocab_size].reshape(
                        n, cfg.vocab_size)
                    model.head(r0, n, view)
                    out[r0:r0 + n] = ops.to_host(view)
            finally:
                model.pool.free(blk)
    return out


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (max-subtracted)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def score(model, token_ids, depth=None, kv_mode=None, *, prefix=None,
          prefix_pool=None, kv_iterations=None) -> np.ndarray:
    """float64 ``[T-1]``: log p(token[t+1] | tokens[0..t]); needs T >= 2."""
    ids = model.encode_prompt(token_ids)
    if len(ids) < 2:
        raise ConfigError("score needs at least 2 tokens (a context and a next token)")
    lp = log_softmax_rows(teacher_forced_logits(model, ids, depth, kv_mode, prefix=prefix,
                                                prefix_pool=prefix_pool,
                                                kv_iterations=kv_iterations)[:-1])
    return lp[np.arange(len(ids) - 1), ids[1:]]


# -- the KV of a request that starts from a cache, and the prefills that make handles ---------
def _depth_arg(model, depth) -> int:
    return model.config.check_depth(_as_int(depth, "depth") if depth is not None else None)


def check_prefix_args(model, ids: np.ndarray, depth, kv_mode, prefix, prefix_pool):
    """Validate ``depth`` / ``kv_mode`` and ``prefix=`` / ``prefix_pool=`` for a request of
    ``ids``; return the resolved (depth, modes: one KV mode per physical layer). A prefix fixes
    both: a different explicit depth or kv_mode is a ConfigError (never a silent re-prefill),
    as is a prompt that does not start with the prefix's tokens (the message names the first
    position that differs). Raises HandleError for a released handle or one of another
    model."""
    if prefix is not None and prefix_pool is not None:
        raise ConfigError("pass prefix= or prefix_pool=, not both")
    if prefix is not None:
        if not isinstance(prefix, PrefixCache):
            raise ConfigError(f"prefix must be a PrefixCache or ResumeHandle, got "
                              f"{type(prefix).__name__}")
        with model.lock:
            prefix.check(model)
            p_depth, p_modes = prefix.depth, prefix.modes
        if depth is not None and _depth_arg(model, depth) != p_depth:
            raise ConfigError(f"depth={depth} differs from the prefix's depth {p_depth}; "
                              f"prefill the prefix at that depth (or upgrade a ResumeHandle)")
        if kv_mode is not None and model.resolve_kv_modes(kv_mode) != p_modes:
            raise ConfigError(f"kv_mode={kv_mode!r} differs from the prefix's kv_mode "
                              f"{mode_name(p_modes)!r}")
        n = len(prefix)
        if len(ids) < n:
            raise ConfigError(f"the prompt ({len(ids)} tokens) is shorter than the prefix "
                              f"({n} tokens); it must start with the prefix's tokens")
        m = common_prefix(prefix.ids, ids)
        if m < n:
            raise ConfigError(f"the prompt differs from the prefix at position {m} (prompt "
                              f"token {int(ids[m])}, prefix token {int(prefix.ids[m])}); "
                              f"it must start with the prefix's {n} tokens")
        return p_depth, p_modes
    depth = _depth_arg(model, depth)
    modes = model.resolve_kv_modes(kv_mode)
    if prefix_pool is not None:
        if not isinstance(prefix_pool, PrefixPool):
            raise ConfigError(f"prefix_pool must be a PrefixPool, got "
                              f"{type(prefix_pool).__name__}")
        with model.lock:
            prefix_pool.check(model)
    return depth, modes


def prefill_request(model, ids: np.ndarray, depth: int, modes: tuple, cache,
                    prefix=None, prefix_pool=None) -> int:
    """Fill ``cache`` and the residual rows 0..T-1 for a request's prompt ``ids``: without a
    prefix, the forward from position 0; with ``prefix`` (or the longest match in
    ``prefix_pool``) its positions are restored first and the forward runs from there, and the
    prompt goes into the pool. Returns the number of positions that came from a cache. The
    prefilled positions run in the forward's absolutely aligned chunks, so every row equals
    that of an uncached run. Raises ConfigError when the prefix changed depth after the
    request's checks (an ``upgrade`` in between), HandleError for a released handle. Call
    under the model's lock."""
    m = restore_prefix(model, ids, depth, modes, cache, prefix, prefix_pool)
    if m < len(ids):
        model.forward(ids[m:], m, depth, cache)
        if prefix_pool is not None:
            prefix_pool.insert(ids, depth, tuple(modes), cache,
                               model.residual_rows(0, len(ids)))
    return m


def restore_prefix(model, ids: np.ndarray, depth: int, modes: tuple, cache, prefix=None,
                   prefix_pool=None) -> int:
    """The first half of :func:`prefill_request`: restore the positions of ``prefix`` (or of
    the longest match in ``prefix_pool``) into ``cache`` and the residual rows 0..m-1; returns
    m (0 without a cache or a match). A request that prefills the rest in several lock holds
    (the serving engine's chunked prefill) runs the forward from m itself, keeps the residual
    rows, and ends with :func:`insert_prompt`. Raises as :func:`prefill_request`. Call under
    the model's lock."""
    m, src = 0, None
    modes = tuple(modes)
    if prefix is not None:
        prefix.check(model)
        if (prefix.depth, prefix.modes) != (depth, modes):
            raise ConfigError(f"the {prefix.kind} changed to depth {prefix.depth} after this "
                              f"call began at depth {depth} (an upgrade() ran in between)")
        m, src = len(prefix), prefix
    elif prefix_pool is not None:
        prefix_pool.check(model)
        src, m = prefix_pool.lookup(ids, depth, modes, cache.kv_iterations)
    m = reusable_positions(model, m, cache.kv_iterations)
    if m:
        src.restore(cache, m, model.residual_rows(0, m))
    return m


def insert_prompt(model, ids: np.ndarray, depth: int, modes: tuple, cache, prefix_pool,
                  rows) -> None:
    """The second half of :func:`prefill_request`: insert the prefilled prompt ``ids`` (its
    KV in ``cache``, its final residual rows ``rows`` f32 [T, d_model]) into ``prefix_pool``
    (``PrefixPool.insert``: never fails the request). Call under the model's lock."""
    prefix_pool.check(model)
    prefix_pool.insert(ids, depth, tuple(modes), cache, rows)


def _prompt_ids(model, prompt) -> np.ndarray:
    ids = model.encode_prompt(prompt)
    if len(ids) > model.max_seq_len:
        raise ConfigError(f"prompt ({len(ids)} tokens) exceeds max_seq_len={model.max_seq_len}")
    return ids


def _resume_policy(model, kv_iterations) -> None:
    """ResumeHandles keep their K/V under kv_iterations="all": ConfigError for "latest"
    (given, or the load's default). There an upgrade cannot equal a fresh prefill at the new
    depth: a chunk's first iterations read the earlier chunks' last iteration, which the
    upgrade changes after they ran."""
    policy = model.resolve_kv_iterations(kv_iterations)
    if policy != "all":
        raise ConfigError(f"resume handles keep K/V under kv_iterations='all' only, not "
                          f"{policy!r}: an upgrade under 'latest' would change what the "
                          f"positions' first iterations read; pass kv_iterations='all'")


def make_prefix(model, prompt, depth=None, kv_mode=None, kv_iterations=None, exit_rule=None,
                exit_threshold=None, max_depth=None) -> PrefixCache:
    """:meth:`Model.prefill`: prefill ``prompt`` at ``depth`` into a new PrefixCache; at
    ``depth="auto"`` every position at the rule's max depth (as a depth="auto" request
    prefills), the handle keyed by the rule (``PrefixCache.exit_key``); its K/V under
    ``kv_iterations`` (a request reuses a "latest" handle's positions up to a multiple of the
    chunk rows: :func:`reusable_positions`). Raises ConfigError / TokenizerError on bad
    input, OutOfMemoryError (nothing stays allocated)."""
    model.check_alive()
    policy = model.resolve_kv_iterations(kv_iterations)
    rule = exit_rule_for(model.config, depth, exit_rule, exit_threshold, max_depth)
    if rule is not None:
        depth = rule.max_depth
    depth = _depth_arg(model, depth)
    modes = model.resolve_kv_modes(kv_mode)
    ids = _prompt_ids(model, prompt)
    with model.lock:
        model.check_alive()
        st = HandleStorage(model, depth, len(ids), modes, kv_iterations=policy)
        try:
            model.forward(ids, 0, depth, st.kv)
            st.rows[...] = model.residual_rows(0, len(ids))
            st.hold_pages()
            return PrefixCache(model, ids, depth, modes, st,
                               exit_key=None if rule is None else rule.key)
        except BaseException:
            st.release()
            raise


def make_resume_handle(model, prompt, depth=None, max_depth=None, kv_mode=None,
                       kv_iterations=None) -> ResumeHandle:
    """:meth:`Model.resume_handle`: prefill at ``depth`` keeping what upgrades need (K/V room
    for ``max_depth`` iterations, the residual snapshot). Raises ConfigError for a max_depth
    outside depth..the model's, or kv_iterations="latest" (:func:`_resume_policy`), and as
    :func:`make_prefix`."""
    model.check_alive()
    _resume_policy(model, kv_iterations)
    if depth == "auto":
        raise ConfigError("resume_handle takes a fixed depth: at depth='auto' every prompt "
                          "position runs at the max depth (no position exits early), so an "
                          "upgrade would have nothing to deepen; prefill(depth='auto') keeps "
                          "such a prompt")
    cfg = model.config
    depth = _depth_arg(model, depth)
    max_depth = cfg.max_depth if max_depth is None else _as_int(max_depth, "max_depth")
    if not depth <= max_depth <= cfg.max_depth:
        raise ConfigError(f"max_depth={max_depth} must be in {depth}..{cfg.max_depth} "
                          f"(depth={depth}, the model's max_depth={cfg.max_depth})")
    modes = model.resolve_kv_modes(kv_mode)
    ids = _prompt_ids(model, prompt)
    n = len(ids)
    with model.lock:
        model.check_alive()
        st = HandleStorage(model, max_depth, n, modes, snapshot=True)
        try:
            model.forward(ids, 0, depth, st.kv.at_depth(depth), snapshot=st.snap)
            st.rows[...] = model.residual_rows(0, n)
            st.hold_pages()
            return ResumeHandle(model, ids, depth, modes, st, max_depth)
        except BaseException:
            st.release()
            raise
