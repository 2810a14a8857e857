"""Hostile Hugging Face folders: safetensors files that break the format's tiling rule, keys
listed twice, files that are not regular files, config values of the wrong type or range.
Each one ends in a ConversionError naming the file and the field, quickly (no read of a
FIFO, no table of millions of layers), with nothing written."""

from __future__ import annotations

import json
import os
import struct
import threading

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.config import MAX_LAYERS
from tinyloop.convert.hf import check_safetensors, convert_hf, folder_config, folder_key

from .. import looped_refs as L


def _split(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def _write(path, raw_header: bytes, data: bytes):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw_header)) + raw_header + data)


def _gap(path):
    """16 bytes between the last tensor and the one before it."""
    h, data = _split(path)
    name = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b + 16, e + 16]
    _write(path, json.dumps(h).encode(), data[:b] + bytes(16) + data[b:])


def _trailing(path):
    with open(path, "ab") as f:
        f.write(bytes(64))


def _twice(path):
    """model.norm.weight listed a second time, pointing at the same bytes (json.loads
    would keep the last one silently)."""
    h, data = _split(path)
    raw = json.dumps(h)[:-1] + ', "model.norm.weight": ' + json.dumps(h["model.norm.weight"])
    _write(path, (raw + "}").encode(), data)


def _metadata(path):
    h, data = _split(path)
    h["__metadata__"] = {"format": ["np"]}
    _write(path, json.dumps(h).encode(), data)


HOSTILE = {"belong to no tensor": _gap, "after the last tensor": _trailing,
           "appears twice": _twice, "__metadata__": _metadata}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_safetensors_that_break_the_formats_rules(tmp_path, looped_folders, what):
    _, cfg, t, _ = looped_folders["nanbeige"]
    folder = str(tmp_path / "bad")
    L.save(folder, cfg, t)
    path = os.path.join(folder, "model.safetensors")
    check_safetensors(path)                  # the untouched file passes
    HOSTILE[what](path)
    with pytest.raises(errors.ConversionError, match=what):
        check_safetensors(path)
    dst = str(tmp_path / "bad.tlm")
    with pytest.raises(errors.ConversionError, match=what):
        convert_hf(folder, dst)
    assert not os.path.exists(dst)


def test_the_tiling_check_agrees_with_the_safetensors_library(tmp_path, looped_folders):
    """Each file check_safetensors refuses for its tiling, the safetensors library refuses
    too, and the file it passes, the library reads."""
    from safetensors import SafetensorError, safe_open
    _, cfg, t, _ = looped_folders["nanbeige"]
    for what in ("belong to no tensor", "after the last tensor"):
        folder = str(tmp_path / what.replace(" ", "_"))
        L.save(folder, cfg, t)
        path = os.path.join(folder, "model.safetensors")
        with safe_open(path, framework="np") as f:
            assert sorted(f.keys()) == sorted(t)
        HOSTILE[what](path)
        with pytest.raises(SafetensorError):
            with safe_open(path, framework="np") as f:
                f.get_tensor("model.norm.weight")


def _call_within(fn, seconds=30):
    """fn()'s exception (or None) from a daemon thread; fails when it has not returned in
    ``seconds`` (a read that blocks on a FIFO)."""
    box = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as e:          # noqa: BLE001 - handed to the test thread
            box.append(e)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"{fn} blocked for {seconds} s"
    return box[0]


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling symlink"])
@pytest.mark.parametrize("name", ["model-1.safetensors", "generation_config.json"])
def test_entries_that_are_not_regular_files(tmp_path, looped_folders, monkeypatch, kind, name):
    _, cfg, t, _ = looped_folders["nanbeige"]
    folder = str(tmp_path / "f")
    L.save(folder, cfg, t)
    path = os.path.join(folder, name)
    if name.endswith(".safetensors"):       # the only shard is the odd one
        os.unlink(os.path.join(folder, "model.safetensors"))
    {"fifo": os.mkfifo, "folder": os.mkdir,
     "dangling symlink": lambda p: os.symlink(str(tmp_path / "nowhere"), p)}[kind](path)
    want = "not a regular file" if kind != "dangling symlink" else "No such file"
    err = _call_within(lambda: folder_key(folder, {}))
    assert isinstance(err, errors.ConversionError) and want in str(err) and name in str(err)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    err = _call_within(lambda: tinyloop.load_model(folder, backend="numpy"))
    assert isinstance(err, errors.ConversionError) and name in str(err)
    if name.endswith(".safetensors"):
        dst = str(tmp_path / "x.tlm")
        err = _call_within(lambda: convert_hf(folder, dst))
        assert isinstance(err, errors.ConversionError) and want in str(err)
        assert not os.path.exists(dst)


