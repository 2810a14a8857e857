"""Iteration KV policies and depth="auto" on the CUDA backend against the NumPy reference, on
the tiny Ouro, Huginn and Nanbeige checkpoints of tests/looped_refs.py (converted at INT8, so
both backends read the same weights and differ only in the kernels' FP16 arithmetic).

Some of these random checkpoints amplify small errors: under kv_iterations="latest" a chunk's
iterations read the earlier chunks' last-iteration K/V, so the chain of dependent iterations
grows with every chunk (or decode step), and a relative perturbation of FP16's size grows
into a different top-1 within tens of positions even between two NumPy runs. Each comparison
therefore runs only as far as NumPy agrees with itself under such a perturbation (a second
checkpoint, its norm weights scaled by 1 + PERTURB * N(0, 1)), and asserts that reach is long
enough to test something."""

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
PERTURB = 5e-4           # about FP16's unit roundoff (2**-11), relative
MIN_ROWS = 16            # logits rows, and MIN_TOKENS decode tokens, every comparison reaches
MIN_TOKENS = 4
GAP_MIN = 0.05           # logits: a greedy pick closer than this to the runner-up is a tie


@pytest.fixture(scope="module")
def tlms(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive_gpu")
    out = {}
    for arch, (make, _, _) in L.ARCHS.items():
        # Huginn's default adapter gain makes the tiny checkpoint chaotic at 4 iterations
        # (two NumPy runs part within a few tokens): a smaller one keeps it comparable
        cfg, t = make(0, adapter_gain=0.2) if arch == "huginn" else make(0)
        rng = np.random.default_rng(11)
        shaken = {k: (v * (1 + PERTURB * rng.standard_normal(v.shape))).astype(v.dtype)
                  if v.ndim == 1 else v for k, v in t.items()}     # the norm weights
        paths = []
        for name, tensors in ((arch, t), (arch + "_shaken", shaken)):
            L.save(str(root / name), cfg, tensors)
            paths.append(str(root / f"{name}.tlm"))
            convert_hf(str(root / name), paths[-1], bits=8)
        out[arch] = (paths[0], cfg, paths[1])
    return out


def _reach(a: list, b: list) -> int:
    """The length of the common prefix of two sequences."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ids(n, vocab, seed):
    return [int(i) for i in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("chunk", [0, 8])
def test_latest_logits_match_numpy(tlms, arch, chunk):
    path, cfg, shaken_path = tlms[arch]
    ids = _ids(40, cfg["vocab_size"], 1)
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ, prefill_chunk=chunk)
    shaken = tinyloop.load_model(shaken_path, backend="numpy", max_seq_len=SEQ,
                                 prefill_chunk=chunk)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ, prefill_chunk=chunk)
    try:
        top = ref.config.max_depth
        for depth in sorted({2, top}):
            for policy in ("all", "latest"):
                want = ref.logits(ids, depth=depth, kv_iterations=policy)
                got = cu.logits(ids, depth=depth, kv_iterations=policy)
                assert np.isfinite(got).all()
                # the rows before the first one the perturbation moves by KL_MEAN / 4
                own = L.kl_rows(want, shaken.logits(ids, depth=depth, kv_iterations=policy))
                n = int(np.argmax(own > KL_MEAN / 4)) if (own > KL_MEAN / 4).any() else len(own)
                assert n >= MIN_ROWS, (arch, depth, policy, n)
                kl = L.kl_rows(want[:n], got[:n])
                assert float(kl.mean()) <= KL_MEAN, (arch, depth, policy, n)
        assert cu.kv_bytes_per_token(top, kv_iterations="latest") == \
            cu.kv_bytes_per_token(1)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(shaken)
        tinyloop.free_model(ref)


def _greedy_gaps(model, **kw):
    """``model.generate(**kw)`` (NumPy backend) and, per token, the gap between the top two
    logits it was picked from."""
    ops, gaps = model._ops, []
    head = ops.rmsnorm_lm_head_sample

    def recording(x, w, eps, lm_head, out, *a, **k):
        tok = head(x, w, eps, lm_head, out, *a, **k)
        top2 = np.sort(np.asarray(out[0], np.float64))[-2:]
        gaps.append(float(top2[1] - top2[0]))
        return tok
    ops.rmsnorm_lm_head_sample = recording
    try:
        return model.generate(**kw), gaps
    finally:
        del ops.rmsnorm_lm_head_sample


def _clear_threshold(model, ids, rule, policy):
    """The first candidate threshold at which NumPy's greedy run exits at several depths, no
    statistic it compared lies within MARGIN of the threshold and no token was picked by less
    than GAP_MIN; None if none does."""
    for th in CANDIDATES[rule]:
        r, gaps = _greedy_gaps(model, prompt=ids, max_new_tokens=N_NEW, depth="auto",
                               exit_rule=rule, exit_threshold=th, kv_iterations=policy, stop=[])
        vals = [v for pos in r.extra["exit_values"] for v in pos]
        if (len(set(r.depths[1:])) > 1 and all(abs(v - th) > MARGIN * th for v in vals)
                and min(gaps) >= GAP_MIN):
            return th, r
    return None, None


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("rule", ["gate", "kl", "state"])
@pytest.mark.parametrize("policy", ["all", "latest"])
def test_auto_depth_picks_the_numpy_depths_and_tokens(tlms, arch, rule, policy, monkeypatch):
    path, cfg, shaken_path = tlms[arch]
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ)
    shaken = tinyloop.load_model(shaken_path, backend="numpy", max_seq_len=SEQ)
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
        # as far as NumPy agrees with itself under the perturbation (tokens and depths)
        own = shaken.generate(ids, max_new_tokens=N_NEW, depth="auto", exit_rule=rule,
                              exit_threshold=th, kv_iterations=policy, stop=[])
        n = min(_reach(want.token_ids, own.token_ids), _reach(want.depths, own.depths))
        assert n >= MIN_TOKENS, (arch, rule, policy, th, n)
        for graphs in ("1", "1", "0"):     # captured parts (warm, capture, replay), eager
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
            before = cu.graph_stats()["replays"]
            got = cu.generate(ids, max_new_tokens=N_NEW, depth="auto", exit_rule=rule,
                              exit_threshold=th, kv_iterations=policy, stop=[])
            assert (cu.graph_stats()["replays"] > before) == (graphs == "1")
            assert got.token_ids[:n] == want.token_ids[:n], (arch, rule, policy, th, graphs, n)
            assert got.depths[:n] == want.depths[:n], (arch, rule, policy, th, graphs, n)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(shaken)
        tinyloop.free_model(ref)
