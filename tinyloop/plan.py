"""Memory plans: every buffer the load and a request will allocate, before anything is allocated.

The same plan feeds ``tinyloop inspect`` and ``load_model`` (llm.c's ``fill_in_parameter_sizes``
then one allocation per entry), so the prediction and the truth cannot drift apart.

Load phases (the lifecycle and memory contract, "Internal allocation phases";
docs/architecture.md):
  1. header parse + format validation      (no device memory)
  2. quantized weight upload               tag "weights"
  3. optional FP16 caches for hot GEMMs    tag "fp16_cache"   (TINYLOOP_FP16_CACHE=1)
  4. BufferPool                            tag "buffers" (+ the lazy ``logit_row``, tag "logits")
  5. optional reconstruction scratch       tag "scratch"      (store-h KV modes: the h rows and
                                                                the rebuilt K|V of one chunk;
                                                                CUDA: the online-softmax state)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig, fp16_cache_enabled
from .format import expected_tensors

PHASES = {2: "weights", 3: "fp16 caches", 4: "buffer pool", 5: "reconstruction scratch"}


@dataclass(frozen=True)
class PlanEntry:
    """One allocation: ``name``, ``shape``, ``dtype`` (numpy name), memory ``tag``, load
    ``phase`` (2..5, or 0 for per-request), and ``lazy`` (allocated on first use)."""

    name: str
    shape: tuple
    dtype: str
    tag: str
    phase: int
    lazy: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def scratch_rows(max_seq_len: int, prefill_chunk: int) -> int:
    """Rows of the FP scratch buffers: prefill_chunk when > 0, else max_seq_len."""
    return min(prefill_chunk, max_seq_len) if prefill_chunk > 0 else max_seq_len


def weight_plan(cfg: ModelConfig, quant_layout: dict[str, tuple[int, int]]) -> list[PlanEntry]:
    """Phase 2 entries. ``quant_layout`` maps each quantized tensor name to (bits, group)."""
    out = []
    for name, (kind, shape) in expected_tensors(cfg).items():
        if kind == "float":
            out.append(PlanEntry(name, shape, "float32", "weights", 2))
            continue
        bits, group = quant_layout[name]
        rows, cols = shape
        qshape = (rows, cols // 2) if bits == 4 else (rows, cols)
        out.append(PlanEntry(name + ".qweight", qshape, "uint8" if bits == 4 else "int8",
                             "weights", 2))
        for part in ("scales", "zeros"):
            out.append(PlanEntry(f"{name}.{part}", (rows, cols // group), "float16",
                                 "weights", 2))
    return out


def hot_gemm_weights(cfg: ModelConfig) -> list[str]:
    """The per-layer projection weights prefill runs through GEMMs (FP16-cache candidates)."""
    return [f"blk.{i}.{n}" for i in range(cfg.n_layers)
            for n in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")]


def fp16_cache_names(cfg: ModelConfig, backend: str) -> list[str]:
    """Weights that get a dequantized cache: the hot GEMM weights on CUDA; every quantized
    weight on the NumPy backend (which otherwise dequantizes on every call)."""
    if backend == "numpy":
        return [n for n, (k, _) in expected_tensors(cfg).items() if k == "quant"]
    return hot_gemm_weights(cfg)


def fp16_cache_plan(cfg: ModelConfig, backend: str) -> list[PlanEntry]:
    """Phase 3 entries: a dense copy (float16 on CUDA, float32 on NumPy) of each cached
    weight."""
    want = expected_tensors(cfg)
    dtype = "float32" if backend == "numpy" else "float16"
    return [PlanEntry(n + ".fp16", want[n][1], dtype, "fp16_cache", 3)
            for n in fp16_cache_names(cfg, backend)]


def buffer_plan(cfg: ModelConfig, max_seq_len: int, prefill_chunk: int,
                act_dtype) -> list[PlanEntry]:
    """Phase 4: the BufferPool.

    - ``main``: float32 residual ``[max_seq_len, d_model]`` (always sequence-wide);
    - ``norm``: act ``[R, d_model]`` (normed rows, and each projection's output);
    - ``scratch1``: act ``[R, max(qkv_dim, 2*ffn_dim, 2*d_model)]`` (QKV, gate|up, [state, e]);
    - ``attn_down``: act ``[R, max(q_dim, ffn_dim)]`` (attention output, SwiGLU output);
    - ``inject``: float32 ``[R, d_model]`` (prelude output; only with injection "adapter");
    - ``ids``: int32 ``[R]`` (token ids of the rows in flight);
    - ``batch_index``: int64 ``[R * (1 + n_slots(max_depth))]`` (a decode batch's device
      index, ``kv.cache.batch_index``: the rows' positions and block-table addresses);
    - ``logit_row``: float32 ``[vocab]`` (lazy: allocated at the first generate call),
    where R = prefill_chunk if prefill_chunk > 0 else max_seq_len.
    """
    act = np.dtype(act_dtype).name
    r = scratch_rows(max_seq_len, prefill_chunk)
    d = cfg.d_model
    out = [PlanEntry("main", (max_seq_len, d), "float32", "buffers", 4),
           PlanEntry("norm", (r, d), act, "buffers", 4),
           PlanEntry("scratch1", (r, max(cfg.qkv_dim, 2 * cfg.ffn_dim, 2 * d)), act,
                     "buffers", 4),
           PlanEntry("attn_down", (r, max(cfg.q_dim, cfg.ffn_dim)), act, "buffers", 4)]
    if cfg.injection == "adapter":
        out.append(PlanEntry("inject", (r, d), "float32", "buffers", 4))
    out.append(PlanEntry("ids", (r,), "int32", "buffers", 4))
    out.append(PlanEntry("batch_index", (r * (1 + cfg.n_slots(cfg.max_depth)),), "int64",
                         "buffers", 4))
    out.append(PlanEntry("logit_row", (1, cfg.vocab_size), "float32", "logits", 4, lazy=True))
    return out


RECON_CHUNK = 256     # positions a store-h attention rebuilds at a time (a multiple of P)


def recon_rows(max_seq_len: int) -> int:
    """Rows of the reconstruction scratch: RECON_CHUNK, or fewer for a short max_seq_len."""
    return min(RECON_CHUNK, max_seq_len)


def recon_plan(cfg: ModelConfig, max_seq_len: int, act_dtype, lazy: bool = False,
               state_rows: int = 0) -> list[PlanEntry]:
    """Phase 5 (store-h KV modes): ``recon_h`` act ``[C, d_model]`` (dequantized h of one
    chunk) and ``recon_kv`` act ``[C, 2 kv_dim]`` (its rebuilt K|V), C = ``recon_rows``; so
    the scratch is bounded whatever the context length. ``state_rows`` > 0 (the CUDA backend,
    whose attention runs one launch per chunk): ``recon_state`` float32
    ``[state_rows, n_heads * (head_dim + 2)]``, the online-softmax state (accumulator, running
    max, sum) of every query row and head carried from chunk to chunk; ``state_rows`` is the
    scratch rows of a prefill chunk (``scratch_rows``). ``lazy``: allocated at the first
    store-h request (the model was loaded without a store-h mode)."""
    act = np.dtype(act_dtype).name
    c = recon_rows(max_seq_len)
    out = [PlanEntry("recon_h", (c, cfg.d_model), act, "scratch", 5, lazy),
           PlanEntry("recon_kv", (c, 2 * cfg.kv_dim), act, "scratch", 5, lazy)]
    if state_rows > 0:
        out.append(PlanEntry("recon_state", (state_rows, cfg.n_heads * (cfg.head_dim + 2)),
                             "float32", "scratch", 5, lazy))
    return out


def load_plan(cfg: ModelConfig, quant_layout: dict, max_seq_len: int, prefill_chunk: int,
              act_dtype, fp16_cache: bool = False, backend: str = "cuda",
              store_h: bool = False) -> list[PlanEntry]:
    """All model-owned allocations, in load order (phases 2..5). ``store_h``: some layer's
    default KV mode stores h (phase 5 allocated at load; else planned lazy)."""
    plan = weight_plan(cfg, quant_layout)
    if fp16_cache:
        plan += fp16_cache_plan(cfg, backend)
    plan += buffer_plan(cfg, max_seq_len, prefill_chunk, act_dtype)
    plan += recon_plan(cfg, max_seq_len, act_dtype, lazy=not store_h,
                       state_rows=(scratch_rows(max_seq_len, prefill_chunk)
                                   if backend == "cuda" else 0))
    return plan


def backend_load_plan(ops, cfg: ModelConfig, quant_layout: dict, max_seq_len: int,
                      prefill_chunk: int, store_h: bool = False) -> list[PlanEntry]:
    """``load_plan`` with a backend's facts: ``ops`` (an Ops instance or class) gives
    ``name``, ``act_dtype`` and ``fp16_cache_default`` (which ``TINYLOOP_FP16_CACHE``
    overrides). What ``load_model`` allocates and ``tinyloop inspect`` prints. ``store_h``:
    a default KV mode stores h (phase 5 allocated at load)."""
    return load_plan(cfg, quant_layout, max_seq_len, prefill_chunk, ops.act_dtype,
                     fp16_cache=fp16_cache_enabled(default=ops.fp16_cache_default),
                     backend=ops.name, store_h=store_h)


LOGIT_BLOCK_ROWS = 128     # rows of the logits block of logits()/score(): 128 x vocab float32


def logits_block_rows(n_tokens: int, max_seq_len: int, prefill_chunk: int) -> int:
    """Rows of the logits block a logits()/score() call over ``n_tokens`` tokens takes: at
    most LOGIT_BLOCK_ROWS, at most one chunk of scratch rows, at most ``n_tokens``."""
    return min(LOGIT_BLOCK_ROWS, scratch_rows(max_seq_len, prefill_chunk), n_tokens)


def request_plan(cfg: ModelConfig, n_tokens: int, depth: int, kv_dtype,
                 logits_rows: int = 0, modes=None, page_size: int | None = None,
                 kv_iterations: str = "all") -> list[PlanEntry]:
    """Per-request allocations: the paged KV cache (tag "kv_cache": the block tables, int64
    ``[slots, pages]``, and ``pages`` pages per slot, uint8 ``[slots * pages, page_bytes]`` for
    a single-mode cache, else one entry per mode) and, for logits()/score(), a float32 logits
    block ``[logits_rows, vocab]`` (tag "logits"). ``modes``: one KV mode per physical layer
    (default all "fp16"); ``kv_iterations``: the iteration KV policy (``slot_layers``)."""
    from .kv.layouts import DEFAULT_PAGE_SIZE, PageLayout, slot_layers
    page_size = page_size or DEFAULT_PAGE_SIZE
    modes = modes or ("fp16",) * cfg.n_layers
    pages = -(-n_tokens // page_size)
    layers = slot_layers(cfg, depth, kv_iterations)
    out = [PlanEntry("kv_block_tables", (len(layers), pages), "int64", "kv_cache", 0)]
    counts: dict = {}
    for li in layers:
        counts[modes[li]] = counts.get(modes[li], 0) + 1
    for mode, n_slots in counts.items():
        lay = PageLayout.for_config(cfg, mode, page_size, kv_dtype)
        out.append(PlanEntry(f"kv_pages_{mode}", (n_slots * pages, lay.page_bytes), "uint8",
                             "kv_cache", 0))
    if logits_rows:
        out.append(PlanEntry("logits", (logits_rows, cfg.vocab_size), "float32", "logits", 0))
    return out


def plan_bytes_by_phase(plan: list[PlanEntry]) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in plan:
        out[e.phase] = out.get(e.phase, 0) + e.nbytes
    return out


def load_phases(plan: list[PlanEntry]) -> list[tuple[int, str, str, int]]:
    """The load's allocations phase by phase, lazy entries left out: ``(phase, label, tag,
    bytes)`` in load order, bytes as the pool takes them (each entry rounded up to 512,
    ``memory.round_size``), tag that of the phase's first entry. What the load checks against
    the pool's room before allocating, and reserves."""
    from .memory.arena import round_size
    out: dict[int, list] = {}
    for e in plan:
        if e.lazy:
            continue
        if e.phase not in out:
            out[e.phase] = [e.phase, PHASES.get(e.phase, f"phase {e.phase}"), e.tag, 0]
        out[e.phase][3] += round_size(e.nbytes)
    return [tuple(v) for _, v in sorted(out.items())]
