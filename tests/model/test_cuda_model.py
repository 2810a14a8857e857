"""End to end on the GPU: the CUDA backend against the NumPy reference, and its lifecycle.

Figures (agreement, KL, greedy prefixes) are appended as JSON lines to
``$TINYLOOP_REPORT_DIR/gpu_figures.jsonl`` when that variable is set, so the GPU suite can
print them in its summary.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.backends.cuda import KernelChoice
from tinyloop.memory import get_pool

from ..conftest import fail_nth_allocation
from .conftest import SMALL

pytestmark = pytest.mark.gpu


def _report(name: str, **figures) -> None:
    out = os.environ.get("TINYLOOP_REPORT_DIR")
    print(name, figures)
    if out:
        with open(os.path.join(out, "gpu_figures.jsonl"), "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


def _kl_rows(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row from logits, in float64."""
    def logsm(z):
        z = z.astype(np.float64)
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp, lq = logsm(p_logits), logsm(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_real_model_matches_reference(real_model_path, real_text_ids):
    ids = real_text_ids
    assert len(ids) >= 300
    ref = tinyloop.load_model(real_model_path, max_seq_len=len(ids), backend="numpy")
    try:
        want = ref.logits(ids)
    finally:
        tinyloop.free_model(ref)
    for chunk, fp16 in ((0, False), (128, False), (0, True)):
        os.environ["TINYLOOP_FP16_CACHE"] = "1" if fp16 else "0"
        try:
            m = tinyloop.load_model(real_model_path, max_seq_len=len(ids), prefill_chunk=chunk,
                                    backend="cuda")
        finally:
            os.environ.pop("TINYLOOP_FP16_CACHE")
        try:
            got = m.logits(ids)
        finally:
            tinyloop.free_model(m)
        assert np.isfinite(got).all()
        top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
        kl = float(_kl_rows(want, got).mean())
        _report("real_model_vs_reference", positions=len(ids), prefill_chunk=chunk,
                fp16_cache=fp16, top1_agreement=top1, mean_kl=kl)
        assert top1 >= 0.99, (chunk, fp16, top1)
        assert kl <= 2e-3, (chunk, fp16, kl)


def test_real_model_greedy_generations(real_model_path):
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "Explain recursion to a child in one paragraph."]
    cu = tinyloop.load_model(real_model_path, max_seq_len=256, backend="cuda")
    ref = tinyloop.load_model(real_model_path, max_seq_len=256, backend="numpy")
    try:
        prefixes, lengths = [], []
        for p in prompts:
            text = cu.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            a = cu.generate(text, max_new_tokens=40)
            b = ref.generate(text, max_new_tokens=40)
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            prefixes.append(n)
            lengths.append(min(len(a.token_ids), len(b.token_ids)))
            _report("greedy_generation", prompt=p, common_prefix=n, cuda_tokens=len(a.token_ids),
                    cuda_text=a.text, reference_text=b.text)
        # near-ties may flip a late token; most of each generation must agree
        assert sum(prefixes) >= 0.6 * sum(lengths)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("chunk", [0, 7])
def test_synthetic_depths_match_reference(small_path, chunk, fp16, monkeypatch):
    ids = np.random.default_rng(chunk).integers(0, SMALL["vocab_size"], 45)
    ref = tinyloop.load_model(small_path, max_seq_len=64, backend="numpy")
    monkeypatch.setenv("TINYLOOP_FP16_CACHE", "1" if fp16 else "0")
    cu = tinyloop.load_model(small_path, max_seq_len=64, prefill_chunk=chunk, backend="cuda")
    try:
        for depth in (1, 2, 3, 4):
            want, got = ref.logits(ids, depth=depth), cu.logits(ids, depth=depth)
            assert np.isfinite(got).all()
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
            kl = float(_kl_rows(want, got).mean())
            _report("synthetic_vs_reference", model=os.path.basename(small_path), depth=depth,
                    prefill_chunk=chunk, fp16_cache=fp16, rel_err=rel, top1=top1, kl=kl)
            assert rel < 2e-2 and top1 >= 0.95 and kl < 5e-3
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


@pytest.mark.parametrize("kv_mode", ["fp16", "int8"])
def test_synthetic_long_prompt_prefill_kernels_match_reference(small_path, kv_mode):
    """A 300-token prompt (five 64-row q tiles, many key tiles, pages of 32): both prefill
    attention kernels (KernelChoice.attn_prefill mma, the tensor-core default, and scalar) against
    the NumPy reference at depths 1 and 3, in one chunk and in chunks of 100 (pos0 > 0)."""
    ids = np.random.default_rng(11).integers(0, SMALL["vocab_size"], 300)
    ref = tinyloop.load_model(small_path, max_seq_len=320, backend="numpy", kv_mode=kv_mode)
    models = {}
    try:
        for kernel in ("mma", "scalar"):
            for chunk in (0, 100):
                models[kernel, chunk] = tinyloop.load_model(
                    small_path, max_seq_len=320, prefill_chunk=chunk, backend="cuda",
                    kv_mode=kv_mode, kernels=KernelChoice(attn_prefill=kernel))
                assert models[kernel, chunk].ops.kernels.attn_prefill == kernel
        for depth in (1, 3):
            want = ref.logits(ids, depth=depth)
            for (kernel, chunk), cu in models.items():
                got = cu.logits(ids, depth=depth)
                kl = float(_kl_rows(want, got).mean())
                top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
                _report("prefill_kernel_vs_reference", model=os.path.basename(small_path),
                        kv_mode=kv_mode, kernel=kernel, prefill_chunk=chunk, depth=depth,
                        top1=top1, kl=kl)
                assert np.isfinite(got).all() and top1 >= 0.95 and kl < 5e-3, \
                    (kernel, chunk, depth, top1, kl)
    finally:
        for cu in models.values():
            tinyloop.free_model(cu)
        tinyloop.free_model(ref)


