"""Shared fixtures: small synthetic looped models written once per session, the pools, the
real model, the CUDA/NumPy op pairs of the kernel tests, and the ``gpu`` marker's skip.

GPU tests draw fresh random inputs every session from ``TINYLOOP_TEST_SEED``; it is chosen
here when unset and printed in the report header, so a failing run can be replayed exactly.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from tinyloop import errors
from tinyloop.backends import cuda_available
from tinyloop.memory import _reset_pools_for_tests, current_tag
from tinyloop.convert.synthetic import synthetic_config, write_synthetic

TINY = dict(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
            n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4, rope_theta=10000.0)


def pytest_configure(config):
    if not os.environ.get("TINYLOOP_TEST_SEED"):
        os.environ["TINYLOOP_TEST_SEED"] = str(np.random.SeedSequence().entropy % 2**31)


def pytest_report_header(config):
    return f"TINYLOOP_TEST_SEED={os.environ.get('TINYLOOP_TEST_SEED')}"


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny looped model (P/R/C = 1/2/1, max depth 4, no injection), INT4 g=32."""
    path = tmp_path_factory.mktemp("models") / "tiny.tlm"
    write_synthetic(path, synthetic_config(**TINY), seed=11)
    return str(path)


@pytest.fixture(scope="session")
def tiny_adapter_path(tmp_path_factory):
    """Like tiny_model_path but with the injection adapter, untied head, INT8 g=64."""
    path = tmp_path_factory.mktemp("models") / "tiny_adapter.tlm"
    write_synthetic(path, synthetic_config(**{**TINY, "injection": "adapter",
                                              "tied_head": False}),
                    seed=12, bits=8, group_size=64)
    return str(path)


@pytest.fixture
def fresh_pools(monkeypatch):
    """The test starts and ends with no process pools and no memory limit."""
    monkeypatch.delenv("TINYLOOP_MEMORY_LIMIT", raising=False)
    _reset_pools_for_tests()
    yield
    _reset_pools_for_tests()


def fail_nth_allocation(monkeypatch, pool, failing_tag: str, nth) -> dict:
    """Make the ``nth`` allocation under ``failing_tag`` from ``pool`` (an int, or a set of
    them: each of those) raise OutOfMemoryError ("injected"), as a budget failure part-way
    through a load phase would. Returns a dict whose ``"n"`` counts the allocations seen
    under ``failing_tag``."""
    real = pool.allocate
    seen = {"n": 0}
    failing = {nth} if isinstance(nth, int) else set(nth)

    def flaky(nbytes, tag=None):
        tag_now = tag or current_tag()
        if tag_now == failing_tag:
            seen["n"] += 1
            if seen["n"] in failing:
                raise errors.OutOfMemoryError("injected", requested_bytes=nbytes, tag=tag_now,
                                              device=pool.device)
        return real(nbytes, tag)

    real_many = pool.allocate_many

    def flaky_many(nbytes, n, tag=None):        # a batch counts as n allocations, all or none
        tag_now = tag or current_tag()
        if tag_now == failing_tag:
            first = seen["n"] + 1
            seen["n"] += n
            if any(first <= k <= seen["n"] for k in failing):
                raise errors.OutOfMemoryError("injected", requested_bytes=nbytes, tag=tag_now,
                                              device=pool.device)
        return real_many(nbytes, n, tag)

    monkeypatch.setattr(pool, "allocate", flaky)
    monkeypatch.setattr(pool, "allocate_many", flaky_many)
    return seen


@pytest.fixture(scope="module")
def real_model_path():
    """The real SmolLM2 .tlm: TINYLOOP_TEST_MODEL, else the embedded default (converted once);
    skips where neither is there."""
    import tinyloop
    path = os.environ.get("TINYLOOP_TEST_MODEL")
    if path:
        return path
    try:
        return tinyloop.default_model_path()
    except tinyloop.TinyLoopError as e:
        pytest.skip(f"real model unavailable: {e}")


def record_decode_steps(model, monkeypatch, filters: bool = False) -> list:
    """Wrap the request's captured step (``graphs.decode_step``, as ``generate`` calls it) so
    each step of ``model`` that ran on the device appends (the picked id, a host copy of that
    step's logit row, the u it was given) to the returned list; with ``filters`` also the
    step's (min_p, repetition_penalty, recent_ids) after them."""
    import tinyloop.generate as generate
    seen = []
    real = generate.decode_step

    def recording(m, cache, token, pos, temperature, top_k=0, top_p=1.0, u=0.0, min_p=0.0,
                  repetition_penalty=1.0, recent_ids=None, repeat_last_n=0):
        nxt = real(m, cache, token, pos, temperature, top_k, top_p, u, min_p,
                   repetition_penalty, recent_ids, repeat_last_n)
        if nxt is not None and m is model:
            got = (nxt, model.ops.to_host(model.logit_row())[0].copy(), u)
            if filters:
                got += (min_p, repetition_penalty,
                        None if recent_ids is None else list(recent_ids))
            seen.append(got)
        return nxt
    monkeypatch.setattr(generate, "decode_step", recording)
    return seen


# --- the kernel tests' op pairs (tests/kernels, and the GPU tests built on them) ---------------
_OPS: dict = {}


@pytest.fixture(scope="module")
def ops(request):
    """CudaOps with the default decode GEMV (v2), or the version a test passes indirectly
    (``@ALL_GEMVS``: each GEMV test runs for v1, v2 and tc)."""
    from tinyloop.backends.cuda import CudaOps, KernelChoice
    ver = getattr(request, "param", "v2")      # "auto": GEMV_BY_SHAPE, as a model runs
    if ver not in _OPS:
        o = _OPS[ver] = CudaOps(KernelChoice(gemv=ver))
        o.compile_all()
    return _OPS[ver]


@pytest.fixture(scope="module")
def ref():
    """The NumPy reference ops (the oracle)."""
    from tinyloop.backends.numpy_ops import NumpyOps
    return NumpyOps()


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id and TINYLOOP_TEST_SEED: fresh inputs every
    session, replayable with the seed the header prints."""
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("TINYLOOP_TEST_SEED") or 0)
    return np.random.default_rng(seed)


class ShiftedClock:
    """The ``time`` module with ``perf_counter`` shifted forward by ``shift`` seconds: a test
    that advances ``shift`` inside a call makes that call take so long by this clock."""

    def __init__(self, real):
        self._real, self.shift = real, 0.0

    def perf_counter(self):
        return self._real.perf_counter() + self.shift

    def __getattr__(self, name):
        return getattr(self._real, name)


def slow_kv_release(monkeypatch, module, seconds: float = 1000.0) -> ShiftedClock:
    """Make every KV cache release take ``seconds`` by ``module``'s clock (its ``time``
    replaced by a ShiftedClock that each live release advances); returns the clock."""
    import time

    from tinyloop.kv import RuntimeKVCache
    clock = ShiftedClock(time)
    real = RuntimeKVCache.release

    def release(self):
        if self._table_block is not None:
            clock.shift += seconds
        real(self)
    monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(RuntimeKVCache, "release", release)
    return clock
