"""INT4 / INT8 against the unquantized checkpoint, KL per depth, per looped architecture (CPU).

    python -m benchmarks looped_quant [--seeds 3] [--tokens 48] [--group-size 32]

CPU, NumPy backend.
For Ouro, Huginn and Nanbeige: tiny random checkpoints with the published names and Gaussian
weights (tests/looped_refs.py, ``exact=False``), converted at INT4 and at INT8
(``convert.hf.convert_hf``); teacher-forced logits of random token ids on the NumPy backend
(fp16 KV mode, which stores float32 here) against the float64 forward of the unquantized
checkpoint (looped_refs: the published description). Per architecture, bits and depth: the
mean and the max over positions of KL(p_float || p_quant) (nats) and top-1 agreement, over
``--seeds`` checkpoints. The figures go to docs/looped_models.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import tinyloop
from tests import looped_refs as L
from tinyloop.convert.hf import convert_hf

from .common import format_table


def measure(arch: str, seed: int, bits: int, group: int, tokens: int, work: str) -> dict:
    """depth -> (KL per position, top-1 agreement per position) for one checkpoint."""
    make, ref, _ = L.ARCHS[arch]
    cfg, t = make(seed, exact=False)
    folder = os.path.join(work, f"{arch}{seed}")
    if not os.path.isdir(folder):
        L.save(folder, cfg, t)
    tlm = os.path.join(work, f"{arch}{seed}_{bits}.tlm")
    c = convert_hf(folder, tlm, bits=bits, group_size=group)
    ids = np.random.default_rng(100 + seed).integers(0, cfg["vocab_size"], tokens)
    out = {}
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=tokens, prefill_chunk=16)
    try:
        for depth in sorted({1, 2, c.max_depth}):
            o = ref(cfg, t, ids, depth)
            q = m.logits(ids, depth=depth)
            out[depth] = (L.kl_rows(o, q), np.argmax(o, 1) == np.argmax(q, 1))
    finally:
        tinyloop.free_model(m)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="checkpoints per architecture "
                    "(default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=48, help="positions (default: %(default)s)")
    ap.add_argument("--group-size", type=int, default=32, help="quantization group "
                    "(default: %(default)s)")
    a = ap.parse_args(argv)
    print(f"KL(p_float64 unquantized || p_tinyloop) over {a.tokens} positions x {a.seeds} "
          f"checkpoints, group {a.group_size}, NumPy backend, fp16 KV mode")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for arch in L.ARCHS:
            for bits in (8, 4):
                per = {}
                for seed in range(a.seeds):
                    for d, (kl, top) in measure(arch, seed, bits, a.group_size, a.tokens,
                                                work).items():
                        k, t = per.setdefault(d, ([], []))
                        k.append(kl)
                        t.append(top)
                for d, (k, t) in per.items():
                    k, t = np.concatenate(k), np.concatenate(t)
                    rows.append((arch, bits, d, f"{k.mean():.2e}", f"{k.max():.2e}",
                                 f"{t.mean():.3f}"))
    print(format_table(("arch", "bits", "depth", "KL_mean", "KL_max", "top-1"), rows))
    return 0
