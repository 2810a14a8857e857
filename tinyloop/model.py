"""Model: the load phases, the BufferPool, and the looped forward written once over the ops.

Implements the TinyLoop lifecycle and memory contract (docs/architecture.md): load_model /
free_model / vram_usage_bytes and the five load phases.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from . import plan as planmod
from .backends import get_ops
from .backends.base import LOGIT_FAULTS, non_finite_logits, penalized, sample_filters
from .config import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_REPEAT_LAST_N, check_load_args,
                     cuda_graphs_enabled,
                     kv_mode_from_env)
from .errors import (ArtificialLoopWarning, ConfigError, FormatError, ModelFreedError,
                     TinyLoopError, TokenizerError)
from .format import read_tlm
from .generate import generate as _generate
from .generate import score as _score
from .generate import stream as _stream
from .generate import make_prefix, make_resume_handle, teacher_forced_logits
from .kv.cache import BatchSlot, Recon, RuntimeKVCache, batch_index, copy_position
from .kv.handles import load_prefix
from .kv.layouts import (DEFAULT_PAGE_SIZE, H_MODES, PageLayout, check_kv_iterations,
                         kv_bytes_per_token, resolve_kv_modes)
from .kv.pages import PageAllocator
from .kv.registry import KVRegistry
from .memory import get_pool, packed_scope, route_cupy_allocations, tag_scope
from .quant import QuantWeight


@dataclass
class Layer:
    """One transformer layer's device weights."""

    attn_norm: object
    attn_qkv: object
    attn_output: object
    ffn_norm: object
    ffn_gate_up: object
    ffn_down: object
    attn_kv: object = None      # the K and V rows of attn_qkv (views): store-h reconstruction
    qkv_bias: object = None     # f32 [qkv_dim] (config.qkv_bias)
    attn_post_norm: object = None   # f32 [d]: the second norm of each branch (layer_norms
    ffn_post_norm: object = None    # "pre_post" / "sandwich")


def _greedy(sampling) -> bool:
    """Whether a decode batch row's ``sampling`` tuple (``Ops.sample``'s arguments after the
    logits: temperature, top_k, top_p, u[, min_p, repetition_penalty, recent_ids]) picks the
    argmax: temperature <= 0 and no repetition penalty over a non-empty window."""
    _, pen, recent = sample_filters(sampling)
    return sampling[0] <= 0.0 and not penalized(pen, recent)


class BatchRows:
    """The rows of a decode batch (:meth:`Model.decode_batch`): row i is request ``caches[i]``
    (a RuntimeKVCache) at position ``positions[i]``. Passed to the stack where a prefill passes
    its first position, so every op that reads a position runs per row. ``index``: the step's
    device copy of ``kv.cache.batch_index`` (int64 [1 + n_slots, B]), or None."""

    __slots__ = ("caches", "positions", "index")

    def __init__(self, caches, positions, index=None):
        self.caches = caches
        self.positions = positions
        self.index = index

    def kv_of(self, s: int) -> BatchSlot:
        """The forward's slot ``s`` (the "all" order) of every row, each through its cache's
        iteration KV policy (``RuntimeKVCache.kv_of``), with its rows of the device index."""
        slots = [c.kv_of(s) for c in self.caches]
        if self.index is None:
            return BatchSlot(slots, self.positions)
        return BatchSlot(slots, self.positions, self.index[0], self.index[1 + s])


class PreparedBatch:
    """A decode batch step made ready on the host (:meth:`Model.decode_batch_prepare`): its
    rows padded to the captured bucket (``caches``, ``positions``; the first ``n`` are the
    batch's own), ``depth``, the host index (``kv.cache.batch_index``), the graph ``key`` and
    the step's ``logits`` / ``host_ids`` buffers (bucket rows, views of ``owner``, the
    captured batch's buffers then), and its inputs' host staging (``Ops.batch_host_inputs``)
    and device views; :meth:`Model.decode_batch_start` takes it with the step's token
    ids."""

    __slots__ = ("graphs", "caches", "positions", "n", "depth", "index", "key", "logits",
                 "host_ids", "owner", "stage_ids", "stage_index", "dev_ids", "dev_index")

    def __init__(self, graphs, caches, positions, n, depth, index, key, logits, host_ids,
                 owner, stage_ids, stage_index, dev_ids, dev_index):
        self.graphs, self.caches, self.positions, self.n = graphs, caches, positions, n
        self.depth, self.index, self.key = depth, index, key
        self.logits, self.host_ids = logits, host_ids
        self.owner = owner          # DecodeGraphs.batch_logits the views are of
        self.stage_ids, self.stage_index = stage_ids, stage_index    # host staging
        self.dev_ids, self.dev_index = dev_ids, dev_index            # device inputs


class PendingBatch:
    """A decode batch step in flight (:meth:`Model.decode_batch_start`): ``result`` is its
    list of ids (or logits) once :meth:`Model.decode_batch_finish` has read it, or at once for
    a step the start computed; ``logits`` / ``host_ids`` / ``sampling`` are the captured
    step's outputs and its rows' sampling, read by the finish."""

    __slots__ = ("result", "logits", "host_ids", "sampling")

    def __init__(self, result=None, logits=None, host_ids=None, sampling=None):
        self.result = result
        self.logits = logits
        self.host_ids = host_ids
        self.sampling = sampling


# What each VERSION 2 fact needs from a backend, as the refusal names it.
_FEATURE_TEXT = {"layer_norms": "post-branch and sandwich norms (layer_norms)",
                 "loop_norm": "the loop-boundary norm (loop_norm)",
                 "exit_norm": "the recurrence exit norm (exit_norm)",
                 "state_init": "a zero or seeded initial state (state_init)",
                 "embed_scale": "a scaled embedding (embed_scale)",
                 "qkv_bias": "Q/K/V bias (qkv_bias)",
                 "sliding_window": "sliding-window attention (sliding_window)"}


# The facts each backend's kernels do not run yet; a backend not named here runs none.
_BACKEND_LACKS = {"numpy": (), "cuda": ()}


def backend_missing_features(cfg, backend: str) -> list[str]:
    """The architecture facts of ``cfg`` the ``backend``'s kernels do not run yet (the
    NumPy reference and the CUDA kernels run every one; a backend not known here none; the
    exit gate is read on the host, by depth="auto" alone: ``Model.forward_auto``)."""
    lacks = _BACKEND_LACKS.get(backend, tuple(_FEATURE_TEXT))
    return [_FEATURE_TEXT[k] for k in _FEATURE_TEXT if k in cfg.arch_facts and k in lacks]


def kv_rows_of(w: QuantWeight, q_dim: int) -> QuantWeight:
    """Views of the K and V output rows (``q_dim`` onwards) of a fused QKV QuantWeight."""
    fp16 = None if w.fp16 is None else w.fp16[q_dim:]
    return QuantWeight(w.bits, w.group_size, w.qweight[q_dim:], w.scales[q_dim:],
                       w.zeros[q_dim:], fp16)


def loop_is_artificial(metadata: dict) -> bool:
    """Whether a .tlm file's recurrent block was cut from a plain (non-looped) transformer, so
    its layers were never trained to run more than once: the header's ``metadata["loop"]``
    ("artificial" / "trained") where recorded, else derived from the converter it names
    (files without the key come from ``tinyloop.convert.gguf`` versions that read only
    plain llama GGUFs; it records "trained" for a Nanbeige GGUF). Synthetic models (random
    weights) make no claim: False."""
    loop = metadata.get("loop")
    if loop is not None:
        return loop == "artificial"
    return metadata.get("converter") == "tinyloop.convert.gguf"


def _file_identity(path: str) -> tuple:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def model_fingerprint(f) -> bytes:
    """SHA-256 over a .tlm file's model identity: its config (dims, recurrent layout P/R/C,
    max_depth, injection) as sorted JSON, then every weight tensor's name, dtype, shape and
    bytes in ``expected_tensors`` order. ``f``: an open TLMFile."""
    import json
    h = hashlib.sha256(b"tinyloop-model-fingerprint-v1\0")
    h.update(json.dumps(f.config.identity_dict(), sort_keys=True).encode())
    for name, (kind, _) in planmod.expected_tensors(f.config).items():
        if kind == "quant":
            q = f.quant_weight(name)
            arrays = (q.qweight, q.scales, q.zeros)
        else:
            arrays = (f.array(name),)
        h.update(b"\0" + name.encode() + b"\0")
        for a in arrays:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
    return h.digest()


class BufferPool:
    """The Model's reusable activation buffers (the contract's load phase 4): contiguous row views.

    ``rows(name, t, cols)`` returns a C-contiguous ``[t, cols]`` view of the first t*cols
    elements of buffer ``name``, so every op sees contiguous arrays whatever the width.
    """

    def __init__(self, arrays: dict):
        self._flat = {name: a.reshape(-1) for name, a in arrays.items()}
        self.main = arrays["main"]
        self.capacity_rows = arrays["norm"].shape[0]

    def rows(self, name: str, t: int, cols: int):
        return self._flat[name][:t * cols].reshape(t, cols)

    def flat(self, name: str):
        return self._flat[name]


# Models loaded and not yet freed. At interpreter exit they are freed by an atexit hook, while
# imports, CuPy and the CUDA context still work: ending the program is a normal way to be done
# with a model, so that gives no ResourceWarning (a Model garbage-collected while the program
# runs does). The hook is registered at the first load, after the backend imported CuPy, so it
# runs before any exit hook CuPy registered (atexit runs hooks last-in, first-out).
_live_lock = threading.RLock()      # re-entrant: a collection inside add() may free a model
_live_models: "weakref.WeakSet[Model]" = weakref.WeakSet()   # guarded by _live_lock
_exit_hook_registered = False                                  # guarded by _live_lock


def _track(model: "Model") -> None:
    global _exit_hook_registered
    with _live_lock:
        _live_models.add(model)
        if not _exit_hook_registered:
            atexit.register(_free_live_models)
            _exit_hook_registered = True


_EXIT_LOCK_WAIT_S = 2.0     # how long the exit hook waits for a request (a daemon thread's)


def _free_live_models() -> None:
    """Free every model still loaded (the atexit hook). A model whose lock a (daemon) thread
    holds past _EXIT_LOCK_WAIT_S is left to the process's end rather than waited for."""
    with _live_lock:
        models = list(_live_models)
    for model in models:
        if model._lock.acquire(timeout=_EXIT_LOCK_WAIT_S):
            try:
                model.free()
            finally:
                model._lock.release()


