"""GPU test configuration: the ``gpu`` marker (select with ``pytest -m gpu``) and the seed.

Kernel tests draw fresh random inputs every session from ``TINYLOOP_TEST_SEED``; it is chosen
here when unset and printed in the report header, so a failing run can be replayed exactly.
"""

import os

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped where CUDA is absent)")
    if not os.environ.get("TINYLOOP_TEST_SEED"):
        os.environ["TINYLOOP_TEST_SEED"] = str(np.random.SeedSequence().entropy % 2**31)


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


def pytest_report_header(config):
    return f"TINYLOOP_TEST_SEED={os.environ.get('TINYLOOP_TEST_SEED')}"


def record_decode_steps(model, monkeypatch) -> list:
    """Wrap the request's captured step (``graphs.decode_step``, as ``generate`` calls it) so
    each step of ``model`` that ran on the device appends (the picked id, a host copy of that
    step's logit row, the u it was given) to the returned list."""
    import tinyloop.generate as generate
    seen = []
    real = generate.decode_step

    def recording(m, cache, token, pos, temperature, top_k=0, top_p=1.0, u=0.0):
        nxt = real(m, cache, token, pos, temperature, top_k, top_p, u)
        if nxt is not None and m is model:
            seen.append((nxt, model.ops.to_host(model.logit_row())[0].copy(), u))
        return nxt
    monkeypatch.setattr(generate, "decode_step", recording)
    return seen
