"""Hostile and broken GGUF files: every one raises ConversionError naming the
field, before any large allocation, and ``tinyloop convert`` prints one line and exits 1.

The files are generated: a valid tiny llama GGUF from the ``gguf`` package's writer
(tests/convert/test_convert_gguf.py::write_tiny_gguf), then corrupted at fields located with the
package's own reader, or written with a bad value through the writer. The table's names are the
inputs that broke the converter."""

from __future__ import annotations

import os
import struct
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tinyloop.cli import main
from tinyloop.convert.gguf import convert_gguf
from tinyloop.convert.gguf_check import check_gguf
from tinyloop.errors import ConversionError, TinyLoopError

from .test_convert_gguf import write_tiny_gguf

VT = gguf.GGUFValueType
SMALL = dict(n_layers=1, d=32, n_heads=2, n_kv_heads=1, ffn=64)
MAX_PEAK_BYTES = 16 << 20        # a hostile file may not make us allocate more than this


class Located:
    """A valid tiny GGUF's bytes and the byte offsets of its fields (found by GGUFReader)."""

    def __init__(self, path):
        self.data = path.read_bytes()
        r = gguf.GGUFReader(str(path))
        base = r.data.ctypes.data
        self.off = lambda arr: arr.ctypes.data - base
        self.fields = r.fields
        self.tensors = {t.name: t for t in r.tensors}
        self.data_start = r.data_offset
        self.data_end = max(t.data_offset + t.n_bytes for t in r.tensors)

    def kv(self, key: str, part: int) -> int:
        """Offset of part ``part`` of KV ``key`` (0 key length, 1 key, 2 value type, 3.. the
        value: for an array 3 element type, 4 count, 5, 6 the first string's length, bytes)."""
        return self.off(self.fields[key].parts[part])

    def tensor(self, name: str, part: int) -> int:
        """Offset of tensor info part: 0 name length, 1 name, 2 n_dims, 3 dims, 4 type,
        5 offset."""
        return self.off(self.tensors[name].field.parts[part])

    def patched(self, *edits) -> bytes:
        """The file with ``(offset, struct format, value)`` edits applied."""
        b = bytearray(self.data)
        for off, fmt, value in edits:
            struct.pack_into(fmt, b, off, value)
        return bytes(b)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "base.gguf"
    write_tiny_gguf(path, **SMALL)
    return Located(path)


