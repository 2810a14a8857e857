"""Decode and prefill speed of the CUDA backend, with the memory it used (a script, not a test).

    python benchmarks/bench_decode.py [--model PATH] [--out DIR] [--no-peer]
                                      [--mega-blocks-per-sm 1,0] [--no-step-table]

Without --model it writes a synthetic model with SmolLM2-135M's dims (INT4 g=32 layers, INT8
g=32 tied embedding, as the Q4_1 GGUF) from a fixed seed, so nothing has to be carried to the
GPU machine. Measures (CUDA events / synchronised wall clock, medians of repeats, after a
warm-up):
  - decode tokens/s at batch 1, depths 1, 2 and 4 (greedy; median of 5 generations of 128
    tokens after 2 s of sustained decoding, with the SM clock read then), three ways: the
    persistent decode megakernel, one cooperative launch per token (TINYLOOP_MEGAKERNEL=1),
    the decode step replayed as one captured CUDA graph (TINYLOOP_MEGAKERNEL=0,
    TINYLOOP_CUDA_GRAPHS=1) and eager (both 0);
  - the megakernel's grid: decode tokens/s at depths 1 and 4 for each blocks-per-SM cap of
    ``--mega-blocks-per-sm`` (TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM; 0 = the occupancy), with the
    grid launched and the blocks per SM that fit;
  - prefill time and tokens/s for 512- and 2048-token prompts;
  - weight bytes read per decoded token against the device-to-device copy bandwidth measured
    in the same run (bytes read + written per second);
  - per KV storage mode (``--kv-modes``): KV bytes per token at depths 1, 2 and 4, decode
    tokens/s there as megakernel / graphs / eager, decode tokens/s at depth 1 after a 1,024-token
    prompt (graphs; the store-h modes rebuild K/V over the whole context every step: their
    cost grows with it; they run eagerly, never as a captured graph or the megakernel),
    prefill of 2,048 tokens;
  - the captured graphs the model holds at the end (count, keys) and the pool bytes under
    tag ``graphs``;
  - the pool's stats after the run;
  - one captured decode step (depth 1, 64 tokens of context, PDL on) kernel by kernel
    (step_kernels.step_table): µs per launch and per step, the bytes each launch must read
    and the GB/s that gives;
  - a peer figure: the same token counts through PyTorch + transformers (LlamaForCausalLM with
    the same dims, FP16, eager attention, random weights) on the same GPU.
Prints a table last; with --out writes bench_decode.json there.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import tinyloop
from tinyloop.convert.synthetic import synthetic_config, synthetic_weights
from tinyloop.format import write_tlm
from tinyloop.quant import quantize


def smollm2_like(path: str, seed: int = 0) -> None:
    """SmolLM2-135M dims; INT4 layers, INT8 embedding (as the Q4_1 GGUF), max depth 4."""
    cfg = synthetic_config(max_depth=4, bos_token_id=1, eos_token_id=2)
    w = synthetic_weights(cfg, seed, bits=4, group_size=32)
    rng = np.random.default_rng(seed + 1)
    w["token_embd"] = quantize((rng.standard_normal((cfg.vocab_size, cfg.d_model)) * 0.08)
                               .astype(np.float32), 8, 32)
    write_tlm(path, cfg, w, metadata={"source": "synthetic SmolLM2-135M dims", "seed": seed})


def model_or_synthetic(path: str | None) -> str:
    """``path`` (a --model argument), or, when None, a synthetic SmolLM2-dims model written
    once into a new temporary folder (``smollm2_like``); returns the model's path."""
    if path is None:
        path = os.path.join(tempfile.mkdtemp(), "smollm2_dims.tlm")
        smollm2_like(path)
    return path


def copy_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 20) -> float:
    import cupy
    a = cupy.ones(nbytes // 4, dtype=cupy.float32)
    b = cupy.empty_like(a)
    cupy.copyto(b, a)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        cupy.copyto(b, a)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times) / 1e9


def weight_bytes_per_token(model, depth: int) -> int:
    """Bytes of quantized weights one decode step reads at ``depth`` (layers x visits + head)."""
    cfg = model.config
    visits = ([1] * cfg.n_prelude + [depth] * cfg.n_recurrent + [1] * cfg.n_coda)
    total = 0
    for lw, v in zip(model._layers, visits):
        for w in (lw.attn_qkv, lw.attn_output, lw.ffn_gate_up, lw.ffn_down):
            total += v * w.nbytes
    total += model._head.nbytes
    if model._adapter is not None:
        total += depth * model._adapter.nbytes
    return total


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


