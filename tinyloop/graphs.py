"""The captured decode step: one graph per key, replayed for every decode step of a request
(docs/architecture.md "The captured decode step").

A decode step reads its token id and position from a small device **step state** (int32
``[STEP_WORDS]``, ``backends.base``): embed reads ``STEP_ID``; the KV write and attention read
``STEP_POS`` (context length = pos + 1); the head writes the next id (and the row's fault code)
back - the fused greedy argmax, or with temperature > 0 (or a repetition penalty) the device
sampler, whose parameters (temperature, top_k, top_p, min_p, the penalty and the host-drawn u)
the host writes to pinned memory before each replay (``Ops.set_step_sampling``) - and
``step_advance`` moves the position on. The penalty's window of recent tokens is a device ring
the step keeps itself (each step stores its input token, ``Ops.set_step_window``), filled by
the host only when it writes the step state. Nothing of
the step is read or computed on the host, so the launches of one step can be captured once (CuPy stream capture on
CUDA: ``Stream.begin_capture`` / ``end_capture``, then ``Graph.launch``) and replayed; the host
reads the 8-byte (id, fault) result after each replay, for stop / EOS / streaming.

Every address a captured step touches is fixed while its graph lives: the step state and the
decode residual row (one pool block, tag ``graphs``), the model's scratch views and logit row,
the weights, and per graph a block table ``[slots, ceil(max_seq_len / P)]`` (tag ``graphs``):
a request binds a graph by copying its own block tables there (after allocating pages for its
whole capacity, ``RuntimeKVCache.ensure``), so one graph serves every request with its key.

**Key**: (depth, the KV mode of every slot, page size, the iteration KV policy
(``kv.layouts.KV_ITERATIONS``), pages per table, the backend's host-chosen launch constants,
``Ops.graph_constants``, whether the repetition penalty runs, and greedy or sampled). A graph
is replayed only under the key it was captured with; other keys get their own graph (at most
``MAX_GRAPHS``, least recently used dropped first). The decode attention reads the context
length on the device with a fixed grid, so no length bucket enters the key.

**depth="auto"** (``step_auto``): the exit is decided on the host after every iteration, so
such a step is no single graph: its parts (``Model.auto_step_ops``: the prelude, each
recurrent iteration, the "kl" rule's probe, the coda and head) are captured one graph each
under the step's key plus ("auto", rule), and the host reads the state back between
iterations.

**A decode batch** (``run_batch``, ``Model.decode_batch``): the B rows' step, padded to
``batch_bucket(B)`` rows by repeating its first row (the copies write that row's K/V values
to its own slot again and their logits are dropped), is captured per batch key - (padded B,
depth, the KV modes, page size, iteration policy, launch constants, and the
attention's split counts, ``Ops.batch_attention_key``, a function of the longest context's
power-of-two bucket) - in fp16 / int8 pages (the store-h modes loop over rows on the host).
Its inputs are fixed buffers the host fills before each replay: the token ids (the model's
scratch), the step's index of positions and block-table addresses (``kv.cache.batch_index``,
the BufferPool's ``batch_index``); it ends in the logits ``[B, vocab]`` of one block held
here (tag ``graphs``, ``batch_buffers``) and ``Ops.argmax_rows`` into mapped host memory, so
one replay and one synchronisation give every row's greedy id (the other rows are drawn from
the logits after it, ``Ops.sample_rows``). At most ``MAX_BATCH_GRAPHS`` batch keys are kept (LRU).

**Rules**: the first step under a new key runs the same launches eagerly (kernels load, every
argument is validated with an ordinary error); the next step captures. The pool must make no
allocation between capture begin and end (checked from its counters: a capture that allocated
is discarded and raises); a failure during capture ends the capture (``Ops.graph_abort``) and
leaves the stream usable. ``release`` frees every graph and its ``graphs`` blocks.
``TINYLOOP_CUDA_GRAPHS=0`` (``config.cuda_graphs_enabled``) keeps the eager path.
"""

from __future__ import annotations

import collections
import weakref

import numpy as np

from .backends.base import LOGIT_FAULTS, STEP_ID, STEP_POS, STEP_WORDS, non_finite_logits
from .config import cuda_graphs_enabled
from .errors import ConfigError, GraphCaptureError
from .kv.cache import SlotKV
from .memory import packed_scope

MAX_GRAPHS = 16       # graphs kept per model (keys: depth x KV modes; LRU beyond this)
MAX_BATCH_GRAPHS = 64  # decode-batch graphs kept per model (keys: batch size x ...; LRU)


