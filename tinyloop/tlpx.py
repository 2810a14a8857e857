"""The prefix file format (.tlpx): what ``PrefixCache.save`` writes and ``Model.load_prefix``
reads, beside the model file format (``tinyloop.format``, .tlm).

:func:`write_prefix` writes a handle's host state; :func:`read_prefix` checks every field of a
file against the model's facts before returning anything, so a hostile or damaged file fails
with a clear error before any pool memory is touched. Neither knows the handle classes:
``kv.handles`` turns a :class:`PrefixFile` into a handle.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

import numpy as np

from .config import KV_MODES
from .errors import (BadMagicError, FormatError, SizeOverflowError, TokenizerError,
                     TruncatedFileError, UnsupportedVersionError)
from .fileio import open_regular, write_bytes
from .kv.layouts import PageLayout, mode_name, slot_layers

PREFIX_MAGIC = b"TLPREFIX"
PREFIX_VERSION = 3
# version 2 stored a ResumeHandle's coda K/V in the slots after its depth's iterations (in the
# page layout of the recurrent layers there); its PrefixCache files and ResumeHandles at
# max_depth have the same bytes as version 3 and are still read
_READ_VERSIONS = (2, 3)
_HEADER = struct.Struct("<8sI32sBBHHH16sIIIIIII32sQ")
# magic, version, fingerprint, kind (0 PrefixCache, 1 ResumeHandle), fp16-mode K/V dtype (0 f32,
# 1 f16), depth, max_depth, snapshot planes, kv_mode (ASCII name or "mixed", NUL padded),
# n_tokens, n_slots, n_kv_heads, head_dim, d_model, vocab_size, n_layers, SHA-256 of the
# modes table and the payload, payload bytes. Then the modes table: n_layers x 8 bytes (ASCII,
# NUL padded), one KV mode per physical layer. Then the payload.
_MODE_BYTES = 8
_KV_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2")}


def _payload_layout(cfg, kind: int, depth: int, max_depth: int, planes: int, n: int,
                    modes: tuple, kv_dtype: np.dtype) -> list[tuple[str, tuple, np.dtype]]:
    """The payload's arrays in order (name, shape, dtype); sizes are exact Python ints.

    tokens (u32 [n]); for every slot s of the K/V (``n_slots(max_depth)`` for a ResumeHandle,
    else ``n_slots(depth)``, in the order of ``slot_layers``: a ResumeHandle's coda slots are
    the last ones whatever its depth, ``kv.layouts.room_slots``), every part of its layer's page
    layout (``kv.layouts.PageLayout``) for positions 0..n-1 (``[n, ...]``); rows (f32 [n,
    d_model]); for a ResumeHandle the snapshot (f32 [planes, n, d_model]).
    """
    out = [("tokens", (n,), np.dtype("<u4"))]
    for s, li in enumerate(slot_layers(cfg, max_depth if kind == 1 else depth)):
        lay = PageLayout.for_config(cfg, modes[li], 1, kv_dtype)
        for part in lay.parts:
            out.append((f"kv.{s}.{part.name}", (n,) + tuple(part.shape[1:]),
                        np.dtype(part.dtype).newbyteorder("<")))
    out.append(("rows", (n, cfg.d_model), np.dtype("<f4")))
    if kind == 1:
        out.append(("snapshot", (planes, n, cfg.d_model), np.dtype("<f4")))
    return out


def _nbytes(shape, dtype) -> int:
    size = dtype.itemsize
    for s in shape:
        size *= int(s)          # Python ints: no overflow
    return size


def _modes_table(modes: tuple) -> bytes:
    return b"".join(m.encode("ascii").ljust(_MODE_BYTES, b"\0") for m in modes)


def kv_dtype_code(kv_dtype) -> int:
    """The header's code of the fp16-mode K/V dtype ``kv_dtype`` (0 float32, 1 float16)."""
    return next(c for c, d in _KV_DTYPES.items() if d == np.dtype(kv_dtype))


