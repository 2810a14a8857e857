"""Memory tags: every allocation says what it is for, explicitly or through ``tag_scope``."""

from __future__ import annotations

import contextlib
import threading

from ..errors import ConfigError

TAGS = ("weights", "fp16_cache", "buffers", "logits", "kv_cache", "prefix_cache", "resume",
        "scratch", "cupy", "graphs", "other")

# What a tag's bytes are and how to go without them, for the out-of-memory error and
# memory_report(): the tags a user can switch off.
TAG_CAUSES = {
    "fp16_cache": "dequantized weight copies for the GEMMs (float32 on the NumPy backend, where "
                  "they are on by default and take several times the quantized weights); set "
                  "TINYLOOP_FP16_CACHE=0 to load without them (on the NumPy backend "
                  "decode is then many times slower: the README gives the measured factor)",
}

_tls = threading.local()      # per thread: .tags, the stack of active tag_scope tags


def check_tag(tag: str) -> str:
    """Return ``tag`` if it is one of TAGS; else raise ConfigError naming it."""
    if tag not in TAGS:
        raise ConfigError(f"unknown memory tag {tag!r}; expected one of {TAGS}")
    return tag


def current_tag() -> str:
    """The innermost ``tag_scope`` tag of this thread, or "other"."""
    stack = getattr(_tls, "tags", None)
    return stack[-1] if stack else "other"


@contextlib.contextmanager
def tag_scope(tag: str):
    """Allocations in this thread without an explicit tag get ``tag`` inside the block."""
    check_tag(tag)
    stack = getattr(_tls, "tags", None)
    if stack is None:
        stack = _tls.tags = []
    stack.append(tag)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def packed_scope():
    """Allocations in this thread go to the pool's "large" size class whatever their size
    (exact splits in shared segments), inside the block.

    The model's own tensors and the paged KV cache use it: all of them are made in sizes the
    plan knows (whole segments reserved at load, fixed-size pages after), so packing them in
    one class leaves one partly used segment instead of one per class and per tensor."""
    depth = getattr(_tls, "packed", 0)
    _tls.packed = depth + 1
    try:
        yield
    finally:
        _tls.packed = depth


def packed() -> bool:
    return getattr(_tls, "packed", 0) > 0
