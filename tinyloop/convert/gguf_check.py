"""Structural check of a GGUF file before anything else reads it: files from outside are hostile.

``check_gguf(path)`` walks the header as the GGUF specification lays it out (ggml's
``docs/gguf.md``; all integers little-endian):

    magic "GGUF" | version u32 (2 or 3) | tensor_count u64 | kv_count u64
    kv_count x (key: string | value_type u32 | value)
    tensor_count x (name: string | n_dims u32 | n_dims x ne u64 | type u32 | offset u64)
    padding to ``general.alignment`` (default 32) | tensor data

    string = length u64 | UTF-8 bytes;  array value = element type u32 | count u64 | elements

and checks, before it allocates anything that grows with a number read from the file:

- every length, count and offset against the bytes that remain, in Python integers (no
  wrap-around: a tensor offset near 2**64 is out of bounds, not a small number);
- a count is compared with what its elements need at least (8 bytes a string, the item size a
  scalar) before any loop over it, so a count of 2**62 fails at once;
- keys and strings are UTF-8; keys and tensor names are unique; value types are known; no
  arrays of arrays; ``general.alignment`` is a non-zero power of two (as llama.cpp's gguf.cpp);
- tensors: a name shorter than 64 bytes (GGML_MAX_NAME), at most 4 dims (GGML_MAX_DIMS), a
  known ggml type whose block divides ne0, an element count and byte size that fit in int64,
  an offset that is a multiple of the alignment, data inside the file and not overlapping
  another tensor's.

Each failure raises ConversionError naming the field (its index, key or tensor name) and the
byte offset. Only then does the ``gguf`` package's ``GGUFReader`` parse the file (it trusts
the file: unchecked, it raises IndexError on a truncated header and computes tensor offsets in
wrapping uint64 arithmetic).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from ..errors import ConversionError
from ..fileio import open_regular

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4              # GGML_MAX_DIMS
MAX_NAME_BYTES = 63       # GGML_MAX_NAME = 64, with the terminating NUL
INT64_MAX = (1 << 63) - 1

# GGUF value types (gguf.GGUFValueType): scalar sizes; 8 = STRING, 9 = ARRAY
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32",
               6: "FLOAT32", 7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64",
               12: "FLOAT64"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor info entry: ``dims`` in GGML order (ne0 first), ``ggml_type`` (int),
    ``offset`` (bytes from the data start), ``nbytes``."""

    name: str
    dims: tuple
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """What ``check_gguf`` found: ``version``, ``alignment``, ``data_start`` (bytes),
    ``file_size`` (bytes), ``keys`` (key -> value type name) and ``tensors`` (file order)."""

    version: int
    alignment: int
    data_start: int
    file_size: int
    keys: dict
    tensors: list


