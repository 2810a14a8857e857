"""Ouro, Huginn and Nanbeige: Hugging Face folders with the published tensor names and config
keys (written here), converted and run on the NumPy backend, against the independent float64
forward of each architecture in tests/looped_refs.py."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.config import KV_MODES
from tinyloop.convert.hf import NANBEIGE_OPTIONS, check_safetensors, convert_hf, folder_config

from .. import looped_refs as L

KL_MAX = 1e-4
PROMPT = 40


def _ids(n, vocab, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n)


def _depths(m):
    return sorted({1, 2, m.config.max_depth})


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("chunk", [0, 8])
def test_logits_match_the_published_forward(looped_folders, arch, chunk):
    folder, cfg, t, tlm = looped_folders[arch]
    ref = L.ARCHS[arch][1]
    ids = _ids(PROMPT, cfg["vocab_size"])
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=chunk)
    try:
        for depth in _depths(m):
            kl = L.kl_rows(ref(cfg, t, ids, depth), m.logits(ids, depth=depth))
            assert kl.max() <= KL_MAX, (arch, depth, kl.max())
        # the loop matters: one pass and the deepest are far apart in the oracle itself
        top = m.config.max_depth
        assert L.kl_rows(ref(cfg, t, ids, top), ref(cfg, t, ids, 1)).max() > 1e-2
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("arch", list(L.ARCHS))
def test_decode_steps_follow_the_published_forward(looped_folders, arch):
    folder, cfg, t, tlm = looped_folders[arch]
    ref = L.ARCHS[arch][1]
    ids = _ids(12, cfg["vocab_size"], seed=3)
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=8)
    try:
        depth = m.config.max_depth
        new = m.generate(ids, max_new_tokens=6, depth=depth, stop=[]).token_ids
        seq = np.concatenate([ids, np.asarray(new, dtype=ids.dtype)])
        want = np.argmax(ref(cfg, t, seq, depth), axis=1)[len(ids) - 1:-1]
        assert list(new) == list(want)
        # and the decoded rows' logits, one step at a time (teacher forcing through a stream
        # of single-position forwards after a prefix)
        pc = m.prefill(seq[:len(ids)], depth=depth)
        try:
            got = m.logits(seq, depth=depth, prefix=pc)
        finally:
            pc.release()
        assert L.kl_rows(ref(cfg, t, seq, depth), got).max() <= KL_MAX
    finally:
        tinyloop.free_model(m)


# KV modes: each is compared with the oracle reading K/V as that mode stores them
# (looped_refs.stored_h / stored_kv). The INT8 modes round K, V or h to codes, and over longer
# prompts and more loops a few values that lie on a rounding boundary round the other way in
# float32 than in the oracle's float64, so they get a looser bound there; over a short
# prompt the two agree as closely as the fp16 mode.
MODE_BOUND = {"fp16": KL_MAX, "h_fp16": KL_MAX, "int8": 1e-3, "h_int8": 1e-3}


@pytest.mark.parametrize("arch", list(L.ARCHS))
@pytest.mark.parametrize("mode", [m for m in KV_MODES if m != "h_int4"])
def test_kv_modes_match_the_oracle_of_their_storage(looped_folders, arch, mode):
    folder, cfg, t, tlm = looped_folders[arch]
    ref = L.ARCHS[arch][1]
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=8)
    try:
        depth = m.config.max_depth
        for n, bound in ((8, KL_MAX), (PROMPT, MODE_BOUND[mode])):
            ids = _ids(n, cfg["vocab_size"])
            kl = L.kl_rows(ref(cfg, t, ids, depth, mode), m.logits(ids, depth=depth,
                                                                     kv_mode=mode))
            assert kl.max() <= bound, (n, kl.max())
        if mode in ("int8", "h_int8"):      # the storage's own oracle is the one that fits
            ids = _ids(PROMPT, cfg["vocab_size"])
            assert L.kl_rows(ref(cfg, t, ids, depth), m.logits(ids, depth=depth,
                                                                kv_mode=mode)).max() > 1e-3
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("arch", list(L.ARCHS))
def test_h_int4_runs_and_is_chunk_invariant(looped_folders, arch):
    folder, cfg, t, tlm = looped_folders[arch]
    ids = _ids(PROMPT, cfg["vocab_size"])
    got = []
    for chunk in (0, 8):
        m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=chunk)
        try:
            got.append(m.logits(ids, depth=m.config.max_depth, kv_mode="h_int4"))
        finally:
            tinyloop.free_model(m)
    assert np.isfinite(got[0]).all()
    np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.parametrize("arch", list(L.ARCHS))
def test_prefix_cache_and_resume_upgrade(looped_folders, arch):
    folder, cfg, t, tlm = looped_folders[arch]
    ref = L.ARCHS[arch][1]
    ids = _ids(PROMPT, cfg["vocab_size"], seed=5)
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=8)
    try:
        top = m.config.max_depth
        fresh = m.logits(ids, depth=top)
        pc = m.prefill(ids[:13], depth=top)
        try:
            np.testing.assert_array_equal(m.logits(ids, prefix=pc), fresh)
        finally:
            pc.release()
        rh = m.resume_handle(ids[:21], depth=1, max_depth=top)
        try:
            np.testing.assert_array_equal(m.logits(ids, prefix=rh), m.logits(ids, depth=1))
            rh.upgrade(top)
            got = m.logits(ids, prefix=rh)
            np.testing.assert_array_equal(got, fresh)
            assert L.kl_rows(ref(cfg, t, ids, top), got).max() <= KL_MAX
        finally:
            rh.release()
    finally:
        tinyloop.free_model(m)


def test_huginn_state_is_the_documented_seeded_normal(looped_folders):
    from tinyloop.backends.base import seeded_state
    got = seeded_state(3, 5, 40, 0.7, 11)
    want = L.documented_state(8, 40, 0.7, 11)[3:]
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.abs(got).max() <= 3 * 0.7 + 1e-6 and got.std() > 0.4
    # the seed is the checkpoint's: another seed is another (repeatable) run
    folder, cfg, t, _ = looped_folders["huginn"]
    ids = _ids(10, cfg["vocab_size"])
    logits = {}
    for seed in (0, 7):
        tlm = os.path.join(os.path.dirname(folder), f"huginn_seed{seed}.tlm")
        convert_hf(folder, tlm, bits=8, state_seed=seed)
        m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=16)
        try:
            logits[seed] = m.logits(ids, depth=2)
            np.testing.assert_array_equal(m.logits(ids, depth=2), logits[seed])
        finally:
            tinyloop.free_model(m)
        assert L.kl_rows(L.huginn_logits(cfg, t, ids, 2, state_seed=seed),
                         logits[seed]).max() <= KL_MAX
    assert np.abs(logits[0] - logits[7]).max() > 1e-3


def test_ouro_sliding_window_and_config(looped_folders):
    folder, cfg, t, tlm = looped_folders["ouro"]
    with tinyloop.format.read_tlm(tlm) as f:
        c = f.config
        assert f.version == 2
    assert (c.n_prelude, c.n_recurrent, c.n_coda, c.max_depth) == (0, 2, 0, 3)
    assert (c.layer_norms, c.loop_norm, c.exit_gate) == ("pre_post", True, True)
    assert (c.sliding_window, c.sliding_layers) == (5, (1,))
    assert not c.tied_head and c.rope_theta == 1e6 and c.head_dim == 128
    # the window is real: the oracle with full attention everywhere disagrees
    full = dict(cfg, layer_types=["full_attention"] * 2)
    ids = _ids(PROMPT, cfg["vocab_size"])
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64)
    try:
        assert L.kl_rows(L.ouro_logits(full, t, ids, 3), m.logits(ids, depth=3)).max() > 1e-3
    finally:
        tinyloop.free_model(m)


def test_nanbeige_skip_loop_final_norm(tmp_path):
    cfg, t = L.nanbeige_checkpoint(2, skip_loop_final_norm=True)
    L.save(str(tmp_path / "nb"), cfg, t)
    c = convert_hf(str(tmp_path / "nb"), str(tmp_path / "nb.tlm"), bits=8)
    assert not c.loop_norm and c.max_depth == 3 and c.tied_head
    ids = _ids(PROMPT, 96)
    m = tinyloop.load_model(str(tmp_path / "nb.tlm"), backend="numpy", max_seq_len=64)
    try:
        got = m.logits(ids, depth=3)
    finally:
        tinyloop.free_model(m)
    assert L.kl_rows(L.nanbeige_logits(cfg, t, ids, 3), got).max() <= KL_MAX
    normed = dict(cfg, skip_loop_final_norm=False)
    assert L.kl_rows(L.nanbeige_logits(normed, t, ids, 3), got).max() > 1e-3



@pytest.mark.parametrize("key", sorted(NANBEIGE_OPTIONS))
def test_nanbeige_options_tinyloop_does_not_run_are_refused(tmp_path, key):
    """Each option of the published modeling code that changes the forward (NANBEIGE_OPTIONS)
    is refused when on, naming it, and converts when off in each JSON spelling of off."""
    cfg, t = L.nanbeige_checkpoint(0)
    on = 2 if key in ("emb_neighbor_num", "loop_middle_layers") else \
        [1] if key == "insert_ngram_layer_idx" else True
    L.save(str(tmp_path / "on"), {**cfg, key: on}, t)
    with pytest.raises(errors.ConversionError, match=f"{key}=.* which TinyLoop does not run"):
        folder_config(str(tmp_path / "on"))
    with pytest.raises(errors.ConversionError, match=key):
        convert_hf(str(tmp_path / "on"), str(tmp_path / "on.tlm"))
    assert not os.path.exists(tmp_path / "on.tlm")
    for i, off in enumerate([False, None, 0, []]):
        L.save(str(tmp_path / f"off{i}"), {**cfg, key: off}, t)
        assert folder_config(str(tmp_path / f"off{i}"))[1].max_depth == cfg["num_loops"]


@pytest.mark.parametrize("extra,match", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
     "layers other than full attention"),
    ({"layer_types": ["full_attention"]}, "for each of the 2 layers"),
    ({"use_sliding_window": True, "sliding_window": 4}, "layers other than full attention"),
    ({"loop_loss_weights": [0.5]}, "lists 1 weight, which the modeling code runs as 2 loops, "
                                   "but num_loops=3"),
    ({"loop_loss_weights": ["0.5", 1]}, "must be a list of numbers"),
    ({"loop_loss_weights": 0.5}, "must be a list of numbers"),
    ({"num_loops": None, "loop_loss_weights": [0.1] * 5000},
     "loop_loss_weights lists 5000 weights: 5001 loops is over the 4096-loop limit"),
    ({"num_loops": 5000}, "num_loops=5000 must be an int in 1..4096"),
])
def test_nanbeige_config_facts_that_would_change_the_forward(tmp_path, extra, match):
    cfg, t = L.nanbeige_checkpoint(0)
    L.save(str(tmp_path / "c"), {**cfg, **extra}, t)
    with pytest.raises(errors.ConversionError, match=match):
        folder_config(str(tmp_path / "c"))


def test_nanbeige_loop_count_from_loop_loss_weights(tmp_path, looped_folders):
    """``loop_loss_weights`` of n entries means n + 1 loops (the published modeling code's
    ``_get_num_loops``): without ``num_loops`` the folder converts to the same model as the
    one that states it."""
    _, cfg, t, tlm = looped_folders["nanbeige"]
    other = {k: v for k, v in cfg.items() if k != "num_loops"}
    other.update(loop_loss_weights=[0.25] * (cfg["num_loops"] - 1))
    L.save(str(tmp_path / "o"), other, t)
    c = convert_hf(str(tmp_path / "o"), str(tmp_path / "o.tlm"), bits=8)
    assert c.max_depth == cfg["num_loops"]
    ids = _ids(PROMPT, cfg["vocab_size"])
    got, want = [], []
    for path, out in ((str(tmp_path / "o.tlm"), got), (tlm, want)):
        m = tinyloop.load_model(path, backend="numpy", max_seq_len=64)
        try:
            out.append(m.logits(ids, depth=c.max_depth))
        finally:
            tinyloop.free_model(m)
    np.testing.assert_array_equal(got[0], want[0])
    assert L.kl_rows(L.nanbeige_logits(cfg, t, ids, c.max_depth), got[0]).max() <= KL_MAX


# --- import: dtypes, shards, hostile files ------------------------------------------------------
def _save_dtype(folder, cfg, t, dtype):
    """The checkpoint with its tensors stored as BF16 (safetensors.serialize_file with the
    raw bits: NumPy has no bfloat16) or F16."""
    from safetensors import TensorSpec, serialize_file
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    keep, specs = [], {}
    for name, a in t.items():
        if dtype == "bf16":
            bits = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        else:
            bits = np.ascontiguousarray(a, np.float16)
        keep.append(bits)
        specs[name] = TensorSpec(dtype="bfloat16" if dtype == "bf16" else "float16",
                                 shape=list(a.shape), data_ptr=bits.ctypes.data,
                                 data_len=bits.nbytes)
    serialize_file(specs, os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_bf16_and_f16_checkpoints(tmp_path, arch, dtype):
    make, ref, _ = L.ARCHS[arch]
    cfg, t = make(4)
    t = {k: L.bf16_exact(v) for k, v in t.items()}       # every value exact in BF16 and F16
    assert all(np.array_equal(v.astype(np.float16).astype(np.float32), v) for v in t.values())
    _save_dtype(str(tmp_path / "ck"), cfg, t, dtype)
    with open(tmp_path / "ck" / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        assert {e["dtype"] for k, e in json.loads(f.read(n)).items()
                if k != "__metadata__"} == {"BF16" if dtype == "bf16" else "F16"}
    convert_hf(str(tmp_path / "ck"), str(tmp_path / "ck.tlm"), bits=8)
    ids = _ids(20, cfg["vocab_size"])
    m = tinyloop.load_model(str(tmp_path / "ck.tlm"), backend="numpy", max_seq_len=32)
    try:
        got = m.logits(ids, depth=2)
    finally:
        tinyloop.free_model(m)
    assert L.kl_rows(ref(cfg, t, ids, 2), got).max() <= KL_MAX


def test_sharded_checkpoint_with_index(tmp_path, looped_folders):
    _, cfg, t, tlm = looped_folders["nanbeige"]
    L.save(str(tmp_path / "sh"), cfg, t, shards=3)
    assert len([f for f in os.listdir(tmp_path / "sh") if f.endswith(".safetensors")]) == 3
    convert_hf(str(tmp_path / "sh"), str(tmp_path / "sh.tlm"), bits=8)
    ids = _ids(20, cfg["vocab_size"])
    out = []
    for path in (tlm, str(tmp_path / "sh.tlm")):
        m = tinyloop.load_model(path, backend="numpy", max_seq_len=32)
        try:
            out.append(m.logits(ids, depth=3))
        finally:
            tinyloop.free_model(m)
    np.testing.assert_array_equal(out[0], out[1])


def _split(path):
    """(JSON header, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()


def _write(path, raw_header: bytes, data: bytes):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw_header)) + raw_header + data)


