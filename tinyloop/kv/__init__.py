"""The KV cache and prefix sharing (docs/architecture.md "Paged KV cache", "Prefix caching").

Layers, lowest first (each imports only those before it):

- ``layouts``: the five storage modes, PageLayout, slot order, ``kv_mode`` resolution;
- ``pages``: Page and the PageAllocator, the only owner of page lifetime (reference and holder
  counts, the ``kv_cache`` / ``prefix_cache`` tag of each page);
- ``cache``: RuntimeKVCache (a request's block tables), SlotKV, DepthView, Recon;
- ``registry``: KVRegistry, a Model's live caches and handles, released when it is freed;
- ``handles``: PrefixCache, ResumeHandle, their storage, loading them from a .tlpx file
  (``tinyloop.tlpx``);
- ``pool``: PrefixPool.

Nothing here runs a request's forward: ``tinyloop.generate`` owns a request and takes its KV
from here.
"""

from .cache import DepthView, Recon, RuntimeKVCache, SlotKV
from .handles import PrefixCache, ResumeHandle
from .layouts import (DEFAULT_PAGE_SIZE, H_MODES, KV_ITERATIONS, PageLayout,
                      kv_bytes_per_token, resolve_kv_modes, room_slots, slot_layers, slot_map)
from .pages import Page, PageAllocator
from .pool import PrefixPool
from .registry import KVRegistry

__all__ = ["DEFAULT_PAGE_SIZE", "H_MODES", "KV_ITERATIONS", "DepthView", "KVRegistry", "Page",
           "PageAllocator", "PageLayout", "PrefixCache", "PrefixPool", "Recon", "ResumeHandle",
           "RuntimeKVCache", "SlotKV", "kv_bytes_per_token", "resolve_kv_modes", "room_slots",
           "slot_layers", "slot_map"]
