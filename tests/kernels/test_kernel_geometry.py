"""Kernel geometry has one definition: ``cuda.compile.GEOMETRY``. The .cu files repeat a value
the kernel uses only as an ``#ifndef`` default for standalone nvcc builds; these tests fail
when a default drifts from the table, when a kernel names a table entry without such a
default or has a default the table lacks, when a launch passes a literal block size, and
(where nvcc exists) when the -D options NVRTC gets do not control what is compiled."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tinyloop.backends.cuda import compile as cuda_compile
from tinyloop.backends.cuda.compile import (ATTN_HEAD_DIMS, FA_HEAD_DIMS, FAMILIES,
                                            FAMILY_INCLUDES, GEOMETRY, load_source,
                                            nvrtc_options)
from tinyloop.backends.cuda.kv import H_KERNEL_MODES, KV_KERNEL_MODES
from tinyloop.errors import ConfigError

PKG = Path(cuda_compile.__file__).resolve().parent
SRC = PKG / "kernels"
NVCC = shutil.which("nvcc") or next(
    (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)


@pytest.fixture(autouse=True)
def this_checkouts_sources(monkeypatch):
    # the sources of this checkout, whatever a test before planted
    monkeypatch.setattr(cuda_compile, "source_dir", lambda: SRC)


def cu_defaults(family: str) -> dict[str, str]:
    """NAME -> default text of every ``#ifndef NAME / #define NAME value / #endif`` in
    kernels/<family>.cu (line continuations joined, whitespace collapsed)."""
    text = (cuda_compile.source_dir() / f"{family}.cu").read_text(encoding="utf-8")
    text = text.replace("\\\n", " ")
    out = {}
    for m in re.finditer(r"^#ifndef (\w+)\n#define \1[ \t]+(.*?)\n#endif", text, re.M):
        out[m.group(1)] = " ".join(m.group(2).split())
    return out


def test_cu_defaults_parser_reads_a_planted_default(tmp_path, monkeypatch):
    (tmp_path / "x.cu").write_text("#ifndef A\n#define A   7\n#endif\n"
                                   "#ifndef B\n#define B f(1) \\\n    f(2)\n#endif\n"
                                   "#define C 3\n")
    monkeypatch.setattr(cuda_compile, "source_dir", lambda: tmp_path)
    assert cu_defaults("x") == {"A": "7", "B": "f(1) f(2)"}


def _named(family: str, name: str) -> bool:
    text = (SRC / f"{family}.cu").read_text(encoding="utf-8")
    return re.search(rf"\b{name}\b", text) is not None


@pytest.mark.parametrize("family", sorted(GEOMETRY))
def test_cu_defaults_equal_the_table(family):
    got = cu_defaults(family)
    for name, value in GEOMETRY[family].items():
        if not _named(family, name):
            continue              # a block size of a kernel written for any block size
        assert name in got, f"kernels/{family}.cu names {name} without an #ifndef default"
        if name.endswith("HEAD_DIM_ENTRIES"):
            dims = [int(h) for h in re.findall(r"[A-Z]+_ENTRIES\((\d+)\)", got[name])]
            assert dims == [int(h) for h in re.findall(r"\((\d+)\)", value)], (family, name)
            want = {"attention_prefill": FA_HEAD_DIMS}
            assert dims == list(want.get(family, ATTN_HEAD_DIMS)), (family, name)
        else:
            assert int(got[name]) == value, (family, name, got[name], value)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_shared_constant_is_in_the_table(family):
    # a constant a kernel takes by #ifndef default must come from GEOMETRY (or, for a family
    # that includes others, from theirs)
    table = {}
    for fam in FAMILY_INCLUDES.get(family, ()) + (family,):
        table.update(GEOMETRY.get(fam, {}))
    assert set(cu_defaults(family)) <= set(table), family
    assert family in GEOMETRY or family in FAMILY_INCLUDES, family


def literal_blocks(text: str) -> list[int]:
    """Lines of every kernel launch ``fn((grid), (block), (args), ...)`` in ``text`` whose
    block is a literal (every element a number), or whose grid or block is a bare number."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Call) and len(node.args) >= 3
                and isinstance(node.args[2], ast.Tuple)):
            continue
        grid, block = node.args[0], node.args[1]
        if not (isinstance(grid, (ast.Tuple, ast.Constant))
                and isinstance(block, (ast.Tuple, ast.Constant))):
            continue
        elts = block.elts if isinstance(block, ast.Tuple) else [block]
        if all(isinstance(e, ast.Constant) for e in elts):
            out.append(node.lineno)
    return out


def test_the_launch_finder_reads_a_planted_launch():
    text = ('f = g\nself._fn("rope", "k")(\n    (t,), (128,), (a, b))\n'
            'info.gemv[e](((n + R - 1) // R,), (32 * R,), (x,))\n'
            'launcher.launch(p, 1, 32, (0, 0), 0, s)\n')
    assert literal_blocks(text) == [2]


