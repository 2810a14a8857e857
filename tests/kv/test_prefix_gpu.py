"""Prefix caching on the CUDA backend: reuse equals no reuse within 1e-3 x max|logit|
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


# every slot laid out for its own layer kind at every depth (per-kind / per-layer kv_mode)
MODE_MIXES = [
    {"prelude": "fp16", "recurrent": "int8", "coda": "fp16"},
    {"prelude": "int8", "recurrent": "h_fp16", "coda": "h_int4"},
    ("h_int8", "int8", "fp16", "h_int4"),             # per physical layer
]


@pytest.mark.parametrize("kv_mode", MODE_MIXES, ids=["readme", "kinds", "layers"])
def test_cuda_resume_handle_mode_mixes_at_every_depth(model, kv_mode, tmp_path):
    """A handle at depth 1 upgraded step by step to max_depth, one made at each depth, and
    each saved and loaded: logits within RTOL of an uncached run with the same argmax, greedy
    tokens equal to a fresh PrefixCache's at that depth."""
    prompt = _ids(133, seed=17)
    full = np.concatenate([prompt, _ids(20, seed=18)]).astype(np.int32)
    max_depth = SMALL["max_depth"]
    with model.resume_handle(prompt, depth=1, max_depth=max_depth, kv_mode=kv_mode) as grown:
        for d in range(1, max_depth + 1):
            if d > 1:
                grown.upgrade(d)
            ref = model.logits(full, depth=d, kv_mode=kv_mode)
            with model.prefill(prompt, depth=d, kv_mode=kv_mode) as pc:
                want = model.generate(full, 8, prefix=pc).token_ids
            with model.resume_handle(prompt, depth=d, max_depth=max_depth,
                                     kv_mode=kv_mode) as made:
                grown.save(tmp_path / "h.tlpx")
                with model.load_prefix(tmp_path / "h.tlpx") as back:
                    for h in (grown, made, back):
                        assert h.depth == d
                        _close_same_argmax(model.logits(full, prefix=h), ref)
                        assert model.generate(full, 8, prefix=h).token_ids == want


def test_cuda_failed_upgrade_and_pool_insert_change_nothing(model, monkeypatch):
    """Each failing kv_cache allocation of an upgrade whose pages a stream shares leaves the
    handle at its depth and the cuda pool's allocated bytes as before; each failing
    allocation of a pool insert that extends an entry leaves the entries as they were."""
    from ..conftest import fail_nth_allocation
    pool = get_pool("cuda")
    prompt = _ids(133, seed=19)
    full = np.concatenate([prompt, _ids(6, seed=20)]).astype(np.int32)
    want_1 = model.generate(full, 6, depth=1).token_ids
    with model.resume_handle(prompt, depth=1, max_depth=3) as rh:
        it = model.stream(full, 6, prefix=rh)
        first = next(it).token_id
        n = 1
        while True:
            before = pool.stats().allocated_bytes
            seen = fail_nth_allocation(monkeypatch, pool, "kv_cache", n)
            try:
                rh.upgrade(3)
            except tinyloop.OutOfMemoryError:
                monkeypatch.undo()
                assert not rh.released and rh.depth == 1
                assert pool.stats().allocated_bytes == before
                assert model.generate(full, 6, prefix=rh).token_ids == want_1
                n += 1
                continue
            finally:
                monkeypatch.undo()
            assert seen["n"] < n and n > 1 and rh.depth == 3
            break
        assert [first] + [t.token_id for t in it] == want_1
        assert (model.generate(full, 6, prefix=rh).token_ids
                == model.generate(full, 6, depth=3).token_ids)

    base, other = _ids(72, seed=21), _ids(70, seed=22)
    ext = np.concatenate([base, _ids(40, seed=23)]).astype(np.int32)
    probe = tinyloop.PrefixPool(model)
    budget = probe.entry_bytes(len(ext), 1) + probe.entry_bytes(len(other), 1) // 2
    probe.release()
    for n in range(1, 200):
        pp = tinyloop.PrefixPool(model, max_bytes=budget)
        model.generate(other, 1, depth=1, prefix_pool=pp)
        model.generate(base, 1, depth=1, prefix_pool=pp)
        keys, st = list(pp._entries), pp.stats()
        before = pool.stats().allocated_bytes
        seen = fail_nth_allocation(monkeypatch, pool, "kv_cache", n)
        try:
            model.generate(ext, 1, depth=1, prefix_pool=pp)
        except tinyloop.OutOfMemoryError:
            pass
        finally:
            monkeypatch.undo()
        if pp.stats()["inserts"] == st["inserts"]:
            assert list(pp._entries) == keys and pp.stats()["bytes"] == st["bytes"]
            assert pool.stats().allocated_bytes == before
            pp.release()
            continue
        assert seen["n"] < n and pp.stats()["entries"] == 1
        pp.release()
        break
    else:
        pytest.fail("the insert never got through")
