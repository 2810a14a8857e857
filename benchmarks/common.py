"""What the benchmarks share: the synthetic model writer, the model lookup, the GPU and wall
timers (median and min-max spread over N runs), the JSON / table writers, and the looped
architectures' published configs, the random-weight writer, and the decode / prefill timers
that bench_looped, bench_adaptive and vs_llamacpp run on them.

Nothing here runs at import: CuPy is imported by the GPU timer on first use, so a benchmark
that imports this module still lists and parses its arguments on a machine without CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from tinyloop.errors import TinyLoopError


class BenchError(TinyLoopError):
    """A benchmark run that cannot give its figure (a llama-bench run or a GGUF write that
    failed, a generation cut short); the message names what and why."""


SYNTHETIC = "synthetic"        # --model value: the synthetic SmolLM2-dims model
DEFAULT = "default"            # --model value: the default model (tinyloop.default_model_path)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Median and spread of N timed runs, in the unit the timer names (µs, ms or s)."""

    median: float
    min: float
    max: float
    runs: int

    def __getitem__(self, i: int) -> float:
        """(median, min, max) by index, as the tuple the kernel tables index."""
        return (self.median, self.min, self.max)[i]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fmt(self, spec: str = ".2f") -> str:
        """``median (min-max)``."""
        return f"{self.median:{spec}} ({self.min:{spec}}-{self.max:{spec}})"


def spread(values: Iterable[float]) -> Timing:
    """Median, min and max of ``values`` (at least one). Raises ValueError when empty."""
    v = sorted(float(x) for x in values)
    if not v:
        raise ValueError("spread of no values")
    return Timing(statistics.median(v), v[0], v[-1], len(v))


def gpu_time_us(fn: Callable[[], object], reps: int = 200, warmup: int = 10,
                setup: Callable[[], object] | None = None) -> Timing:
    """GPU time of one call of ``fn`` in microseconds, from CUDA events around each of
    ``reps`` calls after ``warmup`` untimed ones. ``setup``: called before every call of
    ``fn`` (warm-up included), outside the events. Needs CuPy (imported here)."""
    import cupy
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    us = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        us.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return spread(us)


def graph_time_us(fn: Callable[[], object], n: int = 20, reps: int = 20) -> Timing:
    """GPU time of one call of ``fn`` in microseconds, from replaying a CUDA graph of ``n``
    calls (one call first, outside the capture, makes what the call allocates): launch gaps
    removed, so short kernels are timed as inside a captured step. Median, min and max of
    ``reps`` replays, each divided by ``n``. Needs CuPy (imported here)."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            for _ in range(n):
                fn()
        finally:
            graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    us = []
    for _ in range(reps):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        us.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / n)
    return spread(us)


def wall_time_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1,
                 sync: Callable[[], object] | None = None) -> Timing:
    """Host wall time of one call of ``fn`` in milliseconds over ``reps`` calls after
    ``warmup`` untimed ones; ``sync`` (e.g. ``model.ops.synchronize``) runs before the clock
    starts and before it stops, so queued device work is counted."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        ms.append((time.perf_counter() - t0) * 1e3)
    return spread(ms)


def write_synthetic_model(path: str, seed: int = 0, max_depth: int = 4, **dims) -> str:
    """Write a synthetic .tlm at ``path``: SmolLM2-135M's dims unless ``dims`` (fields of
    ``synthetic_config``: d_model, n_heads, ...) say otherwise; INT4 g=32 layers and an INT8
    g=32 embedding (as the Q4_1 GGUF), from ``seed``. Returns ``path``."""
    from tinyloop.convert.synthetic import synthetic_config, synthetic_weights
    from tinyloop.format import write_tlm
    from tinyloop.quant import quantize
    cfg = synthetic_config(max_depth=max_depth, bos_token_id=1, eos_token_id=2, **dims)
    w = synthetic_weights(cfg, seed, bits=4, group_size=32)
    rng = np.random.default_rng(seed + 1)
    w["token_embd"] = quantize((rng.standard_normal((cfg.vocab_size, cfg.d_model)) * 0.08)
                               .astype(np.float32), 8, 32)
    write_tlm(path, cfg, w, metadata={"source": "synthetic SmolLM2-135M dims", "seed": seed})
    return path