PATH_ENV = {"mega": {"TINYLOOP_MEGAKERNEL": "1", "TINYLOOP_CUDA_GRAPHS": "1"},
            "graphs": {"TINYLOOP_MEGAKERNEL": "0", "TINYLOOP_CUDA_GRAPHS": "1"},
            "eager": {"TINYLOOP_MEGAKERNEL": "0", "TINYLOOP_CUDA_GRAPHS": "0"}}


def bench_decode(model, depth: int, new_tokens: int = 128, reps: int = 5,
                 warmup_s: float = 2.0, kv_mode=None, path: str = "mega",
                 env: dict | None = None, prompt_len: int = 16) -> dict:
    """Median decode tokens/s over ``reps`` generations, after ``warmup_s`` seconds of
    sustained decoding (a launch-bound loop leaves the GPU mostly idle, and an idle H200 sits
    at a low clock: timing before it has ramped up measures the clock, not the code).
    ``path``: ``mega`` (the decode megakernel), ``graphs`` (megakernel off: the captured CUDA
    graph) or ``eager`` (both off); ``env``: more environment settings for the run;
    ``prompt_len``: tokens of the (fixed) prompt, so the decode runs at that context."""
    want = {**PATH_ENV[path], **(env or {})}
    old = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        if path == "mega" and model.graph_stats()["megakernel"]["failed"]:
            return _not_run(model.graph_stats()["megakernel"]["failed"])
        out = _bench_decode(model, depth, new_tokens, reps, warmup_s, kv_mode, prompt_len)
        if path == "mega":
            mk = model.graph_stats()["megakernel"]
            if mk["failed"]:             # the timed steps fell back to the graph
                return _not_run(mk["failed"])
            out.update(blocks=mk["blocks"], blocks_per_sm_fit=mk["blocks_per_sm_fit"])
        return out
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _not_run(why: str) -> dict:
    """A megakernel figure that could not be measured (its launch failed): NaN, with why."""
    nan = float("nan")
    return {"median": nan, "min": nan, "max": nan, "sm_clock_mhz": None, "blocks": 0,
            "blocks_per_sm_fit": 0, "error": why}


