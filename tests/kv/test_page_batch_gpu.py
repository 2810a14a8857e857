"""Batched KV page allocation on the CUDA pool (tests/kv/test_page_batch.py is the CPU half):
cudaMemsetAsync per contiguous run zeroes exactly the new pages, and ensure gives the same
block tables as the one-page reference. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest

from tinyloop.backends import cuda_available
from tinyloop.config import ModelConfig
from tinyloop.kv import PageAllocator, PageLayout, RuntimeKVCache
from tinyloop.memory import MemoryPool, packed_scope
from tinyloop.memory.block import contiguous_runs

from ..kv_reference import ensure_one_by_one

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_pools"),
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

SMOL = ModelConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                   ffn_dim=1536, n_prelude=10, n_recurrent=10, n_coda=10, max_depth=4)


@pytest.fixture
def ops():
    from tinyloop.backends.cuda import CudaOps
    return CudaOps()


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_zero_ranges_zeroes_the_batch_and_nothing_else(ops, mode):
    import cupy as cp
    pool = MemoryPool("cuda")
    alloc = PageAllocator(ops, pool)
    lay = PageLayout.for_config(SMOL, mode, 32, np.float16)
    n = 2 * (2 << 20) // lay.page_bytes + 9
    first = alloc.alloc_many(lay, n)
    with packed_scope():
        guard = pool.allocate(4096, "scratch")          # right after the pages: must survive
    guard_arr = guard.array((4096,), np.uint8)
    guard_arr.fill(0x77)
    for p in first:
        p.block.array((lay.page_bytes,), np.uint8).fill(0xA5)
    alloc.unref_many(first)
    again = alloc.alloc_many(lay, n)                    # the same bytes, dirty before
    assert sorted(p.addr for p in again) == sorted(p.addr for p in first)
    runs = contiguous_runs([p.block for p in again])
    assert len(runs) < n // 10                          # one memset per run, not per page
    cp.cuda.get_current_stream().synchronize()
    for p in again:
        assert not bool(p.block.array((lay.page_bytes,), np.uint8).any())
    assert bool((guard_arr == 0x77).all())
    alloc.unref_many(again)
    pool.free(guard)
    assert pool.allocated_bytes == 0


@pytest.mark.parametrize("depth", [1, 4])
def test_ensure_equals_one_by_one_on_the_cuda_pool(ops, depth):
    pool = MemoryPool("cuda")
    alloc = PageAllocator(ops, pool)
    modes = ("fp16",) * SMOL.n_layers
    with RuntimeKVCache(ops, pool, SMOL, depth, 2048, modes, alloc) as warm:
        ensure_one_by_one(warm, 2048)                    # add the segments once
    with RuntimeKVCache(ops, pool, SMOL, depth, 2048, modes, alloc) as ref:
        ensure_one_by_one(ref, 1000)                     # the same two steps as the batch
        ensure_one_by_one(ref, 2048)
        want = ref.table_host.copy()
    with RuntimeKVCache(ops, pool, SMOL, depth, 2048, modes, alloc) as cache:
        cache.ensure(1000)
        cache.ensure(2048)
        assert np.array_equal(cache.table_host, want)
        assert np.array_equal(ops.to_host(cache._table), want)   # one upload, up to date
        assert cache.nbytes == pool.by_tag()["kv_cache"]
    assert pool.allocated_bytes == 0
    pool._check()
