"""Serving: the continuous-batching :class:`Engine` (``tinyloop.serve.engine``) and the
OpenAI-compatible HTTP server over it (``tinyloop.serve.http``, the ``serve`` extra:
Starlette, uvicorn, prometheus_client; ``tinyloop serve``)."""

from ..errors import EngineStoppedError, QueueFullError
from .engine import Engine, EngineRequest, request_kv_bytes

__all__ = ["Engine", "EngineRequest", "EngineStoppedError", "QueueFullError",
           "request_kv_bytes"]
