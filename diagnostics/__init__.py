"""TinyLoop diagnostics: is the memory a process keeps after a request a leak, a cache, or
fragmentation? Measured, not guessed (docs/architecture.md, "why a runtime keeps memory after
a request").

    python -m diagnostics leak     [--requests N] [--out DIR] [--backend B] [--plant-leak BYTES]
                                   [--plant-cache BYTES] [--model PATH] [--max-new-tokens M]
                                   [--prompt TEXT]
    python -m diagnostics fragment [--requests N] [--out DIR] [--seed S] ...
    python -m diagnostics release  [--out DIR] ...
    python -m diagnostics report   DIR

``leak`` exits with its verdict's code (``EXIT_CODES``: 0 STABLE or BOUNDED CACHE, FILLING;
3 LEAK; 4 UNBOUNDED CACHE; 5 INCONCLUSIVE; 1 an error), so a CI job can gate on it.

Modules: ``verdict`` (the pure verdict function over per-request records), ``leak``,
``fragment``, ``release`` (the three runs), ``replay`` (a recorded trace through TinyLoop's
own pool class, and CuPy's allocators), ``faults`` (planted leak / cache), ``records``
(one dict per step; JSON / CSV), ``plots`` (PNG, matplotlib Agg), ``report`` (one-page HTML),
``session`` (model loading, progress, the event-log collector).
"""

from __future__ import annotations

from .fragment import analyze_trace, run_fragment
from .leak import run_leak
from .release import run_release
from .replay import ReplayDiverged, replay_policies, replay_trace, trace_ops
from .report import write_report
from .verdict import (BOUNDED_CACHE_FILLING, EXIT_CODES, INCONCLUSIVE, LEAK, STABLE,
                      UNBOUNDED_CACHE, VERDICTS, Verdict, classify, linear_fit)

__all__ = ["run_leak", "run_fragment", "run_release", "write_report", "classify", "Verdict",
           "linear_fit", "analyze_trace", "trace_ops", "replay_policies", "replay_trace",
           "ReplayDiverged", "STABLE", "LEAK",
           "UNBOUNDED_CACHE", "BOUNDED_CACHE_FILLING", "INCONCLUSIVE", "VERDICTS", "EXIT_CODES"]
