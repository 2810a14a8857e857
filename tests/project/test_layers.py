"""The import graph of ``tinyloop`` and ``diagnostics`` has no circle (every import counts,
top-level or inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


# -- the request route's layers ----------------------------------------------------------------
# Lowest first: a module imports only the entries before it in its chain. generate owns a
# request: it takes its KV from the kv package and its decode from graphs; graphs issues the
# model's step through the model it is given; model imports generate only for its request
# methods, which hand the call over. The kv package and tlpx import nothing of the request.
KV_CHAIN = ["tinyloop.kv.layouts", "tinyloop.kv.pages", "tinyloop.kv.cache",
            "tinyloop.kv.registry", "tinyloop.tlpx", "tinyloop.kv.handles", "tinyloop.kv.pool"]
ROUTE = ["tinyloop.graphs", "tinyloop.generate", "tinyloop.model"]
# edges the chains allow but the route forbids: the model calls neither the captured step
# nor the pool (a request reaches them through generate)
FORBIDDEN = {("tinyloop.model", "tinyloop.graphs"), ("tinyloop.model", "tinyloop.kv.pool")}


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) edges that go up the route's layers: within KV_CHAIN or ROUTE to
    a later entry, from KV_CHAIN to anything of ROUTE (or the kv package's __init__), and every FORBIDDEN edge."""
    bad = []
    for chain in (KV_CHAIN, ROUTE):
        for i, mod in enumerate(chain):
            bad += [(mod, m) for m in sorted(graph.get(mod, ())) if m in chain[i + 1:]]
    for mod in KV_CHAIN:
        bad += [(mod, m) for m in sorted(graph.get(mod, ()))
                if m in ROUTE or m == "tinyloop.kv"]
    bad += sorted(e for e in FORBIDDEN if e[1] in graph.get(e[0], ()))
    return bad


def test_layer_violations_finds_planted_edges():
    graph = {"tinyloop.kv.pages": {"tinyloop.kv.cache"}, "tinyloop.kv.pool": {"tinyloop.model"},
             "tinyloop.model": {"tinyloop.graphs", "tinyloop.generate", "tinyloop.kv.cache"},
             "tinyloop.graphs": {"tinyloop.model"}, "tinyloop.generate": {"tinyloop.graphs"}}
    assert layer_violations(graph) == [("tinyloop.kv.pages", "tinyloop.kv.cache"),
                                       ("tinyloop.graphs", "tinyloop.model"),
                                       ("tinyloop.kv.pool", "tinyloop.model"),
                                       ("tinyloop.model", "tinyloop.graphs")]


def test_the_request_route_goes_down_its_layers():
    """model -> generate -> prefix -> model and model -> graphs -> model cannot come back: the
    kv package and tlpx import nothing above them, model imports neither graphs nor the pool,
    graphs imports neither model nor generate."""
    graph = import_graph()
    assert set(KV_CHAIN + ROUTE) <= graph.keys()
    assert "tinyloop.graphs" in graph["tinyloop.generate"]
    assert layer_violations(graph) == []


# methods of the Model that run the forward: only the request owners (generate.py, and the
# serving engine, which runs many requests' steps together) and the captured step (graphs.py)
# call them; the kv package hands out and takes back KV state only
FORWARD_METHODS = {"forward", "head", "head_sample", "decode_step_ops", "decode_batch"}
FORWARD_CALLERS = {"tinyloop/generate.py", "tinyloop/graphs.py", "tinyloop/serve/engine.py"}


def calls_to(path: Path, names: set[str]) -> list[str]:
    """``obj.name(...)`` calls of any ``name`` in ``names`` where obj is not ``self``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in names
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}")
    return out


def test_only_the_request_and_the_captured_step_run_the_forward():
    callers = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tinyloop").rglob("*.py")
               if calls_to(p, FORWARD_METHODS)}
    assert callers <= FORWARD_CALLERS
    assert [c for p in (ROOT / "tinyloop" / "kv").glob("*.py")
            for c in calls_to(p, FORWARD_METHODS)] == []


# -- private fields stay in their module -------------------------------------------------------


def own_privates(tree: ast.AST) -> set[str]:
    """The ``_names`` a module defines: ``self._x`` / ``cls._x`` attributes, ``_`` functions
    and methods, class-level names and ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for b in node.body:
                targets = (b.targets if isinstance(b, ast.Assign)
                           else [b.target] if isinstance(b, ast.AnnAssign) else [])
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
                if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                    names |= {c.value for c in ast.walk(b.value)
                              if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {n for n in names if n.startswith("_")}


def foreign_private_access(path: Path, root: Path = ROOT) -> list[str]:
    """``obj._x`` (read or write; obj not ``self`` / ``cls``) where the module defines no
    ``_x`` of its own: another module's private field (named relative to ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = own_privates(tree)
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in own
                and not (isinstance(node.value, ast.Name)
                         and node.value.id in ("self", "cls", "sys", "np"))):
            out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_foreign_private_access_finds_a_planted_read(tmp_path):
    mod = tmp_path / "planted.py"
    mod.write_text("class A:\n    def __init__(self):\n        self._mine = 1\n\n"
                   "def f(a, model):\n    a._mine = 2\n    return model._kv\n", encoding="utf-8")
    assert foreign_private_access(mod, tmp_path) == ["planted.py:7: model._kv"]


def test_no_module_touches_another_modules_private_fields():
    found = []
    for pkg in ("tinyloop", "diagnostics"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found += foreign_private_access(path)
    assert found == []


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
