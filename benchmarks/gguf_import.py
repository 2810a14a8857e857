"""GGUF k-quant import quality: SmolLM2-135M re-quantized by llama.cpp, imported by TinyLoop.

The embedded SmolLM2-135M-Instruct (Q4_1) is written as an F16 GGUF (its exact values), then
llama.cpp's own quantizer makes Q8_0, Q5_0, Q5_1, Q4_K_M, Q5_K_M and Q6_K files of it. Each file
is converted with ``--bits 4`` and ``--bits 8`` and run teacher-forced over tests/corpus.py's
PASSAGES on the NumPy backend. Printed per file and bits, over every position:

- KL(src || ours): the source file's own dequantized weights in an independent float64 forward
  (tests/gguf_files.py) against TinyLoop's import: what the import itself loses;
- KL(F16 || ours) and KL(F16 || src): against the unquantized model, for scale;
- llama.cpp running the source file against TinyLoop's import (KL(llama || ours), top-1), and
  against the float64 forward of the same file (what llama.cpp's own 8-bit activations cost).

Run: ``python -m benchmarks gguf_import [--layers N] [--vocab V] [--texts K]``
(CPU only; the whole model takes a few minutes on two cores). docs/gguf_import.md holds the
output.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

import numpy as np

def tensor_types(path: str) -> str:
    """The GGML types of a file's matrices, most frequent first: "Q5_0 x20, Q8_0 x5"."""
    import gguf
    c = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{k} x{v}" for k, v in c.most_common())


def forward_all(fn, ids_per_text):
    return np.concatenate([fn(ids) for ids in ids_per_text])


def main(argv=None) -> int:
    import tinyloop
    from tinyloop.convert.gguf import convert_gguf
    from tinyloop.default import default_gguf_path

    from tests.corpus import PASSAGES
    from tests.gguf_files import (FTYPES, float_gguf, gguf_weights, kl_top1, llama_quantize,
                                  reference_logits)
    from tests.convert.test_peer_llamacpp import _llama_logits
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers "
                    "(default: all 30)")
    ap.add_argument("--vocab", type=int, default=None, help="keep the first V tokens "
                    "(default: all 49152)")
    ap.add_argument("--texts", type=int, default=len(PASSAGES),
                    help="how many PASSAGES to run (default: %(default)s)")
    ap.add_argument("--work", default=None, help="folder for the files (default: a temp dir)")
    a = ap.parse_args(argv)
    work = a.work or tempfile.mkdtemp(prefix="gguf_import_")
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    f16 = os.path.join(work, "smol.F16.gguf")
    float_gguf(default_gguf_path(), f16, a.layers, a.vocab)
    files = {}
    for ftype in FTYPES:
        files[ftype] = os.path.join(work, f"smol.{ftype}.gguf")
        llama_quantize(f16, files[ftype], ftype)
    texts = list(PASSAGES[:a.texts])
    llama = {ftype: _llama_logits(path, texts, _Dir(work)) for ftype, path in files.items()}
    ids_per_text = [ids for ids, _ in llama["Q8_0"]]
    n = sum(len(i) for i in ids_per_text)
    print(f"# SmolLM2-135M-Instruct, layers={a.layers or 'all'}, vocab={a.vocab or 'all'}, "
          f"{len(texts)} texts, {n} positions; files made in {time.time() - t0:.0f} s")

    W = gguf_weights(f16)
    ref16 = forward_all(lambda ids: reference_logits(None, ids, W), ids_per_text)
    del W
    print("\n| source file | its matrices | KL(F16 ‖ src) | bits | KL(src ‖ ours) mean / max "
          "| top-1 src | KL(F16 ‖ ours) | KL(llama.cpp ‖ ours) | top-1 llama.cpp "
          "| KL(src ‖ llama.cpp) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ftype, path in files.items():
        Ws = gguf_weights(path)
        ref = forward_all(lambda ids: reference_logits(None, ids, Ws), ids_per_text)
        del Ws
        ll = np.concatenate([s for _, s in llama[ftype]]).astype(np.float64)
        kl_src, _ = kl_top1(ref16, ref)
        kl_ll_src, _ = kl_top1(ref, ll)
        for bits in (4, 8):
            dst = os.path.join(work, f"smol.{ftype}.b{bits}.tlm")
            convert_gguf(path, dst, recurrent=None, max_depth=1, bits=bits)
            m = tinyloop.load_model(dst, backend="numpy")
            try:
                ours = forward_all(lambda ids: m.logits(ids).astype(np.float64), ids_per_text)
            finally:
                tinyloop.free_model(m)
            kl, top1 = kl_top1(ref, ours)
            kl16, _ = kl_top1(ref16, ours)
            kl_ll, top1_ll = kl_top1(ll, ours)
            print(f"| {ftype} | {tensor_types(path)} | {kl_src.mean():.2e} | {bits} "
                  f"| {kl.mean():.2e} / {kl.max():.2e} | {top1:.4f} | {kl16.mean():.2e} "
                  f"| {kl_ll.mean():.2e} | {top1_ll:.4f} | {kl_ll_src.mean():.2e} |",
                  flush=True)
    print(f"\n# total {time.time() - t0:.0f} s")
    return 0


class _Dir(str):
    """A folder path with the ``/`` join that _llama_logits uses on pytest's tmp_path."""

    def __truediv__(self, name: str):
        import pathlib
        return pathlib.Path(self) / name


if __name__ == "__main__":
    sys.exit(main())