def write_prefix(path, *, fingerprint: bytes, cfg, resume: bool, kv_dtype, depth: int,
                 max_depth: int, ids: np.ndarray, modes: tuple, state: dict) -> int:
    """Write a prefix file to ``path``; returns the bytes written.

    ``state``: the handle's host copies (``HandleStorage.host_state``: ``kv`` one dict per
    slot of part name -> ``[n, ...]``, ``rows`` float32 ``[n, d_model]``, ``snapshot`` float32
    ``[planes, n, d_model]`` for a ResumeHandle); ``resume``: a ResumeHandle (K/V room for
    ``max_depth``), else a PrefixCache (``max_depth == depth``).

    Format (little-endian): the fixed header ``_HEADER`` (magic ``TLPREFIX``, version 3, the
    model's 32-byte fingerprint, the kind, the fp16-mode K/V dtype, depth, max_depth, snapshot
    planes, kv_mode, token count, slots, n_kv_heads, head_dim, d_model, vocab_size, n_layers,
    the SHA-256 of what follows the header and the payload's length), the modes table (one KV
    mode per physical layer), then the payload of :func:`_payload_layout`: every page part of
    every slot for the prefix's positions.

    Written through ``fileio.atomic_write`` (a fresh temporary file beside ``path``, fsync,
    atomic rename): a reader of ``path`` sees the old file or the new one, never a part, and
    concurrent saves to one path leave one complete file. Raises FileWriteError (an OSError
    naming ``path``) when the file system fails; nothing is left behind.
    """
    kind = 1 if resume else 0
    dt_code = kv_dtype_code(kv_dtype)
    n = len(ids)
    planes = state["snapshot"].shape[0] if kind == 1 else 0
    layout = _payload_layout(cfg, kind, depth, max_depth, planes, n, modes, _KV_DTYPES[dt_code])
    arrays = {"tokens": ids, "rows": state["rows"], "snapshot": state.get("snapshot")}
    for s, parts in enumerate(state["kv"]):
        for name, arr in parts.items():
            arrays[f"kv.{s}.{name}"] = arr
    parts = [np.ascontiguousarray(arrays[name], dtype=dt) for name, _, dt in layout]
    for (name, shape, _), arr in zip(layout, parts):
        assert arr.shape == shape, (name, arr.shape, shape)
    table = _modes_table(modes)
    h = hashlib.sha256(table)
    for p in parts:
        h.update(memoryview(p).cast("B"))
    payload_len = sum(p.nbytes for p in parts)
    mode = mode_name(modes)
    mode = (mode if isinstance(mode, str) else "mixed").encode("ascii")
    header = _HEADER.pack(PREFIX_MAGIC, PREFIX_VERSION, fingerprint, kind, dt_code,
                          depth, max_depth, planes, mode, n, len(state["kv"]), cfg.n_kv_heads,
                          cfg.head_dim, cfg.d_model, cfg.vocab_size, cfg.n_layers, h.digest(),
                          payload_len)
    chunks = [header, table] + [memoryview(p).cast("B") for p in parts]
    return write_bytes(path, chunks, "the prefix file")


@dataclass(frozen=True)
class PrefixFile:
    """A prefix file that passed every check: ``resume`` (a ResumeHandle's), ``ids`` int32
    ``[n]``, ``depth``, ``max_depth``, ``modes`` (one KV mode per physical layer, as stored),
    ``state`` (host arrays shaped as ``HandleStorage.host_state`` gives them)."""

    resume: bool
    ids: np.ndarray
    depth: int
    max_depth: int
    modes: tuple
    state: dict


