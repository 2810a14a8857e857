"""One serving replica: a model, its Engine (and PrefixPool) and the OpenAI-compatible app.

:class:`Replica` is the one code path both multi-replica set-ups run: the worker process of
``tinyloop serve --replicas N`` (:func:`worker_main`, started by ``tinyloop.serve.router``
with ``CUDA_VISIBLE_DEVICES`` set in its environment, so CuPy sees only its device from its
first import) and each actor of the Ray Serve deployment (``tinyloop.serve.ray_app``).

A worker serves the app on 127.0.0.1 at an ephemeral port and writes one line of JSON to its
stdout once it is up (``{"ready": true, "port": P, "pid": PID}``; ``{"ready": false, "error":
MESSAGE}`` when the load failed). It stops on SIGTERM / SIGINT, or when its parent process
goes away (so a killed router leaves no worker behind): the engine stops (every request
ends, its pages freed), the PrefixPool is released and the model freed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading

from ..config import as_int
from ..errors import ConfigError, TinyLoopError
from .engine import DEFAULT_SERIAL_ROWS

PARENT_POLL_S = 0.5          # how often a worker checks that its parent is alive

READY_KEY = "ready"          # the key of the worker's one stdout line



def device_ids(devices, what: str = "devices") -> list:
    """``devices`` (ints or digit strings, or one string of ids separated by commas) as a
    list of device id strings, e.g. ["0", "1"]. Raises ConfigError naming ``what`` (an
    argument or an option) when none is given or one is not a non-negative integer."""
    parts = devices.split(",") if isinstance(devices, str) else devices
    out = [str(d).strip() for d in parts]
    if not out or not all(d.isdigit() for d in out):
        raise ConfigError(f"{what} must be device ids (0,1,...), got {devices!r}")
    return out

@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What one replica loads and how its engine runs: ``model`` (a .tlm path), ``backend``,
    ``max_seq_len`` (positions), ``prefill_chunk`` (load_model's: 0 sizes the scratch for
    the whole sequence),
    ``max_batch`` / ``max_queue`` (requests), ``kv_budget`` / ``prefix_cache`` (bytes or a
    size string, None: none), ``model_name`` (the id /v1/models lists; None: the file's name),
    ``engine_prefill_chunk`` (the engine's prompt positions per iteration, None: its
    default), ``serial_rows`` (the engine's: decoding rows stepped one by one through the
    captured step). JSON round-trips it to a worker process or a Ray actor."""

    model: str
    backend: str = "auto"
    max_seq_len: int = 2048
    prefill_chunk: int = 0
    max_batch: int = 32
    max_queue: int = 256
    kv_budget: int | str | None = None
    prefix_cache: int | str | None = None
    model_name: str | None = None
    engine_prefill_chunk: int | None = None
    serial_rows: int = DEFAULT_SERIAL_ROWS

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"ReplicaSpec.model must be a model path, got {self.model!r}")
        for name in ("max_seq_len", "max_batch"):
            if as_int(getattr(self, name), name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queue", "serial_rows"):
            if as_int(getattr(self, name), name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def name(self) -> str:
        """The model id the replica serves under."""
        return self.model_name or os.path.splitext(os.path.basename(self.model))[0]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ReplicaSpec":
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"not a replica spec: {e}") from None


class Replica:
    """A loaded replica: ``model``, ``engine`` (started), ``prefix_pool`` (or None) and the
    Starlette ``app`` (``serve.http.create_app``). :meth:`close` stops the engine, releases
    the PrefixPool and frees the model (idempotent); a failed load frees what it made and
    re-raises."""

    def __init__(self, spec: ReplicaSpec):
        from ..kv.pool import PrefixPool
        from ..model import load_model
        from .engine import DEFAULT_PREFILL_CHUNK as ENGINE_CHUNK
        from .engine import Engine
        from .http import create_app
        self.spec = spec
        self.model = self.engine = self.prefix_pool = None
        self.model = load_model(spec.model, spec.max_seq_len, spec.prefill_chunk,
                                backend=spec.backend)
        try:
            if spec.prefix_cache is not None:
                self.prefix_pool = PrefixPool(self.model, spec.prefix_cache)
            self.engine = Engine(self.model, max_batch=spec.max_batch,
                                 max_queue=spec.max_queue, kv_budget=spec.kv_budget,
                                 prefix_pool=self.prefix_pool,
                                 prefill_chunk=spec.engine_prefill_chunk or ENGINE_CHUNK,
                                 serial_rows=spec.serial_rows)
            self.engine.start()
            self.app = create_app(self.engine, spec.name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the engine, release the PrefixPool, free the model (idempotent)."""
        from ..model import free_model
        eng, self.engine = self.engine, None
        pool, self.prefix_pool = self.prefix_pool, None
        model, self.model = self.model, None
        try:
            if eng is not None:
                eng.stop()
        finally:
            try:
                if pool is not None:
                    pool.release()
            finally:
                if model is not None:
                    free_model(model)

    def __enter__(self) -> "Replica":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parent_gone(ppid: int) -> bool:
    return os.getppid() != ppid


def worker_main(argv=None) -> int:
    """The worker process's main (``argv``: ``--spec JSON``; ``router.WORKER_CODE`` runs it).
    Serves one
    Replica on 127.0.0.1 (an ephemeral port) until SIGTERM / SIGINT or its parent's exit;
    returns 0, or 1 when the load failed (the error on the ready line and stderr)."""
    p = argparse.ArgumentParser(prog="tinyloop-replica")
    p.add_argument("--spec", required=True, help="the ReplicaSpec as JSON")
    a = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ppid = os.getppid()
    try:
        replica = Replica(ReplicaSpec.from_json(a.spec))
    except TinyLoopError as e:
        print(json.dumps({READY_KEY: False, "error": str(e)}), flush=True)
        print(f"tinyloop replica: {e}", file=sys.stderr)
        return 1
    from .http import ServerThread
    try:
        with ServerThread(replica.app) as srv:
            print(json.dumps({READY_KEY: True, "port": srv.port, "pid": os.getpid()}),
                  flush=True)
            while not stop.wait(PARENT_POLL_S):
                if _parent_gone(ppid) or not srv.thread.is_alive():
                    break
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):     # stopping already: a second signal
            signal.signal(sig, signal.SIG_IGN)          # must not cut the clean-up short
        replica.close()
    return 0

