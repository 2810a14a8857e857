"""TINYLOOP_ATTN_PREFILL (cuda_ops.attn_prefill_setting): the T > 1 attention kernel choice,
read from the argument, else the environment, else ``mma``; a bad value is a ConfigError
naming the variable and the choices. Pure Python: runs without CuPy."""

from __future__ import annotations

import pytest

from tinyloop.backends.cuda_ops import attn_prefill_setting
from tinyloop.errors import ConfigError


def test_default_is_the_tensor_core_kernel(monkeypatch):
    monkeypatch.delenv("TINYLOOP_ATTN_PREFILL", raising=False)
    assert attn_prefill_setting() == "mma"
    monkeypatch.setenv("TINYLOOP_ATTN_PREFILL", "")
    assert attn_prefill_setting() == "mma"


def test_environment_then_argument(monkeypatch):
    monkeypatch.setenv("TINYLOOP_ATTN_PREFILL", "scalar")
    assert attn_prefill_setting() == "scalar"
    assert attn_prefill_setting("mma") == "mma"           # the argument wins


@pytest.mark.parametrize("bad", ["flash", "MMA", "v1", " scalar"])
def test_bad_values_name_the_setting(monkeypatch, bad):
    monkeypatch.setenv("TINYLOOP_ATTN_PREFILL", bad)
    with pytest.raises(ConfigError, match=r"TINYLOOP_ATTN_PREFILL.*'mma', 'scalar'"):
        attn_prefill_setting()
    monkeypatch.delenv("TINYLOOP_ATTN_PREFILL")
    with pytest.raises(ConfigError, match="TINYLOOP_ATTN_PREFILL"):
        attn_prefill_setting(bad)
