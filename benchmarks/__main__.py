"""The one entry point: ``python -m benchmarks`` lists the benchmarks (one line each, from
each module's docstring, read without importing it), ``python -m benchmarks NAME [args]``
imports ``benchmarks.NAME`` and runs its ``main(args)``."""

from __future__ import annotations

import ast
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NOT_BENCHMARKS = {"__init__", "__main__", "common"}


def names() -> list[str]:
    """Every benchmark module's name, sorted."""
    return sorted(f[:-3] for f in os.listdir(HERE)
                  if f.endswith(".py") and f[:-3] not in NOT_BENCHMARKS)


def summary(name: str) -> str:
    """The first line of ``benchmarks/NAME.py``'s docstring."""
    with open(os.path.join(HERE, f"{name}.py"), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().split("\n")[0]


def usage() -> str:
    width = max(len(n) for n in names())
    lines = ["usage: python -m benchmarks NAME [args]   (NAME --help: its arguments)", "",
             "benchmarks:"]
    lines += [f"  {n:<{width}}  {summary(n)}" for n in names()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names():
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"benchmarks.{name}")
    prog, sys.argv[0] = sys.argv[0], f"python -m benchmarks {name}"    # argparse's usage line
    try:
        return int(mod.main(rest) or 0)
    finally:
        sys.argv[0] = prog


if __name__ == "__main__":
    sys.exit(main())