def test_synthetic_decode_logits_match_reference(small_path):
    """The cached decode path (T=1 GEMV kernels, decode attention) against the reference."""
    prompt = [5, 17, 250, 3, 99, 100, 101]
    ref = tinyloop.load_model(small_path, max_seq_len=64, backend="numpy")
    cu = tinyloop.load_model(small_path, max_seq_len=64, backend="cuda")
    try:
        seq = list(prompt)
        with cu.new_kv_cache(3, 40) as cache:
            row = cu.logit_row()
            cu.forward(np.array(seq, np.int32), 0, 3, cache)
            for step in range(20):
                cu.head(len(seq) - 1, 1, row)
                got = cu.ops.to_host(row)[0]
                want = ref.logits(seq, depth=3)[-1]
                rel = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert rel < 2e-2, (step, rel)
                nxt = int(np.argmax(want))
                seq.append(nxt)
                cu.forward(np.array([nxt], np.int32), len(seq) - 1, 3, cache)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


def test_fused_greedy_head_matches_head_then_sample(small_path):
    """generate's greedy step (the fused RMSNorm + LM head + argmax launch, only the id read
    back) picks exactly the ids that ``head`` + ``sample`` pick from the same cache."""
    cu = tinyloop.load_model(small_path, max_seq_len=64, backend="cuda")
    try:
        prompt = [5, 17, 250, 3, 99]
        r = cu.generate(prompt, max_new_tokens=24, depth=2)
        assert r.token_ids
        seq = list(prompt)
        with cu.new_kv_cache(2, 64) as cache:
            row = cu.logit_row()
            cu.forward(np.array(seq, np.int32), 0, 2, cache)
            for i, tok in enumerate(r.token_ids):
                cu.head(len(seq) - 1, 1, row)
                nxt = int(cu._ops.sample(row[0], 0.0, 0, 1.0, 0.0))
                assert nxt == tok, (i, nxt, tok)
                seq.append(nxt)
                cu.forward(np.array([nxt], np.int32), len(seq) - 1, 2, cache)
    finally:
        tinyloop.free_model(cu)


def test_sampling_matches_reference_rule(small_path):
    """Same logits + same uniform draws -> same token, for the device sampler and the rule."""
    from tinyloop.backends.numpy_ops import sample_from_logits
    cu = tinyloop.load_model(small_path, max_seq_len=16, backend="cuda")
    try:
        import cupy
        rng = np.random.default_rng(0)
        for trial in range(60):
            logits = (rng.standard_normal(SMALL["vocab_size"]) * 3).astype(np.float32)
            t, k, p = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (0.9, 0, 0.8),
                       (1.3, 50, 0.95)][trial % 5]
            u = float(rng.random())
            want = sample_from_logits(logits, t, k, p, u)
            got = cu.ops.sample(cupy.asarray(logits), t, k, p, u)
            assert got == want, (trial, t, k, p, u)
    finally:
        tinyloop.free_model(cu)


def test_cuda_lifecycle_returns_every_byte(small_path):
    pool = get_pool("cuda")
    before = pool.stats().allocated_bytes
    m = tinyloop.load_model(small_path, max_seq_len=128, prefill_chunk=16, backend="cuda")
    try:
        assert pool.stats().allocated_bytes - before == tinyloop.vram_usage_bytes(m)
        from tinyloop.memory.cupy_hook import cupy_allocator_installed
        assert cupy_allocator_installed()
        m.generate([1, 2, 3], max_new_tokens=8, temperature=0.8, top_k=10, seed=1)
        assert pool.stats().allocated_bytes - before == tinyloop.vram_usage_bytes(m)
        assert pool.stats().by_tag.get("kv_cache", 0) == 0
        requested = {}
        for b in m._blocks:
            requested[b.tag] = requested.get(b.tag, 0) + b.requested_bytes
        from tinyloop.plan import plan_bytes_by_phase
        by_phase = plan_bytes_by_phase(m.plan)
        assert requested["weights"] == by_phase[2]
        assert requested["buffers"] + requested["logits"] == by_phase[4]
    finally:
        tinyloop.free_model(m)
    import gc
    gc.collect()
    assert pool.stats().allocated_bytes == before


