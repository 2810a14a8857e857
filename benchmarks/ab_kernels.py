"""Decode speed with this checkout's kernels against another commit's, on one machine.

    python -m benchmarks ab_kernels REF [--rounds N] [--depths 1,4] [--model PATH]

Separate runs on separate machines cannot tell a kernel change from host and clock variation
(batch-1 decode here is partly host-bound), so this alternates A (this checkout's kernel
folder) and B (``git archive REF`` of that commit's kernel folder, ``KERNEL_DIRS``, in a
temporary folder; or REF itself when it is a folder holding ``common.cuh``) in fresh
subprocesses, ``--rounds`` times each, on the same GPU, with this checkout's Python host code
for both: B must keep the kernel entry points and signatures the host launches (a run that
fails says so). Each run: greedy decode through the captured graph
(the default), 1.5 s of warm-up, then the median of 4 generations of 128 tokens per
depth. Prints per depth the median (min-max) over rounds of each side and B / A. By default
(--model synthetic) a synthetic SmolLM2-135M-dims model is written once and shared
(common.write_synthetic_model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile

from .common import add_model_arg, model_path, spread

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, statistics, time
from pathlib import Path
import tinyloop
from tinyloop.backends.cuda import compile as cuda_compile
src = {src!r}
if src:
    cuda_compile.source_dir = lambda: Path(src)
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


# where a commit keeps its kernels: the package's folder, or (older commits) cuda_src/
KERNEL_DIRS = ("tinyloop/backends/cuda/kernels", "cuda_src")


def kernel_dir(ref: str) -> str:
    """The folder of ``KERNEL_DIRS`` that git commit ``ref`` holds. Raises
    CalledProcessError for an unknown ref, FileNotFoundError when it holds neither."""
    for d in KERNEL_DIRS:
        names = subprocess.run(["git", "-C", REPO, "ls-tree", "--name-only", ref, d + "/"],
                               capture_output=True, text=True, check=True).stdout.split()
        if names:
            return d
    raise FileNotFoundError(f"commit {ref} holds none of {KERNEL_DIRS}")


def extract_sources(ref: str, dest: str) -> str:
    """The kernel folder of git commit ``ref`` (``kernel_dir``) unpacked under ``dest``;
    returns its path. Raises CalledProcessError for an unknown ref."""
    d = kernel_dir(ref)
    os.makedirs(dest, exist_ok=True)
    tar = os.path.join(dest, "src.tar")
    with open(tar, "wb") as f:
        subprocess.run(["git", "-C", REPO, "archive", ref, d], stdout=f, check=True)
    with tarfile.open(tar) as t:
        try:
            t.extractall(dest, filter="data")
        except TypeError:                 # a Python without extraction filters
            t.extractall(dest)
    return os.path.join(dest, d)


def run_side(src: str | None, model: str, depths: tuple) -> dict:
    """One fresh-process measurement: {depth: tok/s}; raises RuntimeError with the child's
    tail when it fails."""
    code = _CHILD.format(src=src or "", model=model, depths=depths)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[7:]).items()}
    raise RuntimeError(f"run with sources {src or 'this checkout'} failed (rc {p.returncode}):"
                       f"\n{(p.stdout + p.stderr)[-2000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ref", help="git commit whose kernel folder is side B, or a folder of "
                                "kernel sources (one holding common.cuh: for a machine "
                                "without the repository's history)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", default="1,4")
    add_model_arg(ap)
    a = ap.parse_args(argv)
    depths = tuple(int(x) for x in a.depths.split(","))
    if os.path.isfile(os.path.join(a.ref, "common.cuh")):
        b_src = os.path.abspath(a.ref)
    else:
        b_src = extract_sources(a.ref, tempfile.mkdtemp(prefix="tl_ab_"))
    model = model_path(a.model)
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
        ta, tb = spread(res["A"][d]), spread(res["B"][d])
        print(f"  depth {d}: A {ta.fmt(',.1f')}  B {tb.fmt(',.1f')}  B/A "
              f"{tb.median / ta.median:.3f}")
    return 0
