"""Replicas behind the router: aggregate decode tokens/s and time to first token, 1 vs N replicas.

    python -m benchmarks bench_replicas [--model PATH|default|synthetic] [--backend B]
        [--replicas N] [--devices 0,1,...] [--requests 32] [--prompt-tokens 128]
        [--new-tokens 128] [--max-batch 32] [--out DIR]

For R in (1, N): R worker processes (``tinyloop.serve.router.ReplicaSet``, each a model and
an engine of its own; on cuda pinned one per device by CUDA_VISIBLE_DEVICES, --devices picks
them) behind the router app on 127.0.0.1; every replica is warmed by one request, then
--requests streamed greedy completions (random prompts of --prompt-tokens ids, distinct
first blocks so the affinity does not pile them on one replica) go to the router at once
from one asyncio client (httpx2). Measures:
  - aggregate tokens/s: the tokens the replicas generated (their ``tinyloop_generated_tokens``
    counters, before and after) over the wall time from the first send to the last event;
  - decode tokens/s: those tokens less one per request, over the time from the last first
    event to the last event (every request decoding);
  - time to first token, p50 and p99: send to the first SSE event, through the router;
  - how the requests spread (requests per replica) and whether every replica's allocated
    bytes returned to their value before the load.
N > 1 on one GPU or on the CPU shares the device / the cores: the figure that scales is
N GPUs. Prints a table; with --out writes bench_replicas.json there.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from .common import add_model_arg, format_table, model_label, model_path, write_json


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values``, linear between order statistics."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _scrape(text: str, family: str) -> dict:
    """{replica label: value} of the samples of ``family`` in Prometheus text, summed over
    their other labels (but tag "graphs": the captured decode step's blocks, which a replica's
    model keeps between requests)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == family and "replica" in s.labels and s.labels.get("tag") != "graphs":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


async def _load(url: str, prompts, new_tokens: int, timeout_s: float) -> dict:
    """Every prompt streamed to the router at once: per request (ttft_s, end_s) from the
    first send, and the wall time."""
    import httpx2
    limits = httpx2.Limits(max_connections=None)
    async with httpx2.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(p):
            body = {"model": "bench", "prompt": p, "max_tokens": new_tokens,
                    "temperature": 0, "stream": True}
            first = None
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        raise RuntimeError(line)
                    if line.startswith("data: ") and first is None:
                        first = time.perf_counter() - t0
            return first, time.perf_counter() - t0

        got = await asyncio.gather(*(one(p) for p in prompts))
        return {"ttft_s": [g[0] for g in got], "end_s": [g[1] for g in got],
                "wall_s": time.perf_counter() - t0}


