"""depth="auto" decode steps replayed as captured parts (``graphs.DecodeGraphs.step_auto``) on
the CPU, through test_graphs.py's recording fake: the tiny Ouro, Huginn and Nanbeige
checkpoints (tests/looped_refs.py, at INT8) give the eager path's tokens, depths and exit
statistics bit for bit under every rule and iteration KV policy, greedy and sampled, and
the parts are captured once per key and replayed after. The same comparison runs against the
NumPy reference on the GPU in tests/model/test_adaptive_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop import graphs as graphmod

from .. import looped_refs as L
from .test_graphs import FakeGraph, RecordingOps

THRESHOLDS = {"gate": 0.6, "kl": 0.3, "state": 0.7}


@pytest.fixture(scope="module")
def tlms(looped_folders):
    """arch -> the .tlm path of conftest's tiny checkpoint at INT8."""
    return {arch: v[3] for arch, v in looped_folders.items()}


def _fake(path):
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    RecordingOps().attach(m)
    return m


def _ids(n, vocab, seed):
    return [int(i) for i in np.random.default_rng(seed).integers(3, vocab, n)]


def _run(m, ids, rule, policy, **kw):
    return m.generate(ids, max_new_tokens=10, depth="auto", exit_rule=rule,
                      exit_threshold=THRESHOLDS[rule], kv_iterations=policy, stop=[], **kw)


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("rule", ["gate", "kl", "state"])
@pytest.mark.parametrize("policy", ["all", "latest"])
def test_captured_parts_give_the_eager_tokens_depths_and_statistics(tlms, arch, rule, policy,
                                                                    monkeypatch):
    m = _fake(tlms[arch])
    try:
        if rule == "gate" and not m.config.exit_gate:
            pytest.skip(f"{arch} has no exit gate")
        ids = _ids(12, m.config.vocab_size, 3)
        sampled = {"temperature": 0.9, "top_p": 0.9, "seed": 5, "repetition_penalty": 1.3}
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
        want = [_run(m, ids, rule, policy), _run(m, ids, rule, policy, **sampled)]
        assert m.graph_stats()["captures"] == 0 and m.ops.launched == 0
        monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
        seen = []
        for _ in range(3):     # every part a round uses is captured by the end of the next
            got = [_run(m, ids, rule, policy), _run(m, ids, rule, policy, **sampled)]
            for g, w in zip(got, want):
                assert g.token_ids == w.token_ids
                assert g.depths == w.depths
                assert g.extra["exit_values"] == w.extra["exit_values"]
            seen.append(dict(m.graph_stats()))
        top = m.config.max_depth
        deepest = max(d for r in want for d in r.depths[1:])
        # per key (greedy; sampled with the penalty): pre, post, iterations up to the deepest
        # one a position ran, and for "kl" a probe after each but the last
        most = 2 + deepest + (min(deepest, top - 1) if rule == "kl" else 0)
        assert 2 * 3 <= seen[1]["captures"] <= 2 * most
        assert seen[2]["captures"] == seen[1]["captures"]       # round 3 only replays
        assert seen[2]["replays"] > seen[1]["replays"]
        assert m.ops.launched == seen[2]["replays"]
        assert len([k for k in seen[2]["keys"] if k[-2:] == ("auto", rule)]) == 2
    finally:
        tinyloop.free_model(m)


def test_a_depth_auto_key_is_its_own_and_release_frees_every_part(tlms, monkeypatch):
    """A fixed-depth request and a depth="auto" one on the same cache shape keep separate
    graphs; free_model drops every part's graph and the graphs blocks."""
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = _fake(tlms["ouro"])
    ids = _ids(12, m.config.vocab_size, 4)
    top = m.config.max_depth
    fixed = m.generate(ids, max_new_tokens=6, depth=top, stop=[])
    auto = _run(m, ids, "gate", "all")
    st = m.graph_stats()
    assert len(st["keys"]) == 2 and st["keys"][0] + ("auto", "gate") == st["keys"][1]
    assert fixed.depths == [top] * len(fixed.token_ids)
    assert len(auto.depths) == len(auto.token_ids)
    graphs = [g for g in m.ops.graphs if isinstance(g, FakeGraph)]
    assert st["graphs"] == len(graphs) >= 3
    tags = m.pool.by_tag()
    assert tags.get("graphs", 0) > 0
    graphmod.decode_graphs(m).release()
    assert m.pool.by_tag().get("graphs", 0) == 0
    tinyloop.free_model(m)