def _rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header through ``edit(header) -> header`` (or raw
    bytes), keeping the data bytes."""
    header, data = _split(path)
    new = edit(header)
    _write(path, new if isinstance(new, bytes) else json.dumps(new).encode(), data)


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


def _one_tensor(header, name="model.norm.weight"):
    return header[name]


HOSTILE = {
    "header length": lambda p: open(p, "r+b").write(struct.pack("<Q", 1 << 40)),
    "not UTF-8 JSON": lambda p: _rewrite_header(p, lambda h: b"\xff{not json"),
    "unknown dtype": lambda p: _rewrite_header(
        p, lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "Q4"}}),
    "data_offsets": lambda p: _rewrite_header(
        p, lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"],
                                                  "data_offsets": [0, 1 << 50]}}),
    "needs": lambda p: _rewrite_header(     # a shape whose bytes overflow any int64
        p, lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"],
                                                  "shape": [1 << 40, 1 << 40]}}),
    "shape": lambda p: _rewrite_header(
        p, lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [-1]}}),
    "overlap": lambda p: _rewrite_header(
        p, lambda h: {**h, "model.norm.weight": {
            **h["model.norm.weight"],
            "data_offsets": [h["model.embed_tokens.weight"]["data_offsets"][0],
                             h["model.embed_tokens.weight"]["data_offsets"][0]
                             + h["model.norm.weight"]["data_offsets"][1]
                             - h["model.norm.weight"]["data_offsets"][0]]}}),
    # the format's tiling rule, keys listed once, string metadata (safetensors' own checks)
    "belong to no tensor": _gap,
    "after the last tensor": _trailing,
    "appears twice": lambda p: _rewrite_header(    # json.loads would keep the last silently
        p, lambda h: (json.dumps(h)[:-1] + ', "model.norm.weight": '
                      + json.dumps(h["model.norm.weight"]) + "}").encode()),
    "__metadata__": lambda p: _rewrite_header(p, lambda h: {**h, "__metadata__": {"f": [1]}}),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_safetensors_headers(tmp_path, looped_folders, what):
    _, cfg, t, _ = looped_folders["nanbeige"]
    folder = str(tmp_path / "bad")
    L.save(folder, cfg, t)
    path = os.path.join(folder, "model.safetensors")
    HOSTILE[what](path)
    with pytest.raises(errors.ConversionError, match=what):
        check_safetensors(path)
    dst = str(tmp_path / "bad.tlm")
    with pytest.raises(errors.ConversionError, match=what):
        convert_hf(folder, dst)
    assert not os.path.exists(dst) and os.listdir(tmp_path) == ["bad"]


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


def test_hostile_folders(tmp_path, looped_folders):
    _, cfg, t, _ = looped_folders["nanbeige"]

    def case(name, cfg=cfg, t=t, **kw):
        folder = str(tmp_path / name)
        L.save(folder, cfg, t, **kw)
        return folder
    with pytest.raises(errors.ConversionError, match="unsupported architecture "
                                                     "'LlamaForCausalLM'"):
        convert_hf(case("llama", cfg=dict(cfg, architectures=["LlamaForCausalLM"])),
                   str(tmp_path / "x.tlm"))
    with pytest.raises(errors.ConversionError, match="unsupported architecture 'gpt2'"):
        bad = dict(cfg, model_type="gpt2")
        del bad["architectures"]
        convert_hf(case("gpt2", cfg=bad), str(tmp_path / "x.tlm"))
    with pytest.raises(errors.ConversionError, match="num_attention_heads"):
        convert_hf(case("heads", cfg=dict(cfg, num_attention_heads=-3)),
                   str(tmp_path / "x.tlm"))
    with pytest.raises(errors.ConversionError, match="config needs"):
        convert_hf(case("dims", cfg=dict(cfg, intermediate_size=224)),
                   str(tmp_path / "x.tlm"))
    no_norm = {k: v for k, v in t.items() if k != "model.norm.weight"}
    with pytest.raises(errors.ConversionError, match="'model.norm.weight' is missing"):
        convert_hf(case("missing", t=no_norm), str(tmp_path / "x.tlm"))
    with pytest.raises(errors.ConversionError, match="does not map"):
        convert_hf(case("extra", t={**t, "model.extra.weight": np.zeros(4, np.float32)}),
                   str(tmp_path / "x.tlm"))
    sharded = case("shards", shards=2)
    os.unlink(os.path.join(sharded, "model-00002-of-00002.safetensors"))
    with pytest.raises(errors.ConversionError, match="missing from"):
        convert_hf(sharded, str(tmp_path / "x.tlm"))
    with open(os.path.join(case("escape", shards=2), "model.safetensors.index.json"),
              "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "../model.safetensors"}}, f)
    with pytest.raises(errors.ConversionError, match="not a .safetensors file name"):
        convert_hf(str(tmp_path / "escape"), str(tmp_path / "x.tlm"))
    assert not os.path.exists(tmp_path / "x.tlm")


def test_cli_convert_and_load_model_folder_caches(tmp_path, looped_folders, monkeypatch, capsys):
    from tinyloop import cli
    from tinyloop.convert import hf
    folder, cfg, t, _ = looped_folders["ouro"]
    assert cli.main(["convert", folder, str(tmp_path / "o4.tlm"), "--bits", "4"]) == 0
    assert "layer_norms=pre_post" in capsys.readouterr().out
    with tinyloop.format.read_tlm(str(tmp_path / "o4.tlm")) as f:
        assert f.quant_weight("blk.0.attn_qkv").bits == 4
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    real = hf.convert_hf
    monkeypatch.setattr(hf, "convert_hf", lambda *a, **k: calls.append(a) or real(*a, **k))
    ids = _ids(10, cfg["vocab_size"])
    got = []
    for _ in range(2):
        m = tinyloop.load_model(folder, backend="numpy", max_seq_len=16)
        try:
            assert m.path.startswith(str(tmp_path / "cache"))
            got.append(m.logits(ids, depth=3))
        finally:
            tinyloop.free_model(m)
    assert len(calls) == 1                      # converted once, then loaded from the cache
    np.testing.assert_array_equal(got[0], got[1])



def _chatml_tokenizer_json(vocab: int) -> str:
    """A byte-level BPE of ``vocab`` ids: <|endoftext|>, <|im_start|>, <|im_end|> at 0, 1, 2
    (SmolLM2's and Ouro's layout) as special added tokens, then the first byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = sorted(ByteLevel.alphabet())[:vocab - len(specials)]
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(specials + symbols)},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok.to_str()


