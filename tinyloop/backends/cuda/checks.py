"""Argument checks at the op boundary: each raises ConfigError naming the bad value; the
hot path runs ``fast_ok`` (one cheap expression) and only on False the detailed checks."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...quant import QuantWeight
from .compile import cupy


def _dev(arr, name: str, dtype, ndim: int | None = None):
    if not isinstance(arr, cupy.ndarray):
        raise ConfigError(f"{name} must be a cupy.ndarray on the GPU, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ConfigError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ConfigError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ConfigError(f"{name} must be C-contiguous (shape {arr.shape}, "
                          f"strides {arr.strides})")
    return arr


def _shape(arr, name: str, want: tuple) -> None:
    if tuple(arr.shape) != tuple(want):
        raise ConfigError(f"{name} has shape {tuple(arr.shape)}, expected {tuple(want)}")


def _aligned(arr, name: str) -> None:
    if arr.data.ptr % 16:
        raise ConfigError(f"{name} must start on a 16-byte boundary for vector loads "
                          f"(address {arr.data.ptr:#x})")


def _rows(arr, name: str, t: int):
    """``arr[:t]`` for a buffer with at least ``t`` rows (buffers may be sized for max T)."""
    if arr.shape[0] < t:
        raise ConfigError(f"{name} has {arr.shape[0]} rows, need at least {t}")
    return arr if arr.shape[0] == t else arr[:t]


def _weight(w, name: str, in_features: int | None = None) -> QuantWeight:
    if not isinstance(w, QuantWeight):
        raise ConfigError(f"{name} must be a QuantWeight, got {type(w).__name__}")
    if not isinstance(w.qweight, cupy.ndarray):
        raise ConfigError(f"{name}.qweight is on the host ({type(w.qweight).__name__}); "
                          "upload it with CudaOps.upload_weight first")
    if in_features is not None and w.in_features != in_features:
        raise ConfigError(f"{name} has in_features={w.in_features}, but the input has "
                          f"{in_features} columns")
    return w


def _log2g(w: QuantWeight) -> int:
    return int(w.group_size).bit_length() - 1


def _fp16_of(w: QuantWeight):
    return getattr(w, "fp16", None)


_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


def _fast_ok(a, dtype, ndim: int, cols=None, rows=None, aligned: bool = False) -> bool:
    """The hot-path check, one cheap expression: a cupy.ndarray of ``dtype`` with ``ndim``
    dims, C-contiguous; with ``cols`` / ``rows``, that many in the last / first dim; with
    ``aligned``, starting on a 16-byte boundary. On False the caller re-runs the detailed
    checks (``_dev``, ``_shape``, ``_aligned``), which raise with a precise message."""
    return (type(a) is cupy.ndarray and a.dtype == dtype and a.ndim == ndim
            and a.flags.c_contiguous and (cols is None or a.shape[-1] == cols)
            and (rows is None or a.shape[0] == rows) and (not aligned or not a.data.ptr & 15))

