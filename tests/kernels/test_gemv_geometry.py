"""The CUDA backend's decode-GEMV launch geometry (pure Python: no GPU needed); the choice
of version is tests/kernels/test_kernel_choice.py's."""

import pytest

from tinyloop.backends.cuda.gemv import gemv2_geometry

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
