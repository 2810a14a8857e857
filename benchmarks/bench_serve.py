"""Continuous batching: aggregate decode tokens/s of the serving engine at 1/4/16/32 requests.

    python -m benchmarks bench_serve [--model PATH|default|synthetic] [--backend B]
        [--concurrency 1,4,16,32] [--prompt-tokens 128] [--new-tokens 128]
        [--reps 1] [--batch-gemv rows|mma|gemm] [--out DIR]

For each concurrency C, C greedy requests (random prompts of --prompt-tokens ids, --new-tokens
new tokens each: EOS and stop strings are ignored, as vLLM's serving benchmark's
``ignore_eos``, so every request decodes the same length) go to one
``tinyloop.serve.Engine`` (max_batch = C) at once. Measures:
  - aggregate tokens/s: every request's new tokens over the wall time from submit to the
    last token; and decode tokens/s: the tokens made after every request had its first one
    (``EngineRequest.generated`` read once the caller has seen every first token, so at
    least as many as the engine had made at that moment: the figure errs low), over the
    engine's time (``first_token_at`` / ``finished_at``) from the last first token to the
    last token (the batch at its full size, then shrinking as requests end);
  - time to first token, p50 and p99 (submit to the first token: queueing + prefill);
  - against the same model's batch-1 figure: ``Model.generate`` of one such request alone
    (its decode tokens/s), and against the same requests without the engine: one thread per
    request calling ``Model.generate`` (serialized by the model's lock; --no-threads skips);
  - memory per request by pool tag while all C requests decode (the level's peak pool bytes
    by tag minus those at the engine's start, over C), and whether allocated bytes returned
    to their value at start once the engine stopped.
With --reps N each level runs N times on the same prompts: the decode and aggregate figures
and the TTFT percentiles are medians over the runs, with their min-max (``*_spread``), and
``back to start`` must hold for every run. Runs on either backend (--backend numpy: use a
small model). Prints a table; with --out writes bench_serve.json there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import tinyloop

from .common import add_model_arg, format_table, model_label, model_path, spread, write_json


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values``, linear between order statistics."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def run_level(model, prompts, new_tokens: int, depth, prefill_chunk: int) -> dict:
    """One concurrency level: every prompt submitted at once to an Engine of max_batch =
    len(prompts); returns its figures."""
    from tinyloop.serve import Engine
    from tinyloop.serve.engine import allocated_outside_graphs
    c = len(prompts)
    eng = Engine(model, max_batch=c, max_queue=c, prefill_chunk=prefill_chunk).start()
    base_tags = model.pool.by_tag()
    base = eng.baseline_allocated
    # the per-request bytes come from the level's peak by tag: every request is admitted into
    # the one batch and decodes its full length, so the peak holds all C of them at once
    # (a snapshot after the first tokens misses requests that already ended)
    model.pool.reset_peak_stats()
    try:
        t0 = time.perf_counter()
        reqs = [eng.submit(p, max_new_tokens=new_tokens, depth=depth, stop=[],
                           ignore_eos=True) for p in prompts]
        its = [iter(r) for r in reqs]
        for it in its:                     # every request has its first token: all decode
            next(it, None)
        before = sum(r.generated for r in reqs)   # made before every request decoded
        results = [r.result(timeout=3600) for r in reqs]
        t1 = time.perf_counter()
        peak = model.pool.stats().peak_by_tag
        per_request = {t: (peak[t] - base_tags.get(t, 0)) / c for t in peak
                       if peak[t] > base_tags.get(t, 0)}
    finally:
        eng.stop()
    tokens = sum(len(r.token_ids) for r in results)
    # the window runs on the engine's clock, from the last first token to the last token:
    # this thread wakes up after the engine's step, so a time taken here could fall after
    # every request ended (a negative window); ``before``, read after that wake-up, counts
    # at least the tokens made by then, so the decode figure errs low, never high
    firsts = [r.first_token_at for r in reqs if r.first_token_at is not None]
    t_all = max(firsts, default=t0)
    end = max((r.finished_at for r in reqs), default=t_all)
    decode_tokens, window = tokens - before, end - t_all
    ttft = [r.ttft_s * 1e3 for r in reqs]
    return {"concurrency": c, "tokens": tokens,
            "aggregate_tok_s": tokens / (t1 - t0),
            "decode_tok_s": decode_tokens / window if window > 0 else 0.0,
            "decode_tokens": decode_tokens, "decode_window_s": window,
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "bytes_per_request_by_tag": per_request,
            # outside tag graphs: the captured step's blocks stay with the model
            "allocated_back_to_start": allocated_outside_graphs(model.pool) == base,
            "allocated_after_minus_start": allocated_outside_graphs(model.pool) - base,
            "steps": eng.stats()["steps"]}


def run_threads(model, prompts, new_tokens: int, depth) -> float:
    """The same requests without the engine: one thread per request calling
    ``Model.generate`` (they serialize on the model's lock); aggregate tokens/s."""
    import threading
    out = [None] * len(prompts)

    def one(i):
        out[i] = model.generate(prompts[i], max_new_tokens=new_tokens, depth=depth,
                                stop=[], ignore_eos=True)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arg(ap)
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "numpy"),
                    help="the backend (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,4,16,32",
                    help="comma-separated request counts (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="prompt length of each request (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="new tokens of each request at most (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=None,
                    help="recurrent depth (default: the model's default depth)")
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="prompt positions the engine prefills per iteration "
                         "(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    ap.add_argument("--no-threads", action="store_true",
                    help="skip the comparison with one Model.generate thread per request "
                         "(default: run it)")
    ap.add_argument("--reps", type=int, default=1,
                    help="runs of each level (same prompts); the table gives the decode and "
                         "aggregate medians with their min-max (default: %(default)s)")
    ap.add_argument("--batch-gemv", default=None, choices=("rows", "mma", "gemm"),
                    help="CUDA: the decode batch's GEMV (KernelChoice.batch_gemv; default: "
                         "the product's)")
    ap.add_argument("--out", default=None,
                    help="folder (or .json file) for bench_serve.json (default: none)")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    path = model_path(a.model)
    kernels = None
    if a.batch_gemv is not None:
        from tinyloop.backends.cuda import KernelChoice
        kernels = KernelChoice(batch_gemv=a.batch_gemv)
    model = tinyloop.load_model(path, max_seq_len=a.prompt_tokens + a.new_tokens,
                                backend=a.backend, kernels=kernels)
    try:
        rng = np.random.default_rng(a.seed)
        vocab = model.config.vocab_size
        eos = model.config.eos_token_id
        def prompt():
            ids = rng.integers(3, vocab, a.prompt_tokens)
            return np.where(ids == eos, 3, ids).tolist()
        # the batch-1 figure: Model.generate alone (after one warm-up run)
        solo_prompt = prompt()
        model.generate(solo_prompt, max_new_tokens=min(8, a.new_tokens), depth=a.depth)
        solo = [model.generate(solo_prompt, max_new_tokens=a.new_tokens, depth=a.depth,
                               stop=[], ignore_eos=True)
                for _ in range(2)]
        solo_tps = statistics.median(r.decode_tokens_per_s for r in solo)
        rows = []
        for c in levels:
            prompts = [prompt() for _ in range(c)]
            runs = [run_level(model, prompts, a.new_tokens, a.depth, a.prefill_chunk)
                    for _ in range(a.reps)]
            row = dict(runs[0])
            row["runs"] = runs
            for name in ("decode_tok_s", "aggregate_tok_s", "ttft_ms_p50", "ttft_ms_p99"):
                row[name + "_spread"] = spread(r[name] for r in runs).as_dict()
                row[name] = row[name + "_spread"]["median"]
            row["allocated_back_to_start"] = all(r["allocated_back_to_start"] for r in runs)
            row["allocated_after_minus_start"] = max(
                (r["allocated_after_minus_start"] for r in runs), key=abs)
            row["threads_tok_s"] = (None if a.no_threads else
                                    run_threads(model, prompts, a.new_tokens, a.depth))
            rows.append(row)
    finally:
        tinyloop.free_model(model)
    result = {"model": model_label(a.model, path), "backend": model.backend,
              "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "reps": a.reps,
              "batch1_generate_decode_tok_s": solo_tps, "levels": rows}
    print(f"# {result['model']} on {model.backend}: {a.prompt_tokens}-token prompts, "
          f"{a.new_tokens} new tokens; Model.generate alone: {solo_tps:.1f} tok/s decode")

    def cell(r, name):
        t = r[name + "_spread"]
        return (f"{t['median']:.1f}" if t["runs"] == 1 else
                f"{t['median']:.1f} ({t['min']:.0f}-{t['max']:.0f})")
    print(format_table(
        ["requests", "tokens", "aggregate tok/s", "threads tok/s", "decode tok/s",
         "x batch-1",
         "TTFT p50 ms", "TTFT p99 ms", "KV B/request", "back to start"],
        [[r["concurrency"], r["tokens"], cell(r, "aggregate_tok_s"),
          "-" if r["threads_tok_s"] is None else f"{r['threads_tok_s']:.1f}",
          cell(r, "decode_tok_s"),
          f"{r['decode_tok_s'] / solo_tps:.2f}" if solo_tps else "-",
          f"{r['ttft_ms_p50']:.1f}", f"{r['ttft_ms_p99']:.1f}",
          f"{r['bytes_per_request_by_tag'].get('kv_cache', 0):.0f}",
          "yes" if r["allocated_back_to_start"] else
          f"no ({r['allocated_after_minus_start']:+d} B)"] for r in rows]))
    write_json(a.out, "bench_serve.json", result)
    return 0 if all(r["allocated_back_to_start"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
