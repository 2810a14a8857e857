"""The memory pool on a GPU: the cuda arena, driver figures, the budget, and CuPy's own
allocations routed through the pool. Skipped without CUDA."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import tinyloop.memory as mem
from tinyloop.backends import cuda_available
from tinyloop.errors import OutOfMemoryError

MiB = 1 << 20

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_pools"),
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]


def test_cuda_blocks_are_cupy_views_of_their_own_bytes():
    import cupy as cp
    pool = mem.get_pool("cuda")
    a = pool.allocate(1000 * 4, "buffers")
    b = pool.allocate(3 * MiB, "kv_cache")
    x = a.array((10, 100), np.float32)
    assert isinstance(x, cp.ndarray) and x.data.ptr == a.ptr and a.ptr % 512 == 0
    x[...] = cp.arange(1000, dtype=cp.float32).reshape(10, 100)
    y = b.array((3 * MiB,), np.uint8)
    y.fill(7)
    cp.cuda.Device().synchronize()
    assert float(x.sum()) == float(np.arange(1000).sum()) and int(y[-1]) == 7
    s = mem.memory_stats()                       # the cuda pool exists: it is the default
    assert s.device == "cuda" and s.allocated_bytes == 4096 + 3 * MiB
    assert s.device_total_bytes >= s.device_free_bytes > 0
    free, total = cp.cuda.runtime.memGetInfo()
    assert s.device_total_bytes == total
    assert "unattributed" in mem.memory_report()
    a.free()
    b.free()


def test_cuda_empty_cache_returns_memory_to_the_driver():
    import cupy as cp
    pool = mem.get_pool("cuda")
    keep = pool.allocate(MiB, "weights")
    pool.allocate(256 * MiB, "kv_cache").free()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    reserved = mem.memory_stats("cuda").reserved_bytes
    released = mem.empty_cache("cuda")
    assert released == 256 * MiB
    assert mem.memory_stats("cuda").reserved_bytes == reserved - released
    assert cp.cuda.runtime.memGetInfo()[0] >= free_before + 200 * MiB
    assert mem.memory_stats("cuda").allocated_bytes == keep.nbytes
    keep.free()


def test_cuda_limit_and_device_oom_raise_ours():
    pool = mem.get_pool("cuda")
    mem.set_memory_limit(64 * MiB, "cuda")
    with pytest.raises(OutOfMemoryError) as ei:
        pool.allocate(100 * MiB, "kv_cache")
    e = ei.value
    assert (e.limit_bytes, e.tag, e.device) == (64 * MiB, "kv_cache", "cuda")
    assert e.device_free_bytes > 0
    mem.set_memory_limit(None, "cuda")
    import cupy as cp
    total = cp.cuda.runtime.memGetInfo()[1]
    with pytest.raises(OutOfMemoryError) as ei:    # larger than the device: cudaMalloc fails
        pool.allocate(2 * total, "weights")
    assert ei.value.limit_bytes is None
    assert mem.memory_stats("cuda").allocated_bytes == 0


def test_cupy_temporaries_go_through_the_pool_and_the_allocator_is_restored():
    import cupy as cp
    pool = mem.get_pool("cuda")
    previous = cp.cuda.get_allocator()
    with mem.install_cupy_allocator():
        x = cp.arange(1 << 20, dtype=cp.float32)     # 4 MiB
        y = cp.exp(x) + 1
        assert pool.by_tag()["cupy"] >= 8 * MiB
        assert pool.allocate(10).tag == "other"
        ptrs = {b["address"] for s in pool.layout() for b in s["blocks"] if b["tag"] == "cupy"}
        assert x.data.ptr in ptrs and y.data.ptr in ptrs
        del x, y
        gc.collect()
        assert pool.by_tag()["cupy"] == 0
        z = cp.ones(1000)
    assert cp.cuda.get_allocator() == previous
    assert pool.by_tag()["cupy"] > 0                # z outlives the install...
    del z
    gc.collect()
    assert pool.stats().by_tag["cupy"] == 0         # ...and returns to the pool when dropped
    assert not mem.uninstall_cupy_allocator()


def test_cuda_snapshot_has_device_index(tmp_path):
    pool = mem.get_pool("cuda")
    blk = pool.allocate(5 * MiB, "weights")
    snap = mem.export_snapshot(tmp_path / "cuda.pickle", "cuda")
    dev = pool.device_index
    assert all(s["device"] == dev for s in snap["segments"])
    assert any(e["action"] == "alloc" and e["category"] == "weights"
               for e in snap["device_traces"][dev])
    blk.free()


# --- every byte named: the backend's scratch in the pools, the driver's bytes by NVML --------
NVML_GRANULARITY = 2 * MiB        # NVML reports a process's device memory in 2 MiB steps


@pytest.fixture(scope="module")
def smol_dims_path(tmp_path_factory):
    """A synthetic model with SmolLM2-135M's attention and FFN shapes, fewer layers."""
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    path = tmp_path_factory.mktemp("gpu_mem") / "smol_dims.tlm"
    write_synthetic(path, synthetic_config(vocab_size=4096, d_model=576, n_heads=9,
                                           n_kv_heads=3, head_dim=64, ffn_dim=1536,
                                           n_prelude=1, n_recurrent=2, n_coda=1,
                                           max_depth=4), seed=7)
    return str(path)


