"""What the benchmarks share: the synthetic model writer, the model lookup, the GPU and wall
timers (median and min-max spread over N runs) and the JSON / table writers.

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
