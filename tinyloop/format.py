"""The .tlm file format: reader, writer and validator. Specification: docs/format.md.

Layout (all integers little-endian):

    offset 0   MAGIC        8 bytes  b"TINYLOOP"
    offset 8   VERSION      u32      1, or 2 when the config holds VERSION 2 facts
    offset 12  reserved     u32      (0)
    offset 16  HEADER_LEN   u64      bytes of the UTF-8 JSON header that follows
    offset 24  header       JSON     {"config": {...}, "tensors": [...], "chat_template": str,
                                      "metadata": {...}}
    DATA_START = align64(24 + HEADER_LEN)
    data       each tensor at DATA_START + entry["offset"], offset a multiple of 64

Each tensor entry: {"name": str, "dtype": "f32"|"f16"|"i8"|"u8"|"i32"|"q4", "shape": [..],
"offset": int, "nbytes": int}. "q4" is packed INT4 (two codes per byte, low nibble first);
its shape counts bytes ([out, in // 2]) like "u8" but marks the content.

Every size read from a file is checked against the file's length before it is used.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from .config import V2_DEFAULTS, ModelConfig
from .errors import (BadMagicError, ConfigError, FormatError, InconsistentDimsError,
                     NonFiniteWeightError, SizeOverflowError, TensorBoundsError,
                     TensorOverlapError, TensorShapeError, TruncatedFileError,
                     UnsupportedVersionError)
from .fileio import NotRegularFileError, atomic_write, open_regular
from .quant import QuantWeight, check_quant_parts, non_finite_message

MAGIC = b"TINYLOOP"
VERSION = 2                # the newest version this writer writes
VERSION_MAX = 2
ALIGN = 64
PREFIX = struct.Struct("<8sIIQ")          # magic, version, reserved, header_len
MAX_HEADER_BYTES = 256 << 20              # a header larger than this is refused
MAX_TENSORS = 1 << 16

DTYPES = {"f32": np.float32, "f16": np.float16, "i8": np.int8, "u8": np.uint8,
          "i32": np.int32, "q4": np.uint8}


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple
    offset: int          # relative to the data section start
    nbytes: int


# --------------------------------------------------------------------------------------------
# The tensors a config requires
# --------------------------------------------------------------------------------------------
def expected_tensors(cfg: ModelConfig) -> dict[str, tuple]:
    """Name -> ("float", shape) or ("quant", (out, in)) for every tensor ``cfg`` requires."""
    d = cfg.d_model
    out: dict[str, tuple] = {"token_embd": ("quant", (cfg.vocab_size, d)),
                             "output_norm": ("float", (d,))}
    if not cfg.tied_head:
        out["output"] = ("quant", (cfg.vocab_size, d))
    if cfg.injection == "adapter":
        out["inject.adapter"] = ("quant", (d, 2 * d))
    if cfg.exit_gate:
        out["exit_gate.weight"] = ("float", (d,))
        out["exit_gate.bias"] = ("float", (1,))
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out[p + "attn_norm"] = ("float", (d,))
        out[p + "attn_qkv"] = ("quant", (cfg.qkv_dim, d))
        if cfg.qkv_bias:
            out[p + "attn_qkv_bias"] = ("float", (cfg.qkv_dim,))
        out[p + "attn_output"] = ("quant", (d, cfg.q_dim))
        if cfg.layer_norms != "pre":
            out[p + "attn_post_norm"] = ("float", (d,))
        out[p + "ffn_norm"] = ("float", (d,))
        out[p + "ffn_gate_up"] = ("quant", (2 * cfg.ffn_dim, d))
        out[p + "ffn_down"] = ("quant", (d, cfg.ffn_dim))
        if cfg.layer_norms != "pre":
            out[p + "ffn_post_norm"] = ("float", (d,))
    return out


def header_version(cfg: ModelConfig) -> int:
    """The version a file of ``cfg`` is written as: 1 when VERSION 1 can hold the model (no
    VERSION 2 fact differs from its default), so older readers still read it; else 2."""
    return 2 if cfg.arch_facts else 1


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------
def write_tlm(path, config: ModelConfig, tensors: dict, *, tokenizer_json: str | None = None,
              chat_template: str = "", metadata: dict | None = None) -> None:
    """Write a .tlm file.

    ``tensors`` maps names (see ``expected_tensors``) to a float ndarray (norm weights; stored
    as f32) or a :class:`QuantWeight` (stored as ``name.qweight``/``.scales``/``.zeros``).
    ``tokenizer_json`` (HF ``tokenizers`` JSON) is stored as the u8 entry ``tokenizer.json``.
    The file is validated against ``config`` before it is written (ConfigError /
    TensorShapeError on mismatch; NonFiniteWeightError for a NaN or inf norm weight, scale or
    zero) and written atomically (``fileio.atomic_write``: a fresh temporary file beside
    ``path``, fsync, rename), so ``path`` holds the old file or the whole new one; raises
    FileWriteError (an OSError naming ``path``) when the file system fails, leaving nothing
    behind.
    """
    arrays: list[tuple[str, str, np.ndarray]] = []
    want = expected_tensors(config)
    missing = set(want) - set(tensors)
    extra = set(tensors) - set(want)
    if missing or extra:
        raise TensorShapeError(f"tensors do not match the config: missing {sorted(missing)}, "
                               f"unexpected {sorted(extra)}")
    for name in sorted(tensors, key=_tensor_sort_key):
        kind, shape = want[name]
        t = tensors[name]
        if kind == "quant":
            if not isinstance(t, QuantWeight):
                raise TensorShapeError(f"{name} must be a QuantWeight")
            t.check()
            if t.shape != shape:
                raise TensorShapeError(f"{name} has shape {t.shape}, config needs {shape}")
            arrays.append((name + ".qweight", "q4" if t.bits == 4 else "i8",
                           np.ascontiguousarray(t.qweight)))
            arrays.append((name + ".scales", "f16", np.ascontiguousarray(t.scales)))
            arrays.append((name + ".zeros", "f16", np.ascontiguousarray(t.zeros)))
        else:
            a = np.ascontiguousarray(np.asarray(t, dtype=np.float32))
            if a.shape != shape:
                raise TensorShapeError(f"{name} has shape {a.shape}, config needs {shape}")
            arrays.append((name, "f32", a))
    for name, dt, a in arrays:
        bad = non_finite_message(name, a) if dt in ("f32", "f16") else None
        if bad:
            raise NonFiniteWeightError(f"refusing to write {path}: {bad}")
    if tokenizer_json is not None:
        n_tok = _tokenizer_json_size(tokenizer_json)
        if n_tok > config.vocab_size:
            raise TensorShapeError(f"the tokenizer has ids up to {n_tok - 1} but vocab_size is "
                                   f"{config.vocab_size}")
        arrays.append(("tokenizer.json", "u8",
                       np.frombuffer(tokenizer_json.encode("utf-8"), dtype=np.uint8)))

    entries, off = [], 0
    for name, dt, a in arrays:
        entries.append({"name": name, "dtype": dt, "shape": list(a.shape), "offset": off,
                        "nbytes": int(a.nbytes)})
        off = align(off + a.nbytes)
    version = header_version(config)
    header = json.dumps({"config": config.to_dict() if version >= 2 else
                         config.identity_dict(), "tensors": entries,
                         "chat_template": chat_template, "metadata": metadata or {}},
                        separators=(",", ":")).encode("utf-8")
    data_start = align(PREFIX.size + len(header))
    with atomic_write(path, "the model file") as f:
        f.write(PREFIX.pack(MAGIC, version, 0, len(header)))
        f.write(header)
        f.write(b"\0" * (data_start - PREFIX.size - len(header)))
        pos = 0
        for (name, dt, a), e in zip(arrays, entries):
            f.write(b"\0" * (e["offset"] - pos))
            f.write(a.tobytes())
            pos = e["offset"] + a.nbytes


def _tokenizer_json_size(text: str) -> int:
    """1 + the largest token id in HF ``tokenizers`` JSON (model vocab and added tokens)."""
    try:
        spec = json.loads(text)
        ids = list((spec.get("model") or {}).get("vocab", {}).values())
        ids += [t["id"] for t in spec.get("added_tokens") or []]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise TensorShapeError(f"tokenizer_json is not HF tokenizers JSON: {e}") from None
    return 1 + max((i for i in ids if isinstance(i, int)), default=-1)


def _tensor_sort_key(name: str):
    # layers in order, globals first: keeps a file readable with a hex dump
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        return (1, int(i), rest)
    return (0, 0, name)


# --------------------------------------------------------------------------------------------
# Reader / validator
# --------------------------------------------------------------------------------------------
class TLMFile:
    """A validated, memory-mapped .tlm file.

    Attributes: ``path``, ``version``, ``config`` (ModelConfig), ``entries`` (name ->
    TensorEntry), ``chat_template`` (str), ``metadata`` (dict), ``data_start`` (int, bytes),
    ``file_size`` (int, bytes). Use as a context manager or call ``close()``.

    Raises (all FormatError subclasses, each naming the cause): BadMagicError,
    UnsupportedVersionError, TruncatedFileError, SizeOverflowError, InconsistentDimsError,
    TensorBoundsError, TensorOverlapError, TensorShapeError; and NonFiniteWeightError from
    ``array`` / ``quant_weight`` / ``weight`` when a norm weight, scale or zero is NaN or inf.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._mm = None
        try:
            f = open_regular(self.path)
        except (NotRegularFileError, IsADirectoryError):
            raise FormatError(f"{self.path}: not a regular file") from None
        with f:
            self.file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(PREFIX.size)
            if not MAGIC.startswith(prefix[:8]):   # a short prefix of MAGIC is "truncated"
                raise BadMagicError(f"{self.path}: not a .tlm file (magic {prefix[:8]!r}, "
                                    f"expected {MAGIC!r})")
            if len(prefix) < PREFIX.size:
                raise TruncatedFileError(f"{self.path}: file is {self.file_size} bytes, shorter "
                                         f"than the {PREFIX.size}-byte prefix")
            _, self.version, _, header_len = PREFIX.unpack(prefix)
            if self.version > VERSION_MAX:
                raise UnsupportedVersionError(
                    f"{self.path}: .tlm VERSION {self.version} is newer than this reader "
                    f"supports (VERSION_MAX={VERSION_MAX}); upgrade tinyloop")
            if self.version < 1:
                raise UnsupportedVersionError(f"{self.path}: .tlm VERSION {self.version} < 1")
            if header_len > MAX_HEADER_BYTES:
                raise SizeOverflowError(f"{self.path}: header length {header_len} exceeds the "
                                        f"{MAX_HEADER_BYTES}-byte limit")
            if PREFIX.size + header_len > self.file_size:
                raise TruncatedFileError(f"{self.path}: header of {header_len} bytes runs past "
                                         f"the end of the {self.file_size}-byte file")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise FormatError(f"{self.path}: header is not valid UTF-8 JSON: "
                              f"{type(e).__name__}: {str(e)[:200]}") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: header must be a JSON object")
        self.data_start = align(PREFIX.size + header_len)
        raw_cfg = header.get("config")
        if self.version < 2 and isinstance(raw_cfg, dict):
            newer = sorted(set(raw_cfg) & set(V2_DEFAULTS))
            if newer:
                raise InconsistentDimsError(f"{self.path}: config keys {newer} need .tlm "
                                            f"VERSION 2, the file says {self.version}")
        try:
            self.config = ModelConfig.from_dict(raw_cfg)
        except ConfigError as e:
            raise InconsistentDimsError(f"{self.path}: {e}") from None
        self.chat_template = header.get("chat_template", "")
        self.metadata = header.get("metadata", {})
        if not isinstance(self.chat_template, str) or not isinstance(self.metadata, dict):
            raise FormatError(f"{self.path}: chat_template must be a string and metadata "
                              "an object")
        self.entries = self._parse_entries(header.get("tensors"))
        self._check_tensors()
        with open_regular(self.path) as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    # -- validation ---------------------------------------------------------------------------
    def _parse_entries(self, raw) -> dict[str, TensorEntry]:
        if not isinstance(raw, list):
            raise FormatError(f"{self.path}: 'tensors' must be a list")
        if len(raw) > MAX_TENSORS:
            raise SizeOverflowError(f"{self.path}: {len(raw)} tensor entries (limit "
                                    f"{MAX_TENSORS})")
        data_len = self.file_size - self.data_start
        entries: dict[str, TensorEntry] = {}
        for e in raw:
            if not isinstance(e, dict) or not isinstance(e.get("name"), str):
                raise FormatError(f"{self.path}: malformed tensor entry {e!r:.200}")
            name = e["name"]
            if name in entries:
                raise FormatError(f"{self.path}: tensor {name!r} appears twice")
            dt, shape, off, nb = e.get("dtype"), e.get("shape"), e.get("offset"), e.get("nbytes")
            if not isinstance(dt, str) or dt not in DTYPES:
                raise TensorShapeError(f"{self.path}: tensor {name!r} has unknown dtype {dt!r}")
            if (not isinstance(shape, list) or not all(_is_int(s) for s in shape)
                    or not _is_int(off) or not _is_int(nb)):
                raise FormatError(f"{self.path}: tensor {name!r}: shape/offset/nbytes must be "
                                  "integers")
            if any(s < 0 for s in shape) or off < 0 or nb < 0:
                raise SizeOverflowError(f"{self.path}: tensor {name!r} has a negative size or "
                                        "offset")
            # Python ints never overflow; compare with the file before anything is allocated.
            count = 1
            for s in shape:
                count *= s
            want = count * np.dtype(DTYPES[dt]).itemsize
            for what, v in (("size", want), ("nbytes", nb), ("offset", off)):
                if v >= 1 << 62:
                    raise SizeOverflowError(f"{self.path}: tensor {name!r} declares an "
                                            f"impossible {what} ({v}; shape {shape})")
            if want != nb:
                raise TensorShapeError(f"{self.path}: tensor {name!r} declares nbytes={nb} but "
                                       f"shape {shape} of {dt} needs {want}")
            if off % ALIGN:
                raise TensorBoundsError(f"{self.path}: tensor {name!r} offset {off} is not "
                                        f"{ALIGN}-byte aligned")
            if off + nb > data_len:
                if nb <= data_len and off <= data_len:
                    raise TruncatedFileError(
                        f"{self.path}: tensor {name!r} ends at data offset {off + nb}, past the "
                        f"end of the data section ({data_len} bytes): file truncated?")
                raise TensorBoundsError(f"{self.path}: tensor {name!r} [{off}, {off + nb}) lies "
                                        f"outside the data section ({data_len} bytes)")
            entries[name] = TensorEntry(name, dt, tuple(shape), off, nb)
        spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values()
                       if e.nbytes)
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise TensorOverlapError(f"{self.path}: tensors {an!r} [{a0}, {a1}) and {bn!r} "
                                         f"[{b0}, {b1}) overlap")
        return entries

    def _check_tensors(self) -> None:
        for name, (kind, shape) in expected_tensors(self.config).items():
            if kind == "float":
                e = self._entry(name)
                if e.dtype != "f32" or e.shape != shape:
                    raise TensorShapeError(f"{self.path}: {name!r} is {e.dtype}{list(e.shape)}, "
                                           f"the dims need f32{list(shape)}")
                continue
            q, s, z = (self._entry(f"{name}.{p}") for p in ("qweight", "scales", "zeros"))
            if q.dtype not in ("q4", "i8"):
                raise TensorShapeError(f"{self.path}: {name}.qweight has dtype {q.dtype}, "
                                       "expected q4 or i8")
            for part in (s, z):
                if part.dtype != "f16":
                    raise TensorShapeError(f"{self.path}: {part.name} has dtype {part.dtype}, "
                                           "expected f16")
            bits = 4 if q.dtype == "q4" else 8
            if len(q.shape) != 2 or len(s.shape) != 2 or s.shape[1] == 0:
                raise TensorShapeError(f"{self.path}: {name} parts must be 2-D with groups")
            cols = q.shape[1] * (2 if bits == 4 else 1)
            if (q.shape[0], cols) != shape:
                raise TensorShapeError(f"{self.path}: {name} is [{q.shape[0]}, {cols}], the dims "
                                       f"need {list(shape)}")
            group = cols // s.shape[1] if cols % s.shape[1] == 0 else -1
            try:
                check_quant_parts(bits, group, q.shape, "uint8" if bits == 4 else "int8",
                                  s.shape, _np_name(s.dtype), z.shape, _np_name(z.dtype))
            except ConfigError as e:
                raise TensorShapeError(f"{self.path}: {name}: {e}") from None
        known = set()
        for name, (kind, _) in expected_tensors(self.config).items():
            known |= {name} if kind == "float" else {f"{name}.{p}" for p in
                                                     ("qweight", "scales", "zeros")}
        known.add("tokenizer.json")
        unknown = set(self.entries) - known
        if unknown:
            raise TensorShapeError(f"{self.path}: unexpected tensors for these dims: "
                                   f"{sorted(unknown)[:5]}")
        tok = self.entries.get("tokenizer.json")
        if tok is not None and (tok.dtype != "u8" or len(tok.shape) != 1):
            raise TensorShapeError(f"{self.path}: tokenizer.json must be a 1-D u8 entry")

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise TensorShapeError(f"{self.path}: required tensor {name!r} is missing") from None

    # -- access --------------------------------------------------------------------------------
    def array(self, name: str) -> np.ndarray:
        """A read-only NumPy view (memory-mapped) of tensor ``name``.

        Float entries (norm weights, scales, zeros) are checked to be finite first: raises
        NonFiniteWeightError naming the first NaN or inf element."""
        e = self._entry(name)
        if self._mm is None:
            raise FormatError(f"{self.path}: file is closed")
        a = np.frombuffer(self._mm, dtype=DTYPES[e.dtype], count=e.nbytes //
                          np.dtype(DTYPES[e.dtype]).itemsize,
                          offset=self.data_start + e.offset).reshape(e.shape)
        if e.dtype in ("f32", "f16"):
            bad = non_finite_message(name, a)
            if bad:
                raise NonFiniteWeightError(f"{self.path}: {bad}")
        return a

    def quant_weight(self, name: str) -> QuantWeight:
        q = self._entry(name + ".qweight")
        qa, sa = self.array(name + ".qweight"), self.array(name + ".scales")
        bits = 4 if q.dtype == "q4" else 8
        cols = qa.shape[1] * (2 if bits == 4 else 1)
        return QuantWeight(bits, cols // sa.shape[1], qa, sa, self.array(name + ".zeros"))

    def weight(self, name: str):
        """QuantWeight for quantized tensors, float32 array for norm weights."""
        kind, _ = expected_tensors(self.config)[name]
        return self.quant_weight(name) if kind == "quant" else self.array(name)

    @property
    def tokenizer_json(self) -> str | None:
        if "tokenizer.json" not in self.entries:
            return None
        try:
            return self.array("tokenizer.json").tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{self.path}: the embedded tokenizer.json is not UTF-8 "
                              f"({e.reason} at byte {e.start}): file corrupted?") from None

    def quant_layout(self) -> dict[str, tuple[int, int]]:
        """Quantized tensor name -> (bits, group_size), as the memory plan needs it."""
        out = {}
        for n in self.quant_names():
            q = self.quant_weight(n)
            out[n] = (q.bits, q.group_size)
        return out

    def quant_names(self) -> list[str]:
        return [n for n, (k, _) in expected_tensors(self.config).items() if k == "quant"]

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive; the map closes when they go
                pass
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _np_name(dt: str) -> str:
    return np.dtype(DTYPES[dt]).name


def read_tlm(path) -> TLMFile:
    """Open and validate a .tlm file (see :class:`TLMFile` for the errors raised)."""
    return TLMFile(path)
