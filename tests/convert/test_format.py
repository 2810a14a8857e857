"""Every .tlm validation case raises its own named error, on crafted files."""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.format import ALIGN, MAGIC, PREFIX, VERSION_MAX, align, read_tlm


def _split(path):
    raw = pathlib.Path(path).read_bytes()
    magic, version, _, hlen = PREFIX.unpack(raw[:PREFIX.size])
    header = json.loads(raw[PREFIX.size:PREFIX.size + hlen])
    data = raw[align(PREFIX.size + hlen):]
    return version, header, data


def _write(path, header, data, *, magic=MAGIC, version=1, header_len=None):
    h = json.dumps(header).encode()
    hl = len(h) if header_len is None else header_len
    start = align(PREFIX.size + len(h))
    with open(path, "wb") as f:
        f.write(PREFIX.pack(magic, version, 0, hl))
        f.write(h)
        f.write(b"\0" * (start - PREFIX.size - len(h)))
        f.write(data)
    return str(path)


def _entry(header, name):
    return next(e for e in header["tensors"] if e["name"] == name)


@pytest.fixture
def parts(tiny_model_path):
    return _split(tiny_model_path)


def test_roundtrip_reads_back(tiny_model_path):
    with read_tlm(tiny_model_path) as f:
        assert f.config.d_model == 64 and f.version == 1
        assert f.data_start % ALIGN == 0
        assert all(e.offset % ALIGN == 0 for e in f.entries.values())
        qw = f.quant_weight("blk.0.attn_qkv")
        assert qw.shape == (f.config.qkv_dim, 64) and qw.bits == 4 and qw.group_size == 32


def test_bad_magic(tmp_path, parts):
    _, h, d = parts
    p = _write(tmp_path / "m.tlm", h, d, magic=b"GGUF\0\0\0\0")
    with pytest.raises(errors.BadMagicError, match="not a .tlm file"):
        read_tlm(p)


def test_newer_version(tmp_path, parts):
    _, h, d = parts
    p = _write(tmp_path / "v.tlm", h, d, version=VERSION_MAX + 1)
    with pytest.raises(errors.UnsupportedVersionError, match="VERSION_MAX"):
        read_tlm(p)


def test_inconsistent_dims(tmp_path, parts):
    _, h, d = parts
    h["config"]["n_kv_heads"] = 3          # 4 heads are not a multiple of 3 kv heads
    with pytest.raises(errors.InconsistentDimsError, match="n_kv_heads"):
        read_tlm(_write(tmp_path / "d.tlm", h, d))
    h["config"]["n_kv_heads"] = 2
    h["config"]["default_depth"] = 9       # > max_depth 4
    with pytest.raises(errors.InconsistentDimsError, match="default_depth"):
        read_tlm(_write(tmp_path / "d2.tlm", h, d))


def test_tensor_out_of_bounds(tmp_path, parts):
    _, h, d = parts
    _entry(h, "output_norm")["offset"] = align(len(d) + 4096)
    with pytest.raises(errors.TensorBoundsError, match="output_norm"):
        read_tlm(_write(tmp_path / "b.tlm", h, d))


def test_tensors_overlap(tmp_path, parts):
    _, h, d = parts
    a, b = _entry(h, "blk.0.attn_norm"), _entry(h, "blk.0.ffn_norm")
    b["offset"] = a["offset"]
    with pytest.raises(errors.TensorOverlapError, match="overlap"):
        read_tlm(_write(tmp_path / "o.tlm", h, d))


def test_wrong_shape_for_dims(tmp_path, parts):
    _, h, d = parts
    e = _entry(h, "blk.0.attn_norm")
    e["shape"], e["nbytes"] = [32], 128
    with pytest.raises(errors.TensorShapeError, match="blk.0.attn_norm"):
        read_tlm(_write(tmp_path / "s.tlm", h, d))


def test_wrong_dtype_for_dims(tmp_path, parts):
    _, h, d = parts
    e = _entry(h, "blk.0.attn_qkv.scales")
    e["dtype"], e["shape"] = "u8", [e["shape"][0], e["shape"][1] * 2]
    with pytest.raises(errors.TensorShapeError, match="scales"):
        read_tlm(_write(tmp_path / "t.tlm", h, d))