def add_model_arg(ap, default: str = SYNTHETIC) -> None:
    """The ``--model`` argument every model benchmark takes (see ``model_path``)."""
    ap.add_argument("--model", default=default,
                    help=f"a .tlm or .gguf path, '{DEFAULT}' (the default model) or "
                         f"'{SYNTHETIC}' (SmolLM2-135M dims, fixed seed; written to a "
                         f"temporary folder) (default: {default})")


def model_path(arg: str | None) -> str:
    """The model a ``--model`` argument names: ``synthetic`` (or None) writes the synthetic
    SmolLM2-dims model once into a new temporary folder; ``default`` is
    ``tinyloop.default_model_path()``; anything else is a path, returned as given."""
    if arg is None or arg == SYNTHETIC:
        return write_synthetic_model(os.path.join(tempfile.mkdtemp(prefix="tl_bench_"),
                                                  "smollm2_dims.tlm"))
    if arg == DEFAULT:
        import tinyloop
        return tinyloop.default_model_path()
    return arg


def model_label(arg: str | None, path: str) -> str:
    """How reports name the model: the synthetic one by its dims, others by path."""
    return "synthetic SmolLM2-135M dims" if arg in (None, SYNTHETIC) else path


def write_json(out: str | None, name: str, result) -> str | None:
    """Write ``result`` as ``out/name`` (``out`` a folder, made if missing) or, when ``out``
    ends in ``.json``, as that file; nothing when ``out`` is None. Values JSON does not know
    (Timing, tuples as keys' values, paths) are written by ``str`` or ``as_dict``. Returns
    the path written."""
    if not out:
        return None
    path = out if out.endswith(".json") else os.path.join(out, name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def enc(o):
        return o.as_dict() if isinstance(o, Timing) else str(o)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=enc)
    return path


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, each as
    wide as its widest cell."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)


@contextlib.contextmanager
def user_setting(name: str, value: str):
    """Within the block, the user setting ``name`` (a key of ``tinyloop.config.SETTINGS``,
    e.g. ``cuda_graphs``) reads ``value`` through its environment variable; the variable is
    restored (or removed) on exit. Raises KeyError for an unknown name."""
    from tinyloop.config import SETTINGS
    env = SETTINGS[name].env
    old = os.environ.get(env)
    os.environ[env] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = old


# SmolLM2-135M's attention dims, for the attention kernel benchmarks: query heads, KV heads,
# head dim, positions per KV page
ATTN_H, ATTN_HKV, ATTN_HD, ATTN_PAGE = 9, 3, 64, 32