def test_a_fifo_config_json_is_refused_not_read(tmp_path, looped_folders):
    _, cfg, t, _ = looped_folders["nanbeige"]
    folder = str(tmp_path / "f")
    L.save(folder, cfg, t)
    os.unlink(os.path.join(folder, "config.json"))
    os.mkfifo(os.path.join(folder, "config.json"))
    err = _call_within(lambda: folder_config(folder))
    assert isinstance(err, errors.ConversionError) and "config.json is not a regular file" \
        in str(err)


def test_an_embedding_that_is_not_a_matrix(tmp_path, looped_folders):
    _, cfg, t, _ = looped_folders["nanbeige"]
    for shape in [(), (96,), (0, 128)]:
        folder = str(tmp_path / f"e{len(shape)}")
        L.save(folder, cfg, {**t, "model.embed_tokens.weight": np.zeros(shape, np.float32)})
        with pytest.raises(errors.ConversionError,
                           match=r"'model.embed_tokens.weight' has shape .* \[vocab, hidden\]"):
            convert_hf(folder, str(tmp_path / "x.tlm"))
    _, hcfg, ht, _ = looped_folders["huginn"]
    folder = str(tmp_path / "h")
    L.save(folder, hcfg, {**ht, "transformer.wte.weight": np.zeros((), np.float32)})
    with pytest.raises(errors.ConversionError, match="'transformer.wte.weight' has shape"):
        convert_hf(folder, str(tmp_path / "x.tlm"))
    assert not os.path.exists(tmp_path / "x.tlm")


@pytest.mark.parametrize("arch,key,value,match", [
    ("nanbeige", "rope_theta", 10 ** 400, "rope_theta=.* must be a finite number"),
    ("nanbeige", "rms_norm_eps", "1e-5", "rms_norm_eps='1e-5' must be a finite number"),
    ("nanbeige", "architectures", [["NanbeigeForCausalLM"]], "unsupported architecture"),
    ("nanbeige", "architectures", [{"a": 1}, "NanbeigeForCausalLM"], None),
    ("nanbeige", "num_hidden_layers", 1 << 24, f"must be an int in 1..{MAX_LAYERS}"),
    ("nanbeige", "num_hidden_layers", MAX_LAYERS + 1, f"must be an int in 1..{MAX_LAYERS}"),
    ("ouro", "num_hidden_layers", 1 << 24, f"must be an int in 1..{MAX_LAYERS}"),
    ("huginn", "n_layers_in_recurrent_block", 1 << 24, f"must be an int in 1..{MAX_LAYERS}"),
    ("huginn", "n_layers_in_prelude", 1 << 24, f"must be an int in 0..{MAX_LAYERS}"),
    ("huginn", "rope_base", -(10 ** 400), "rope_base=.* must be a finite number"),
])
def test_config_values_of_the_wrong_type_or_range(tmp_path, looped_folders, arch, key, value,
                                                  match):
    _, cfg, t, _ = looped_folders[arch]
    folder = str(tmp_path / "c")
    L.save(folder, {**cfg, key: value}, t)
    dst = str(tmp_path / "x.tlm")
    if match is None:                       # a non-string entry before a supported one
        assert convert_hf(folder, dst).n_layers == cfg["num_hidden_layers"]
        return
    with pytest.raises(errors.ConversionError, match=match):
        convert_hf(folder, dst)
    with pytest.raises(errors.ConversionError, match=match):
        folder_config(folder)               # what `tinyloop inspect DIR` reads
    assert not os.path.exists(dst)


def test_a_model_type_that_is_not_a_string(tmp_path, looped_folders):
    _, cfg, t, _ = looped_folders["nanbeige"]
    bad = {k: v for k, v in cfg.items() if k != "architectures"}
    for mt in (["nanbeige"], {"nanbeige": 1}, 3):
        folder = str(tmp_path / f"m{type(mt).__name__}")
        L.save(folder, {**bad, "model_type": mt}, t)
        with pytest.raises(errors.ConversionError, match="unsupported architecture"):
            folder_config(folder)


def test_model_config_bounds_the_layer_count():
    from tinyloop.config import ModelConfig
    base = dict(vocab_size=8, d_model=8, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8,
                n_prelude=1, n_recurrent=MAX_LAYERS - 2, n_coda=1, default_depth=1,
                max_depth=1)
    assert ModelConfig(**base).n_layers == MAX_LAYERS
    with pytest.raises(errors.ConfigError, match=f"over the {MAX_LAYERS}-layer limit"):
        ModelConfig(**{**base, "n_coda": 2})
