"""Serving: the continuous-batching :class:`Engine` (``tinyloop.serve.engine``), the
OpenAI-compatible HTTP server over it (``tinyloop.serve.http``, the ``serve`` extra:
Starlette, uvicorn, prometheus_client; ``tinyloop serve``), one :class:`Replica` of both
(``tinyloop.serve.replica``), several replicas behind a prefix-affinity router
(``tinyloop.serve.router``, ``tinyloop serve --replicas N``) and the Ray Serve deployment
(``tinyloop.serve.ray_serve``, the ``ray`` extra; :func:`ray_app`, ``tinyloop serve --ray``)."""

from ..errors import EngineStoppedError, QueueFullError
from .engine import Engine, EngineRequest, request_kv_bytes
from .replica import Replica, ReplicaSpec

__all__ = ["Engine", "EngineRequest", "EngineStoppedError", "QueueFullError", "Replica",
           "ReplicaSpec", "ray_app", "request_kv_bytes"]


def __getattr__(name):
    # ray_app imports Ray only when asked for (the ray extra)
    if name == "ray_app":
        from .ray_serve import ray_app
        return ray_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