def random_kv_slot(mode: str, ctx: int, rng):
    """One KV slot of ``mode`` pages (SmolLM2 attention dims) holding ``ctx`` positions of
    random contents, as the attention kernels read it: one device array cut into page-sized
    pieces (256-byte aligned), FP16 rows small random halves, INT8 codes random with scales
    0.01. Timing only: the values are not a real cache's. Returns (slot, the device buffer
    that must outlive it). Needs CuPy."""
    import types

    import cupy

    from tinyloop.kv.layouts import PageLayout
    lay = PageLayout(mode, ATTN_PAGE, ATTN_HKV, ATTN_HD, ATTN_H * ATTN_HD)
    npages = -(-ctx // ATTN_PAGE)
    pb = -(-lay.page_bytes // 256) * 256
    buf = cupy.asarray(rng.integers(0, 255, npages * pb, dtype=np.uint8))
    if mode == "fp16":
        n = npages * pb // 2
        buf.view(cupy.float16)[:] = cupy.asarray(rng.standard_normal(n).astype(np.float16))
    else:
        for i in range(npages):
            for name in ("k_scale", "v_scale"):
                part = next(p for p in lay.parts if p.name == name)
                o = i * pb + part.offset
                buf[o:o + part.nbytes].view(cupy.float16)[:] = 0.01
    table_host = np.array([buf.data.ptr + i * pb for i in range(npages)], np.int64)
    kv = types.SimpleNamespace(layout=lay, table=cupy.asarray(table_host),
                               table_host=table_host)
    return kv, buf


def record_launches(fn: Callable[[], object]) -> list:
    """The CUDA kernel launches ``fn()`` makes, as (kernel, grid, block, args, shared_mem)
    with their real arguments (``tinyloop.backends.cuda.launch.Kernel`` calls, recorded while
    ``fn`` runs; each still launches). ``kernel(grid, block, args, shared_mem)`` launches one
    again without the op's Python wrapper."""
    from tinyloop.backends.cuda import launch as cuda_launch
    rec = []
    real = cuda_launch.Kernel.__call__

    def spy(self, grid, block, args, shared_mem=0):
        rec.append((self, grid, block, tuple(args), shared_mem))
        return real(self, grid, block, args, shared_mem)
    cuda_launch.Kernel.__call__ = spy
    try:
        fn()
    finally:
        cuda_launch.Kernel.__call__ = real
    return rec


def weight_bytes_per_token(model, depth: int) -> int:
    """Bytes of quantized weights one decode step reads at ``depth``: each layer's matrices
    times its visits (prelude and coda once, the recurrent block ``depth`` times), the head
    (``output``, or the tied ``token_embd``) and the injection adapter once per iteration."""
    cfg = model.config
    visits = [1] * cfg.n_prelude + [depth] * cfg.n_recurrent + [1] * cfg.n_coda
    ws = model.quant_weights()
    total = sum(v * ws[f"blk.{i}.{n}"].nbytes for i, v in enumerate(visits)
                for n in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"))
    total += ws.get("output", ws["token_embd"]).nbytes
    if "inject.adapter" in ws:
        total += depth * ws["inject.adapter"].nbytes
    return total


# --- the looped architectures' published configs (config.json dicts; the sources of every
# figure are cited in benchmarks/bench_looped.py's docstring) ------------------------------------

OURO_1_4B = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": 2048,
             "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 16, "head_dim": 128, "hidden_act": "silu",
             "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
             "total_ut_steps": 4, "vocab_size": 49152, "max_position_embeddings": 65536,
             "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2}
HUGINN_3_5B = {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
               "n_embd": 5280, "n_heads": 55, "num_key_value_heads": 55, "head_dim": 96,
               "intermediate_size": 17920, "n_layers": 8, "n_layers_in_prelude": 2,
               "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
               "mean_recurrence": 32, "norm_eps": 1e-6, "rope_base": 50000.0,
               "qk_bias": True, "bias": False, "tie_embeddings": True, "vocab_size": 65536,
               "padded_vocab_size": 65536, "injection_type": "linear",
               "state_init": "like-init", "block_size": 4096,
               "init_values": {"std": (2 / (5 * 5280)) ** 0.5, "embed_scale": 5280 ** 0.5}}
NANBEIGE_3B = {"architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige",
               "hidden_size": 3072, "intermediate_size": 10752, "num_hidden_layers": 22,
               "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
               "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 7e7,
               "tie_word_embeddings": False, "num_loops": 2, "skip_loop_final_norm": False,
               "vocab_size": 166144, "max_position_embeddings": 262144,
               "bos_token_id": 166100, "eos_token_id": 166101}

_WIDTHS = ("hidden_size", "n_embd", "intermediate_size", "vocab_size", "padded_vocab_size")
_COUNTS = ("num_hidden_layers", "n_layers_in_recurrent_block")


def shrunk(conf: dict, k: int) -> dict:
    """``conf`` with widths, layer and head counts divided by ``k`` (head dims kept; at least
    one of each), for a CPU smoke run of this script."""
    c = json.loads(json.dumps(conf))
    hkey = "n_heads" if "n_heads" in c else "num_attention_heads"
    heads = c[hkey] // k or 1
    kv = max(1, c["num_key_value_heads"] // k)
    while heads % kv:
        kv -= 1
    hd = c.get("head_dim") or (c.get("hidden_size") or c["n_embd"]) // c[hkey]
    for key in _WIDTHS + _COUNTS:
        if key in c:
            c[key] = max(1, c[key] // k)
    c[hkey], c["num_key_value_heads"] = heads, kv
    for key in ("hidden_size", "n_embd"):
        if key in c:
            c[key] = heads * hd if key == "n_embd" else max(32, c[key] // 32 * 32)
    c["intermediate_size"] = max(32, c["intermediate_size"] // 32 * 32)
    if "init_values" in c:
        c["init_values"]["embed_scale"] = c["n_embd"] ** 0.5
    for key in ("bos_token_id", "eos_token_id"):
        if key in c and c[key] >= c["vocab_size"]:
            c[key] = 1 if key == "bos_token_id" else 2
    return c


# the decode benchmarks' prompt: 16 token ids, the same for every model
DECODE_PROMPT = tuple(10 + i for i in range(16))


def decode_once(model, depth: int, new_tokens: int) -> float:
    """Decode tokens/s of one generation of ``new_tokens`` tokens after DECODE_PROMPT at
    ``depth`` (no stop string, EOS ignored: every generation has the same length)."""
    return model.generate(list(DECODE_PROMPT), max_new_tokens=new_tokens, depth=depth,
                          stop=[], ignore_eos=True).decode_tokens_per_s


def warm_decode(model, depth: int, new_tokens: int, seconds: float) -> None:
    """Decode for ``seconds`` s (at least once): an idle GPU sits at a low clock, and the
    first generation at a depth captures its graphs."""
    t = time.perf_counter()
    decode_once(model, depth, new_tokens)
    while time.perf_counter() - t < seconds:
        decode_once(model, depth, new_tokens)


def prefill_ids(model, n: int) -> list[int]:
    """``n`` random token ids of the model's vocabulary (ids 3 and up), fixed by ``n``."""
    return np.random.default_rng(n).integers(3, model.config.vocab_size, n).tolist()


def prefill_once(model, ids, depth: int) -> float:
    """ms of prefilling ``ids`` at ``depth`` (one generation of one token)."""
    return model.generate(list(ids), max_new_tokens=1, depth=depth).prefill_ms


def bench_decode(model, depth: int, new_tokens: int, reps: int, warmup_s: float = 2.0) -> dict:
    """Decode tokens/s (graphs on) after ``warmup_s`` s of sustained decoding: median, min
    and max of ``reps`` generations (``decode_once``)."""
    with user_setting("cuda_graphs", "1"):
        warm_decode(model, depth, new_tokens, warmup_s)
        tps = sorted(decode_once(model, depth, new_tokens) for _ in range(reps))
    return {"median": statistics.median(tps), "min": tps[0], "max": tps[-1]}


def bench_prefill(model, n: int, depth: int, reps: int) -> float:
    """Median ms of prefilling ``n`` random tokens (``prefill_ids``) at ``depth``, after one
    untimed prefill."""
    ids = prefill_ids(model, n)
    prefill_once(model, ids, depth)                                    # warm-up
    return statistics.median(prefill_once(model, ids, depth) for _ in range(reps))


def random_quant(rng, rows: int, cols: int, bits: int, group_size: int, std: float):
    """A QuantWeight [rows, cols] of uniformly random codes whose dequantized values have
    mean 0 and standard deviation ``std`` (INT4: zero = -7.5 s; INT8: symmetric)."""
    from tinyloop.quant import QuantWeight
    groups = cols // group_size
    if bits == 4:
        q = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        s = std / np.sqrt((16 ** 2 - 1) / 12)            # a uniform code's std: sqrt(21.25)
        z = -7.5 * s
    else:
        q = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
        s, z = std / np.sqrt((255 ** 2 - 1) / 12), 0.0
    scales = np.full((rows, groups), s, np.float16)
    zeros = np.full((rows, groups), z, np.float16)
    return QuantWeight(bits, group_size, q, scales, zeros)


def write_random_model(conf: dict, path: str, bits: int = 4, group_size: int = 32,
                       seed: int = 0):
    """Write a .tlm of the model ``conf`` (a config.json dict) with random weights (what
    bench_looped and bench_adaptive run); returns its ModelConfig."""
    from tinyloop.convert.hf import folder_config
    from tinyloop.convert.synthetic import float_tensor
    from tinyloop.format import expected_tensors, write_tlm
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(conf, f)
    _, cfg = folder_config(folder)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (kind, shape) in expected_tensors(cfg).items():
        if kind == "float":
            tensors[name] = float_tensor(rng, name, shape)
            continue
        rows, cols = shape
        std = 2.0 / np.sqrt(cols) if name in ("token_embd", "output") else 1.0 / np.sqrt(cols)
        tensors[name] = random_quant(rng, rows, cols, bits, group_size, std)
    write_tlm(path, cfg, tensors, metadata={"source": "benchmarks random weights",
                                            "seed": seed, "bits": bits,
                                            "group_size": group_size})
    return cfg
