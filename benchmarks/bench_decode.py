"""Decode and prefill speed of the CUDA backend, with the memory it used.

    python -m benchmarks bench_decode [--model PATH|default|synthetic] [--out DIR] [--no-peer]
                                      [--kv-modes fp16,int8] [--contexts 64,1024,4096,8000]
                                      [--context-modes fp16,int8]

By default (--model synthetic) it writes a synthetic model with SmolLM2-135M's dims (INT4 g=32 layers, INT8
g=32 tied embedding, as the Q4_1 GGUF) from a fixed seed, so nothing has to be carried to the
GPU machine. Measures (CUDA events / synchronised wall clock, medians of repeats, after a
warm-up):
  - decode tokens/s at batch 1, depths 1, 2 and 4 (greedy; median of 5 generations of 128
    tokens after 2 s of sustained decoding, with the SM clock read then), two ways: the
    decode step replayed as one captured CUDA graph (the ``cuda_graphs`` setting on) and
    eager (off);
  - prefill time and tokens/s for 512- and 2048-token prompts;
  - weight bytes read per decoded token against the device-to-device copy bandwidth measured
    in the same run (bytes read + written per second);
  - per KV storage mode (``--kv-modes``): KV bytes per token at depths 1, 2 and 4, decode
    tokens/s there as graphs / eager, decode tokens/s at depth 1 after a 1,024-token
    prompt (graphs; the store-h modes rebuild K/V over the whole context every step: their
    cost grows with it; they run eagerly, never as a captured graph),
    prefill of 2,048 tokens;
  - with --contexts: decode tokens/s after each prompt length at depths 1 and 4 per mode
    (--context-modes, default the --kv-modes ones), and against the shortest (the
    long-context slowdown);
  - the captured graphs the model holds at the end (count, keys) and the pool bytes under
    tag ``graphs``;
  - the pool's stats after the run;
  - a peer figure: the same token counts through PyTorch + transformers (LlamaForCausalLM with
    the same dims, FP16, eager attention, random weights) on the same GPU.
Prints a table last; with --out writes bench_decode.json there. One captured decode step
kernel by kernel is the ``step_kernels`` benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

import tinyloop

from .common import (BenchError, add_model_arg, gpu_time_us, model_label, model_path, spread,
                     user_setting, weight_bytes_per_token, write_json)


def copy_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9 (median of
    ``reps`` copies of ``nbytes``); the ceiling for the decode GEMVs."""
    import cupy
    a = cupy.ones(nbytes // 4, dtype=cupy.float32)
    b = cupy.empty_like(a)
    us = gpu_time_us(lambda: cupy.copyto(b, a), reps=reps, warmup=1).median
    del a, b
    return 2 * nbytes / (us * 1e-6) / 1e9


def sm_clock_mhz() -> int | None:
    """The SM clock now (NVML), or None where pynvml is unavailable."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    except Exception:  # no NVML: the clock is reported as unknown
        return None


DEPTHS = (1, 2, 4)


PATH_GRAPHS = {"graphs": "1", "eager": "0"}      # the cuda_graphs setting of each path
# Sampled decode rows (depth 1, graphs): generate's sampling arguments, and the sampler kernel
# (KernelChoice.sampler) each runs with.
SAMPLED = {
    "sampled": (dict(temperature=0.8, top_p=0.9, seed=0), "fast"),
    "sampled_min_p_penalty": (dict(temperature=0.8, top_p=0.9, min_p=0.05,
                                   repetition_penalty=1.1, seed=0), "fast"),
    "sampled_all_filters": (dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                                 repetition_penalty=1.1, seed=0), "fast"),
    "sampled_reference": (dict(temperature=0.8, top_p=0.9, seed=0), "reference"),
}


def bench_decode(model, depth: int, new_tokens: int = 128, reps: int = 5,
                 warmup_s: float = 2.0, kv_mode=None, path: str = "graphs",
                 prompt_len: int = 16, sampling: dict | None = None) -> dict:
    """Median decode tokens/s over ``reps`` generations, after ``warmup_s`` seconds of
    sustained decoding (a launch-bound loop leaves the GPU mostly idle, and an idle H200 sits
    at a low clock: timing before it has ramped up measures the clock, not the code).
    ``path``: ``graphs`` (the captured CUDA graph) or ``eager``; ``prompt_len``: tokens of
    the (fixed) prompt, so the decode runs at that context; ``sampling``: generate's sampling
    arguments (None: greedy)."""
    with user_setting("cuda_graphs", PATH_GRAPHS[path]):
        return _bench_decode(model, depth, new_tokens, reps, warmup_s, kv_mode, prompt_len,
                             sampling)


def _not_run(why: str) -> dict:
    """A figure that is not measured (the path does not run the mode): NaN, with why."""
    nan = float("nan")
    return {"median": nan, "min": nan, "max": nan, "sm_clock_mhz": None, "error": why}


def _bench_decode(model, depth, new_tokens, reps, warmup_s, kv_mode, prompt_len=16,
                  sampling=None) -> dict:
    prompt = [10 + i % 1000 for i in range(prompt_len)]
    # no stop string and ignore_eos: nothing ends a run early, so every generation decodes
    # new_tokens tokens at the context it was given (a model that answers a long prompt with
    # EOS would otherwise time nothing)
    kw = dict(sampling or {}, stop=[], ignore_eos=True)

    def once():
        r = model.generate(prompt, max_new_tokens=new_tokens, depth=depth, kv_mode=kv_mode,
                           **kw)
        if len(r.token_ids) != new_tokens:
            raise BenchError(f"a generation at depth {depth} after {prompt_len} prompt tokens "
                             f"made {len(r.token_ids)} of {new_tokens} tokens "
                             f"({r.finish_reason})")
        return r.decode_tokens_per_s

    t = time.perf_counter()
    while time.perf_counter() - t < warmup_s:
        once()
    clock = sm_clock_mhz()
    tps = spread(once() for _ in range(reps))
    return {"median": tps.median, "min": tps.min, "max": tps.max, "sm_clock_mhz": clock}


def bench_prefill(model, n: int, reps: int = 5, kv_mode=None) -> float:
    rng = np.random.default_rng(n)
    ids = rng.integers(3, model.config.vocab_size, n).tolist()
    model.generate(ids, max_new_tokens=1, kv_mode=kv_mode)          # warm-up
    ms = []
    for _ in range(reps):
        r = model.generate(ids, max_new_tokens=1, kv_mode=kv_mode)
        ms.append(r.prefill_ms)
    return statistics.median(ms)


def peer_transformers(cfg, new_tokens: int = 128, prefill: int = 2048) -> dict:
    """PyTorch + transformers on the same GPU: eager LlamaForCausalLM, FP16, random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                     intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                     num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                     head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                     tie_word_embeddings=True, max_position_embeddings=4096,
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf).to("cuda", torch.float16).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
        torch.cuda.synchronize()
        dec = new_tokens / (time.perf_counter() - t)
        long = torch.randint(3, cfg.vocab_size, (1, prefill), device="cuda")
        model(long)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(long)
        torch.cuda.synchronize()
        pre_ms = (time.perf_counter() - t) * 1e3
    del model
    torch.cuda.empty_cache()
    return {"decode_tokens_per_s": dec, "prefill_2048_ms": pre_ms}


