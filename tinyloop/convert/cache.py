"""One conversion cache entry: a .tlm file under the cache folder, made once per source.

The GGUF default model (``tinyloop.default``) and Hugging Face folders (``convert.hf``) both
convert into ``config.cache_dir()`` under a name keyed by the source's content and the
conversion options; this is the shared check-then-build step.
"""

from __future__ import annotations

import os

from ..errors import FormatError
from ..fileio import wrap_os_error


def cached_tlm(dst: str, cache: str, build) -> str:
    """``dst`` when a readable .tlm is there (a damaged one is rebuilt), else ``build(dst)``
    (which writes it atomically) after making the ``cache`` folder. Returns ``dst``. Raises
    FileWriteError (an OSError) naming the cache folder when it cannot be made, and what
    ``build`` raises."""
    from ..format import read_tlm
    if os.path.isfile(dst):
        try:
            read_tlm(dst).close()
            return dst
        except FormatError:
            pass                     # a damaged cache entry: rebuilt below
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise wrap_os_error(e, cache, "the cache folder", "create") from e
    build(dst)
    return dst