def run_level(spec, n_replicas: int, devices, prompts, new_tokens: int,
              timeout_s: float) -> dict:
    """One replica count: start the workers and the router, warm, load, measure, stop."""
    import httpx2

    from tinyloop.serve.http import ServerThread
    from tinyloop.serve.router import ReplicaSet, create_router_app, load_tokenizer
    with ReplicaSet(spec, n_replicas, devices) as rs:
        app = create_router_app(rs, spec.name, load_tokenizer(spec.model),
                                read_timeout_s=timeout_s)
        with ServerThread(app) as srv:
            for w in rs.workers:            # warm each replica directly (the same path)
                r = httpx2.post(w.url + "/v1/completions", timeout=timeout_s,
                                json={"prompt": prompts[0], "max_tokens": 2})
                r.raise_for_status()
            before = httpx2.get(srv.url + "/metrics", timeout=30).text
            load = asyncio.run(_load(srv.url, prompts, new_tokens, timeout_s))
            t_end = time.monotonic()
            while True:                     # the replicas end their requests' bookkeeping
                after = httpx2.get(srv.url + "/metrics", timeout=30).text
                alloc_after = _scrape(after, "tinyloop_pool_allocated_bytes")
                if alloc_after == _scrape(before, "tinyloop_pool_allocated_bytes") \
                        or time.monotonic() - t_end > 10:
                    break
                time.sleep(0.1)
            spread = [w.requests for w in rs.workers]
    gen = _scrape(after, "tinyloop_generated_tokens_total")
    gen0 = _scrape(before, "tinyloop_generated_tokens_total")
    tokens = int(sum(gen.values()) - sum(gen0.values()))
    last_first, end = max(load["ttft_s"]), max(load["end_s"])
    ttft_ms = [t * 1e3 for t in load["ttft_s"]]
    decode = tokens - len(prompts)
    return {"replicas": n_replicas, "requests": len(prompts), "tokens": tokens,
            "aggregate_tok_s": tokens / load["wall_s"],
            "decode_tok_s": decode / (end - last_first) if end > last_first else 0.0,
            "ttft_ms_p50": percentile(ttft_ms, 50), "ttft_ms_p99": percentile(ttft_ms, 99),
            "requests_per_replica": spread,
            "allocated_back_to_baseline":
                alloc_after == _scrape(before, "tinyloop_pool_allocated_bytes")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arg(ap)
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "numpy"),
                    help="the backend of every replica (default: %(default)s)")
    ap.add_argument("--replicas", type=int, default=2,
                    help="N, the replica count compared with 1 (default: %(default)s)")
    ap.add_argument("--devices", default=None,
                    help="GPUs for the replicas, e.g. 0,1 (default: replica i on device i; "
                         "none pinned on numpy)")
    ap.add_argument("--requests", type=int, default=32,
                    help="concurrent requests of each run (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="prompt length of each request (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="new tokens of each request at most (default: %(default)s)")
    ap.add_argument("--max-batch", type=int, default=32,
                    help="each replica's decode batch (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds any one call may wait (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    ap.add_argument("--out", default=None,
                    help="folder (or .json file) for bench_replicas.json (default: none)")
    a = ap.parse_args(argv)
    if a.replicas < 1 or a.requests < 1:
        ap.error("--replicas and --requests must be >= 1")
    from tinyloop.format import read_tlm
    from tinyloop.serve.replica import ReplicaSpec
    path = model_path(a.model)
    with read_tlm(path) as f:
        vocab, eos = f.config.vocab_size, f.config.eos_token_id
    rng = np.random.default_rng(a.seed)
    prompts = []
    for _ in range(a.requests):
        ids = rng.integers(3, vocab, a.prompt_tokens)
        prompts.append(np.where(ids == eos, 3, ids).tolist())
    spec = ReplicaSpec(model=path, backend=a.backend,
                       max_seq_len=a.prompt_tokens + a.new_tokens, max_batch=a.max_batch,
                       max_queue=max(256, a.requests), model_name="bench")
    devices = None if a.devices is None else a.devices.split(",")
    rows = [run_level(spec, r, devices, prompts, a.new_tokens, a.timeout)
            for r in sorted({1, a.replicas})]
    one = rows[0]["aggregate_tok_s"]
    result = {"model": model_label(a.model, path), "backend": a.backend,
              "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
              "requests": a.requests, "levels": rows}
    print(f"# {result['model']} on {a.backend}: {a.requests} streamed requests, "
          f"{a.prompt_tokens}-token prompts, <= {a.new_tokens} new tokens, through the router")
    print(format_table(
        ["replicas", "tokens", "aggregate tok/s", "x 1 replica", "decode tok/s",
         "TTFT p50 ms", "TTFT p99 ms", "requests per replica", "back to baseline"],
        [[r["replicas"], r["tokens"], f"{r['aggregate_tok_s']:.1f}",
          f"{r['aggregate_tok_s'] / one:.2f}" if one else "-", f"{r['decode_tok_s']:.1f}",
          f"{r['ttft_ms_p50']:.1f}", f"{r['ttft_ms_p99']:.1f}",
          "/".join(map(str, r["requests_per_replica"])),
          "yes" if r["allocated_back_to_baseline"] else "no"] for r in rows]))
    write_json(a.out, "bench_replicas.json", result)
    return 0 if all(r["allocated_back_to_baseline"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