class _Cursor:
    """Reads little-endian fields from a buffer, refusing to step past its end."""

    def __init__(self, buf, size: int, src: str):
        self.buf, self.size, self.src, self.pos = buf, size, src, 0

    def fail(self, what: str, detail: str):
        raise ConversionError(f"{self.src}: invalid GGUF file: {what}: {detail}")

    def take(self, n: int, what: str) -> int:
        """Advance over ``n`` bytes; return where they start."""
        if n > self.size - self.pos:
            self.fail(what, f"needs {n} bytes at offset {self.pos} but the file ends after "
                            f"{self.size - self.pos} (truncated or corrupt)")
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str, max_bytes: int | None = None) -> str:
        n = self.u64(f"{what} (length)")
        if max_bytes is not None and n > max_bytes:
            self.fail(what, f"length {n} exceeds {max_bytes} bytes")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            bad = e
        self.fail(what, f"is not UTF-8 ({bad.reason} at byte {start + bad.start})")

    def strings(self, n: int, what: str) -> None:
        """Skip ``n`` strings (an array's elements), checking each as ``string`` does; the
        loop is inlined because a vocabulary holds ~10^5 of them."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.take(8, f"{what}[{i}] (length)")
            ln = unpack(buf, pos)[0]
            pos += 8
            if ln > size - pos:
                self.pos = pos
                self.take(ln, f"{what}[{i}]")
            try:
                buf[pos:pos + ln].decode("utf-8")
            except UnicodeDecodeError:
                self.pos = pos - 8
                self.string(f"{what}[{i}]")        # raises, naming the element
            pos += ln
        self.pos = pos

    def count(self, n: int, min_item: int, what: str) -> None:
        """Refuse ``n`` items of at least ``min_item`` bytes each that cannot fit."""
        if n * min_item > self.size - self.pos:
            self.fail(what, f"count {n} needs at least {n * min_item} bytes at offset "
                            f"{self.pos} but only {self.size - self.pos} remain")

    def value(self, vtype: int, what: str, in_array: bool = False):
        """Skip (or, for UINT32, return) one value of type ``vtype``."""
        if vtype in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[vtype], what)
            return struct.unpack_from("<I", self.buf, start)[0] if vtype == _UINT32 else None
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype == _ARRAY and not in_array:
            etype = self.u32(f"{what} (array element type)")
            n = self.u64(f"{what} (array length)")
            if etype in _SCALAR_SIZES:
                self.count(n, _SCALAR_SIZES[etype], what)
                self.take(n * _SCALAR_SIZES[etype], what)
            elif etype == _STRING:
                self.count(n, 8, what)
                self.strings(n, what)
            elif etype == _ARRAY:
                self.fail(what, "arrays of arrays are not supported")
            else:
                self.fail(what, f"unknown array element type {etype}")
            return None
        self.fail(what, f"unknown value type {vtype}")


def check_gguf(path) -> GGUFLayout:
    """Check the structure of the GGUF file ``path`` (see the module docstring); return its
    layout. Raises ConversionError naming the bad field; reads only what the header
    declares, through a read-only memory map."""
    src = os.fspath(path)
    try:
        with open_regular(src) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise ConversionError(f"{src}: invalid GGUF file: {size} bytes, shorter than "
                                      "the 4-byte magic")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(buf, size, src)
    except OSError as e:
        raise ConversionError(f"{src}: cannot read the file: {e}") from None


def _walk(buf, size: int, src: str) -> GGUFLayout:
    c = _Cursor(buf, size, src)
    magic = bytes(buf[0:4])
    c.take(4, "magic")
    if magic != GGUF_MAGIC:
        c.fail("magic", f"{magic!r}, expected {GGUF_MAGIC!r} (not a GGUF file)")
    version = c.u32("version")
    if version & 0xFFFF == 0 and version:
        c.fail("version", "the file is big-endian; only little-endian GGUF is supported")
    if version not in SUPPORTED_VERSIONS:
        c.fail("version", f"{version} is not supported (GGUF {SUPPORTED_VERSIONS})")
    n_tensors = c.u64("tensor_count")
    n_kv = c.u64("kv_count")
    c.count(n_kv, 8 + 4 + 1, "kv_count")          # key length, value type, a 1-byte value
    c.count(n_tensors, 8 + 4 + 4 + 8, "tensor_count")   # name length, n_dims, type, offset

    keys: dict[str, str] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.string(f"key of KV #{i}")
        if key in keys:
            c.fail(f"KV #{i} {key!r}", "duplicate key")
        vtype = c.u32(f"value type of KV #{i} {key!r}")
        v = c.value(vtype, f"value of KV #{i} {key!r}")
        keys[key] = _TYPE_NAMES[vtype]
        if key == "general.alignment":
            if vtype != _UINT32:
                c.fail(f"KV #{i} 'general.alignment'",
                       f"must be UINT32, got {_TYPE_NAMES[vtype]}")
            if v == 0 or v & (v - 1):
                c.fail(f"KV #{i} 'general.alignment'", f"{v} is not a power of two")
            alignment = v

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    sizes = {int(t): bs for t, bs in GGML_QUANT_SIZES.items()}
    raw = []
    names = set()
    for i in range(n_tensors):
        name = c.string(f"name of tensor #{i}", max_bytes=MAX_NAME_BYTES)
        what = f"tensor #{i} {name!r}"
        if name in names:
            c.fail(what, "duplicate tensor name")
        names.add(name)
        n_dims = c.u32(f"{what} n_dims")
        if n_dims > MAX_DIMS:
            c.fail(what, f"has {n_dims} dimensions; GGML allows at most {MAX_DIMS}")
        dims = tuple(c.u64(f"{what} ne[{j}]") for j in range(n_dims))
        ggml_type = c.u32(f"{what} type")
        offset = c.u64(f"{what} offset")
        raw.append((name, dims, ggml_type, offset, what))
    data_start = -(-c.pos // alignment) * alignment
    if data_start > size:
        c.fail("tensor data", f"starts at offset {data_start}, past the end of the "
                              f"{size}-byte file")

    tensors = []
    for name, dims, ggml_type, offset, what in raw:
        if ggml_type not in sizes:
            c.fail(what, f"unknown ggml type {ggml_type}")
        block, type_size = sizes[ggml_type]
        n = 1
        for j, d in enumerate(dims):
            if d > INT64_MAX or (d and n > INT64_MAX // d):
                c.fail(what, f"element count of shape {list(dims)} overflows int64")
            n *= d
        if dims and dims[0] % block:
            c.fail(what, f"ne[0]={dims[0]} is not a multiple of the "
                         f"{GGMLQuantizationType(ggml_type).name} block of {block}")
        nbytes = n // block * type_size
        if offset % alignment:
            c.fail(what, f"offset {offset} is not a multiple of the alignment {alignment}")
        if offset > size - data_start or nbytes > size - data_start - offset:
            c.fail(what, f"data [{offset}, {offset + nbytes}) from the data start at "
                         f"{data_start} runs past the end of the {size}-byte file")
        tensors.append(TensorInfo(name, dims, ggml_type, offset, nbytes))
    by_offset = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(by_offset, by_offset[1:]):
        if a.nbytes and b.offset < a.offset + a.nbytes:
            c.fail(f"tensor {b.name!r}", f"data [{b.offset}, {b.offset + b.nbytes}) overlaps "
                                         f"tensor {a.name!r} [{a.offset}, "
                                         f"{a.offset + a.nbytes})")
    return GGUFLayout(version, alignment, data_start, size, keys, tensors)
