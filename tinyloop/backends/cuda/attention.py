"""Attention over the paged KV cache: decode (T = 1: split-K, kernels/attention_decode.cu, or
the single-pass kernel of kernels/attention.cu), prefill (T > 1: FlashAttention-2 on tensor
cores, kernels/attention_prefill.cu, or attention.cu's scalar kernel) and the store-h modes'
chunked rebuild (kernels/kv_h.cu): a mixin of CudaOps."""

from __future__ import annotations

import math

import numpy as np

from ...errors import ConfigError
from ..base import STEP_POS, Ops
from .checks import _F16, _F32, _aligned, _dev, _fast_ok, _rows, _shape
from .compile import ATTN_HEAD_DIMS, FA_HEAD_DIMS, GEOMETRY, cupy
from .kv import KV_KERNEL_MODES

_DECODE_NAMES = {(m, hd): f"attn_decode_{m}_hd{hd}" for m in KV_KERNEL_MODES
                 for hd in ATTN_HEAD_DIMS}
_PREFILL_NAMES = {(m, hd): f"attn_prefill_{m}_hd{hd}" for m in KV_KERNEL_MODES
                  for hd in ATTN_HEAD_DIMS}
_FA_NAMES = {(m, hd): f"attn_fa_{m}_hd{hd}" for m in KV_KERNEL_MODES for hd in FA_HEAD_DIMS}
_SPLIT_NAMES = {(m, hd): f"attn_split_{m}_hd{hd}" for m in KV_KERNEL_MODES
                for hd in ATTN_HEAD_DIMS}
_DECODE_BATCH_NAMES = {(m, hd): f"attn_decode_batch_{m}_hd{hd}" for m in KV_KERNEL_MODES
                       for hd in ATTN_HEAD_DIMS}
_SPLIT_BATCH_NAMES = {(m, hd): f"attn_split_batch_{m}_hd{hd}" for m in KV_KERNEL_MODES
                      for hd in ATTN_HEAD_DIMS}
_PF_Q = GEOMETRY["attention"]["PF_Q"]
_FA_THREADS = 32 * GEOMETRY["attention_prefill"]["FA_WARPS"]
_FA_Q = 16 * GEOMETRY["attention_prefill"]["FA_WARPS"]    # query rows per block
_DC_THREADS = GEOMETRY["attention"]["DC_THREADS"]
_DS_THREADS = GEOMETRY["attention_decode"]["DS_THREADS"]
_H_THREADS = GEOMETRY["kv_h"]["H_THREADS"]
_KVW_THREADS = GEOMETRY["rope"]["KVW_THREADS"]
_H_ATTN_THREADS_DECODE = GEOMETRY["kv_h"]["H_ATTN_THREADS_DECODE"]
_H_ATTN_THREADS_PREFILL = GEOMETRY["kv_h"]["H_ATTN_THREADS_PREFILL"]
DS_MIN_KEYS = 128       # split-K decode: a split gets at least this many keys of the bucket
DS_MAX_SPLITS = GEOMETRY["attention_decode"]["DS_MAX_SPLITS"]   # ... and at most this many
_DS_TICKETS = 1024      # split-K decode: per-head merge tickets (query heads at most)
# Contexts of at most this many keys run the single-pass decode kernel (attention.cu), not
# split-K: one split there does the single-pass work plus a merge, and the measured
# break-even lies between the 128 and 256 buckets (docs/architecture.md "Split-K decode
# attention"; benchmarks/bench_attn_decode.py's 192 / 256 rows check it).
DS_SINGLE_PASS_MAX = 128
# Blocks per SM the split count may reach: one query row takes up to DS_ROW_BLOCKS_PER_SM (its
# splits then hold one chunk of DS_MIN_KEYS keys each up to DS_MAX_SPLITS * DS_MIN_KEYS keys,
# all loaded at once); a decode batch, whose rows already fill the grid, DS_BATCH_BLOCKS_PER_SM.
DS_ROW_BLOCKS_PER_SM = 8
DS_BATCH_BLOCKS_PER_SM = 2


