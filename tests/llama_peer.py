"""llama.cpp's side of the peer check (tests/convert/test_peer_llamacpp.py), run in a child process.

llama.cpp is native code compiled on the installing machine: a build that executes an
instruction the CPU rejects (SIGILL) or crashes otherwise would kill the whole pytest process.
In a child, such a crash fails only the peer test, with the signal and llama.cpp's stderr.

Usage: ``python -X faulthandler tests/llama_peer.py REQUEST.json OUT.npz``. REQUEST holds
``{"gguf": path, "texts": [str, ...]}``; OUT receives, for text i, ``ids{i}`` (int64 ``[T]``:
llama.cpp's tokens, no BOS, special tokens parsed) and ``scores{i}`` (float32 ``[T, vocab]``:
its teacher-forced next-token logits at every position).

A REQUEST of ``{"quantize": {"src": path, "dst": path, "ftype": int, "threads": int}}`` runs
llama.cpp's quantizer instead (``llama_model_quantize``; ``ftype`` a ``llama_ftype`` value of
llama.h) and writes nothing to OUT.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def llama_logits(gguf: str, texts: list[str]) -> dict[str, np.ndarray]:
    import llama_cpp
    ref = llama_cpp.Llama(model_path=gguf, logits_all=True, n_ctx=1024, n_threads=2,
                          verbose=False)
    out = {}
    for i, text in enumerate(texts):
        ids = ref.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        ref.reset()
        ref.eval(ids)
        out[f"ids{i}"] = np.asarray(ids, dtype=np.int64)
        # a copy: ref.scores is llama's own buffer, which the next eval overwrites
        out[f"scores{i}"] = np.array(ref.scores[:len(ids)], dtype=np.float32, copy=True)
    return out


def quantize(src: str, dst: str, ftype: int, threads: int) -> int:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    return llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        req = json.load(f)
    if "quantize" in req:
        q = req["quantize"]
        rc = quantize(q["src"], q["dst"], q["ftype"], q["threads"])
        if rc != 0:
            print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return 1 if rc else 0
    np.savez(argv[1], **llama_logits(req["gguf"], req["texts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