def batch_bucket(rows: int, cap: int) -> int:
    """The row count a captured decode batch of ``rows`` rows runs at: 1, 2, then multiples
    of 4, at most ``cap`` (the model's scratch rows). The extra rows repeat the first row
    (``Model.decode_batch``), so a batch whose size moves step by step (requests starting and
    ending) reuses a few graphs instead of capturing one per size."""
    rows = int(rows)
    return min(int(cap), rows if rows <= 2 else -(-rows // 4) * 4)


class _Entry:
    """One key's graphs and its block table (tag ``graphs``)."""

    __slots__ = ("graphs", "warm", "table", "table_block", "table_host", "slots", "bound")

    def __init__(self):
        # by part: "step" (the whole decode step), or depth="auto"'s parts (step_auto)
        self.graphs: dict = {}
        self.warm: set = set()     # the parts run eagerly once under this key
        self.table = self.table_block = self.table_host = None
        self.slots: list = []
        self.bound = None          # weakref to the RuntimeKVCache whose tables are copied in


class DecodeGraphs:
    """The captured decode steps of one Model (see the module doc). Not locked: the Model's
    lock serialises every call."""

    def __init__(self, model):
        self._model = model
        self._ops = model.ops
        self._pool = model.pool
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._state_block = None
        self.step_state = None          # int32 [STEP_WORDS] device array
        self.row = None                 # f32 [1, d_model]: the decode residual row
        self._host_out = None
        self._keep = None               # f32 [1, d_model]: the "kl" rule's copy of the state
        self._batch: collections.OrderedDict = collections.OrderedDict()   # batch keys
        cfg = model.config              # the layers' attention windows (0 = full attention)
        self._windows = tuple(sorted({cfg.window(li) for li in range(cfg.n_layers)}))
        self._batch_block = None        # the decode batch's logits (tag graphs)
        self.batch_logits = None        # f32 [rows, vocab] device array
        self.batch_ids = None           # int32 [rows, 2] host (Ops.batch_host_ids)
        self._expect = None             # (owner ref, id, pos, window) the device state holds
        self.captures = 0               # graphs captured since load
        self.replays = 0

    # --- policy ---------------------------------------------------------------------------
    def eligible(self, cache, temperature: float) -> bool:
        """Whether a step of ``cache``'s request runs as a graph: graphs on (``TINYLOOP_CUDA_GRAPHS``), greedy or a backend that samples inside the
        step (``Ops.graph_sampling``), and every slot's KV mode capturable here."""
        if not self._ops.graph_kv_modes:
            return False
        if temperature > 0.0 and not self._ops.graph_sampling:
            return False
        if not set(cache.modes) <= set(self._ops.graph_kv_modes):
            return False
        return cuda_graphs_enabled()

    def key(self, cache, sampled: bool = False, penalized: bool = False) -> tuple:
        """The graph key of a step of ``cache``'s request (see the module doc); ``sampled``:
        the step ends in the device sampler instead of the argmax (temperature > 0 or a
        penalty); ``penalized``: the repetition penalty runs before it."""
        return (cache.depth, tuple(lay.mode for lay in cache.layouts), cache.page_size,
                cache.kv_iterations, self._pages(cache.page_size), self._ops.graph_constants(),
                bool(penalized), bool(sampled))

    def _pages(self, page_size: int) -> int:
        return -(-self._model.max_seq_len // page_size)

    # --- memory ---------------------------------------------------------------------------
    def _ensure_state(self) -> None:
        if self._state_block is not None:
            return
        d = self._model.config.d_model
        ops = self._ops
        with packed_scope():
            blk = self._pool.allocate(STEP_WORDS * 4 + 16 + 2 * d * 4, "graphs")
        try:
            self.step_state = blk.array((STEP_WORDS,), np.int32)
            off = (STEP_WORDS * 4 + 16) // 4        # the row starts 16-byte aligned
            self.row = blk.array((off + 2 * d,), np.float32)[off:off + d].reshape(1, d)
            self._keep = blk.array((off + 2 * d,), np.float32)[off + d:].reshape(1, d)
            ops.zero(self.step_state)
            self._host_out = ops.step_host_buffer()
        except BaseException:
            self._pool.free(blk)
            raise
        self._state_block = blk

    def _entry(self, key, cache) -> _Entry:
        ent = self._entries.get(key)
        if ent is not None:
            self._entries.move_to_end(key)
            return ent
        while len(self._entries) >= MAX_GRAPHS:
            _, old = self._entries.popitem(last=False)
            self._free_entry(old)
        ent = _Entry()
        shape = (cache.n_slots, self._pages(cache.page_size))
        with packed_scope():
            ent.table, ent.table_block = self._ops.empty(self._pool, shape, np.int64, "graphs")
        ent.table_host = np.zeros(shape, np.int64)
        own = [SlotKV(cache.layouts[s], ent.table[s], ent.table_host[s],
                      cache.slot(s).allocator) for s in range(cache.n_slots)]
        ent.slots = [own[s] for s in cache.slot_of]      # by the forward's slot names
        self._entries[key] = ent
        return ent

    def _free_entry(self, ent: _Entry) -> None:
        graphs = list(ent.graphs.values())
        ent.graphs = {}
        for g in graphs:
            # the executable graph's device memory goes with the last reference: measured,
            # as its instantiation was, so the "cuda graphs" line follows what is held
            with self._pool.measure_driver("cuda graphs"):
                self._ops.graph_free(g)
            del g
        del graphs
        ent.slots = []
        ent.table = None
        blk, ent.table_block = ent.table_block, None
        if blk is not None:
            self._pool.free(blk)

    def release(self) -> None:
        """Free every graph and every ``graphs`` block (after the stream is idle)."""
        self._ops.synchronize()
        entries, self._entries = list(self._entries.values()), collections.OrderedDict()
        for ent in entries:
            self._free_entry(ent)
        self._drop_batch()
        self.step_state = self.row = self._keep = None
        self._expect = None
        blk, self._state_block = self._state_block, None
        if blk is not None:
            self._pool.free(blk)

    @property
    def nbytes(self) -> int:
        """Pool bytes held under tag ``graphs`` (``stats()["bytes"]``)."""
        return self.stats()["bytes"]

    def stats(self) -> dict:
        """``graphs``: graphs held; ``keys``: their keys; ``captures`` / ``replays`` since
        load; ``bytes``: pool bytes under tag ``graphs`` held for them (rounded blocks)."""
        nbytes = sum(e.table_block.nbytes for e in self._entries.values())
        for blk in (self._state_block, self._batch_block):
            nbytes += blk.nbytes if blk is not None else 0
        return {"graphs": sum(len(e.graphs) for e in self._entries.values())
                + sum(len(e.graphs) for e in self._batch.values()),
                "keys": list(self._entries) + list(self._batch), "captures": self.captures,
                "replays": self.replays, "bytes": nbytes}

    def captured(self, cache, sampled: bool = False, penalized: bool = False):
        """The graph captured for ``cache``'s key (``key(cache, sampled, penalized)``), or None
        before the key's second step: what a benchmark replays to time the step alone."""
        ent = self._entries.get(self.key(cache, sampled, penalized))
        return None if ent is None else ent.graphs.get("step")

    def forget_device_state(self) -> None:
        """Mark the device step state unknown (a caller launched a captured graph outside
        ``step``, which advanced it): the next ``step`` writes its token and position."""
        self._expect = None

    # --- the step -------------------------------------------------------------------------
    def _bind(self, ent: _Entry, cache) -> None:
        """Copy ``cache``'s block tables into the entry's (pages for its whole capacity)."""
        cache.ensure(cache.capacity)
        n = cache.max_pages
        ent.table_host[...] = 0
        ent.table_host[:, :n] = cache.table_host
        self._ops.from_host(ent.table_host, ent.table)
        ent.bound = weakref.ref(cache)

    def step(self, cache, token: int, pos: int, sampling: tuple | None = None,
             window=None) -> tuple[int, int]:
        """One decode step of ``cache``'s request: embed ``token`` at position ``pos``, every
        slot, the head; returns (next id, fault code: 0 or a ``LOGIT_FAULTS`` key). Greedy, or
        with ``sampling`` = (temperature, top_k, top_p, u[, min_p, repetition_penalty,
        repeat_last_n]) sampled by the device sampler: the parameters go to
        ``Ops.set_step_sampling`` before the launch, so the graph captured for the key serves
        every setting. With the penalty on, ``window`` holds the request's tokens at positions
        pos - len + 1 .. pos (at most repeat_last_n, ``token`` last): written to the device
        ring (``Ops.set_step_window``) whenever the step state is. Run eagerly on the key's
        first use, captured on its second and replayed from then on. The caller checks
        ``eligible`` first. Raises ConfigError for ``pos`` outside the cache's capacity or sampling
        parameters out of range, GraphCaptureError for a capture that allocated, and what the
        ops raise."""
        ent, sampled, last_n = self._prepare(cache, token, pos, sampling, window)
        ops, m = self._ops, self._model
        self._run(ent, "step", lambda: m.decode_step_ops(
            self.step_state, self.row, cache.depth, ent.slots, self._host_out, sampled))
        ops.graph_sync()
        nxt, code = int(self._host_out[0]), int(self._host_out[1])
        self._expect = (weakref.ref(cache), nxt, pos + 1, last_n)
        return nxt, code

    def _prepare(self, cache, token: int, pos: int, sampling, window, auto=None):
        """What a step and a depth="auto" step share: check ``pos``, write the sampling
        parameters, find (or make) the key's entry with ``cache``'s tables bound, and write
        the device step state unless it already holds (token, pos). Returns (entry, sampled,
        repeat_last_n)."""
        if not 0 <= pos < cache.capacity:
            raise ConfigError(f"decode position {pos} is outside the request's capacity "
                              f"{cache.capacity}")
        self._ensure_state()
        sampled = sampling is not None
        if sampled:
            self._ops.set_step_sampling(*sampling)
        last_n = (int(sampling[6]) if sampled and len(sampling) > 6 and sampling[5] != 1.0
                  else 0)
        penalized = last_n > 0
        if penalized and (window is None or len(window) == 0 or int(window[-1]) != token):
            raise ConfigError("a penalised decode step needs its window of recent tokens, "
                              "ending with the step's token")
        key = self.key(cache, sampled, penalized)
        if auto is not None:
            key = key + ("auto", auto)
        ent = self._entry(key, cache)
        if ent.bound is None or ent.bound() is not cache:
            self._bind(ent, cache)
        exp = self._expect
        if (exp is None or exp[0]() is not cache or exp[1] != token or exp[2] != pos
                or exp[3] != last_n):
            state = np.zeros(STEP_WORDS, np.int32)
            state[STEP_ID], state[STEP_POS] = token, pos
            self._ops.from_host(state, self.step_state)
            if penalized:
                self._ops.set_step_window(window, pos, last_n)
        return ent, sampled, last_n

    def step_auto(self, cache, token: int, pos: int, rule, sampling: tuple | None = None,
                  window=None) -> tuple[int, int, int]:
        """One depth="auto" decode step of ``cache``'s request (a cache laid out for
        ``rule.max_depth`` iterations; ``rule`` an ``adaptive.ExitRule``): the parts of
        ``Model.auto_step_ops`` replayed as graphs of their own - the prelude, then iteration
        after iteration until ``Model.exit_decision`` exits on the state read back after each
        (and, for the "kl" rule, the logits of the "probe" part), the copy into the deeper
        slots (``Model.fill_deeper``, eager), the coda and the head. Each part runs eagerly on
        its first use under the key (the step's key plus ("auto", the rule's name)), is
        captured on its second and replayed after. ``sampling`` / ``window`` as in
        :meth:`step`. Returns (next id, fault code, depth run). Raises as :meth:`step`
        does."""
        top = rule.max_depth
        if cache.depth != top:
            raise ConfigError(f"a depth='auto' step up to {top} iterations needs a cache laid "
                              f"out for {top}, got {cache.depth}")
        ent, sampled, last_n = self._prepare(cache, token, pos, sampling, window,
                                             auto=rule.rule)
        ops, m = self._ops, self._model
        x, st, slots = self.row, self.step_state, ent.slots

        def part(name):
            self._run(ent, name, lambda: m.auto_step_ops(name, st, x, top, slots,
                                                         self._host_out, sampled, self._keep))

        cfg = m.config
        part("pre")
        depth = top
        if cfg.n_recurrent:
            rule.start(ops.to_host(x) if rule.needs_start_state else None, cfg.vocab_size)
            for it in range(top):
                part(it)
                if it + 1 == top:
                    break
                logits = None
                if rule.needs_logits:
                    part("probe")
                    logits = ops.to_host(m.logit_row())
                if m.exit_decision(rule, ops.to_host(x), logits):
                    depth = it + 1
                    break
            m.fill_deeper(cache, depth, pos)
        part("post")
        ops.graph_sync()
        nxt, code = int(self._host_out[0]), int(self._host_out[1])
        self._expect = (weakref.ref(cache), nxt, pos + 1, last_n)
        return nxt, code, depth

    # --- the decode batch -------------------------------------------------------------------
    def batch_eligible(self, cache) -> bool:
        """Whether a decode batch of requests laid out as ``cache`` (one depth and kv_mode)
        runs as a graph: graphs on, and every slot in a KV mode the backend captures that
        does not store h (those loop over the rows on the host)."""
        modes = self._ops.graph_kv_modes
        return (bool(modes) and set(cache.modes) <= set(modes)
                and not any(lay.stores_h for lay in cache.layouts) and cuda_graphs_enabled())

    @staticmethod
    def bucket(rows: int, cap: int) -> int:
        """``batch_bucket``: the padded row count of a captured batch of ``rows`` rows (here
        so that Model reaches it through its graphs object: model imports no graphs)."""
        return batch_bucket(rows, cap)

    def batch_key(self, cache, rows: int, ctx: int) -> tuple:
        """The graph key of a decode batch of ``rows`` requests laid out as ``cache`` whose
        longest context is ``ctx`` keys (see the module doc)."""
        return ("batch", int(rows), cache.depth, tuple(lay.mode for lay in cache.layouts),
                cache.page_size, cache.kv_iterations, self._ops.graph_constants(),
                self._ops.batch_attention_key(ctx, rows, self._model.config.n_heads,
                                              self._windows))

    def batch_buffers(self, rows: int) -> tuple:
        """(logits f32 [rows, vocab] on the device, ids int32 [rows, 2] on the host) of a
        captured decode batch: one pool block (tag ``graphs``) and ``Ops.batch_host_ids``,
        kept for later batches. Growing them drops every batch graph (they address the old
        ones)."""
        rows = int(rows)
        if self.batch_logits is None or self.batch_logits.shape[0] < rows:
            vocab = self._model.config.vocab_size
            self._drop_batch()
            ids = self._ops.batch_host_ids(rows)
            with packed_scope():
                self.batch_logits, self._batch_block = self._ops.empty(
                    self._pool, (rows, vocab), np.float32, "graphs")
            self.batch_ids = ids
        return self.batch_logits[:rows], self.batch_ids[:rows]

    def run_batch(self, key, issue) -> None:
        """The decode batch of ``key`` (``batch_key``), whose launches ``issue()`` makes:
        eagerly on the key's first use, captured on its second, replayed after (``_run``).
        The caller fills the inputs first and synchronises (``Ops.graph_sync``) before reading
        ``batch_ids``."""
        ent = self._batch.get(key)
        if ent is None:
            while len(self._batch) >= MAX_BATCH_GRAPHS:
                self._free_entry(self._batch.popitem(last=False)[1])
            ent = self._batch[key] = _Entry()
        else:
            self._batch.move_to_end(key)
        self._run(ent, "batch", issue)

    def _drop_batch(self) -> None:
        """Free every batch graph and the batch logits block (the stream idle first)."""
        if self._batch or self._batch_block is not None:
            self._ops.synchronize()
        batch, self._batch = list(self._batch.values()), collections.OrderedDict()
        for ent in batch:
            self._free_entry(ent)
        self.batch_logits = self.batch_ids = None
        blk, self._batch_block = self._batch_block, None
        if blk is not None:
            self._pool.free(blk)

    def _run(self, ent: _Entry, name, issue) -> None:
        """Part ``name`` of ``ent``'s step, whose launches ``issue()`` makes: eagerly on its
        first use under the key, captured (and launched) on its second, replayed after."""
        g = ent.graphs.get(name)
        if g is None and name not in ent.warm:
            issue()
            ent.warm.add(name)
            return
        if g is None:
            g = ent.graphs[name] = self._capture(issue)
            with self._pool.measure_driver("cuda graphs"):   # the first launch uploads it
                self._ops.graph_launch(g)
        else:
            self._ops.graph_launch(g)
        self.replays += 1

    def _capture(self, issue):
        """Capture what ``issue()`` launches as one graph (the pool must not allocate
        meanwhile: GraphCaptureError otherwise, the graph dropped)."""
        ops, pool, m = self._ops, self._pool, self._model
        m.logit_row()                                   # exists before capture
        before = pool.stats()
        ops.graph_begin()
        try:
            issue()
            with pool.measure_driver("cuda graphs"):     # instantiation: device memory
                graph = ops.graph_end()
        except BaseException:
            ops.graph_abort()
            raise
        after = pool.stats()
        if (after.num_allocs, after.num_segment_allocs) != (before.num_allocs,
                                                            before.num_segment_allocs):
            with pool.measure_driver("cuda graphs"):
                ops.graph_free(graph)
                del graph
            n = after.num_allocs - before.num_allocs
            raise GraphCaptureError(
                f"the decode-step capture allocated from the pool ({n} blocks): every array "
                "of the step must exist before the capture begins")
        self.captures += 1
        return graph


def decode_graphs(model) -> DecodeGraphs:
    """The model's captured decode steps, made at first use and released with the model
    (``Model.extra``). Raises ModelFreedError after free."""
    return model.extra("decode_graphs", DecodeGraphs)


def _through_graphs(model, cache, args: tuple, run):
    """A step through the model's graphs: ``args`` = (temperature, top_k, top_p, u, min_p,
    repetition_penalty, recent_ids, repeat_last_n); ``run(graphs, sampling, extra)`` runs
    it (sampling: the tuple ``DecodeGraphs.step`` takes, or None for greedy; extra:
    {"window": recent_ids} with the penalty on, else {}) and returns (id, fault code, ...).
    None when the step is not eligible (``DecodeGraphs.eligible``); NonFiniteLogitsError for
    a fault code."""
    temperature, top_k, top_p, u, min_p, repetition_penalty, recent_ids, repeat_last_n = args
    g = decode_graphs(model)
    pen = (repetition_penalty != 1.0 and repeat_last_n > 0 and recent_ids is not None
           and len(recent_ids) > 0)
    if not g.eligible(cache, temperature if not pen else 1.0):
        return None
    sampling = None
    if temperature > 0.0 or pen:
        sampling = (temperature, top_k, top_p, u, min_p, repetition_penalty,
                    repeat_last_n if pen else 0)
    out = run(g, sampling, {"window": recent_ids} if pen else {})
    if out[1]:
        raise non_finite_logits(LOGIT_FAULTS[out[1]])
    return out


def decode_step(model, cache, token: int, pos: int, temperature: float, top_k: int = 0,
                top_p: float = 1.0, u: float = 0.0, min_p: float = 0.0,
                repetition_penalty: float = 1.0, recent_ids=None,
                repeat_last_n: int = 0) -> int | None:
    """The next token id after ``token`` at position ``pos`` of ``cache``'s request, through
    the captured decode step (:meth:`DecodeGraphs.step`), or None when this step does not
    run there (graphs off by ``TINYLOOP_CUDA_GRAPHS=0``, sampling the backend cannot capture, or a KV
    mode it cannot capture): the caller then runs ``Model.forward`` + ``Model.head_sample``
    with the same (temperature, top_k, top_p, u, min_p, repetition_penalty over
    ``recent_ids``: the tokens of the last ``repeat_last_n`` positions through ``pos``), which
    picks the same id (``numpy_ops.sample_from_logits``'s rule). Raises NonFiniteLogitsError
    (no step / position: the caller adds them) for a non-finite logit row, as ``head_sample``
    does, and ConfigError for sampling parameters out of range."""
    out = _through_graphs(model, cache, (temperature, top_k, top_p, u, min_p,
                                         repetition_penalty, recent_ids, repeat_last_n),
                          lambda g, sampling, extra: g.step(cache, int(token), int(pos),
                                                            sampling, **extra))
    return None if out is None else out[0]


def decode_step_auto(model, cache, token: int, pos: int, rule, temperature: float,
                     top_k: int = 0, top_p: float = 1.0, u: float = 0.0, min_p: float = 0.0,
                     repetition_penalty: float = 1.0, recent_ids=None,
                     repeat_last_n: int = 0) -> tuple[int, int] | None:
    """:func:`decode_step` at depth="auto" (``rule``: the request's ``adaptive.ExitRule``):
    (next id, depth run) through :meth:`DecodeGraphs.step_auto`, or None where the step does
    not run as graphs (then ``Model.forward_auto`` + ``Model.head_sample`` run it, with the
    same result). Raises as :func:`decode_step` does."""
    out = _through_graphs(model, cache, (temperature, top_k, top_p, u, min_p,
                                         repetition_penalty, recent_ids, repeat_last_n),
                          lambda g, sampling, extra: g.step_auto(cache, int(token), int(pos),
                                                                 rule, sampling, **extra))
    return None if out is None else (out[0], out[2])


__all__ = ["DecodeGraphs", "MAX_BATCH_GRAPHS", "MAX_GRAPHS", "batch_bucket", "decode_graphs",
           "decode_step", "decode_step_auto"]