# (name, how to make the file from the Located base, what the error must name)
PATCHED = [
    ("4-byte GGUF", lambda b: b"GGUF", r"version: needs 4 bytes at offset 4"),
    ("empty file", lambda b: b"", r"0 bytes, shorter than the 4-byte magic"),
    ("3 bytes", lambda b: b"GGU", r"3 bytes, shorter than the 4-byte magic"),
    ("magic GGML", lambda b: b"GGML" + b.data[4:], r"magic: b'GGML'"),
    ("version 1", lambda b: b.patched((4, "<I", 1)), r"version: 1 is not supported"),
    ("version 4", lambda b: b.patched((4, "<I", 4)), r"version: 4 is not supported"),
    ("big-endian version", lambda b: b.patched((4, ">I", 3)), r"version: .*big-endian"),
    ("tensor_count 2^62", lambda b: b.patched((8, "<Q", 1 << 62)),
     r"tensor_count: count 4611686018427387904 needs at least"),
    ("kv_count 2^64-1", lambda b: b.patched((16, "<Q", (1 << 64) - 1)),
     r"kv_count: count 18446744073709551615"),
    ("kv_count one too many", lambda b: b.patched((16, "<Q", len(b.fields) - 3 + 1)),
     r"invalid GGUF file: name of tensor #0: length \d+ exceeds 63 bytes"),
    ("tensor_count one too many", lambda b: b.patched((8, "<Q", len(b.tensors) + 1)),
     r"invalid GGUF file: tensor .* overlaps tensor ''"),
    ("key length 2^64-1", lambda b: b.patched((b.kv("general.architecture", 0), "<Q",
                                                (1 << 64) - 1)),
     r"key of KV #0: needs 18446744073709551615 bytes"),
    ("string value length past the end",
     lambda b: b.patched((b.kv("general.architecture", 3), "<Q", len(b.data))),
     r"value of KV #0 'general.architecture': needs \d+ bytes"),
    ("tokens array count 2^60", lambda b: b.patched((b.kv("tokenizer.ggml.tokens", 4), "<Q",
                                                     1 << 60)),
     r"'tokenizer.ggml.tokens': count 1152921504606846976 needs at least 9223372036854775808"),
    ("token string length 2^63", lambda b: b.patched((b.kv("tokenizer.ggml.tokens", 5), "<Q",
                                                      1 << 63)),
     r"'tokenizer.ggml.tokens'\[0\]: needs 9223372036854775808 bytes"),
    ("token_type array count 2^61", lambda b: b.patched((b.kv("tokenizer.ggml.token_type", 4),
                                                         "<Q", 1 << 61)),
     r"'tokenizer.ggml.token_type': count 2305843009213693952"),
    ("value type 99", lambda b: b.patched((b.kv("llama.block_count", 2), "<I", 99)),
     r"'llama.block_count': unknown value type 99"),
    ("array of arrays", lambda b: b.patched((b.kv("tokenizer.ggml.merges", 3), "<I", 9)),
     r"'tokenizer.ggml.merges': arrays of arrays are not supported"),
    ("array element type 77", lambda b: b.patched((b.kv("tokenizer.ggml.merges", 3), "<I", 77)),
     r"'tokenizer.ggml.merges': unknown array element type 77"),
    ("key not UTF-8", lambda b: b.patched((b.kv("general.architecture", 1), "<B", 0xFF)),
     r"key of KV #0: is not UTF-8"),
    ("token not UTF-8", lambda b: b.patched((b.kv("tokenizer.ggml.tokens", 6), "<B", 0xC0)),
     r"'tokenizer.ggml.tokens'\[0\]: is not UTF-8"),
    ("duplicate tensor name", lambda b: b.patched(*[
        (b.tensor("blk.0.attn_k.weight", 1) + i, "<B", c)
        for i, c in enumerate(b"blk.0.attn_q.weight")]),
     r"tensor #\d+ 'blk.0.attn_q.weight': duplicate tensor name"),
    ("tensor name of 2^40 bytes", lambda b: b.patched((b.tensor("output_norm.weight", 0), "<Q",
                                                       1 << 40)),
     r"name of tensor #\d+: length 1099511627776 exceeds 63 bytes"),
    ("5-dim tensor info", lambda b: b.patched((b.tensor("blk.0.attn_q.weight", 2), "<I", 5)),
     r"'blk.0.attn_q.weight': has 5 dimensions; GGML allows at most 4"),
    ("n_dims 2^32-1", lambda b: b.patched((b.tensor("blk.0.attn_q.weight", 2), "<I",
                                           (1 << 32) - 1)),
     r"has 4294967295 dimensions"),
    ("element count overflows int64", lambda b: b.patched(
        (b.tensor("blk.0.attn_q.weight", 3), "<Q", 1 << 40),
        (b.tensor("blk.0.attn_q.weight", 3) + 8, "<Q", 1 << 40)),
     r"'blk.0.attn_q.weight': element count of shape \[1099511627776, 1099511627776\] "
     r"overflows int64"),
    ("ne0 not a multiple of the Q4_1 block", lambda b: b.patched(
        (b.tensor("blk.0.attn_q.weight", 3), "<Q", 33)),
     r"'blk.0.attn_q.weight': ne\[0\]=33 is not a multiple of the Q4_1 block of 32"),
    ("ggml type 200", lambda b: b.patched((b.tensor("blk.0.ffn_up.weight", 4), "<I", 200)),
     r"'blk.0.ffn_up.weight': unknown ggml type 200"),
    ("tensor offset not aligned", lambda b: b.patched(
        (b.tensor("output_norm.weight", 5), "<Q",
         b.tensors["output_norm.weight"].data_offset - b.data_start + 4)),
     r"'output_norm.weight': offset \d+ is not a multiple of the alignment 32"),
    ("tensor offset wraps past 2^64", lambda b: b.patched(
        (b.tensor("output_norm.weight", 5), "<Q", (1 << 64) - b.data_start)),
     r"'output_norm.weight': data \[\d+, \d+\) from the data start at \d+ runs past the end"),
    ("tensor offset past the end", lambda b: b.patched(
        (b.tensor("token_embd.weight", 5), "<Q", len(b.data) // 32 * 32)),
     r"'token_embd.weight': data .* runs past the end of the \d+-byte file"),
    ("tensor dims far beyond the file", lambda b: b.patched(
        (b.tensor("token_embd.weight", 3) + 8, "<Q", 1 << 40)),
     r"'token_embd.weight': data \[\d+, \d+\) .* runs past the end"),
    ("overlapping tensors", lambda b: b.patched(
        (b.tensor("blk.0.ffn_norm.weight", 5), "<Q",
         b.tensors["blk.0.attn_norm.weight"].data_offset - b.data_start)),
     r"overlaps tensor"),
]


def _write(tmp_path, name: str, data: bytes):
    p = tmp_path / (name.replace(" ", "_").replace("/", "_") + ".gguf")
    p.write_bytes(data)
    return p


def _assert_refused(path, tmp_path, match: str) -> None:
    """ConversionError matching ``match`` with small peak memory, no output file, and the CLI
    prints one line and exits 1."""
    dst = tmp_path / "out.tlm"
    tracemalloc.start()
    try:
        with pytest.raises(ConversionError, match=match) as ei:
            convert_gguf(path, dst, recurrent=(0, 1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(ei.value, TinyLoopError) and str(path) in str(ei.value)
    assert peak < MAX_PEAK_BYTES, f"{peak} bytes allocated for a hostile file"
    assert not dst.exists()
    assert_cli_one_line(path, dst)


def assert_cli_one_line(path, dst) -> None:
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["convert", str(path), str(dst), "--recurrent", "0:1"])
    text = err.getvalue()
    assert rc == 1
    assert text.startswith("tinyloop convert: error: ") and text.count("\n") == 1, text


@pytest.mark.parametrize("name, make, match", PATCHED, ids=[c[0] for c in PATCHED])
def test_patched_gguf_is_refused(base, tmp_path, name, make, match):
    _assert_refused(_write(tmp_path, name, make(base)), tmp_path, match)


def test_the_base_file_converts(base, tmp_path):
    p = _write(tmp_path, "base", base.data)
    layout = check_gguf(p)
    assert layout.data_start == base.data_start and len(layout.tensors) == len(base.tensors)
    for t in layout.tensors:                      # the same layout as the gguf package's
        ref = base.tensors[t.name]
        assert (t.offset + layout.data_start, t.nbytes) == (ref.data_offset, ref.n_bytes)
    convert_gguf(p, tmp_path / "ok.tlm", recurrent=(0, 1))


def test_every_truncation_of_the_header_is_refused(base, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(base.data[:base.data_start])
    for n in reversed(range(base.data_start)):      # cut one more byte each time
        os.truncate(p, n)
        with pytest.raises(ConversionError, match="invalid GGUF file"):
            convert_gguf(p, tmp_path / "x.tlm", recurrent=(0, 1))
    assert not (tmp_path / "x.tlm").exists()


def test_truncations_of_the_tensor_data_are_refused(base, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(base.data[:base.data_end])      # only the padding after the last tensor gone
    convert_gguf(p, tmp_path / "x.tlm", recurrent=(0, 1))
    ends = {t.data_offset + t.n_bytes for t in base.tensors.values()}
    cuts = set(range(base.data_start, base.data_end, 7)) | {e - 1 for e in ends}
    for n in sorted(cuts, reverse=True):          # every 7th byte and each tensor's last one
        os.truncate(p, n)
        with pytest.raises(ConversionError, match="runs past the end"):
            convert_gguf(p, tmp_path / "y.tlm", recurrent=(0, 1))


# --- files written with a bad value through the gguf writer ----------------------------------
def _set(key, value, vtype, sub_type=None):
    return lambda w: w.add_key_value(key, value, vtype, sub_type)


def _merges_with(extra: str):
    def edit(w):
        merges = list(w.kv_data[0]["tokenizer.ggml.merges"].value) + [extra]
        w.add_key_value("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING)
    return edit


WRITTEN = [
    ("5-dim tensor", lambda w: w.add_tensor("blk.0.extra.weight",
                                            np.zeros((2, 2, 2, 2, 32), np.float32)),
     r"'blk.0.extra.weight': has 5 dimensions"),
    ("merge producing a token missing from the vocab", _merges_with("h w"),
     r"tokenizer.ggml.merges\[9\] = 'h w': 'hw' is not in tokenizer.ggml.tokens"),
    ("merge of a token missing from the vocab", _merges_with("hello zzz"),
     r"tokenizer.ggml.merges\[9\] = 'hello zzz': 'zzz' is not in"),
    ("merge without a space", _merges_with("hello"),
     r"tokenizer.ggml.merges\[9\] = 'hello' is not two tokens"),
    ("tokens as an int array", _set("tokenizer.ggml.tokens", list(range(268)), VT.ARRAY,
                                    VT.INT32),
     r"tokenizer.ggml.tokens must be an array of strings"),
    ("token types as strings", _set("tokenizer.ggml.token_type", ["1"] * 268, VT.ARRAY,
                                    VT.STRING),
     r"tokenizer.ggml.token_type must be an array of integers"),
    ("tokenizer.ggml.pre as an array", _set("tokenizer.ggml.pre", ["smollm"], VT.ARRAY,
                                            VT.STRING),
     r"tokenizer.ggml.pre=\['smollm'\] is not supported"),
    ("block_count as a string", _set("llama.block_count", "one", VT.STRING),
     r"'llama.block_count' must be an integer, got a STRING"),
    ("block_count 2^40", _set("llama.block_count", 1 << 40, VT.UINT64),
     r"'llama.block_count' = 1099511627776 is outside 0..2147483647"),
    ("head_count 0", _set("llama.attention.head_count", 0, VT.UINT32),
     r"'llama.attention.head_count' is 0"),
    ("embedding_length negative", _set("llama.embedding_length", -32, VT.INT32),
     r"'llama.embedding_length' = -32 is outside"),
    ("rms epsilon NaN", _set("llama.attention.layer_norm_rms_epsilon", float("nan"),
                             VT.FLOAT32),
     r"'llama.attention.layer_norm_rms_epsilon' = nan is not finite"),
    ("rope base as a string", _set("llama.rope.freq_base", "1e4", VT.STRING),
     r"'llama.rope.freq_base' must be a number, got a STRING"),
    ("architecture as an int", _set("general.architecture", 7, VT.UINT32),
     r"'general.architecture' must be a string, got a UINT32"),
    ("eos id past the vocab", _set("tokenizer.ggml.eos_token_id", 268, VT.UINT32),
     r"'tokenizer.ggml.eos_token_id' = 268 is not a token id of the 268-token vocab"),
    ("chat template as an array", _set("tokenizer.chat_template", ["x"], VT.ARRAY, VT.STRING),
     r"'tokenizer.chat_template' must be a string, got a ARRAY"),
    ("alignment 48", lambda w: w.add_key_value("general.alignment", 48, VT.UINT32),
     r"'general.alignment': 48 is not a power of two"),
    ("alignment as UINT64", lambda w: w.add_key_value("general.alignment", 32, VT.UINT64),
     r"'general.alignment': must be UINT32, got UINT64"),
    ("NaN norm weight", lambda w: w.add_tensor("output_norm.weight",
                                               np.full(32, np.nan, np.float32)),
     r"'output_norm.weight': weight\[0\] is nan"),
    ("inf in an F32 matrix", lambda w: w.add_tensor(
        "blk.0.attn_output.weight", np.where(np.eye(32) > 0, np.inf, 0).astype(np.float32)),
     r"'blk.0.attn_output.weight': weight\[0, 0\] is inf"),
    ("NaN Q8_0 scale", lambda w: w.add_tensor(
        "blk.0.ffn_down.weight", _q8_0_with_nan_scale(32, 64), raw_dtype=gguf.GGMLQuantizationType.Q8_0),
     r"'blk.0.ffn_down.weight': scales\[3, 1\] is nan"),
]


def _q8_0_with_nan_scale(rows: int, cols: int) -> np.ndarray:
    q = gguf.quants.quantize(np.ones((rows, cols), np.float32), gguf.GGMLQuantizationType.Q8_0)
    blocks = q.reshape(rows, cols // 32, 34)
    blocks[3, 1, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    return q


@pytest.mark.parametrize("name, edit, match", WRITTEN, ids=[c[0] for c in WRITTEN])
def test_written_gguf_with_bad_value_is_refused(tmp_path, name, edit, match):
    p = tmp_path / "bad.gguf"
    write_tiny_gguf(p, **SMALL, edit=_dropping_replaced(edit))
    _assert_refused(p, tmp_path, match)


def _dropping_replaced(edit):
    """Run ``edit`` on a writer whose add_tensor replaces a tensor of the same name."""
    def run(w):
        real = w.add_tensor

        def add_tensor(name, *args, **kw):
            for tensors in w.tensors:
                tensors.pop(name, None)
            return real(name, *args, **kw)
        w.add_tensor = add_tensor
        edit(w)
    return run
