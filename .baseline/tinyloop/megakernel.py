"""The persistent decode megakernel's host side (issue 10; ``cuda_src/decode_mega.cu``).

One cooperative launch runs a whole decode step at T = 1 - embedding, every layer slot of the
looped stack, the injections, the final RMSNorm + LM head + argmax - where the captured graph
(``graphs.py``) replays ~7 kernels per layer slot. The kernel reads the same device step state
(token id, position) and writes the same results (logit row, next id + fault code, position
advanced, the 8-byte (id, fault) copy in mapped host memory), so ``graphs.DecodeGraphs.step``
runs it in place of a replay, over the same fixed-address block tables of its key's entry.

What the host builds (int64 words; the layout constants below are decode_mega.cu's ``MK_*``):

- **program** ``[n_ops, OP_WORDS]`` per graph key (depth, KV modes, page size, pages): one op
  per layer slot (``OP_LAYER``: layer index, the slot's block-table pointer, page size, KV mode
  code, the K / V / K-scale / V-scale byte offsets of a page, attention splits), plus
  ``OP_SAVE_E`` / ``OP_INJECT`` for the injection adapter, in ``stack_schedule``'s order (the
  order of ``Model._stack``);
- **layer records** ``[n_layers, LAYER_WORDS]`` and the **model record** ``[MODEL_WORDS]``
  once per model: norm weight pointers and per weight ``(qweight, scales, zeros, N, K, bits,
  log2 g, lanes per row)`` (``CudaOps.mega_weight_record``);
- **scratch** once per model: attention partials f32 ``[n_heads, DS_MAX_SPLITS, hd + 2]``, the
  LM head's per-block argmax partials ``[blocks]`` (value f32, id i32) and the tickets u32
  ``[2 n_heads + 1 + 2 n_kv_heads]`` (each head's last-split merge, the argmax's last block,
  each QKV head unit's last row: decode_mega.cu MK_TICKETS) and the grid barrier word
  (zeroed once; each barrier adds 2^31 in all, so nothing is re-armed; a second word spare).

All of it is pool memory under tag ``graphs``: it is decode-step machinery with the lifetime
of ``DecodeGraphs`` (made at the first eligible step, freed by its ``release``), like the
captured graphs' block tables beside which it lives; nothing is allocated per step.

Eligibility (``MegaDecode.why_not``): CUDA backend with the kernel family, every slot fp16 or
int8, a head dim the kernel is built for, the staged activations within 48 KiB of shared
memory, cooperative launches supported, split-K decode attention, and ``TINYLOOP_MEGAKERNEL``
not 0. Grid: ``CudaOps.mega_grid`` - the SM count times min(blocks that fit co-resident,
``TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM``); the launch is cooperative (cuLaunchCooperativeKernel),
so a grid past co-residency fails to launch instead of deadlocking in the kernel's grid
barrier. A launch that fails disables the megakernel for the model (one warning naming the
error) and the step runs as the captured graph (or eager, with graphs off).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from .config import megakernel_blocks_per_sm, megakernel_enabled
from .memory import packed_scope

OP_WORDS = 16           # decode_mega.cu MK_OP_WORDS
W_WORDS = 8             # MK_W_WORDS
LAYER_WORDS = 40        # MK_LAYER_WORDS
MODEL_WORDS = 32        # MK_MODEL_WORDS
OP_LAYER, OP_SAVE_E, OP_INJECT = 1, 2, 3
KV_MODE_CODES = {"fp16": 0, "int8": 1}      # common.cuh KV_FP16 / KV_INT8
DS_MAX_SPLITS = 64      # cuda_ops.DS_MAX_SPLITS (the partials' split capacity)


def stack_schedule(n_prelude: int, n_recurrent: int, n_coda: int, depth: int,
                   injects: bool) -> list[tuple]:
    """The ops of one step over the looped stack, in ``Model._stack``'s order: ``("layer",
    layer index, KV slot index)`` for each layer slot (prelude i -> slot i; recurrent
    iteration t, layer j -> slot P + t R + j; coda c -> slot P + R depth + c), ``("save_e",)``
    where the prelude output is kept for the injections and ``("inject",)`` before each
    recurrent iteration (only with ``injects``)."""
    out: list[tuple] = [("layer", i, i) for i in range(n_prelude)]
    if n_recurrent:
        if injects:
            out.append(("save_e",))
        for it in range(depth):
            if injects:
                out.append(("inject",))
            out.extend(("layer", n_prelude + j, n_prelude + it * n_recurrent + j)
                       for j in range(n_recurrent))
    out.extend(("layer", n_prelude + n_recurrent + c, n_prelude + n_recurrent * depth + c)
               for c in range(n_coda))
    return out


def pack_program(schedule, slot_record) -> np.ndarray:
    """int64 ``[len(schedule), OP_WORDS]``: the program of ``schedule`` (``stack_schedule``).
    ``slot_record(slot)`` gives a slot's (block-table pointer, page size, KV mode code, K, V,
    K-scale, V-scale byte offsets, attention splits)."""
    prog = np.zeros((len(schedule), OP_WORDS), np.int64)
    for i, op in enumerate(schedule):
        if op[0] == "layer":
            rec = tuple(int(v) for v in slot_record(op[2]))
            if len(rec) != 8:
                raise ValueError(f"slot record of slot {op[2]} has {len(rec)} fields, need 8")
            prog[i, :3] = (OP_LAYER, op[1], rec[0])
            prog[i, 3:10] = rec[1:]
        else:
            prog[i, 0] = OP_SAVE_E if op[0] == "save_e" else OP_INJECT
    return prog


def pack_layers(layers, weight_record, ptr) -> np.ndarray:
    """int64 ``[n_layers, LAYER_WORDS]``: per layer the attention / FFN norm weight pointers
    (``ptr(array)``) at words 0 and 1 and the weight records (``weight_record(w)``, W_WORDS
    each) of attn_qkv, attn_output, ffn_gate_up, ffn_down at words 8, 16, 24, 32."""
    out = np.zeros((len(layers), LAYER_WORDS), np.int64)
    for i, lw in enumerate(layers):
        out[i, 0], out[i, 1] = ptr(lw.attn_norm), ptr(lw.ffn_norm)
        for j, w in enumerate((lw.attn_qkv, lw.attn_output, lw.ffn_gate_up, lw.ffn_down)):
            out[i, 8 + 8 * j:16 + 8 * j] = weight_record(w)
    return out


def pack_model(embed, head, output_norm, adapter, weight_record, ptr) -> np.ndarray:
    """int64 ``[MODEL_WORDS]``: embedding record (words 0-7), LM head record (8-15), output
    norm pointer (16), injection adapter record (24-31; zeros without one)."""
    out = np.zeros(MODEL_WORDS, np.int64)
    out[0:8] = weight_record(embed)
    out[8:16] = weight_record(head)
    out[16] = ptr(output_norm)
    if adapter is not None:
        out[24:32] = weight_record(adapter)
    return out


def smem_bytes(d_model: int, q_dim: int, ffn_dim: int) -> int:
    """Dynamic shared memory of a launch: the largest FP16 row a block stages (the [x, e]
    concatenation of an injection, the attention output, the SwiGLU output)."""
    return 2 * max(2 * d_model, q_dim, ffn_dim)


def shape_why_not(cfg) -> str | None:
    """Why the model's dims do not fit the kernel (None: they do): whole 16-byte rows for the
    staged attention / SwiGLU outputs, and GQA heads."""
    if cfg.q_dim % 8 or cfg.ffn_dim % 8 or cfg.d_model % 8:
        return (f"d_model={cfg.d_model}, q_dim={cfg.q_dim}, ffn_dim={cfg.ffn_dim} must be "
                "multiples of 8")
    if cfg.n_kv_heads <= 0 or cfg.n_heads % cfg.n_kv_heads:
        return f"n_heads={cfg.n_heads} is not a multiple of n_kv_heads={cfg.n_kv_heads}"
    return None


class _Program:
    """One graph key's program (pool block, tag ``graphs``)."""

    __slots__ = ("prog", "block", "n_ops")

    def __init__(self, prog, block, n_ops):
        self.prog, self.block, self.n_ops = prog, block, n_ops


