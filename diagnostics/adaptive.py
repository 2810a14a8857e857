"""Adaptive depth and iteration KV policies in numbers: the depth each token of a request ran
at and the recurrent compute that saved (a depth="auto" GenerationResult), and the KV bytes
per token of each policy by depth. ``plots.adaptive_depth`` draws both."""

from __future__ import annotations

from tinyloop.kv.layouts import KV_ITERATIONS, kv_bytes_per_token


def depth_summary(result, max_depth: int) -> dict:
    """From a GenerationResult: ``depths`` (one per new token), ``mean_depth``, ``histogram``
    (depth -> tokens, 1..max_depth) and ``compute_saved``: the share of the recurrent
    iterations a fixed ``max_depth`` would run that the tokens skipped, 1 - sum(depths) /
    (tokens * max_depth) (the prelude, coda and head run once per token either way)."""
    depths = list(result.depths)
    n = len(depths)
    return {"depths": depths, "max_depth": max_depth,
            "mean_depth": sum(depths) / n if n else 0.0,
            "histogram": {d: depths.count(d) for d in range(1, max_depth + 1)},
            "compute_saved": 1.0 - sum(depths) / (n * max_depth) if n else 0.0}


def policy_bytes(cfg, depths, modes, kv_dtype="float16") -> dict:
    """policy -> [KV bytes per token at each depth of ``depths``] for every iteration KV
    policy (``kv_bytes_per_token``; ``modes``: one KV mode per physical layer)."""
    return {p: [kv_bytes_per_token(cfg, d, modes, kv_dtype, p) for d in depths]
            for p in KV_ITERATIONS}