def test_missing_tensor(tmp_path, parts):
    _, h, d = parts
    h["tensors"] = [e for e in h["tensors"] if e["name"] != "blk.1.ffn_down.zeros"]
    with pytest.raises(errors.TensorShapeError, match="blk.1.ffn_down.zeros"):
        read_tlm(_write(tmp_path / "x.tlm", h, d))


def test_nbytes_disagrees_with_shape(tmp_path, parts):
    _, h, d = parts
    _entry(h, "output_norm")["nbytes"] += 4
    with pytest.raises(errors.TensorShapeError, match="nbytes"):
        read_tlm(_write(tmp_path / "n.tlm", h, d))


def test_truncated_data(tmp_path, parts):
    _, h, d = parts
    p = _write(tmp_path / "tr.tlm", h, d[: len(d) - 1000])
    with pytest.raises(errors.TruncatedFileError, match="truncated"):
        read_tlm(p)


def test_truncated_header(tmp_path, tiny_model_path):
    raw = pathlib.Path(tiny_model_path).read_bytes()
    p = tmp_path / "th.tlm"
    p.write_bytes(raw[:PREFIX.size + 10])
    with pytest.raises(errors.TruncatedFileError, match="header"):
        read_tlm(p)
    p.write_bytes(raw[:5])
    with pytest.raises(errors.TruncatedFileError):
        read_tlm(p)


def test_huge_header_length_is_refused_before_reading(tmp_path, parts):
    _, h, d = parts
    p = _write(tmp_path / "hl.tlm", h, d, header_len=(1 << 63) + 5)
    with pytest.raises(errors.SizeOverflowError, match="header length"):
        read_tlm(p)


def test_size_overflow_in_shape(tmp_path, parts):
    _, h, d = parts
    e = _entry(h, "output_norm")
    e["shape"] = [1 << 40, 1 << 40]
    e["nbytes"] = 4 << 80
    with pytest.raises(errors.SizeOverflowError, match="output_norm"):
        read_tlm(_write(tmp_path / "ov.tlm", h, d))


def test_negative_size(tmp_path, parts):
    _, h, d = parts
    _entry(h, "output_norm")["offset"] = -64
    with pytest.raises(errors.SizeOverflowError, match="negative"):
        read_tlm(_write(tmp_path / "neg.tlm", h, d))


def test_garbage_header(tmp_path):
    p = tmp_path / "g.tlm"
    body = b"\xff\xfe not json"
    p.write_bytes(PREFIX.pack(MAGIC, 1, 0, len(body)) + body)
    with pytest.raises(errors.FormatError, match="JSON"):
        read_tlm(p)


def test_load_model_rejects_bad_file_and_allocates_nothing(tmp_path, parts):
    from tinyloop.memory import get_pool
    _, h, d = parts
    _entry(h, "output_norm")["nbytes"] += 4
    p = _write(tmp_path / "bad.tlm", h, d)
    pool = get_pool("host")
    before = pool.stats().allocated_bytes if hasattr(pool, "stats") else pool.allocated_bytes
    with pytest.raises(tinyloop.TinyLoopError):
        tinyloop.load_model(p, backend="numpy")
    after = pool.stats().allocated_bytes if hasattr(pool, "stats") else pool.allocated_bytes
    assert after == before


def test_writer_refuses_tensors_that_do_not_match(tmp_path):
    from tinyloop.convert.synthetic import synthetic_config, synthetic_weights
    from tinyloop.format import write_tlm
    from ..conftest import TINY
    cfg = synthetic_config(**TINY)
    w = synthetic_weights(cfg, 0)
    del w["blk.0.ffn_norm"]
    with pytest.raises(errors.TensorShapeError, match="missing"):
        write_tlm(tmp_path / "w.tlm", cfg, w)
    w = synthetic_weights(cfg, 0)
    w["output_norm"] = np.ones(3, np.float32)
    with pytest.raises(errors.TensorShapeError, match="output_norm"):
        write_tlm(tmp_path / "w.tlm", cfg, w)
    assert not (tmp_path / "w.tlm").exists()