def test_ouro_with_the_upstream_token_ids_still_ends_chat_turns(tmp_path):
    """The published Ouro config.json names <|endoftext|> (0) as bos and eos while its chat
    turns end with <|im_end|> (2) (LoopedLMs/ouro_rl modeling/constants.py: "upstream config
    has all three set to 0"): the converted model keeps the config's eos and ends a
    generation at <|im_end|> too, as llama.cpp does by that token's text."""
    cfg, t = L.ouro_checkpoint(0)
    cfg = {**cfg, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    folder = tmp_path / "ouro"
    L.save(str(folder), cfg, t)
    (folder / "tokenizer.json").write_text(_chatml_tokenizer_json(cfg["vocab_size"]))
    c = convert_hf(str(folder), str(tmp_path / "o.tlm"), bits=8)
    assert (c.bos_token_id, c.eos_token_id) == (0, 0)
    m = tinyloop.load_model(str(tmp_path / "o.tlm"), backend="numpy", max_seq_len=64)
    try:
        assert m.tokenizer.eog_ids == {0, 2}
        assert m.is_end_of_generation(2) and not m.is_end_of_generation(1)
        assert m.tokenizer.encode("<|im_start|>user") == [1] + m.tokenizer.encode("user")
    finally:
        tinyloop.free_model(m)


def test_a_nanbeige_folder_with_a_sentencepiece_tokenizer_generates_text(tmp_path,
                                                                         monkeypatch):
    """Nanbeige's tokenizer is Llama's kind (tokenizer_config: legacy, add_prefix_space), a
    SentencePiece-style tokenizer.json: the folder converts and a text prompt generates, its
    ids the ``tokenizers`` library's and its text the decoder's."""
    from ..convert.test_tokenizer_spm import _llama_style
    hf = _llama_style()
    cfg, t = L.nanbeige_checkpoint(0, vocab=hf.get_vocab_size())
    cfg = {**cfg, "bos_token_id": hf.token_to_id("<s>"), "eos_token_id": hf.token_to_id("</s>")}
    folder = tmp_path / "nb"
    L.save(str(folder), cfg, t)
    (folder / "tokenizer.json").write_text(hf.to_str())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    m = tinyloop.load_model(str(folder), backend="numpy", max_seq_len=64)
    try:
        prompt = "The quick brown fox, été 🙂"
        r = m.generate(prompt, max_new_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
        assert r.prompt_token_ids == hf.encode(prompt, add_special_tokens=False).ids
        assert r.text == hf.decode(r.token_ids, skip_special_tokens=False) and r.text
        assert m.end_of_generation_ids == {hf.token_to_id("</s>"),
                                           hf.token_to_id("<|im_end|>")}
    finally:
        tinyloop.free_model(m)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("files,want", [
    ({"chat_template.jinja": CHATML}, CHATML),
    # chat_template.jinja wins over tokenizer_config.json, as transformers loads them
    ({"chat_template.jinja": CHATML, "tokenizer_config.json": {"chat_template": "x"}}, CHATML),
    ({"tokenizer_config.json": {"chat_template": CHATML}}, CHATML),
    ({"tokenizer_config.json": {"chat_template": [{"name": "tool_use", "template": "t"},
                                                  {"name": "default", "template": CHATML}]}},
     CHATML),
    ({"tokenizer_config.json": {"chat_template": [{"name": "tool_use", "template": "t"}]}}, ""),
    ({}, ""),
])
def test_the_chat_template_is_found_where_transformers_looks(tmp_path, files, want):
    cfg, t = L.ouro_checkpoint(0)
    folder = tmp_path / "o"
    L.save(str(folder), cfg, t)
    (folder / "tokenizer.json").write_text(_chatml_tokenizer_json(cfg["vocab_size"]))
    for name, body in files.items():
        (folder / name).write_text(body if isinstance(body, str) else json.dumps(body))
    convert_hf(str(folder), str(tmp_path / "o.tlm"), bits=8)
    with tinyloop.format.read_tlm(str(tmp_path / "o.tlm")) as f:
        assert f.chat_template == want
    if want:
        m = tinyloop.load_model(str(tmp_path / "o.tlm"), backend="numpy", max_seq_len=16)
        try:
            ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                  tokenize=True)
            want_ids = m.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>"
                                          "assistant\n")
            assert ids == want_ids and want_ids.count(1) == 2 and 2 in want_ids
        finally:
            tinyloop.free_model(m)


