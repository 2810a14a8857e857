"""Where does a megakernel decode step's time go? (a diagnostic script, not a test)

    python benchmarks/profile_mega.py [--model PATH] [--depth N] [--ctx N] [--blocks-per-sm K]

Runs greedy decode through the megakernel (decode_mega.cu) with its phase timer on: block 0
stamps the GPU global timer (ns) at the start of each step and after every grid barrier
(``MegaDecode.timing_ptr``, decode_mega.cu ``mk_stamp``), so each interval is one phase of the
step *including* the barrier that ends it, as block 0 saw it. Phases are named from the step's
program (``megakernel.stack_schedule``): per layer slot A (RMSNorm + QKV + RoPE/KV write),
B (split-K attention), C (O projection + residual), D (RMSNorm + gate/up + SwiGLU),
E (down + residual); ``embed``, ``save_e``, ``inject``; the LM head runs after the last
barrier and is the step's CUDA-event time minus the last stamp. Prints the median us per
phase kind and per layer slot. Without --model a
synthetic SmolLM2-135M-dims model is written (benchmarks/bench_decode.smollm2_like).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinyloop  # noqa: E402
from bench_decode import model_or_synthetic  # noqa: E402


def phase_names(schedule) -> list[str]:
    """The name of each stamped interval of one step, in order (decode_mega.cu mk_step)."""
    names = ["embed"]
    for op in schedule:
        if op[0] == "layer":
            names += ["A", "B", "C", "D", "E"]
        elif op[0] == "save_e":
            names.append("save_e")
        else:
            names += ["inject_read", "inject"]
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=64, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--blocks-per-sm", default=None,
                    help="TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM for the run (0 = as many as fit)")
    a = ap.parse_args(argv)
    import cupy
    from tinyloop.megakernel import stack_schedule
    if a.blocks_per_sm is not None:
        os.environ["TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM"] = str(a.blocks_per_sm)
    os.environ["TINYLOOP_MEGAKERNEL"] = "1"
    path = model_or_synthetic(a.model)
    m = tinyloop.load_model(path, max_seq_len=max(1024, a.ctx + a.steps + 8), backend="cuda")
    cfg = m.config
    prompt = [10 + i % 1000 for i in range(a.ctx)]
    m.generate(prompt, max_new_tokens=8, depth=a.depth)            # compile, build, warm
    mk = m.decode_graphs.mega
    if mk.failed or not mk.launches:
        print(f"megakernel did not run: {mk.failed or 'not eligible'}")
        return 1
    names = phase_names(stack_schedule(cfg.n_prelude, cfg.n_recurrent, cfg.n_coda, a.depth,
                                       m.injects))
    stamps = cupy.zeros(len(names) + 1, dtype=cupy.uint64)
    per = collections.defaultdict(list)          # phase kind -> us per occurrence, all steps
    heads, totals = [], []
    orig = mk.launch
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()

    def timed_launch(*args, **kw):
        stamps.fill(0)
        mk.timing_ptr = stamps.data.ptr
        ev0.record()
        orig(*args, **kw)
        ev1.record()
        ev1.synchronize()
        mk.timing_ptr = 0
        t = cupy.asnumpy(stamps).astype("int64")
        total_us = cupy.cuda.get_elapsed_time(ev0, ev1) * 1e3
        d = (t[1:] - t[:-1]) / 1e3
        for n, us in zip(names, d):
            per[n].append(us)
        totals.append(total_us)
        heads.append(total_us - (t[-1] - t[0]) / 1e3)
    mk.launch = timed_launch
    try:
        for _ in range(3):
            m.generate(prompt, max_new_tokens=a.steps, depth=a.depth)
    finally:
        del mk.launch
    layers = sum(1 for n in names if n == "A")
    print(f"megakernel phases: depth {a.depth}, context ~{a.ctx}, grid {mk.blocks} "
          f"({mk.blocks_fit}/SM fit), {len(totals)} steps")
    print(f"  step (CUDA events)        {statistics.median(totals):8.1f} us "
          f"(min {min(totals):.1f}, max {max(totals):.1f})")
    for n in ["embed", "A", "B", "C", "D", "E", "save_e", "inject_read", "inject"]:
        if per[n]:
            med = statistics.median(per[n])
            cnt = names.count(n)
            print(f"  {n:<12} x{cnt:<3} median {med:6.2f} us  -> {med * cnt:8.1f} us/step")
    print(f"  head (LM head + argmax)   {statistics.median(heads):8.1f} us")
    print(f"  per layer slot (A-E)      {sum(statistics.median(per[n]) for n in 'ABCDE'):8.2f} us"
          f" x {layers} slots")
    tinyloop.free_model(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
