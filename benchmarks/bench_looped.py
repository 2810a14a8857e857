"""Decode and prefill speed of the real looped architectures' shapes on the CUDA backend (a
script, not a test).

    python benchmarks/bench_looped.py [--arch ouro|huginn|nanbeige ...] [--depths 1,2,4]
                                      [--bits 4] [--group-size 32] [--reps 5]
                                      [--new-tokens 128] [--prefill 2048] [--out DIR]

Each model is written straight as a .tlm with random quantized weights (codes drawn uniformly,
scales and zeros chosen so every projection has weights of mean 0 and variance 1 / in, the
synthetic models' scale): the speed does not depend on the values, so no checkpoint has to be
carried to the GPU machine. The configs come from ``tinyloop.convert.hf.folder_config`` on a
config.json with the published dims, so the model is what converting the checkpoint gives:
  - ouro: Ouro-1.4B (24 layers x 2048, 16 heads of 128 without KV grouping, FFN 5632, vocab
    49152, RoPE base 1e6, RMSNorm eps 1e-6, untied head, 4 loops (``total_ut_steps``); no
    sliding window, so every layer is on full attention). Source: ByteDance/Ouro-1.4B's
    config.json and model card (Hugging Face), whose dims the bf16 checkpoint's size (about
    2.87 GB) confirms;
  - huginn: Huginn-0125 (3.5B: 2 prelude / 4 recurrent / 2 coda layers x 5280, 55 heads of 96
    without KV grouping, FFN 17920, vocab 65536, tied head, RoPE base 50000, eps 1e-6, Q/K
    bias, the linear injection, mean recurrence 32; a few of its recurrences). Source:
    tomg-group-umd/huginn-0125's config.json (Hugging Face) and its raven_config_minimal.py
    (``n_heads``, ``n_embd``);
  - nanbeige: Nanbeige4.2-3B (22 layers x 3072 looped twice (``num_loops`` 2), each loop with
    its own KV cache, the final RMSNorm at the loop boundary (``skip_loop_final_norm``
    false); 48 query heads of 128 over 8 KV heads, FFN 10752, vocab 166144, untied head, RoPE
    base 7e7, eps 1e-5). Source: Nanbeige/Nanbeige4.2-3B's config.json and
    configuration_nanbeige.py (Hugging Face; copies in neonccx/qmagent-by-FT-Nanbeige4.2-3B
    training-Nanbeige4.2-3B/models/Nanbeige4.2-3B/, and the config quoted by
    jishnuvenugopal/nanbeige-mlx nanbeige_mlx/model.py and johnhalloran321/Nanbeige4.2-3B-mps-fix
    patch/MPS_FIX_NOTES.md); the checkpoint's model.safetensors.index.json lists 22 layers and
    ``total_size`` 8339601408 bf16 bytes, exactly twice the parameter count these dims give
    (tests/project/test_benchmarks_cpu.py checks it). llama.cpp runs the same file as
    src/models/nanbeige.cpp: ``nanbeige.num_loops`` passes of the stack with shared weights and
    a KV slot per (loop, layer), ``output_norm`` at each boundary unless
    ``nanbeige.skip_loop_final_norm``.
Measures per depth (after a warm-up of sustained decoding, CUDA graphs on):
  - decode tokens/s at batch 1 after a 16-token prompt: median and min-max of ``--reps``
    generations of ``--new-tokens`` tokens;
  - the weight bytes one decode step reads (every layer visit, the injection adapter per
    recurrence, the LM head) and the fraction of the H200 floor (4.8 TB/s: the tokens/s
    reading them once at that bandwidth) the median reaches;
  - prefill of ``--prefill`` tokens: median ms of ``--reps``.
Prints a table; with --out writes bench_looped.json there.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from .common import (HUGINN_3_5B, NANBEIGE_3B, OURO_1_4B, bench_decode, bench_prefill,
                     shrunk, weight_bytes_per_token, write_json, write_random_model)

H200_BYTES_PER_S = 4.8e12        # HBM3e peak: the floor a weight-streaming decode can reach

ARCHS = {"ouro": (OURO_1_4B, (1, 2, 3, 4)), "huginn": (HUGINN_3_5B, (1, 4, 8)),
         "nanbeige": (NANBEIGE_3B, (1, 2))}


def run_arch(name: str, depths, args) -> list:
    import tinyloop
    conf, default_depths = ARCHS[name]
    if args.shrink > 1:
        conf = shrunk(conf, args.shrink)
    path = os.path.join(tempfile.mkdtemp(), f"{name}.tlm")
    t = time.perf_counter()
    cfg = write_random_model(conf, path, args.bits, args.group_size)
    print(f"{name}: wrote {os.path.getsize(path) / 1e9:.2f} GB in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    depths = [d for d in (depths or default_depths) if d <= cfg.max_depth]
    m = tinyloop.load_model(path, backend=args.backend, max_seq_len=args.prefill + 256)
    rows = []
    try:
        for depth in depths:
            nbytes = weight_bytes_per_token(m, depth)
            dec = bench_decode(m, depth, args.new_tokens, args.reps, args.warmup)
            floor = H200_BYTES_PER_S / nbytes
            rows.append({"arch": name, "depth": depth, "bits": args.bits,
                         "group_size": args.group_size, "decode_tok_s": dec,
                         "weight_bytes_per_token": nbytes, "floor_tok_s": floor,
                         "fraction_of_floor": dec["median"] / floor,
                         f"prefill_{args.prefill}_ms": bench_prefill(m, args.prefill, depth,
                                                                     args.reps)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        tinyloop.free_model(m)
        os.remove(path)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHS),
                    help="architecture(s) to run (default: all)")
    ap.add_argument("--depths", default=None,
                    help="comma-separated depths (default: per architecture)")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of decoding before each depth's timed runs")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--out", default=None, help="folder for bench_looped.json")
    ap.add_argument("--backend", default="cuda", help="cuda (numpy: a CPU smoke run)")
    ap.add_argument("--shrink", type=int, default=1,
                    help="divide layer counts and widths by this (a CPU smoke run)")
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")] if args.depths else None
    rows = []
    for name in args.arch or list(ARCHS):
        if name == "huginn" and args.group_size != 32:
            print("huginn: d 5280 takes groups of 32 only; skipped", flush=True)
            continue
        rows += run_arch(name, depths, args)
    print(f"\n{'arch':10s} {'depth':>5s} {'tok/s':>8s} {'min-max':>15s} {'MB/tok':>8s} "
          f"{'floor':>7s} {'of floor':>8s} {'prefill ms':>10s}")
    for r in rows:
        d = r["decode_tok_s"]
        print(f"{r['arch']:10s} {r['depth']:5d} {d['median']:8.1f} "
              f"{d['min']:7.1f}-{d['max']:<7.1f} {r['weight_bytes_per_token'] / 1e6:8.1f} "
              f"{r['floor_tok_s']:7.0f} {r['fraction_of_floor']:8.1%} "
              f"{r[f'prefill_{args.prefill}_ms']:10.1f}")
    write_json(args.out, "bench_looped.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
