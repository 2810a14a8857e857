"""Sampling loops over a Model: generate / stream / teacher-forced logits / score.

Each call takes the model's lock for its whole duration, allocates its RuntimeKVCache (tag
``kv_cache``) sized for the call, and releases it when the call ends, however it ends.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .config import DEFAULT_MAX_NEW_TOKENS
from .errors import ConfigError
from .plan import LOGIT_BLOCK_ROWS


@dataclass
class GenerationResult:
    """What :func:`generate` returns.

    ``token_ids`` (new tokens only), ``text`` (their decoded text, cut before a stop string),
    ``prompt_token_ids``, ``finish_reason`` ("length" | "eos" | "stop"), ``depth``,
    ``prefill_ms``, ``decode_ms``, and ``decode_tokens_per_s`` (new tokens after the first
    over the decode time; 0.0 when fewer than 2 tokens).
    """

    token_ids: list
    text: str
    prompt_token_ids: list
    finish_reason: str
    depth: int
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class StreamToken:
    """One streamed token: its id and the text it completes (may be empty mid-character)."""

    token_id: int
    text: str


def _is_number(v) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating))
            and not isinstance(v, (bool, np.bool_)))


def check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    """Raise ConfigError naming the first bad sampling argument (NumPy scalars are fine)."""
    if (not _is_number(max_new_tokens) or not float(max_new_tokens).is_integer()
            or max_new_tokens < 0):
        raise ConfigError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_number(top_k) or not float(top_k).is_integer() or top_k < 0:
        raise ConfigError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p!r}")



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


def stream(model, prompt, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, depth=None, temperature=0.0, top_k=0, top_p=1.0,
           seed=None, stop=None, _result: dict | None = None):
    """Yield StreamToken for each new token. Sampling rule: see
    ``backends.numpy_ops.sample_from_logits`` (the uniform draws come from
    ``numpy.random.default_rng(seed)`` on the host, so both backends sample alike).

    Stops at ``max_new_tokens``, at the EOS token (not yielded), or once the decoded text
    contains a ``stop`` string. Raises ConfigError (bad arguments, prompt + max_new_tokens >
    max_seq_len), TokenizerError (ids out of range / no tokenizer for text), ModelFreedError
    (the model was freed while the stream was open).

    The model's lock is held only while a token is computed, never across a ``yield``: each
    step touches only this request's KV cache and the residual row of its own position, so
    other callers may run between two steps of an open stream. The KV cache is released as
    soon as the last token is known (before it is yielded), or when the stream is closed.
    """
    model._check_alive()
    cfg = model.config
    depth = cfg.check_depth(_as_int(depth, "depth") if depth is not None else None)
    max_new_tokens = _as_int(max_new_tokens, "max_new_tokens")
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    temperature, top_k, top_p = float(temperature), int(top_k), float(top_p)
    if seed is not None:
        seed = _as_int(seed, "seed")
        if seed < 0:
            raise ConfigError(f"seed must be None or an int >= 0, got {seed}")
    stops = _normalise_stop(stop)
    ids = model.encode_prompt(prompt)
    total = len(ids) + max_new_tokens
    if total > model.max_seq_len:
        raise ConfigError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = "
                          f"{total} exceeds max_seq_len={model.max_seq_len}")
    rng = np.random.default_rng(seed)
    res = _result if _result is not None else {}
    res.update(prompt_token_ids=ids.tolist(), finish_reason="length", depth=depth,
               token_ids=[], text="", prefill_ms=0.0, decode_ms=0.0)
    if max_new_tokens == 0:
        return
    tok = model.tokenizer
    ops = model._ops
    cache = model.new_kv_cache(depth, total)

    def step(step_ids, pos0: int) -> int:
        """Forward ``step_ids`` at ``pos0``, then head + sample, atomically under the lock."""
        with model._lock:
            model._check_alive()
            row = model.logit_row()
            model.forward(step_ids, pos0, depth, cache)
            model.head(pos0 + len(step_ids) - 1, 1, row)
            u = float(rng.random()) if temperature > 0 else 0.0
            return int(ops.sample(row[0], temperature, top_k, top_p, u))

    try:
        t0 = time.perf_counter()
        nxt = step(ids, 0)
        t1 = time.perf_counter()
        res["prefill_ms"] = (t1 - t0) * 1e3
        pos = len(ids)
        new: list[int] = []
        text = ""
        dec = tok.stream() if tok is not None else None
        one = np.empty(1, dtype=np.int32)
        while True:
            if nxt == cfg.eos_token_id:
                res["finish_reason"] = "eos"
                text += dec.flush() if dec is not None else ""
                break
            new.append(nxt)
            piece = dec.push(nxt) if dec is not None else ""     # holds back split UTF-8
            start = len(text)
            text += piece
            # a stop string may straddle pieces: search only where it could newly end
            hit = next((s for s in stops if s in text[max(0, start - len(s) + 1):]), None)
            last = hit is not None or len(new) >= max_new_tokens
            if hit is not None:
                res["finish_reason"] = "stop"
                cut = text.find(hit, max(0, start - len(hit) + 1))
                text = text[:cut]
                piece = piece[:max(0, cut - start)]
            elif last and dec is not None:
                tail = dec.flush()
                text += tail
                piece += tail
            res.update(token_ids=list(new), text=text)
            if last:
                cache.release()              # free the request's memory before the last yield
                res["decode_ms"] = (time.perf_counter() - t1) * 1e3
                if piece or hit is None:
                    yield StreamToken(nxt, piece)
                return
            yield StreamToken(nxt, piece)
            one[0] = nxt
            nxt = step(one, pos)
            pos += 1
        res.update(token_ids=list(new), text=text)
        res["decode_ms"] = (time.perf_counter() - t1) * 1e3
    finally:
        cache.release()


def _as_int(v, name: str) -> int:
    """An int (Python or NumPy integer, not bool) or ConfigError naming ``name``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ConfigError(f"{name} must be an int, got {v!r}")
    return int(v)