def decode_splits(ctx: int, n_heads: int, sms: int,
                  blocks_per_sm: int = DS_ROW_BLOCKS_PER_SM) -> int:
    """Split count of the split-K decode attention for a context of ``ctx`` keys, or 0 for
    the single-pass kernel (``ctx <= DS_SINGLE_PASS_MAX``, or a rule outcome of one split:
    one split does the single-pass work plus a combine launch; see DS_SINGLE_PASS_MAX).
    Otherwise from the power-of-two length bucket ``b = max(DS_MIN_KEYS, 2^ceil(log2 ctx))``:
    ``b / DS_MIN_KEYS`` splits, capped so n_heads * splits is about ``blocks_per_sm`` blocks
    per SM (``DS_ROW_BLOCKS_PER_SM`` for one query row, ``DS_BATCH_BLOCKS_PER_SM`` for a
    batch, whose ``n_heads`` counts every row's heads) and at DS_MAX_SPLITS. A function of
    the bucket only, so a captured graph keyed by the bucket (or by the block table's
    capacity, whose ctx it passes) launches a valid grid for every length in it; each split's
    page range is computed on the device from the real length. The one place the split /
    single-pass choice is made."""
    if int(ctx) <= DS_SINGLE_PASS_MAX:
        return 0
    bucket = max(DS_MIN_KEYS, 1 << max(0, int(ctx) - 1).bit_length())
    by_sms = -(-int(blocks_per_sm) * int(sms) // max(1, int(n_heads)))
    ns = max(1, min(DS_MAX_SPLITS, bucket // DS_MIN_KEYS, by_sms))
    return 0 if ns == 1 else ns


def batch_split_bound(rows: int, n_heads: int, sms: int) -> tuple[int, int]:
    """(ticket units, (unit, split) partial pairs) that cover the batched split-K attention
    of any batch of 1..``rows`` rows at any context: B * n_heads units take at most
    max(1, min(DS_MAX_SPLITS, ceil(DS_BATCH_BLOCKS_PER_SM * sms / (B * n_heads)))) splits
    (``decode_splits``'s SM cap, at least one split in the batch kernel)."""
    worst, per_sm = 0, DS_BATCH_BLOCKS_PER_SM
    for b in range(1, int(rows) + 1):
        units = b * int(n_heads)
        worst = max(worst, units * max(1, min(DS_MAX_SPLITS, -(-per_sm * int(sms) // units))))
    return int(rows) * int(n_heads), worst


class AttentionOps:
    """``kv_attention`` / ``kv_attention_step`` of ``base.Ops`` on the device (mixed into
    CudaOps)."""

    @classmethod
    def config_problems(cls, cfg) -> list[str]:
        """``Ops.config_problems``: a head dim with no attention kernel (ATTN_HEAD_DIMS)."""
        if cfg.head_dim not in ATTN_HEAD_DIMS:
            return [f"head_dim={cfg.head_dim} has no CUDA attention kernel (built for "
                    f"{ATTN_HEAD_DIMS})"]
        return []

    def _heads_ok(self, n_heads, n_kv_heads, head_dim, ld):
        key = (n_heads, n_kv_heads, head_dim, ld)
        if key not in self._heads_seen:
            self._check_heads(*key)
            self._heads_seen.add(key)

    @staticmethod
    def _check_heads(n_heads, n_kv_heads, head_dim, ld):
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ConfigError(f"n_heads={n_heads} must be a positive multiple of "
                              f"n_kv_heads={n_kv_heads}")
        if head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"head_dim={head_dim} must be positive and even")
        need = (n_heads + 2 * n_kv_heads) * head_dim
        if ld < need:
            raise ConfigError(f"qkv has {ld} columns, need (n_heads + 2*n_kv_heads)*head_dim "
                              f"= {need}")

    @staticmethod
    def _window_arg(window) -> int:
        """``window`` as the kernels take it (an i64, 0 = full attention). Raises ConfigError
        for anything but an int in 0..2^31-1 (a negative window would read as full attention
        in the kernels' win_lo, a silent change of meaning)."""
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) \
                or not 0 <= int(window) < 2**31:
            raise ConfigError(f"attention window={window!r}: expected an int in 0..2^31-1 "
                              "(positions; 0 = full attention)")
        return int(window)

    def kv_attention(self, qkv, kv, pos0, n_heads, n_kv_heads, head_dim, out, recon=None,
                     window: int = 0):
        """out f16 [T, H hd]: causal GQA attention of the (rotated) Q rows of ``qkv`` over
        positions 0..pos0+T-1 of slot ``kv``, read through its device block table (fp16, or
        int8 dequantized in the inner loop). T = 1: decode kernel; T > 1: prefill, on tensor
        cores (attention_prefill.cu) unless ``attn_prefill == "scalar"``, the head dim is not
        in FA_HEAD_DIMS or the rows do not allow its 4-byte loads (then attention.cu's scalar
        kernel). Store-h modes: K/V rebuilt chunk by chunk through ``recon`` (a kv.cache.Recon
        with the phase-5 scratch; ``_h_attention``), T = 1 and T > 1 alike. ``window`` > 0
        (a sliding-window layer): the query at position p reads keys max(0, p-window+1)..p
        only (``NumpyOps.kv_attention``'s rule), every kernel taking it as an argument; key
        tiles, pages and chunks wholly before every query's window are not read. Raises
        ConfigError for a bad ``window`` (``_window_arg``)."""
        window = self._window_arg(window)
        if not _fast_ok(qkv, _F16, 2):
            _dev(qkv, "qkv", np.float16, 2)
        t, ld = qkv.shape
        self._heads_ok(n_heads, n_kv_heads, head_dim, ld)
        if head_dim not in ATTN_HEAD_DIMS:
            raise ConfigError(f"head_dim={head_dim} has no attention kernel; built for "
                              f"{ATTN_HEAD_DIMS}")
        ctx = int(pos0) + t
        table, p, offs = self._kv_table(kv, ctx)
        out = self._out(out, "out", _F16, t, n_heads * head_dim)
        if kv.layout.stores_h:
            self._h_attention(qkv, kv, int(pos0), n_heads, n_kv_heads, head_dim, out, recon,
                              table, p, offs, window)
            return
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        mode = kv.layout.mode
        if t == 1:
            self._attn_decode(qkv, ctx, 0, table, p, offs, mode, n_heads, n_kv_heads, head_dim,
                              scale_log2, out, window)
        elif (self.kernels.attn_prefill == "mma" and head_dim in FA_HEAD_DIMS and ld % 2 == 0
              and qkv.data.ptr % 4 == 0 and out.data.ptr % 4 == 0 and ctx < 2**30):
            self._fn("attention_prefill", _FA_NAMES[mode, head_dim])(
                (((t + _FA_Q - 1) // _FA_Q) * int(n_heads),), (_FA_THREADS,),
                (qkv.data.ptr, ld, t, int(pos0), table, p, *offs, int(n_heads),
                 int(n_kv_heads), scale_log2, window, self.sms, out.data.ptr))
        else:
            self._fn("attention", _PREFILL_NAMES[mode, head_dim])(
                ((t + _PF_Q - 1) // _PF_Q, int(n_heads)), (4 * _PF_Q,),
                (qkv.data.ptr, ld, t, int(pos0), table, p, *offs, int(n_heads),
                 int(n_kv_heads), scale_log2, window, out.data.ptr))

    @staticmethod
    def _decode_keys(ctx: int, window: int) -> int:
        """The keys one decode query reads in a context of ``ctx``: all of them, or the last
        ``window`` on a sliding-window layer (what the split count is chosen for)."""
        return min(int(ctx), window) if window > 0 else int(ctx)

    def _attn_decode(self, qkv, ctx, step_pos, table, p, offs, mode, n_heads, n_kv_heads,
                     head_dim, scale_log2, out, window=0, splits=None):
        """One query row: split-K (``attn_split_*``: the partials, then the last block of
        each head merges them) or, with ``attn_decode == "v1"`` or when ``decode_splits`` says
        single-pass (short contexts, or a short ``window``: ``_decode_keys``), the
        one-block-per-head kernel. ``step_pos``: 0, or the device address of the int32
        position (ctx = pos + 1 on the device; ``ctx`` is then the table's capacity and only
        picks the split count). ``window``: the layer's sliding window (0 = full attention);
        split-K deals only the window's pages out to the splits, on the device. ``splits``
        forces split-K with that count (tests)."""
        ns = int(splits) if splits is not None else decode_splits(
            self._decode_keys(ctx, window), n_heads, self.sms)
        if self.kernels.attn_decode == "v1" or ns == 0:
            if step_pos:
                raise ConfigError("KernelChoice(attn_decode='v1') reads the context length on the "
                                  "host; the device step state needs the split-K kernel")
            self._fn("attention", _DECODE_NAMES[mode, head_dim])(
                (int(n_heads),), (_DC_THREADS,),
                (qkv.data.ptr, ctx, table, p, *offs, int(n_heads), int(n_kv_heads),
                 scale_log2, window, out.data.ptr))
            return
        if not 1 <= ns <= DS_MAX_SPLITS:
            raise ConfigError(f"decode attention splits={ns}: expected 1..{DS_MAX_SPLITS}")
        if n_heads > _DS_TICKETS:
            raise ConfigError(f"split-K decode attention takes at most {_DS_TICKETS} query "
                              f"heads, got {n_heads}")
        # the scratch: u32 tickets [_DS_TICKETS] (zero between launches: the merging block of
        # each head re-arms its own), then the partials f32 [n_heads, ns, hd + 2]
        need = 4 * _DS_TICKETS + int(n_heads) * ns * (int(head_dim) + 2) * 4
        if need > self._ds_cap:
            if self._ds_blk is not None:
                self.synchronize()
                blk, self._ds_blk, self._ds_ptr, self._ds_cap = self._ds_blk, None, 0, 0
                blk.free()
            self._ds_blk = self._cuda_pool.allocate(need, "scratch")
            self._ds_ptr = self._ds_blk.ptr
            cupy.cuda.runtime.memset(self._ds_ptr, 0, 4 * _DS_TICKETS)
            self._ds_cap = need
        self._fn("attention_decode", _SPLIT_NAMES[mode, head_dim])(
            (int(n_heads), ns), (_DS_THREADS,),
            (qkv.data.ptr, int(ctx), int(step_pos), table, p, *offs, int(n_heads),
             int(n_kv_heads), scale_log2, window, self._ds_ptr + 4 * _DS_TICKETS, self._ds_ptr,
             out.data.ptr))

    def kv_attention_batch(self, qkv, rows, n_heads, n_kv_heads, head_dim, out, window: int = 0,
                           recon=None):
        """``Ops.kv_attention_batch`` in one launch: out f16 [B, H hd], row i the decode
        attention of query row i of ``qkv`` f16 [B, ...] over positions 0..positions[i] of
        its own slot, the position and block-table address read on the device from the
        step's index (``rows.positions_dev`` / ``tables_dev``). Split-K (default): grid
        (n_heads, splits, B) of attention_decode.cu ``attn_split_batch_*``, the split count
        ``decode_splits`` of the longest row's keys over n_heads * B blocks (at least 1: the
        batch rows give the grid its width), each row dealing its own keys to the splits;
        ``KernelChoice(attn_decode="v1")``: grid (n_heads, B) of attention.cu's
        one-block-per-head kernel. ``window`` as in ``kv_attention``. The store-h modes, and
        a BatchSlot without a device index, run the per-row loop of
        ``Ops.kv_attention_batch`` (``recon`` as there). Raises ConfigError for a qkv / out
        of another row count, bad heads, window or index arrays."""
        window = self._window_arg(window)
        lay = rows.layout
        if lay.stores_h or rows.positions_dev is None:
            Ops.kv_attention_batch(self, qkv, rows, n_heads, n_kv_heads, head_dim, out,
                                   window=window, recon=recon)
            return
        b, ld = self._batch_args(qkv, rows, n_heads, n_kv_heads, head_dim)
        if head_dim not in ATTN_HEAD_DIMS:
            raise ConfigError(f"head_dim={head_dim} has no attention kernel; built for "
                              f"{ATTN_HEAD_DIMS}")
        pos, tables = self._batch_ptrs(rows, b)
        out = self._out(out, "out", _F16, b, n_heads * head_dim)
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        args = (qkv.data.ptr, ld, pos, tables, lay.page_size, *lay.kernel_offsets, int(n_heads),
                int(n_kv_heads), scale_log2, window)
        mode, hd = lay.mode, int(head_dim)
        if self.kernels.attn_decode == "v1":
            self._fn("attention", _DECODE_BATCH_NAMES[mode, hd])(
                (int(n_heads), b), (_DC_THREADS,), args + (out.data.ptr,))
            return
        ns = self._batch_splits(int(rows.max_pos) + 1, b, n_heads, window)
        if not 1 <= ns <= DS_MAX_SPLITS:
            raise ConfigError(f"decode attention splits={ns}: expected 1..{DS_MAX_SPLITS}")
        part, tickets = self._batch_split_scratch(b * int(n_heads), ns, hd)
        self._fn("attention_decode", _SPLIT_BATCH_NAMES[mode, hd])(
            (int(n_heads), ns, b), (_DS_THREADS,), args + (part, tickets, out.data.ptr))

    def _batch_splits(self, ctx: int, b: int, n_heads: int, window: int) -> int:
        """The split count of the batched split-K attention (at least 1: the batch rows give
        the grid its width) for a longest context of ``ctx`` keys."""
        keys = self._decode_keys(ctx, window)
        return max(1, int(decode_splits(keys, int(n_heads) * int(b), self.sms,
                                        DS_BATCH_BLOCKS_PER_SM)))

    def batch_attention_key(self, ctx: int, rows: int, n_heads: int, windows) -> tuple:
        """``Ops.batch_attention_key``: the split count ``kv_attention_batch`` launches for
        each window (a function of the context's power-of-two bucket, ``decode_splits``), or
        () for the one-block-per-head kernel, which has none."""
        if self.kernels.attn_decode == "v1":
            return ()
        return tuple(self._batch_splits(ctx, rows, n_heads, w) for w in windows)

    def reserve_decode_batch(self, rows: int, n_heads: int, head_dim: int) -> None:
        """``Ops.reserve_decode_batch``: grow the batched split-K scratch to the most any batch
        of 1..``rows`` rows takes (``batch_split_bound``)."""
        units, partials = batch_split_bound(rows, n_heads, self.sms)
        if units:
            self._batch_split_scratch(units, 1, int(head_dim), partials)

    def _batch_split_scratch(self, units: int, ns: int, head_dim: int,
                             partials: int = 0) -> tuple:
        """(partials, tickets) device addresses of the batched split-K attention for ``units``
        = B * n_heads (row, head) pairs and ``ns`` splits: one pool block (tag ``scratch``,
        held by the backend and grown when a batch needs more; released by ``release``)
        holding u32 tickets [units] (zero between launches: each merging block re-arms its
        own; zeroed when the block is taken) then f32 partials [units, ns, head_dim + 2]
        (room for at least ``partials`` (unit, split) pairs: ``reserve_decode_batch``)."""
        tick = max(-(-4 * units // 16) * 16, 4096, self._dsb_tick)   # 16-byte aligned after
        part_bytes = max(units * ns, int(partials)) * (head_dim + 2) * 4
        if self._dsb_blk is None or tick > self._dsb_tick or tick + part_bytes > self._dsb_cap:
            if self._dsb_blk is not None:
                self.synchronize()                            # no launch still reads it
                blk, self._dsb_blk, self._dsb_cap, self._dsb_tick = self._dsb_blk, None, 0, 0
                blk.free()
            self._dsb_blk = self._cuda_pool.allocate(tick + part_bytes, "scratch")
            cupy.cuda.runtime.memset(self._dsb_blk.ptr, 0, tick)
            self._dsb_cap, self._dsb_tick = tick + part_bytes, tick
        base = self._dsb_blk.ptr
        return base + self._dsb_tick, base

    def _h_attention(self, qkv, kv, pos0, n_heads, n_kv_heads, head_dim, out, recon, table,
                     p, offs, window=0) -> None:
        """Store-h attention (``kv_attention`` for a slot storing h), chunk by chunk so the
        scratch stays bounded: for each chunk of C = ``recon.chunk`` positions c0..c0+n-1 of
        the context 0..pos0+T-1: dequantize its h rows into ``recon_h`` f16 [n, d]
        (kv_h.cu ``h_read_*``: ``numpy_ops.decode_h``), K|V = h @ w_kv.T into
        ``recon_kv`` f16 [n, 2 kv_dim] (``linear``: the GEMM, or the GEMV when n = 1), RoPE
        on its K columns at positions c0.. (rope.cu's Q-only kernel, kv_write's rule), then
        (the K and V bias rows added first when ``recon.bias`` is set),
        ``h_attn_chunk``: every query row against the chunk under the causal mask, the
        online-softmax state carried in ``recon_state`` f32 [>= T, H (hd + 2)] and normalised
        into ``out`` after the last chunk. 4 launches per chunk; the chunks run from the one
        holding the first query's first visible key (``window`` > 0: position
        max(0, pos0 - window + 1); else 0) to ceil((pos0 + T) / C) - 1, counted here on the
        host (so a store-h step is never captured: ``graph_kv_modes``); ``h_attn_chunk``
        masks each row's window inside a chunk. Raises ConfigError without a CUDA Recon (scratch
        missing or too small, a w_kv of the wrong shape)."""
        t, ld = qkv.shape
        lay = kv.layout
        if recon is None or recon.scratch is None:
            raise ConfigError(f"kv mode {lay.mode!r} stores h: attention needs the layer's "
                              "reconstruction (a kv.cache.Recon with the phase-5 scratch)")
        if head_dim > 256 or ld % 2:
            raise ConfigError(f"store-h attention needs head_dim <= 256 and an even qkv row "
                              f"(head_dim={head_dim}, qkv columns={ld})")
        d, kvd, chunk = lay.d_model, int(n_kv_heads) * int(head_dim), int(recon.chunk)
        sc = recon.scratch
        bufs = {}
        for name, dtype, rows, cols in (("recon_h", _F16, chunk, d),
                                        ("recon_kv", _F16, chunk, 2 * kvd),
                                        ("recon_state", _F32, t,
                                         int(n_heads) * (int(head_dim) + 2))):
            arr = sc.get(name) if isinstance(sc, dict) else None
            if arr is None:
                raise ConfigError(f"the reconstruction scratch has no {name!r} (phase 5 of the "
                                  "load plan, plan.recon_plan)")
            if not _fast_ok(arr, dtype, 2, cols, None, True):
                _dev(arr, name, dtype, 2)
                _aligned(arr, name)
                _shape(arr, name, (arr.shape[0], cols))
            bufs[name] = _rows(arr, name, rows)
        hbuf, kvbuf, state = bufs["recon_h"], bufs["recon_kv"], bufs["recon_state"]
        info = self._info(recon.w_kv)
        if (info.n, info.k) != (2 * kvd, d):
            raise ConfigError(f"recon.w_kv has shape {(info.n, info.k)}, expected "
                              f"{(2 * kvd, d)} (the K and V rows of the QKV weight)")
        ctx = int(pos0) + t
        n_chunks = -(-ctx // chunk)
        ci0 = (max(0, int(pos0) - window + 1) if window > 0 else 0) // chunk
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        read = self._fn("kv_h", f"h_read_{lay.mode}")
        rope = self._fn("rope", "kv_write_qonly")
        attn = self._fn("kv_h", "h_attn_chunk")
        nt = _H_ATTN_THREADS_DECODE if t == 1 else _H_ATTN_THREADS_PREFILL
        smem = (nt // 32) * (int(head_dim) + 2) * 4
        for ci in range(ci0, n_chunks):
            c0 = ci * chunk
            n = min(chunk, ctx - c0)
            read((n,), (_H_THREADS,), (table, p, c0, d, *offs[:3], int(lay.outliers),
                                       *lay.outlier_offsets, hbuf.data.ptr))
            self.linear(hbuf[:n], recon.w_kv, kvbuf[:n])
            if getattr(recon, "bias", None) is not None:     # the K and V rows of qkv_bias
                self.add_bias(kvbuf[:n], recon.bias)
            rope((n,), (_KVW_THREADS,), (kvbuf.data.ptr, 2 * kvd, c0, float(recon.theta),
                                         int(n_kv_heads), 0, int(head_dim), 0, p, 0, 0, 0, 0),
                 shared_mem=int(head_dim) * 4)
            attn((t, int(n_heads)), (nt,),
                 (qkv.data.ptr, ld, int(pos0), kvbuf.data.ptr, c0, n, int(n_heads),
                  int(n_kv_heads), int(head_dim), scale_log2, window, state.data.ptr,
                  int(ci == ci0), int(ci == n_chunks - 1), out.data.ptr), shared_mem=smem)

    def kv_attention_step(self, qkv, kv, step, n_heads, n_kv_heads, head_dim, out, recon=None,
                          window: int = 0):
        """``kv_attention`` of one query row over positions 0..step[STEP_POS] (the context
        length read on the device). Split-K (default): the split count comes from the block
        table's capacity (pages per table are in the graph key), each split's page range from
        the device length; ``KernelChoice(attn_decode="v1")``: n_heads blocks whatever the
        length. ``window``: as in ``kv_attention``, a kernel argument, so a captured step
        holds each layer's own."""
        window = self._window_arg(window)
        if kv.layout.stores_h:
            # the chunk count depends on the context length: read it on the host (one
            # synchronisation) and run the eager store-h attention; graphs.DecodeGraphs never
            # captures a store-h step (graph_kv_modes)
            if self._capturing is not None:
                raise ConfigError(f"kv mode {kv.layout.mode!r} cannot be captured: its "
                                  "attention's chunk count is chosen on the host")
            return Ops.kv_attention_step(self, qkv, kv, step, n_heads, n_kv_heads, head_dim,
                                         out, recon, window=window)
        if not _fast_ok(qkv, _F16, 2, None, 1):
            _dev(qkv, "qkv", np.float16, 2)
            _shape(qkv, "qkv", (1, qkv.shape[1]))
        self._heads_ok(n_heads, n_kv_heads, head_dim, qkv.shape[1])
        if head_dim not in ATTN_HEAD_DIMS:
            raise ConfigError(f"head_dim={head_dim} has no attention kernel; built for "
                              f"{ATTN_HEAD_DIMS}")
        table, p, offs = self._step_kv(kv)
        out = self._out(out, "out", _F16, 1, n_heads * head_dim)
        scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        cap = int(kv.table.shape[0]) * kv.layout.page_size
        if self.kernels.attn_decode == "split" and decode_splits(
                self._decode_keys(cap, window), n_heads, self.sms):
            self._attn_decode(qkv, cap, self._step_ptr(step) + 4 * STEP_POS, table, p, offs,
                              kv.layout.mode, n_heads, n_kv_heads, head_dim, scale_log2, out,
                              window)
            return
        self._fn("attention", f"attn_decode_step_{kv.layout.mode}_hd{int(head_dim)}")(
            (int(n_heads),), (_DC_THREADS,),
            (qkv.data.ptr, self._step_ptr(step), table, p, *offs, int(n_heads),
             int(n_kv_heads), scale_log2, window, out.data.ptr))
