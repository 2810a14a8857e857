"""The looped architectures on the CUDA backend against the NumPy reference: the tiny Ouro,
Huginn and Nanbeige checkpoints of tests/looped_refs.py (published tensor names; head dims
128, 96 and 64, Ouro and Huginn without KV grouping), converted once at INT4, at depths 1, 2
and the deepest, whole prompts and prefill chunks, every KV mode the CUDA backend runs, decode
steps with CUDA graphs on and off, a PrefixCache and a ResumeHandle upgrade. Both backends
read the same quantized weights, so what differs is the CUDA kernels' FP16 arithmetic: the
mean KL bound is the one the other CUDA model tests use. Ouro runs twice: every layer on full
attention ("ouro"), and with its layer 1 on a sliding window of SWA_WINDOW positions
("ouro_swa", the same weights), shorter than the 40-token prompt, so prefill chunks of 8
straddle the window, the decode steps (captured and eager) run past it and a PrefixCache /
ResumeHandle continues behind it."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.backends import cuda_available
from tinyloop.convert.hf import convert_hf
from tinyloop.memory import get_pool

from .. import looped_refs as L

pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device (tinyloop.backends.cuda_available() is False)",
                allow_module_level=True)

from tinyloop.backends.cuda import CudaOps  # noqa: E402

KL_MEAN = 2e-3           # fp16 kernels vs the float64-accumulating reference, mean over rows
# the modes that round K/V or h to codes: a value on a rounding boundary may round the other
# way in FP16 than in float32 (test_cuda_model.py::test_kv_modes_match_reference's bound). A
# flipped code is one quantization step, the noise the mode itself adds against fp16 K/V; on
# random-weight looped models that noise compounds with depth, so the two backends may differ
# by up to the mode's own error (NumPy fp16 against NumPy in the mode, at the same depth):
# twice its mean KL, as two realisations of that noise each lie about that far from fp16; and
# its greedy agreement as the top-1 floor, less two binomial standard errors of an agreement
# measured over PROMPT rows (one flipped row moves it by 1 / PROMPT)
KL_MEAN_CODES = 5e-3
TOP1 = 0.9               # greedy agreement of the two backends' rows
SEQ = 64
PROMPT = 40
SWA_WINDOW = 8
MAKERS = {"ouro": lambda s: L.ouro_checkpoint(s, sliding=()),
          "ouro_swa": lambda s: L.ouro_checkpoint(s, sliding=(1,), window=SWA_WINDOW),
          "huginn": L.huginn_checkpoint, "nanbeige": L.nanbeige_checkpoint}


@pytest.fixture(scope="module")
def tlms(tmp_path_factory):
    """arch -> (.tlm path at INT4, config.json dict)."""
    root = tmp_path_factory.mktemp("looped_cuda")
    out = {}
    for arch, make in MAKERS.items():
        cfg, t = make(0)
        L.save(str(root / arch), cfg, t)
        path = str(root / f"{arch}.tlm")
        convert_hf(str(root / arch), path, bits=4)
        out[arch] = (path, cfg)
    return out


def _ids(n, vocab, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n)


def _depths(m) -> list:
    return sorted({1, min(2, m.config.max_depth), m.config.max_depth})


def _top1(a, b) -> float:
    return float((a.argmax(axis=1) == b.argmax(axis=1)).mean())


def _agree(want, got, what, bound=KL_MEAN, top1_floor=TOP1):
    assert np.isfinite(got).all(), what
    kl = float(L.kl_rows(want, got).mean())
    top1 = _top1(want, got)
    assert kl <= bound and top1 >= top1_floor, (what, kl, top1)


@pytest.mark.parametrize("arch", list(MAKERS))
@pytest.mark.parametrize("mode", CudaOps.kv_modes)
@pytest.mark.parametrize("chunk", [0, 8])
def test_logits_match_numpy(tlms, arch, mode, chunk):
    path, cfg = tlms[arch]
    ids = _ids(PROMPT, cfg["vocab_size"])
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ, prefill_chunk=chunk,
                              kv_mode=mode)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ, prefill_chunk=chunk,
                             kv_mode=mode)
    codes = mode not in ("fp16", "h_fp16")
    base = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ, kv_mode="fp16") \
        if codes else None
    try:
        for depth in _depths(ref):
            want = ref.logits(ids, depth=depth)
            bound, floor = KL_MEAN, TOP1
            if codes:
                fp16 = base.logits(ids, depth=depth)
                bound = max(KL_MEAN_CODES, 2.0 * float(L.kl_rows(fp16, want).mean()))
                own = _top1(fp16, want)
                floor = min(TOP1, own - 2.0 * np.sqrt(own * (1.0 - own) / len(ids)))
            _agree(want, cu.logits(ids, depth=depth),
                   f"{arch} {mode} chunk={chunk} depth={depth}", bound, floor)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)
        if base is not None:
            tinyloop.free_model(base)


@pytest.mark.parametrize("arch", list(MAKERS))
def test_decode_steps_graphs_on_and_off(tlms, arch, monkeypatch):
    """Greedy decode at each depth: the captured step (graphs on) gives the eager step's
    tokens, and the decoded rows (single-position forwards after a prefix) agree with NumPy."""
    path, cfg = tlms[arch]
    ids = _ids(12, cfg["vocab_size"], seed=3)
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ)
    try:
        for depth in _depths(cu):
            toks = {}
            for graphs in ("0", "1"):
                monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", graphs)
                toks[graphs] = cu.generate(ids, max_new_tokens=8, depth=depth,
                                           stop=[]).token_ids
            assert toks["0"] == toks["1"], (arch, depth, toks)
            assert cu.graph_stats()["replays"] >= 1
            seq = np.concatenate([ids, np.asarray(toks["1"], dtype=ids.dtype)])
            pc = cu.prefill(seq[:len(ids)], depth=depth)
            try:
                got = cu.logits(seq, depth=depth, prefix=pc)
            finally:
                pc.release()
            _agree(ref.logits(seq, depth=depth), got, f"{arch} decode depth={depth}")
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


@pytest.mark.parametrize("arch", list(MAKERS))
def test_prefix_cache_and_resume_upgrade(tlms, arch):
    path, cfg = tlms[arch]
    ids = _ids(PROMPT, cfg["vocab_size"], seed=5)
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ, prefill_chunk=8)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ, prefill_chunk=8)
    try:
        top = cu.config.max_depth
        want_top, want_1 = ref.logits(ids, depth=top), ref.logits(ids, depth=1)
        fresh = cu.logits(ids, depth=top)
        _agree(want_top, fresh, f"{arch} fresh")
        pc = cu.prefill(ids[:13], depth=top)
        try:
            _agree(want_top, cu.logits(ids, prefix=pc), f"{arch} prefix cache")
        finally:
            pc.release()
        rh = cu.resume_handle(ids[:21], depth=1, max_depth=top)
        try:
            _agree(want_1, cu.logits(ids, prefix=rh), f"{arch} resume handle depth 1")
            rh.upgrade(top)
            _agree(want_top, cu.logits(ids, prefix=rh), f"{arch} resume handle upgraded")
        finally:
            rh.release()
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


@pytest.mark.parametrize("chunk", [0, 5, 13])
def test_the_sliding_window_is_real_on_cuda(tlms, chunk):
    """The sliding Ouro on CUDA matches NumPy's windowed forward and not the same weights on
    full attention (the window changes the logits far beyond the bound), with prefill chunks
    shorter than, and straddling, the window."""
    path, cfg = tlms["ouro_swa"]
    assert cfg["layer_types"].count("sliding_attention") == 1 and SWA_WINDOW < PROMPT
    ids = _ids(PROMPT, cfg["vocab_size"], seed=7)
    ref = tinyloop.load_model(path, backend="numpy", max_seq_len=SEQ)
    full = tinyloop.load_model(tlms["ouro"][0], backend="numpy", max_seq_len=SEQ)
    cu = tinyloop.load_model(path, backend="cuda", max_seq_len=SEQ, prefill_chunk=chunk)
    try:
        assert cu.config.sliding_window == SWA_WINDOW and cu.config.sliding_layers == (1,)
        top = cu.config.max_depth
        got = cu.logits(ids, depth=top)
        _agree(ref.logits(ids, depth=top), got, f"ouro_swa chunk={chunk}")
        assert float(L.kl_rows(full.logits(ids, depth=top), got).mean()) > 10 * KL_MEAN
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(full)
        tinyloop.free_model(ref)


def test_nanbeige_without_the_boundary_norm_runs_on_cuda_like_numpy(tmp_path):
    """skip_loop_final_norm: a plain llama loop."""
    cfg, t = L.nanbeige_checkpoint(0, skip_loop_final_norm=True)
    L.save(str(tmp_path / "nb"), cfg, t)
    tlm = str(tmp_path / "nb.tlm")
    convert_hf(str(tmp_path / "nb"), tlm, bits=8)
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], 24)
    out = {}
    for backend in ("numpy", "cuda"):
        m = tinyloop.load_model(tlm, backend=backend, max_seq_len=64)
        try:
            out[backend] = m.logits(ids, depth=3)
        finally:
            tinyloop.free_model(m)
    assert L.kl_rows(out["numpy"], out["cuda"]).max() <= 2e-3


def test_a_head_dim_without_a_kernel_is_refused_at_load(tmp_path):
    """Named at load with nothing allocated, not at the first attention call."""
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    cfg = synthetic_config(dict(vocab_size=64, d_model=224, n_heads=2, n_kv_heads=2,
                                head_dim=112, ffn_dim=64, n_prelude=1, n_recurrent=1,
                                n_coda=1, max_depth=2))
    path = str(tmp_path / "hd112.tlm")
    write_synthetic(path, cfg, tokenizer=False)
    pool = get_pool("cuda")
    before = pool.allocated_bytes
    with pytest.raises(errors.ConfigError, match="head_dim=112 has no CUDA attention kernel"):
        tinyloop.load_model(path, backend="cuda", max_seq_len=64)
    assert pool.allocated_bytes == before