def test_a_chat_template_jinja_file_is_checked_and_keys_the_cache(tmp_path):
    from tinyloop.convert.hf import folder_key
    cfg, t = L.ouro_checkpoint(0)
    folder = tmp_path / "o"
    L.save(str(folder), cfg, t)
    (folder / "tokenizer.json").write_text(_chatml_tokenizer_json(cfg["vocab_size"]))
    path = folder / "chat_template.jinja"
    path.write_text(CHATML)
    key = folder_key(str(folder), {})
    path.write_text(CHATML + " ")
    assert folder_key(str(folder), {}) != key       # a new template: a new conversion
    path.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(errors.ConversionError, match="chat_template.jinja is not UTF-8"):
        convert_hf(str(folder), str(tmp_path / "o.tlm"))
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(errors.ConversionError, match="chat_template.jinja is not a regular file"):
        convert_hf(str(folder), str(tmp_path / "o.tlm"))
    with pytest.raises(errors.ConversionError, match="chat_template.jinja"):
        folder_key(str(folder), {})
    assert not os.path.exists(tmp_path / "o.tlm")


@pytest.mark.parametrize("value,want", [(5, {0, 5}), ([2, 5, 5], {0, 2, 5}), ([], {0}),
                                        (None, {0})])
def test_generation_config_eos_ids_end_a_generation(tmp_path, value, want):
    """generation_config.json's eos_token_id (what transformers' generate stops at: an id or
    a list) goes into the metadata and ends a generation beside the config's eos."""
    cfg, t = L.nanbeige_checkpoint(0)
    cfg = {**cfg, "eos_token_id": 0}
    folder = tmp_path / "nb"
    L.save(str(folder), cfg, t)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value,
                                                               "do_sample": True}))
    convert_hf(str(folder), str(tmp_path / "nb.tlm"), bits=8)
    m = tinyloop.load_model(str(tmp_path / "nb.tlm"), backend="numpy", max_seq_len=16)
    try:
        assert m.end_of_generation_ids == want        # the folder has no tokenizer.json
        assert all(m.is_end_of_generation(i) for i in want) and not m.is_end_of_generation(1)
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("text,match", [
    ('{"eos_token_id": "2"}', "eos_token_id='2' must be a token id"),
    ('{"eos_token_id": [2, -1]}', "must be a token id or a list"),
    ('{"eos_token_id": [96]}', "of the 96-token vocabulary"),
    ('{"eos_token_id": true}', "must be a token id"),
    ('{"eos_token_id": [' + ", ".join(["1"] * 65) + "]}", "at most 64 token ids"),
    ("[2]", "must be a JSON object"),
    ('{"eos_token_id": 2', "is not UTF-8 JSON"),
])
def test_hostile_generation_configs(tmp_path, text, match):
    cfg, t = L.nanbeige_checkpoint(0)
    folder = tmp_path / "nb"
    L.save(str(folder), cfg, t)
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(errors.ConversionError, match=f"generation_config.json.*{match}"):
        convert_hf(str(folder), str(tmp_path / "nb.tlm"))
    assert not os.path.exists(tmp_path / "nb.tlm")


