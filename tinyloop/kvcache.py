"""RuntimeKVCache: the per-request attention cache (the lifecycle and memory contract,
"Per-request memory"; docs/architecture.md).

One pool block (tag ``kv_cache``) holds ``[n_slots, 2, capacity, n_kv_heads, head_dim]``:
for every attention slot (layer, iteration) a K and a V plane of ``capacity`` rows. Slot
indices follow ``docs/architecture.md`` (prelude i -> i; recurrent j at iteration t ->
P + t*R + j; coda c -> P + R*depth + c).

Storage modes (the contract's five): ``"fp16"`` (dense K/V at the backend's KV dtype: float16
on CUDA, float32 on the NumPy reference) is implemented; ``"int8"``, ``"h_fp16"``, ``"h_int8"`` and
``"h_int4"`` are reserved names a later issue implements — asking for them raises ConfigError.
The layout keeps a slot's K and V contiguous so quantized planes (codes + per-row scales) and
store-h planes (the residual ``h`` of a slot instead of K/V) fit as other per-slot views.
"""

from __future__ import annotations

from .config import ModelConfig
from .errors import ConfigError, HandleError
from .plan import request_plan

KV_MODES = ("fp16", "int8", "h_fp16", "h_int8", "h_int4")
IMPLEMENTED_KV_MODES = ("fp16",)


class RuntimeKVCache:
    """K/V planes for ``n_slots`` slots x ``capacity`` positions, owned by one request.

    Use as a context manager or call :meth:`release`; after release any access raises
    HandleError. Raises ConfigError for an unknown or not-yet-implemented ``mode``, and the
    pool's OutOfMemoryError when it does not fit (nothing stays allocated).
    """

    def __init__(self, ops, pool, cfg: ModelConfig, depth: int, capacity: int,
                 mode: str = "fp16"):
        if mode not in KV_MODES:
            raise ConfigError(f"KV cache mode {mode!r} is not one of {KV_MODES}")
        if mode not in IMPLEMENTED_KV_MODES:
            raise ConfigError(f"KV cache mode {mode!r} is not implemented yet "
                              f"(available: {IMPLEMENTED_KV_MODES})")
        if capacity < 1:
            raise ConfigError(f"KV cache capacity must be >= 1, got {capacity}")
        self.mode = mode
        self.depth = depth
        self.capacity = capacity
        self.n_slots = cfg.n_slots(depth)
        (entry,) = request_plan(cfg, capacity, depth, ops.kv_dtype)
        self._data, self._block = ops.empty(pool, entry.shape, entry.dtype, entry.tag)
        self._pool = pool
        # per-slot views made once, so the decode loop only indexes
        self._k = [self._data[s, 0] for s in range(self.n_slots)]   # [capacity, Hkv, hd]
        self._v = [self._data[s, 1] for s in range(self.n_slots)]

    @property
    def nbytes(self) -> int:
        return 0 if self._block is None else self._block.nbytes

    def k(self, slot: int):
        if self._block is None:
            raise HandleError("RuntimeKVCache used after release()")
        return self._k[slot]

    def v(self, slot: int):
        if self._block is None:
            raise HandleError("RuntimeKVCache used after release()")
        return self._v[slot]

    def release(self) -> None:
        """Return the block to the pool (idempotent)."""
        if self._block is not None:
            self._k = self._v = []
            self._data = None
            blk, self._block = self._block, None
            self._pool.free(blk)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