def test_no_launch_passes_a_literal_block_size():
    found = [f"{path.name}:{line}" for path in sorted(PKG.glob("*.py"))
             for line in literal_blocks(path.read_text(encoding="utf-8"))]
    assert not found, "literal block sizes (use GEOMETRY):\n" + "\n".join(found)


def test_an_including_family_compiles_with_the_included_geometry():
    # qkv_rope.cu pastes gemv.cu / rope.cu: their -D values must reach it
    opts = nvrtc_options("qkv_rope")
    for fam in FAMILY_INCLUDES["qkv_rope"] + ("qkv_rope",):
        for k, v in GEOMETRY.get(fam, {}).items():
            assert f"-D{k}={v}" in opts, (fam, k)
    assert "-DGEMV_WARPS=8" in opts


def test_load_source_pastes_each_include_once():
    src = load_source("qkv_rope")
    assert src.count("typedef unsigned short half_t;") == 1       # common.cuh once
    assert src.count("__device__ __forceinline__ void kv_write_impl(") == 1         # rope.cu once
    assert src.count("__device__ __forceinline__ void gemv_norm_impl(") == 1        # gemv.cu once
    assert not re.search(r"^#include", src, re.M)                  # and no CUDA header


def test_load_source_names_a_missing_include(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("#pragma once\n")
    (tmp_path / "x.cu").write_text('#include "common.cuh"\n#include "nothere.cu"\n')
    monkeypatch.setattr(cuda_compile, "source_dir", lambda: tmp_path)
    with pytest.raises(ConfigError, match="nothere.cu"):
        load_source("x")


def test_nvrtc_options_carry_the_table():
    opts = nvrtc_options("attention")
    assert opts[0] == "--std=c++17"
    assert "-DPF_Q=64" in opts and "-DDC_THREADS=1024" in opts
    assert ("-DATTN_HEAD_DIM_ENTRIES=" + "".join(f"ATTN_ENTRIES({h})" for h in ATTN_HEAD_DIMS)
            in opts)
    assert nvrtc_options("rope") == ("--std=c++17",) + tuple(
        f"-D{k}={v}" for k, v in GEOMETRY["rope"].items())


def _compile(tmp_path, family: str, options) -> bytes:
    src = tmp_path / f"{family}.cu"
    src.write_text(load_source(family))
    out = tmp_path / f"{family}.cubin"
    opts = [o.replace("--std=", "-std=") for o in options]
    proc = subprocess.run([NVCC, "-arch=sm_90", "-cubin", *opts, "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("family,entries,dims,kernels", [
    ("attention", "ATTN", ATTN_HEAD_DIMS, ("attn_decode", "attn_prefill")),
    ("attention_prefill", "FA", FA_HEAD_DIMS, ("attn_fa",))])
def test_head_dim_option_controls_the_attention_kernels(tmp_path, family, entries, dims,
                                                        kernels):
    full = _compile(tmp_path, family, nvrtc_options(family))
    for hd in dims:
        for mode in KV_KERNEL_MODES:
            for k in kernels:
                assert f"{k}_{mode}_hd{hd}".encode() in full
    only64 = [o for o in nvrtc_options(family) if "HEAD_DIM_ENTRIES" not in o]
    only64.append(f"-D{entries}_HEAD_DIM_ENTRIES={entries}_ENTRIES(64)")
    one = _compile(tmp_path, family, only64)
    assert f"{kernels[0]}_int8_hd64".encode() in one
    assert f"{kernels[0]}_fp16_hd48".encode() not in one


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_store_h_kernels_the_host_launches_exist(tmp_path):
    """Every kernel CudaOps launches for the store-h modes is in the compiled families (the
    write / read per mode, the chunk attention, and rope.cu's Q-only write, plain and step)."""
    kv = _compile(tmp_path, "kv_h", nvrtc_options("kv_h"))
    for mode in H_KERNEL_MODES:
        assert f"h_write_{mode}".encode() in kv and f"h_read_{mode}".encode() in kv
    assert b"h_attn_chunk" in kv
    rope = _compile(tmp_path, "rope", nvrtc_options("rope"))
    assert b"kv_write_qonly" in rope and b"kv_write_step_qonly" in rope


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_an_including_family_compiles_the_included_entries_out(tmp_path):
    # qkv_rope.cu takes gemv.cu's and rope.cu's device code only (TL_DEVICE_ONLY)
    one = _compile(tmp_path, "qkv_rope", nvrtc_options("qkv_rope"))
    assert b"qkv_rope_step_q4_fp16" in one
    assert b"gemv2_q4_f16_l4" not in one and b"kv_write_fp16" not in one


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_gemm_refuses_a_tile_it_was_not_written_for(tmp_path):
    src = tmp_path / "gemm.cu"
    src.write_text(load_source("gemm"))
    proc = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-std=c++17", "-DBM=32", "-o",
                           str(tmp_path / "g.cubin"), str(src)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "64 x 64 tile" in proc.stderr


def test_the_v2_gemv_launch_bound_covers_every_block_size():
    from tinyloop.backends.cuda.choice import GEMV2_THREADS
    assert GEOMETRY["gemv"]["GEMV2_MAX_THREADS"] == max(GEMV2_THREADS)