@pytest.mark.parametrize("value", ["2", [2, "3"], [True], [-1], [96], {"a": 1}])
def test_a_tlm_whose_metadata_eos_ids_are_not_token_ids_is_refused(tmp_path, looped_folders,
                                                                   value):
    from tinyloop.format import read_tlm, write_tlm
    _, _, _, tlm = looped_folders["nanbeige"]
    with read_tlm(tlm) as f:
        cfg, meta = f.config, dict(f.metadata)
        weights = {n: f.weight(n) for n in tinyloop.format.expected_tensors(cfg)}
    bad = str(tmp_path / "bad.tlm")
    write_tlm(bad, cfg, weights, metadata={**meta, "eos_token_ids": value})
    with pytest.raises(errors.FormatError, match="metadata eos_token_ids=.* must be a list"):
        tinyloop.load_model(bad, backend="numpy", max_seq_len=16)

def test_cuda_runs_every_fact_sliding_windows_included(looped_folders):
    """The CUDA kernels run every VERSION 2 fact: Huginn (sandwich norms, seeded state, Q/K/V
    bias, embedding scale), Nanbeige and Ouro with its sliding-window layer (the window is a
    kernel argument of every attention kernel) load; an unknown backend is refused every
    fact, the sliding window included."""
    from tinyloop.model import backend_missing_features
    cfgs = {}
    for arch in ("huginn", "nanbeige", "ouro"):
        with tinyloop.format.read_tlm(looped_folders[arch][3]) as f:
            cfgs[arch] = f.config
    assert cfgs["huginn"].arch_facts and cfgs["nanbeige"].arch_facts
    assert "sliding_window" in cfgs["ouro"].arch_facts and cfgs["ouro"].sliding_layers
    for arch in ("huginn", "nanbeige", "ouro"):
        assert backend_missing_features(cfgs[arch], "cuda") == [], arch
    other = backend_missing_features(cfgs["huginn"], "some-future-backend")
    assert any("Q/K/V bias" in m for m in other)
    assert any("seeded initial state" in m for m in other)
    assert backend_missing_features(cfgs["ouro"], "some-future-backend")[-1] == \
        "sliding-window attention (sliding_window)"
    for cfg in cfgs.values():
        assert backend_missing_features(cfg, "numpy") == []
    from tinyloop.convert.synthetic import synthetic_config
    plain = synthetic_config(dict(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2,
                                  head_dim=16, ffn_dim=96, n_prelude=1, n_recurrent=2,
                                  n_coda=1, max_depth=3))
    assert backend_missing_features(plain, "cuda") == []


