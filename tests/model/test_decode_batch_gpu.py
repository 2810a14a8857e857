"""Model.decode_batch on the CUDA backend: every row against the NumPy reference's batched
step (itself equal to each request's solo step) and against the CUDA solo step, over requests
of different lengths and positions, in each KV mode the CUDA kernels run, for two steps (the
second reads the K/V the first wrote into each request's own pages)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop

pytestmark = pytest.mark.gpu


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kv_mode", ["fp16", "int8"])
@pytest.mark.parametrize("chunk", [0, 4])      # 4: the batch of 7 runs as 4 + 3 rows
def test_cuda_decode_batch_matches_the_reference_and_the_solo_step(small_path, kv_mode,
                                                                   chunk):
    lengths, depth = [1, 5, 31, 32, 33, 40, 12], 3
    rng = np.random.default_rng(0)
    models = {b: tinyloop.load_model(small_path, max_seq_len=64, prefill_chunk=chunk,
                                     backend=b) for b in ("numpy", "cuda")}
    caches = []
    try:
        vocab = models["cuda"].config.vocab_size
        prompts = [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]

        def prefilled(m):
            out = []
            for p in prompts:
                c = m.new_kv_cache(depth, 48, kv_mode=kv_mode)
                caches.append(c)
                m.forward(p, 0, depth, c)
                out.append(c)
            return out
        ref, cu, solo = prefilled(models["numpy"]), prefilled(models["cuda"]), \
            prefilled(models["cuda"])
        tokens, pos = [int(p[-1]) for p in prompts], list(lengths)
        row = models["cuda"].logit_row()
        for step in range(2):
            want = models["numpy"].decode_batch(ref, tokens, pos, depth)
            got = models["cuda"].decode_batch(cu, tokens, pos, depth)
            for i, (c, t, p) in enumerate(zip(solo, tokens, pos)):
                models["cuda"].forward(np.array([t], np.int32), p, depth, c)
                models["cuda"].head(p, 1, row)
                alone = models["cuda"].ops.to_host(row)[0]
                assert np.isfinite(got[i]).all()
                assert _rel(got[i], want[i]) < 2e-2, (step, i, _rel(got[i], want[i]))
                assert _rel(got[i], alone) < 2e-2, (step, i, _rel(got[i], alone))
            tokens = [int(np.argmax(r)) for r in want]
            pos = [p + 1 for p in pos]
        # the sampled form: greedy ids of one batch equal the argmax of the same batch's
        # logits (the solo caches hold what cu holds)
        ids = models["cuda"].decode_batch(cu, tokens, pos, depth,
                                          sampling=[(0.0, 0, 1.0, 0.0)] * len(cu))
        logits = models["cuda"].decode_batch(solo, tokens, pos, depth)
        assert ids == [int(np.argmax(r)) for r in logits]
    finally:
        for c in caches:
            c.release()
        for m in models.values():
            tinyloop.free_model(m)


def _batch_against_solo(m, monkeypatch, prompts, depth, capacity, refused, kv_mode=None,
                        steps=2):
    """``steps`` decode steps of ``prompts``' requests as one ``decode_batch`` against each
    request's solo step (forward of one id, then the head) on a second set of caches: every
    batch row finite and within 2e-2 relative of its solo logits, with the ops in ``refused``
    made to fail during the batch (the batch kernels run, not a per-row loop). Releases every
    cache it made."""
    caches = []

    def prefilled():
        out = []
        for p in prompts:
            c = m.new_kv_cache(depth, capacity, kv_mode=kv_mode)
            caches.append(c)
            m.forward(p, 0, depth, c)
            out.append(c)
        return out
    try:
        batch, solo = prefilled(), prefilled()
        tokens, pos = [int(p[-1]) for p in prompts], [len(p) for p in prompts]
        row = m.logit_row()
        for step in range(steps):
            with monkeypatch.context() as mp:
                def refuse(*a, **k):
                    raise AssertionError("decode_batch ran a per-row op")
                for name in refused:
                    mp.setattr(m.ops, name, refuse)
                got = m.decode_batch(batch, tokens, pos, depth)
            for i, (c, t, p) in enumerate(zip(solo, tokens, pos)):
                m.forward(np.array([t], np.int32), p, depth, c)
                m.head(p, 1, row)
                alone = m.ops.to_host(row)[0]
                assert np.isfinite(got[i]).all()
                assert _rel(got[i], alone) < 2e-2, (step, i, _rel(got[i], alone))
            tokens = [int(np.argmax(r)) for r in got]
            pos = [p + 1 for p in pos]
    finally:
        for c in caches:
            c.release()


@pytest.mark.parametrize("kv_mode", ["fp16", "int8"])
@pytest.mark.parametrize("version,batch_gemv", [("split", "rows"), ("v1", "rows"),
                                                ("split", "mma")])
def test_cuda_decode_batch_of_32_runs_the_batch_kernels(small_path, monkeypatch, kv_mode,
                                                        version, batch_gemv):
    """32 requests of lengths across page boundaries (pages of 32) and up to a few pages: each
    row within the bound above of its solo CUDA step, with the per-row kv_write /
    kv_attention made to fail (the batch kernels run, not the per-row loop), for both decode
    attention choices and both batch GEMVs (KernelChoice.batch_gemv); every pool tag back at
    its figure after free_model (the index buffer, the batch split-K scratch)."""
    import dataclasses

    from tinyloop.memory import get_pool
    lengths = [1, 2, 5, 12, 30, 31, 32, 33, 34, 40, 47, 63, 64, 65, 70, 90, 95, 96, 97, 100,
               110, 120, 127, 128, 129, 140, 150, 160, 170, 180, 190, 200]
    depth = 2
    pool = get_pool("cuda")
    start = dict(pool.by_tag())
    from tinyloop.backends.cuda import KernelChoice
    m = tinyloop.load_model(small_path, max_seq_len=256, backend="cuda",
                            kernels=KernelChoice(batch_gemv=batch_gemv))
    try:
        monkeypatch.setattr(m.ops, "kernels", dataclasses.replace(m.ops.kernels,
                                                                  attn_decode=version))
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, m.config.vocab_size, n).astype(np.int32) for n in lengths]
        _batch_against_solo(m, monkeypatch, prompts, depth, 208, ("kv_write", "kv_attention"),
                            kv_mode)
    finally:
        tinyloop.free_model(m)
    assert dict(pool.by_tag()) == start


def test_cuda_decode_batch_of_a_huginn_like_stack(tmp_path, monkeypatch):
    """Seeded state (state_init="normal": init_state_rows from the device index), sandwich
    norms, Q/K/V bias, a scaled embedding, a sliding-window layer (window 5 over contexts of
    up to 70 positions) and the injection adapter: each batch row within the bound above of
    its solo CUDA step, the per-row state and K/V ops refused during the batch."""
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic

    from .conftest import SMALL
    path = tmp_path / "huginn_like.tlm"
    arch = dict(injection="adapter", state_init="normal", state_std=0.5,
                layer_norms="sandwich", qkv_bias=True, embed_scale=2.0, sliding_window=5,
                sliding_layers=(1,))
    write_synthetic(path, synthetic_config(**{**SMALL, **arch}), seed=5)
    lengths, depth = [1, 4, 5, 6, 31, 32, 33, 70], 3
    m = tinyloop.load_model(str(path), max_seq_len=96, backend="cuda")
    try:
        rng = np.random.default_rng(2)
        prompts = [rng.integers(0, m.config.vocab_size, n).astype(np.int32) for n in lengths]
        _batch_against_solo(m, monkeypatch, prompts, depth, 80,
                            ("kv_write", "kv_attention", "init_state"))
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("kv_mode", ["fp16", "int8"])
def test_batch_graphs_on_and_off_agree(small_path, monkeypatch, kv_mode):
    """The captured decode batch (graphs.DecodeGraphs.run_batch) launches what the eager
    batch launches, so graphs on and off give the same picks and logits bit for bit while
    requests join, leave and trade places (test_batch_graphs.SCHEDULE), greedy and sampled,
    read at once or after host work (decode_batch_start / finish); batch sizes replay; every
    graph and tag goes with the model."""
    from .test_batch_graphs import _greedy, _mixed, _run, _same
    m = tinyloop.load_model(small_path, max_seq_len=64, backend="cuda")
    before = m.pool.by_tag()
    try:
        for sampling_of in (_greedy, _mixed):
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
            want = _run(m, 2, kv_mode, sampling_of)
            monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
            r0 = m.graph_stats()["replays"]
            got = _run(m, 2, kv_mode, sampling_of)
            _same(got, want)
            assert m.graph_stats()["replays"] - r0 >= 4
            # launched, host work, then read: what the serving engine runs
            _same(_run(m, 2, kv_mode, sampling_of, split=True), want)
    finally:
        tinyloop.free_model(m)
    assert m.pool.by_tag().get("graphs", 0) == before.get("graphs", 0)
