"""Backends: each implements the small set of ops the forward is written against.

``numpy_ops.NumpyOps`` is the reference (the oracle); ``cuda_ops.CudaOps`` runs RawModule
kernels from ``cuda_src/``. ``resolve_backend(name)`` is the one place "auto" is decided;
``ops_class(name)`` gives a backend's class (its ``device``, ``act_dtype``, ``kv_dtype``
without building it) and ``get_ops(name)`` an instance.
"""

from __future__ import annotations

from ..errors import BackendUnavailableError, ConfigError

BACKENDS = ("auto", "cuda", "numpy")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: F401
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError when no driver: both mean "no CUDA"
        return False


def resolve_backend(backend: str = "auto") -> str:
    """"auto" -> "cuda" where CuPy sees a GPU, else "numpy"; "cuda" / "numpy" unchanged.

    Raises ConfigError for any other name. Does not check that "cuda" is usable (``get_ops``
    does)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of 'auto', 'cuda', 'numpy'")
    if backend == "auto":
        return "cuda" if cuda_available() else "numpy"
    return backend


def ops_class(backend: str = "auto"):
    """The Ops subclass of ``backend`` (resolved by ``resolve_backend``), not instantiated: its
    class attributes ``name``, ``device``, ``act_dtype``, ``kv_dtype``, ``fp16_cache_default``
    are the backend's facts. Raises ConfigError for an unknown name."""
    if resolve_backend(backend) == "numpy":
        from .numpy_ops import NumpyOps
        return NumpyOps
    from .cuda_ops import CudaOps           # imports without CuPy (for these class facts)
    return CudaOps


def get_ops(backend: str = "auto"):
    """Return an Ops instance for ``backend`` ("auto" picks cuda when available).

    Raises ConfigError for an unknown name, BackendUnavailableError for "cuda" without a
    device CuPy can see."""
    cls = ops_class(backend)
    if cls.name == "cuda" and not cuda_available():
        raise BackendUnavailableError("backend='cuda' was requested but CuPy cannot see a CUDA "
                                      "device (is cupy-cuda12x/13x installed and a GPU present?)")
    return cls()
