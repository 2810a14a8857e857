"""The op set the forward is written against (one implementation per backend).

Conventions for every op:
- ``act`` is the backend's activation dtype (``Ops.act_dtype``): float32 on NumPy, float16 on
  CUDA. The residual stream (``main``) is always float32. Logits are always float32.
- Every array passed to an op is C-contiguous.
- Ops write into the ``out``/``residual`` arrays they are given (views of buffers made at load
  or at request start); the hot path allocates nothing.
- ``QuantWeight`` arrays live on the backend's device (see ``Ops.upload_weight``).
- RoPE is the GGML "normal" (GPT-J, interleaved-pair) convention used by llama GGUF files:
  pairs (x[2i], x[2i+1]) of each head rotate by angle pos * theta^(-2i/head_dim).
- Attention is causal with scale 1/sqrt(head_dim); query head h reads KV head
  h // (n_heads // n_kv_heads) (grouped-query attention).
"""

from __future__ import annotations

import contextlib
import ctypes
import math

import numpy as np

from ..config import KV_MODES
from ..errors import ConfigError, NonFiniteLogitsError
from ..quant import QuantWeight

# Why a logit row cannot be sampled, by code (the CUDA argmax kernel writes the same codes):
# 1 = some logit is NaN, 2 = some logit is +inf (and none is NaN), 3 = every logit is -inf.
LOGIT_FAULTS = {1: "nan", 2: "+inf", 3: "all -inf"}
_FAULT_TEXT = {"nan": "contain NaN", "+inf": "contain +inf", "all -inf": "are all -inf"}


def logit_fault(top: float) -> str | None:
    """Why a row whose NaN-propagating maximum is ``top`` cannot be sampled (a LOGIT_FAULTS
    value), or None when it can. NaN wins that maximum, then +inf; it is -inf only when every
    logit is."""
    if top != top:
        return "nan"
    if top == float("inf"):
        return "+inf"
    if top == float("-inf"):
        return "all -inf"
    return None


def non_finite_logits(kind: str, step: int | None = None,
                      position: int | None = None) -> NonFiniteLogitsError:
    """The error both samplers raise for a row with fault ``kind`` (a LOGIT_FAULTS value);
    ``generate`` re-raises it with the ``step`` and ``position`` it was sampling."""
    where = "" if step is None else f"at step {step} (position {position}) "
    return NonFiniteLogitsError(
        f"the logits {where}{_FAULT_TEXT[kind]}, so no token can be sampled: the model's "
        "weights or activations are not finite (NaN/inf norm weights or scales, or an "
        "overflow in the forward)", kind=kind, step=step, position=position)


def penalized(repetition_penalty, recent_ids) -> bool:
    """Whether the repetition penalty changes a row: a factor other than 1 over a non-empty
    window of recent ids."""
    return repetition_penalty != 1.0 and recent_ids is not None and len(recent_ids) > 0


def sample_filters(args) -> tuple:
    """(min_p, repetition_penalty, recent_ids) of ``Ops.sample``'s arguments after the logits
    (temperature, top_k, top_p, u[, min_p, repetition_penalty, recent_ids]), each at its
    default (0, 1, None) where ``args`` stops before it."""
    return (args[4] if len(args) > 4 else 0.0, args[5] if len(args) > 5 else 1.0,
            args[6] if len(args) > 6 else None)


def check_sample_rows(rows, b: int) -> None:
    """ConfigError for an ``Ops.sample_rows`` entry whose row index is not in 0..b-1 or that
    has fewer than the five leading fields (index, temperature, top_k, top_p, u)."""
    for r in rows:
        if len(r) < 5 or isinstance(r[0], bool) or int(r[0]) != r[0] or not 0 <= r[0] < b:
            raise ConfigError(f"sample_rows: {r!r} must start (row index in 0..{b - 1}, "
                              "temperature, top_k, top_p, u)")