class Model:
    """A loaded looped model. Create with :func:`tinyloop.load_model`.

    Attributes: ``config`` (ModelConfig), ``tokenizer`` (Tokenizer or None), ``backend``
    ("numpy" | "cuda"), ``max_seq_len``, ``prefill_chunk``, ``path``, ``plan`` (list of
    PlanEntry), ``fingerprint`` (see the property). Calls on one Model are serialized by a
    per-model lock (the contract's lock-per-model pattern): ``generate``, ``logits`` and
    ``score`` hold it for the whole call,
    so concurrent callers wait and are never interleaved. ``stream`` holds it for each token
    (forward + head + sample of one step) but not while suspended at a ``yield``, so a stream
    a caller stops reading never blocks the model; a step touches only its own request's KV
    cache and residual row, so whatever runs between two steps cannot disturb it.
    """

    def __init__(self, path, max_seq_len: int = 2048, prefill_chunk: int = 0, *,
                 backend: str = "auto", kv_mode=None, kernels=None, kv_iterations="all"):
        self._freed = True           # until the load succeeds there is nothing to free
        self._blocks: list = []      # every model-owned pool block; freed by free()
        max_seq_len, prefill_chunk = check_load_args(max_seq_len, prefill_chunk)
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path must be a str or os.PathLike, got {path!r}")
        self.path = os.fspath(path)
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self._kv_mode_spec = kv_mode_from_env() if kv_mode is None else kv_mode
        self.kv_iterations = check_kv_iterations(kv_iterations)   # the requests' default
        self._lock = threading.RLock()
        self._kv = KVRegistry()      # live caches and prefix handles; free() releases them
        self._ops = get_ops(backend, kernels)
        self.backend = self._ops.name
        self._pool = get_pool(self._ops.device)
        self._extras: dict = {}  # name -> model-owned extra made at first use (extra())
        self._pending_batch = None   # the PendingBatch decode_batch_start left in flight
        self._stage = None           # a captured decode batch's input staging (_batch_stage)
        self._loop_warned = False    # ArtificialLoopWarning given (once per model)
        self._rows_hooks: list = []  # watch_forward callbacks
        # CuPy's own temporaries go through this pool (tag "cupy") while a CUDA model lives
        self._cupy_routing = (route_cupy_allocations(self._pool) if self._ops.name == "cuda"
                              else None)
        try:
            with packed_scope():
                self._load()
        except BaseException:
            self._release_blocks()
            self._ops.release()
            self._stop_cupy_routing()
            raise
        self._freed = False
        _track(self)

    def _stop_cupy_routing(self) -> None:
        if self._cupy_routing is not None:
            self._cupy_routing.release()

    # -- load phases --------------------------------------------------------------------------
    def _load(self) -> None:
        # phase 1: header parse + validation (no device memory)
        if not os.path.exists(self.path):
            raise TinyLoopError(f"model file not found: {self.path}")
        if not os.path.isfile(self.path):
            raise TinyLoopError(f"model path is not a file: {self.path}")
        with read_tlm(self.path) as f:
            cfg = self.config = f.config
            missing = backend_missing_features(cfg, self._ops.name)
            if missing:
                raise ConfigError(f"{self.path}: {'; '.join(missing)} are not yet supported "
                                  f"on the {self._ops.name} backend (the numpy backend runs "
                                  f"them: backend='numpy')")
            problems = self._ops.config_problems(cfg)
            if problems:
                raise ConfigError(f"{self.path}: {'; '.join(problems)} (the numpy backend "
                                  "runs any shape: backend='numpy')")
            self.chat_template = f.chat_template
            self.metadata = dict(f.metadata)
            extra = self.metadata.get("eos_token_ids", [])
            if not isinstance(extra, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size
                    for i in extra):
                raise FormatError(f"{self.path}: metadata eos_token_ids={extra!r:.60} must be "
                                  f"a list of token ids below vocab_size={cfg.vocab_size}")
            tok_json = f.tokenizer_json
            layout = f.quant_layout()
            self.kv_modes = resolve_kv_modes(self._kv_mode_spec, cfg)
            self._check_kv_modes(self.kv_modes)
            store_h = any(m in H_MODES for m in self.kv_modes)
            self.plan = planmod.backend_load_plan(self._ops, cfg, layout, self.max_seq_len,
                                                  self.prefill_chunk, store_h=store_h)
            self.tokenizer = None
            if tok_json is not None:
                from .tokenizer import Tokenizer
                self.tokenizer = Tokenizer.from_json(tok_json, chat_template=self.chat_template,
                                                     bos_token_id=cfg.bos_token_id,
                                                     eos_token_id=cfg.eos_token_id)
                if self.tokenizer.vocab_size > cfg.vocab_size:
                    raise TokenizerError(
                        f"{self.path}: the embedded tokenizer has {self.tokenizer.vocab_size} "
                        f"tokens but the model's vocab_size is {cfg.vocab_size}")
            # besides config.eos_token_id (read at each check: it may be replaced)
            self._stop_ids = frozenset(extra) | (
                self.tokenizer.eog_ids if self.tokenizer is not None else frozenset())
            # A plan that cannot fit fails here, before anything is allocated, naming each
            # phase's bytes against the room. One that can goes into one reserved segment
            # (the caller's packed_scope), so only that segment has a rounding tail; failing
            # that, into one exact segment per phase, reserved as the phase starts.
            phases = planmod.load_phases(self.plan)
            self._pool.check_room([(label, tag, n) for _, label, tag, n in phases],
                                  f"loading {os.path.basename(self.path)}")
            whole = self._pool.reserve(sum(n for *_, n in phases), "weights")
            self._phase_reserve = ({} if whole else
                                   {ph: (tag, n) for ph, _, tag, n in phases})
            self._reserve_phase(2)
            # phase 2: quantized weights (packed codes + FP16 scales/zeros), norm weights
            w = {}
            with tag_scope("weights"):
                for name, (kind, _) in planmod.expected_tensors(cfg).items():
                    if kind == "quant":
                        dev, blocks = self._ops.upload_weight(f.quant_weight(name),
                                                              self._pool)
                        self._blocks.extend(blocks)
                    else:
                        dev, blk = self._ops.upload_array(np.asarray(f.array(name)),
                                                          self._pool)
                        self._blocks.append(blk)
                    w[name] = dev
            self._file_identity = _file_identity(self.path)
            self._fingerprint = None
        # phase 3: optional FP16 caches for the hot prefill GEMMs (the plan's phase-3 entries)
        self._reserve_phase(3)
        for e in self.plan:
            if e.phase == 3:
                name = e.name.removesuffix(".fp16")
                arr, blk = self._ops.make_fp16_cache(w[name], self._pool, e.tag)
                self._blocks.append(blk)
                w[name] = dataclasses.replace(w[name], fp16=arr)
        self._embed = w["token_embd"]
        self._head = w["token_embd"] if cfg.tied_head else w["output"]
        self._output_norm = w["output_norm"]
        self._adapter = w.get("inject.adapter")
        self._exit_gate = (w.get("exit_gate.weight"), w.get("exit_gate.bias"))
        self._host_gate = None       # float64 (norm weight, gate weight, gate bias): depth="auto"
        self._layers = [Layer(*(w[f"blk.{i}.{n}"] for n in
                                ("attn_norm", "attn_qkv", "attn_output", "ffn_norm",
                                 "ffn_gate_up", "ffn_down")),
                              attn_kv=kv_rows_of(w[f"blk.{i}.attn_qkv"], cfg.q_dim),
                              qkv_bias=w.get(f"blk.{i}.attn_qkv_bias"),
                              attn_post_norm=w.get(f"blk.{i}.attn_post_norm"),
                              ffn_post_norm=w.get(f"blk.{i}.ffn_post_norm"))
                        for i in range(cfg.n_layers)]
        # phase 4: the BufferPool (logit_row stays lazy)
        self._reserve_phase(4)
        arrays = {}
        for e in self.plan:
            if e.phase == 4 and not e.lazy:
                arrays[e.name], blk = self._ops.empty(self._pool, e.shape, e.dtype, e.tag)
                self._blocks.append(blk)
        self._buf = BufferPool(arrays)
        self._view_cache: dict = {}
        self._logit_row = None
        # phase 5: reconstruction scratch of the store-h KV modes (lazy when no default
        # mode stores h: a per-call kv_mode may still ask for one)
        self._recon_scratch = None
        if store_h:
            self._reserve_phase(5)
            self._recon_scratch = self._alloc_recon()
        self._phase_reserve = {}
        self._pages = PageAllocator(self._ops, self._pool)

    def _reserve_phase(self, phase: int) -> None:
        """When the load's one segment could not be had: one segment of exactly the phase's
        bytes (no 2 MiB rounding, so the phases together take what the plan says), best
        effort like ``MemoryPool.reserve``."""
        want = self._phase_reserve.pop(phase, None)
        if want is not None:
            self._pool.reserve(want[1], want[0], exact=True)

    def _release_blocks(self) -> None:
        blocks, self._blocks = self._blocks, []
        for blk in reversed(blocks):
            self._pool.free(blk)

    def free(self) -> None:
        """Return every model-owned block to the pool, and release what the model's live
        handles (PrefixCache, ResumeHandle, PrefixPool) and live requests (a stream's KV
        cache) hold: afterwards those raise HandleError / ModelFreedError. Idempotent."""
        with self._lock:
            if self._freed:
                return
            self._freed = True
            self._pending_batch = None      # the synchronisations below let it finish
            self._stage = None              # views of the backend's block, released below
            with _live_lock:
                _live_models.discard(self)
            extras, self._extras = self._extras, {}
            for extra in extras.values():
                extra.release()         # e.g. the captured steps' "graphs" blocks, before the
                                        # views go
            # prefix handles and pools, then what live requests hold (a stream suspended at a
            # yield, or a generator never closed): the request's next step raises
            # ModelFreedError
            self._kv.release_all()
            # drop every view into pool memory, so nothing dangles once the blocks go back
            self._layers = []
            self._embed = self._head = self._output_norm = self._adapter = None
            self._buf = None
            self._view_cache = {}
            self._logit_row = None
            self._recon_scratch = None
            self._recons = []
            self._release_blocks()
            self._ops.synchronize()
            self._ops.release()         # the backend's own scratch blocks
            self._stop_cupy_routing()

    def __del__(self):
        # A Model dropped without free_model() would otherwise keep its blocks forever (the
        # pool holds them, not the Model): free them, and say so, as an unclosed file does.
        # Not so once the interpreter is finalizing: the exit hook has freed every model it
        # could, a warning could not be shown, and a lock held by a daemon thread (frozen by
        # now) would never be released, so free only if the lock is free this instant.
        if getattr(self, "_freed", True):
            return
        if sys.is_finalizing():
            if self._lock.acquire(blocking=False):
                try:
                    self.free()
                finally:
                    self._lock.release()
            return
        warnings.warn(f"Model({self.path!r}) was garbage-collected without free_model(); "
                      f"freeing its {self.vram_usage_bytes()} bytes now", ResourceWarning,
                      stacklevel=2)
        self.free()

    @property
    def fingerprint(self) -> bytes:
        """The model's identity, under which prefix caches are keyed and saved: 32 bytes of
        SHA-256 over the config (dims, recurrent layout P/R/C, max_depth, injection) and
        every weight tensor's bytes (:func:`model_fingerprint`). Hashed from the file on first
        use (so loading pays nothing for it) and kept; raises FormatError when the file
        changed since the load (its size, mtime or inode differ), since its bytes would then
        not be this model's."""
        with self._lock:
            if self._fingerprint is None:
                if _file_identity(self.path) != self._file_identity:
                    raise FormatError(f"{self.path} changed since it was loaded; its "
                                      f"fingerprint would not be this model's (load it again)")
                with read_tlm(self.path) as f:
                    self._fingerprint = model_fingerprint(f)
            return self._fingerprint

    def vram_usage_bytes(self) -> int:
        """Bytes of pool blocks the model owns (weights, FP16 caches, buffers, logit_row, its
        backend's scratch (tag ``scratch``: the CUDA backend's argmax, split-K and sampler
        scratch), and what its captured decode steps hold under tag ``graphs``:
        ``graph_stats()["bytes"]``, made at the first decode step and released with the
        model: every :meth:`extra`'s ``nbytes``)."""
        own = sum(b.nbytes for b in self._blocks) + self._ops.scratch_bytes(self._pool)
        return own + sum(e.nbytes for e in self._extras.values())

    def extra(self, name: str, make):
        """The model-owned extra ``name`` (``graphs.decode_graphs``: the captured decode
        steps), made by ``make(model)`` at first use. An extra has ``release()``, which
        :meth:`free` calls, and ``nbytes``, which :meth:`vram_usage_bytes` counts. Raises
        ModelFreedError after free."""
        self.check_alive()
        got = self._extras.get(name)
        if got is None:
            got = self._extras[name] = make(self)
        return got

    # -- the surface request code uses (generate.py, diagnostics, benchmarks) -----------------
    @property
    def ops(self):
        """The backend's Ops instance (``base.Ops``): ``act_dtype``, ``kv_dtype``, ``empty``,
        ``to_host``, ``sample``, ..."""
        return self._ops

    @property
    def pool(self):
        """The MemoryPool every block of this model and its requests comes from."""
        return self._pool

    @property
    def device(self) -> str:
        """The pool's device: "host" (NumPy backend) or "cuda"."""
        return self._pool.device

    @property
    def lock(self):
        """The per-model re-entrant lock every request holds while it runs the forward."""
        return self._lock

    @property
    def kv_registry(self) -> KVRegistry:
        """The model's live KV caches and prefix handles (``kv.registry.KVRegistry``), which
        :meth:`free` releases."""
        return self._kv

    @property
    def kv_pages(self) -> PageAllocator:
        """The PageAllocator every KV page of this model comes from."""
        return self._pages

    @property
    def chunk_rows(self) -> int:
        """Positions per forward chunk (the scratch buffers' rows, ``plan.scratch_rows``);
        chunks start at absolute multiples of it (:meth:`_chunks`)."""
        return self._buf.capacity_rows

    def residual_rows(self, pos0: int, n: int):
        """The final residual rows of positions pos0..pos0+n-1 (float32 ``[n, d_model]`` view
        of ``buffers.main``): what ``head`` reads; prefix caches save and restore them."""
        return self._buf.main[pos0:pos0 + n]

    def quant_weights(self) -> dict:
        """Every quantized weight the model holds on its device, by GGUF-style name
        (``token_embd``; ``output`` unless the head is tied to the embedding;
        ``blk.{i}.attn_qkv`` / ``attn_output`` / ``ffn_gate_up`` / ``ffn_down`` per layer in
        storage order; ``inject.adapter`` where the model injects): ``QuantWeight`` values
        (or plain arrays for unquantized tensors), whose ``nbytes`` give what a decode step
        streams. Raises ModelFreedError after free."""
        self.check_alive()
        out = {"token_embd": self._embed}
        if self._head is not self._embed:
            out["output"] = self._head
        for i, lw in enumerate(self._layers):
            for n in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"):
                out[f"blk.{i}.{n}"] = getattr(lw, n)
        if self._adapter is not None:
            out["inject.adapter"] = self._adapter
        return out

    @property
    def injects(self) -> bool:
        """Whether each recurrent iteration injects the prelude output (``inject.adapter``)."""
        return self._adapter is not None

    def check_alive(self) -> None:
        """Raise ModelFreedError once the model was freed."""
        if self._freed:
            raise ModelFreedError("this Model was freed with free_model(); load it again")

    def request_plan(self, n_tokens: int, depth: int, logits: bool = False,
                     kv_mode=None, kv_iterations=None) -> list:
        """``plan.request_plan`` for this model: the paged KV cache of ``n_tokens`` positions
        at ``depth`` in ``kv_mode`` (default the load's; block tables and pages at the
        backend's kv_dtype) and, with ``logits``, the logits block of a logits()/score() call
        (``plan.logits_block_rows`` rows); ``kv_iterations`` as in :meth:`new_kv_cache`."""
        rows = (planmod.logits_block_rows(n_tokens, self.max_seq_len, self.prefill_chunk)
                if logits else 0)
        return planmod.request_plan(self.config, n_tokens, depth, self._ops.kv_dtype,
                                    logits_rows=rows, modes=self.resolve_kv_modes(kv_mode),
                                    kv_iterations=self.resolve_kv_iterations(kv_iterations))

    def check_token_ids(self, token_ids, what: str = "token_ids") -> np.ndarray:
        """``token_ids`` as int32 [T] after checking it is a non-empty 1-D sequence of ints
        in 0..vocab_size-1. Raises ConfigError (shape/dtype/empty), TokenizerError (range)."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ConfigError(f"{what} must be a 1-D sequence of ints, got shape {ids.shape} "
                              f"dtype {ids.dtype}")
        if ids.size == 0:
            raise ConfigError(f"{what} is empty")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise TokenizerError(f"{what}[{i}]={int(ids[i])} is outside 0..vocab_size-1="
                                 f"{self.config.vocab_size - 1}")
        return ids.astype(np.int32)

    def encode_prompt(self, prompt) -> np.ndarray:
        """Text (encoded with the tokenizer) or token ids -> int32 ids ``[T]``, T >= 1.

        An empty prompt (``""``, text that encodes to no token, or ``[]``) is the BOS token
        alone: the request starts from the start of a sequence. Raises ConfigError for an
        empty prompt when the model has no BOS token, and as :meth:`check_token_ids`;
        TokenizerError for text without a tokenizer or ids out of range."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError("this model file has no tokenizer: pass token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TokenizerError(f"prompt is not valid Unicode text ({e.reason} at index "
                                     f"{e.start})") from None
            prompt = self.tokenizer.encode(prompt)
        arr = np.asarray(prompt)
        if arr.ndim == 1 and arr.size == 0:
            if self.config.bos_token_id < 0:
                raise ConfigError("the prompt is empty and this model has no BOS token to "
                                  "start from: pass at least one token")
            return np.array([self.config.bos_token_id], dtype=np.int32)
        return self.check_token_ids(prompt, "prompt")

    def _check_kv_modes(self, modes) -> None:
        if self._ops.name == "cuda":
            missing = sorted(set(modes) - set(self._ops.kv_modes))
            if missing:
                raise ConfigError(f"kv mode(s) {missing} have no CUDA kernels yet; this backend "
                                  f"runs {self._ops.kv_modes}")

    def resolve_kv_modes(self, kv_mode=None) -> tuple[str, ...]:
        """One KV mode per physical layer: ``kv_mode`` (a name, "auto", a dict by slot kind,
        or a sequence per layer; see kv.layouts.resolve_kv_modes), or the load's default when
        None. Raises ConfigError naming the bad value."""
        if kv_mode is None:
            return self.kv_modes
        modes = resolve_kv_modes(kv_mode, self.config)
        self._check_kv_modes(modes)
        return modes

    def resolve_kv_iterations(self, kv_iterations=None) -> str:
        """The iteration KV policy ("all" | "latest", ``kv.layouts.KV_ITERATIONS``):
        ``kv_iterations``, or the load's default when None. Raises ConfigError naming a bad
        value."""
        return self.kv_iterations if kv_iterations is None else check_kv_iterations(
            kv_iterations)

    def kv_bytes_per_token(self, depth: int | None = None, kv_mode=None,
                           kv_iterations=None) -> int:
        """Bytes a request's KV cache holds per position at ``depth`` (default: the model's),
        over all slots, scales and zeros included, page rounding excluded: ``P + R*depth + C``
        slots under ``kv_iterations="all"``, ``P + R + C`` under "latest" (default: the
        load's policy)."""
        depth = self.config.check_depth(depth)
        return kv_bytes_per_token(self.config, depth, self.resolve_kv_modes(kv_mode),
                                  self._ops.kv_dtype, self.resolve_kv_iterations(kv_iterations))

    def kv_page_layout(self, mode: str, page_size: int = DEFAULT_PAGE_SIZE) -> PageLayout:
        """The PageLayout of ``mode`` pages on this model's backend."""
        return PageLayout.for_config(self.config, mode, page_size, self._ops.kv_dtype)

    def new_kv_cache(self, depth: int, capacity: int, kv_mode=None,
                     page_size: int = DEFAULT_PAGE_SIZE, kv_iterations=None) -> RuntimeKVCache:
        """A paged RuntimeKVCache for up to ``capacity`` positions at ``depth`` (tag
        kv_cache; pages are gained as positions are written). ``kv_mode``: see
        :meth:`resolve_kv_modes`; ``kv_iterations``: :meth:`resolve_kv_iterations`.
        :meth:`free` releases it if it is still live then. First releases the storage of
        prefix handles collected unreleased (``KVRegistry.drain``), so every request and every
        new handle frees them."""
        self.check_alive()
        self._kv.drain()
        if capacity > self.max_seq_len:
            raise ConfigError(f"{capacity} positions exceed max_seq_len={self.max_seq_len}")
        modes = self.resolve_kv_modes(kv_mode)
        policy = self.resolve_kv_iterations(kv_iterations)
        if any(m in H_MODES for m in modes) and self._recon_scratch is None:
            self._recon_scratch = self._alloc_recon()
        with packed_scope():
            cache = RuntimeKVCache(self._ops, self._pool, self.config, depth, capacity, modes,
                                   self._pages, page_size, policy)
        self._kv.track_cache(cache)
        return cache

    def _alloc_recon(self) -> dict:
        """Phase 5: the reconstruction scratch (model-owned, tag scratch)."""
        out = {}
        for e in self.plan:
            if e.phase == 5:
                with packed_scope():
                    out[e.name], blk = self._ops.empty(self._pool, e.shape, e.dtype, e.tag)
                self._blocks.append(blk)
        chunk = planmod.recon_rows(self.max_seq_len)
        q_dim = self.config.q_dim
        self._recons = [Recon(lw.attn_kv, self.config.rope_theta, chunk, out,
                              bias=None if lw.qkv_bias is None else lw.qkv_bias[q_dim:])
                        for lw in self._layers]
        return out

    def logit_row(self):
        """The lazily allocated float32 [1, vocab] logit row (model-owned, tag logits)."""
        if self._logit_row is None:
            (e,) = [e for e in self.plan if e.name == "logit_row"]
            with packed_scope():
                self._logit_row, blk = self._ops.empty(self._pool, e.shape, e.dtype, e.tag)
            self._blocks.append(blk)
        return self._logit_row

    # -- the forward --------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, pos0: int, depth: int, cache: RuntimeKVCache,
                on_rows=None, snapshot=None) -> None:
        """Run ``ids`` (int32 [T], positions pos0..pos0+T-1) through the model, chunk by chunk
        (chunks end at absolute multiples of the scratch rows: :meth:`_chunks`).

        Writes K/V for every slot into ``cache`` and the final residual rows into
        ``buffers.main[pos0:pos0+T]``. After each chunk, ``on_rows(start, t)`` is called with
        the chunk's absolute start position and length (the residual rows are in ``main``).
        ``snapshot`` (a ``kv.handles.ResidualSnapshot``) receives, for every position, the state
        entering the recurrent block and the state after iteration ``depth`` (ResumeHandle).
        """
        for start, t in self._chunks(pos0, len(ids)):
            cache.ensure(start + t)
            c0 = start - pos0
            self._forward_chunk(ids[c0:c0 + t], start, t, depth, cache, snapshot)
            if on_rows is not None:
                on_rows(start, t)

    def deepen(self, pos0: int, n: int, depth_from: int, depth_to: int, cache: RuntimeKVCache,
               snapshot, on_rows=None) -> None:
        """Continue positions pos0..pos0+n-1 from iteration ``depth_from`` to ``depth_to``.

        Reads the state after iteration ``depth_from`` (and the state entering the recurrent
        block, for the injection) from ``snapshot``, runs recurrent iterations
        depth_from+1..depth_to (0-based depth_from..depth_to-1; their K/V go to slots
        P + t*R + j of ``cache``) and the coda (slots P + R*depth_to + c), writes the state
        after iteration ``depth_to`` back into ``snapshot`` and the final rows into ``main``.
        Equal to a fresh forward at ``depth_to``: the prelude and iterations < depth_from
        depend only on earlier positions' same-slot K/V, which ``cache`` already holds.
        """
        for start, t in self._chunks(pos0, n):
            cache.ensure(start + t)
            self._deepen_chunk(start, t, depth_from, depth_to, cache, snapshot)
            if on_rows is not None:
                on_rows(start, t)

    def _chunks(self, pos0: int, n: int):
        """(start, t) of the chunks covering positions pos0..pos0+n-1: row blocks aligned to
        absolute multiples of the scratch rows R, so a position is computed in the same block
        (same rows, same attention context) wherever the request's forward began (after a
        prefix, a pool hit, a resume handle, or from 0)."""
        r = self._buf.capacity_rows
        pos, end = pos0, pos0 + n
        while pos < end:
            t = min(end, (pos // r + 1) * r) - pos
            yield pos, t
            pos += t

    def _views(self, t: int) -> dict:
        """Contiguous ``[t, cols]`` views of the scratch buffers, made once per chunk length
        (the decode step reuses the t=1 set, so the hot path only indexes)."""
        v = self._view_cache.get(t)
        if v is None:
            cfg, b = self.config, self._buf
            d = cfg.d_model
            v = {"norm": b.rows("norm", t, d), "qkv": b.rows("scratch1", t, cfg.qkv_dim),
                 "att": b.rows("attn_down", t, cfg.q_dim),
                 "h": b.rows("attn_down", t, cfg.ffn_dim),
                 "gate_up": b.rows("scratch1", t, 2 * cfg.ffn_dim),
                 "cat": b.rows("scratch1", t, 2 * d), "ids": b.flat("ids")[:t]}
            if self._adapter is not None:
                v["inject"] = b.rows("inject", t, d)
            if len(self._view_cache) > 8:      # a few chunk lengths recur; keep it bounded
                self._view_cache.clear()
            self._view_cache[t] = v
        return v

    def _forward_chunk(self, ids, pos0: int, t: int, depth: int, cache: RuntimeKVCache,
                       snapshot=None) -> None:
        ops = self._ops
        v = self._views(t)
        x = self._buf.main[pos0:pos0 + t]                           # [T, d] float32
        if t == 1:
            ops.embed(self._embed, ids, x)       # one host id: travels as a kernel argument
        else:
            ops.from_host(np.ascontiguousarray(ids, dtype=np.int32), v["ids"])
            ops.embed(self._embed, v["ids"], x)
        if self.config.embed_scale != 1.0:
            ops.scale(x, self.config.embed_scale)
        self._check_loop_depth(depth)
        self._stack(x, v, depth, cache.kv_of, pos0, None, snapshot)
        for hook in self._rows_hooks:
            hook(pos0, t)

    def _stack(self, x, v: dict, depth: int, kv_of, pos0, step, snapshot=None) -> None:
        """Every layer slot of the looped stack over residual rows ``x``: prelude, ``depth``
        passes of the recurrent block (with the injection adapter), coda. ``kv_of(slot)``
        gives a slot's SlotKV; positions come from ``pos0`` (host) or, when ``step`` is given,
        from the device step state (``Ops.kv_write_step``). ``snapshot`` (ResumeHandle) keeps
        the rows entering and leaving the recurrent block."""
        cfg = self.config
        for i in range(cfg.n_prelude):
            self._layer(i, kv_of(i), x, pos0, v, step)
        if cfg.n_recurrent:
            e = None
            if self._adapter is not None:
                e = v["inject"]                                      # prelude output [T, d]
                self._ops.copy(x, e)
            if snapshot is not None:
                snapshot.put_entry(pos0, x)
            if cfg.state_init == "zeros":
                self._ops.zero(x)
            elif cfg.state_init == "normal" and isinstance(pos0, BatchRows):
                # each row at its own position (read on the device from the step's index)
                self._ops.init_state_rows(x, pos0.positions, cfg.state_std, cfg.state_seed,
                                          None if pos0.index is None else pos0.index[0])
            elif cfg.state_init == "normal" and step is None:
                self._ops.init_state(x, pos0, cfg.state_std, cfg.state_seed)
            elif cfg.state_init == "normal":     # the position read on the device
                self._ops.init_state_step(x, step, cfg.state_std, cfg.state_seed)
            self._iterations(x, e, 0, depth, pos0, v, kv_of, step)
            if snapshot is not None:
                snapshot.put_state(pos0, x)
        self._coda(x, depth, pos0, v, kv_of, step)

    def forward_auto(self, token: int, pos0: int, cache: RuntimeKVCache, rule) -> int:
        """One decode position at adaptive depth (``depth="auto"``; ``tinyloop.adaptive``):
        embed ``token`` at ``pos0``, the prelude, then recurrent iterations until ``rule``
        (an ``adaptive.ExitRule``) exits or ``rule.max_depth`` ran, then the coda; the final
        row lands in ``buffers.main[pos0]`` as :meth:`forward` leaves it. ``cache`` is laid
        out for ``rule.max_depth`` iterations. Under kv_iterations="all" an exit after
        iteration d copies each recurrent layer's row of iteration d into the slots of the
        iterations after it (``kv.cache.copy_position``). Eager: the exit is decided on the
        host after each iteration, so the captured form (``graphs.DecodeGraphs.step_auto``)
        replays the step's parts one graph each. Returns the depth the position ran at. Raises ConfigError when the cache is laid
        out for another depth."""
        cfg, ops = self.config, self._ops
        top = rule.max_depth
        if cache.depth != top:
            raise ConfigError(f"a depth='auto' step up to {top} iterations needs a cache laid "
                              f"out for {top}, got {cache.depth}")
        cache.ensure(pos0 + 1)
        v = self._views(1)
        x = self._buf.main[pos0:pos0 + 1]
        ops.embed(self._embed, np.asarray([token], np.int32), x)
        if cfg.embed_scale != 1.0:
            ops.scale(x, cfg.embed_scale)
        self._check_loop_depth(top)
        kv_of = cache.kv_of
        for i in range(cfg.n_prelude):
            self._layer(i, kv_of(i), x, pos0, v, None)
        depth = top
        keep = keep_blk = None      # the KL rule's copy of the state [1, d] (tag scratch)
        try:
            if cfg.n_recurrent:
                e = None
                if self._adapter is not None:
                    e = v["inject"]
                    ops.copy(x, e)
                if cfg.state_init == "zeros":
                    ops.zero(x)
                elif cfg.state_init == "normal":
                    ops.init_state(x, pos0, cfg.state_std, cfg.state_seed)
                rule.start(ops.to_host(x) if rule.needs_start_state else None, cfg.vocab_size)
                if rule.needs_logits:
                    keep, keep_blk = ops.empty(self._pool, (1, cfg.d_model), np.float32,
                                               "scratch")
                for it in range(top):
                    self._iterations(x, e, it, it + 1, pos0, v, kv_of, None)
                    if it + 1 < top and self._exits(rule, x, pos0, v, kv_of, top, keep):
                        depth = it + 1
                        break
                self.fill_deeper(cache, depth, pos0)
            self._coda(x, top, pos0, v, kv_of, None)
        finally:
            if keep_blk is not None:
                self._pool.free(keep_blk)
        for hook in self._rows_hooks:
            hook(pos0, 1)
        return depth

    def fill_deeper(self, cache: RuntimeKVCache, depth: int, pos0: int) -> None:
        """After position ``pos0`` exited at ``depth`` < ``cache.depth`` under
        kv_iterations="all": copy each recurrent layer's row of iteration ``depth`` into the
        slots of the iterations after it (``kv.cache.copy_position``), so later positions
        that run deeper attend to the position's last iteration. Nothing to do under "latest"
        (the one slot already holds it) or at full depth."""
        top = cache.depth
        if depth >= top or cache.kv_iterations != "all":
            return
        p, r = self.config.n_prelude, self.config.n_recurrent
        for j in range(r):
            src = cache.kv_of(p + (depth - 1) * r + j)
            for it in range(depth, top):
                copy_position(src, cache.kv_of(p + it * r + j), pos0)

    def exit_decision(self, rule, state, logits=None) -> bool:
        """Whether ``rule`` (an ``adaptive.ExitRule``) exits after an iteration that left the
        state ``state`` (host float array [d] or [1, d]): "gate" from the exit gate on
        rmsnorm(state) (float64 on the host, Ouro's ``early_exit_gate``), "kl" from
        ``logits`` (host [vocab]: the coda and head run on the state), "state" from the state
        itself (``ExitRule.exits``)."""
        cfg, ops = self.config, self._ops
        xh = np.asarray(state, np.float64).reshape(-1)
        if rule.rule == "gate":
            if self._host_gate is None:
                self._host_gate = tuple(np.asarray(ops.to_host(a), np.float64).reshape(-1)
                                        for a in (self._output_norm, *self._exit_gate))
            nw, gw, gb = self._host_gate
            h = xh / np.sqrt(np.mean(xh * xh) + cfg.norm_eps) * nw
            return rule.exits(xh, gate_z=float(h @ gw + gb[0]))
        if rule.rule == "kl":
            return rule.exits(xh, logits=logits)
        return rule.exits(xh)

    def _exits(self, rule, x, pos0: int, v: dict, kv_of, top: int, keep) -> bool:
        """Whether ``rule`` exits after the iteration that left state ``x`` [1, d]
        (``exit_decision``); for "kl" the coda and head run on the state first (x is
        restored from ``keep`` after; the coda's K/V rows at ``pos0`` are rewritten by the
        exit's own coda)."""
        ops = self._ops
        xh = ops.to_host(x)
        logits = None
        if rule.rule == "kl":
            ops.copy(x, keep)
            self._coda(x, top, pos0, v, kv_of, None)
            row = self.logit_row()
            self.head(pos0, 1, row)
            logits = ops.to_host(row)
            ops.copy(keep, x)
        return self.exit_decision(rule, xh, logits)

    def auto_step_ops(self, part, step, x, top: int, slots, host_out=None,
                      sampled: bool = False, keep=None) -> None:
        """Issue one part of a depth="auto" decode step driven by the device step state
        ``step`` (int32 [STEP_WORDS]) over the residual row ``x`` f32 [1, d] and the SlotKVs
        ``slots`` (by the forward's slot names, a cache laid out for ``top`` iterations):
        ``"pre"`` embeds ``step[STEP_ID]``, runs the prelude, keeps the adapter's input and
        starts the recurrent state; an int ``t`` runs recurrent iteration t (0-based);
        ``"probe"`` (the "kl" rule) runs the coda and the head on the state into
        ``logit_row()`` and restores it from ``keep`` f32 [1, d]; ``"post"`` runs the coda,
        the head (argmax, or with ``sampled`` the device sampler) and ``step_advance`` into
        ``host_out``. The host decides between iterations (``exit_decision``), so each part
        is captured on its own (``graphs.DecodeGraphs.step_auto``); together they issue what
        :meth:`forward_auto` and the head run eagerly. Reads nothing on the host and
        allocates nothing."""
        cfg, ops = self.config, self._ops
        v = self._views(1)
        kv_of = slots.__getitem__
        e = v["inject"] if self._adapter is not None else None
        if part == "pre":
            ops.embed(self._embed, step[:1], x)
            if cfg.embed_scale != 1.0:
                ops.scale(x, cfg.embed_scale)
            for i in range(cfg.n_prelude):
                self._layer(i, kv_of(i), x, None, v, step)
            if cfg.n_recurrent:
                if e is not None:
                    ops.copy(x, e)
                if cfg.state_init == "zeros":
                    ops.zero(x)
                elif cfg.state_init == "normal":
                    ops.init_state_step(x, step, cfg.state_std, cfg.state_seed)
        elif part == "probe":
            ops.copy(x, keep)
            self._coda(x, top, None, v, kv_of, step)
            ops.rmsnorm_lm_head(x, self._output_norm, cfg.norm_eps, self._head,
                                self.logit_row(), v["norm"])
            ops.copy(keep, x)
        elif part == "post":
            self._coda(x, top, None, v, kv_of, step)
            head = ops.head_sample_step if sampled else ops.head_argmax_step
            head(x, self._output_norm, cfg.norm_eps, self._head, self.logit_row(), v["norm"],
                 step)
            ops.step_advance(step, host_out, cfg.rope_theta, cfg.head_dim)
        else:
            self._iterations(x, e, int(part), int(part) + 1, None, v, kv_of, step)

    def _deepen_chunk(self, pos0: int, t: int, depth_from: int, depth_to: int,
                      cache: RuntimeKVCache, snapshot) -> None:
        self._check_loop_depth(depth_to)
        v = self._views(t)
        x = self._buf.main[pos0:pos0 + t]
        snapshot.get_state(pos0, x)
        e = None
        if self._adapter is not None:
            e = v["inject"]
            snapshot.get_entry(pos0, e)
        self._iterations(x, e, depth_from, depth_to, pos0, v, cache.kv_of, None)
        snapshot.put_state(pos0, x)
        self._coda(x, depth_to, pos0, v, cache.kv_of, None)
        for hook in self._rows_hooks:
            hook(pos0, t)

    @property
    def loop_is_artificial(self) -> bool:
        """True when the recurrent block was cut from a plain transformer (a converted llama
        GGUF, such as the embedded default model): depths above ``config.default_depth``
        then degrade the text (:func:`loop_is_artificial`)."""
        return loop_is_artificial(self.metadata)

    def _check_loop_depth(self, depth: int) -> None:
        """Warn once per model (ArtificialLoopWarning) when a forward runs deeper than the
        default depth on a model whose loop is artificial."""
        if depth > self.config.default_depth and not self._loop_warned \
                and self.loop_is_artificial:
            self._loop_warned = True
            warnings.warn(artificial_loop_message(self, depth), ArtificialLoopWarning,
                          stacklevel=2)

    @contextlib.contextmanager
    def watch_forward(self, callback):
        """While the block runs, ``callback(start, t)`` is called after every chunk of
        positions start..start+t-1 the forward computes (prefill chunks, eager decode steps,
        ResumeHandle upgrades; decode steps and batches run as captured graphs are not seen): for
        progress display. It runs under the model's lock and must not call the model."""
        self._rows_hooks.append(callback)
        try:
            yield
        finally:
            self._rows_hooks.remove(callback)

    def _iterations(self, x, e, it0: int, it1: int, pos0, v: dict, kv_of, step) -> None:
        """Recurrent iterations it0..it1-1 (0-based) over the rows ``x``; ``e`` is the prelude
        output the adapter injects (None without injection)."""
        cfg = self.config
        p, r = cfg.n_prelude, cfg.n_recurrent
        for it in range(it0, it1):
            if it > 0 and cfg.loop_norm:        # the final norm between two passes
                self._ops.norm_residual(x, self._output_norm, cfg.norm_eps)
            if e is not None:
                self._ops.inject(x, e, self._adapter, v["cat"], v["norm"])
            for j in range(r):
                self._layer(p + j, kv_of(p + it * r + j), x, pos0, v, step)

    def _coda(self, x, depth: int, pos0, v: dict, kv_of, step) -> None:
        cfg = self.config
        p, r = cfg.n_prelude, cfg.n_recurrent
        if cfg.exit_norm:                       # the final norm on the state leaving the loop
            self._ops.norm_residual(x, self._output_norm, cfg.norm_eps)
        for c in range(cfg.n_coda):
            self._layer(p + r + c, kv_of(p + r * depth + c), x, pos0, v, step)

    def _layer(self, li: int, kv, x, pos0, v: dict, step=None) -> None:
        cfg, ops, lw = self.config, self._ops, self._layers[li]
        norm, qkv = v["norm"], v["qkv"]
        recon = None
        window = cfg.window(li)
        win = {"window": window} if window else {}    # only sliding layers pass it
        if step is not None and not kv.layout.stores_h and ops.rmsnorm_qkv_kv_step(
                x, lw.attn_norm, cfg.norm_eps, lw.attn_qkv, qkv, step, cfg.rope_theta,
                cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kv, bias=lw.qkv_bias):
            # one launch did rmsnorm_linear (+ add_bias) + kv_write_step (CUDA, fp16 / int8
            # pages)
            ops.kv_attention_step(qkv, kv, step, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                  v["att"], None, **win)
            self._layer_rest(lw, x, v, norm)
            return
        if kv.layout.stores_h:
            # the normed rows are what the slot stores, so the pair runs unfused
            ops.rmsnorm(x, lw.attn_norm, cfg.norm_eps, norm)
            ops.linear(norm, lw.attn_qkv, qkv)
            recon = self._recons[li]
        else:
            ops.rmsnorm_linear(x, lw.attn_norm, cfg.norm_eps, lw.attn_qkv, qkv, norm)
        if lw.qkv_bias is not None:
            ops.add_bias(qkv, lw.qkv_bias)
        if isinstance(kv, BatchSlot):
            # a decode batch: RoPE, the K/V write and attention of every row, each into and
            # over its own request's pages at its own position (one call each; the CUDA
            # backend runs one launch each, the store-h modes a loop of T = 1 calls)
            ops.kv_write_batch(qkv, norm, kv, cfg.rope_theta, cfg.n_heads, cfg.n_kv_heads,
                               cfg.head_dim)
            ops.kv_attention_batch(qkv, kv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                   v["att"], recon=recon, **win)
        elif step is None:
            ops.kv_write(qkv, norm, pos0, cfg.rope_theta, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, kv)
            ops.kv_attention(qkv, kv, pos0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             v["att"], recon, **win)
        else:
            ops.kv_write_step(qkv, norm, step, cfg.rope_theta, cfg.n_heads, cfg.n_kv_heads,
                              cfg.head_dim, kv)
            ops.kv_attention_step(qkv, kv, step, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                  v["att"], recon, **win)
        self._layer_rest(lw, x, v, norm)

    def _layer_rest(self, lw, x, v: dict, norm) -> None:
        """A layer after its attention: O projection + residual, RMSNorm + gate/up + SwiGLU,
        down projection + residual."""
        self._branch_out(v["att"], lw.attn_output, lw.attn_post_norm, x, norm)
        self._ops.rmsnorm_linear_swiglu(x, lw.ffn_norm, self.config.norm_eps, lw.ffn_gate_up,
                                        v["gate_up"], v["h"], norm)
        self._branch_out(v["h"], lw.ffn_down, lw.ffn_post_norm, x, norm)

    def _branch_out(self, h, w, post_norm, x, norm) -> None:
        """A branch's output projection of ``h`` into the residual ``x`` by the layer's norm
        placement (``layer_norms``): "pre" adds it; "pre_post" (Ouro) normalizes it with
        ``post_norm`` first (through ``norm``); "sandwich" (Huginn) adds it, then normalizes
        the sum."""
        ops, eps, where = self._ops, self.config.norm_eps, self.config.layer_norms
        if where == "pre":
            ops.linear_residual(h, w, x)
        elif where == "pre_post":
            ops.linear_norm_residual(h, w, post_norm, eps, x, norm)
        else:
            ops.linear_residual_norm(h, w, post_norm, eps, x)

    def decode_step_ops(self, step, x, depth: int, slots, host_out,
                        sampled: bool = False) -> None:
        """Issue one decode step driven by the device step state ``step`` (int32
        [STEP_WORDS], ``backends.base``): embed ``step[STEP_ID]`` into the residual row ``x``
        f32 [1, d], run every slot (``slots[s]``: SlotKV) at position ``step[STEP_POS]``, final
        RMSNorm + LM head into ``logit_row()`` with the next id written back to ``step`` (the
        argmax, or with ``sampled`` the device sampler under the parameters of
        ``Ops.set_step_sampling``, read when it runs), then advance the position and copy
        (id, fault) to ``host_out``. Reads nothing on the host,
        so ``graphs.DecodeGraphs`` captures it once per key and replays it every step. Every
        array it touches exists before (no allocation)."""
        cfg, ops = self.config, self._ops
        v = self._views(1)
        ops.embed(self._embed, step[:1], x)
        if cfg.embed_scale != 1.0:
            ops.scale(x, cfg.embed_scale)
        self._stack(x, v, depth, slots.__getitem__, None, step)
        head = ops.head_sample_step if sampled else ops.head_argmax_step
        head(x, self._output_norm, cfg.norm_eps, self._head, self.logit_row(), v["norm"], step)
        ops.step_advance(step, host_out, cfg.rope_theta, cfg.head_dim)

    def head(self, pos0: int, t: int, out) -> None:
        """Final RMSNorm + LM head of residual rows pos0..pos0+t into ``out`` f32 [t, vocab]."""
        cfg = self.config
        self._ops.rmsnorm_lm_head(self._buf.main[pos0:pos0 + t], self._output_norm,
                                  cfg.norm_eps, self._head, out, self._views(t)["norm"])

    def head_sample(self, pos: int, out, temperature: float, top_k: int, top_p: float,
                    u: float, **filters) -> int:
        """Final RMSNorm + LM head of residual row ``pos`` into ``out`` f32 [1, vocab], then the
        next token id by ``numpy_ops.sample_from_logits``'s rule (``Ops.rmsnorm_lm_head_sample``:
        one fused launch for greedy decode on the CUDA backend, only the id crosses);
        ``filters``: the rule's ``min_p``, ``repetition_penalty``, ``recent_ids``."""
        cfg = self.config
        return int(self._ops.rmsnorm_lm_head_sample(
            self._buf.main[pos:pos + 1], self._output_norm, cfg.norm_eps, self._head, out,
            self._views(1)["norm"], temperature, top_k, top_p, u, **filters))

    def reserve_decode_batch(self, rows: int, graphs=None) -> None:
        """Take now the backend scratch a :meth:`decode_batch` of up to ``rows`` rows needs
        (``Ops.reserve_decode_batch``: the batched split-K attention's partials on CUDA) and,
        with ``graphs`` (this model's ``graphs.DecodeGraphs``) where batches run as graphs,
        the captured batch's logits and ids (``DecodeGraphs.batch_buffers``, tag
        ``graphs``), so later steps allocate nothing. Raises ModelFreedError after free."""
        cfg = self.config
        with self.lock:
            self.check_alive()
            rows = min(int(rows), self._buf.capacity_rows)
            if graphs is not None and self._ops.graph_kv_modes and cuda_graphs_enabled():
                rows = graphs.bucket(rows, self._buf.capacity_rows)     # padded batches
                graphs.batch_buffers(rows)
            self._ops.reserve_decode_batch(rows, cfg.n_heads, cfg.head_dim)

    def decode_batch(self, caches, tokens, positions, depth: int | None = None,
                     sampling=None, graphs=None):
        """One decode step of B requests together: row i embeds ``tokens[i]`` at position
        ``positions[i]`` of request ``caches[i]`` (its own RuntimeKVCache: block tables,
        pages, position), runs the looped stack and the head.

        The projections, RMSNorm, SwiGLU and the head run over the B rows as one T = B
        product (``ops.linear*``: on CUDA the prefill GEMM path, which reads each weight once
        per step); RoPE + the K/V write and attention run as one batch call each per layer
        slot (``ops.kv_write_batch`` / ``ops.kv_attention_batch``: row i at its own position
        over its own request's block table, read on the CUDA backend from a device index
        uploaded once per step; the store-h modes loop over the rows at T = 1). Each row's
        K/V goes into its own request's pages
        (``RuntimeKVCache.ensure`` gains the page first). A batch of more rows than the
        scratch buffers hold runs as consecutive sub-batches. Uses the residual rows
        ``buffers.main[0:B]`` as its batch rows (every request step, this one included, runs
        its forward and head inside one hold of the model's lock, so no request needs its
        residual rows across two holds). On the NumPy backend row i equals a solo decode
        step of request i (``forward`` of one id, then ``head``) bit for bit: its products
        run one row at a time (``NumpyOps._matmul``), so rows do not depend on B.

        ``tokens``: B ints in 0..vocab-1; ``positions``: B ints, ``positions[i]`` below
        ``caches[i].capacity``, the caches all at ``depth`` (default their depth) with one
        kv_mode (the scheduler groups requests by both). ``sampling``: None -> returns the
        logits, float32 ``[B, vocab]`` (host); else B tuples ``(temperature, top_k, top_p,
        u)`` -> returns a list of B next-token ids (``numpy_ops.sample_from_logits``'s rule,
        ``Ops.sample``), where a row whose logits are not finite holds its
        NonFiniteLogitsError instead, so one bad request does not end the others.
        ``graphs``: this model's ``graphs.DecodeGraphs``, to run each sub-batch as its
        captured batch step where ``DecodeGraphs.batch_eligible`` (the same launches, so the
        same results; greedy rows then take the step's device argmax). Raises
        ConfigError for mismatched lengths, mixed depths or kv modes, a cache given twice or
        a position outside its cache, TokenizerError for an id outside the vocabulary,
        ModelFreedError after free, HandleError for a released cache, OutOfMemoryError when a
        page does not fit. Takes the model's lock for the step. It is
        :meth:`decode_batch_finish` of :meth:`decode_batch_start`.
        """
        with self._lock:
            return self.decode_batch_finish(self.decode_batch_start(
                caches, tokens, positions, depth, sampling, graphs))

    def decode_batch_start(self, caches, tokens, positions, depth: int | None = None,
                           sampling=None, graphs=None, prepared=None) -> "PendingBatch":
        """Launch :meth:`decode_batch`'s step and return at once, before the device has run
        it: a :class:`PendingBatch` whose ids :meth:`decode_batch_finish` reads. The host may
        do other work meanwhile (the serving engine streams the previous step's text and
        prepares the next step), so a step's device time and the host's per-step work
        overlap. Only a captured step of at most one sub-batch with ``sampling`` given runs
        asynchronously (nothing of it is read on the host before the finish); any other batch
        is computed here and its finish returns at once. The caller holds the model's lock
        from the start to the finish (the step's buffers are the model's), and one batch at a
        time is in flight: a second start before the finish raises ConfigError.
        ``prepared``: what :meth:`decode_batch_prepare` made for these caches and positions
        (ConfigError for others), so only the token ids are checked and the inputs uploaded
        here. The other arguments, checks and errors are :meth:`decode_batch`'s."""
        caches = list(caches)
        b = len(caches)
        pos = [int(p) for p in positions]
        if len(tokens) != b or (sampling is not None and len(sampling) != b):
            raise ConfigError(f"decode_batch: caches ({b}), tokens ({len(tokens)})"
                              + ("" if sampling is None else f", sampling ({len(sampling)})")
                              + " must have one entry per request")
        with self._lock:
            self.check_alive()
            if self._pending_batch is not None:
                raise ConfigError("decode_batch_start: a decode batch is in flight; "
                                  "decode_batch_finish it first")
            if prepared is not None:
                if (sampling is None or prepared.caches[:prepared.n] != caches
                        or prepared.positions[:prepared.n] != pos
                        or (depth is not None and depth != prepared.depth)):
                    raise ConfigError("decode_batch_start: the prepared batch is for other "
                                      "caches, positions or depth (or sampling is None)")
                for c in caches:
                    c.check_alive()
                ids = self.check_token_ids(tokens, "tokens")
                pending = self._launch_prepared(prepared, ids, sampling)
                self._pending_batch = pending
                return pending
            ids = self.check_token_ids(tokens, "tokens")
            depth, graphs = self._check_batch(caches, pos, depth, graphs)
            rows = min(b, self._buf.capacity_rows)
            if graphs is not None and sampling is not None and b <= rows:
                pending = self._launch_prepared(
                    self._prepare_batch_graph(graphs, caches, pos, depth), ids, sampling)
            elif graphs is not None:
                pending = PendingBatch(result=self._decode_batch_graphs(
                    graphs, caches, ids, pos, depth, sampling, rows))
            else:
                pending = PendingBatch(result=self._decode_batch_eager(
                    caches, ids, pos, depth, sampling, rows))
            self._pending_batch = pending
            return pending

    def decode_batch_prepare(self, caches, positions, depth: int | None = None,
                             graphs=None):
        """The host half of a later :meth:`decode_batch_start` over ``caches`` at
        ``positions`` (as it takes them): checks them, gains each cache's page for its
        position (``RuntimeKVCache.ensure``), and builds the step's index and graph key on the
        host, so the start only checks the token ids, uploads and replays. Runs while another
        batch is in flight (it reads nothing that batch writes; a page gained then waits for
        that batch before its block table upload). Returns a :class:`PreparedBatch`, or None
        for a batch the start would not run as one captured sub-batch (graphs off, a mode
        the backend does not capture, more rows than the scratch holds) and, while a batch
        is in flight, for one that needs larger batch buffers (``DecodeGraphs.batch_buffers``:
        growing them frees the in-flight batch's; ``Model.reserve_decode_batch`` sizes them
        ahead). Raises as
        :meth:`decode_batch` for the caches and positions; OutOfMemoryError when a page does
        not fit (the pages gained before it stay with their caches)."""
        caches = list(caches)
        pos = [int(p) for p in positions]
        with self._lock:
            self.check_alive()
            depth, graphs = self._check_batch(caches, pos, depth, graphs)
            cap = self._buf.capacity_rows
            if graphs is None or len(caches) > cap:
                return None
            if self._pending_batch is not None and (
                    graphs.batch_logits is None
                    or graphs.batch_logits.shape[0] < graphs.bucket(len(caches), cap)):
                return None         # growing the batch buffers would free the in-flight's
            return self._prepare_batch_graph(graphs, caches, pos, depth)

    def _check_batch(self, caches: list, pos: list, depth, graphs) -> tuple:
        """``decode_batch``'s checks of the caches and positions, each cache's page for its
        position gained; returns (depth, graphs or None where the batch does not run as a
        graph)."""
        b = len(caches)
        if b == 0:
            raise ConfigError("decode_batch needs at least one request (caches is empty)")
        if len(pos) != b:
            raise ConfigError(f"decode_batch: caches ({b}) and positions ({len(pos)}) must "
                              "have one entry per request")
        depth = caches[0].depth if depth is None else self.config.check_depth(depth)
        if len({id(c) for c in caches}) != b:
            raise ConfigError("decode_batch: a request's cache appears twice in one batch")
        modes = caches[0].modes
        for i, (c, p) in enumerate(zip(caches, pos)):
            if c.depth != depth or c.modes != modes:
                raise ConfigError(
                    f"decode_batch: request {i} is at depth {c.depth}, kv_mode "
                    f"{c.mode!r}; the batch runs depth {depth}, kv_mode "
                    f"{caches[0].mode!r} (group requests by depth and kv_mode)")
            if not 0 <= p < c.capacity:
                raise ConfigError(f"decode_batch: positions[{i}]={p} is outside its "
                                  f"cache's 0..{c.capacity - 1}")
        for c, p in zip(caches, pos):
            c.ensure(p + 1)
        self._check_loop_depth(depth)
        if graphs is not None and not graphs.batch_eligible(caches[0]):
            graphs = None
        return depth, graphs

    def _decode_batch_eager(self, caches, ids, pos, depth: int, sampling, rows: int):
        """``decode_batch`` launch by launch (no captured step), sub-batch by sub-batch."""
        b = len(caches)
        vocab = self.config.vocab_size
        block, blk = self._ops.empty(self._pool, (rows, vocab), np.float32, "logits")
        try:
            out = None if sampling is not None else np.empty((b, vocab), np.float32)
            picked = []
            for b0 in range(0, b, rows):
                n = min(rows, b - b0)
                logits = block[:n]
                batch = self._batch_inputs(ids[b0:b0 + n], pos[b0:b0 + n], depth,
                                           caches[b0:b0 + n])
                self._decode_rows_ops(batch, depth, logits)
                for hook in self._rows_hooks:       # eager rows (watch_forward)
                    for p in pos[b0:b0 + n]:
                        hook(p, 1)
                if sampling is None:
                    out[b0:b0 + n] = self._ops.to_host(logits)
                    continue
                picked.extend(self._ops.sample_rows(
                    logits, [(i, *sampling[b0 + i]) for i in range(n)]))
        finally:
            self._pool.free(blk)
        return out if sampling is None else picked

    def decode_batch_finish(self, pending: "PendingBatch"):
        """The result of the step :meth:`decode_batch_start` launched (what
        :meth:`decode_batch` returns): waits for the device, reads the greedy rows' argmax and
        draws the sampled rows (``Ops.sample_rows``). Finishing it again returns the same
        result. Raises ConfigError for a batch this model does not have in flight (and
        ModelFreedError once the model is freed)."""
        with self._lock:
            if pending is self._pending_batch:
                self._pending_batch = None
                if pending.result is None:
                    pending.result = self._read_batch_graph(pending)
            elif pending.result is None:
                self.check_alive()
                raise ConfigError("decode_batch_finish: this model has no such batch in "
                                  "flight")
            return pending.result

    def _prepare_batch_graph(self, graphs, caches, pos, depth: int) -> "PreparedBatch":
        """One sub-batch's captured step up to its inputs: padded to ``DecodeGraphs.bucket``
        rows with copies of its first row, its host index (``kv.cache.batch_index``), graph
        key, and the host staging and device views its inputs go through."""
        n, cap = len(caches), self._buf.capacity_rows
        nb = graphs.bucket(n, cap)              # padded with copies of the first row
        logits_all, host_ids = graphs.batch_buffers(nb)
        sub = caches + [caches[0]] * (nb - n)
        spos = pos + [pos[0]] * (nb - n)
        index = batch_index(sub, spos, self.config.n_slots(depth))
        key = graphs.batch_key(sub[0], nb, max(spos) + 1)
        stage_ids, stage_index = self._batch_stage()
        dev_index = self._buf.flat("batch_index")[:index.size].reshape(index.shape)
        return PreparedBatch(graphs, sub, spos, n, depth, index, key, logits_all, host_ids,
                             graphs.batch_logits, stage_ids[:nb],
                             stage_index[:index.size].reshape(index.shape),
                             self._views(nb)["ids"], dev_index)

    def _batch_stage(self) -> tuple:
        """(int32 [capacity rows], int64 [the device batch index's size]): host views of
        ``Ops.batch_host_inputs`` a captured decode batch stages its token ids and index in
        (its copy nodes read them at every replay); made once, so they never move."""
        if self._stage is None:
            n_ids, n_index = self._buf.capacity_rows, self._buf.flat("batch_index").size
            off = -(-4 * n_ids // 16) * 16
            raw = self._ops.batch_host_inputs(off + 8 * n_index)
            self._stage = (raw[:4 * n_ids].view(np.int32),
                           raw[off:off + 8 * n_index].view(np.int64))
        return self._stage

    def _launch_prepared(self, p: "PreparedBatch", ids, sampling) -> "PendingBatch":
        """Stage ``p``'s token ids (padded as its rows) and index, and replay its captured
        step, whose first launches copy them to the device (``_decode_batch_graphs`` for one
        sub-batch, up to its synchronisation). The step before has finished: nothing reads
        the staging meanwhile."""
        if p.graphs.batch_logits is not p.owner:         # the buffers grew since: new views
            p = self._prepare_batch_graph(p.graphs, p.caches[:p.n], p.positions[:p.n],
                                          p.depth)
        p.stage_ids[:p.n] = ids
        p.stage_ids[p.n:] = ids[0]
        p.stage_index[...] = p.index
        batch = BatchRows(p.caches, p.positions, p.dev_index)
        ops, logits, host_ids = self._ops, p.logits, p.host_ids

        def issue():
            ops.copy_host_inputs(p.stage_ids, p.dev_ids)
            ops.copy_host_inputs(p.stage_index, p.dev_index)
            self._decode_rows_ops(batch, p.depth, logits, host_ids)
        p.graphs.run_batch(p.key, issue)
        return PendingBatch(logits=logits[:p.n], host_ids=host_ids[:p.n], sampling=sampling)

    def _read_batch_graph(self, pending: "PendingBatch") -> list:
        """Synchronise, then every row's id: greedy rows take the step's device argmax, the
        others are drawn from their logits rows (``Ops.sample_rows``)."""
        ops, sampling, hid = self._ops, pending.sampling, pending.host_ids
        ops.graph_sync()
        n = len(sampling)
        got: list = [None] * n
        drawn = []
        for i, (nxt, code) in enumerate(hid[:n].tolist()):
            if not _greedy(sampling[i]):
                drawn.append(i)
                continue
            got[i] = nxt if not code else non_finite_logits(LOGIT_FAULTS[code])
        if drawn:
            for i, g in zip(drawn, ops.sample_rows(pending.logits,
                                                   [(i, *sampling[i]) for i in drawn])):
                got[i] = g
        return got

    def _decode_batch_graphs(self, graphs, caches, ids, pos, depth: int, sampling, rows: int):
        """``decode_batch`` through the captured batch step (``graphs.DecodeGraphs
        .run_batch``): per sub-batch of at most ``rows`` rows, padded to
        ``DecodeGraphs.bucket`` rows with copies of its first row (same id, position and
        cache: they write that row's own K/V values again, and their logits are not read),
        the inputs are staged (``_launch_prepared``), the step (their copies, stack, head into
        the held logits, the rows' argmax into mapped host memory) replays, and after one
        synchronisation greedy rows
        take their argmax; the others are drawn from their logits rows (``Ops.sample_rows``:
        on CUDA queued together, one more synchronisation)."""
        b, ops = len(caches), self._ops
        out = None if sampling is not None else np.empty((b, self.config.vocab_size), np.float32)
        picked = []
        for b0 in range(0, b, rows):            # the first sub-batch sizes the buffers
            n = min(rows, b - b0)
            pending = self._launch_prepared(
                self._prepare_batch_graph(graphs, caches[b0:b0 + n], pos[b0:b0 + n], depth),
                ids[b0:b0 + n], None if sampling is None else sampling[b0:b0 + n])
            if sampling is None:
                ops.graph_sync()
                out[b0:b0 + n] = ops.to_host(pending.logits)
            else:
                picked.extend(self._read_batch_graph(pending))
        return out if sampling is None else picked

    def _batch_inputs(self, ids, positions, depth: int, caches) -> BatchRows:
        """Upload one decode sub-batch's token ids (the scratch ``ids``) and its index
        (``_batch_index``); returns its BatchRows."""
        n = len(ids)
        self._ops.from_host(np.ascontiguousarray(ids, dtype=np.int32), self._views(n)["ids"])
        return BatchRows(caches, positions, self._batch_index(caches, positions, depth))

    def _decode_rows_ops(self, batch: BatchRows, depth: int, logits, host_ids=None) -> None:
        """The launches of one decode sub-batch (inputs uploaded by ``_batch_inputs``;
        nothing read on the host, nothing allocated, so ``graphs`` captures them): embed,
        stack, head into ``logits`` f32 [n, vocab], and with ``host_ids`` every row's argmax
        there (``Ops.argmax_rows``)."""
        cfg, ops = self.config, self._ops
        n = len(batch.positions)
        v = self._views(n)
        x = self._buf.main[:n]
        with ops.decode_batch_scope():
            ops.embed(self._embed, v["ids"], x)
            if cfg.embed_scale != 1.0:
                ops.scale(x, cfg.embed_scale)
            self._stack(x, v, depth, batch.kv_of, batch, None)
            ops.rmsnorm_lm_head(x, self._output_norm, cfg.norm_eps, self._head, logits,
                                v["norm"])
            if host_ids is not None:
                ops.argmax_rows(logits, host_ids)

    def _batch_index(self, caches, positions, depth: int):
        """The device copy of ``kv.cache.batch_index`` for one decode sub-batch: int64
        [1 + n_slots(depth), B], a view of the BufferPool's ``batch_index`` (sized for the
        scratch rows at max_depth), filled with one host -> device copy."""
        host = batch_index(caches, positions, self.config.n_slots(depth))
        dev = self._buf.flat("batch_index")[:host.size].reshape(host.shape)
        self._ops.from_host(host, dev)
        return dev

    def graph_stats(self) -> dict:
        """What the captured decode steps hold: ``graphs`` (count), ``bytes`` (tag
        ``graphs``), ``keys``, ``captures``, ``replays`` (``graphs.DecodeGraphs.stats``)."""
        graphs = self._extras.get("decode_graphs")
        if graphs is None:
            return {"graphs": 0, "keys": [], "captures": 0, "replays": 0, "bytes": 0}
        return graphs.stats()

    # -- public request API -------------------------------------------------------------------
    def logits(self, token_ids, depth: int | None = None, kv_mode=None, *, prefix=None,
               prefix_pool=None, kv_iterations=None) -> np.ndarray:
        """Next-token logits at every position (teacher forcing).

        ``token_ids``: 1-D ints, 1 <= T <= max_seq_len, or text (encoded as generate does;
        an empty prompt is [BOS]: :meth:`encode_prompt`). Returns float32 ``[T, vocab]``: row t
        is the distribution of token t+1 given tokens 0..t. Honours prefill_chunk (chunk by
        chunk). Attention reads what the KV cache stores (``kv_mode``: this call's storage
        mode, default the load's), so the logits show a mode's true quality. ``prefix``
        (PrefixCache / ResumeHandle the ids start with) or ``prefix_pool`` (PrefixPool):
        positions that come from the cache are not recomputed (their rows come from the cached
        residuals through the head). ``kv_iterations``: the iteration KV policy (default the
        load's; :meth:`new_kv_cache`). Raises ConfigError / TokenizerError on bad input,
        ModelFreedError after free, HandleError for a released handle.
        """
        return teacher_forced_logits(self, token_ids, depth, kv_mode, prefix=prefix,
                                     prefix_pool=prefix_pool, kv_iterations=kv_iterations)

    def score(self, token_ids, depth: int | None = None, kv_mode=None, *, prefix=None,
              prefix_pool=None, kv_iterations=None) -> np.ndarray:
        """float64 ``[T-1]``: log p(token[t+1] | tokens[0..t]) under the model (T >= 2;
        ``token_ids`` as in :meth:`logits`, so an empty one is [BOS], T = 1: ConfigError).
        ``kv_mode`` / ``prefix`` / ``prefix_pool`` as in :meth:`logits`."""
        return _score(self, token_ids, depth, kv_mode, prefix=prefix, prefix_pool=prefix_pool,
                      kv_iterations=kv_iterations)

    @property
    def end_of_generation_ids(self) -> frozenset:
        """The token ids whose sampling ends a generation (finish reason "eos"): the
        config's ``eos_token_id``, the tokenizer's ``eog_ids`` (llama.cpp's rule,
        :func:`tinyloop.tokenizer.end_of_generation_ids`) and the metadata's
        ``eos_token_ids`` (a Hugging Face folder's generation_config.json)."""
        eos = self.config.eos_token_id
        return self._stop_ids | ({eos} if eos >= 0 else set())

    def is_end_of_generation(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of :attr:`end_of_generation_ids`."""
        return token_id == self.config.eos_token_id or token_id in self._stop_ids

    def generate(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 depth: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, stop=None, kv_mode=None, *, prefix=None,
                 prefix_pool=None, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 repeat_last_n: int = DEFAULT_REPEAT_LAST_N, kv_iterations=None,
                 exit_rule=None, exit_threshold=None, max_depth=None, ignore_eos: bool = False):
        """Generate up to ``max_new_tokens`` tokens; returns a GenerationResult (new token ids,
        text, finish reason, timings, ``cached_tokens``). ``prompt`` is text or token ids
        (an empty one is [BOS]: :meth:`encode_prompt`). ``prefix`` / ``prefix_pool``: start
        from cached state (see :mod:`tinyloop.kv.handles`, :mod:`tinyloop.kv.pool`).
        ``min_p``, ``repetition_penalty`` over the last ``repeat_last_n`` tokens: see
        :func:`tinyloop.generate.stream` for the sampling rule, and for the errors.
        ``depth="auto"`` with ``exit_rule`` / ``exit_threshold`` / ``max_depth``: per-token
        adaptive depth (:mod:`tinyloop.adaptive`); ``kv_iterations``: "all" | "latest";
        ``ignore_eos``: decode past the end-of-generation tokens
        (:meth:`is_end_of_generation`; a benchmark's fixed token count)."""
        return _generate(self, prompt, max_new_tokens=max_new_tokens, depth=depth,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                         kv_mode=kv_mode, prefix=prefix, prefix_pool=prefix_pool, min_p=min_p,
                         repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n,
                         kv_iterations=kv_iterations, exit_rule=exit_rule,
                         exit_threshold=exit_threshold, max_depth=max_depth,
                         ignore_eos=ignore_eos)

    def stream(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               depth: int | None = None,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, stop=None, kv_mode=None, *, prefix=None,
               prefix_pool=None, min_p: float = 0.0, repetition_penalty: float = 1.0,
               repeat_last_n: int = DEFAULT_REPEAT_LAST_N, kv_iterations=None,
               exit_rule=None, exit_threshold=None, max_depth=None, ignore_eos: bool = False):
        """Streaming form of :meth:`generate`: returns a :class:`~tinyloop.generate.Stream`
        of ``StreamToken(token_id, text, finish_reason)``, one as each token is sampled
        (``text`` is the newly decodable text, possibly empty); the ids and texts are
        generate's, and ``.result`` / ``.finish_reason`` say how it ended. Arguments are
        checked at the call, as generate checks them."""
        return _stream(self, prompt, max_new_tokens=max_new_tokens, depth=depth,
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                       kv_mode=kv_mode, prefix=prefix, prefix_pool=prefix_pool, min_p=min_p,
                       repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n,
                       kv_iterations=kv_iterations, exit_rule=exit_rule,
                       exit_threshold=exit_threshold, max_depth=max_depth,
                       ignore_eos=ignore_eos)

    # -- cached state across calls (tinyloop.kv) -----------------------------------------------
    def prefill(self, prompt, depth: int | None = None, kv_mode=None, kv_iterations=None, *,
                exit_rule=None, exit_threshold=None, max_depth=None):
        """Prefill ``prompt`` (text or ids) once and keep it: returns a
        :class:`~tinyloop.kv.PrefixCache` to pass as ``prefix=`` to generate / stream /
        logits / score, which then prefill only the tokens after it. ``depth="auto"`` with
        ``exit_rule`` / ``exit_threshold`` / ``max_depth``: the prompt at the max depth, the
        handle keyed by the rule (only depth="auto" requests under that rule take it; see
        :func:`tinyloop.generate.make_prefix`). Raises ConfigError / TokenizerError on bad
        input, OutOfMemoryError (nothing stays allocated)."""
        return make_prefix(self, prompt, depth, kv_mode, kv_iterations, exit_rule,
                           exit_threshold, max_depth)

    def resume_handle(self, prompt, depth: int | None = None, max_depth: int | None = None,
                      kv_mode=None, kv_iterations=None):
        """Prefill ``prompt`` at ``depth`` keeping, for every position, the residual state the
        recurrent block continues from and K/V room for ``max_depth`` iterations (default: the
        model's): returns a :class:`~tinyloop.kv.ResumeHandle`; ``rh.upgrade(d2)`` deepens
        it by running only the added iterations and the coda."""
        return make_resume_handle(self, prompt, depth, max_depth, kv_mode, kv_iterations)

    def load_prefix(self, path):
        """Load a prefix saved with ``PrefixCache.save`` / ``ResumeHandle.save`` (see
        :func:`tinyloop.kv.handles.load_prefix` and :func:`tinyloop.tlpx.read_prefix` for the
        checks and the errors)."""
        return load_prefix(self, path)

    def __repr__(self) -> str:
        c = self.config
        state = "freed" if self._freed else f"{self.vram_usage_bytes() / 2**20:.1f} MiB"
        return (f"Model({os.path.basename(self.path)!r}, backend={self.backend}, d_model="
                f"{c.d_model}, layers P/R/C={c.n_prelude}/{c.n_recurrent}/{c.n_coda}, "
                f"max_depth={c.max_depth}, {state})")


def artificial_loop_message(model: Model, depth: int) -> str:
    """One line: ``depth`` is above the default depth of a model whose loop is artificial."""
    c = model.config
    a, b = c.n_prelude, c.n_prelude + c.n_recurrent
    return (f"depth {depth} on {os.path.basename(model.path)}, whose loop is artificial: its "
            f"recurrent block (layers {a}..{b - 1}) comes from a plain model never trained "
            f"to run it more than once, so depths above {c.default_depth} degrade the text, "
            f"typically into gibberish (depth {c.default_depth} is the original model)")


def load_model(path, max_seq_len: int = 2048, prefill_chunk: int = 0, *,
               backend: str = "auto", kv_mode=None, kernels=None,
               kv_iterations: str = "all") -> Model:
    """Load a .tlm model, phase by phase (the lifecycle and memory contract,
    docs/architecture.md).

    Args: ``path`` to a .tlm file, or to a llama GGUF file, which is converted once into the
    cache folder as a plain model (``tinyloop.default.model_file``; ConversionError when the
    converter refuses it); ``max_seq_len`` (positions, >= 1); ``prefill_chunk`` (0 =
    scratch buffers sequence-wide; > 0 = chunk-wide, prefill runs chunk by chunk);
    ``backend`` "auto" | "cuda" | "numpy"; ``kv_mode``: the KV cache storage mode of every
    request (a name from ``tinyloop.config.KV_MODES``, "auto", a dict ``{"prelude": m,
    "recurrent": m, "coda": m}`` or one mode per physical layer; default
    ``TINYLOOP_KV_MODE``, else "fp16"; docs/kv_modes.md compares them); ``kernels``: the
    CUDA kernel variants (``tinyloop.backends.cuda.KernelChoice``, for tests and
    benchmarks; None: the defaults; a non-default choice on the NumPy backend raises
    ConfigError); ``kv_iterations``: the requests' default iteration KV policy ("all": one
    K/V slot per recurrent layer and iteration; "latest": one per recurrent layer, each
    iteration overwriting it; ``tinyloop.kv.layouts.KV_ITERATIONS`` says what each reads).
    Raises a TinyLoopError subclass naming the cause (FormatError family, ConfigError,
    OutOfMemoryError, BackendUnavailableError); on failure nothing stays allocated.
    A folder (Hugging Face config.json + .safetensors of Ouro, Huginn or Nanbeige) is
    converted once into the cache folder (INT4, group 32: ``convert.hf.cached_folder_conversion``,
    ConversionError on a bad checkpoint) and that .tlm file is loaded.
    """
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise TinyLoopError(f"model path is not a file: {os.fspath(path)} (a folder loads "
                                "only as a Hugging Face checkpoint, with its config.json)")
        from .convert.hf import cached_folder_conversion
        path = cached_folder_conversion(path)
    from .default import model_file
    return Model(model_file(path), max_seq_len, prefill_chunk, backend=backend, kv_mode=kv_mode,
                 kernels=kernels, kv_iterations=kv_iterations)


def _check_model(model) -> Model:
    if not isinstance(model, Model):
        raise ConfigError(f"expected a tinyloop Model, got {type(model).__name__}")
    return model


def free_model(model: Model) -> None:
    """Free every byte the model owns, and what its open streams and prefix handles hold
    (idempotent): allocated returns to its value before the load. The model, its handles and
    its streams are unusable afterwards (ModelFreedError / HandleError). Raises ConfigError
    when ``model`` is not a Model."""
    _check_model(model).free()


def vram_usage_bytes(model: Model) -> int:
    """Bytes the model owns in the pool (0 after free_model). Raises ConfigError when
    ``model`` is not a Model."""
    return _check_model(model).vram_usage_bytes()