def test_backend_scratch_is_pool_memory_under_its_tag(smol_dims_path):
    """The CUDA backend's own buffers (argmax partials and tickets, the mapped id words, the
    split-K partials, the sampler's scratch) are blocks of the cuda and pinned pools under tag
    scratch, counted in vram_usage_bytes and returned by free_model."""
    import tinyloop
    cuda, pinned = mem.get_pool("cuda"), mem.get_pool("pinned")
    c0, p0 = cuda.stats().allocated_bytes, pinned.stats().allocated_bytes
    m = tinyloop.load_model(smol_dims_path, max_seq_len=512, backend="cuda")
    try:
        own = m.ops.scratch_bytes(cuda)
        assert own > 0 and cuda.by_tag()["scratch"] == own
        assert pinned.by_tag()["scratch"] == m.ops.scratch_bytes(pinned) >= 40
        m.generate(list(range(1, 300)), max_new_tokens=4)                  # split-K partials
        m.generate([1, 2, 3], max_new_tokens=4, temperature=0.8, seed=1)   # sampler scratch
        grown = m.ops.scratch_bytes(cuda)
        assert grown >= own + 8 * m.config.vocab_size
        assert cuda.by_tag()["scratch"] == grown
        assert cuda.stats().allocated_bytes - c0 == tinyloop.vram_usage_bytes(m)
    finally:
        tinyloop.free_model(m)
    assert cuda.stats().allocated_bytes == c0 and pinned.stats().allocated_bytes == p0
    assert m.ops.scratch_bytes(cuda) == 0


_EVERY_BYTE = """
import json, sys
import tinyloop, tinyloop.memory as mem
m = tinyloop.load_model(sys.argv[1], max_seq_len=1024, backend="cuda")
ids = list(range(1, 200))
m.generate(ids, max_new_tokens=16)                                 # graphs
m.generate(ids, max_new_tokens=8, temperature=0.7, seed=3)         # sampled steps
m.logits(ids[:64])
s = mem.memory_stats("cuda")
print(json.dumps({"process": s.process_bytes, "reserved": s.reserved_bytes,
                  "lines": s.driver_bytes, "unattributed": s.unattributed_bytes,
                  "report": mem.memory_report("cuda")}))
tinyloop.free_model(m)
"""


def _check_every_byte_named(path):
    """In a fresh process (so the context, modules and cuBLAS are first used there), with
    the FP16 caches on (prefill through cuBLAS too): every line is measured and what is left
    unattributed is within 2 MiB plus NVML's granularity of 0."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "TINYLOOP_FP16_CACHE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _EVERY_BYTE, path], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["process"] is None:
        pytest.skip("NVML does not show this process (no pynvml, or a PID namespace)")
    lines, report = got["lines"], got["report"]
    assert lines["cuda context"] > 0 and lines["kernel modules"] > 0, report
    assert lines["cublas workspace"] > 0, report
    assert got["unattributed"] == got["process"] - got["reserved"] - sum(lines.values())
    assert abs(got["unattributed"]) <= 2 * MiB + NVML_GRANULARITY, report
    for label in ("cuda context", "kernel modules", "cublas workspace", "cuda graphs",
                  "unattributed"):
        assert label in report


def test_every_byte_is_named_after_a_real_load_and_generate(real_model_path):
    _check_every_byte_named(real_model_path)


def test_every_byte_is_named_on_smollm2_dims(smol_dims_path):
    _check_every_byte_named(smol_dims_path)
