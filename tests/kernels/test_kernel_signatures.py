"""Kernel argument signatures: each entry of kernels/*.cu takes only pointers, i64 and double
(what CuPy packs a Python int / float / array as), launch.SIGNATURES declares each entry's
kinds exactly, and a launch's arguments are checked against them once. CPU only."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tinyloop.backends.cuda import compile as cuda_compile
from tinyloop.backends.cuda.launch import SIGNATURES, check_args, signature
from tinyloop.errors import ConfigError

SRC = Path(cuda_compile.__file__).resolve().parent / "kernels"
_ENTRY = re.compile(r'extern "C" __global__ void'
                    r'(?:[\s\\]+__launch_bounds__\((?:[^()]|\([^()]*\))*\))?'
                    r'[\s\\]+([\w#]+)\s*\(([^)]*)\)', re.S)


def _kind(param: str) -> str:
    """p / i / f of one C parameter declaration; ValueError for any other type."""
    p = " ".join(param.replace("\\", " ").split())
    if "*" in p:
        return "p"
    ty = re.sub(r"\b(const|volatile|__restrict__)\b", "", p).split()[0]
    if ty == "i64":
        return "i"
    if ty == "double":
        return "f"
    raise ValueError(f"parameter {p!r} is neither a pointer, an i64 nor a double")


def _sample(token: str) -> str:
    """A concrete name from an entry's name token: each ##-joined macro parameter as x1."""
    parts = token.split("##")
    return "".join(p if i % 2 == 0 else "x1" for i, p in enumerate(parts))


def entries() -> list[tuple[str, str, str]]:
    """(file, a concrete name, the parameter kinds) of every kernel entry; an entry named by
    a macro parameter (NAME) is resolved through the macro's uses."""
    out = []
    for path in sorted(SRC.glob("*.cu")):
        text = path.read_text(encoding="utf-8")
        for m in _ENTRY.finditer(text):
            name, params = m.group(1), m.group(2)
            kinds = "".join(_kind(p) for p in params.split(",") if p.strip(" \\\n"))
            if name == "NAME":
                start = text.rfind("#define", 0, m.start())
                macro = re.match(r"#define (\w+)\(", text[start:]).group(1)
                names = [u.group(1) for u in re.finditer(rf"\b{macro}\(\s*([\w#]+)",
                                                          text[m.end():])]
            else:
                names = [name]
            out += [(path.name, _sample(n), kinds) for n in names]
    return out


def test_the_entry_reader_reads_a_planted_entry():
    assert _kind("const half_t* __restrict__ x") == "p"
    assert _kind(" i64 ld") == "i" and _kind("double eps") == "f"
    with pytest.raises(ValueError, match="int n"):
        _kind("int n")
    assert _sample("attn_split_##NAME##_hd##HD") == "attn_split_x1_hdx1"


def test_every_entry_has_its_declared_signature():
    found = entries()
    assert len(found) > 60
    for file, name, kinds in found:
        assert signature(name) == kinds, (file, name, kinds, signature(name))


def test_every_declaration_names_an_entry():
    names = [n for _, n, _ in entries()]
    for pat, _ in SIGNATURES:
        assert any(re.fullmatch(pat, n) for n in names), pat


def test_check_args_names_the_kernel_and_the_argument():
    check_args("k", "pif", (0x1000, 3, 0.5))
    check_args("k", "pif", (np.int64(16), np.int64(3), np.float64(0.5)))
    with pytest.raises(ConfigError, match="kernel k takes 3 arguments"):
        check_args("k", "pif", (1, 2))
    with pytest.raises(ConfigError, match="argument 2 must be a double"):
        check_args("k", "pif", (1, 2, 3))
    with pytest.raises(ConfigError, match="argument 1 must be an i64"):
        check_args("k", "pif", (1, np.int32(2), 0.5))
    with pytest.raises(ConfigError, match="argument 0 must be a pointer"):
        check_args("k", "pif", (True, 2, 0.5))
    with pytest.raises(ConfigError, match="argument 2 must be a double"):
        check_args("k", "pif", (1, 2, np.float32(0.5)))
    with pytest.raises(ConfigError, match="no declared argument signature"):
        signature("not_a_kernel")
