"""Atomic file writes: every file TinyLoop writes (.tlm models, the default model's cached
conversion, .tlpx prefix files, pool snapshots) goes through :func:`atomic_write`.

A write goes to a fresh temporary file in the destination's folder, created exclusively
(``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name, so a file or symlink planted there is
never followed or overwritten, and two writers never share one), is flushed and fsynced, then
renamed over the destination with ``os.replace`` (atomic on POSIX: a reader opens either the
old complete file or the new one), and the folder is fsynced so the rename survives a crash.
On any failure -- an OSError, any other exception, KeyboardInterrupt -- the temporary file is
removed and the destination is untouched. OS errors surface as
:class:`~tinyloop.errors.FileWriteError` naming the destination, not the temporary name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from .errors import FileWriteError, TinyLoopError


class NotRegularFileError(OSError):
    """:func:`open_regular` met a FIFO, a folder, a device or a socket (``filename``: the
    path)."""


def open_regular(path):
    """``open(path, "rb")`` for a regular file only. The open is non-blocking, since a FIFO's
    would wait for a writer, and the descriptor is then fstat'ed, so the check and the read
    see one file. Raises IsADirectoryError for a folder (as ``open`` does), NotRegularFileError
    (an OSError, "not a regular file") for a FIFO, device or socket, and the file system's
    OSError unchanged."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, "not a regular file", path)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


TEMP_SUFFIX = ".tmp"
_TEMP_TRIES = 100
# fsync of a folder: file systems that cannot do it answer one of these; anything else counts
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM}


def temp_name(path: str) -> str:
    """A fresh temporary name beside ``path``: ``.<name>.<16 hex digits>.tmp`` (hidden, so
    globs of the destination's pattern never match it)."""
    folder, base = os.path.split(path)
    return os.path.join(folder, f".{base}.{secrets.token_hex(8)}{TEMP_SUFFIX}")


def _create_temp(path: str) -> tuple[int, str]:
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    for _ in range(_TEMP_TRIES):
        tmp = temp_name(path)
        try:
            return os.open(tmp, flags, 0o666), tmp      # the umask applies, as for open()
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", path)


def wrap_os_error(e: OSError, path: str, what: str, action: str = "write") -> FileWriteError:
    """A FileWriteError for ``e`` naming ``path``: "cannot <action> <what>: <strerror>"
    (``what``: "the model file", ...)."""
    if e.errno is None:
        err = FileWriteError(f"cannot {action} {what} {path!r}: {e}")
        err.filename = path
        return err
    reason = e.strerror or os.strerror(e.errno)
    return FileWriteError(e.errno, f"cannot {action} {what}: {reason}", path)


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return                                 # no directory handles here (e.g. Windows)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _unlink_quiet(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def atomic_write(path, what: str = "the file"):
    """``with atomic_write(path) as f: f.write(...)``: ``path`` gets the bytes written to the
    binary file object ``f`` all at once when the block ends, or keeps its old content.

    ``what`` names the file in error messages. Raises FileWriteError (an OSError and a
    TinyLoopError; ``filename`` is ``path``, ``__cause__`` the OS error) for a failure of the
    file system: the destination is a directory, its folder is missing or read-only, the
    disk is full, the file-size limit is hit, fsync or the rename fails. An exception from the
    block propagates unchanged (OSErrors wrapped). Either way no temporary file is left."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise FileWriteError(errno.EISDIR, f"cannot write {what}: the destination is a "
                                           f"directory", path)
    try:
        fd, tmp = _create_temp(path)
    except OSError as e:
        raise wrap_os_error(e, path, what) from e
    try:
        f = open(fd, "wb", closefd=True)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _unlink_quiet(tmp)
        if isinstance(e, OSError) and not isinstance(e, TinyLoopError):
            raise wrap_os_error(e, path, what) from e
        raise
    try:
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise wrap_os_error(e, path, what) from e


def write_bytes(path, chunks, what: str = "the file") -> int:
    """Write the bytes-like ``chunks`` (an iterable) to ``path`` through :func:`atomic_write`;
    returns the bytes written. Raises as atomic_write."""
    n = 0
    with atomic_write(path, what) as f:
        for c in chunks:
            n += f.write(c)
    return n
