"""The looped architectures' VERSION 2 facts on the CUDA backend: refused at load, naming the
feature, with nothing left allocated (its kernels for them are not written yet); a model
that uses none of them (exit gate aside, which no forward reads) loads as before."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.convert.hf import convert_hf
from tinyloop.memory import get_pool

from .. import looped_refs as L

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch, feature", [("ouro", "post-branch and sandwich norms"),
                                           ("huginn", "seeded initial state"),
                                           ("nanbeige", "loop-boundary norm")])
def test_cuda_refuses_looped_facts_and_allocates_nothing(tmp_path, arch, feature):
    cfg, t = L.ARCHS[arch][0](0)
    L.save(str(tmp_path / arch), cfg, t)
    tlm = str(tmp_path / f"{arch}.tlm")
    convert_hf(str(tmp_path / arch), tlm, bits=4)
    pool = get_pool("cuda")
    before = pool.allocated_bytes
    with pytest.raises(errors.ConfigError, match=feature + ".*not yet supported on the cuda"):
        tinyloop.load_model(tlm, backend="cuda", max_seq_len=64)
    assert pool.allocated_bytes == before


def test_nanbeige_without_the_boundary_norm_runs_on_cuda_like_numpy(tmp_path):
    """skip_loop_final_norm: a plain llama loop, which the CUDA kernels run today."""
    cfg, t = L.nanbeige_checkpoint(0, skip_loop_final_norm=True)
    L.save(str(tmp_path / "nb"), cfg, t)
    tlm = str(tmp_path / "nb.tlm")
    convert_hf(str(tmp_path / "nb"), tlm, bits=8)
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], 24)
    out = {}
    for backend in ("numpy", "cuda"):
        m = tinyloop.load_model(tlm, backend=backend, max_seq_len=64)
        try:
            out[backend] = m.logits(ids, depth=3)
        finally:
            tinyloop.free_model(m)
    assert L.kl_rows(out["numpy"], out["cuda"]).max() <= 2e-3
