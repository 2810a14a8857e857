"""No module or class of the product defines one function name twice: the later definition
silently replaces the earlier one, and every caller of the first then gets the second's
signature (a wrong-arity call only fails on the path that reaches it, often GPU-only)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([*ROOT.glob("tinyloop/**/*.py"), *ROOT.glob("diagnostics/*.py"),
                  *ROOT.glob("benchmarks/*.py")])


def _redefinitions(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef)):
            continue
        seen: dict[str, int] = {}
        for b in node.body:
            if not isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            # property setters / deleters and typing.overload legitimately reuse a name
            if any((isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter"))
                   or (isinstance(d, ast.Name) and d.id == "overload") for d in b.decorator_list):
                continue
            if b.name in seen:
                where = getattr(node, "name", "<module>")
                found.append(f"{where}.{b.name}: lines {seen[b.name]} and {b.lineno}")
            seen[b.name] = b.lineno
    return found


def test_the_finder_finds_a_shadowed_method():
    src = "class A:\n    def f(self): pass\n    def g(self): pass\n    def f(self, x): pass\n"
    assert _redefinitions(ast.parse(src)) == ["A.f: lines 2 and 4"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_defined_twice(path):
    assert _redefinitions(ast.parse(path.read_text(encoding="utf-8"))) == []
