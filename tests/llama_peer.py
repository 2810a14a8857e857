"""llama.cpp's side of the peer check (tests/test_peer_llamacpp.py), run in a child process.

llama.cpp is native code compiled on the installing machine: a build that executes an
instruction the CPU rejects (SIGILL) or crashes otherwise would kill the whole pytest process.
In a child, such a crash fails only the peer test, with the signal and llama.cpp's stderr.

Usage: ``python -X faulthandler tests/llama_peer.py REQUEST.json OUT.npz``. REQUEST holds
``{"gguf": path, "texts": [str, ...]}``; OUT receives, for text i, ``ids{i}`` (int64 ``[T]``:
llama.cpp's tokens, no BOS, special tokens parsed) and ``scores{i}`` (float32 ``[T, vocab]``:
its teacher-forced next-token logits at every position).
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
        out[f"scores{i}"] = np.asarray(ref.scores[:len(ids)], dtype=np.float32)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        req = json.load(f)
    np.savez(argv[1], **llama_logits(req["gguf"], req["texts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
