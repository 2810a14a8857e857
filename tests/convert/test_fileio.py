"""Every file TinyLoop writes goes through fileio.atomic_write: a failed write leaves no
temporary file and the old destination intact, OS errors name the destination (never a
temporary name), planted symlinks are never followed, concurrent writers leave one complete
file. Checked for each writer: .tlm (format.write_tlm), GGUF conversion, .tlpx prefix files,
memory snapshots, and the default-model cache conversion."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import tinyloop
from tinyloop import errors, fileio
from tinyloop.convert.synthetic import byte_level_tokenizer_json, synthetic_config, \
    synthetic_weights
from tinyloop.format import read_tlm, write_tlm
from tinyloop.memory import get_pool
from tinyloop.memory.snapshot import write_snapshot

from ..conftest import TINY

WRITERS = ["tlm", "convert", "tlpx", "snapshot"]
SNAPSHOT_MARKS = (777, 1555)    # requested bytes of a block held while each snapshot is taken


@pytest.fixture(scope="module")
def model(tiny_model_path):
    m = tinyloop.load_model(tiny_model_path, max_seq_len=128, backend="numpy")
    yield m
    tinyloop.free_model(m)


@pytest.fixture(scope="module")
def tlm_parts():
    cfg = synthetic_config(**{**TINY, "bos_token_id": 256, "eos_token_id": 257})
    return cfg, [synthetic_weights(cfg, seed) for seed in (1, 2)], \
        byte_level_tokenizer_json(cfg.vocab_size)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from .test_convert_gguf import write_tiny_gguf
    paths = []
    for seed in (0, 1):
        p = tmp_path_factory.mktemp("gguf") / f"tiny{seed}.gguf"
        write_tiny_gguf(p, seed=seed)
        paths.append(str(p))
    return paths


class Writer:
    """``write(path, k)`` writes version k (0 or 1) of one kind of file; ``check(path)``
    reads it back fully (raising on any damage) and returns which version it is."""

    def __init__(self, kind, request):
        self.kind = kind
        if kind == "tlm":
            self.cfg, self.weights, self.tok = request.getfixturevalue("tlm_parts")
        elif kind == "convert":
            self.src = request.getfixturevalue("tiny_gguf")
        elif kind == "tlpx":
            m = self.model = request.getfixturevalue("model")
            self.handles = [m.prefill([5, 6, 7, 8, 9][:3 + k], depth=1 + k) for k in (0, 1)]
            request.addfinalizer(lambda: [h.release() for h in self.handles])

    def write(self, path, k=0):
        if self.kind == "tlm":
            write_tlm(path, self.cfg, self.weights[k], tokenizer_json=self.tok,
                      metadata={"version": k})
        elif self.kind == "convert":
            from tinyloop.convert.gguf import convert_gguf
            convert_gguf(self.src[k], path, recurrent=(1, 3))
        elif self.kind == "tlpx":
            self.handles[k].save(path)
        else:
            pool = get_pool("host")
            blk = pool.allocate(SNAPSHOT_MARKS[k], "other")  # the snapshot differs per k
            try:
                write_snapshot(pool, path)
            finally:
                pool.free(blk)

    def check(self, path) -> int:
        if self.kind in ("tlm", "convert"):
            with read_tlm(path) as f:
                qkv = f.quant_weight("blk.0.attn_qkv").qweight.tobytes()
                if self.kind == "tlm":
                    return f.metadata["version"]
            return [read_tlm_qkv(p) for p in self.converted].index(qkv)
        if self.kind == "tlpx":
            with self.model.load_prefix(path) as h:
                return [x.tokens for x in self.handles].index(h.tokens)
        with open(path, "rb") as f:
            snap = pickle.load(f)
        sizes = {b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                 if b["category"] == "other" and b["state"] == "active_allocated"}
        found = [k for k, mark in enumerate(SNAPSHOT_MARKS) if mark in sizes]
        assert found, "a snapshot without the block its writer held"
        return found[0]


def read_tlm_qkv(path) -> bytes:
    with read_tlm(path) as f:
        return f.quant_weight("blk.0.attn_qkv").qweight.tobytes()


@pytest.fixture(params=WRITERS)
def writer(request, tmp_path_factory):
    w = Writer(request.param, request)
    if w.kind == "convert":                   # what each source converts to, for check()
        d = tmp_path_factory.mktemp("ref")
        w.converted = []
        for k in (0, 1):
            w.write(str(d / f"ref{k}.tlm"), k)
            w.converted.append(str(d / f"ref{k}.tlm"))
    return w


def _listing(folder):
    return sorted(os.listdir(folder))


def _assert_names_destination(e, path, code):
    assert isinstance(e, errors.FileWriteError) and isinstance(e, OSError)
    assert e.filename == str(path)
    assert e.errno == code
    assert isinstance(e.__cause__, OSError) or code == errno.EISDIR
    assert fileio.TEMP_SUFFIX not in str(e) and ".tmp" not in str(e)


class _FileProxy:
    """A file object that passes everything to the file ``f`` it wraps (subclasses override
    what fails)."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


