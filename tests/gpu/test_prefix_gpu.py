"""Prefix caching on the CUDA backend (issue 9): reuse equals no reuse within 1e-3 x max|logit|
with the same argmax and the same greedy tokens; upgrades equal fresh prefills; save on the GPU
and load gives the same state; the pool's bytes equal its tag on the cuda pool."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.memory import get_pool

pytestmark = pytest.mark.gpu

SMALL = dict(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=320,
             n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4, rope_theta=10000.0)
RTOL = 1e-3


@pytest.fixture(scope="module", params=["plain", "adapter"])
def model(request, tmp_path_factory):
    extra = {"injection": "adapter", "tied_head": False} if request.param == "adapter" else {}
    path = tmp_path_factory.mktemp("models") / f"{request.param}.tlm"
    write_synthetic(path, synthetic_config(**{**SMALL, **extra}), seed=5)
    m = tinyloop.load_model(str(path), max_seq_len=512, prefill_chunk=64, backend="cuda")
    yield m
    tinyloop.free_model(m)


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, SMALL["vocab_size"], n).astype(np.int32)


def _close_same_argmax(a, b):
    assert np.isfinite(a).all()
    assert float(np.abs(a - b).max()) <= RTOL * float(np.abs(b).max())
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.99


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("n_prefix", [128, 133])
def test_cuda_prefix_reuse_equals_no_reuse(model, depth, n_prefix):
    prompt = _ids(n_prefix + 40, seed=depth + n_prefix)
    ref = model.logits(prompt, depth=depth)
    with model.prefill(prompt[:n_prefix], depth=depth) as pc:
        _close_same_argmax(model.logits(prompt, prefix=pc), ref)
        got = model.generate(prompt, 16, prefix=pc)
        assert got.cached_tokens == n_prefix
        assert got.token_ids == model.generate(prompt, 16, depth=depth).token_ids


def test_cuda_resume_upgrade_and_save_load(model, tmp_path):
    prompt = _ids(150, seed=9)
    full = np.concatenate([prompt, _ids(20, seed=10)]).astype(np.int32)
    with model.resume_handle(prompt, depth=2, max_depth=4) as rh:
        rh.upgrade(4)
        _close_same_argmax(model.logits(full, prefix=rh), model.logits(full, depth=4))
        tokens = model.generate(full, 12, prefix=rh).token_ids
        assert tokens == model.generate(full, 12, depth=4).token_ids
        assert model.generate(full, 12, prefix=rh).token_ids == tokens
        rh.save(tmp_path / "rh.tlpx")
        with model.load_prefix(tmp_path / "rh.tlpx") as back:
            assert back.depth == 4
            assert model.generate(full, 12, prefix=back).token_ids == tokens


def test_cuda_pool_bytes_equal_tag(model):
    pool = tinyloop.PrefixPool(model, max_bytes=3 * tinyloop.PrefixPool(model).entry_bytes(80, 2))
    base = get_pool("cuda").stats().by_tag.get("prefix_cache", 0)
    system = _ids(64, seed=1)
    for i in range(8):
        prompt = np.concatenate([system if i % 2 else _ids(64, seed=50 + i),
                                 _ids(16, seed=i)]).astype(np.int32)
        got = model.generate(prompt, 4, depth=2, prefix_pool=pool)
        assert got.token_ids == model.generate(prompt, 4, depth=2).token_ids
        s = pool.stats()
        assert s["bytes"] == get_pool("cuda").stats().by_tag["prefix_cache"] - base
        assert s["bytes"] <= pool.max_bytes
    assert pool.stats()["hits"] >= 3 and pool.stats()["evictions"] > 0
    pool.release()
