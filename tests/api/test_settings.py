"""The user's settings: one registry (config.SETTINGS) that every reader of the environment
in tinyloop/ goes through, and the README listing each variable once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tinyloop import config
from tinyloop.config import SETTINGS, Setting, setting
from tinyloop.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# read by tests / notebooks / scripts, never by tinyloop/
TEST_ONLY = ("TINYLOOP_TEST_MODEL", "TINYLOOP_TEST_SEED", "TINYLOOP_REPORT_DIR", "TINYLOOP_NB_")


def environ_reads(source: str) -> list[int]:
    """Lines of ``source`` that touch ``os.environ`` or call ``os.getenv``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            out.append(node.lineno)
    return out


def test_the_finder_finds_each_kind():
    src = ("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
           "c = os.path.join('a')\n")
    assert sorted(environ_reads(src)) == [2, 3, 4]


def test_only_config_reads_the_environment():
    found = []
    for path in sorted((ROOT / "tinyloop").rglob("*.py")):
        if path.name == "config.py" and path.parent.name == "tinyloop":
            continue
        for line in environ_reads(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found, "environment read outside tinyloop/config.py:\n" + "\n".join(found)


def test_every_variable_tinyloop_names_is_a_setting():
    envs = {s.env for s in SETTINGS.values()}
    named = set()
    for path in (ROOT / "tinyloop").rglob("*.py"):
        named |= set(re.findall(r"TINYLOOP_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    assert named <= envs, sorted(named - envs)


def test_the_registry_holds_the_four_user_settings():
    assert {s.env for s in SETTINGS.values()} == {
        "TINYLOOP_KV_MODE", "TINYLOOP_MEMORY_LIMIT", "TINYLOOP_FP16_CACHE",
        "TINYLOOP_CUDA_GRAPHS"}
    for name, s in SETTINGS.items():
        assert isinstance(s, Setting) and s.name == name and s.doc and callable(s.parse)


def _readme_env_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Environment variables")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_the_readme_lists_each_variable_once():
    section = _readme_env_section()
    for s in SETTINGS.values():
        assert section.count(f"`{s.env}`") == 1, s.env
    for var in TEST_ONLY:
        assert section.count(f"`{var}") == 1, var
    listed = set(re.findall(r"`(TINYLOOP_[A-Z0-9_]+)", section))
    assert listed <= {s.env for s in SETTINGS.values()} | set(TEST_ONLY), listed
    whole = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"TINYLOOP_[A-Z0-9_]+", whole))
    allowed = {s.env for s in SETTINGS.values()}
    assert all(n in allowed or n.startswith(TEST_ONLY) for n in named), named


@pytest.mark.parametrize("name,raw,want", [
    ("cuda_graphs", "0", False), ("cuda_graphs", " On ", True), ("fp16_cache", "yes", True),
    ("kv_mode", "INT8", "int8"), ("kv_mode", "auto", "auto"), ("memory_limit", "4G", "4G"),
    ("memory_limit", "40%", "40%")])
def test_setting_parses_the_variable(monkeypatch, name, raw, want):
    monkeypatch.setenv(SETTINGS[name].env, raw)
    assert setting(name) == want


@pytest.mark.parametrize("name,raw", [("cuda_graphs", "maybe"), ("fp16_cache", "2"),
                                      ("kv_mode", "fp8"), ("memory_limit", "lots"),
                                      ("memory_limit", "150%")])
def test_a_bad_value_names_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(SETTINGS[name].env, raw)
    with pytest.raises(ConfigError, match=SETTINGS[name].env):
        setting(name)


def test_unset_or_empty_gives_the_default(monkeypatch):
    for s in SETTINGS.values():
        monkeypatch.delenv(s.env, raising=False)
    assert setting("kv_mode") == "fp16" and setting("cuda_graphs") is True
    assert setting("memory_limit") is None and setting("fp16_cache") is None
    assert config.fp16_cache_enabled(default=True) is True
    monkeypatch.setenv("TINYLOOP_FP16_CACHE", "  ")
    assert config.fp16_cache_enabled(default=False) is False
    monkeypatch.setenv("TINYLOOP_MEMORY_LIMIT", "50%")
    assert config.memory_limit_from_env(1000) == 500
