"""What every diagnostics command shares: the model it loads, the request it repeats, progress
bars, and a loss-free copy of the pool's event log."""

from __future__ import annotations

import os
import sys
import time

import tinyloop
from tinyloop.backends import ops_class, resolve_backend

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_MAX_NEW_TOKENS = 8
DEFAULT_MAX_SEQ_LEN = 512


def resolve_model(path: str | None) -> str:
    """``path``, or the embedded default model (converted on first use)."""
    return path if path else tinyloop.default_model_path()


def settle_run(out_dir, requests: int, model, model_path: str | None, backend: str,
               max_seq_len: int):
    """The common start of a repeated-request run: check ``requests`` (ValueError when < 1),
    make ``out_dir``, and settle the model. Returns ``(own, backend, model_path, max_seq_len)``:
    own=True when the run loads (and frees) ``model_path`` itself (backend resolved, default
    model path filled in); False when it uses the given loaded ``model``, whose backend, path
    and max_seq_len are returned."""
    if requests < 1:
        raise ValueError(f"--requests must be >= 1, got {requests}")
    os.makedirs(out_dir, exist_ok=True)
    if model is None:
        return True, resolve_backend(backend), resolve_model(model_path), max_seq_len
    return False, model.backend, model.path, model.max_seq_len


def backend_facts(backend: str) -> dict:
    """What a run's byte figures depend on besides the model: {"backend", "act_dtype",
    "kv_dtype"} (numpy dtype names) of ``backend`` ("auto" resolved)."""
    import numpy as np
    ops = ops_class(backend)
    return {"backend": ops.name, "act_dtype": np.dtype(ops.act_dtype).name,
            "kv_dtype": np.dtype(ops.kv_dtype).name}


def run_on(config: dict) -> str:
    """``"numpy (host pool; activations float32, fp16-mode K/V float32)"``: the backend, pool
    and dtypes a run's figures belong to, from its result's ``config``."""
    dt = (f"; activations {config['act_dtype']}, fp16-mode K/V {config['kv_dtype']}"
          if config.get("act_dtype") else "")
    return f"{config['backend']} ({config['device']} pool{dt})"


def load_timed(path: str, max_seq_len: int, backend: str):
    """(model, seconds to load)."""
    t0 = time.perf_counter()
    model = tinyloop.load_model(path, max_seq_len=max_seq_len, backend=backend)
    return model, time.perf_counter() - t0


def backend_pool(backend: str):
    """The process pool a model of ``backend`` ("auto" | "cuda" | "numpy") allocates from,
    before any model is loaded (a loaded model's is ``model.pool``)."""
    from tinyloop.memory import get_pool
    return get_pool(ops_class(backend).device)


def progress(iterable, *, total: int | None = None, desc: str = "", enabled: bool = True):
    """``iterable`` with a tqdm bar on stderr (plain iterable when disabled)."""
    if not enabled:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, unit="req", leave=False)


class EventCollector:
    """Copies the pool's event log (a ring buffer) as it goes, so a long run loses nothing as
    long as ``collect()`` is called before the ring wraps (once per request is plenty).

    ``events`` holds ``MemoryEvent`` tuples from ``start()`` on; ``dropped`` counts events the
    ring pushed out before they were collected.
    """

    def __init__(self, pool):
        self.pool = pool
        self.events: list = []
        self.dropped = 0
        self._seen = self._total()

    def _total(self) -> int:
        return self.pool.events_dropped + len(self.pool.events())

    def start(self) -> "EventCollector":
        self.events.clear()
        self.dropped = 0
        self._seen = self._total()
        return self

    def collect(self) -> None:
        ev = self.pool.events()
        total = self.pool.events_dropped + len(ev)
        new = total - self._seen
        if new > len(ev):
            self.dropped += new - len(ev)
            new = len(ev)
        if new > 0:
            self.events.extend(ev[-new:])
        self._seen = total