def test_freeing_cuda_models_keeps_a_users_own_cupy_install(small_path):
    """Two models share one reference-counted routing; a user's install made while they live
    stays CuPy's allocator after both are freed (the old stack popped it)."""
    import cupy
    from tinyloop.memory.cupy_hook import cupy_allocator_installed
    previous = cupy.cuda.get_allocator()
    m1 = tinyloop.load_model(small_path, max_seq_len=32, backend="cuda")
    m2 = tinyloop.load_model(small_path, max_seq_len=32, backend="cuda")
    user = tinyloop.memory.install_cupy_allocator(tag="scratch")
    try:
        tinyloop.free_model(m1)
        tinyloop.free_model(m2)
        assert user.installed and cupy.cuda.get_allocator() == user.allocate
        x = cupy.ones(1 << 16, dtype=cupy.float32)
        assert get_pool("cuda").by_tag()["scratch"] >= x.nbytes
        del x
    finally:
        user.uninstall()
    assert cupy.cuda.get_allocator() == previous and not cupy_allocator_installed()


@pytest.mark.parametrize("failing_tag", ["weights", "fp16_cache", "buffers"])
def test_cuda_failed_load_each_phase_leaves_nothing(small_path, monkeypatch, failing_tag):
    """An out-of-memory failure injected part-way through each load phase frees everything."""
    pool = get_pool("cuda")
    monkeypatch.setenv("TINYLOOP_FP16_CACHE", "1")
    before = pool.stats().allocated_bytes
    seen = fail_nth_allocation(monkeypatch, pool, failing_tag, 2)
    with pytest.raises(errors.OutOfMemoryError, match="injected"):
        tinyloop.load_model(small_path, max_seq_len=64, backend="cuda")
    monkeypatch.undo()
    assert seen["n"] == 2
    assert pool.stats().allocated_bytes == before


def test_cuda_budget_out_of_memory_leaves_nothing(small_path):
    """A real budget (set_memory_limit) too small for the model: OutOfMemoryError, no residue."""
    pool = get_pool("cuda")
    tinyloop.empty_cache()
    before = pool.stats().allocated_bytes
    old = pool.limit_bytes
    tinyloop.set_memory_limit(pool.stats().reserved_bytes + 64 * 1024, device="cuda")
    try:
        with pytest.raises(errors.OutOfMemoryError) as ei:
            tinyloop.load_model(small_path, max_seq_len=4096, backend="cuda")
        assert ei.value.limit_bytes is not None and ei.value.requested_bytes > 0
    finally:
        tinyloop.set_memory_limit(old, device="cuda")
    assert pool.stats().allocated_bytes == before


def test_cuda_non_finite_logits_name_step_and_position(small_path):
    """A non-finite logit row on the CUDA samplers (the argmax's and the temperature
    sampler's fault code) names the step and position."""
    from ..api.test_sampling import check_non_finite_generation
    check_non_finite_generation(small_path, "cuda")


def test_cuda_exit_with_live_model_is_clean(small_path):
    """A script that ends with a live CUDA model exits without "Exception
    ignored ... sys.meta_path is None"; only the model dropped mid-run warns."""
    from ..api.test_api import check_exit_output, run_exit_script
    check_exit_output(*run_exit_script(small_path, "cuda"))


@pytest.mark.parametrize("mode", ["int8", {"prelude": "fp16", "recurrent": "int8",
                                           "coda": "fp16"}])
def test_kv_modes_match_reference(small_path, mode):
    """A quantized KV mode on CUDA against the same mode on the reference: prefill (logits)
    and the cached decode path across page boundaries (pages of 32; 45 + 20 positions)."""
    ids = np.random.default_rng(9).integers(0, SMALL["vocab_size"], 45)
    ref = tinyloop.load_model(small_path, max_seq_len=80, backend="numpy", kv_mode=mode)
    cu = tinyloop.load_model(small_path, max_seq_len=80, backend="cuda", kv_mode=mode)
    try:
        for depth in (1, 3):
            want, got = ref.logits(ids, depth=depth), cu.logits(ids, depth=depth)
            kl = float(_kl_rows(want, got).mean())
            top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
            _report("kv_mode_vs_reference", model=os.path.basename(small_path), mode=str(mode),
                    depth=depth, top1=top1, kl=kl)
            assert np.isfinite(got).all() and top1 >= 0.95 and kl < 5e-3
        a = cu.generate(list(ids), max_new_tokens=20, depth=3)
        b = ref.generate(list(ids), max_new_tokens=20, depth=3)
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), 20)
        assert n >= 10, (a.token_ids, b.token_ids)
    finally:
        tinyloop.free_model(cu)
        tinyloop.free_model(ref)


def test_real_model_int8_first_request_is_bit_identical(real_model_path, real_text_ids):
    """No page is read before it is written: three identical requests, identical logits."""
    m = tinyloop.load_model(real_model_path, max_seq_len=len(real_text_ids), backend="cuda",
                            kv_mode="int8")
    try:
        runs = [m.logits(real_text_ids[:300]) for _ in range(3)]
    finally:
        tinyloop.free_model(m)
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])
