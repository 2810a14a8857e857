"""TinyLoop: a runtime for quantized looped (recurrent-depth) transformer language models.

Public API (pinned; see README.md):
    load_model(path, max_seq_len=2048, prefill_chunk=0, *, backend="auto") -> Model
    free_model(model); vram_usage_bytes(model) -> int
    default_model_path() -> str        (SmolLM2-135M-Instruct, converted once into the cache)
    memory_stats(), memory_report(), reset_peak_memory_stats(), empty_cache(),
    set_memory_limit()
    TinyLoopError and its family (tinyloop.errors), OutOfMemoryError
    Model.prefill / Model.resume_handle / Model.load_prefix -> PrefixCache / ResumeHandle;
    PrefixPool(model, max_bytes=None)          (tinyloop.prefix)
"""

from __future__ import annotations

from .config import ModelConfig
from .errors import (ArtificialLoopWarning, BackendUnavailableError, ConfigError,
                     ConversionError, FormatError, HandleError, ModelFreedError,
                     NonFiniteLogitsError, OutOfMemoryError, TinyLoopError, TokenizerError)
from .generate import GenerationResult, Stream, StreamToken
from .memory import (empty_cache, export_snapshot, memory_report, memory_stats,
                     reset_peak_memory_stats, set_memory_limit)
from .model import Model, free_model, load_model, vram_usage_bytes
from .prefix import PrefixCache, PrefixPool, ResumeHandle

__version__ = "0.1.0"


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct), converted on first use."""
    from .default import default_model_path as _impl
    return _impl()


__all__ = ["load_model", "free_model", "vram_usage_bytes", "default_model_path", "Model",
           "memory_stats", "memory_report", "reset_peak_memory_stats", "empty_cache",
           "set_memory_limit", "export_snapshot",
           "ModelConfig", "GenerationResult", "Stream", "StreamToken", "TinyLoopError",
           "ConfigError",
           "FormatError", "TokenizerError", "OutOfMemoryError", "BackendUnavailableError",
           "ModelFreedError", "ConversionError", "NonFiniteLogitsError", "HandleError",
           "PrefixCache", "ResumeHandle", "PrefixPool", "ArtificialLoopWarning", "__version__"]