def test_inspect_an_ouro_1_4b_shaped_folder(tmp_path, capsys):
    """config.json alone (the published Ouro-1.4B dims): 24 layers x 4 loops = 96 slots at
    depth 4; fp16 K/V (CUDA's kv dtype) take 2 (K, V) x 16 heads x 128 x 2 bytes per slot."""
    from tinyloop import cli
    conf = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "tie_word_embeddings": False, "total_ut_steps": 4, "vocab_size": 49152,
            "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 28}
    os.makedirs(tmp_path / "ouro14")
    with open(tmp_path / "ouro14" / "config.json", "w") as f:
        json.dump(conf, f)
    assert cli.main(["inspect", str(tmp_path / "ouro14"), "--backend", "cuda",
                     "--max-seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "at max depth 4: 96" in out
    per_slot = 2 * 16 * 128 * 2
    rows = {int(line.split()[0]): line.split() for line in out.split("by depth")[1]
            .splitlines()[2:] if line.strip()}
    assert sorted(rows) == [1, 2, 3, 4]
    for d, cols in rows.items():
        assert int(cols[1]) == 24 * d
        assert int(cols[2].replace(",", "")) == 24 * d * per_slot


def test_readme_looped_section_commands_parse_and_run(tmp_path, looped_folders, monkeypatch, capsys):
    """The README's looped-checkpoint commands parse with the real parser; with a tiny Ouro
    folder in place of the download, its inspect and convert lines run as written."""
    import re
    import shlex
    from tinyloop import cli
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    sec = text[text.index("## Running a looped checkpoint"):]
    block = re.findall(r"```bash\n(.*?)```", sec, flags=re.S)[0]
    cmds = [shlex.split(ln, comments=True) for ln in block.splitlines() if ln.strip()]
    tl = [c for c in cmds if c[0] == "tinyloop"]
    # the non-tinyloop lines fetch a folder or make a GGUF with llama.cpp's own converter
    assert all(c[:2] == ["huggingface-cli", "download"]
               or c[0] == "python" and c[1].endswith("convert_hf_to_gguf.py")
               for c in cmds if c[0] != "tinyloop")
    assert len(tl) == 8
    for argv in tl:
        cli.build_parser().parse_args(argv[1:])
    # a tiny Ouro folder where the download would be: the inspect and convert lines run
    monkeypatch.chdir(tmp_path)
    _, cfg, t, _ = looped_folders["ouro"]
    L.save(str(tmp_path / "Ouro-1.4B"), cfg, t)
    ran = 0
    for argv in tl:
        if argv[1] in ("inspect", "convert") and "Ouro-1.4B" in argv:
            assert cli.main(argv[1:]) == 0, argv
            ran += 1
    assert ran == 2
    out = capsys.readouterr().out
    assert "by depth" in out and "wrote ouro-1.4b.tlm" in out


@pytest.mark.parametrize("arch", sorted(L.ARCHS))
def test_a_captured_decode_step_runs_every_fact_like_the_eager_forward(looped_folders, monkeypatch,
                                                                       arch):
    """The decode step as graphs.DecodeGraphs captures it (tests/test_graphs.py's recording
    fake: no host read while recording) at the deepest loop: every greedy token is the argmax
    of the teacher-forced eager logits, so the seeded state (Huginn) is drawn at the device
    step's position and the sliding layers (Ouro) keep their window inside the step."""
    from .test_graphs import RecordingOps
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "1")
    m = tinyloop.load_model(looped_folders[arch][3], backend="numpy", max_seq_len=64)
    RecordingOps().attach(m)
    try:
        depth = m.config.max_depth
        prompt = _ids(12, m.config.vocab_size, seed=3).tolist()
        res = m.generate(prompt, max_new_tokens=8, depth=depth)
        assert m.graph_stats()["replays"] >= 1
        toks = prompt + res.token_ids
        want = m.logits(toks[:-1], depth=depth)[len(prompt) - 1:].argmax(axis=1)
        assert res.token_ids == want[:len(res.token_ids)].tolist()
    finally:
        tinyloop.free_model(m)


def test_cuda_names_a_head_dim_it_has_no_kernel_for(tmp_path):
    """The published shapes (head dims 128, 96, 128; Huginn's d 5280) pass the CUDA backend's
    load check; a head dim without an attention kernel is named (the Model refuses it at
    load: tests/gpu/test_looped_cuda.py)."""
    from benchmarks import bench_looped as bench
    from tinyloop.backends.cuda import CudaOps
    from tinyloop.backends.numpy_ops import NumpyOps
    from tinyloop.convert.hf import folder_config
    for name, (conf, _) in bench.ARCHS.items():
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump(conf, f)
        _, cfg = folder_config(str(tmp_path / name))
        assert CudaOps.config_problems(cfg) == [], name
    from tinyloop.convert.synthetic import synthetic_config
    odd = synthetic_config(dict(vocab_size=64, d_model=112, n_heads=1, n_kv_heads=1,
                                head_dim=112, ffn_dim=64, n_prelude=1, n_recurrent=1,
                                n_coda=1, max_depth=2))
    from tinyloop.backends.cuda.compile import ATTN_HEAD_DIMS
    assert 112 not in ATTN_HEAD_DIMS
    (problem,) = CudaOps.config_problems(odd)
    assert problem.startswith("head_dim=112 has no CUDA attention kernel")
    assert NumpyOps.config_problems(odd) == []
