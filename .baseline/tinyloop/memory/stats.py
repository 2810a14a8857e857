"""``MemoryStats``: one pool's figures at one moment, and the report table that renders them.

The three figures a user must not confuse (docs/architecture.md, "why a runtime
keeps memory after a request"):
allocated bytes (live blocks), reserved bytes (segments the pool holds: live or cached for
reuse), and the driver's device-free bytes. A footprint whose *reserved* high-water mark is
stable across identical requests is caching; one whose *allocated* bytes grow with every
identical request is a leak.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from .tags import TAG_CAUSES

# The device bytes outside the pool that the report names, each measured with NVML when it is
# taken (MemoryPool.measure_driver), with what the measurement spans.
DRIVER_LINES = {
    "cuda context": "at pool creation",
    "kernel modules": "at load / 1st launch",
    "cublas workspace": "at 1st cuBLAS call",
    "cuda graphs": "at instantiate / destroy",
}


def fmt_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"n/a"``. Binary units, as the limit parser uses."""
    if n is None:
        return "n/a"
    sign, n = ("-", -n) if n < 0 else ("", n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n} B" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class MemoryStats:
    """A pool's figures (all sizes in bytes). Made by ``tinyloop.memory_stats()``.

    - ``allocated_bytes``: live blocks, after 512-byte rounding; ``requested_bytes``: before.
    - ``reserved_bytes``: segments the pool holds from the raw allocator (live + cached);
      ``pool_free_bytes = reserved_bytes - allocated_bytes``.
    - ``device_free_bytes`` / ``device_total_bytes``: the driver's view (cudaMemGetInfo), or
      the host's available / total memory on the host pool; None if unknown.
    - ``process_bytes``: what the driver says this process uses (NVML on cuda, VmRSS on the
      host), None if unknown; ``nvml_process_bytes``: NVML's figure (None without pynvml).
    - ``driver_bytes``: label -> device bytes the driver gave this process outside the pool,
      measured with NVML when they were taken (:data:`DRIVER_LINES`: the CUDA context, kernel
      modules, the cuBLAS workspace, CUDA graphs); empty off CUDA or without NVML.
    - ``unattributed_bytes = process_bytes - reserved_bytes - sum(driver_bytes)``: what no
      line names (on CUDA within NVML's granularity of 0 once every use is measured). On the
      host it is the interpreter and libraries, and may be negative: reserved host pages are
      not resident until touched.
    - ``by_tag`` / ``peak_by_tag``: tag -> live bytes now / at their high-water mark.
    - ``largest_free_block_bytes`` and ``external_fragmentation = 1 - largest free block /
      pool_free_bytes`` (0 with no free bytes): how unusable the cached bytes are for one
      big request.
    """

    device: str
    device_index: int
    allocated_bytes: int
    requested_bytes: int
    reserved_bytes: int
    pool_free_bytes: int
    device_free_bytes: int | None
    device_total_bytes: int | None
    process_bytes: int | None
    nvml_process_bytes: int | None
    limit_bytes: int | None
    by_tag: dict = field(default_factory=dict)
    peak_by_tag: dict = field(default_factory=dict)
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_allocs: int = 0
    num_frees: int = 0
    num_segment_allocs: int = 0
    num_segment_releases: int = 0
    num_ooms: int = 0
    num_alloc_retries: int = 0
    active_blocks: int = 0
    segments: int = 0
    largest_free_block_bytes: int = 0
    external_fragmentation: float = 0.0
    driver_bytes: dict = field(default_factory=dict)

    @property
    def unattributed_bytes(self) -> int | None:
        if self.process_bytes is None:
            return None
        return self.process_bytes - self.reserved_bytes - sum(self.driver_bytes.values())

    def report(self) -> str:
        return format_report(self)


def format_report(s: MemoryStats) -> str:
    """The table ``tinyloop.memory_report()`` prints."""
    name = f"{s.device}:{s.device_index}" if s.device == "cuda" else s.device
    rows = [
        ("allocated (live blocks)", s.allocated_bytes, s.peak_allocated_bytes),
        ("requested (before 512 B rounding)", s.requested_bytes, None),
        ("reserved (segments held by the pool)", s.reserved_bytes, s.peak_reserved_bytes),
        ("pool free (reserved - allocated)", s.pool_free_bytes, None),
        ("largest free block", s.largest_free_block_bytes, None),
        ("limit (TINYLOOP_MEMORY_LIMIT / set_memory_limit)", s.limit_bytes, None),
    ]
    if s.device == "cuda":
        rows += [("device free (driver)", s.device_free_bytes, None),
                 ("device total (driver)", s.device_total_bytes, None),
                 ("process usage (NVML)", s.process_bytes, None)]
        if s.process_bytes is not None:
            rows += [(f"{label} (NVML {when})", s.driver_bytes.get(label, 0), None)
                     for label, when in DRIVER_LINES.items()]
        rows += [("unattributed (process - reserved - the lines above)",
                  s.unattributed_bytes, None)]
    else:       # the host pool: the driver's figures are the host's memory
        rows += [("host memory free (MemAvailable)", s.device_free_bytes, None),
                 ("host memory total", s.device_total_bytes, None),
                 ("process usage (RSS, host memory)", s.process_bytes, None),
                 ("unattributed (RSS - reserved: interpreter, libraries)",
                  s.unattributed_bytes, None)]
    w = 56
    lines = [f"TinyLoop memory on {name}".ljust(w) + f"{'now':>12}{'peak':>12}"]
    for label, now, peak in rows:
        now_s = "none" if (now is None and label.startswith("limit")) else fmt_bytes(now)
        lines.append(f"  {label}".ljust(w) + f"{now_s:>12}"
                     + (f"{fmt_bytes(peak):>12}" if peak is not None else ""))
    if s.process_bytes is None:
        lines.append("  (process usage unknown: " + ("install pynvml (nvidia-ml-py) to see it"
                                                     if s.device == "cuda" else
                                                     "no /proc/self/status") + ")")
    lines.append(f"  external fragmentation {s.external_fragmentation:.3f} (1 - largest free "
                 f"block / pool free: the share of the free bytes one request cannot get in "
                 f"one piece), {s.active_blocks} live blocks in {s.segments} segments")
    lines.append("  by tag".ljust(w) + f"{'now':>12}{'peak':>12}")
    for tag in s.by_tag:
        if s.by_tag[tag] or s.peak_by_tag.get(tag):
            lines.append(f"    {tag}".ljust(w) + f"{fmt_bytes(s.by_tag[tag]):>12}"
                         f"{fmt_bytes(s.peak_by_tag.get(tag, 0)):>12}")
            if s.by_tag[tag] and tag in TAG_CAUSES:
                lines += textwrap.wrap(TAG_CAUSES[tag], 90, initial_indent="      (",
                                       subsequent_indent="       ")
                lines[-1] += ")"
    lines.append(f"  counts: {s.num_allocs} allocs, {s.num_frees} frees, "
                 f"{s.num_segment_allocs} segment allocs, {s.num_segment_releases} releases, "
                 f"{s.num_alloc_retries} retries, {s.num_ooms} OOMs")
    return "\n".join(lines)
