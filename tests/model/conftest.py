"""The model tests' fixtures: a small synthetic model for the CUDA tests, the tiny Ouro, Huginn
and Nanbeige checkpoints, and token ids of real text for the real-model ones."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.hf import convert_hf
from tinyloop.convert.synthetic import synthetic_config, write_synthetic

from .. import looped_refs as L

SMALL = dict(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=320,
             n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4, rope_theta=10000.0)


@pytest.fixture(scope="module")
def real_text_ids(real_model_path):
    from ..corpus import PASSAGES
    m = tinyloop.load_model(real_model_path, max_seq_len=16, backend="numpy")
    try:
        ids = []
        for p in PASSAGES:
            ids += m.tokenizer.encode(p)
    finally:
        tinyloop.free_model(m)
    return np.array(ids[:600], dtype=np.int32)


@pytest.fixture(scope="module", params=["none", "adapter"])
def small_path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("gpu") / f"small_{request.param}.tlm"
    bits, group = (4, 32) if request.param == "none" else (8, 64)
    write_synthetic(p, synthetic_config(**{**SMALL, "injection": request.param}), seed=3,
                    bits=bits, group_size=group)
    return str(p)


@pytest.fixture(scope="module")
def looped_folders(tmp_path_factory):
    """arch -> (Hugging Face folder, config.json dict, tensors, .tlm path converted at INT8)
    of the tiny Ouro, Huginn and Nanbeige checkpoints (tests/looped_refs.py ARCHS, seed 0)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch, (make, _, _) in L.ARCHS.items():
        cfg, t = make(0)
        folder = str(root / arch)
        L.save(folder, cfg, t)
        tlm = str(root / f"{arch}.tlm")
        convert_hf(folder, tlm, bits=8)
        out[arch] = (folder, cfg, t, tlm)
    return out