class MegaDecode:
    """The megakernel of one Model's decode steps (see the module doc); owned by
    ``graphs.DecodeGraphs``, which serialises every call under the Model's lock."""

    def __init__(self, model):
        self._model = model
        self._ops = model.ops
        self._pool = model.pool
        self._blocks: list = []       # layer records, model record, scratch (tag graphs)
        self._arrays: dict = {}
        self.failed: str | None = None  # set when a launch failed: off for this model
        self.launches = 0
        self.blocks = 0               # grid of the last launch
        self.blocks_fit = 0           # blocks per SM that fit (the occupancy)
        # diagnostics (benchmarks/profile_mega.py): the device address of a u64 array that
        # receives block 0's global-timer stamps after the start and every grid barrier of
        # each step (decode_mega.cu mk_stamp); 0 = off
        self.timing_ptr = 0

    # --- policy -----------------------------------------------------------------------------
    def why_not(self, cache) -> str | None:
        """Why a step of ``cache``'s request cannot run as the megakernel (None: it can)."""
        if not megakernel_enabled():
            return "TINYLOOP_MEGAKERNEL=0"
        if self.failed is not None:
            return self.failed
        ops, cfg = self._ops, self._model.config
        modes = getattr(ops, "mega_kv_modes", ())
        if not modes:
            return f"the {ops.name} backend has no megakernel"
        bad = sorted(set(cache.modes) - set(modes))
        if bad:
            return f"KV mode(s) {bad} (the megakernel runs {modes})"
        # the step's tables cover max_seq_len (graphs.DecodeGraphs); at <= DS_SINGLE_PASS_MAX
        # positions the captured step attends with the single-pass kernel, which the
        # megakernel does not carry (it would launch 0 splits: no attention at all)
        cap = -(-self._model.max_seq_len // cache.page_size) * cache.page_size
        if ops.mega_splits(cap, cfg.n_heads) < 2:
            return (f"a {cap}-position block table (the captured step's attention is the "
                    "single-pass kernel there; the megakernel runs split-K only)")
        return shape_why_not(cfg) or ops.mega_why_not(cfg.head_dim, self.smem)

    @property
    def smem(self) -> int:
        cfg = self._model.config
        return smem_bytes(cfg.d_model, cfg.q_dim, cfg.ffn_dim)

    # --- memory -----------------------------------------------------------------------------
    def _ensure(self) -> None:
        """The model-level records and scratch (pool blocks, tag graphs), built once."""
        if self._blocks:
            return
        m, ops, cfg = self._model, self._ops, self._model.config
        rec, ptr = ops.mega_weight_record, (lambda a: a.data.ptr)
        layers = pack_layers(m._layers, rec, ptr)
        model = pack_model(m._embed, m._head, m._output_norm, m._adapter, rec, ptr)
        cap = ops.sms * 32                               # argmax partials: any grid
        parts = [("layers", layers.shape, np.int64), ("model", model.shape, np.int64),
                 ("part", (cfg.n_heads * DS_MAX_SPLITS * (cfg.head_dim + 2),), np.float32),
                 ("amax_v", (cap,), np.float32), ("amax_i", (cap,), np.int32),
                 ("tickets", (2 * cfg.n_heads + 1 + 2 * cfg.n_kv_heads,), np.uint32),
                 ("barrier", (2,), np.uint32)]
        arrays, blocks = {}, []
        try:
            with packed_scope():
                for name, shape, dt in parts:
                    arrays[name], blk = ops.empty(self._pool, shape, dt, "graphs")
                    blocks.append(blk)
            ops.from_host(layers, arrays["layers"])
            ops.from_host(model, arrays["model"])
            ops.zero(arrays["tickets"])
            ops.zero(arrays["barrier"])
        except BaseException:
            for blk in blocks:
                self._pool.free(blk)
            raise
        self._blocks, self._arrays = blocks, arrays

    def prepare(self, ent, cache) -> _Program:
        """The program of ``ent``'s key (its block tables: ``ent.slots``), built once per
        entry into a pool block (tag graphs)."""
        self._ensure()
        ops, cfg, m = self._ops, self._model.config, self._model
        sched = stack_schedule(cfg.n_prelude, cfg.n_recurrent, cfg.n_coda, cache.depth,
                               m.injects)

        def slot_record(s):
            kv = ent.slots[s]
            lay = kv.layout
            cap = int(kv.table.shape[0]) * lay.page_size
            return (kv.table.data.ptr, lay.page_size, KV_MODE_CODES[lay.mode],
                    *lay.kernel_offsets, ops.mega_splits(cap, cfg.n_heads))

        prog = pack_program(sched, slot_record)
        with packed_scope():
            arr, blk = ops.empty(self._pool, prog.shape, np.int64, "graphs")
        try:
            ops.from_host(prog, arr)
        except BaseException:
            self._pool.free(blk)
            raise
        return _Program(arr, blk, len(sched))

    def free_program(self, p: _Program) -> None:
        blk, p.block = p.block, None
        if blk is not None:
            self._pool.free(blk)

    def release(self) -> None:
        """Free the model-level block (after the stream is idle; entries free their own)."""
        blocks, self._blocks, self._arrays = self._blocks, [], {}
        for blk in blocks:
            self._pool.free(blk)

    def nbytes(self) -> int:
        """Pool bytes (tag graphs) of the model-level records and scratch."""
        return sum(b.nbytes for b in self._blocks)

    # --- the step ---------------------------------------------------------------------------
    def launch(self, p: _Program, step, row, host_ptr: int) -> None:
        """Queue one megakernel step over program ``p``: step state ``step`` (int32
        [STEP_WORDS]), residual row ``row`` f32 [1, d]; (id, fault) also to the mapped host
        int32 [2] at ``host_ptr`` (0: not). Raises what the launch raises (nothing queued)."""
        m, ops, cfg, a = self._model, self._ops, self._model.config, self._arrays
        v = m._views(1)
        blocks, fit = ops.mega_grid(cfg.head_dim, self.smem, megakernel_blocks_per_sm())
        e = v["inject"] if "inject" in v else row
        args = (p.prog.data.ptr, p.n_ops, a["layers"].data.ptr, a["model"].data.ptr,
                cfg.d_model, cfg.n_heads, cfg.n_kv_heads, float(cfg.norm_eps),
                float(cfg.rope_theta), math.log2(math.e) / math.sqrt(cfg.head_dim),
                step.data.ptr, int(host_ptr), row.data.ptr, e.data.ptr, v["qkv"].data.ptr,
                v["att"].data.ptr, v["h"].data.ptr, m.logit_row().data.ptr,
                a["part"].data.ptr, a["amax_v"].data.ptr, a["amax_i"].data.ptr,
                a["tickets"].data.ptr, a["barrier"].data.ptr, int(self.timing_ptr))
        ops.mega_launch(cfg.head_dim, blocks, self.smem, args)
        self.launches += 1
        self.blocks, self.blocks_fit = blocks, fit

    def disable(self, exc: BaseException) -> None:
        """Turn the megakernel off for this model after a failed launch (one warning)."""
        self.failed = f"a megakernel launch failed ({type(exc).__name__}: {exc})"
        warnings.warn(f"TinyLoop: {self.failed}; decode steps run as captured graphs",
                      RuntimeWarning, stacklevel=3)

    def stats(self) -> dict:
        return {"launches": self.launches, "blocks": self.blocks,
                "blocks_per_sm_fit": self.blocks_fit, "failed": self.failed}


__all__ = ["MegaDecode", "stack_schedule", "pack_program", "pack_layers", "pack_model",
           "smem_bytes", "shape_why_not", "OP_WORDS", "LAYER_WORDS", "MODEL_WORDS", "W_WORDS"]
