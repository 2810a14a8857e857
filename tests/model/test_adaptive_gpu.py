"""Iteration KV policies and depth="auto" on the CUDA backend against the NumPy reference, on
the tiny Ouro, Huginn and Nanbeige checkpoints of tests/looped_refs.py (converted at INT8, so
both backends read the same weights and differ only in the kernels' FP16 arithmetic)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tinyloop
from tinyloop.backends import cuda_available
from tinyloop.convert.hf import convert_hf

from .. import looped_refs as L

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

KL_MEAN = 2e-3           # fp16 kernels vs the float32 reference (test_looped_cuda.py's bound)
SEQ = 64
N_NEW = 12
# a statistic this close to the threshold (relative) may fall on the other side in FP16
MARGIN = 0.05
CANDIDATES = {"gate": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95],
              "kl": [0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0],
              "state": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2]}
SEEDS = range(1, 9)


@pytest.fixture(scope="module")
def tlms(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive_gpu")
    out = {}
    for arch, (make, _, _) in L.ARCHS.items():
        cfg, t = make(0)
        L.save(str(root / arch), cfg, t)
        path = str(root / f"{arch}.tlm")
        convert_hf(str(root / arch), path, bits=8)
        out[arch] = (path, cfg)
    return out


def _ids(n, vocab, seed):
    return [int(i) for i in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("chunk", [0, 8])
def test_latest_logits_match_numpy(tlms, arch, chunk):
    path, cfg = tlms[arch]
    ids = _ids(40, cfg["vocab_size"], 1)
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ, prefill_chunk=chunk)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ, prefill_chunk=chunk)
    try:
        top = ref.config.max_depth
        for policy in ("all", "latest"):
            want = ref.logits(ids, depth=top, kv_iterations=policy)
            got = cu.logits(ids, depth=top, kv_iterations=policy)
            assert np.isfinite(got).all()
            assert float(L.kl_rows(want, got).mean()) <= KL_MEAN, (arch, policy)
        assert cu.kv_bytes_per_token(top, kv_iterations="latest") == \
            cu.kv_bytes_per_token(1)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


def _clear_threshold(model, ids, rule, policy):
    """The first candidate threshold at which NumPy's greedy run exits at several depths and
    no statistic it compared lies within MARGIN of the threshold; None if none does."""
    for th in CANDIDATES[rule]:
        r = model.generate(ids, max_new_tokens=N_NEW, depth="auto", exit_rule=rule,
                           exit_threshold=th, kv_iterations=policy, stop=[])
        vals = [v for pos in r.extra["exit_values"] for v in pos]
        if len(set(r.depths[1:])) > 1 and all(abs(v - th) > MARGIN * th for v in vals):
            return th, r
    return None, None


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("rule", ["gate", "kl", "state"])
@pytest.mark.parametrize("policy", ["all", "latest"])
def test_auto_depth_picks_the_numpy_depths_and_tokens(tlms, arch, rule, policy, monkeypatch):
    path, cfg = tlms[arch]
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ)
    try:
        if rule == "gate" and not ref.config.exit_gate:
            pytest.skip(f"{arch} has no exit gate")
        found = None
        for seed in SEEDS:
            ids = _ids(12, cfg["vocab_size"], seed)
            th, want = _clear_threshold(ref, ids, rule, policy)
            if th is not None:
                found = (ids, th, want)
                break
        if found is None:
            # no candidate splits these prompts' depths with room to spare (the state rule on
            # some checkpoints): every decode position exits after iteration 1 instead, which
            # still runs the copy into the deeper slots on both backends
            ids = _ids(12, cfg["vocab_size"], SEEDS[0])
            th = 0.0 if rule == "gate" else math.inf
            want = ref.generate(ids, max_new_tokens=N_NEW, depth="auto", exit_rule=rule,
                                exit_threshold=th, kv_iterations=policy, stop=[])
            assert set(want.depths[1:]) <= {1}
            found = (ids, th, want)
        ids, th, want = found
        for graphs in ("1", "0"):          # depth="auto" bypasses the captured step either way
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
            got = cu.generate(ids, max_new_tokens=N_NEW, depth="auto", exit_rule=rule,
                              exit_threshold=th, kv_iterations=policy, stop=[])
            assert got.token_ids == want.token_ids, (arch, rule, policy, th)
            assert got.depths == want.depths, (arch, rule, policy, th)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)