class _FailingFile(_FileProxy):
    """A file object whose write fails once ``limit`` bytes are written (as a full disk)."""

    def __init__(self, f, limit, exc):
        super().__init__(f)
        self._left, self._exc = limit, exc

    def write(self, b):
        n = memoryview(b).nbytes
        if n > self._left:
            self._f.write(memoryview(b).cast("B")[:self._left])
            raise self._exc
        self._left -= n
        return self._f.write(b)


FAILURES = {
    "disk full mid-file": (lambda: OSError(errno.ENOSPC, "No space left on device"),
                           errno.ENOSPC),
    "interrupt mid-file": (lambda: KeyboardInterrupt(), None),
    "fsync": ("fsync", errno.EIO),
    "rename": ("replace", errno.EXDEV),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_write_leaves_no_temp_file_and_the_old_destination(writer, tmp_path,
                                                                     monkeypatch, failure):
    path = tmp_path / "out.bin"
    writer.write(str(path), 0)
    old = path.read_bytes()
    listing = _listing(tmp_path)
    how, code = FAILURES[failure]
    if how in ("fsync", "replace"):
        def fail(*a, **k):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(os, how, fail)
    else:
        real_open = open

        def opener(fd, *a, **k):
            return _FailingFile(real_open(fd, *a, **k), 300, how())
        monkeypatch.setattr(fileio, "open", opener, raising=False)
    expected = KeyboardInterrupt if code is None else errors.FileWriteError
    with pytest.raises(expected) as info:
        writer.write(str(path), 1)
    monkeypatch.undo()
    if code is not None:
        _assert_names_destination(info.value, path, code)
    assert _listing(tmp_path) == listing                     # no temporary file left
    assert path.read_bytes() == old
    assert writer.check(str(path)) == 0


def test_a_failed_save_leaves_the_handle_and_allocated_bytes_as_they_were(model, tmp_path,
                                                                          monkeypatch):
    from ..kv.test_prefix import _state
    with model.resume_handle([3, 4, 5, 6, 7], depth=1, max_depth=3) as rh:
        want = _state(rh)
        before = get_pool("host").stats().allocated_bytes
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(
            OSError(errno.EIO, "Input/output error")))
        with pytest.raises(errors.FileWriteError):
            rh.save(tmp_path / "rh.tlpx")
        monkeypatch.undo()
        assert get_pool("host").stats().allocated_bytes == before
        for part, arr in _state(rh).items():
            np.testing.assert_array_equal(arr, want[part])
        rh.upgrade(3)
        assert rh.save(tmp_path / "rh.tlpx") == os.path.getsize(tmp_path / "rh.tlpx")
        assert _listing(tmp_path) == ["rh.tlpx"]


