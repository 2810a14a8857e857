"""The import graph of ``tinyloop`` and ``diagnostics`` has no circle (every import counts,
top-level or inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``from . import plan`` counts as an edge to
    the submodule ``plan`` only; parent packages, which Python imports first, do not count)."""
    files = {}
    for pkg in ("tinyloop", "diagnostics"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    graph = {}
    for mod, path in files.items():
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = pkg[:len(pkg) - node.level + 1] if node.level else []
                base = ".".join(base + ([node.module] if node.module else []))
                subs = {f"{base}.{a.name}" for a in node.names} & files.keys()
                out |= subs
                if len(subs) < len(node.names):
                    out.add(base)
        graph[mod] = {m for m in out if m in files and m != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycles_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_has_no_circle():
    graph = import_graph()
    assert "tinyloop.memory.cupy_hook" in graph and "tinyloop.model" in graph
    assert "tinyloop.generate" in graph["tinyloop.model"]
    assert cycles(graph) == []


# --- the CUDA backend's package: compile / launch / checks / choice below the kernel families,
# the families below ops.py, which composes them
CUDA = "tinyloop.backends.cuda"
CUDA_BASE = {f"{CUDA}.{m}" for m in ("compile", "launch", "checks", "choice")}
CUDA_FAMILIES = {f"{CUDA}.{m}" for m in ("norms", "gemv", "gemm", "kv", "attention",
                                          "sampling", "step")}
# a family may use another's launcher or constants where its op composes it
CUDA_FAMILY_USES = {f"{CUDA}.gemv": {f"{CUDA}.gemm"}, f"{CUDA}.attention": {f"{CUDA}.kv"}}


def test_the_cuda_package_is_layered():
    graph = import_graph()
    inside = {m for m in graph if m.startswith(CUDA + ".")}
    assert CUDA_BASE | CUDA_FAMILIES | {f"{CUDA}.ops"} == inside, inside
    for m in CUDA_BASE:
        assert not graph[m] & (CUDA_FAMILIES | {f"{CUDA}.ops", CUDA}), (m, graph[m])
    for m in CUDA_FAMILIES:
        others = graph[m] & (CUDA_FAMILIES | {f"{CUDA}.ops", CUDA})
        assert others <= CUDA_FAMILY_USES.get(m, set()), (m, others)
    assert "tinyloop.backends.cuda_ops" not in graph      # no shim of the old module


def test_no_two_cuda_mixins_define_one_method():
    """CudaOps composes one mixin per kernel family: a method two of them define would be
    shadowed silently by the one first in the MRO."""
    from tinyloop.backends.base import Ops
    from tinyloop.backends.cuda import CudaOps
    owner: dict = {}
    for cls in CudaOps.__mro__:
        if cls in (Ops, object):
            continue
        for name, v in vars(cls).items():
            if callable(v) or isinstance(v, (property, staticmethod, classmethod)):
                assert name not in owner or name.startswith("__") and cls is CudaOps, \
                    (name, owner.get(name), cls.__name__)
                owner.setdefault(name, cls.__name__)
