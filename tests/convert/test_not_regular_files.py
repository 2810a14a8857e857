"""Every reader of a file from outside (.tlm, GGUF, .tlpx prefix files, the content hash of a
conversion's cache key, the CLI) refuses a FIFO or a folder at the path before it reads: a
FIFO's open or read would wait for a writer forever, a folder has no bytes. Each is checked
in a daemon thread that must come back."""

from __future__ import annotations

import os
import threading

import pytest

import tinyloop
from tinyloop import errors
from tinyloop.fileio import NotRegularFileError, open_regular


_NOT_REGULAR = OSError


def _call_within(fn, seconds=30):
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:          # noqa: BLE001 - handed to the test thread
            box.append(("raised", e))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"{fn} blocked for {seconds} s"
    return box[0]


@pytest.fixture(params=["fifo", "folder"])
def odd(request, tmp_path):
    """A path of each suffix that is a FIFO or a folder (at which open_regular raises
    NotRegularFileError or, as ``open`` does, IsADirectoryError)."""
    global _NOT_REGULAR
    _NOT_REGULAR = NotRegularFileError if request.param == "fifo" else IsADirectoryError
    make = os.mkfifo if request.param == "fifo" else os.mkdir

    def at(name):
        p = str(tmp_path / name)
        make(p)
        return p
    return at


def test_open_regular(tmp_path, odd):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    with open_regular(p) as f:
        assert f.read() == b"abc" and os.get_blocking(f.fileno())
    how, e = _call_within(lambda: open_regular(odd("x.bin")))
    assert how == "raised" and isinstance(e, _NOT_REGULAR) and e.filename.endswith("x.bin")
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")


def test_tlm_readers(odd, tiny_model_path):
    from tinyloop.format import read_tlm
    path = odd("m.tlm")
    how, e = _call_within(lambda: read_tlm(path))
    assert how == "raised" and isinstance(e, errors.FormatError) \
        and f"{path}: not a regular file" in str(e)
    how, e = _call_within(lambda: tinyloop.load_model(path, backend="numpy"))
    assert how == "raised" and isinstance(e, errors.TinyLoopError) and path in str(e)
    with read_tlm(tiny_model_path) as f:        # a real file still reads
        assert f.config.n_layers > 0


def test_gguf_readers(odd, tmp_path, monkeypatch):
    from tinyloop.convert.gguf import convert_gguf
    from tinyloop.convert.gguf_check import check_gguf
    path = odd("m.gguf")
    for fn in (lambda: check_gguf(path), lambda: convert_gguf(path, str(tmp_path / "o.tlm"))):
        how, e = _call_within(fn)
        assert how == "raised" and isinstance(e, errors.ConversionError) \
            and ("not a regular file" in str(e) or "Is a directory" in str(e))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    how, e = _call_within(lambda: tinyloop.load_model(path, backend="numpy"))
    assert how == "raised" and isinstance(e, errors.TinyLoopError) \
        and "not a file" in str(e) and path in str(e)
    assert not os.path.exists(tmp_path / "o.tlm")


def test_content_hash_and_the_cli(odd, capsys):
    from tinyloop import cli
    from tinyloop.default import content_hash
    path = odd("h.tlm")
    how, e = _call_within(lambda: content_hash(path))
    assert how == "raised" and isinstance(e, _NOT_REGULAR)
    how, rc = _call_within(lambda: cli.main(["inspect", path]))
    assert how == "ok" and rc != 0 and path in capsys.readouterr().err


def test_a_prefix_file_that_is_not_a_regular_file(odd, tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, backend="numpy", max_seq_len=32)
    try:
        path = odd("p.tlpx")
        before = m.pool.allocated_bytes
        how, e = _call_within(lambda: m.load_prefix(path))
        assert how == "raised" and isinstance(e, _NOT_REGULAR) and e.filename == path
        assert m.pool.allocated_bytes == before
    finally:
        tinyloop.free_model(m)
