"""Shared fixtures: small synthetic looped models written once per session."""

from __future__ import annotations

import pytest

from tinyloop import errors
from tinyloop.backends import cuda_available
from tinyloop.memory import _reset_pools_for_tests, current_tag
from tinyloop.convert.synthetic import synthetic_config, write_synthetic

TINY = dict(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
            n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4, rope_theta=10000.0)


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


def fail_nth_allocation(monkeypatch, pool, failing_tag: str, nth: int) -> dict:
    """Make the ``nth`` allocation under ``failing_tag`` from ``pool`` raise OutOfMemoryError
    ("injected"), as a budget failure part-way through a load phase would. Returns a dict
    whose ``"n"`` counts the allocations seen under ``failing_tag``."""
    real = pool.allocate
    seen = {"n": 0}

    def flaky(nbytes, tag=None):
        tag_now = tag or current_tag()
        if tag_now == failing_tag:
            seen["n"] += 1
            if seen["n"] == nth:
                raise errors.OutOfMemoryError("injected", requested_bytes=nbytes, tag=tag_now,
                                              device=pool.device)
        return real(nbytes, tag)

    real_many = pool.allocate_many

    def flaky_many(nbytes, n, tag=None):        # a batch counts as n allocations, all or none
        tag_now = tag or current_tag()
        if tag_now == failing_tag:
            first = seen["n"] + 1
            seen["n"] += n
            if first <= nth <= seen["n"]:
                raise errors.OutOfMemoryError("injected", requested_bytes=nbytes, tag=tag_now,
                                              device=pool.device)
        return real_many(nbytes, n, tag)

    monkeypatch.setattr(pool, "allocate", flaky)
    monkeypatch.setattr(pool, "allocate_many", flaky_many)
    return seen