def test_writer_refuses_a_tokenizer_larger_than_the_vocab(tmp_path):
    from tinyloop.convert.synthetic import (byte_level_tokenizer_json, synthetic_config,
                                            synthetic_weights)
    from tinyloop.format import write_tlm
    from ..conftest import TINY
    cfg = synthetic_config(**TINY)                       # vocab 300
    with pytest.raises(errors.TensorShapeError, match="ids up to 399"):
        write_tlm(tmp_path / "t.tlm", cfg, synthetic_weights(cfg, 0),
                  tokenizer_json=byte_level_tokenizer_json(400))


def test_prefix_struct_is_24_bytes():
    assert PREFIX.size == 24 and struct.calcsize("<8sIIQ") == 24


V1_FIXTURE = pathlib.Path(__file__).parent.parent / "data" / "v1_synthetic.tlm"
V1_KEYS = {"vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
           "n_prelude", "n_recurrent", "n_coda", "default_depth", "max_depth", "rope_theta",
           "norm_eps", "injection", "tied_head", "bos_token_id", "eos_token_id"}


def test_a_file_of_the_version_1_writer_loads_and_is_rewritten_byte_for_byte(tmp_path):
    """tests/data/v1_synthetic.tlm was written by the VERSION 1 writer (write_synthetic of
    commit ca4b00d, seed 5): it loads, and today's writer writes the same model to the same
    bytes (VERSION 1, the same config keys), so older readers read it and its fingerprint
    and saved prefixes stay valid."""
    from tinyloop.convert.synthetic import write_synthetic
    version, header, _ = _split(V1_FIXTURE)
    assert version == 1 and set(header["config"]) == V1_KEYS
    with read_tlm(V1_FIXTURE) as f:
        cfg = f.config
        assert (cfg.layer_norms, cfg.loop_norm, cfg.state_init, cfg.qkv_bias) == \
            ("pre", False, "prelude", False)
    again = tmp_path / "again.tlm"
    write_synthetic(again, cfg, seed=5)
    assert again.read_bytes() == V1_FIXTURE.read_bytes()
    m = tinyloop.load_model(str(V1_FIXTURE), backend="numpy", max_seq_len=16)
    try:
        assert np.isfinite(m.logits([1, 2, 3], depth=3)).all()
    finally:
        tinyloop.free_model(m)


def test_version_2_facts_need_a_version_2_file(tmp_path):
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    cfg = synthetic_config(dict(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1,
                                head_dim=16, ffn_dim=64, n_prelude=0, n_recurrent=2,
                                n_coda=0, max_depth=2, layer_norms="pre_post",
                                loop_norm=True))
    p = tmp_path / "v2.tlm"
    write_synthetic(p, cfg, seed=1)
    version, header, data = _split(p)
    assert version == 2 and header["config"]["layer_norms"] == "pre_post"
    names = {e["name"] for e in header["tensors"]}
    assert {"blk.1.attn_post_norm", "blk.1.ffn_post_norm"} <= names
    with read_tlm(p) as f:
        assert f.config == cfg
    bad = _write(tmp_path / "as_v1.tlm", header, data, version=1)
    with pytest.raises(errors.InconsistentDimsError, match="need .tlm VERSION 2"):
        read_tlm(bad)


@pytest.mark.parametrize("change, match", [
    ({"layer_norms": "post"}, "layer_norms"),
    ({"state_init": "normal"}, "state_std"),
    ({"state_init": "normal", "state_std": 0.5}, "injection='adapter'"),
    ({"sliding_window": 4}, "given together"),
    ({"sliding_window": 4, "sliding_layers": [3]}, "0..n_layers-1"),
    ({"embed_scale": 0.0}, "embed_scale"),
    ({"loop_norm": 1}, "loop_norm"),
])
def test_version_2_facts_are_validated(change, match):
    from tinyloop.config import ModelConfig
    base = dict(vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                n_prelude=0, n_recurrent=2, n_coda=0, max_depth=2)
    with pytest.raises(errors.ConfigError, match=match):
        ModelConfig(**{**base, **change})
