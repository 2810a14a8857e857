"""stream and generate: one generation loop, so the same ids, text and finish reason; the same
argument checks at the call; errors that name where they struck and carry what was generated;
and nothing a live stream holds outlives free_model."""

from __future__ import annotations

import gc

import pytest

import tinyloop
from tinyloop import errors
from tinyloop.memory import get_pool


def _allocated():
    return get_pool("host").stats().allocated_bytes


# --- free_model with open streams ----------------------------------------------------------------
def test_free_model_releases_what_suspended_streams_hold(tiny_model_path):
    """Streams suspended at a yield (plain, sharing a PrefixCache's pages, on a PrefixPool),
    one in a reference cycle nobody collects, and one never started: free_model returns
    allocated to its value before the load at once, and each stream's next step raises
    ModelFreedError."""
    before = _allocated()
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy")
    system = [5, 6, 7, 8] * 10                       # 40 tokens: one full page and a part
    pc = m.prefill(system, depth=2)
    pool = tinyloop.PrefixPool(m)
    m.generate(system + [1], max_new_tokens=2, depth=2, prefix_pool=pool)
    streams = [m.stream([1, 2, 3], max_new_tokens=60),
               m.stream(system + [9, 10], max_new_tokens=50, prefix=pc),
               m.stream(system + [11], max_new_tokens=50, depth=2, prefix_pool=pool)]
    for s in streams:
        next(s)
    cycle = [m.stream([4, 4, 4], max_new_tokens=60)]
    next(cycle[0])
    cycle.append(cycle)                              # only a collection would close it
    del cycle
    unstarted = m.stream([3, 2, 1], max_new_tokens=10)
    gc.disable()
    try:
        assert _allocated() > before + tinyloop.vram_usage_bytes(m) + pc.nbytes
        tinyloop.free_model(m)
        assert _allocated() == before
    finally:
        gc.enable()
    for s in streams + [unstarted]:
        with pytest.raises(errors.ModelFreedError):
            next(s)
    assert pc.released
    gc.collect()
    assert _allocated() == before
