"""KV writes into the paged cache (kernels/rope.cu: RoPE + K/V page write; kernels/kv_h.cu:
the store-h modes' h rows; kernels/qkv_rope.cu: RMSNorm + QKV + RoPE + the write in one
launch): a mixin of CudaOps. ``kv`` arguments are ``kv.cache.SlotKV`` (layout + device block
table)."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...kv.layouts import H_MODES
from ..base import STEP_ROPE_MAX, Ops
from .checks import _F16, _F32, _dev, _fast_ok, _rows, _shape
from .compile import GEOMETRY, cupy

KV_KERNEL_MODES = ("fp16", "int8")           # attention.cu / rope.cu instantiate each
# the store-h modes: kv_h.cu writes / reads h; attention rebuilds K|V chunk by chunk through
# the layer's own QKV weight (attention.AttentionOps._h_attention)
H_KERNEL_MODES = H_MODES
H_KERNEL_GROUP, H_KERNEL_ROTATE = 32, (0, 32)   # one warp per group; Hadamard blocks of 32
H_KERNEL_OUTLIERS = GEOMETRY["kv_h"]["H_MAX_OUTLIERS"]   # h_int4 channels a row keeps, at most
_KVW_THREADS = GEOMETRY["rope"]["KVW_THREADS"]
_H_THREADS = GEOMETRY["kv_h"]["H_THREADS"]
_GEMV_ROWS = GEOMETRY["gemv"]["GEMV_WARPS"]


class KVOps:
    """``kv_write`` / ``kv_write_step`` / ``rmsnorm_qkv_kv_step`` of ``base.Ops`` on the device
    (mixed into CudaOps)."""

    def _kv_table(self, kv, ctx: int):
        """Validate a SlotKV for ``ctx`` positions; return (table ptr, P, part offsets)."""
        lay = kv.layout
        if lay.mode not in self.kv_modes:
            raise ConfigError(f"kv mode {lay.mode!r} has no CUDA kernels yet; this backend "
                              f"runs {self.kv_modes}")
        if lay.stores_h and (lay.group_size != H_KERNEL_GROUP
                             or lay.rotate not in H_KERNEL_ROTATE or lay.d_model % 32
                             or lay.outliers > H_KERNEL_OUTLIERS):
            raise ConfigError(f"kv mode {lay.mode!r} with group_size={lay.group_size}, "
                              f"rotate={lay.rotate}, outliers={lay.outliers}, "
                              f"d_model={lay.d_model} has no CUDA kernel: kv_h.cu takes groups "
                              f"of {H_KERNEL_GROUP}, rotations {H_KERNEL_ROTATE}, at most "
                              f"{H_KERNEL_OUTLIERS} outliers and d_model a multiple of 32")
        tab = kv.table
        if not (type(tab) is cupy.ndarray and tab.dtype == np.int64 and tab.ndim == 1
                and tab.flags.c_contiguous):
            _dev(tab, "kv.table", np.int64, 1)
        p = lay.page_size
        if tab.shape[0] * p < ctx:
            raise ConfigError(f"kv.table has {tab.shape[0]} pages of {p} positions, need "
                              f"{ctx} positions")
        if ctx > 0 and not kv.table_host[(ctx - 1) // p]:
            raise ConfigError(f"position {ctx - 1} has no page: call RuntimeKVCache.ensure "
                              "first")
        return tab.data.ptr, p, lay.kernel_offsets

    def kv_write(self, qkv, h, pos0, theta, n_heads, n_kv_heads, head_dim, kv):
        """Rotate Q in place in ``qkv`` f16 [T, >= (H + 2 Hkv) hd] and store positions
        pos0..pos0+T-1 of slot ``kv`` through its block table: rotated K and V (fp16; a
        rotated K beyond FP16's range saturates at its largest finite value), or int8 codes
        with one FP16 scale per (position, KV head) (``quant.quantize_rows_int8(...,
        saturate=True)``'s rule, bit for bit), or (store-h modes) the rows of ``h`` f16
        [>= T, d_model] (``_h_write``; ``h`` is unused in the K/V modes)."""
        if not _fast_ok(qkv, _F16, 2):
            _dev(qkv, "qkv", np.float16, 2)
        t, ld = qkv.shape
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        if head_dim > 256:
            raise ConfigError(f"head_dim={head_dim} > 256: kv_write keeps <= 4 pairs per lane")
        table, p, offs = self._kv_table(kv, int(pos0) + t)
        if kv.layout.stores_h:
            self._h_write(qkv, h, int(pos0), 0, theta, n_heads, n_kv_heads, head_dim, kv,
                          table, p, offs)
            return
        self._fn("rope", f"kv_write_{kv.layout.mode}")(
            (t,), (_KVW_THREADS,),
            (qkv.data.ptr, ld, int(pos0), float(theta), int(n_heads), int(n_kv_heads),
             int(head_dim), table, p, *offs),
            shared_mem=int(head_dim) * 4)

    @staticmethod
    def _batch_ptrs(rows, b: int) -> tuple:
        """The device addresses of a BatchSlot's ``positions_dev`` and ``tables_dev`` (each
        int64 [B], contiguous, on the device); ConfigError naming the bad one otherwise."""
        out = []
        for name in ("positions_dev", "tables_dev"):
            arr = getattr(rows, name)
            if not (type(arr) is cupy.ndarray and arr.dtype == np.int64 and arr.ndim == 1
                    and arr.flags.c_contiguous and arr.shape[0] == b):
                raise ConfigError(f"rows.{name} must be a contiguous device int64 array of "
                                  f"the batch's {b} rows (kv.cache.batch_index), got "
                                  f"{type(arr).__name__} {getattr(arr, 'dtype', '')} "
                                  f"{getattr(arr, 'shape', '')}")
            out.append(arr.data.ptr)
        return tuple(out)

    def _batch_args(self, qkv, rows, n_heads, n_kv_heads, head_dim) -> tuple[int, int]:
        """The checks the batch kernels share (a mode with kernels, qkv f16 2-D with B rows,
        the head counts): (B, qkv's leading dimension). Raises ConfigError naming what is
        wrong."""
        lay = rows.layout
        if lay.mode not in KV_KERNEL_MODES:
            raise ConfigError(f"kv mode {lay.mode!r} has no CUDA kernels yet; this backend "
                              f"runs {self.kv_modes}")
        if not _fast_ok(qkv, _F16, 2):
            _dev(qkv, "qkv", np.float16, 2)
        b = self._batch_rows(qkv, rows)
        ld = qkv.shape[1]
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        return b, ld

    def kv_write_batch(self, qkv, h, rows, theta, n_heads, n_kv_heads, head_dim):
        """``Ops.kv_write_batch`` in one launch (rope.cu ``kv_write_batch_*``, grid B): row i
        of ``qkv`` f16 [B, >= (H + 2 Hkv) hd] is ``kv_write`` at ``rows.positions[i]`` into
        the slot whose block table ``rows.tables_dev[i]`` addresses, the position and address
        read on the device from the step's index (nothing per row on the host). The store-h
        modes, and a BatchSlot built without a device index, run the per-row loop of
        ``Ops.kv_write_batch``. Raises ConfigError for a qkv of another row count, bad heads
        or index arrays."""
        lay = rows.layout
        if lay.stores_h or rows.positions_dev is None:
            Ops.kv_write_batch(self, qkv, h, rows, theta, n_heads, n_kv_heads, head_dim)
            return
        b, ld = self._batch_args(qkv, rows, n_heads, n_kv_heads, head_dim)
        if head_dim > 256:
            raise ConfigError(f"head_dim={head_dim} > 256: kv_write keeps <= 4 pairs per lane")
        pos, tables = self._batch_ptrs(rows, b)
        self._fn("rope", f"kv_write_batch_{lay.mode}")(
            (b,), (_KVW_THREADS,),
            (qkv.data.ptr, ld, pos, float(theta), int(n_heads), int(n_kv_heads),
             int(head_dim), tables, lay.page_size, *lay.kernel_offsets),
            shared_mem=int(head_dim) * 4)

    def _h_write(self, qkv, h, pos0, step_ptr, theta, n_heads, n_kv_heads, head_dim, kv, table,
                 p, offs) -> None:
        """Store-h write of T = qkv rows: Q rotated in place (rope.cu's Q-only write), then
        the rows of ``h`` f16 [>= T, d_model] stored at positions pos0.. (or, with
        ``step_ptr`` != 0, at the device step state's STEP_POS..) in the slot's mode
        (kv_h.cu ``h_write_*``: FP16 copy, or ``numpy_ops.encode_h``'s INT8 / INT4 parts bit
        for bit). Arguments besides ``h`` already validated."""
        t, ld = qkv.shape
        lay = kv.layout
        d = lay.d_model
        if not _fast_ok(h, _F16, 2, d):
            _dev(h, "h", np.float16, 2)
            _shape(h, "h", (h.shape[0], d))
        h = _rows(h, "h", t)
        where = step_ptr if step_ptr else int(pos0)
        self._fn("rope", "kv_write_step_qonly" if step_ptr else "kv_write_qonly")(
            (t,), (_KVW_THREADS,),
            (qkv.data.ptr, ld, where, float(theta), int(n_heads), int(n_kv_heads),
             int(head_dim), 0, p, 0, 0, 0, 0),
            shared_mem=int(head_dim) * 4)
        self._fn("kv_h", f"h_write_{lay.mode}")(
            (t,), (_H_THREADS,),
            (h.data.ptr, d, int(pos0), step_ptr, table, p, d, *offs[:3], int(lay.rotate),
             int(lay.outliers), *lay.outlier_offsets))

    def _step_kv(self, kv) -> tuple:
        mode = kv.layout.mode
        if mode not in self.graph_kv_modes:
            raise ConfigError(f"kv mode {mode!r} has no step kernels; a captured decode step "
                              f"runs {self.graph_kv_modes}")
        # pages for every position a replay may reach are the caller's promise
        # (graphs.DecodeGraphs binds a table covering the request's capacity): check page 0
        return self._kv_table(kv, 1)

    def kv_write_step(self, qkv, h, step, theta, n_heads, n_kv_heads, head_dim, kv):
        """``kv_write`` of one row (qkv f16 [1, >= (H + 2 Hkv) hd]) at the position in the
        device step state ``step`` int32 [STEP_WORDS] (read by the kernel: nothing of the
        position is passed from the host, so a captured launch serves every step)."""
        if not _fast_ok(qkv, _F16, 2, None, 1):
            _dev(qkv, "qkv", np.float16, 2)
            _shape(qkv, "qkv", (1, qkv.shape[1]))
        ld = qkv.shape[1]
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        if head_dim > 256:
            raise ConfigError(f"head_dim={head_dim} > 256: kv_write keeps <= 4 pairs per lane")
        if kv.layout.stores_h:            # the position read on the device, as below
            table, p, offs = self._kv_table(kv, 1)
            self._h_write(qkv, h, 0, self._step_ptr(step), theta, n_heads, n_kv_heads,
                          head_dim, kv, table, p, offs)
            return
        table, p, offs = self._step_kv(kv)
        self._fn("rope", f"kv_write_step_{kv.layout.mode}")(
            (1,), (_KVW_THREADS,),
            (qkv.data.ptr, ld, self._step_ptr(step), float(theta), int(n_heads),
             int(n_kv_heads), int(head_dim), table, p, *offs),
            shared_mem=int(head_dim) * 4)

    def rmsnorm_qkv_kv_step(self, x, weight, eps, w, qkv, step, theta, n_heads, n_kv_heads,
                            head_dim, kv, bias=None) -> bool:
        """``Ops.rmsnorm_qkv_kv_step``: one launch of qkv_rope.cu (RMSNorm + QKV GEMV + RoPE +
        the K/V write at ``step[STEP_POS]``) for an fp16 or int8 slot, with the v1 GEMV the
        pair would use (its RMSNorm-fused kernel), head_dim even and <= STEP_ROPE_MAX, W's
        rows exactly (H + 2 Hkv) hd and ``KernelChoice.fused_qkv_rope`` on; False otherwise
        (nothing launched). Bit for bit the memory ``rmsnorm_linear`` + ``kv_write_step``
        leave; with ``bias`` (f32 [(H + 2 Hkv) hd], ``qkv_bias``) as ``rmsnorm_linear`` +
        ``add_bias`` + ``kv_write_step``."""
        if kv.layout.mode not in ("fp16", "int8") or not self.kernels.fused_qkv_rope:
            return False
        info = self._info(w)
        if info.v2 or info.tc is not None or head_dim % 2 or head_dim > STEP_ROPE_MAX:
            return False
        if info.n != (n_heads + 2 * n_kv_heads) * head_dim or not self._norm_fused(x, weight,
                                                                                  info):
            return False
        out = self._out(qkv, "qkv", _F16, 1, info.n)
        self._heads_ok(n_heads, n_kv_heads, head_dim, out.shape[1])
        if bias is not None and not _fast_ok(bias, _F32, 1, info.n):
            _dev(bias, "bias", np.float32, 1)
            _shape(bias, "bias", (info.n,))
        table, p, offs = self._step_kv(kv)
        fn = self._fn("qkv_rope", f"qkv_rope_step_q{w.bits}_{kv.layout.mode}")
        blocks = min((info.n + _GEMV_ROWS - 1) // _GEMV_ROWS,
                     self.resident_blocks(fn, 32 * _GEMV_ROWS, 2 * info.k))
        fn(
            (blocks,), (32 * _GEMV_ROWS,),
            (x.data.ptr, weight.data.ptr, float(eps), *info.args, info.n, info.k, info.lg,
             out.data.ptr, self._step_ptr(step), float(theta), int(n_heads), int(n_kv_heads),
             int(head_dim), table, p, *offs, self._qkv_ticket,
             0 if bias is None else bias.data.ptr), shared_mem=2 * info.k)
        return True
