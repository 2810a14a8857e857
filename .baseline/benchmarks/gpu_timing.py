"""The GPU timer the kernel benchmarks share (CuPy imported on first use, so a script that
imports this still parses its arguments on a machine without CUDA)."""

from __future__ import annotations

import numpy as np


def time_us(fn, reps=200, warmup=10, setup=None) -> tuple[float, float, float]:
    """GPU time of one call of ``fn`` in microseconds, from CUDA events around each of ``reps``
    calls after ``warmup`` untimed ones: (median, 10th percentile, 90th percentile).
    ``setup``: called before every call of ``fn`` (warm-up included), outside the events."""
    import cupy
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    us = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        us.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return float(np.median(us)), float(np.percentile(us, 10)), float(np.percentile(us, 90))
