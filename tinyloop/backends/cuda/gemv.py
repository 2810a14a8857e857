"""Decode projections (T = 1) and the linear ops that dispatch between GEMV and GEMM
(kernels/gemv.cu): a mixin of CudaOps.

Three GEMV kernels: v1 (one warp per output row, ``GEMV_WARPS`` rows per block), v2 (a group
of 4 to 32 lanes per row, x staged in shared memory; ``gemv2_geometry``) and tc (INT4 only:
16-row tiles on tensor cores, kernels/gemv_mma.cu ``gemv_tc_*``; ``tc_geometry``). The default
(``KernelChoice.gemv = "auto"``) picks per weight shape from ``GEMV_BY_SHAPE``: tc for INT4
weights of K >= 3072, else v2 for an LM-head-sized weight and v1 for the layer shapes;
``KernelChoice(gemv="tc")`` takes tc wherever the weight is INT4 (docs/architecture.md "GEMV
choice" has the measurements). The RMSNorm ->
projection pairs (``rmsnorm_linear``, ``rmsnorm_linear_swiglu``, ``rmsnorm_lm_head``) are one
launch at T == 1 (``gemv_norm_*``: the GEMV normalizes the FP32 residual row into shared memory
first, bit-identically to ``rmsnorm``) and leave their ``norm`` scratch unwritten; T > 1
composes ``rmsnorm`` with the projection through ``norm``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ...errors import ConfigError
from ...quant import QuantWeight
from ..base import penalized
from .checks import _F16, _F32, _aligned, _dev, _fast_ok, _fp16_of, _log2g, _shape, _rows, _weight
from .choice import GEMV2_THREADS, KernelChoice
from .compile import GEOMETRY, cupy
from .gemm import launch_gemm

_GEMV_ROWS = GEOMETRY["gemv"]["GEMV_WARPS"]
_GEMM_BM, _GEMM_BN = GEOMETRY["gemm"]["BM"], GEOMETRY["gemm"]["BN"]
ROWS_MAX_T = 32         # gemv_rows{R}_*: the most input rows it takes (a decode batch)
ROWS_TILES = (8, 4, 2)  # gemv_rows{R}_*: the row tiles built, largest first
_ROWS_WARPS_PER_SM = 32  # rows_tile: warps per SM that hide the dependent FMA chains
_EW_THREADS = GEOMETRY["elementwise"]["EW_THREADS"]
_MMA_MAX_WARPS = GEOMETRY["gemv_mma"]["MMA_MAX_WARPS"]
MMA_COL_TILES = (1, 2, 4)   # gemv_mma{CT}_*: CT tiles of 8 input rows (T <= 8, 16, 32)
_MMA_SMEM = 48 * 1024       # gemv_mma: the warps' partial sums, under the no-opt-in limit
_NORM_MAX_K = 16384     # gemv_norm_*: the FP16 normalized row (2 K bytes) in dynamic shared
                        # memory, <= 32 KiB (under the 48 KiB a launch gets without opt-in)
_NORM_MAX_N = 1 << 30   # gemv_norm_*: int row index in the kernel
_BLOCKS_PER_SM = 8      # 2048 resident threads per SM / 256-thread GEMV blocks
_TC_WARPS = 8           # gemv_tc_*: warps per block (the RMSNorm prologue is rmsnorm.cu's
                        # 256-thread arithmetic)
_THREADS_PER_SM = 2048
_MAX_BLOCKS_PER_SM = 32
# The decode GEMV per weight (KernelChoice.gemv = "auto", the default): the first row whose
# min_rows <= N, min_k <= K and bits (None: any) match gives (version, v2 lanes per row or None
# = gemv2_geometry's rule). tc for INT4 weights of K >= 3072 (Nanbeige4.2-3B's and Huginn's
# layers and heads, Ouro-1.4B's down projection); v1 for SmolLM2's and Ouro-1.4B's K = 2048
# layer shapes, v2 at 4 lanes per row for an LM-head-sized weight there
# (docs/architecture.md "GEMV choice").
GEMV_BY_SHAPE = ((0, 3072, 4, "tc", None),     # Nanbeige4.2-3B: 8192 x 3072 ... 166k x 3072
                 (16384, 0, None, "v2", 4),    # LM-head sized: 49,152 x 576
                 (0, 0, None, "v1", None))     # every other layer shape


def rows_tile(n: int, t: int, sms: int) -> int:
    """The row tile R of a ``gemv_rows{R}_*`` launch over ``n`` output rows (warps) and
    ``t`` input rows: the largest of ROWS_TILES whose n * ceil(t / R) warps give every SM
    _ROWS_WARPS_PER_SM (each tile re-reads the weight from L2, each warp runs R dependent
    dot-product chains per chunk), else the smallest."""
    for r in ROWS_TILES:
        if n * -(-t // r) >= _ROWS_WARPS_PER_SM * sms:
            return r
    return ROWS_TILES[-1]


def mma_geometry(t: int, k: int, two: bool) -> tuple:
    """(CT, warps, shared bytes) of a ``gemv_mma{CT}_*`` launch over ``t`` input rows of a
    K = ``k`` weight (``two``: SwiGLU's gate and up tiles): the fewest 8-row column tiles
    holding t; one warp per 32-column chunk of K up to _MMA_MAX_WARPS and what the warps'
    partial sums in shared memory (warps * tiles * CT * 128 floats) allow."""
    ct = next(c for c in MMA_COL_TILES if t <= 8 * c)
    per_warp = (2 if two else 1) * ct * 128 * 4
    warps = max(1, min(_MMA_MAX_WARPS, k // 32, _MMA_SMEM // per_warp))
    return ct, warps, warps * per_warp


# gemv_tc_*: dynamic shared memory, at most; without the opt-in a launch gets 48 KiB of static
# and dynamic shared memory together, and the RMSNorm-fused entries hold a static block_sum
# scratch (128 bytes), so 1 KiB stays free for it
_TC_SMEM_MAX = 48 * 1024 - 1024


def tc_geometry(n: int, k: int, two: bool, resident: int) -> tuple:
    """(blocks, dynamic shared memory bytes) of a ``gemv_tc_*`` launch over ``n`` output rows
    (F for SwiGLU, ``two``) of a K = ``k`` weight, with ``resident`` blocks resident at once:
    the kernel gives block b the ceil(tiles / blocks) 16-row tiles from b * that, so the grid
    is the fewest blocks, at most ``resident`` (one wave), that leave none empty. Shared
    memory: x's FP16 pairs (64 bytes a chunk) and chunk sums (4 bytes) for K rounded up to 8
    chunks of 32, and 16 floats per (tile, gate / up, 8-chunk step) of a block; a block holds
    fewer tiles (more blocks) where that would pass ``_TC_SMEM_MAX``."""
    tiles = -(-n // 16)
    cpad = -(-(k // 32) // 8) * 8
    base, per_tile = cpad * 68, (2 if two else 1) * (cpad // 8) * 64
    blocks = max(1, min(tiles, resident))
    tb = min(-(-tiles // blocks), max(1, (_TC_SMEM_MAX - base) // per_tile))
    blocks = -(-tiles // tb)
    return blocks, base + -(-tiles // blocks) * per_tile


def gemv_choice(n: int, k: int, bits: int, kernels: KernelChoice) -> tuple:
    """(version, forced lanes per row or None) of the decode GEMV over an ``n`` x ``k`` weight
    of ``bits`` under ``kernels``: a forced version wins; ``auto`` reads GEMV_BY_SHAPE. A
    forced ``gemv_lpr`` overrides the table's."""
    ver, lpr = kernels.gemv, kernels.gemv_lpr
    if ver == "auto":
        for min_rows, min_k, b, v, l in GEMV_BY_SHAPE:
            if n >= min_rows and k >= min_k and b in (None, bits):
                ver, lpr = v, (lpr if lpr is not None else l)
                break
    return ver, lpr


def gemv2_geometry(n: int, k: int, bits: int, sms: int, lpr: int | None = None,
                   threads: int | None = None, cap_wave: bool = False) -> tuple:
    """(lanes per row, threads per block, blocks) of a v2 GEMV over ``n`` rows of ``k`` inputs.

    Lanes per row: enough that each lane takes at most two 16-byte chunks of the row (the
    loads of a row are then all in flight at once), between 4 and 32. Threads: the largest of
    256 / 128 / 64 that still gives every SM a block (small matrices spread over all ``sms``).
    ``cap_wave``: at most one resident wave of blocks (the RMSNorm-fused kernels, which
    normalize the row once per block and stride over the rest).
    """
    cpr = (k // 2 if bits == 4 else k) // 16
    if lpr is None:
        want = max(1, -(-cpr // 2))
        lpr = min(32, max(4, 1 << (want - 1).bit_length()))
    if threads is None:
        threads = GEMV2_THREADS[0]
        for nt in reversed(GEMV2_THREADS):
            if -(-n * lpr // nt) >= sms:
                threads = nt
                break
    blocks = max(1, -(-n * lpr // threads))
    if cap_wave:
        per_sm = min(_MAX_BLOCKS_PER_SM, _THREADS_PER_SM // threads)
        blocks = min(blocks, sms * per_sm)
    return lpr, threads, blocks


class _WInfo:
    """Launch parameters of one device QuantWeight, validated once (cached weakly per weight)."""

    __slots__ = ("n", "k", "lg", "args", "gemv", "gemv_norm", "gemm", "rows", "bits", "mma",
                 "v2", "lpr", "g2", "g2_norm", "g2_argmax", "geo", "tc", "__weakref__")

    def __init__(self, ops, w):
        _weight(w, "w")
        for name in ("qweight", "scales", "zeros"):
            _dev(getattr(w, name), f"w.{name}", getattr(w, name).dtype, 2)
            _aligned(getattr(w, name), f"w.{name}")
        self.n, self.k = w.shape
        self.lg = _log2g(w)
        self.args = (w.qweight.data.ptr, w.scales.data.ptr, w.zeros.data.ptr)
        b = w.bits
        self.gemv = {e: ops._fn("gemv", f"gemv_q{b}_{e}") for e in ("f16", "resid", "swiglu",
                                                                      "f32")}
        # RMSNorm-fused GEMVs (T = 1); None when K or N is past what the kernel takes, and
        # the pairs then compose rmsnorm + GEMV instead
        self.gemv_norm = ({e: ops._fn("gemv", f"gemv_norm_q{b}_{e}") for e in ("f16", "swiglu",
                                                                                "f32")}
                          if self.k <= _NORM_MAX_K and self.n <= _NORM_MAX_N else None)
        self.gemm = {e: ops._fn("gemm", f"gemm_q{b}_{e}") for e in ("f16", "resid", "f32")}
        self.rows = {(r, e): ops._fn("gemv", f"gemv_rows{r}_q{b}_{e}") for r in ROWS_TILES
                     for e in ("f16", "resid", "swiglu", "f32")}
        self.bits = b
        self.mma = None                           # gemv_mma{CT}_*: built at their first use
        # GEMV v2 (GEMV_BY_SHAPE's pick for LM-head-sized weights but INT4 ones of K >= 3072):
        # needs x in shared memory (K <= _NORM_MAX_K) and int row arithmetic (N * 32 < 2^31);
        # a weight past either runs v1, which takes any shape
        kc = ops.kernels
        ver, lpr = gemv_choice(self.n, self.k, b, kc)
        self.v2 = (ver == "v2" and self.k <= _NORM_MAX_K
                   and self.n * 32 < _NORM_MAX_N)
        self.lpr = self.g2 = self.g2_norm = self.g2_argmax = None
        self.geo: dict = {}                       # (rows, cap_wave) -> (threads, blocks)
        if self.v2:
            self.lpr = gemv2_geometry(self.n, self.k, b, ops.sms, lpr, kc.gemv_threads)[0]
            sfx = f"_l{self.lpr}"
            self.g2 = {e: ops._fn("gemv", f"gemv2_q{b}_{e}{sfx}") for e in ("f16", "resid",
                                                                            "swiglu", "f32")}
            self.g2_norm = {e: ops._fn("gemv", f"gemv2_norm_q{b}_{e}{sfx}")
                            for e in ("f16", "swiglu", "f32")}
            self.g2_argmax = ops._fn("gemv", f"gemv2_norm_q{b}_argmax{sfx}")
        # the tensor-core GEMV (gemv_tc_*): INT4 weights, x staged in shared memory
        # (K <= _NORM_MAX_K), int row arithmetic
        self.tc = None
        if (ver == "tc" and not self.v2 and b == 4 and self.n < _NORM_MAX_N
                and self.k <= _NORM_MAX_K):
            self.tc = {e: ops._fn("gemv_mma", f"gemv_tc_q4_{e}") for e in ("f16", "resid",
                                                                            "swiglu", "f32")}
            for e in ("f16", "swiglu", "f32"):
                self.tc["norm_" + e] = ops._fn("gemv_mma", f"gemv_tc_norm_q4_{e}")

    def geometry(self, ops, rows: int, cap_wave: bool = False) -> tuple:
        """(threads, blocks) of a v2 launch over ``rows`` output rows."""
        _, nt, nb = gemv2_geometry(rows, self.k, 8, ops.sms, self.lpr, ops.kernels.gemv_threads,
                                   cap_wave)
        return nt, nb


class GemvOps:
    """The linear ops of ``base.Ops`` (GEMV at T = 1, ``gemm`` at T > 1) and the RMSNorm-fused
    pairs (mixed into CudaOps)."""

    def _info(self, w) -> _WInfo:
        info = self._winfo.get(w) if isinstance(w, QuantWeight) else None
        if info is None:
            info = _WInfo(self, w)
            self._winfo[w] = info
        return info

    def _act_in(self, x, info, name="x") -> int:
        """Validate activation input x f16 [T, in] against the weight; return T."""
        if not _fast_ok(x, _F16, 2, info.k, None, True):
            _dev(x, name, np.float16, 2)
            _aligned(x, name)
            raise ConfigError(f"w has in_features={info.k}, but the input has {x.shape[1]} "
                              "columns")
        return x.shape[0]

    def _matmul(self, x, w, info, out, epi: str, ldo: int):
        """Launch out (epi: f16 | resid | f32) = x @ W.T; shapes already validated."""
        t = x.shape[0]
        n, k = info.n, info.k
        lg = w.group_size.bit_length() - 1
        if t == 1:
            if info.v2:
                self._gemv2(info, info.g2[epi], n, 0, x, out)
                return
            if info.tc is not None:
                self._gemv_tc(info, epi, n, 0, (x.data.ptr,), out)
                return
            info.gemv[epi](((n + _GEMV_ROWS - 1) // _GEMV_ROWS,), (32 * _GEMV_ROWS,),
                           (*info.args, x.data.ptr, n, k, 0, lg, out.data.ptr))
            return
        if self._rows_path(info, t):
            self._gemv_rows(info, epi, x, t, n, 0, out, ldo)
            return
        w16 = _fp16_of(w)
        if w16 is not None:
            self._cublas(x, w16, out, epi)
            return
        launch_gemm(info, epi, x, t, out, ldo)

    def _rows_path(self, info, t: int) -> bool:
        """Whether a T = ``t`` product runs as a decode batch's GEMV (``gemv_rows{R}_*``:
        each weight row read once per tile of input rows, a warp per output row; or
        ``gemv_mma{CT}_*`` with ``KernelChoice.batch_gemv = "mma"``) instead of the tiled
        GEMM: inside ``decode_batch_scope`` (prefill keeps the GEMM, so a prefix's recomputed
        tail matches a full prefill), 2 <= t <= ROWS_MAX_T, and a GEMM grid under one block
        per SM, whose K loop of dependent tile loads on few blocks is latency-bound. A GEMM
        grid that fills the GPU (the LM head's 49k rows) keeps the GEMM's tensor cores.
        ``batch_gemv = "gemm"`` always takes the GEMM."""
        if not (self._in_batch and 2 <= t <= ROWS_MAX_T and self.kernels.batch_gemv != "gemm"):
            return False
        return -(-info.n // _GEMM_BN) * -(-t // _GEMM_BM) < self.sms

    @contextlib.contextmanager
    def decode_batch_scope(self):
        """``Ops.decode_batch_scope``: products of a few rows run the decode batch's GEMV
        inside (``_rows_path``)."""
        prev, self._in_batch = self._in_batch, True
        try:
            yield
        finally:
            self._in_batch = prev

    def _gemv_rows(self, info, epi: str, x, t: int, rows: int, f: int, out, ldo: int) -> None:
        """Launch ``gemv_rows{R}_*`` (R: ``rows_tile``), or ``gemv_mma{CT}_*``
        (``mma_geometry``) with ``batch_gemv = "mma"``, over x f16 [t, K] (contiguous) into
        ``out`` (rows ``ldo`` elements apart): ``rows`` output rows (F for SwiGLU, with ``f``
        = F)."""
        if self.kernels.batch_gemv == "mma":
            if info.mma is None:
                info.mma = {(c, e): self._fn("gemv_mma", f"gemv_mma{c}_q{info.bits}_{e}")
                            for c in MMA_COL_TILES for e in ("f16", "resid", "swiglu", "f32")}
            ct, warps, smem = mma_geometry(t, info.k, epi == "swiglu")
            info.mma[ct, epi](((rows + 15) // 16,), (32 * warps,),
                              (*info.args, x.data.ptr, info.k, t, rows, info.k, f, info.lg,
                               out.data.ptr, ldo), shared_mem=smem)
            return
        r = rows_tile(rows, t, self.sms)
        info.rows[r, epi](((rows + _GEMV_ROWS - 1) // _GEMV_ROWS, (t + r - 1) // r),
                          (32 * _GEMV_ROWS,),
                          (*info.args, x.data.ptr, info.k, t, rows, info.k, f, info.lg,
                           out.data.ptr, ldo))

    def _geo(self, info, rows: int, cap_wave: bool) -> tuple:
        """(threads, blocks) of a v2 launch, cached per weight; ``_grid_cap`` applied."""
        geo = info.geo.get((rows, cap_wave))
        if geo is None:
            geo = info.geo[(rows, cap_wave)] = info.geometry(self, rows, cap_wave)
        nt, nb = geo
        if self._grid_cap is not None and nb > self._grid_cap:
            nb = self._grid_cap
        return nt, nb

    def _gemv2(self, info, fn, rows: int, f: int, x, out) -> None:
        """Launch a v2 GEMV (x f16 [1, K] staged into shared memory) over ``rows`` rows."""
        nt, nb = self._geo(info, rows, False)
        fn((nb,), (nt,), (*info.args, x.data.ptr, rows, info.k, f, info.lg, out.data.ptr),
           shared_mem=2 * info.k)

    def linear(self, x, w, out):
        """out f16 [T, out] = x f16 [T, in] @ W.T."""
        info = self._info(w)
        t = self._act_in(x, info)
        out = self._out(out, "out", _F16, t, info.n)
        self._matmul(x, w, info, out, "f16", info.n)

    def linear_residual(self, x, w, residual):
        """residual f32 [T, out] += x f16 [T, in] @ W.T."""
        info = self._info(w)
        t = self._act_in(x, info)
        if not _fast_ok(residual, _F32, 2, info.n, t):
            _dev(residual, "residual", np.float32, 2)
            _shape(residual, "residual", (t, info.n))
        self._matmul(x, w, info, residual, "resid", info.n)

    def linear_swiglu(self, x, w, tmp, out):
        """out f16 [T, F] = silu(x @ Wg.T) * (x @ Wu.T); W [2F, in] gate rows then up rows.

        T = 1: one fused GEMV (each warp reads its gate and up rows); a few rows (a decode
        batch, ``_rows_path``): one ``gemv_mma{CT}_q*_swiglu`` or ``gemv_rows{R}_q*_swiglu``
        launch (``KernelChoice.batch_gemv``); else GEMM into ``tmp`` f16 [>= T, 2F], then the
        SwiGLU kernel.
        """
        info = self._info(w)
        t = self._act_in(x, info)
        n2 = info.n
        if n2 % 2:
            raise ConfigError(f"linear_swiglu needs an even out_features (gate|up), got {n2}")
        f = n2 // 2
        out = self._out(out, "out", _F16, t, f)
        if t == 1:
            if info.v2:
                self._gemv2(info, info.g2["swiglu"], f, f, x, out)
                return
            if info.tc is not None:
                self._gemv_tc(info, "swiglu", f, f, (x.data.ptr,), out)
                return
            info.gemv["swiglu"](((f + _GEMV_ROWS - 1) // _GEMV_ROWS,), (32 * _GEMV_ROWS,),
                                (*info.args, x.data.ptr, f, info.k, f,
                                 w.group_size.bit_length() - 1, out.data.ptr))
            return
        if self._rows_path(info, t):
            self._gemv_rows(info, "swiglu", x, t, f, f, out, f)
            return
        tmp = self._out(tmp, "tmp", _F16, t, n2)
        self._matmul(x, w, info, tmp, "f16", n2)
        self._fn("elementwise", "swiglu_f16")(
            ((f + _EW_THREADS - 1) // _EW_THREADS, t), (_EW_THREADS,),
            (tmp.data.ptr, f, out.data.ptr))

    def inject(self, state, e, w, tmp2, tmp1):
        """state f32 [T, d] = [state, e] @ W.T, W [d, 2d]; e f32 or f16 [T, d].

        ``tmp2`` f16 [>= T, 2d] takes the concatenation; ``tmp1`` f16 [>= T, d] is used only
        on the FP16-cache path."""
        _dev(state, "state", np.float32, 2)
        t, d = state.shape
        if not isinstance(e, cupy.ndarray) or e.dtype not in (np.float32, np.float16):
            raise ConfigError(f"e must be a float32 or float16 cupy.ndarray, got "
                              f"{type(e).__name__} {getattr(e, 'dtype', '')}")
        _dev(e, "e", e.dtype, 2)
        _shape(e, "e", (t, d))
        _weight(w, "w", 2 * d)
        info = self._info(w)
        if w.out_features != d:
            raise ConfigError(f"inject weight has out_features={w.out_features}, need d={d}")
        _dev(tmp2, "tmp2", np.float16, 2)
        tmp2 = _rows(tmp2, "tmp2", t)
        _shape(tmp2, "tmp2", (t, 2 * d))
        _aligned(tmp2, "tmp2")
        kern = "concat_inject_f16" if e.dtype == np.float16 else "concat_inject_f32"
        self._fn("elementwise", kern)(
            ((d + _EW_THREADS - 1) // _EW_THREADS, t), (_EW_THREADS,),
            (state.data.ptr, e.data.ptr, d, tmp2.data.ptr))
        if t > 1 and _fp16_of(w) is not None:
            _dev(tmp1, "tmp1", np.float16, 2)
            tmp1 = _rows(tmp1, "tmp1", t)
            _shape(tmp1, "tmp1", (t, d))
            self._cublas_matmul(tmp2, _fp16_of(w).T, out=tmp1)
            self._fn("elementwise", "copy_f16_to_f32")(
                ((t * d + _EW_THREADS - 1) // _EW_THREADS,), (_EW_THREADS,),
                (tmp1.data.ptr, t * d, state.data.ptr))
            return
        self._matmul(tmp2, w, info, state, "f32", d)

    def lm_head(self, x, w, out):
        """out f32 [T, vocab] = x f16 [T, d] @ W.T."""
        info = self._info(w)
        t = self._act_in(x, info)
        out = self._out(out, "out", _F32, t, info.n)
        self._matmul(x, w, info, out, "f32", info.n)

    def resident_blocks(self, fn, threads: int, smem: int) -> int:
        """Blocks of ``fn`` (a launch.Kernel) that are resident on the whole GPU at once with
        ``threads`` threads and ``smem`` bytes of dynamic shared memory (the driver's occupancy
        figure, which counts the kernel's registers). The RMSNorm-fused kernels cap their grid
        there: a block past it would wait for a first-wave block to finish and then normalize
        the row again, where a resident block's warps take the extra rows in their row loop."""
        key = (fn.name, threads, smem)
        n = self._resident.get(key)
        if n is None:
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                fn.raw.kernel.ptr, threads, smem)
            n = self._resident[key] = max(1, min(per_sm, _BLOCKS_PER_SM) * self.sms)
        if self._grid_cap is not None and n > self._grid_cap:
            n = self._grid_cap
        return n

    def _norm_fused(self, x, weight, info) -> bool:
        """True when the pair runs fused: x f32 [1, K], weight f32 [K] on the device and a
        weight the fused kernel takes. T > 1 or a too-large weight: False (compose). A bad
        argument at T == 1 raises with the detailed message."""
        if _fast_ok(x, _F32, 2, info.k, 1) and _fast_ok(weight, _F32, 1, info.k):
            return info.gemv_norm is not None
        _dev(x, "x", np.float32, 2)
        if x.shape[0] != 1:
            return False
        if x.shape[1] != info.k:
            raise ConfigError(f"w has in_features={info.k}, but the input has {x.shape[1]} "
                              "columns")
        _dev(weight, "weight", np.float32, 1)
        _shape(weight, "weight", (info.k,))
        return info.gemv_norm is not None

    def _gemv_tc(self, info, epi: str, rows: int, f: int, xargs: tuple, out) -> None:
        """Launch ``gemv_tc_[norm_]q4_{epi}`` (``xargs``: (x,) for f16 x [1, K] after the
        weight, or (x, weight, eps) before it for the RMSNorm-fused entry) over ``rows`` output
        rows (F for SwiGLU, with ``f`` = F) on ``tc_geometry``'s grid: one wave of resident
        blocks, each with its consecutive tiles."""
        norm = len(xargs) == 3
        fn = info.tc[("norm_" if norm else "") + epi]
        two, threads = epi == "swiglu", 32 * _TC_WARPS
        # the occupancy at one tile a block: the registers, not shared memory, bound it
        resident = self.resident_blocks(fn, threads, tc_geometry(rows, info.k, two, rows)[1])
        blocks, smem = tc_geometry(rows, info.k, two, resident)
        args = (*xargs, *info.args) if norm else (*info.args, *xargs)
        fn((blocks,), (threads,), (*args, rows, info.k, f, info.lg, out.data.ptr),
           shared_mem=smem)

    def _gemv_norm(self, info, epi: str, x, weight, eps, rows: int, f: int, out) -> None:
        if info.tc is not None:
            self._gemv_tc(info, epi, rows, f, (x.data.ptr, weight.data.ptr, float(eps)), out)
            return
        if info.v2:
            nt, nb = self._geo(info, rows, True)
            info.g2_norm[epi]((nb,), (nt,),
                              (x.data.ptr, weight.data.ptr, float(eps), *info.args, rows,
                               info.k, f, info.lg, out.data.ptr), shared_mem=2 * info.k)
            return
        blocks = (rows + _GEMV_ROWS - 1) // _GEMV_ROWS
        cap = self.resident_blocks(info.gemv_norm[epi], 32 * _GEMV_ROWS, 2 * info.k)
        if blocks > cap:
            blocks = cap
        info.gemv_norm[epi]((blocks,), (32 * _GEMV_ROWS,),
                            (x.data.ptr, weight.data.ptr, float(eps), *info.args, rows, info.k,
                             f, info.lg, out.data.ptr), shared_mem=2 * info.k)

    def rmsnorm_linear(self, x, weight, eps, w, out, norm):
        """out f16 [T, n] = rmsnorm(x f32 [T, d], weight) @ W.T.

        T == 1: one fused launch, ``norm`` left unwritten; T > 1: rmsnorm into ``norm``
        f16 [>= T, d], then ``linear``."""
        info = self._info(w)
        if not self._norm_fused(x, weight, info):
            return super().rmsnorm_linear(x, weight, eps, w, out, norm)
        out = self._out(out, "out", _F16, 1, info.n)
        self._gemv_norm(info, "f16", x, weight, eps, info.n, 0, out)

    def rmsnorm_linear_swiglu(self, x, weight, eps, w, tmp, out, norm):
        """out f16 [T, F] = swiglu(rmsnorm(x f32 [T, d], weight) @ W.T), W [2F, d] gate rows
        then up rows.

        T == 1: one fused launch (``tmp`` and ``norm`` unused, ``norm`` left unwritten);
        T > 1: rmsnorm into ``norm``, then ``linear_swiglu`` through ``tmp``."""
        info = self._info(w)
        if not self._norm_fused(x, weight, info):
            return super().rmsnorm_linear_swiglu(x, weight, eps, w, tmp, out, norm)
        n2 = info.n
        if n2 % 2:
            raise ConfigError(f"linear_swiglu needs an even out_features (gate|up), got {n2}")
        f = n2 // 2
        out = self._out(out, "out", _F16, 1, f)
        self._gemv_norm(info, "swiglu", x, weight, eps, f, f, out)

    def rmsnorm_lm_head(self, x, weight, eps, w, out, norm):
        """out f32 [T, vocab] = rmsnorm(x f32 [T, d], weight) @ W.T.

        T == 1: one fused launch, ``norm`` left unwritten; T > 1: rmsnorm into ``norm``,
        then ``lm_head``."""
        info = self._info(w)
        if not self._norm_fused(x, weight, info):
            return super().rmsnorm_lm_head(x, weight, eps, w, out, norm)
        out = self._out(out, "out", _F32, 1, info.n)
        self._gemv_norm(info, "f32", x, weight, eps, info.n, 0, out)

    def rmsnorm_lm_head_sample(self, x, weight, eps, w, out, norm, temperature, top_k, top_p,
                               u, **filters) -> int:
        """The next token id from rmsnorm(x f32 [1, d], weight) @ W.T; the logits land in
        ``out`` f32 [1, vocab] as ``rmsnorm_lm_head`` writes them.

        Greedy (temperature <= 0) with the v2 GEMV: ONE launch: the LM head's blocks each
        reduce their logits to an argmax partial and the last block picks the id (numpy.argmax's
        rule: first NaN, else first maximum) and writes it with the row's fault code to pinned
        host memory, so only 8 bytes cross per step (one stream synchronisation). Otherwise
        ``rmsnorm_lm_head`` then ``sample`` (so with a repetition penalty in ``filters``,
        ``sample``'s ``min_p`` / ``repetition_penalty`` / ``recent_ids``). Raises ConfigError on bad arguments (as those two
        do) and NonFiniteLogitsError for a row ``sample`` would refuse.
        """
        info = self._info(w)
        pen = penalized(filters.get("repetition_penalty", 1.0), filters.get("recent_ids"))
        if (temperature > 0.0 or pen or not info.v2
                or not self._norm_fused(x, weight, info)):
            return super().rmsnorm_lm_head_sample(x, weight, eps, w, out, norm, temperature,
                                                  top_k, top_p, u, **filters)
        out = self._out(out, "out", _F32, 1, info.n)
        self.head_argmax_launch(info, x, weight, eps, out, self._id_ptr)
        cupy.cuda.get_current_stream().synchronize()
        self._raise_on_fault()
        return int(self._id_view[0])

    def head_argmax_launch(self, info, x, weight, eps, out, id_host, id_dev=None) -> None:
        """Queue the fused RMSNorm + LM head + argmax (no synchronisation): the id and the
        row's fault code go to the device ints at ``id_dev`` (default ``self._id_dev``; a
        captured decode step passes its step state) and, when ``id_host`` (a mapped pinned
        int [2]) is non-zero, there too. Arguments already validated; ``info.v2`` must
        hold."""
        nt, nb = self._geo(info, info.n, True)
        if nb > self._part_cap:
            nb = self._part_cap
        info.g2_argmax((nb,), (nt,),
                       (x.data.ptr, weight.data.ptr, float(eps), *info.args, info.n, info.k,
                        info.lg, out.data.ptr, self._part_v, self._part_i, self._ticket,
                        self._id_dev if id_dev is None else id_dev, id_host),
                       shared_mem=2 * info.k)
