"""Decode speed with this checkout's kernels against another commit's, on one machine (a
script, not a test).

    python benchmarks/ab_kernels.py REF [--rounds N] [--depths 1,4] [--model PATH]

Separate runs on separate machines cannot tell a kernel change from host and clock variation
(batch-1 decode here is partly host-bound), so this alternates A (this checkout's
``cuda_src/``) and B (``git archive REF cuda_src`` in a temporary folder) in fresh
subprocesses, ``--rounds`` times each, on the same GPU, with this checkout's Python host code
for both: B must keep the kernel entry points and signatures the host launches (a run that
fails says so). Each run: greedy decode through the captured graph (TINYLOOP_MEGAKERNEL=0,
TINYLOOP_CUDA_GRAPHS=1), 1.5 s of warm-up, then the median of 4 generations of 128 tokens per
depth. Prints per depth the median over rounds of each side and B / A. Without --model a
synthetic SmolLM2-135M-dims model is written once and shared (bench_decode.smollm2_like).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

_CHILD = r"""
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
os.environ["TINYLOOP_MEGAKERNEL"] = "0"
os.environ["TINYLOOP_CUDA_GRAPHS"] = "1"
import tinyloop
from tinyloop.backends import cuda_ops
src = {src!r}
if src:
    cuda_ops.source_dir = lambda: Path(src)
m = tinyloop.load_model({model!r}, max_seq_len=1024, backend="cuda")
prompt = list(range(10, 26))
t0 = time.perf_counter()
while time.perf_counter() - t0 < 1.5:
    m.generate(prompt, max_new_tokens=64, depth=1)
out = {{}}
for d in {depths!r}:
    tps = [m.generate(prompt, max_new_tokens=128, depth=d).decode_tokens_per_s
           for _ in range(4)]
    out[d] = statistics.median(tps)
print("RESULT " + json.dumps(out))
"""


def extract_sources(ref: str, dest: str) -> str:
    """``cuda_src/`` of git commit ``ref`` unpacked under ``dest``; returns its path. Raises
    CalledProcessError for an unknown ref."""
    tar = os.path.join(dest, "src.tar")
    with open(tar, "wb") as f:
        subprocess.run(["git", "-C", REPO, "archive", ref, "cuda_src"], stdout=f, check=True)
    with tarfile.open(tar) as t:
        try:
            t.extractall(dest, filter="data")
        except TypeError:                 # a Python without extraction filters
            t.extractall(dest)
    return os.path.join(dest, "cuda_src")


def run_side(src: str | None, model: str, depths: tuple) -> dict:
    """One fresh-process measurement: {depth: tok/s}; raises RuntimeError with the child's
    tail when it fails."""
    code = _CHILD.format(bench=HERE, src=src or "", model=model, depths=depths)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[7:]).items()}
    raise RuntimeError(f"run with sources {src or 'this checkout'} failed (rc {p.returncode}):"
                       f"\n{(p.stdout + p.stderr)[-2000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ref", help="git commit whose cuda_src/ is side B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", default="1,4")
    ap.add_argument("--model", default=None)
    a = ap.parse_args(argv)
    depths = tuple(int(x) for x in a.depths.split(","))
    tmp = tempfile.mkdtemp(prefix="tl_ab_")
    b_src = extract_sources(a.ref, tmp)
    model = a.model
    if model is None:
        sys.path.insert(0, HERE)
        from bench_decode import smollm2_like
        model = os.path.join(tmp, "smollm2_dims.tlm")
        smollm2_like(model)
    res = {"A": {d: [] for d in depths}, "B": {d: [] for d in depths}}
    for r in range(a.rounds):
        for side, src in (("A", None), ("B", b_src)):
            got = run_side(src, model, depths)
            for d in depths:
                res[side][d].append(got[d])
            print(f"round {r + 1} {side}: " + ", ".join(f"d{d} {got[d]:,.1f}" for d in depths),
                  flush=True)
    print(f"\ngreedy decode through the captured graph, tok/s (median of {a.rounds} rounds;"
          f" A = this checkout, B = {a.ref})")
    for d in depths:
        ma, mb = statistics.median(res["A"][d]), statistics.median(res["B"][d])
        print(f"  depth {d}: A {ma:,.1f} ({min(res['A'][d]):,.0f}-{max(res['A'][d]):,.0f})"
              f"  B {mb:,.1f} ({min(res['B'][d]):,.0f}-{max(res['B'][d]):,.0f})"
              f"  B/A {mb / ma:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
