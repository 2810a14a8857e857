"""KernelChoice: the CUDA kernel variants as a validated argument (``kernels=``), not the
environment. Pure Python: runs without CuPy."""

from __future__ import annotations

import dataclasses

import pytest

from tinyloop.backends import get_ops
from tinyloop.backends.cuda.choice import (ATTN_DECODE_VERSIONS, ATTN_PREFILL_VERSIONS,
                                           GEMV_VERSIONS, SAMPLERS, KernelChoice)
from tinyloop.backends.cuda.gemv import gemv_choice
from tinyloop.errors import ConfigError


def test_the_defaults_are_the_product_paths():
    k = KernelChoice()
    assert (k.gemv, k.gemv_lpr, k.gemv_threads) == ("auto", None, None)
    assert (k.attn_decode, k.attn_prefill) == ("split", "mma")
    assert k.fused_qkv_rope is True and k.pdl is True
    assert k.sampler == "fast"
    assert KernelChoice.of(None) == k


def test_it_is_frozen_and_hashable():
    k = KernelChoice(gemv="v1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.gemv = "v2"
    assert {k: 1}[KernelChoice(gemv="v1")] == 1


@pytest.mark.parametrize("field,bad", [
    ("gemv", "v3"), ("gemv", "V1"), ("attn_decode", "flash"), ("attn_prefill", " scalar"),
    ("gemv_lpr", 6), ("gemv_lpr", "16"), ("gemv_lpr", True), ("gemv_threads", 100),
    ("fused_qkv_rope", 1), ("pdl", "0"), ("sampler", "slow"), ("sampler", None)])
def test_a_bad_field_is_named(field, bad):
    with pytest.raises(ConfigError, match=rf"KernelChoice\.{field}="):
        KernelChoice(**{field: bad})


def test_every_listed_version_is_accepted():
    for v in GEMV_VERSIONS:
        assert KernelChoice(gemv=v).gemv == v
    for v in ATTN_DECODE_VERSIONS:
        assert KernelChoice(attn_decode=v).attn_decode == v
    for v in ATTN_PREFILL_VERSIONS:
        assert KernelChoice(attn_prefill=v).attn_prefill == v
    for v in SAMPLERS:
        assert KernelChoice(sampler=v).sampler == v
    assert set(SAMPLERS) == {"fast", "reference"}
    assert KernelChoice(gemv="v2", gemv_lpr=8, gemv_threads=128).gemv_lpr == 8


def test_the_old_variables_choose_nothing(monkeypatch):
    for var, val in (("TINYLOOP_GEMV", "v1"), ("TINYLOOP_ATTN_PREFILL", "scalar"),
                     ("TINYLOOP_ATTN_DECODE", "v1"), ("TINYLOOP_PDL", "0"),
                     ("TINYLOOP_FUSED_QKV_ROPE", "0"), ("TINYLOOP_GEMV_LPR", "six")):
        monkeypatch.setenv(var, val)
    assert KernelChoice() == KernelChoice.of(None)
    assert KernelChoice().gemv == "auto" and KernelChoice().pdl is True


def test_gemv_choice_by_shape():
    """auto: tc for INT4 weights of K >= 3072; else v1 for the layer shapes and v2 at 4 lanes
    per row for an LM-head-sized weight; a forced version or lpr wins."""
    auto = KernelChoice()
    # SmolLM2 (K 576 / 1536) and Ouro-1.4B (K 2048) layers, their heads
    assert [gemv_choice(n, k, 4, auto) for n, k in ((960, 576), (576, 1536), (6144, 2048),
                                                     (11264, 2048), (2048, 2048))] == \
        [("v1", None)] * 5
    assert gemv_choice(49152, 576, 4, auto) == gemv_choice(49152, 2048, 4, auto) == ("v2", 4)
    # Nanbeige4.2-3B: QKV, O, gate | up (21,504 rows), down, head; Ouro's down (K 5632)
    for n, k in ((8192, 3072), (3072, 6144), (21504, 3072), (3072, 10752), (166144, 3072),
                 (2048, 5632)):
        assert gemv_choice(n, k, 4, auto) == ("tc", None), (n, k)
    # INT8 weights never take tc: the same shapes as INT4 below K = 3072
    assert gemv_choice(8192, 3072, 8, auto) == ("v1", None)
    assert gemv_choice(166144, 3072, 8, auto) == ("v2", 4)
    assert gemv_choice(960, 576, 4, KernelChoice(gemv="v2")) == ("v2", None)
    assert gemv_choice(8192, 3072, 4, KernelChoice(gemv="v1")) == ("v1", None)
    assert gemv_choice(49152, 576, 4, KernelChoice(gemv_lpr=16)) == ("v2", 16)
    assert gemv_choice(576, 576, 4, KernelChoice(gemv="tc")) == ("tc", None)


def test_the_numpy_backend_refuses_a_choice_it_would_ignore():
    assert get_ops("numpy", KernelChoice()).name == "numpy"
    assert get_ops("numpy", None).name == "numpy"
    with pytest.raises(ConfigError, match="numpy backend runs none"):
        get_ops("numpy", KernelChoice(attn_prefill="scalar"))
    with pytest.raises(ConfigError, match="KernelChoice or None"):
        get_ops("numpy", {"gemv": "v1"})


def test_load_model_passes_kernels_and_frees_nothing_on_refusal(tiny_model_path):
    import tinyloop
    import tinyloop.memory as mem
    before = mem.memory_stats("host").allocated_bytes
    with pytest.raises(ConfigError, match="numpy backend runs none"):
        tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy",
                            kernels=KernelChoice(pdl=False))
    assert mem.memory_stats("host").allocated_bytes == before
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy",
                            kernels=KernelChoice())
    try:
        assert m.generate([1, 2, 3], max_new_tokens=2).token_ids
    finally:
        tinyloop.free_model(m)