def read_prefix(path, *, cfg, fingerprint: bytes, max_seq_len: int,
                injects: bool) -> PrefixFile:
    """Read and check a prefix file written by :func:`write_prefix` for the model of ``cfg`` /
    ``fingerprint`` / ``max_seq_len`` (``injects``: it injects the prelude output, so a
    ResumeHandle keeps two snapshot planes).

    Every header field is checked against the model and against the file's length (Python
    ints, so no overflow), then the SHA-256 of the modes table and the payload. Raises
    BadMagicError, UnsupportedVersionError, TruncatedFileError (shorter than the header or its
    payload), SizeOverflowError (trailing bytes, absurd counts), FormatError (another model's
    fingerprint, dims that differ from the model's, an unknown kind/dtype/KV mode, a depth
    outside the model's range, a checksum mismatch), TokenizerError (ids outside the
    vocabulary), and the file system's OSError unchanged (FileNotFoundError, PermissionError,
    IsADirectoryError, ...; ``filename`` is ``path``).
    Version 2 files are read where their bytes equal version 3's (see ``_READ_VERSIONS``).
    """
    path = os.fspath(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER.size:
                raise TruncatedFileError(f"{path}: {size} bytes is shorter than the "
                                         f"{_HEADER.size}-byte prefix header")
            (magic, version, file_fp, kind, dt_code, depth, max_depth, planes, mode_raw, n,
             slots, n_kv_heads, head_dim, d_model, vocab_size, n_layers, digest,
             payload_len) = _HEADER.unpack(f.read(_HEADER.size))
            if magic != PREFIX_MAGIC:
                raise BadMagicError(f"{path}: not a TinyLoop prefix file (magic {magic!r})")
            if version not in _READ_VERSIONS:
                raise UnsupportedVersionError(f"{path}: prefix file version {version}; this "
                                              f"reader reads versions {_READ_VERSIONS}")
            if file_fp != fingerprint:
                raise FormatError(f"{path}: saved by another model (fingerprint "
                                  f"{file_fp.hex()[:16]}..., this model's is "
                                  f"{fingerprint.hex()[:16]}...)")
            if kind not in (0, 1) or dt_code not in _KV_DTYPES:
                raise FormatError(f"{path}: unknown kind {kind} / K/V dtype code {dt_code}")
            dims = dict(n_kv_heads=n_kv_heads, head_dim=head_dim, d_model=d_model,
                        vocab_size=vocab_size, n_layers=n_layers)
            for name, val in dims.items():
                if val != getattr(cfg, name):
                    raise FormatError(f"{path}: {name}={val} but the model has "
                                      f"{getattr(cfg, name)}")
            if not 1 <= depth <= max_depth <= cfg.max_depth or (kind == 0 and max_depth != depth):
                raise FormatError(f"{path}: depth {depth} / max_depth {max_depth} outside the "
                                  f"model's 1..{cfg.max_depth}")
            if version == 2 and depth != max_depth:
                raise UnsupportedVersionError(f"{path}: a version 2 ResumeHandle below its "
                                              f"max_depth ({depth} < {max_depth}) stored its coda "
                                              f"in another slot order; make it again with "
                                              f"resume_handle() and save it")
            if not 1 <= n <= max_seq_len:
                raise SizeOverflowError(f"{path}: {n} tokens; this model takes 1.."
                                        f"{max_seq_len} (max_seq_len)")
            want_planes = (2 if injects else 1) if kind == 1 else 0
            if planes != want_planes:
                raise FormatError(f"{path}: {planes} snapshot planes, expected {want_planes}")
            want_slots = cfg.n_slots(max_depth if kind == 1 else depth)
            if slots != want_slots:
                raise FormatError(f"{path}: {slots} K/V slots, expected {want_slots}")
            if size - _HEADER.size < n_layers * _MODE_BYTES:
                raise TruncatedFileError(f"{path}: the file ends inside its KV modes table")
            table = f.read(n_layers * _MODE_BYTES)
            try:
                modes = tuple(table[i:i + _MODE_BYTES].rstrip(b"\0").decode("ascii")
                              for i in range(0, len(table), _MODE_BYTES))
            except UnicodeDecodeError:
                raise FormatError(f"{path}: the KV modes table is not ASCII") from None
            bad = [m for m in modes if m not in KV_MODES]
            if bad:
                raise FormatError(f"{path}: unknown KV mode(s) {sorted(set(bad))}")
            try:
                mode_field = mode_raw.rstrip(b"\0").decode("ascii")
            except UnicodeDecodeError:
                raise FormatError(f"{path}: kv_mode field is not ASCII") from None
            if mode_field != (modes[0] if len(set(modes)) == 1 else "mixed"):
                raise FormatError(f"{path}: kv_mode {mode_field!r} contradicts the modes table")
            layout = _payload_layout(cfg, kind, depth, max_depth, planes, n, modes,
                                     _KV_DTYPES[dt_code])
            want = sum(_nbytes(s, d) for _, s, d in layout)
            if payload_len != want:
                raise SizeOverflowError(f"{path}: header says {payload_len} payload bytes; its "
                                        f"counts need {want}")
            rest = size - _HEADER.size - len(table)
            if rest < want:
                raise TruncatedFileError(f"{path}: {size} bytes; header, modes and payload need "
                                         f"{_HEADER.size + len(table) + want}")
            if rest > want:
                raise SizeOverflowError(f"{path}: {rest - want} trailing bytes after the payload")
            payload = f.read(want)
    except OSError as e:          # a failed read names the file too, like a failed open
        if e.filename is None:
            e.filename = path
        raise
    if len(payload) != want:
        raise TruncatedFileError(f"{path}: the file shrank while being read")
    if hashlib.sha256(table + payload).digest() != digest:
        raise FormatError(f"{path}: checksum mismatch (the file is corrupted)")
    arrays, off = {}, 0
    for name, shape, dt in layout:
        nb = _nbytes(shape, dt)
        arrays[name] = np.frombuffer(payload, dtype=dt, count=nb // dt.itemsize,
                                     offset=off).reshape(shape)
        off += nb
    ids = arrays["tokens"]
    if (ids >= cfg.vocab_size).any():
        i = int(np.argmax(ids >= cfg.vocab_size))
        raise TokenizerError(f"{path}: token {i} = {int(ids[i])} is outside the vocabulary "
                             f"of {cfg.vocab_size}")
    ids = ids.astype(np.int32)
    state = {"rows": arrays["rows"], "snapshot": arrays.get("snapshot"),
             "kv": [{part.name: arrays[f"kv.{s}.{part.name}"]
                     for part in PageLayout.for_config(cfg, modes[li], 1).parts}
                    for s, li in enumerate(slot_layers(cfg, max_depth if kind == 1
                                                       else depth))]}
    return PrefixFile(kind == 1, ids, depth, max_depth, modes, state)