def generate(model, prompt, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, depth=None, temperature=0.0, top_k=0,
             top_p=1.0, seed=None, stop=None) -> GenerationResult:
    """Run :func:`stream` to completion and return a GenerationResult.

    Holds the model's lock for the whole call (the lock is re-entrant, so the stream's
    per-token acquisitions nest): concurrent generate/logits/score calls on one Model run one
    after another, never interleaved.
    """
    res: dict = {}
    with model._lock:
        for _ in stream(model, prompt, max_new_tokens, depth, temperature, top_k, top_p, seed,
                        stop, _result=res):
            pass
    n = len(res["token_ids"])
    tps = (n - 1) / (res["decode_ms"] / 1e3) if n > 1 and res["decode_ms"] > 0 else 0.0
    return GenerationResult(token_ids=res["token_ids"], text=res["text"],
                            prompt_token_ids=res["prompt_token_ids"],
                            finish_reason=res["finish_reason"], depth=res["depth"],
                            prefill_ms=res["prefill_ms"], decode_ms=res["decode_ms"],
                            decode_tokens_per_s=tps)


def teacher_forced_logits(model, token_ids, depth=None) -> np.ndarray:
    """float32 ``[T, vocab]`` next-token logits at every position (see Model.logits)."""
    model._check_alive()
    cfg = model.config
    depth = cfg.check_depth(depth)
    ids = model._ids_from(token_ids)
    if len(ids) > model.max_seq_len:
        raise ConfigError(f"{len(ids)} tokens exceed max_seq_len={model.max_seq_len}")
    out = np.empty((len(ids), cfg.vocab_size), dtype=np.float32)
    with model._lock:
        model._check_alive()
        ops = model._ops
        rows = min(LOGIT_BLOCK_ROWS, model._buf.capacity_rows, len(ids))
        with model.new_kv_cache(depth, len(ids)) as cache:
            block_arr, blk = ops.empty(model._pool, (rows, cfg.vocab_size), np.float32,
                                       "logits")
            try:
                def on_rows(start, t):
                    for r0 in range(start, start + t, rows):
                        n = min(rows, start + t - r0)
                        view = block_arr.reshape(-1)[:n * cfg.vocab_size].reshape(
                            n, cfg.vocab_size)
                        model.head(r0, n, view)
                        out[r0:r0 + n] = ops.to_host(view)
                model.forward(ids, 0, depth, cache, on_rows=on_rows)
            finally:
                model._pool.free(blk)
    return out


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (max-subtracted)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def score(model, token_ids, depth=None) -> np.ndarray:
    """float64 ``[T-1]``: log p(token[t+1] | tokens[0..t]); needs T >= 2."""
    ids = model._ids_from(token_ids)
    if len(ids) < 2:
        raise ConfigError("score needs at least 2 tokens (a context and a next token)")
    lp = log_softmax_rows(teacher_forced_logits(model, ids, depth)[:-1])
    return lp[np.arange(len(ids) - 1), ids[1:]]