def bench_kv_modes(model, modes: str, new_tokens: int) -> dict:
    """Per KV storage mode: KV bytes per token at DEPTHS (all slots), decode tokens/s there
    as graphs / eager (bench_decode), prefill of 2,048 tokens (ms, median of 5)."""
    names = model.ops.kv_modes if modes == "all" else tuple(modes.split(","))
    out = {}
    for mode in names:
        r = {}
        for depth in DEPTHS:
            if depth > model.config.max_depth:
                continue
            r[f"kv_bytes_per_token_depth{depth}"] = model.kv_bytes_per_token(depth, mode)
            eager = bench_decode(model, depth, new_tokens, kv_mode=mode, path="eager")
            # a mode the captured step does not run would fall back to the eager path
            # there: not measured twice, reported as not run
            ops = model.ops
            r[f"decode_depth{depth}"] = (
                bench_decode(model, depth, new_tokens, kv_mode=mode, path="graphs")
                if mode in ops.graph_kv_modes else
                _not_run(f"kv mode {mode} does not run as a captured graph"))
            r[f"decode_depth{depth}_eager"] = eager
        # the default decode path (captured graphs; the eager step where the mode has none)
        r["decode_depth1_ctx1024"] = bench_decode(
            model, 1, 64, reps=3, warmup_s=0.5, kv_mode=mode, prompt_len=1024,
            path="graphs" if mode in model.ops.graph_kv_modes else "eager")
        r["prefill_2048_ms"] = bench_prefill(model, 2048, kv_mode=mode)
        out[mode] = r
    return out


