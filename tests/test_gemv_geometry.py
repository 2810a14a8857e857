"""The CUDA backend's decode-GEMV launch geometry and settings (pure Python: no GPU needed)."""

import pytest

from tinyloop.backends.cuda_ops import gemv2_geometry, gemv_settings
from tinyloop.errors import ConfigError

SHAPES = [(960, 576, 4), (576, 576, 4), (1536, 576, 4), (576, 1536, 4), (49152, 576, 8),
          (16384, 8192, 4), (1, 64, 8), (7, 32, 4), (203, 4096, 8)]


@pytest.mark.parametrize("n,k,bits", SHAPES)
@pytest.mark.parametrize("sms", [1, 132])
def test_gemv2_geometry_covers_every_row(n, k, bits, sms):
    cpr = (k // 2 if bits == 4 else k) // 16
    lpr, nt, nb = gemv2_geometry(n, k, bits, sms)
    assert lpr in (4, 8, 16, 32) and nt in (64, 128, 256) and nb >= 1
    assert lpr == 32 or -(-cpr // lpr) <= 2          # at most two 16-byte chunks per lane
    assert lpr == 4 or -(-cpr // (lpr // 2)) > 2     # and no more lanes than that needs
    assert nb * nt >= n * lpr                         # one row group per row, no stride needed
    assert nb * nt - n * lpr < nt                     # and not a block more
    # a larger block only when it still leaves a block per SM
    assert nt == 64 or nb >= sms
    _, nt_c, nb_c = gemv2_geometry(n, k, bits, sms, cap_wave=True)
    assert nt_c == nt and nb_c == min(nb, sms * min(32, 2048 // nt))


def test_gemv2_geometry_forced():
    assert gemv2_geometry(960, 576, 4, 132, lpr=8, threads=256) == (8, 256, 30)


def test_gemv_settings(monkeypatch):
    for var in ("TINYLOOP_GEMV", "TINYLOOP_GEMV_LPR", "TINYLOOP_GEMV_THREADS"):
        monkeypatch.delenv(var, raising=False)
    assert gemv_settings() == {"version": "auto", "lpr": None, "threads": None}
    monkeypatch.setenv("TINYLOOP_GEMV", "v1")
    monkeypatch.setenv("TINYLOOP_GEMV_LPR", "16")
    assert gemv_settings() == {"version": "v1", "lpr": 16, "threads": None}
    assert gemv_settings("v2", 4, 128) == {"version": "v2", "lpr": 4, "threads": 128}
    with pytest.raises(ConfigError, match=r"TINYLOOP_GEMV\) 'v3'"):
        gemv_settings("v3")
    with pytest.raises(ConfigError, match=r"TINYLOOP_GEMV_THREADS\) 100"):
        gemv_settings(threads=100)
    monkeypatch.setenv("TINYLOOP_GEMV_LPR", "six")
    with pytest.raises(ConfigError, match=r"TINYLOOP_GEMV_LPR\) 'six'"):
        gemv_settings()


def test_gemv_choice_by_shape():
    """auto: v1 for the layer shapes, v2 at 4 lanes per row for an LM-head-sized weight; a
    forced version or lpr wins (TINYLOOP_GEMV / TINYLOOP_GEMV_LPR)."""
    from tinyloop.backends.cuda_ops import gemv_choice
    auto = {"version": "auto", "lpr": None, "threads": None}
    assert [gemv_choice(n, auto) for n in (576, 960, 3072, 49152)] == \
        [("v1", None)] * 3 + [("v2", 4)]
    assert gemv_choice(960, dict(auto, version="v2")) == ("v2", None)
    assert gemv_choice(49152, dict(auto, version="v1")) == ("v1", None)
    assert gemv_choice(49152, dict(auto, lpr=16)) == ("v2", 16)
