"""Export a pool's layout and event log in the snapshot format of PyTorch's memory viewer.

The result of ``pool_snapshot`` has the shape of ``torch.cuda.memory._snapshot()``, so the file
written by ``export_snapshot`` opens in https://pytorch.org/memory_viz (drag the .pickle in) and
in ``python -m torch.cuda._memory_viz``:

- ``segments``: one dict per segment (``device``, ``address``, ``total_size``, ``stream`` 0,
  ``segment_type`` "small" | "large", ``allocated_size``, ``active_size``, ``requested_size``,
  ``blocks``); the ``blocks`` of a segment tile it exactly, in address order, each with
  ``address``, ``size``, ``requested_size``, ``state`` ("active_allocated" | "inactive"),
  ``frames`` [] and ``category`` (the tag; None for a free range).
- ``device_traces``: one list per device index; ours holds the event log as dicts with
  ``action`` (alloc, free_requested, free_completed, segment_alloc, segment_free), ``addr``,
  ``size``, ``stream`` 0, ``frames`` [], ``time_us`` and ``category`` (the tag). OOM and limit
  events stay in ``MemoryPool.events()`` (the viewer's "oom" entries need fields we do not
  have, and it has no limit entry), as do the events' size class, cause and request.
"""

from __future__ import annotations

import pickle

from ..fileio import atomic_write

TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")


def pool_snapshot(pool) -> dict:
    """The snapshot dict of ``pool`` (a ``MemoryPool``) now."""
    dev = pool.device_index
    segments = []
    for seg in pool.layout():
        blocks = [{"address": b["address"], "size": b["size"],
                   "requested_size": b["requested_bytes"],
                   "state": "active_allocated" if b["live"] else "inactive",
                   "frames": [], "category": b["tag"]} for b in seg["blocks"]]
        live = sum(b["size"] for b in seg["blocks"] if b["live"])
        segments.append({"device": dev, "address": seg["address"], "total_size": seg["size"],
                         "stream": 0, "segment_type": seg["kind"], "segment_pool_id": (0, 0),
                         "allocated_size": live, "active_size": live,
                         "requested_size": sum(b["requested_bytes"] for b in seg["blocks"]),
                         "is_expandable": False, "frames": [], "blocks": blocks})
    trace = [{"action": e.action, "addr": e.address, "size": e.size, "stream": 0, "frames": [],
              "time_us": int(e.time * 1e6), "category": e.tag}
             for e in pool.events() if e.action in TRACE_ACTIONS]
    device_traces = [[] for _ in range(dev + 1)]
    device_traces[dev] = trace
    return {"segments": segments, "device_traces": device_traces,
            "allocator_settings": {"tinyloop_device": pool.device,
                                   "events_dropped": pool.events_dropped}}


def write_snapshot(pool, path) -> dict:
    """Pickle ``pool_snapshot(pool)`` to ``path`` (protocol 4, written atomically through
    ``fileio.atomic_write``; FileWriteError naming ``path`` on a file-system failure) and
    return the dict."""
    snap = pool_snapshot(pool)
    with atomic_write(path, "the memory snapshot") as f:
        pickle.dump(snap, f, protocol=4)
    return snap
