"""The benchmark scripts that run on the device still import and parse their arguments on the
CPU (no CuPy here), and the CPU-only page benchmark runs end to end on a small case."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _load(name: str):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"),
                           *args], capture_output=True, text=True, env=env, timeout=300)


def test_bench_kernels_imports_and_describes_itself_without_a_gpu():
    mod = _load("bench_kernels")
    # the paged-cache port: the stack is the model's slot layout at depth 1, both KV modes
    assert mod.CFG.n_slots(1) == mod.LAYERS == 30
    assert mod.KV_MODES == ("fp16", "int8")
    assert set(mod.PREFILL_KINDS.values()) == {"norms", "GEMMs", "kv write", "attention"}
    # bytes of one position of one slot, by hand: fp16 K+V rows; int8 codes + fp16 scales
    assert mod.kv_bytes_per_position("fp16") == 2 * 3 * 64 * 2
    assert mod.kv_bytes_per_position("int8") == 2 * 3 * 64 + 2 * 3 * 2
    r = _run("bench_kernels", "--help")
    assert r.returncode == 0, r.stderr
    assert "--ctx" in r.stdout and "prefill" in r.stdout
    if mod.cupy is None:
        r = _run("bench_kernels", "--quick")
        assert r.returncode != 0 and "needs CuPy" in r.stderr


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


def test_ab_kernels_extracts_another_commits_kernels(tmp_path):
    """benchmarks/ab_kernels.py side B: a commit's kernel folder unpacked intact (compared
    with git's own copy of each file; this commit's package folder and an older commit's
    cuda_src/), and --help without a GPU."""
    mod = _load("ab_kernels")
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
    r = _run("ab_kernels", "--help")
    assert r.returncode == 0, r.stderr
    assert "REF" in r.stdout or "ref" in r.stdout


def test_graph_replay_and_step_kernels_describe_themselves_without_a_gpu():
    """The two decode-step profilers import and parse their arguments here (they run on the
    device: scripts/device_run.sh); step_kernels' per-kernel groups key on the recorded
    launch's kernel name and GEMV shape (rows x K: the O and down projections share a name)."""
    for name, flag in (("graph_replay", "--pdl"), ("step_kernels", "--ctx")):
        r = _run(name, "--help")
        assert r.returncode == 0, r.stderr
        assert flag in r.stdout
    mod = _load("step_kernels")
    assert mod.group_key("gemv_q4_resid", (1, 2, 3, 4, 576, 1536, 0, 5, 6)) == \
        "gemv_q4_resid 576x1536"
    assert mod.group_key("attn_split_fp16_hd64", (1, 2, 3)) == "attn_split_fp16_hd64"
    assert mod.group_key("gemv2_norm_q8_argmax_l4", tuple(range(15))) == \
        "gemv2_norm_q8_argmax_l4"


def test_step_kernels_bytes_per_launch():
    """The per-kernel table's bytes: the weight a launch is passed (found by its codes'
    address), one row of it for the embedding lookup, the slot's K / V for every key of the
    context for the decode attention, nothing for the rest."""
    mod = _load("step_kernels")
    wb = {0x7000: (4_000_000, 1000), 0x9000: (120_000, 960)}
    assert mod.launch_bytes("gemv_q4_resid", (5, 0x9000, 6, 1.5, 576), wb, 0, 0) == 120_000
    assert mod.launch_bytes("gemv2_norm_q8_argmax_l4", (0x1, 1e-5, 0x7000), wb, 0, 0) == \
        4_000_000
    assert mod.launch_bytes("embed_q8", (0x7000, 0x2, 0x3), wb, 0, 0) == 4_000
    # 64 keys of context before the step's own: 65 rows of K and V
    assert mod.launch_bytes("attn_split_fp16_hd64", (0x9000, 1, 2), wb, 768, 64) == 768 * 65
    assert mod.launch_bytes("decode_step_advance", (0x11, 0x12, 1e4, 64), wb, 768, 64) == 0
    r = _run("bench_decode", "--help")
    assert r.returncode == 0, r.stderr
    assert "--no-step-table" in r.stdout


def test_looped_quant_runs_on_the_cpu():
    """benchmarks/looped_quant.py: one row per (architecture, bits, depth); INT8 closer to the
    unquantized checkpoint than INT4 at every depth."""
    r = _run("looped_quant", "--seeds", "1", "--tokens", "16")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[2:] if ln.strip()]
    assert {row[0] for row in rows} == {"ouro", "huginn", "nanbeige"} and len(rows) == 18
    kl = {(a, int(b), int(d)): float(m) for a, b, d, m, *_ in rows}
    for (a, b, d), v in kl.items():
        if b == 8:
            assert v < kl[(a, 4, d)]


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
    mod = _load("bench_looped")
    assert not hasattr(mod, "rows")                   # no work at import
