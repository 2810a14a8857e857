"""KernelChoice: which CUDA kernel variant each op runs, as a validated argument.

The variants are for tests and benchmarks (``load_model(..., kernels=KernelChoice(...))``);
the defaults are the product's paths. A variant named here that a default path also takes
for some shapes (GEMV v1 / v2, the single-pass decode attention, the scalar prefill) says in
its field's description when the default takes it.
"""

from __future__ import annotations

import dataclasses

from ...errors import ConfigError

GEMV_VERSIONS = ("auto", "v1", "v2", "tc")
GEMV2_LPR = (4, 8, 16, 32)        # lanes per row the v2 kernels are built for
GEMV2_THREADS = (64, 128, 256)    # v2 block sizes (norm_row_v256 needs a divisor of 256)
ATTN_DECODE_VERSIONS = ("split", "v1")      # split-K (default) | single-pass at every length
ATTN_PREFILL_VERSIONS = ("mma", "scalar")   # tensor cores (default) | FP32 at every T > 1
SAMPLERS = ("fast", "reference")            # grid + candidates (default) | one block, whole row
BATCH_GEMVS = ("rows", "mma", "gemm")       # a decode batch's products: see KernelChoice


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which CUDA kernel variant each op runs: an argument of ``load_model`` / ``Model``
    (``kernels=``) and of ``CudaOps`` for tests and benchmarks; the defaults are the product's
    paths. Validated on construction (ConfigError naming the field).

    ``gemv``: the decode GEMV (T = 1): ``auto`` (per weight shape, GEMV_BY_SHAPE), or ``v1``
    (one warp per row) / ``v2`` (lanes per row, x in shared memory) / ``tc`` (16-row tiles on
    tensor cores, INT4 weights; INT8 ones run v1) for every shape.
    ``gemv_lpr``: 4 | 8 | 16 | 32 forces v2's lanes per row (None: per shape,
    ``gemv2_geometry``); ``gemv_threads``: 64 | 128 | 256 forces its block size (None: per
    shape). ``attn_decode``: ``split`` (split-K, attention_decode.cu; contexts of at most
    DS_SINGLE_PASS_MAX keys run the single-pass kernel, ``decode_splits``) or ``v1`` (the
    single-pass kernel of attention.cu, one block per query head, at every length).
    ``attn_prefill``: ``mma`` (FlashAttention-2 on tensor cores, attention_prefill.cu; head
    dims outside FA_HEAD_DIMS or rows without 4-byte alignment run the scalar kernel) or
    ``scalar`` (attention.cu's FP32 kernel at every T > 1). ``fused_qkv_rope``: in a decode
    step with fp16 / int8 pages and the v1 QKV GEMV, RMSNorm + QKV + RoPE + the K/V write as
    one kernel (qkv_rope.cu; False: the fused RMSNorm-GEMV then kv_write_step, its
    reference). ``pdl``: capture the decode step's kernels with programmatic dependent
    launch on GPUs of compute capability 9.0+ (False: plain launches; eager launches never
    use it). ``sampler``: the temperature sampler of sample.cu: ``fast`` (a grid over the
    row, then one block on the candidates; it runs the reference itself where the candidates
    cannot settle the pick) or ``reference`` (one block over the whole row, ``sample_step``);
    both pick the same id. ``batch_gemv``: how a decode batch's products of 2 to
    ``gemv.ROWS_MAX_T`` input rows whose GEMM grid would not fill the GPU run: ``mma``
    (the default; ``gemv_mma{CT}_*``: the codes on tensor cores against the rows as MMA
    columns, within FP32 rounding of ``rows``), ``rows`` (``gemv_rows{R}_*``: the T = 1 v1 GEMV
    per output row over every input row, each row equal to that row alone bit for bit where
    the row alone runs v1, i.e. not for INT4 weights of K >= 3072, which run tc alone) or
    ``gemm`` (the tiled GEMM, their reference).
    """

    gemv: str = "auto"
    gemv_lpr: int | None = None
    gemv_threads: int | None = None
    attn_decode: str = "split"
    attn_prefill: str = "mma"
    fused_qkv_rope: bool = True
    pdl: bool = True
    sampler: str = "fast"
    batch_gemv: str = "mma"

    def __post_init__(self):
        for name, allowed in (("gemv", GEMV_VERSIONS), ("attn_decode", ATTN_DECODE_VERSIONS),
                              ("attn_prefill", ATTN_PREFILL_VERSIONS), ("sampler", SAMPLERS),
                              ("batch_gemv", BATCH_GEMVS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"KernelChoice.{name}={getattr(self, name)!r}: expected one "
                                  f"of {allowed}")
        for name, allowed in (("gemv_lpr", GEMV2_LPR), ("gemv_threads", GEMV2_THREADS)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  or v not in allowed):
                raise ConfigError(f"KernelChoice.{name}={v!r}: expected None or one of "
                                  f"{allowed}")
        for name in ("fused_qkv_rope", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"KernelChoice.{name}={getattr(self, name)!r}: expected "
                                  "True or False")

    @classmethod
    def of(cls, kernels) -> "KernelChoice":
        """``kernels`` itself, or the defaults for None; ConfigError for anything else."""
        if kernels is None:
            return cls()
        if not isinstance(kernels, cls):
            raise ConfigError(f"kernels must be a KernelChoice or None, got "
                              f"{type(kernels).__name__}")
        return kernels
