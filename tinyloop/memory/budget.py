"""The pool's budget: what a memory limit may be, and the out-of-memory error it raises.

Wraps the arena the way RMM's limiting adaptor wraps a resource: the pool asks here only on the
slow path (a new segment, ``set_limit``), never per allocation.
"""

from __future__ import annotations

import operator

from ..config import parse_size
from ..errors import ConfigError, OutOfMemoryError
from .arena import ALIGNMENT
from .stats import fmt_bytes
from .tags import TAG_CAUSES


def check_limit(limit, total_bytes: int | None) -> int | None:
    """``limit`` as bytes: an int >= 0, a size string ("2G", "50%" of ``total_bytes``), or None
    (no cap). Raises ConfigError naming the bad value.

    The pool counts memory in blocks of ALIGNMENT = 512 bytes, so the limit is rounded up to a
    multiple of 512: a single request of exactly the limit then fits an empty pool (its block
    is the limit rounded up the same way, and a request that cannot have its whole 2 MiB
    segment gets a segment of exactly its rounded size)."""
    if isinstance(limit, str):
        limit = parse_size(limit, name="memory limit", total_bytes=total_bytes)
    elif limit is None:
        return None
    elif isinstance(limit, bool) or not hasattr(limit, "__index__"):
        raise ConfigError(f"memory limit must be an int number of bytes, a size string "
                          f"like '2G' or '50%', or None; got {limit!r}")
    limit = operator.index(limit)
    if limit < 0:
        raise ConfigError(f"memory limit must be >= 0 bytes, got {limit}")
    return -(-limit // ALIGNMENT) * ALIGNMENT          # up to whole 512-byte blocks


def crosses(limit: int | None, reserved_bytes: int, segment_bytes: int) -> bool:
    """Whether a new ``segment_bytes`` segment would take reserved bytes past ``limit``."""
    return limit is not None and reserved_bytes + segment_bytes > limit


def oom_hint(tag: str, by_tag: dict) -> str:
    """The sentence an out-of-memory error adds when a tag of :data:`TAG_CAUSES` is the one
    being allocated or holds bytes: what those bytes are and the setting that avoids them;
    "" otherwise. ``by_tag``: tag -> live bytes."""
    parts = []
    for t, cause in TAG_CAUSES.items():
        if t == tag or by_tag.get(t, 0):
            parts.append(f"tag {t!r} holds {fmt_bytes(by_tag.get(t, 0))}"
                         + (" and asked for more" if t == tag else "") + f": {cause}")
    return "; ".join(parts)


def out_of_memory(device: str, nbytes: int, rounded: int, tag: str, reasons: list[str], *,
                  allocated_bytes: int, reserved_bytes: int, limit_bytes: int | None,
                  device_free_bytes: int | None, by_tag: dict | None = None) -> OutOfMemoryError:
    """The OutOfMemoryError for a request of ``nbytes`` (``rounded`` in the pool) under ``tag``:
    the message names the request, each refusal in ``reasons`` and the pool's figures (the
    host pool's driver figure is host memory), and, when a tag one can switch off (``fp16_cache``)
    is asked for or holds bytes in ``by_tag`` (tag -> live bytes), the cause and the setting
    that avoids it (:func:`oom_hint`)."""
    hint = oom_hint(tag, by_tag or {})
    return OutOfMemoryError(
        f"out of memory on {device}: cannot allocate {rounded} bytes "
        f"({fmt_bytes(rounded)}; requested {nbytes}) for tag {tag!r}: {'; '.join(reasons)}. "
        f"allocated {fmt_bytes(allocated_bytes)}, reserved {fmt_bytes(reserved_bytes)}, "
        f"limit {'none' if limit_bytes is None else fmt_bytes(limit_bytes)}, "
        f"{'device' if device == 'cuda' else 'host memory'} free "
        f"{'unknown' if device_free_bytes is None else fmt_bytes(device_free_bytes)}"
        + (f". Cause: {hint}" if hint else ""),
        requested_bytes=nbytes, tag=tag, allocated_bytes=allocated_bytes,
        reserved_bytes=reserved_bytes, limit_bytes=limit_bytes,
        device_free_bytes=device_free_bytes, device=device)