class Ops:
    """Abstract op set. See ``numpy_ops.NumpyOps`` for the reference semantics of each op."""

    name: str = "abstract"
    device: str = "host"          # memory pool device: "host" | "cuda"
    act_dtype = np.float32        # activations (the scratch buffers)
    kv_dtype = np.float32         # the KV cache
    fp16_cache_default = False    # whether load keeps dense weight caches unless
                                  # TINYLOOP_FP16_CACHE says otherwise
    kv_modes = KV_MODES           # KV cache storage modes this backend runs
    xp = np

    # --- memory ---------------------------------------------------------------------------
    @classmethod
    def config_problems(cls, cfg) -> list[str]:
        """What in ``cfg`` (a ModelConfig) this backend's kernels cannot run, each naming the
        dim (``Model`` refuses such a model at load, before allocating); [] here."""
        return []

    def empty(self, pool, shape, dtype, tag):
        """Allocate ``shape``/``dtype`` from ``pool`` under ``tag``; return (array, block)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        blk = pool.allocate(max(nbytes, 1), tag)
        try:
            return blk.array(shape, dtype), blk
        except BaseException:
            pool.free(blk)
            raise

    def upload_array(self, host: np.ndarray, pool):
        """Copy a host array into a new pool block (tag: the current tag_scope)."""
        arr, blk = self.empty(pool, host.shape, host.dtype, None)
        self.from_host(np.ascontiguousarray(host), arr)
        return arr, blk

    def upload_weight(self, w, pool):
        """Copy a host QuantWeight's parts into pool blocks (tag: the current tag_scope);
        return (QuantWeight, [blocks]). Raises ConfigError for anything but a consistent
        QuantWeight; on any failure the blocks taken so far are freed."""
        if not isinstance(w, QuantWeight):
            raise ConfigError(f"upload_weight needs a QuantWeight, got {type(w).__name__}")
        w.check()
        parts, blocks = [], []
        try:
            for a in (w.qweight, w.scales, w.zeros):
                arr, blk = self.upload_array(np.asarray(a), pool)
                parts.append(arr)
                blocks.append(blk)
        except BaseException:
            for blk in blocks:
                pool.free(blk)
            raise
        return QuantWeight(w.bits, w.group_size, *parts), blocks

    def zero(self, arr) -> None:
        """Set every element of a device array to 0."""
        arr.fill(0)

    def zero_ranges(self, ranges) -> None:
        """Set the bytes of every ``(address, nbytes)`` range to 0 (ranges of this backend's
        pool, e.g. ``memory.block.contiguous_runs`` of freshly allocated pages: one memset per
        range). Host memory here; CudaOps issues one cudaMemsetAsync per range."""
        for ptr, n in ranges:
            ctypes.memset(ptr, 0, n)

    def make_fp16_cache(self, w, pool, tag: str | None = "fp16_cache"):
        """A dense ``[out, in]`` copy of the device QuantWeight ``w`` for the prefill GEMMs
        (float16 on CUDA, float32 on the NumPy reference), in a block taken from ``pool``
        under ``tag`` (None: the current tag_scope). Returns (array, block); on failure the
        block is freed."""
        raise NotImplementedError

    def to_host(self, arr) -> np.ndarray:
        return np.asarray(arr)

    def from_host(self, host: np.ndarray, out) -> None:
        """Copy a host array into a device array of the same shape/dtype."""
        out[...] = host

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        """Return the backend's own scratch blocks to their pools (``Model.free`` calls it
        once the stream is idle; the Ops is not used afterwards). None on this base."""

    def scratch_bytes(self, pool) -> int:
        """Bytes of the backend's own scratch blocks (tag ``scratch``) that ``pool`` holds
        now; 0 on this base."""
        return 0

    # --- ops (shapes in comments; T = rows of this chunk) ----------------------------------
    def embed(self, w, ids, out):                   # ids int32 [T]; out f32 [T, d]
        raise NotImplementedError

    def rmsnorm(self, x, weight, eps, out):         # x f32 [T, d]; weight f32 [d]; out act [T, d]
        raise NotImplementedError

    def linear(self, x, w, out):                    # x act [T, in]; out act [T, out] = x @ W.T
        raise NotImplementedError

    def linear_residual(self, x, w, residual):      # residual f32 [T, d] += x @ W.T
        raise NotImplementedError

    def linear_swiglu(self, x, w, tmp, out):        # W [2F, d]: rows 0..F gate, F..2F up
        raise NotImplementedError                   # out act [T, F] = silu(x@Wg.T) * (x@Wu.T)

    def rope_kv(self, qkv, pos0, theta, n_heads, n_kv_heads, head_dim, k_cache, v_cache):
        raise NotImplementedError

    def attention(self, qkv, k_cache, v_cache, pos0, n_heads, n_kv_heads, head_dim, out):
        raise NotImplementedError

    # --- the paged KV cache: ``kv`` is a kv.cache.SlotKV (layout + block table) --------------
    def kv_write(self, qkv, h, pos0, theta, n_heads, n_kv_heads, head_dim, kv):
        """Rotate Q in place; store positions pos0.. of the slot in its mode (K/V or h)."""
        raise NotImplementedError

    def kv_attention(self, qkv, kv, pos0, n_heads, n_kv_heads, head_dim, out, recon=None,
                     window: int = 0):
        """Causal GQA attention over the slot's positions 0..pos0+T-1, read through its block
        table as stored (dequantized / rebuilt from h with ``recon``, a kv.cache.Recon).
        ``window`` > 0: the query at position p reads only keys p-window+1..p (sliding-window
        layers); the forward passes it only for such layers."""
        raise NotImplementedError

    # --- a decode batch: B rows, each one position of its own request's slot ---------------
    # ``rows`` is a kv.cache.BatchSlot (row i: SlotKV ``rows.slots[i]`` at position
    # ``rows.positions[i]``, one layout for all rows). The base versions below loop over the
    # rows calling the T = 1 ops: the reference semantics (the NumPy backend runs them), and
    # what a backend falls back to where it has no batch kernel (the CUDA store-h modes).
    def kv_write_batch(self, qkv, h, rows, theta, n_heads, n_kv_heads, head_dim):
        """Row i of ``qkv`` [B, >= (H + 2 Hkv) hd] (and of ``h`` [B, d] in the store-h modes,
        else unused) is ``kv_write`` at position ``rows.positions[i]`` into ``rows.slots[i]``:
        Q rotated in place, K/V (or h) stored. Raises ConfigError when ``qkv`` does not have
        one row per batch row."""
        self._batch_rows(qkv, rows)
        for i, (skv, p) in enumerate(zip(rows.slots, rows.positions)):
            self.kv_write(qkv[i:i + 1], None if h is None else h[i:i + 1], p, theta, n_heads,
                          n_kv_heads, head_dim, skv)

    def reserve_decode_batch(self, rows: int, n_heads: int, head_dim: int) -> None:
        """Take now the scratch any ``kv_attention_batch`` of up to ``rows`` rows needs, so a
        serving run allocates nothing while it decodes (``serve.Engine.start``). Nothing to
        take on a backend without such scratch (here)."""

    def kv_attention_batch(self, qkv, rows, n_heads, n_kv_heads, head_dim, out, window: int = 0,
                           recon=None):
        """Row i of ``out`` [B, H hd] is ``kv_attention`` of query row i of ``qkv`` (rotated by
        ``kv_write_batch``) over positions 0..``rows.positions[i]`` of ``rows.slots[i]``
        (``window`` and ``recon``, a kv.cache.Recon for the store-h modes, as there). Raises
        ConfigError when ``qkv`` or ``out`` does not have one row per batch row."""
        b = self._batch_rows(qkv, rows)
        if out.shape[0] < b:
            raise ConfigError(f"kv_attention_batch: out has {out.shape[0]} rows, the batch "
                              f"{b}")
        for i, (skv, p) in enumerate(zip(rows.slots, rows.positions)):
            self.kv_attention(qkv[i:i + 1], skv, p, n_heads, n_kv_heads, head_dim,
                              out[i:i + 1], recon, window=window)

    @staticmethod
    def _batch_rows(qkv, rows) -> int:
        """B, the rows of the batch ``rows``; ConfigError unless ``qkv`` has B rows."""
        b = len(rows.slots)
        if b < 1 or qkv.shape[0] != b or len(rows.positions) != b:
            raise ConfigError(f"a decode batch of {b} slots and {len(rows.positions)} "
                              f"positions needs qkv of as many rows, got {qkv.shape[0]}")
        return b

    def inject(self, state, e, w, tmp2, tmp1):      # state f32 [T, d] = [state, e] @ W.T
        raise NotImplementedError

    # --- the ops of the VERSION 2 architecture facts (config.ModelConfig) --------------------
    # The NumPy reference runs them; a backend without them refuses such a model at load
    # (model.backend_missing_features).
    def scale(self, x, s: float) -> None:
        """x f32 [T, d] *= s (``embed_scale``)."""
        raise NotImplementedError

    def add_bias(self, x, bias) -> None:
        """x act [T, n] += bias f32 [n] (``qkv_bias``: before RoPE and the K/V write)."""
        raise NotImplementedError

    def norm_residual(self, x, weight, eps) -> None:
        """x f32 [T, d] = rmsnorm(x) in place, kept in float32 (``loop_norm``, ``exit_norm``:
        the final norm run on the residual stream itself)."""
        raise NotImplementedError

    def linear_norm_residual(self, x, w, weight, eps, residual, tmp) -> None:
        """residual f32 [T, d] += rmsnorm(x @ W.T): a "pre_post" layer's branch output normed
        before the add (Ouro); ``tmp`` act [T, d] scratch."""
        raise NotImplementedError

    def linear_residual_norm(self, x, w, weight, eps, residual) -> None:
        """residual f32 [T, d] = rmsnorm(residual + x @ W.T): a "sandwich" layer's norm after
        the add (Huginn)."""
        raise NotImplementedError

    def init_state(self, out, pos0: int, std: float, seed: int) -> None:
        """out f32 [T, d] = the seeded initial state of positions pos0..pos0+T-1
        (``seeded_state`` below: a truncated normal that depends only on the seed, the
        position and the channel). Drawn on the host and copied in, on every backend."""
        t, d = out.shape
        self.from_host(seeded_state(pos0, t, d, std, seed), out)

    def init_state_rows(self, out, positions, std: float, seed: int,
                        positions_dev=None) -> None:
        """out f32 [B, d]: row i = ``init_state`` of the one position ``positions[i]`` (B host
        ints; a decode batch, each row at its own position). ``positions_dev``: the same
        positions as a device int64 [B] array (the step's ``kv.cache.batch_index`` row 0), for
        a backend that draws on the device; unused here, where every row is drawn on the host
        (``seeded_state``) and copied in with one copy. Raises ConfigError when ``out`` does
        not have one row per position."""
        t, d = out.shape
        if len(positions) != t:
            raise ConfigError(f"init_state_rows: {len(positions)} positions for {t} rows")
        self.from_host(np.concatenate([seeded_state(int(p), 1, d, std, seed)
                                       for p in positions]), out)

    def init_state_step(self, out, step, std: float, seed: int) -> None:
        """``init_state`` of the one row out f32 [1, d] at position ``step[STEP_POS]`` of the
        device step state (int32 [STEP_WORDS]); a backend that captures decode steps draws it
        on the device (the base reads the position on the host)."""
        self.init_state(out, self.step_pos(step), std, seed)

    def lm_head(self, x, w, out):                   # x act [T, d]; out f32 [T, vocab]
        raise NotImplementedError

    # --- fused pairs: RMSNorm feeding the next projection --------------------------------
    # Defaults compose the two ops through the ``norm`` scratch rows; a backend may fuse them
    # (the CUDA backend does at T = 1: one launch instead of two per pair, and ``norm`` is then
    # left unwritten). Results must equal the composition at the backend's precision.
    def rmsnorm_linear(self, x, weight, eps, w, out, norm):
        """out act [T, n] = rmsnorm(x f32 [T, d]) @ W.T."""
        self.rmsnorm(x, weight, eps, norm)
        self.linear(norm, w, out)

    def rmsnorm_linear_swiglu(self, x, weight, eps, w, tmp, out, norm):
        """out act [T, F] = swiglu(rmsnorm(x) @ W.T) (gate rows then up rows)."""
        self.rmsnorm(x, weight, eps, norm)
        self.linear_swiglu(norm, w, tmp, out)

    def rmsnorm_lm_head(self, x, weight, eps, w, out, norm):
        """out f32 [T, vocab] = rmsnorm(x) @ W.T."""
        self.rmsnorm(x, weight, eps, norm)
        self.lm_head(norm, w, out)

    def rmsnorm_lm_head_sample(self, x, weight, eps, w, out, norm, temperature, top_k, top_p,
                               u, **filters) -> int:
        """The next token id: ``rmsnorm_lm_head`` of x f32 [1, d] into ``out`` f32 [1, vocab],
        then ``sample`` of that row (the rule of ``numpy_ops.sample_from_logits``; ``filters``:
        its ``min_p``, ``repetition_penalty``, ``recent_ids``, passed on). A backend may fuse
        the two (the CUDA backend does for greedy decode: only the id leaves the device)."""
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        return int(self.sample(out[0], temperature, top_k, top_p, u, **filters))

    def sample(self, logits, temperature, top_k, top_p, u, min_p=0.0, repetition_penalty=1.0,
               recent_ids=None) -> int:
        """The next token id from f32 logits [vocab] (``numpy_ops.sample_from_logits``'s rule,
        with its min-p and repetition penalty over ``recent_ids``). Raises
        NonFiniteLogitsError (``non_finite_logits``) when a logit is NaN or +inf or all are
        -inf."""
        raise NotImplementedError

    # --- the device step state of a captured decode step (tinyloop/graphs.py) ----------------
    # A decode step that reads its token id and position from device memory can be captured
    # once and replayed for every step of a request. ``step`` is an int32 [STEP_WORDS] device
    # array: [STEP_ID] the token id embed reads (the head writes the next one), [STEP_FAULT] the
    # head row's fault code (LOGIT_FAULTS; 0 = none), [STEP_POS] the position written and
    # attended from (context length = pos + 1), advanced by ``step_advance``. The base versions
    # below read the state on the host and call the ordinary ops: the reference semantics, and
    # what a backend without device-side variants runs.
    graph_kv_modes: tuple = ()    # KV modes whose step ops a backend can capture (none here)
    graph_sampling: bool = False  # whether a captured step can sample (temperature > 0)
    _step_sampling: tuple = (0.0, 0, 1.0, 0.0)
    _step_filters: tuple = (0.0, 1.0, 0)      # (min_p, repetition_penalty, repeat_last_n)
    _step_ring = None                         # host ring of the penalty window (base only)

    def graph_constants(self) -> tuple:
        """Every launch constant this backend chooses on the host for a decode step (kernel
        geometry, versions), hashable: part of a captured graph's key."""
        return ()

    def copy(self, src, out) -> None:
        """out[...] = src (same shape), as an op so that a captured step records it."""
        out[...] = src

    def step_pos(self, step) -> int:
        return int(self.to_host(step)[STEP_POS])

    def rmsnorm_qkv_kv_step(self, x, weight, eps, w, qkv, step, theta, n_heads, n_kv_heads,
                            head_dim, kv, bias=None) -> bool:
        """Optionally ``rmsnorm_linear`` (x f32 [1, d] -> qkv f16 [1, (H + 2 Hkv) hd]), with
        ``bias`` (f32 [(H + 2 Hkv) hd] or None) ``add_bias``, and ``kv_write_step`` in one
        fused launch; True when done, False when this backend (or
        this slot's mode / this weight) has no fused kernel: the caller then runs the pair.
        The base backend never fuses."""
        return False

    def kv_write_step(self, qkv, h, step, theta, n_heads, n_kv_heads, head_dim, kv):
        """``kv_write`` of one row at position ``step[STEP_POS]``."""
        self.kv_write(qkv, h, self.step_pos(step), theta, n_heads, n_kv_heads, head_dim, kv)

    def kv_attention_step(self, qkv, kv, step, n_heads, n_kv_heads, head_dim, out, recon=None,
                          window: int = 0):
        """``kv_attention`` of one query row at position ``step[STEP_POS]`` (context length
        ``step[STEP_POS] + 1``; ``window`` as there)."""
        self.kv_attention(qkv, kv, self.step_pos(step), n_heads, n_kv_heads, head_dim, out,
                          recon, window=window)

    def head_argmax_step(self, x, weight, eps, w, out, norm, step) -> None:
        """Greedy head into the step state: ``rmsnorm_lm_head`` of x f32 [1, d] into ``out``
        f32 [1, vocab], then ``step[STEP_ID]`` = its argmax (numpy.argmax's rule) and
        ``step[STEP_FAULT]`` = the row's fault code (0, or a LOGIT_FAULTS key: the id is then
        meaningless). Raises nothing for a non-finite row: the host reads the code."""
        from ..errors import NonFiniteLogitsError
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        try:
            nxt, code = int(self.sample(out[0], 0.0, 0, 1.0, 0.0)), 0
        except NonFiniteLogitsError as e:
            nxt, code = 0, _FAULT_CODES[e.kind]
        state = self.to_host(step).copy()
        state[STEP_ID], state[STEP_FAULT] = nxt, code
        self.from_host(state, step)

    def set_step_sampling(self, temperature: float, top_k: int, top_p: float,
                          u: float, min_p: float = 0.0, repetition_penalty: float = 1.0,
                          repeat_last_n: int = 0) -> None:
        """The sampling parameters ``head_sample_step`` reads when it runs (not when it is
        captured): the host sets them before each replay. temperature > 0 (0, the argmax, only
        with the repetition penalty on); top_k >= 0 (0 = off); top_p in (0, 1] (>= 1 off; 0
        means greedy and never reaches here); u in [0, 1) drawn on the host; min_p in [0, 1]
        (0 off); repetition_penalty > 0 (1 off) over the tokens of the last ``repeat_last_n``
        positions (0 off, at most REPEAT_LAST_N_MAX), held by the step's window ring
        (``set_step_window``). Raises ConfigError for a value outside those ranges."""
        from ..errors import ConfigError
        temperature, top_p, u = float(temperature), float(top_p), float(u)
        min_p, repetition_penalty = float(min_p), float(repetition_penalty)
        check_filters(min_p, repetition_penalty, repeat_last_n)
        penalized = repetition_penalty != 1.0 and repeat_last_n > 0
        if (temperature != temperature or temperature == float("inf")
                or not (temperature > 0.0 or (temperature == 0.0 and penalized))):
            raise ConfigError(f"a sampled step needs a finite temperature > 0 (0 only with a "
                              f"repetition penalty), got {temperature}")
        if not 0.0 <= u < 1.0:
            raise ConfigError(f"u must lie in [0, 1), got {u}")
        if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
            raise ConfigError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if not 0.0 <= top_p:
            raise ConfigError(f"top_p must be >= 0, got {top_p}")
        self._step_sampling = (temperature, int(top_k), top_p, u)
        self._step_filters = (min_p, repetition_penalty, int(repeat_last_n))

    def set_step_window(self, recent_ids, pos: int, repeat_last_n: int) -> None:
        """Fill the penalty window ring of the step state: ``recent_ids`` (ints) are the
        tokens at positions ``pos - len + 1 .. pos`` (the last is the step's input token,
        ``step[STEP_ID]``); slot ``p % repeat_last_n`` holds the token at position p. A
        captured step then keeps the ring itself (``head_sample_step`` stores each input token
        in its slot), so the host fills it only when it writes the step state. Raises
        ConfigError for more ids than ``repeat_last_n`` or ``repeat_last_n`` outside
        [1, REPEAT_LAST_N_MAX]."""
        ids = window_ring(recent_ids, pos, repeat_last_n)
        self._step_ring = ids

    def _step_recent(self, step_state, advance: bool):
        """The penalty window's ids of the current step from the host ring (base backends):
        positions max(0, pos - N + 1) .. pos, the token at pos from the step state; with
        ``advance`` the input token is stored in its slot, as the device kernel does."""
        _, pen, n = self._step_filters
        if pen == 1.0 or n <= 0:
            return None
        pos, tok = int(step_state[STEP_POS]), int(step_state[STEP_ID])
        ring = self._step_ring
        if ring is None or ring.size != n:
            ring = self._step_ring = np.zeros(n, np.int32)
        cnt = min(n, pos + 1)
        ids = [tok] + [int(ring[(pos - j) % n]) for j in range(1, cnt)]
        if advance:
            ring[pos % n] = tok
        return ids

    def head_sample_step(self, x, weight, eps, w, out, norm, step) -> None:
        """Sampled head into the step state: ``rmsnorm_lm_head`` of x f32 [1, d] into ``out``
        f32 [1, vocab], then ``step[STEP_ID]`` = ``sample`` of that row under the parameters of
        the last ``set_step_sampling`` (read now, at run time; the repetition penalty over the
        window ring, which takes the step's input token) and ``step[STEP_FAULT]`` = the row's
        fault code (0, or a LOGIT_FAULTS key). Raises nothing for a non-finite row."""
        from ..errors import NonFiniteLogitsError
        self.rmsnorm_lm_head(x, weight, eps, w, out, norm)
        temperature, top_k, top_p, u = self._step_sampling
        min_p, pen, _ = self._step_filters
        state = self.to_host(step).copy()
        recent = self._step_recent(state, advance=True)
        try:
            nxt, code = int(self.sample(out[0], temperature, top_k, top_p, u, min_p, pen,
                                        recent)), 0
        except NonFiniteLogitsError as e:
            nxt, code = 0, _FAULT_CODES[e.kind]
        state[STEP_ID], state[STEP_FAULT] = nxt, code
        self.from_host(state, step)

    def step_advance(self, step, host_out, theta: float | None = None,
                     head_dim: int | None = None) -> None:
        """``step[STEP_POS] += 1`` and copy (id, fault) to ``host_out`` int32 [2] (the host
        reads it after ``graph_sync``). ``theta`` / ``head_dim``: the model's RoPE, for a
        backend that also prepares the next position's table (STEP_ROPE; ignored here)."""
        state = self.to_host(step).copy()
        host_out[0], host_out[1] = state[STEP_ID], state[STEP_FAULT]
        state[STEP_POS] += 1
        self.from_host(state, step)

    def step_host_buffer(self):
        """A host int32 [2] the step result lands in (``step_advance``'s ``host_out``)."""
        return np.zeros(2, np.int32)

    @contextlib.contextmanager
    def decode_batch_scope(self):
        """The ops issued inside are a decode batch's (``Model.decode_batch``): a backend may
        pick kernels for a few rows there (CUDA: ``gemv_mma`` / ``gemv_rows``) that prefill,
        whose results prefix reuse compares against a full recompute, does not take. Nothing
        changes here."""
        yield

    def argmax_rows(self, logits, out) -> None:
        """Greedy pick of every row of ``logits`` f32 [B, vocab]: ``out[i]`` = (numpy.argmax's
        id of row i, its fault code: 0 or a LOGIT_FAULTS key, the id then meaningless).
        ``out``: int32 [>= B, 2] from ``batch_host_ids`` (the host reads it after a
        synchronisation). Raises nothing for a non-finite row. One launch on CUDA, so a
        captured decode batch ends in it (``graphs.DecodeGraphs.run_batch``)."""
        for i in range(logits.shape[0]):
            try:
                out[i] = (int(self.sample(logits[i], 0.0, 0, 1.0, 0.0)), 0)
            except NonFiniteLogitsError as e:
                out[i] = (0, _FAULT_CODES[e.kind])

    def sample_rows(self, logits, rows) -> list:
        """The next token of several rows of ``logits`` f32 [B, vocab], each by ``sample``'s
        rule: ``rows`` holds tuples (row index, temperature, top_k, top_p, u[, min_p,
        repetition_penalty, recent_ids]); returns, in their order, each pick, or the row's
        NonFiniteLogitsError (so one bad row does not end the others). A backend may queue
        every row before one synchronisation. Raises ConfigError as ``sample`` does."""
        check_sample_rows(rows, logits.shape[0])
        out = []
        for i, *args in rows:
            try:
                out.append(int(self.sample(logits[i], *args)))
            except NonFiniteLogitsError as e:
                out.append(e)
        return out

    def batch_host_ids(self, rows: int):
        """A host int32 [rows, 2] that ``argmax_rows`` writes (CUDA: mapped pinned memory the
        kernel writes directly); the same buffer while ``rows`` does not grow."""
        buf = getattr(self, "_batch_ids", None)
        if buf is None or buf.shape[0] < rows:
            buf = self._batch_ids = np.zeros((int(rows), 2), np.int32)
        return buf[:rows]

    def batch_host_inputs(self, nbytes: int):
        """Host bytes, uint8 [nbytes], that a decode batch stages its inputs in (its token
        ids and index) for ``copy_host_inputs`` (CUDA: pinned memory); the same buffer while
        ``nbytes`` does not grow."""
        buf = getattr(self, "_batch_inputs", None)
        if buf is None or buf.size < nbytes:
            buf = self._batch_inputs = np.zeros(int(nbytes), np.uint8)
        return buf[:nbytes]

    def copy_host_inputs(self, host, out) -> None:
        """Copy ``host`` (a view of ``batch_host_inputs``) into the device array ``out`` of
        its dtype and size, queued on the stream. Capturable: a captured step's copy reads
        what ``host`` holds when it replays, so the host writes a step's inputs there (after
        the step before it finished) and replays. Raises ConfigError when the dtypes or
        sizes differ."""
        if host.nbytes != out.nbytes or host.dtype != out.dtype:
            raise ConfigError(f"copy_host_inputs: host {host.dtype} {host.shape} does not "
                              f"match device {out.dtype} {out.shape}")
        out[...] = host.reshape(out.shape)

    def batch_attention_key(self, ctx: int, rows: int, n_heads: int, windows) -> tuple:
        """The host-chosen launch constants of a decode batch's attention over a context of
        at most ``ctx`` keys, ``rows`` rows, for each sliding ``window`` in ``windows`` (0 =
        full attention): part of a captured batch's key. None here."""
        return ()

    # --- graph capture (a backend with ``graph_kv_modes`` implements these) ------------------
    def graph_begin(self) -> None:
        """Start capturing the ops issued from now on (nothing runs until a launch)."""
        raise ConfigError(f"backend {self.name!r} cannot capture graphs")

    def graph_end(self):
        """End the capture; return the graph handle."""
        raise ConfigError(f"backend {self.name!r} cannot capture graphs")

    def graph_abort(self) -> None:
        """End a capture that failed, discarding what was captured; the stream stays usable.
        A no-op when no capture is open."""

    def graph_launch(self, graph) -> None:
        """Queue one replay of ``graph`` on the current stream."""
        raise ConfigError(f"backend {self.name!r} cannot capture graphs")

    def graph_sync(self) -> None:
        """Wait for the replays queued so far (then ``step_host_buffer`` holds the result)."""
        self.synchronize()

    def graph_free(self, graph) -> None:
        """Release ``graph`` (and what the driver holds for it)."""


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of uint64 ``x`` (Steele, Lea & Flood 2014), elementwise:
    the counter-based hash the seeded state draws from."""
    with np.errstate(over="ignore"):
        z = (np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


STATE_TRUNCATE = 3.0     # the seeded state's normal is cut at +-3 std (Huginn's trunc_normal_)
STATE_ATTEMPTS = 64      # draws per element before it is left 0 (cuda init_state_f32 too)


def seeded_state(pos0: int, t: int, d: int, std: float, seed: int) -> np.ndarray:
    """float32 ``[t, d]``: the initial recurrent state of positions pos0..pos0+t-1 for
    ``state_init="normal"``. Element (p, i) is std * z with z standard normal cut at
    +-STATE_TRUNCATE: Box-Muller over two uniforms from ``splitmix64`` of the counter
    (seed, p, i, attempt), the first attempt 0, 1, ... whose z lies within the cut. It depends
    on nothing but (seed, p, i), so a position's state is the same in every chunk, prefix and
    request, and equal seeds make runs repeatable."""
    p = np.arange(pos0, pos0 + t, dtype=np.uint64)[:, None]
    i = np.arange(d, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        base = splitmix64(splitmix64(splitmix64(np.uint64(seed)) ^ p) ^ (i << np.uint64(8)))
    z = np.zeros((t, d))
    todo = np.ones((t, d), bool)
    for attempt in range(STATE_ATTEMPTS):
        a = np.uint64(2 * attempt)
        u1 = (splitmix64(base ^ a) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        u2 = (splitmix64(base ^ (a + np.uint64(1))) >> np.uint64(11)).astype(np.float64) \
            * 2.0 ** -53
        cand = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
        take = todo & (np.abs(cand) <= STATE_TRUNCATE)
        z[take] = cand[take]
        todo &= ~take
        if not todo.any():
            break
    return (z * std).astype(np.float32)


STEP_ID, STEP_FAULT, STEP_POS = 0, 1, 2
# [STEP_ROPE_POS] = p + 1 when [STEP_ROPE, STEP_ROPE + head_dim) holds position p's RoPE cos |
# sin (float32 bits; 0: none): CudaOps.step_advance writes it for the next position, so the
# step's KV writes read it instead of computing it per layer (rope.cu). Backends may ignore it.
STEP_ROPE_POS, STEP_ROPE, STEP_ROPE_MAX = 3, 4, 256
STEP_WORDS = STEP_ROPE + STEP_ROPE_MAX
# The longest repetition-penalty window (repeat_last_n) a request may ask for: the size of the
# captured step's window ring (int32 each).
REPEAT_LAST_N_MAX = 4096


def is_finite_number(v) -> bool:
    """math.isfinite for a number, False for an int too large for a float (not an
    OverflowError)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def is_integral_number(v) -> bool:
    """An int (of any size: no float conversion) or a float with no fractional part."""
    if isinstance(v, (int, np.integer)):
        return True
    return is_finite_number(v) and float(v).is_integer()


def check_filters(min_p, repetition_penalty, repeat_last_n) -> None:
    """Raise ConfigError naming the first bad min-p / repetition-penalty argument: min_p a
    number in [0, 1]; repetition_penalty a finite number > 0; repeat_last_n an int in
    [0, REPEAT_LAST_N_MAX]."""
    def number(v):
        return (isinstance(v, (int, float, np.integer, np.floating))
                and not isinstance(v, (bool, np.bool_)))
    if not number(min_p) or not 0.0 <= min_p <= 1.0:
        raise ConfigError(f"min_p must be in [0, 1] (0 = off), got {min_p!r:.80}")
    if (not number(repetition_penalty) or not is_finite_number(repetition_penalty)
            or not repetition_penalty > 0):
        raise ConfigError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                          f"{repetition_penalty!r:.80}")
    if (not number(repeat_last_n) or not is_integral_number(repeat_last_n)
            or not 0 <= repeat_last_n <= REPEAT_LAST_N_MAX):
        raise ConfigError(f"repeat_last_n must be an int in [0, {REPEAT_LAST_N_MAX}] (0 = "
                          f"no penalty window), got {repeat_last_n!r:.80}")


def window_ring(recent_ids, pos: int, repeat_last_n: int) -> np.ndarray:
    """int32 [repeat_last_n]: the penalty window ring holding ``recent_ids``, the tokens at
    positions ``pos - len + 1 .. pos``, in slot ``p % repeat_last_n`` (other slots 0).
    Raises ConfigError for a window longer than ``repeat_last_n``, ``repeat_last_n`` outside
    [1, REPEAT_LAST_N_MAX] or ``pos`` before the window's start."""
    n = int(repeat_last_n)
    ids = np.asarray(recent_ids, dtype=np.int64).reshape(-1)
    if not 1 <= n <= REPEAT_LAST_N_MAX:
        raise ConfigError(f"repeat_last_n must be in [1, {REPEAT_LAST_N_MAX}], got {n}")
    if ids.size > n or pos + 1 < ids.size:
        raise ConfigError(f"a penalty window of {ids.size} ids does not fit repeat_last_n={n} "
                          f"at position {pos}")
    ring = np.zeros(n, np.int32)
    ring[(pos - ids.size + 1 + np.arange(ids.size)) % n] = ids
    return ring
_FAULT_CODES = {v: k for k, v in LOGIT_FAULTS.items()}
