"""What the replica tests (CPU and GPU) share: waiting on a condition and reading a replica's
own /metrics (needs httpx2 and prometheus_client, not the openai client)."""

from __future__ import annotations

import time

import httpx2
from prometheus_client.parser import text_string_to_metric_families


def _wait(cond, timeout=30.0, what="the condition", poll=0.05):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(poll)


def _replica_metrics(url: str) -> dict:
    """{(family, labels...): value} of a server's /metrics."""
    text = httpx2.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _allocated(url: str) -> float:
    """The replica's pool allocated bytes, summed over tags but "graphs" (the captured decode
    step's blocks, kept by the model between requests), from its own /metrics."""
    return sum(v for (name, labels), v in _replica_metrics(url).items()
               if name == "tinyloop_pool_allocated_bytes" and ("tag", "graphs") not in labels)
