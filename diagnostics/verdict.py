"""The leak verdict: a pure function over per-request records (no model, no pool, no I/O).

Input: the records of N identical requests, in order, each a mapping with at least
``allocated_bytes`` and ``reserved_bytes`` taken at the end of the request; optionally
``peak_reserved_bytes`` (the request's own high-water mark), ``by_tag`` (tag -> bytes),
``request`` (its number, 1-based; the position in the list otherwise) and, for a cache that
accounts for what it holds (a PrefixPool), ``cache_bytes`` (its ``stats()["bytes"]``, equal to
its tag ``cache_tag``), ``cache_budget_bytes`` (the budget it declares; None: none) and
``cache_evictions`` (its running eviction count). The verdict reads only these records: how a
run was configured decides nothing.

The rule (docs/architecture.md, "why a runtime keeps memory after a request": a stable
high-water mark is caching, a footprint that grows with every identical request is a leak or
an unbounded cache):

1. The first ``warmup`` requests (default: max(1, N // 10)) are skipped by the fits: the first
   request allocates what the model makes lazily (the logit row) and reserves its KV segment.
2. A series *keeps growing* when its least-squares slope is positive, adds at least
   ``min_growth_bytes`` over the window, and is at least ``t_threshold`` standard errors from 0
   -- both over the whole window and over its second half (growth that stopped is not growth)
   -- and the mean of each quarter of the window exceeds the one before (a single step is not
   growth that keeps going).
3. With an accounting cache in the records, in this order:
   LEAK if the cache ever holds more than its declared budget, or if allocated minus the
   cache's bytes keeps growing (the rate is that slope; the tag the fastest-growing other
   one); UNBOUNDED CACHE if no budget is declared and the cache keeps growing; BOUNDED CACHE,
   FILLING if a budget is declared and the cache, not yet full, holds more than at the start
   of the window (the figures: held of budget); once full (its eviction count rises, or
   without that count: its bytes come within its largest step of the budget) the records from
   the fill on are judged by rules 4-7 alone, so a plateau at the budget is STABLE.
4. LEAK: allocated bytes at request end grow. The rate is the slope over the window; the tag is
   the one whose bytes grow fastest.
5. UNBOUNDED CACHE: allocated does not grow, reserved (the high-water mark) does.
6. STABLE: allocated at request end and the high-water mark each settled -- stayed within
   their noise band (:func:`noise_band`; 512 bytes on an exact series) -- from request k on,
   for at least max(``min_plateau``, k) more requests, and allocated shows no trend.
7. INCONCLUSIVE otherwise, with the reason and an estimate of the requests that would decide:
   too few requests; a trend that is not yet ``t_threshold`` standard errors from 0 (the
   requests needed follow from the slope's standard error, sigma * sqrt(12 / m^3) for m
   evenly spaced points); or a footprint that changed too recently to call it settled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

STABLE = "STABLE"
LEAK = "LEAK"
UNBOUNDED_CACHE = "UNBOUNDED CACHE"
BOUNDED_CACHE_FILLING = "BOUNDED CACHE, FILLING"
INCONCLUSIVE = "INCONCLUSIVE"
VERDICTS = (STABLE, LEAK, UNBOUNDED_CACHE, BOUNDED_CACHE_FILLING, INCONCLUSIVE)
# ``python -m diagnostics leak`` exits with the verdict's code, so a CI job can gate on it like
# on a test run (1: an error, 2: bad arguments -- argparse's own code). A bounded cache still
# filling passes: its footprint stops at the budget it declares, and nothing else grows.
EXIT_CODES = {STABLE: 0, BOUNDED_CACHE_FILLING: 0, LEAK: 3, UNBOUNDED_CACHE: 4,
              INCONCLUSIVE: 5}

MIN_REQUESTS = 8          # warm-up + a window whose quarters have >= 1 point each
MIN_PLATEAU = 5           # requests the high-water mark must hold before we call it stable
T_THRESHOLD = 4.0         # standard errors a slope must be from 0 to count as growth
T_HINT = 2.0              # a slope this many standard errors from 0 is "a trend, not decided"
MIN_GROWTH_BYTES = 512    # the pool's rounding: less growth over a whole window is no growth


@dataclass(frozen=True)
class Fit:
    """Least-squares line ``y = intercept + slope * x`` over x = 0..n-1 (one per request).

    ``stderr`` is the slope's standard error (residual std * sqrt(1 / sum((x - mean)^2)));
    ``t`` = slope / stderr (inf for a nonzero slope on an exact line, 0 for a zero slope).
    """

    slope: float
    intercept: float
    stderr: float
    resid_std: float
    n: int

    @property
    def t(self) -> float:
        if self.slope == 0:
            return 0.0
        if self.stderr == 0:
            return math.copysign(math.inf, self.slope)
        return self.slope / self.stderr

    @property
    def total(self) -> float:
        """Growth the fitted line predicts across the window."""
        return self.slope * max(0, self.n - 1)


def linear_fit(y) -> Fit:
    """Least-squares slope (bytes per request) of ``y`` against its index."""
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        return Fit(0.0, float(y[0]) if n else 0.0, math.inf, 0.0, n)
    x = np.arange(n, dtype=np.float64)
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - ym)).sum() / sxx)
    intercept = float(ym - slope * xm)
    resid = y - (intercept + slope * x)
    # round-off on byte counts of ~1e9 leaves ~1e-7 residuals on an exact line: call it exact
    scale = max(1.0, float(np.abs(y).max()))
    ss = float((resid ** 2).sum())
    if n > 2 and math.sqrt(ss / n) > 1e-12 * scale:
        resid_std = math.sqrt(ss / (n - 2))
    else:
        resid_std = 0.0
    return Fit(slope, intercept, resid_std / math.sqrt(sxx), resid_std, n)


def points_needed(slope: float, resid_std: float, t_threshold: float = T_THRESHOLD) -> int:
    """Evenly spaced points m at which ``slope`` reaches ``t_threshold`` standard errors, given
    residual noise ``resid_std``: slope / (sigma * sqrt(12 / m^3)) >= t  <=>
    m >= (12 * (t * sigma / slope)^2)^(1/3)."""
    if slope == 0:
        return 0
    if resid_std == 0:
        return 3
    return max(3, math.ceil((12.0 * (t_threshold * resid_std / abs(slope)) ** 2) ** (1 / 3)))


@dataclass(frozen=True)
class Verdict:
    """What :func:`classify` concludes, and why. Rates are bytes per request."""

    verdict: str
    reason: str
    leak_bytes_per_request: float          # allocated-at-request-end slope over the window
    reserved_bytes_per_request: float      # high-water (reserved) slope over the window
    growing_tag: str | None = None
    tag_bytes_per_request: dict = field(default_factory=dict)
    stable_from: int | None = None         # request at which the high-water mark was reached
    cache_bytes_per_request: float = 0.0   # growth of a self-accounting cache (cache_bytes)
    cache_budget_bytes: int | None = None  # the budget the records declare for that cache
    cache_held_bytes: int | None = None    # what the cache holds after the last request
    cache_filled_at: int | None = None     # request at which the cache reached its budget
    requests_needed: int | None = None     # INCONCLUSIVE: about how many requests would decide
    warmup: int = 0
    evidence: list = field(default_factory=list)
    fits: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(n: float) -> str:
    sign, n = ("-", -n) if n < 0 else ("", float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def _fit_desc(f: Fit) -> str:
    t = "inf" if math.isinf(f.t) else f"{f.t:.1f}"
    return f"{_fmt(f.slope)}/request (+-{_fmt(f.stderr if math.isfinite(f.stderr) else 0)}, t={t})"


def classify(records, *, warmup: int | None = None, t_threshold: float = T_THRESHOLD,
             min_growth_bytes: float = MIN_GROWTH_BYTES, min_plateau: int = MIN_PLATEAU
             ) -> Verdict:
    """The verdict over per-request ``records`` (see the module docstring for the rule).

    Raises ValueError when a record lacks ``allocated_bytes`` or ``reserved_bytes``.
    """
    recs = list(records)
    n = len(recs)
    for i, r in enumerate(recs):
        if "allocated_bytes" not in r or "reserved_bytes" not in r:
            raise ValueError(f"record {i} has no allocated_bytes / reserved_bytes: {r!r}")
    numbers = [int(r.get("request", i + 1)) for i, r in enumerate(recs)]
    if n < MIN_REQUESTS:
        return Verdict(INCONCLUSIVE, f"only {n} request(s) recorded; the verdict needs at least "
                       f"{MIN_REQUESTS} (a warm-up request and a window of identical requests)",
                       0.0, 0.0, requests_needed=MIN_REQUESTS, warmup=0,
                       evidence=[f"{n} requests recorded"])
    w = max(1, n // 10) if warmup is None else max(0, min(int(warmup), n - 4))
    alloc = np.array([r["allocated_bytes"] for r in recs], dtype=np.float64)
    reserved = np.array([r["reserved_bytes"] for r in recs], dtype=np.float64)
    high = np.array([max(r["reserved_bytes"], r.get("peak_reserved_bytes") or 0)
                     for r in recs], dtype=np.float64)
    win_a, win_h = alloc[w:], high[w:]
    m = len(win_a)
    half = m // 2
    fa, fa_late = linear_fit(win_a), linear_fit(win_a[half:])
    fh, fh_late = linear_fit(win_h), linear_fit(win_h[half:])
    tags = sorted({t for r in recs for t in (r.get("by_tag") or {})})
    tag_rates = {t: linear_fit([(r.get("by_tag") or {}).get(t, 0) for r in recs[w:]]).slope
                 for t in tags}
    first, last = numbers[w], numbers[-1]

    def grows(f: Fit) -> bool:
        return f.slope > 0 and f.total >= min_growth_bytes * (f.n - 1) / max(1, m - 1) \
            and f.t >= t_threshold

    def keeps_growing(y) -> bool:
        """Significant growth over the window and its second half, and a higher mean in each
        quarter than in the one before (one step is not growth that keeps going)."""
        q = [float(part.mean()) for part in np.array_split(np.asarray(y), 4)]
        return (grows(linear_fit(y)) and grows(linear_fit(y[len(y) // 2:]))
                and all(b > a for a, b in zip(q, q[1:])))

    def hinted(f: Fit) -> bool:
        return f.slope > 0 and f.total >= min_growth_bytes and f.t >= T_HINT

    fits = {"allocated": asdict(fa), "allocated_late_half": asdict(fa_late),
            "high_water": asdict(fh), "high_water_late_half": asdict(fh_late)}
    evidence = [
        f"requests {numbers[0]}..{last}; fits over requests {first}..{last} "
        f"(the first {w} skipped as warm-up)",
        f"allocated at request end: {_fmt(alloc[w])} at request {first} -> {_fmt(alloc[-1])} "
        f"at request {last}; slope {_fit_desc(fa)}; second half {_fit_desc(fa_late)}",
        f"reserved high-water mark: {_fmt(high[w])} -> {_fmt(high[-1])}; slope {_fit_desc(fh)}; "
        f"second half {_fit_desc(fh_late)}",
        f"pool free (reserved - allocated) at request end: {_fmt(reserved[w] - alloc[w])} -> "
        f"{_fmt(reserved[-1] - alloc[-1])}",
    ]
    host = recs[0].get("device") not in (None, "cuda")   # records without one: both named
    for key, label in (("process_bytes", "host: process RSS (host memory)" if host
                        else "driver: process usage (NVML / RSS)"),
                       ("device_free_bytes", "host memory free" if host
                        else "driver: device free")):
        vals = [r.get(key) for r in recs[w:]]
        if all(v is not None for v in vals):
            evidence.append(f"{label} {_fmt(vals[0])} -> {_fmt(vals[-1])} "
                            f"(slope {_fmt(linear_fit(vals).slope)}/request; the driver's view "
                            f"moves with other processes and with pages touched, not with "
                            f"blocks freed)")
    common = dict(leak_bytes_per_request=fa.slope, reserved_bytes_per_request=fh.slope,
                  tag_bytes_per_request=tag_rates, warmup=w, fits=fits)

    # A cache that accounts for its bytes: records carry ``cache_bytes`` (and, where the cache
    # has one, its declared ``cache_budget_bytes``). Its growth is judged against its budget;
    # only what it does not account for can be a leak.
    cache = [r.get("cache_bytes") for r in recs]
    if all(c is not None for c in cache):
        cache_a = np.array(cache, dtype=np.float64)
        rest = alloc - cache_a
        fc, fr = linear_fit(cache_a[w:]), linear_fit(rest[w:])
        tag = next((r.get("cache_tag") for r in recs if r.get("cache_tag")), None)
        name = f"the cache (tag {tag!r})" if tag else "the cache"
        budgets = [r.get("cache_budget_bytes") for r in recs]
        budget = budgets[-1]
        evidence.append(f"{name} reports {_fmt(cache_a[w])} -> {_fmt(cache_a[-1])} held "
                        f"(slope {_fit_desc(fc)}); declared budget: "
                        + (_fmt(budget) if budget is not None else "none")
                        + f"; allocated minus the cache: {_fmt(rest[w])} -> {_fmt(rest[-1])} "
                        f"(slope {_fit_desc(fr)})")
        # the leak rate is what the cache does not account for (over a budget: all of it)
        cache_common = dict(common, leak_bytes_per_request=fr.slope,
                            cache_bytes_per_request=fc.slope, cache_budget_bytes=budget,
                            cache_held_bytes=int(cache_a[-1]))
        over = [i for i, (c, b) in enumerate(zip(cache, budgets)) if b is not None and c > b]
        if over:
            i = over[0]
            return Verdict(LEAK, f"{name} holds {_fmt(cache[i])} at request {numbers[i]}, "
                           f"over its declared budget of {_fmt(budgets[i])}: a budget the "
                           f"cache does not keep bounds nothing", growing_tag=tag,
                           evidence=evidence, **dict(cache_common,
                                                     leak_bytes_per_request=fa.slope))
        if keeps_growing(rest[w:]):
            growing = {t: s for t, s in tag_rates.items() if s > 0 and t != tag}
            leak_tag = max(growing, key=growing.get) if growing else tag
            return Verdict(LEAK, f"allocated bytes that {name} does not account for grow by "
                           f"{_fmt(fr.slope)} per request"
                           + (f", in tag {leak_tag!r}" if leak_tag else "")
                           + f" (least-squares fit over {m} requests; the cache itself "
                           f"{_fmt(fc.slope)}/request)", growing_tag=leak_tag,
                           evidence=evidence, **cache_common)
        if budget is None and keeps_growing(cache_a[w:]):
            return Verdict(UNBOUNDED_CACHE, f"allocated bytes grow by {_fmt(fa.slope)} per "
                           f"request, all of it held by a cache that accounts for it"
                           + (f" (tag {tag!r})" if tag else "")
                           + f", growing by {_fmt(fc.slope)} per request with no budget "
                           f"declared in the records: an unbounded cache, not a leak (give "
                           f"it a byte budget)", growing_tag=tag, evidence=evidence,
                           **cache_common)
        if budget is not None:
            f = _filled_at(recs, cache_a, budget)
            if f is None and cache_a[-1] > cache_a[w]:
                left = budget - cache_a[-1]
                eta = (f"; at {_fmt(fc.slope)}/request it is full in about "
                       f"{math.ceil(left / fc.slope)} more requests") if fc.slope > 0 else ""
                return Verdict(BOUNDED_CACHE_FILLING, f"bounded cache, filling: "
                               f"{_mib(cache_a[-1])} of {_mib(budget)} MiB held by {name} "
                               f"after request {last}{eta}; allocated minus the cache does "
                               f"not grow (it is no leak; the footprint stops at the budget)",
                               growing_tag=tag, evidence=evidence, **cache_common)
            if f is not None:
                return _after_fill(recs, f, numbers, name, tag, budget, evidence,
                                   cache_common, dict(warmup=warmup, t_threshold=t_threshold,
                                                      min_growth_bytes=min_growth_bytes,
                                                      min_plateau=min_plateau))

    # LEAK: allocated keeps growing
    if keeps_growing(win_a):
        growing = {t: s for t, s in tag_rates.items() if s > 0}
        tag = max(growing, key=growing.get) if growing else None
        if tag is not None:
            evidence.append("tags that grow: " + ", ".join(
                f"{t} {_fmt(s)}/request" for t, s in sorted(growing.items(), key=lambda x: -x[1])))
        return Verdict(LEAK, f"allocated bytes at the end of identical requests grow by "
                       f"{_fmt(fa.slope)} per request"
                       + (f", in tag {tag!r}" if tag else "")
                       + f" (least-squares fit over {m} requests)",
                       growing_tag=tag, evidence=evidence, **common)

    # UNBOUNDED CACHE: allocated flat, the reservation keeps growing
    if keeps_growing(win_h) and not hinted(fa_late):
        return Verdict(UNBOUNDED_CACHE, f"allocated bytes at request end are flat "
                       f"({_fmt(fa_late.slope)}/request over the second half) while the "
                       f"reservation keeps growing by {_fmt(fh.slope)} per request: cached "
                       f"free memory that is never reused or returned",
                       evidence=evidence, **common)

    # STABLE: both series settled (within their noise) by request k and held since
    k_a = settled_from(alloc, noise_band(win_a, min_growth_bytes))
    k_h = settled_from(high, noise_band(win_h, min_growth_bytes))
    k = max(k_a, k_h)
    held = n - 1 - k                                      # requests after k
    need = max(min_plateau, k + 1)
    tail = alloc[k:]
    spread = float(tail.max() - tail.min())
    evidence.append(f"high-water mark {_fmt(high[k:].max())} reached by request {numbers[k]} "
                    f"and not exceeded in the {held} requests after it")
    f_tail = linear_fit(alloc[max(k, w):])
    if spread == 0:
        evidence.append("allocated at request end identical from then on")
    else:
        evidence.append(f"allocated at request end varies within {_fmt(spread)} from then on "
                        f"(slope {_fit_desc(f_tail)})")
    if held >= need and not hinted(fa_late) and not hinted(f_tail):
        if spread:
            evidence.append(f"no trend in that noise: a leak above about "
                            f"{_fmt(t_threshold * f_tail.stderr)}/request would have shown")
        return Verdict(STABLE, f"the high-water mark ({_fmt(high[k:].max())} reserved) was "
                       f"reached by request {numbers[k]} and held for the {held} requests after "
                       f"it; allocated at request end does not grow: this is caching, not a leak",
                       stable_from=numbers[k], evidence=evidence, **common)

    # INCONCLUSIVE: a trend the noise hides, or a plateau too short to trust
    for name, f_all, f_late in (("allocated", fa, fa_late), ("reserved", fh, fh_late)):
        if hinted(f_all) or hinted(f_late) or grows(f_all) or grows(f_late):
            noisy = max(f_all.resid_std, f_late.resid_std)
            slope = max(f_all.slope, f_late.slope)
            m_needed = max(2 * points_needed(slope, noisy, t_threshold), m + min_plateau)
            if grows(f_all) and grows(f_late):
                why = (f"{name} bytes rose by about {_fmt(slope)}/request over the window, but "
                       f"in a step rather than in every quarter of it: growth that started late "
                       f"or is about to stop; more requests show which")
            else:
                why = (f"{name} bytes trend up by about {_fmt(slope)}/request (t={f_all.t:.1f} "
                       f"over the window, {f_late.t:.1f} over its second half), short of "
                       f"{t_threshold:g} standard errors in both halves: the per-request noise "
                       f"({_fmt(noisy)}) hides it, or the growth started or stopped mid-run")
            return Verdict(INCONCLUSIVE, why, requests_needed=w + m_needed,
                           evidence=evidence, **common)
    return Verdict(INCONCLUSIVE, f"the footprint last changed at request {numbers[k]}; {need} "
                   f"requests without a change are needed to call it stable, only {held} ran "
                   f"after it", stable_from=numbers[k], requests_needed=k + 1 + need,
                   evidence=evidence, **common)


def _filled_at(recs, cache, budget: int) -> int | None:
    """Index of the first record at which a cache with ``budget`` bytes is full: its
    ``cache_evictions`` count rose (the cache made room), or, in records without that count,
    its bytes came within its largest single growth step of the budget (the next entry would
    not fit). None while it is still filling."""
    ev = [r.get("cache_evictions") for r in recs]
    if all(e is not None for e in ev):
        return next((i for i in range(len(ev)) if ev[i] > ev[0]), None)
    steps = np.diff(cache)
    step = float(steps.max()) if len(steps) and steps.max() > 0 else 0.0
    if step == 0:
        return None
    return next((i for i, c in enumerate(cache) if c + step > budget), None)


def _after_fill(recs, f: int, numbers, name: str, tag, budget: int, evidence: list,
                common: dict, opts: dict) -> Verdict:
    """The verdict on a budgeted cache that filled at record ``f``: the footprint from then on
    is judged like any other (the cache's bytes stay within its budget, so what the records
    show from ``f`` on is the steady state), with the fill named in the reason."""
    tail = [{k: v for k, v in r.items() if not k.startswith("cache_")} for r in recs[f:]]
    opts = dict(opts, warmup=0)
    v = classify(tail, **opts)
    held = int(recs[-1]["cache_bytes"])
    ev = recs[-1].get("cache_evictions")
    filled = (f"{name} reached its {_fmt(budget)} budget at request {numbers[f]} and "
              + (f"has evicted {ev - (recs[0].get('cache_evictions') or 0)} entries since"
                 if ev is not None else "stays within it since")
              + f" ({_fmt(held)} held after request {numbers[-1]})")
    evidence = evidence + [filled] + [f"from request {numbers[f]} on: {e}" for e in v.evidence]
    rates = dict(leak_bytes_per_request=v.leak_bytes_per_request,
                 reserved_bytes_per_request=v.reserved_bytes_per_request,
                 tag_bytes_per_request=v.tag_bytes_per_request)
    common = dict(common, **rates, cache_filled_at=numbers[f])
    needed = None if v.requests_needed is None else f + v.requests_needed
    return Verdict(v.verdict, f"{filled}; from then on: {v.reason}",
                   growing_tag=v.growing_tag or (tag if v.verdict == LEAK else None),
                   stable_from=v.stable_from, requests_needed=needed,
                   evidence=evidence, **common)


def noise_band(y, floor: float = MIN_GROWTH_BYTES) -> float:
    """Bytes within which a settled series of n points may wander: the range n independent
    normal draws stay within (about 2 * sqrt(2 ln n) + 2 standard deviations), with the
    standard deviation estimated from the median absolute deviation of successive differences
    (which a steady trend does not inflate); at least ``floor``."""
    d = np.diff(np.asarray(y, dtype=np.float64))
    if len(d) < 2:
        return float(floor)
    mad = float(np.median(np.abs(d - np.median(d))))
    sigma = 1.4826 * mad / math.sqrt(2.0)
    return max(float(floor), (2.0 * math.sqrt(2.0 * math.log(len(d) + 1)) + 2.0) * sigma)


def settled_from(y, band: float) -> int:
    """Start index of the longest suffix of ``y`` whose range (max - min) is within ``band``."""
    y = np.asarray(y, dtype=np.float64)
    lo = hi = y[-1]
    i = len(y) - 1
    while i > 0:
        v = y[i - 1]
        lo2, hi2 = min(lo, v), max(hi, v)
        if hi2 - lo2 > band:
            break
        lo, hi, i = lo2, hi2, i - 1
    return i
