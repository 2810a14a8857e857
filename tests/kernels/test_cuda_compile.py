"""Compile every kernel source with nvcc for sm_90 (CI has nvcc but no GPU), so a syntax or
type error in the kernel sources (tinyloop/backends/cuda/kernels/) never lands. Skips where nvcc is absent."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "tinyloop" / "backends" / "cuda" / "kernels"
KERNELS = sorted(SRC.glob("*.cu"))
NVCC = shutil.which("nvcc") or next(
    (str(p) for p in (pathlib.Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)


def test_there_are_kernel_sources():
    names = {p.stem for p in KERNELS}
    assert {"gemv", "gemm", "attention", "rmsnorm", "rope", "sample"} <= names, names


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("src", KERNELS, ids=lambda p: p.name)
def test_kernel_compiles_for_sm90(src, tmp_path):
    out = tmp_path / (src.stem + ".cubin")
    proc = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-std=c++17", "-I", str(SRC),
                           "-Werror", "all-warnings", "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed on {src.name}:\n{proc.stderr}"
    assert out.stat().st_size > 0
