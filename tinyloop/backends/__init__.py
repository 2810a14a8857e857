"""Backends: each implements the small set of ops the forward is written against.

``numpy_ops.NumpyOps`` is the reference (the oracle); ``cuda_ops.CudaOps`` runs RawModule
kernels from ``cuda_src/``. ``get_ops(name)`` resolves "auto" | "numpy" | "cuda".
"""

from __future__ import annotations

from ..errors import BackendUnavailableError, ConfigError


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: F401
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError when no driver: both mean "no CUDA"
        return False


def get_ops(backend: str = "auto"):
    """Return an Ops instance for ``backend`` ("auto" picks cuda when available)."""
    if backend not in ("auto", "cuda", "numpy"):
        raise ConfigError(f"backend={backend!r} is not one of 'auto', 'cuda', 'numpy'")
    if backend == "auto":
        backend = "cuda" if cuda_available() else "numpy"
    if backend == "numpy":
        from .numpy_ops import NumpyOps
        return NumpyOps()
    if not cuda_available():
        raise BackendUnavailableError("backend='cuda' was requested but CuPy cannot see a CUDA "
                                      "device (is cupy-cuda12x/13x installed and a GPU present?)")
    from .cuda_ops import CudaOps
    return CudaOps()
