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


def oom_hint(tag: str, by_tag: dict, shortfall: int = 0) -> str:
    """The sentence an out-of-memory error adds for a tag of :data:`TAG_CAUSES` (the tags one
    can switch off): what its bytes are and the setting that avoids them, when that tag is the
    one being allocated, or when it holds at least ``shortfall`` bytes (going without it would
    make the request fit); "" otherwise. ``by_tag``: tag -> live bytes."""
    parts = []
    for t, cause in TAG_CAUSES.items():
        held = by_tag.get(t, 0)
        if t == tag or (held and held >= shortfall):
            parts.append(f"tag {t!r} holds {fmt_bytes(held)}"
                         + (" and asked for more" if t == tag else "") + f": {cause}")
    return "; ".join(parts)


def _free_word(device: str) -> str:
    return {"cuda": "device", "host": "host memory"}.get(device, f"{device} device")


def out_of_memory(device: str, nbytes: int, rounded: int, tag: str, reasons: list[str], *,
                  allocated_bytes: int, reserved_bytes: int, limit_bytes: int | None,
                  device_free_bytes: int | None, largest_free_bytes: int = 0,
                  free_segment_bytes: int = 0, n: int = 1, fitted: int = 0,
                  by_tag: dict | None = None) -> OutOfMemoryError:
    """The OutOfMemoryError for ``n`` blocks of ``nbytes`` (``rounded`` each in the pool)
    under ``tag``, of which ``fitted`` had found room when the next did not.

    The message names the request (a batch: its block count and total), the pool's largest
    free range (``largest_free_bytes``: no free range holds the request, which is why a new
    segment was needed), each refusal of a new segment in ``reasons``, the room the limit
    leaves for one (the limit minus the segments that hold live blocks: ``reserved_bytes -
    free_segment_bytes``) and the pool's figures (the host pool's driver figure is host
    memory), and, when a tag one can switch off (``fp16_cache``) is asked for or holds enough
    to make the request fit, the cause and the setting that avoids it (:func:`oom_hint`)."""
    pool_free = reserved_bytes - allocated_bytes
    pinned = reserved_bytes - free_segment_bytes
    room = None if limit_bytes is None else max(0, limit_bytes - pinned)
    free = (f"the largest free range is {fmt_bytes(largest_free_bytes)} "
            f"({largest_free_bytes} bytes) of {fmt_bytes(pool_free)} free")
    if n == 1:
        what = (f"cannot allocate {rounded} bytes ({fmt_bytes(rounded)}; requested {nbytes}) "
                f"for tag {tag!r}: no free range of the pool holds it ({free})")
    else:
        what = (f"cannot allocate a batch of {n} blocks of {rounded} bytes "
                f"({fmt_bytes(rounded * n)} in all; requested {nbytes} each) for tag {tag!r}: "
                f"the pool's free ranges and new segments held {fitted} of them ({free} "
                f"without the batch)")
    why = "and no new segment can be had"
    if room is not None:
        why += (f" (the limit leaves {fmt_bytes(room)} = {room} bytes for new segments: limit "
                f"{limit_bytes} - {pinned} bytes of segments holding live blocks)")
    shortfall = rounded * (n - fitted) - max(largest_free_bytes, room or 0)
    hint = oom_hint(tag, by_tag or {}, shortfall)
    return OutOfMemoryError(
        f"out of memory on {device}: {what}, {why}: {'; '.join(reasons)}. "
        f"allocated {fmt_bytes(allocated_bytes)}, reserved {fmt_bytes(reserved_bytes)}, "
        f"limit {'none' if limit_bytes is None else fmt_bytes(limit_bytes)}, "
        f"{_free_word(device)} free "
        f"{'unknown' if device_free_bytes is None else fmt_bytes(device_free_bytes)}"
        + (f". Cause: {hint}" if hint else ""),
        requested_bytes=nbytes * n, tag=tag, allocated_bytes=allocated_bytes,
        reserved_bytes=reserved_bytes, limit_bytes=limit_bytes,
        device_free_bytes=device_free_bytes, device=device, blocks=n,
        largest_free_bytes=largest_free_bytes, room_bytes=room)


def plan_room(*, allocated_bytes: int, reserved_bytes: int, limit_bytes: int | None,
              device: str, device_free_bytes: int | None) -> int | None:
    """The most bytes a set of new blocks can take: the limit minus the live blocks, and on
    CUDA at most the driver's free bytes plus the pool's own free bytes. None: no bound known.
    An upper bound (it assumes perfect packing into the pool's free ranges), so a plan above
    it cannot fit whatever the order of its allocations."""
    room = None if limit_bytes is None else limit_bytes - allocated_bytes
    # host pages are committed when touched, so MemAvailable is no bound for a reservation
    if device == "cuda" and device_free_bytes is not None:
        dev = device_free_bytes + reserved_bytes - allocated_bytes
        room = dev if room is None else min(room, dev)
    return None if room is None else max(0, room)


def plan_out_of_memory(device: str, what: str, phases: list, room: int, *,
                       allocated_bytes: int, reserved_bytes: int, limit_bytes: int | None,
                       device_free_bytes: int | None) -> OutOfMemoryError:
    """The OutOfMemoryError of a plan that cannot fit, raised before any of it is allocated.

    ``phases``: ``(label, tag, nbytes)`` in allocation order (nbytes rounded as the pool
    rounds); ``room``: :func:`plan_room`. The phase that does not fit is the one where the
    running total passes ``room``: the error carries its tag, and the hint of a tag of
    :data:`TAG_CAUSES` (the FP16 caches' setting) only when it is that phase."""
    total = sum(b for _, _, b in phases)
    run, miss = 0, len(phases) - 1
    for i, (_, _, b) in enumerate(phases):
        run += b
        if run > room:
            miss = i
            break
    tag = phases[miss][1] if phases else "other"
    table = ", ".join(f"{label} {fmt_bytes(b)} = {b}" for label, _, b in phases)
    bound = []
    if limit_bytes is not None:
        bound.append(f"the {fmt_bytes(limit_bytes)} limit minus {fmt_bytes(allocated_bytes)} "
                     f"of live blocks")
    if device == "cuda" and device_free_bytes is not None:
        bound.append(f"{fmt_bytes(device_free_bytes)} device free plus "
                     f"{fmt_bytes(reserved_bytes - allocated_bytes)} free in the pool")
    label, _, _ = phases[miss] if phases else ("", "", 0)
    hint = (f"the {label} phase (tag {tag!r}) is what does not fit: {TAG_CAUSES[tag]}"
            if tag in TAG_CAUSES else "")
    return OutOfMemoryError(
        f"out of memory on {device}: {what} needs {fmt_bytes(total)} ({total} bytes: {table}) "
        f"but there is room for {fmt_bytes(room)} ({room} bytes: {' and '.join(bound)}), "
        f"{total - room} bytes short from the {label} phase on (tag {tag!r}); nothing was "
        f"allocated. allocated {fmt_bytes(allocated_bytes)}, reserved "
        f"{fmt_bytes(reserved_bytes)}, limit "
        f"{'none' if limit_bytes is None else fmt_bytes(limit_bytes)}, {_free_word(device)} "
        f"free {'unknown' if device_free_bytes is None else fmt_bytes(device_free_bytes)}"
        + (f". Cause: {hint}" if hint else ""),
        requested_bytes=total, tag=tag, allocated_bytes=allocated_bytes,
        reserved_bytes=reserved_bytes, limit_bytes=limit_bytes,
        device_free_bytes=device_free_bytes, device=device, room_bytes=room)
