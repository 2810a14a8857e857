"""sample.cu's fast sampler (``sample_fast_*``) and the repetition penalty on the device,
against the NumPy rule (``numpy_ops.sample_from_logits``) and the one-block reference kernel
(``KernelChoice(sampler="reference")``): the same id for every row, setting and draw, through
each of the fast path's routes (candidates under the filters, the draw's one bin, the fallback
to the reference for too many candidates), and the captured step's window ring advancing on
the device."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.backends import cuda_available

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

import cupy  # noqa: E402

from tinyloop.backends.base import STEP_ID, STEP_POS, STEP_WORDS  # noqa: E402
from tinyloop.backends.cuda import CudaOps, KernelChoice  # noqa: E402
from tinyloop.backends.numpy_ops import sample_from_logits  # noqa: E402

U_MAX = 1.0 - 2.0 ** -30     # the fixed-point edge next to 1 (sample.cu's comment)


@pytest.fixture(scope="module")
def pair():
    fast = CudaOps(KernelChoice(sampler="fast"))
    ref = CudaOps(KernelChoice(sampler="reference"))
    yield fast, ref
    fast.release()
    ref.release()


def _row(rng, vocab, shape):
    """Logit rows of the shapes that take each route: peaked (few candidates), flat (many:
    the fallback under a loose top-p), ties, masked tokens, +0 / -0."""
    scale = {"peaked": 10.0, "mid": 3.0, "flat": 0.3}[shape[0]]
    x = (rng.standard_normal(vocab) * scale).astype(np.float32)
    if "ties" in shape and vocab > 10:
        x[rng.integers(0, vocab, vocab // 3)] = x[rng.integers(0, vocab)]
        x[rng.integers(0, vocab, 5)] = x.max()
    if "masked" in shape and vocab > 4:
        x[rng.integers(0, vocab, vocab // 2)] = -np.inf
    if "zeros" in shape and vocab > 3:
        x[:3] = np.array([0.0, -0.0, 0.0], np.float32)
    return x


SHAPES = [("peaked",), ("mid",), ("flat",), ("mid", "ties"), ("flat", "masked"),
          ("peaked", "zeros", "ties")]
SETTINGS = [  # temperature, top_k, top_p, min_p, penalty
    (1.0, 0, 1.0, 0.0, 1.0), (0.8, 0, 0.9, 0.0, 1.0), (0.7, 40, 0.9, 0.0, 1.0),
    (0.8, 0, 1.0, 0.05, 1.0), (1.3, 50, 0.95, 0.1, 1.0), (0.8, 0, 0.9, 0.0, 1.3),
    (1.0, 0, 0.99, 0.0, 1.0), (2.0, 0, 1.0, 0.0, 1.0), (0.8, 5, 1.0, 1.0, 1.0),
    (0.0, 0, 1.0, 0.0, 1.5), (1.0, 1000, 1.0, 0.0, 0.8), (0.3, 0, 1e-6, 0.0, 1.0)]


@pytest.mark.parametrize("vocab", [1, 7, 2003, 49152])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(s))
def test_fast_equals_reference_equals_rule(pair, rng, vocab, shape):
    fast, ref = pair
    for temperature, top_k, top_p, min_p, pen in SETTINGS:
        x = _row(rng, vocab, shape)
        dev = cupy.asarray(x)
        recent = rng.integers(0, vocab, min(64, 3 * vocab)) if pen != 1.0 else None
        for u in list(rng.random(6) * U_MAX) + [0.0]:
            u = float(u)
            want = sample_from_logits(x, temperature, top_k, top_p, u, min_p, pen, recent)
            got_f = fast.sample(dev, temperature, top_k, top_p, u, min_p, pen, recent)
            got_r = ref.sample(dev, temperature, top_k, top_p, u, min_p, pen, recent)
            case = (vocab, shape, temperature, top_k, top_p, min_p, pen, u)
            assert got_f == got_r == want, (case, got_f, got_r, want)
        assert np.array_equal(cupy.asnumpy(dev), x)       # the caller's row is left alone


def test_many_random_rows_and_draws(pair, rng):
    """Wide coverage at the real vocabulary: random settings, rows and draws."""
    fast, ref = pair
    vocab = 49152
    for trial in range(150):
        x = _row(rng, vocab, SHAPES[trial % len(SHAPES)])
        temperature = float(rng.choice([0.3, 0.7, 0.8, 1.0, 1.5]))
        top_k = int(rng.choice([0, 0, 1, 20, 50, 400]))
        top_p = float(rng.choice([1.0, 0.9, 0.95, 0.5]))
        min_p = float(rng.choice([0.0, 0.0, 0.02, 0.1]))
        pen = float(rng.choice([1.0, 1.1, 1.5]))
        recent = rng.integers(0, vocab, int(rng.integers(1, 200))) if pen != 1.0 else None
        u = float(rng.random() * U_MAX)
        dev = cupy.asarray(x)
        want = sample_from_logits(x, temperature, top_k, top_p, u, min_p, pen, recent)
        got = fast.sample(dev, temperature, top_k, top_p, u, min_p, pen, recent)
        assert got == want, (trial, temperature, top_k, top_p, min_p, pen, u)
        assert ref.sample(dev, temperature, top_k, top_p, u, min_p, pen, recent) == want


def test_fast_faults_as_the_reference(pair):
    fast, _ = pair
    from tinyloop.errors import NonFiniteLogitsError
    for row, kind in ((np.array([0, np.nan, 1], np.float32), "nan"),
                      (np.array([0, np.inf, 1], np.float32), "+inf"),
                      (np.full(300, -np.inf, np.float32), "all -inf")):
        for kw in ({}, {"min_p": 0.1}, {"repetition_penalty": 1.2, "recent_ids": [0]}):
            with pytest.raises(NonFiniteLogitsError) as ei:
                fast.sample(cupy.asarray(row), 0.8, 0, 0.9, 0.5, **kw)
            assert ei.value.kind == kind


@pytest.mark.parametrize("sampler", ["fast", "reference"])
def test_step_window_ring_advances_on_the_device(rng, sampler):
    """head_sample_step's launches (parameters and ring as a captured step has them): seeded
    once, the ring takes each step's input token itself, so every pick equals the rule with
    the window of the last N positions."""
    ops = CudaOps(KernelChoice(sampler=sampler))
    try:
        vocab, last_n, steps = 2003, 5, 12
        tokens = [int(t) for t in rng.integers(0, 60, 40)]    # repeats: the penalty bites
        step = cupy.zeros(STEP_WORDS, cupy.int32)
        pos0 = 9
        for temperature in (0.0, 0.9):
            ops.set_step_sampling(temperature, 0, 0.95, 0.3, 0.0, 1.8, last_n)
            ops.set_step_window(tokens[pos0 + 1 - last_n:pos0 + 1], pos0, last_n)
            for pos in range(pos0, pos0 + steps):
                x = (rng.standard_normal(vocab) * 2).astype(np.float32)
                x[:60] += 3.0                              # the recent tokens lead
                state = np.zeros(STEP_WORDS, np.int32)
                state[STEP_ID], state[STEP_POS] = tokens[pos], pos
                step.set(state)
                dev = cupy.asarray(x)
                ops._ensure_wq(vocab)
                ops._sampler_launches(dev.data.ptr, vocab, ops._smp_ptr, step.data.ptr,
                                      (ops._ring.data.ptr, step.data.ptr))
                got = cupy.asnumpy(step)
                window = tokens[max(0, pos + 1 - last_n):pos + 1]
                want = sample_from_logits(x, temperature, 0, 0.95, 0.3, 0.0, 1.8, window)
                assert (int(got[0]), int(got[1])) == (want, 0), (temperature, pos)
    finally:
        ops.release()


def test_bad_penalty_window_is_refused(pair):
    fast, _ = pair
    from tinyloop.errors import ConfigError
    dev = cupy.zeros(100, cupy.float32)
    with pytest.raises(ConfigError, match="recent_ids"):
        fast.sample(dev, 0.8, 0, 1.0, 0.5, 0.0, 1.2, [3, 100])
    with pytest.raises(ConfigError, match="repeat_last_n"):
        fast.set_step_window([1, 2, 3], 5, 2)