_FSIZE_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    import tinyloop
    from tinyloop import errors
    from tinyloop.convert.synthetic import synthetic_config, write_synthetic
    kind, path, src = sys.argv[1:4]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write then fails with EFBIG
    m = tinyloop.load_model(src, max_seq_len=64, backend="numpy")
    h = m.prefill(list(range(3, 40)), depth=2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        if kind == "tlm":
            write_synthetic(path, synthetic_config(**json.loads(sys.argv[4])), seed=3)
        else:
            h.save(path)
    except errors.FileWriteError as e:
        print(json.dumps([e.errno, e.filename, str(e), type(e.__cause__).__name__]))
""")


@pytest.mark.parametrize("kind", ["tlm", "tlpx"])
def test_the_file_size_limit_leaves_no_temp_file(kind, tmp_path, tiny_model_path):
    """RLIMIT_FSIZE (a real EFBIG from the kernel, in a child process) mid-file."""
    import json
    path = tmp_path / f"out.{kind}"
    path.write_bytes(b"old content")
    r = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, kind, str(path), tiny_model_path,
                        json.dumps(TINY)], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr
    code, filename, message, cause = json.loads(r.stdout)
    assert (code, filename, cause) == (errno.EFBIG, str(path), "OSError")
    assert ".tmp" not in message and str(path) in message
    assert _listing(tmp_path) == [path.name]
    assert path.read_bytes() == b"old content"


def test_a_directory_or_a_missing_folder_as_destination(writer, tmp_path):
    target = tmp_path / "adir"
    target.mkdir()
    (target / "inside").write_bytes(b"x")
    with pytest.raises(errors.FileWriteError) as info:
        writer.write(str(target), 0)
    _assert_names_destination(info.value, target, errno.EISDIR)
    assert _listing(tmp_path) == ["adir"] and _listing(target) == ["inside"]
    missing = tmp_path / "no" / "such" / "folder.bin"
    with pytest.raises(errors.FileWriteError) as info:
        writer.write(str(missing), 0)
    _assert_names_destination(info.value, missing, errno.ENOENT)


def test_a_symlink_at_a_temporary_name_is_never_followed(writer, tmp_path, monkeypatch):
    """Symlinks planted at the names earlier versions used (``<path>.tmp``,
    ``<path>.tmp<pid>``) and at the first name the helper draws: none is written through,
    the destination is a regular file with the new content."""
    path = tmp_path / "out.bin"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    drawn = iter(["0" * 16])
    real = fileio.secrets.token_hex
    monkeypatch.setattr(fileio.secrets, "token_hex",
                        lambda n: next(drawn, None) or real(n))
    planted = [f"{path}.tmp", f"{path}.tmp{os.getpid()}",
               os.path.join(tmp_path, f".out.bin.{'0' * 16}{fileio.TEMP_SUFFIX}")]
    for p in planted:
        os.symlink(victim, p)
    writer.write(str(path), 1)
    assert victim.read_bytes() == b"precious"
    assert all(os.path.islink(p) for p in planted)
    assert path.is_file() and not path.is_symlink()
    assert writer.check(str(path)) == 1
    assert len(_listing(tmp_path)) == 2 + len(planted)


@pytest.mark.parametrize("n_writers", [2, 8])
def test_concurrent_writers_and_a_reader_see_only_complete_files(writer, tmp_path, n_writers):
    path = str(tmp_path / "shared.bin")
    writer.write(path, 0)
    deadline = time.monotonic() + 1.5
    reads, failures = [], []

    def write(k):
        try:
            while time.monotonic() < deadline:
                writer.write(path, k)
        except BaseException as e:        # reported below
            failures.append(e)

    def read():
        while time.monotonic() < deadline:
            try:
                reads.append(writer.check(path))
            except BaseException as e:
                failures.append(e)

    threads = [threading.Thread(target=write, args=(i % 2,)) for i in range(n_writers)]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert reads and set(reads) <= {0, 1}
    assert writer.check(path) in (0, 1)
    assert _listing(tmp_path) == ["shared.bin"]


def test_the_cache_conversion_names_the_cache_folder(tiny_gguf, tmp_path, monkeypatch):
    """The default model's cache: a cache folder that cannot be made is named in the error;
    a write that fails leaves no temporary file in the cache folder and no .tlm."""
    from tinyloop import default
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    cache = blocker / "tinyloop"                      # under a regular file: cannot be made
    with pytest.raises(errors.FileWriteError, match="cache folder") as info:
        default.cached_conversion(tiny_gguf[0], str(cache), recurrent=(1, 3))
    assert info.value.filename == str(cache) and info.value.errno == errno.ENOTDIR
    cache = tmp_path / "cache"
    real_open = open
    monkeypatch.setattr(fileio, "open", lambda fd, *a, **k: _FailingFile(
        real_open(fd, *a, **k), 1000, OSError(errno.ENOSPC, "No space left on device")),
        raising=False)
    with pytest.raises(errors.FileWriteError) as info:
        default.cached_conversion(tiny_gguf[0], str(cache), recurrent=(1, 3))
    assert os.path.dirname(info.value.filename) == str(cache)
    assert _listing(cache) == []
    monkeypatch.undo()
    dst = default.cached_conversion(tiny_gguf[0], str(cache), recurrent=(1, 3))
    assert _listing(cache) == [os.path.basename(dst)]


def test_load_prefix_os_errors_name_the_file(model, tmp_path, monkeypatch):
    """load_prefix raises the file system's OSError unchanged, naming the path it was given,
    also for a read that fails after the open."""
    import tinyloop.tlpx as tlpx
    with pytest.raises(FileNotFoundError) as info:
        model.load_prefix(tmp_path / "missing.tlpx")
    assert info.value.filename == str(tmp_path / "missing.tlpx")
    with pytest.raises(IsADirectoryError):
        model.load_prefix(tmp_path)
    path = tmp_path / "p.tlpx"
    with model.prefill([3, 4, 5], depth=1) as h:
        h.save(path)
    before = get_pool("host").stats().allocated_bytes
    real_open = tlpx.open_regular

    class FailingRead(_FileProxy):
        def read(self, n=-1):
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tlpx, "open_regular", lambda p: FailingRead(real_open(p)))
    with pytest.raises(OSError) as info:
        model.load_prefix(path)
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    assert get_pool("host").stats().allocated_bytes == before
