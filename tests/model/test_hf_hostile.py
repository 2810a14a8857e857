"""Hostile Hugging Face folders: entries that are not regular files, an embedding that is not
a matrix, config values of the wrong type or range (the safetensors header cases are in
test_looped_archs.py).
Each one ends in a ConversionError naming the file and the field, quickly (no read of a
FIFO, no table of millions of layers), with nothing written."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.config import MAX_LAYERS
from tinyloop.convert.hf import convert_hf, folder_config, folder_key

from .. import looped_refs as L


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