def _bench_decode(model, depth, new_tokens, reps, warmup_s, kv_mode, prompt_len=16) -> dict:
    prompt = [10 + i % 1000 for i in range(prompt_len)]
    t = time.perf_counter()
    while time.perf_counter() - t < warmup_s:
        model.generate(prompt, max_new_tokens=new_tokens, depth=depth, kv_mode=kv_mode)
    clock = sm_clock_mhz()
    tps = sorted(model.generate(prompt, max_new_tokens=new_tokens, depth=depth,
                                kv_mode=kv_mode).decode_tokens_per_s for _ in range(reps))
    return {"median": statistics.median(tps), "min": tps[0], "max": tps[-1],
            "sm_clock_mhz": clock}


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
    as megakernel / graphs / eager (bench_decode), prefill of 2,048 tokens (ms, median of 5)."""
    names = model.ops.kv_modes if modes == "all" else tuple(modes.split(","))
    out = {}
    for mode in names:
        r = {}
        for depth in DEPTHS:
            if depth > model.config.max_depth:
                continue
            r[f"kv_bytes_per_token_depth{depth}"] = model.kv_bytes_per_token(depth, mode)
            eager = bench_decode(model, depth, new_tokens, kv_mode=mode, path="eager")
            # a mode the megakernel / the captured step does not run would fall back to the
            # eager path there: not measured twice more, reported as not run
            ops = model.ops
            r[f"decode_depth{depth}_mega"] = (
                bench_decode(model, depth, new_tokens, kv_mode=mode, path="mega")
                if mode in getattr(ops, "mega_kv_modes", ()) else
                _not_run(f"kv mode {mode} does not run as the megakernel"))
            r[f"decode_depth{depth}"] = (
                bench_decode(model, depth, new_tokens, kv_mode=mode, path="graphs")
                if mode in ops.graph_kv_modes else
                _not_run(f"kv mode {mode} does not run as a captured graph"))
            r[f"decode_depth{depth}_eager"] = eager
        # the default decode path (captured graphs; the eager step where the mode has none):
        # bench_decode's own default is the megakernel, which this column used to measure
        r["decode_depth1_ctx1024"] = bench_decode(
            model, 1, 64, reps=3, warmup_s=0.5, kv_mode=mode, prompt_len=1024,
            path="graphs" if mode in model.ops.graph_kv_modes else "eager")
        r["prefill_2048_ms"] = bench_prefill(model, 2048, kv_mode=mode)
        out[mode] = r
    return out


def bench_mega_grid(model, per_sm: str, new_tokens: int) -> dict:
    """Megakernel decode tokens/s at depths 1 and 4 (fp16 KV) per blocks-per-SM cap."""
    out = {}
    for n in per_sm.split(","):
        n = n.strip()
        for depth in (1, 4):
            if depth > model.config.max_depth:
                continue
            out[f"{n}/depth{depth}"] = bench_decode(
                model, depth, new_tokens, path="mega",
                env={"TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM": n})
    return out


def _fmt(r: dict) -> str:
    return f"{r['median']:,.1f} ({r['min']:,.0f}-{r['max']:,.0f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-step-table", action="store_true",
                    help="skip the per-kernel table of one captured step (step_kernels.py)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-modes", default="all",
                    help="KV storage modes to measure per mode (comma list; all = every mode "
                         "the CUDA backend runs); the headline figures use fp16")
    ap.add_argument("--mega-blocks-per-sm", default="1,0",
                    help="megakernel blocks-per-SM caps to sweep (comma list; 0 = occupancy)")
    a = ap.parse_args(argv)
    tmp = None
    path = a.model
    if path is None:
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "smollm2_dims.tlm")
        smollm2_like(path)
    res: dict = {"model": path}
    bw = copy_bandwidth_gbs()
    res["copy_bandwidth_GBps"] = bw
    tinyloop.reset_peak_memory_stats("cuda")
    model = tinyloop.load_model(path, max_seq_len=2304, backend="cuda")
    try:
        for depth in DEPTHS:
            if depth > model.config.max_depth:
                continue
            mega = bench_decode(model, depth, a.new_tokens, path="mega")
            dec = bench_decode(model, depth, a.new_tokens, path="graphs")
            res[f"decode_depth{depth}_eager"] = bench_decode(model, depth, a.new_tokens,
                                                             path="eager")
            res[f"decode_depth{depth}_mega"] = mega
            res[f"decode_depth{depth}_mega_tokens_per_s"] = mega["median"]
            tps = dec["median"]
            wb = weight_bytes_per_token(model, depth)
            res[f"decode_depth{depth}"] = dec
            res[f"decode_depth{depth}_tokens_per_s"] = tps
            res[f"weight_bytes_per_token_depth{depth}"] = wb
            res[f"weight_GBps_depth{depth}"] = wb * tps / 1e9
            res[f"weight_GBps_depth{depth}_mega"] = wb * mega["median"] / 1e9
        res["mega_grid"] = bench_mega_grid(model, a.mega_blocks_per_sm, a.new_tokens)
        for n in (512, 2048):
            ms = bench_prefill(model, n)
            res[f"prefill_{n}_ms"] = ms
            res[f"prefill_{n}_tokens_per_s"] = n / (ms / 1e3)
        res["kv_modes"] = bench_kv_modes(model, a.kv_modes, a.new_tokens)
        gs = model.graph_stats()
        res["graphs"] = {"count": gs["graphs"], "captures": gs["captures"],
                         "replays": gs["replays"], "keys": [str(k) for k in gs["keys"]],
                         "bytes": gs["bytes"], "megakernel": gs["megakernel"]}
        try:                        # the megakernel's compiled resources (ptxas -v's figures)
            fn = model.ops._fn("decode_mega", f"decode_mega_hd{model.config.head_dim}")
            res["graphs"]["kernel_attributes"] = dict(fn.attributes)
        except Exception as e:  # no kernel for this head dim: reported, not fatal
            res["graphs"]["kernel_attributes"] = {"error": f"{type(e).__name__}: {e}"}
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
        step_text = ""
        if not a.no_step_table:     # last: its isolated replays leave the scratch stale
            from step_kernels import step_table     # it imports this module: not at the top
            buf = io.StringIO()
            res["step_kernels"] = step_table(model, 1, 64, None, "1", out=buf)
            step_text = buf.getvalue()
    finally:
        tinyloop.free_model(model)
    if not a.no_peer:
        try:
            res["peer_transformers"] = peer_transformers(model.config, a.new_tokens)
        except Exception as e:  # the peer is a reference figure; its absence is reported
            res["peer_transformers"] = {"error": f"{type(e).__name__}: {e}"}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
            json.dump(res, f, indent=2, default=str)
    print(report)
    print("\n== TinyLoop CUDA benchmark (" + ("synthetic SmolLM2-135M dims" if tmp else path)
          + ") ==")
    rows = [("copy bandwidth (read+write)", f"{bw:,.0f} GB/s")]
    for d in DEPTHS:
        if f"decode_depth{d}_tokens_per_s" in res:
            dec, eag = res[f"decode_depth{d}"], res[f"decode_depth{d}_eager"]
            mk = res[f"decode_depth{d}_mega"]
            rows.append((f"decode depth {d} (megakernel)", f"{mk['median']:,.1f} tok/s "
                         f"(median; {mk['min']:,.0f}-{mk['max']:,.0f}; SM {mk['sm_clock_mhz']} "
                         f"MHz; {1e6 / mk['median']:,.0f} us/tok)  "
                         f"{res[f'weight_GBps_depth{d}_mega']:,.0f} GB/s; grid {mk['blocks']}"))
            rows.append((f"decode depth {d} (graphs)", f"{dec['median']:,.1f} tok/s (median; "
                         f"{dec['min']:,.0f}-{dec['max']:,.0f}; SM {dec['sm_clock_mhz']} MHz)"
                         f"  {res[f'weight_bytes_per_token_depth{d}'] / 2**20:.1f} MiB weights/tok"
                         f", {res[f'weight_GBps_depth{d}']:,.0f} GB/s"))
            rows.append((f"decode depth {d} (eager)", f"{eag['median']:,.1f} tok/s (median; "
                         f"{eag['min']:,.0f}-{eag['max']:,.0f}; SM {eag['sm_clock_mhz']} MHz)"))
    for n in (512, 2048):
        rows.append((f"prefill {n}", f"{res[f'prefill_{n}_ms']:.1f} ms  "
                     f"({res[f'prefill_{n}_tokens_per_s']:,.0f} tok/s)"))
    rows.append(("model owns", f"{res['vram_usage_bytes'] / 2**20:.1f} MiB"))
    g = res["graphs"]
    rows.append(("captured graphs held / captures",
                 f"{g['count']} / {g['captures']} ({g['replays']:,d} replays); tag graphs "
                 f"{g['pool_tag_bytes']:,d} B"))
    rows.append(("megakernel launches / failure", f"{g['megakernel']['launches']:,d} / "
                 f"{g['megakernel']['failed']}"))
    ka = g.get("kernel_attributes")
    if ka:
        rows.append(("megakernel regs / static smem / local", f"{ka.get('num_regs')} / "
                     f"{ka.get('shared_size_bytes')} B / {ka.get('local_size_bytes')} B"))
    for key, r in res.get("mega_grid", {}).items():
        n, d = key.split("/")
        rows.append((f"megakernel {n or '0'} blk/SM, {d}", f"{_fmt(r)} tok/s; grid {r['blocks']}"
                     f" (fit {r['blocks_per_sm_fit']}/SM)"))
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
    print("\n  KV storage modes: bytes/token (all slots) | decode tok/s megakernel / graphs / "
          "eager (median, min-max) | decode d1 after 1024 tokens (graphs) | prefill 2048")
    for mode, r in res.get("kv_modes", {}).items():
        parts = []
        for d in DEPTHS:
            if f"decode_depth{d}" in r:
                dec, eag = r[f"decode_depth{d}"], r[f"decode_depth{d}_eager"]
                mk = r[f"decode_depth{d}_mega"]
                parts.append(f"d{d}: {r[f'kv_bytes_per_token_depth{d}']:,d} B, "
                             f"{_fmt(mk)} / {_fmt(dec)} / {_fmt(eag)} tok/s")
        long = r["decode_depth1_ctx1024"]
        print(f"  {mode:<8}" + " | ".join(parts) + f" | {long['median']:,.1f} tok/s"
              f" | {r['prefill_2048_ms']:.1f} ms")
    if step_text:
        print("\n  One captured decode step, per kernel (step_kernels.py; KB a launch must read "
              "and the GB/s that gives):" + step_text)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
