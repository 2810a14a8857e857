"""``python -m diagnostics leak | fragment | release | report`` (see diagnostics/__init__.py)."""

from __future__ import annotations

import argparse
import sys

from tinyloop.backends import BACKENDS
from tinyloop.config import parse_size
from tinyloop.errors import TinyLoopError

from .session import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_SEQ_LEN, DEFAULT_PROMPT
from .verdict import EXIT_CODES, INCONCLUSIVE, LEAK, STABLE, UNBOUNDED_CACHE

DEFAULT_OUT = "tinyloop-diagnostics"
LEAK_EXIT_HELP = f"""exit status (gate a CI job on it like on a test run):
  {EXIT_CODES[STABLE]}  STABLE, or BOUNDED CACHE, FILLING (a cache growing toward the budget it
     declares, nothing else growing)
  {EXIT_CODES[LEAK]}  LEAK (allocated bytes no cache accounts for grow, or a cache holds more
     than its budget)
  {EXIT_CODES[UNBOUNDED_CACHE]}  UNBOUNDED CACHE (a cache without a budget, or a reservation,
     keeps growing)
  {EXIT_CODES[INCONCLUSIVE]}  INCONCLUSIVE (too few requests to decide; the output says how
     many would)
  1  an error (bad model path, a request that failed); 2  bad arguments
The verdict is computed from the recorded series (leak.json's records) and the budgets the
caches declare in them, never from these options."""
NO_PROGRESS_HELP = "no progress bar (default: a bar on stderr)"


def _bytes(text: str) -> int:
    """argparse type: "4096", "64K", "2M", "1GiB" -> bytes (binary suffixes)."""
    try:
        n = parse_size(text, name="bytes")
    except TinyLoopError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0 bytes")
    return n


def _budget(text: str):
    """argparse type of --prefix-pool: bytes, or "unbounded" / "none" (no budget: None)."""
    if text.strip().lower() in ("unbounded", "none"):
        return None
    return _bytes(text)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return n


