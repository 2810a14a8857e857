"""What prefix caching buys: time to first token, depth upgrades, a pool over a chat trace.

    python -m benchmarks bench_prefix [--backend cuda|numpy] [--model PATH] [--out DIR]
        [--system-tokens 1024] [--user-tokens 32] [--repeats 5] [--turns 40]

By default (--model synthetic) it writes the synthetic model with SmolLM2-135M's dims (P/R/C =
10/10/10, max depth 4; ``common.write_synthetic_model``), so nothing has to be carried to the
GPU machine.
Measures, after a warm-up, as medians of ``--repeats`` runs with their min..max spread
(synchronised wall clock):

1. Time to first token (prefill + head + sample of one token) of a prompt made of a
   ``--system-tokens`` system prompt and a ``--user-tokens`` user turn: with no cache, and with
   the system prompt in a PrefixCache (expected: only the user turn's cost, plus copying the
   cached K/V), at depth 1 and 4.
2. ResumeHandle.upgrade(d2) from d against a fresh prefill at d2 of the same prompt, for
   (d, d2) in (1, 2), (1, 4), (2, 4); printed beside the share of the layer visits the upgrade
   runs, (R*(d2 - d) + C) / (P + R*d2 + C), which is what it should cost.
3. A chat-like trace through a PrefixPool: ``--conversations`` conversations, each with its own
   system prompt (lengths spread over 256..--system-tokens), ``--turns`` requests drawn at
   random among them; each request is the conversation so far (system, earlier user turns and
   replies) plus a new user turn, and its greedy reply joins the conversation. Reported: hit
   rate (requests that hit), cached share of prompt tokens, entries, bytes held against the
   budget (and against the pool's ``prefix_cache`` tag), evictions, and the summed time to
   first token against the same trace with no pool.

Prints a table; with --out writes bench_prefix.json there.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tinyloop
from tinyloop.config import parse_size

from .common import (add_model_arg, model_label, model_path, spread, wall_time_ms,
                     write_json)


def _sync(model) -> None:
    model.ops.synchronize()


def _timed(model, fn, repeats: int) -> dict:
    """Median and spread (ms) of ``fn()`` over ``repeats`` runs after one warm-up."""
    t = wall_time_ms(fn, reps=repeats, warmup=1, sync=model.ops.synchronize)
    return {"median_ms": t.median, "min_ms": t.min, "max_ms": t.max, "runs": t.runs}


def _fmt(t: dict) -> str:
    return f"{t['median_ms']:9.1f} ms ({t['min_ms']:.1f}..{t['max_ms']:.1f})"


def ttft(model, system, user, depths, repeats) -> list[dict]:
    prompt = np.concatenate([system, user]).astype(np.int32)
    rows = []
    for d in depths:
        plain = _timed(model, lambda: model.generate(prompt, 1, depth=d), repeats)
        with model.prefill(system, depth=d) as pc:
            cached = _timed(model, lambda: model.generate(prompt, 1, prefix=pc), repeats)
            prefill = _timed(model, lambda: model.prefill(system, depth=d).release(), 1)
            same = (model.generate(prompt, 8, prefix=pc).token_ids
                    == model.generate(prompt, 8, depth=d).token_ids)
        rows.append({"depth": d, "system_tokens": len(system), "user_tokens": len(user),
                     "no_cache": plain, "cached": cached, "prefill_system_once": prefill,
                     "speedup": plain["median_ms"] / cached["median_ms"],
                     "same_greedy_tokens": same})
    return rows


def upgrades(model, prompt, pairs, repeats) -> list[dict]:
    cfg = model.config
    rows = []
    for d, d2 in pairs:
        times = []
        for i in range(repeats + 1):
            rh = model.resume_handle(prompt, depth=d, max_depth=d2)
            _sync(model)
            t0 = time.perf_counter()
            rh.upgrade(d2)
            _sync(model)
            if i:                                   # the first is the warm-up
                times.append((time.perf_counter() - t0) * 1e3)
            rh.release()
        t = spread(times)
        up = {"median_ms": t.median, "min_ms": t.min, "max_ms": t.max, "runs": t.runs}
        fresh = _timed(model, lambda: model.resume_handle(prompt, depth=d2,
                                                          max_depth=d2).release(), repeats)
        share = ((cfg.n_recurrent * (d2 - d) + cfg.n_coda)
                 / (cfg.n_prelude + cfg.n_recurrent * d2 + cfg.n_coda))
        rows.append({"from": d, "to": d2, "tokens": len(prompt), "upgrade": up,
                     "fresh_prefill": fresh,
                     "ratio": up["median_ms"] / fresh["median_ms"], "expected_share": share})
    return rows


def chat_trace(model, args, rng) -> dict:
    vocab = model.config.vocab_size
    lo = min(256, args.system_tokens)
    systems = [rng.integers(3, vocab, int(n)).astype(np.int32)
               for n in np.linspace(lo, args.system_tokens, args.conversations)]
    limit = model.max_seq_len - args.reply_tokens
    pool = tinyloop.PrefixPool(model, max_bytes=args.pool_bytes)
    convs = [list(s) for s in systems]
    tag0 = model.pool.stats().by_tag.get("prefix_cache", 0)
    hits = prompt_tokens = cached_tokens = 0
    t_pool = t_plain = 0.0
    max_bytes_seen = 0
    tag_matches = True
    for turn in range(args.turns):
        c = int(rng.integers(len(convs)))
        user = rng.integers(3, vocab, int(rng.integers(8, 48))).tolist()
        prompt = np.array(convs[c] + user, dtype=np.int32)
        if len(prompt) > limit:                      # the conversation is full: start it again
            convs[c] = list(systems[c])
            prompt = np.array(convs[c] + user, dtype=np.int32)
        res = model.generate(prompt, args.reply_tokens, depth=args.depth, prefix_pool=pool)
        t_pool += res.prefill_ms
        plain = model.generate(prompt, 1, depth=args.depth)
        t_plain += plain.prefill_ms
        hits += res.cached_tokens > 0
        prompt_tokens += len(prompt)
        cached_tokens += res.cached_tokens
        convs[c] = prompt.tolist() + res.token_ids
        st = pool.stats()
        max_bytes_seen = max(max_bytes_seen, st["bytes"])
        tag = model.pool.stats().by_tag.get("prefix_cache", 0) - tag0
        tag_matches &= tag == st["bytes"]
    st = pool.stats()
    pool.release()
    return {"conversations": args.conversations, "turns": args.turns,
            "pool_max_bytes": args.pool_bytes, "hit_rate": hits / args.turns,
            "cached_token_share": cached_tokens / prompt_tokens, "stats": st,
            "max_bytes_held": max_bytes_seen, "bytes_equal_tag_every_turn": tag_matches,
            "ttft_sum_ms_pool": t_pool, "ttft_sum_ms_no_pool": t_plain}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "numpy"))
    add_model_arg(ap)
    ap.add_argument("--out", default=None, help="directory for bench_prefix.json")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--depth", type=int, default=1, help="depth of the chat trace")
    ap.add_argument("--pool-bytes", default="256M", help="the chat trace's pool budget")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--skip", default="", help="comma list of ttft,upgrade,chat to skip")
    ap.add_argument("--depths", default="1,4", help="depths of the TTFT figures")
    ap.add_argument("--upgrades", default="1-2,1-4,2-4", help="from-to depth pairs")
    args = ap.parse_args(argv)
    args.pool_bytes = parse_size(args.pool_bytes, name="--pool-bytes")
    skip = set(filter(None, args.skip.split(",")))

    path = model_path(args.model)
    model = tinyloop.load_model(path, max_seq_len=args.max_seq_len, backend=args.backend)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(3, vocab, args.system_tokens).astype(np.int32)
    user = rng.integers(3, vocab, args.user_tokens).astype(np.int32)
    out = {"model": model_label(args.model, path),
           "backend": model.backend, "config": model.config.to_dict(), "args": vars(args)}
    print(f"{model}")
    try:
        if "ttft" not in skip:
            depths = [int(d) for d in args.depths.split(",") if int(d) <= model.config.max_depth]
            out["ttft"] = ttft(model, system, user, depths, args.repeats)
            print(f"\ntime to first token, {args.system_tokens}-token system prompt + "
                  f"{args.user_tokens}-token user turn (median, min..max of {args.repeats})")
            for r in out["ttft"]:
                print(f"  depth {r['depth']}: no cache {_fmt(r['no_cache'])} | cached "
                      f"{_fmt(r['cached'])} | x{r['speedup']:.1f} | prefilling the system "
                      f"prompt once {r['prefill_system_once']['median_ms']:.1f} ms | same "
                      f"tokens: {r['same_greedy_tokens']}")
        pairs = [tuple(int(x) for x in p.split("-")) for p in args.upgrades.split(",")]
        pairs = [(a, b) for a, b in pairs if a < b <= model.config.max_depth]
        if "upgrade" not in skip and pairs:
            prompt = np.concatenate([system, user]).astype(np.int32)
            out["upgrade"] = upgrades(model, prompt, pairs, args.repeats)
            print(f"\nResumeHandle.upgrade vs a fresh prefill at the target depth "
                  f"({len(prompt)} tokens)")
            for r in out["upgrade"]:
                print(f"  {r['from']} -> {r['to']}: upgrade {_fmt(r['upgrade'])} | fresh "
                      f"{_fmt(r['fresh_prefill'])} | ratio {r['ratio']:.2f} (layer-visit "
                      f"share {r['expected_share']:.2f})")
        if "chat" not in skip:
            out["chat"] = c = chat_trace(model, args, rng)
            s = c["stats"]
            print(f"\nchat trace: {c['turns']} requests over {c['conversations']} "
                  f"conversations, depth {args.depth}, pool budget {args.pool_bytes} B")
            print(f"  hit rate {c['hit_rate']:.2%} of requests; {c['cached_token_share']:.2%} "
                  f"of prompt tokens from the pool; {s['entries']} entries, {s['bytes']} B "
                  f"held (max {c['max_bytes_held']} B), {s['evictions']} evictions, "
                  f"{s['replaced']} replaced; bytes == prefix_cache tag every turn: "
                  f"{c['bytes_equal_tag_every_turn']}")
            print(f"  summed time to first token: {c['ttft_sum_ms_pool']:.0f} ms with the "
                  f"pool, {c['ttft_sum_ms_no_pool']:.0f} ms without")
    finally:
        tinyloop.free_model(model)
    write_json(args.out, "bench_prefix.json", out)
    return 0