def context_sweep(model, contexts, modes, depths=(1, 4), new_tokens: int = 64) -> dict:
    """Decode tokens/s (graphs, greedy, median of 3 after a short warm-up) after each prompt
    length in ``contexts``, per KV mode and depth, and each against the shortest context's
    figure (the long-context slowdown). mode -> {"depth{d}_ctx{c}": result}."""
    out = {}
    for mode in modes:
        path = "graphs" if mode in model.ops.graph_kv_modes else "eager"
        r = {}
        for d in depths:
            if d > model.config.max_depth:
                continue
            for c in contexts:
                r[f"depth{d}_ctx{c}"] = bench_decode(model, d, new_tokens, reps=3,
                                                     warmup_s=0.5, kv_mode=mode,
                                                     prompt_len=c, path=path)
            base = r[f"depth{d}_ctx{contexts[0]}"]["median"]
            for c in contexts:
                r[f"depth{d}_ctx{c}"]["vs_shortest"] = r[f"depth{d}_ctx{c}"]["median"] / base
        out[mode] = r
    return out


def _fmt(r: dict) -> str:
    return f"{r['median']:,.1f} ({r['min']:,.0f}-{r['max']:,.0f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arg(ap)
    ap.add_argument("--out", default=None, help="directory for bench_decode.json")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-modes", default="all",
                    help="KV storage modes to measure per mode (comma list; all = every mode "
                         "the CUDA backend runs); the headline figures use fp16")
    ap.add_argument("--contexts", default="",
                    help="comma list of prompt lengths for a long-context decode sweep at "
                         "depths 1 and 4 per --context-modes mode (e.g. 64,1024,4096,8000); off "
                         "by default")
    ap.add_argument("--context-modes", default="",
                    help="comma list of KV modes for the --contexts sweep (default: the "
                         "--kv-modes ones; the store-h modes rebuild K/V over the whole "
                         "context every step)")
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",") if c]
    path = model_path(a.model)
    res: dict = {"model": path}
    bw = copy_bandwidth_gbs()
    res["copy_bandwidth_GBps"] = bw
    tinyloop.reset_peak_memory_stats("cuda")
    model = tinyloop.load_model(path, max_seq_len=max([2304] + [c + a.new_tokens + 80
                                                                for c in contexts]),
                                backend="cuda")
    try:
        for depth in DEPTHS:
            if depth > model.config.max_depth:
                continue
            dec = bench_decode(model, depth, a.new_tokens, path="graphs")
            res[f"decode_depth{depth}_eager"] = bench_decode(model, depth, a.new_tokens,
                                                             path="eager")
            tps = dec["median"]
            wb = weight_bytes_per_token(model, depth)
            res[f"decode_depth{depth}"] = dec
            res[f"decode_depth{depth}_tokens_per_s"] = tps
            res[f"weight_bytes_per_token_depth{depth}"] = wb
            res[f"weight_GBps_depth{depth}"] = wb * tps / 1e9
        default_kernels = model.ops.kernels
        for name, (kw, sampler) in SAMPLED.items():
            model.ops.kernels = dataclasses.replace(default_kernels, sampler=sampler)
            try:
                res[f"decode_depth1_{name}"] = bench_decode(model, 1, a.new_tokens,
                                                            sampling=kw)
            finally:
                model.ops.kernels = default_kernels
            res[f"decode_depth1_{name}"]["vs_greedy"] = (
                res[f"decode_depth1_{name}"]["median"] / res["decode_depth1_tokens_per_s"])
        for n in (512, 2048):
            ms = bench_prefill(model, n)
            res[f"prefill_{n}_ms"] = ms
            res[f"prefill_{n}_tokens_per_s"] = n / (ms / 1e3)
        res["kv_modes"] = bench_kv_modes(model, a.kv_modes, a.new_tokens)
        if contexts:
            modes = a.context_modes or a.kv_modes
            names = model.ops.kv_modes if modes == "all" else tuple(modes.split(","))
            res["context_sweep"] = context_sweep(model, contexts, names)
        gs = model.graph_stats()
        res["graphs"] = {"count": gs["graphs"], "captures": gs["captures"],
                         "replays": gs["replays"], "keys": [str(k) for k in gs["keys"]],
                         "bytes": gs["bytes"]}
        st = tinyloop.memory_stats("cuda")
        res["graphs"]["pool_tag_bytes"] = st.by_tag.get("graphs", 0)
        res["pool"] = {"allocated_bytes": st.allocated_bytes, "reserved_bytes": st.reserved_bytes,
                       "peak_allocated_bytes": st.peak_allocated_bytes,
                       "peak_reserved_bytes": st.peak_reserved_bytes, "by_tag": st.by_tag,
                       "peak_by_tag": st.peak_by_tag,
                       "external_fragmentation": st.external_fragmentation,
                       "device_free_bytes": st.device_free_bytes}
        res["vram_usage_bytes"] = tinyloop.vram_usage_bytes(model)
        report = tinyloop.memory_report("cuda")
    finally:
        tinyloop.free_model(model)
    if not a.no_peer:
        try:
            res["peer_transformers"] = peer_transformers(model.config, a.new_tokens)
        except Exception as e:  # the peer is a reference figure; its absence is reported
            res["peer_transformers"] = {"error": f"{type(e).__name__}: {e}"}
    write_json(a.out, "bench_decode.json", res)
    print(report)
    print(f"\n== TinyLoop CUDA benchmark ({model_label(a.model, path)}) ==")
    rows = [("copy bandwidth (read+write)", f"{bw:,.0f} GB/s")]
    for d in DEPTHS:
        if f"decode_depth{d}_tokens_per_s" in res:
            dec, eag = res[f"decode_depth{d}"], res[f"decode_depth{d}_eager"]
            rows.append((f"decode depth {d} (graphs)", f"{dec['median']:,.1f} tok/s (median; "
                         f"{dec['min']:,.0f}-{dec['max']:,.0f}; SM {dec['sm_clock_mhz']} MHz)"
                         f"  {res[f'weight_bytes_per_token_depth{d}'] / 2**20:.1f} MiB weights/tok"
                         f", {res[f'weight_GBps_depth{d}']:,.0f} GB/s"))
            rows.append((f"decode depth {d} (eager)", f"{eag['median']:,.1f} tok/s (median; "
                         f"{eag['min']:,.0f}-{eag['max']:,.0f}; SM {eag['sm_clock_mhz']} MHz)"))
    for name, (kw, sampler) in SAMPLED.items():
        r = res.get(f"decode_depth1_{name}")
        if r is not None:
            what = ", ".join(f"{k} {v}" for k, v in kw.items() if k != "seed")
            rows.append((f"decode depth 1 {what} ({sampler} sampler)",
                         f"{r['median']:,.1f} tok/s ({r['vs_greedy']:.2f}x greedy)"))
    for n in (512, 2048):
        rows.append((f"prefill {n}", f"{res[f'prefill_{n}_ms']:.1f} ms  "
                     f"({res[f'prefill_{n}_tokens_per_s']:,.0f} tok/s)"))
    rows.append(("model owns", f"{res['vram_usage_bytes'] / 2**20:.1f} MiB"))
    g = res["graphs"]
    rows.append(("captured graphs held / captures",
                 f"{g['count']} / {g['captures']} ({g['replays']:,d} replays); tag graphs "
                 f"{g['pool_tag_bytes']:,d} B"))
    rows.append(("pool peak allocated / reserved",
                 f"{res['pool']['peak_allocated_bytes'] / 2**20:.1f} / "
                 f"{res['pool']['peak_reserved_bytes'] / 2**20:.1f} MiB"))
    peer = res.get("peer_transformers")
    if peer:
        if "error" in peer:
            rows.append(("peer transformers", peer["error"][:60]))
        else:
            rows.append(("peer transformers eager fp16",
                         f"decode {peer['decode_tokens_per_s']:.1f} tok/s, prefill 2048 "
                         f"{peer['prefill_2048_ms']:.1f} ms"))
    for k, v in rows:
        print(f"  {k:<34}{v}")
    print("\n  KV storage modes: bytes/token (all slots) | decode tok/s graphs / "
          "eager (median, min-max) | decode d1 after 1024 tokens (graphs) | prefill 2048")
    for mode, r in res.get("kv_modes", {}).items():
        parts = []
        for d in DEPTHS:
            if f"decode_depth{d}" in r:
                dec, eag = r[f"decode_depth{d}"], r[f"decode_depth{d}_eager"]
                parts.append(f"d{d}: {r[f'kv_bytes_per_token_depth{d}']:,d} B, "
                             f"{_fmt(dec)} / {_fmt(eag)} tok/s")
        long = r["decode_depth1_ctx1024"]
        print(f"  {mode:<8}" + " | ".join(parts) + f" | {long['median']:,.1f} tok/s"
              f" | {r['prefill_2048_ms']:.1f} ms")
    if "context_sweep" in res:
        print("\n  decode after a prompt of N tokens (graphs; median, min-max; x the shortest)")
        for mode, r in res["context_sweep"].items():
            for key, v in r.items():
                print(f"  {mode:<8} {key:<16} {_fmt(v)} tok/s  {v['vs_shortest']:.2f}x")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