def _common(p: argparse.ArgumentParser, *, requests: int | None, max_new_tokens: int) -> None:
    if requests is not None:
        p.add_argument("--requests", type=_positive, default=requests, metavar="N",
                       help=f"number of requests (default {requests})")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"where JSON, CSV and PNG files go (default ./{DEFAULT_OUT})")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: CUDA where CuPy sees a GPU, else NumPy (default auto)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a .tlm model (default: tinyloop.default_model_path(), the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=_positive, default=max_new_tokens, metavar="M",
                   help=f"new tokens per request (default {max_new_tokens})")
    p.add_argument("--depth", type=_positive, default=None, metavar="D",
                   help="recurrent depth (default: the model's default depth)")
    p.add_argument("--max-seq-len", type=_positive, default=DEFAULT_MAX_SEQ_LEN, metavar="N",
                   help=f"positions of the model's KV cache (default {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--no-plots", action="store_true",
                   help="skip the PNG plots (default: draw them when matplotlib is installed)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m diagnostics",
        description="Tell a leak from a cache: repeated identical requests, fragmentation, "
                    "release steps, and a one-page HTML report.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lk = sub.add_parser("leak", help="N identical greedy requests -> STABLE / LEAK / "
                        "UNBOUNDED CACHE / BOUNDED CACHE, FILLING / INCONCLUSIVE "
                        "(the exit code says which)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=LEAK_EXIT_HELP)
    _common(lk, requests=30, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    lk.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="TEXT",
                    help=f"the request's prompt (default {DEFAULT_PROMPT!r})")
    lk.add_argument("--plant-leak", type=_bytes, default=0, metavar="BYTES",
                    help="plant a leak: keep BYTES allocated per request (tag 'other'), "
                         "e.g. 64K (default 0: none)")
    lk.add_argument("--plant-cache", type=_bytes, default=0, metavar="BYTES",
                    help="plant an unbounded cache: grow a cached-but-free reservation by "
                         "BYTES per request (default 0: none)")
    lk.add_argument("--prefix-pool", type=_budget, default=False, metavar="BYTES",
                    help="run every request through a tinyloop.PrefixPool of BYTES "
                         "(\"unbounded\" for no budget; default: no pool)")
    lk.add_argument("--unique-prompts", action="store_true",
                    help="give each request a prompt of its own (two trailing tokens), so a "
                         "prefix pool gains an entry per request (default: off)")
    lk.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    fr = sub.add_parser("fragment", help="seeded requests of varying length: fragmentation, "
                        "misses, allocator policies side by side")
    _common(fr, requests=30, max_new_tokens=16)
    fr.add_argument("--seed", type=int, default=0, metavar="S",
                    help="seed of the prompt and generation lengths (default 0)")
    fr.add_argument("--max-prompt-tokens", type=_positive, default=96, metavar="P",
                    help="prompts are 1..P tokens long (default 96)")
    fr.add_argument("--no-replay", action="store_true",
                    help="skip replaying the trace against other allocator policies "
                         "(default: replay where CUDA is present)")
    fr.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    rl = sub.add_parser("release", help="what the end of a request, empty_cache() and "
                        "free_model() each free; the cold start after unloading")
    _common(rl, requests=None, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    rl.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="TEXT",
                    help=f"the request's prompt (default {DEFAULT_PROMPT!r})")
    kv = sub.add_parser("kvmodes", help="KV cache bytes per token for every storage mode "
                        "(table + plot; no model load)")
    kv.add_argument("--model", default=None, help="a .tlm model (default: the embedded one)")
    kv.add_argument("--backend", choices=BACKENDS, default="auto",
                    help="whose dtypes size the figures (fp16 K/V: float16 on cuda, float32 on "
                         "numpy); auto: cuda where CuPy sees a GPU, else numpy (default auto)")
    kv.add_argument("--out", default="tinyloop-diagnostics",
                    help="where JSON and PNG files go (default tinyloop-diagnostics)")
    kv.add_argument("--no-plots", action="store_true",
                    help="skip the PNG plot (default: draw it)")
    rp = sub.add_parser("report", help="render DIR's results as one HTML page")
    rp.add_argument("dir", metavar="DIR",
                    help="a folder the leak / fragment / release runs wrote (their --out)")
    rp.add_argument("--html", default=None, metavar="PATH",
                    help="where to write it (default DIR/report.html)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "leak":
            from .leak import run_leak, summary
            r = run_leak(a.out, model_path=a.model, requests=a.requests, backend=a.backend,
                         prompt=a.prompt, max_new_tokens=a.max_new_tokens, depth=a.depth,
                         max_seq_len=a.max_seq_len, plant_leak=a.plant_leak,
                         plant_cache=a.plant_cache, prefix_pool=a.prefix_pool,
                         unique_prompts=a.unique_prompts, show_progress=not a.no_progress,
                         plot=not a.no_plots)
        elif a.cmd == "fragment":
            from .fragment import run_fragment, summary
            r = run_fragment(a.out, model_path=a.model, requests=a.requests,
                             backend=a.backend, seed=a.seed,
                             max_prompt_tokens=a.max_prompt_tokens,
                             max_new_tokens=a.max_new_tokens, depth=a.depth,
                             max_seq_len=a.max_seq_len, show_progress=not a.no_progress,
                             replay=not a.no_replay, plot=not a.no_plots)
        elif a.cmd == "release":
            from .release import run_release, summary
            r = run_release(a.out, model_path=a.model, backend=a.backend, prompt=a.prompt,
                            max_new_tokens=a.max_new_tokens, depth=a.depth,
                            max_seq_len=a.max_seq_len, plot=not a.no_plots)
        elif a.cmd == "kvmodes":
            from .kvmodes import run_kvmodes, summary
            r = run_kvmodes(a.out, model_path=a.model, backend=a.backend, plot=not a.no_plots)
        else:
            from .report import write_report
            print(f"wrote {write_report(a.dir, a.html)}")
            return 0
    except (TinyLoopError, OSError, ValueError) as e:
        print(f"python -m diagnostics {a.cmd}: error: {e}", file=sys.stderr)
        return 1
    print(summary(r))
    if r.get("plots_note"):
        print(r["plots_note"])
    print(f"wrote {', '.join(r['files'])} in {a.out}")
    if a.cmd == "leak":
        return EXIT_CODES[r["verdict"]]
    return 0


if __name__ == "__main__":
    sys.exit(main())
