"""Slow references of the KV cache's batched paths, for tests and benchmarks/bench_pages.py."""

from __future__ import annotations

from tinyloop.errors import ConfigError


def ensure_one_by_one(cache, n_positions: int) -> None:
    """The slow reference of ``RuntimeKVCache.ensure``: slot by slot, one
    ``PageAllocator.alloc`` per page (one pool allocation, one view, one memset each). Gives the
    same pages in the same order as ``ensure`` on a pool in the same state (one layout). It
    fills the cache's own page lists and block tables, as ``ensure`` does."""
    cache.slot(0)                                  # HandleError after release
    if n_positions > cache.capacity:
        raise ConfigError(f"{n_positions} positions exceed the cache's capacity "
                          f"{cache.capacity}")
    need = -(-n_positions // cache.page_size)
    pages_of = cache._pages                        # the lists ensure() appends to
    if need <= len(pages_of[-1]):
        return
    alloc = cache.allocator
    try:
        for s in range(cache.n_slots):
            pages, lay = pages_of[s], cache.layouts[s]
            while len(pages) < need:
                page = alloc.alloc(lay)
                cache.table_host[s, len(pages)] = page.addr
                pages.append(page)
        cache.length = min(need * cache.page_size, cache.capacity)
    finally:
        cache._ops.from_host(cache.table_host, cache._table)
