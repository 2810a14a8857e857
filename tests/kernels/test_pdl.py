"""Programmatic dependent launch: the kernels the CUDA backend launches with PDL inside a
captured decode step all wait for their predecessor before touching its output, and the
driver structures are laid out as cuda.h declares them. CPU-only (source and ctypes checks);
tests/model/test_cuda_graphs.py runs the captured step with PDL on and off."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from tinyloop.backends.cuda import compile as cuda_compile
from tinyloop.backends.cuda import launch as cuda_launch
from tinyloop.errors import ConfigError

SRC = Path(cuda_compile.__file__).resolve().parent / "kernels"
_ENTRY = re.compile(r'extern "C" __global__ void(?:[\s\\]+__launch_bounds__\((?:[^()]|\([^()]*\))*\))?'
                    r'[\s\\]+([\w#]+)\s*\(')


def _entries():
    """(file, kernel-name prefix, the entry's first statements) of every kernel entry; a
    macro-made entry named by a parameter (NAME) is resolved through the macro's uses."""
    out = []
    for path in sorted(SRC.glob("*.cu")):
        text = path.read_text(encoding="utf-8")
        for m in _ENTRY.finditer(text):
            name = m.group(1)
            open_ = text.index("{", m.end())
            body = text[open_:open_ + 400]
            if name == "NAME":     # resolve: the #define holding it, then its invocations
                start = text.rfind("#define", 0, m.start())
                macro = re.match(r"#define (\w+)\(", text[start:]).group(1)
                for use in re.finditer(rf"\b{macro}\(\s*([\w#]+)", text[open_:]):
                    out.append((path.name, use.group(1).split("##")[0], body))
            else:
                out.append((path.name, name.split("##")[0], body))
    return out


# The bodies that load ahead of the wait: (function, its preload, what first touches the
# predecessor's output). The wait must sit between the two. The GEMVs preload weights; the
# split-K attention preloads K / V rows of earlier positions (attention_decode.cu); the
# sampler's first kernel reads its host parameters and the penalty window (sample.cu).
_PRELOADING = (("gemv2_body", "gemv2_load<BITS, TWO>", ("norm_row_v256(", "= (const uint4*)xin")),
               ("gemv_impl", "gemv_prefetch_row<", ("gemv_row<", "__ldcg(", "gemv_row_acc<")),
               ("gemv_norm_impl", "gemv_prefetch_row<", ("norm_row_to_shared(",)),
               ("gemv_rows_impl", "gemv_prefetch_row<", ("chunk_dot_q<", "gemv_store<")),
               ("gemv_mma_impl", "prefetch_l1(", ("X[ct] = t < T", "gemv_store<")),
               ("gemv_tc_body", "load_round(0);", ("tc_stage<NORM>(", "gemv_store<")),
               ("qkv_rope_impl", "gemv_prefetch_row<", ("norm_row_to_shared(", "qkv[")),
               ("attn_split_step", "ds_load<MODE, HD>(ch", ("ds_load_key<", "attn_split_unit<")),
               ("kv_write_impl", "kv_page_w(", ("row[e]", "v[j]", "kv_int8_rows_block(")),
               ("sample_params_impl", "ring[(pos - j) % N]", ("sc->prm[", "sc->win[")))


def _preloads_then_waits(func: str, preload: str, touches) -> bool:
    text = next(t for t in (p.read_text(encoding="utf-8") for p in sorted(SRC.glob("*.cu")))
                if f"__device__ __forceinline__ void {func}(" in t)
    start = text.index(f"__device__ __forceinline__ void {func}(")
    body = text[start:text.index("\n}\n", start)]
    enter = body.index("TL_PDL_ENTER();")
    return body.index(preload) < enter < min(body.index(t) for t in touches)


def test_every_pdl_kernel_waits_for_its_predecessor():
    entries = _entries()
    assert len(entries) > 60                       # the parse found the macro-made entries too
    pdl = [(f, n, b) for f, n, b in entries if n.startswith(cuda_launch.PDL_KERNELS)]
    for prefix in cuda_launch.PDL_KERNELS:            # no stale prefix
        assert any(n.startswith(prefix) for _, n, _ in pdl), prefix
    for f, n, body in pdl:
        first = body[1:].lstrip(" \t\n\\")
        call = body.split(";")[0]
        waits = first.startswith("TL_PDL_ENTER();") or any(
            f"{fn}<" in call or f"{fn}(" in call for fn, _, _ in _PRELOADING)
        assert waits, f"{f}: {n}* is launched with PDL but does not start with TL_PDL_ENTER"
    for fn, preload, touches in _PRELOADING:
        assert _preloads_then_waits(fn, preload, touches), fn


def test_the_prefill_kernels_are_not_pdl_launched():
    names = {n for _, n, _ in _entries()}
    for n in names:
        if n.startswith(("attn_prefill", "gemm", "h_", "rmsnorm")):
            assert not n.startswith(cuda_launch.PDL_KERNELS), n


def test_driver_structures_match_cuda_h():
    # CUlaunchAttribute: id (4) + pad (4) + value union (64); CUlaunchConfig: 7 uints, then
    # the stream handle at offset 32, attrs at 40, numAttrs at 48; 56 bytes in all (x86-64)
    assert ctypes.sizeof(cuda_launch._CULaunchAttribute) == 72
    assert cuda_launch._CULaunchAttribute.value.offset == 8
    assert cuda_launch._CULaunchConfig.hStream.offset == 32
    assert cuda_launch._CULaunchConfig.attrs.offset == 40
    assert cuda_launch._CULaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(cuda_launch._CULaunchConfig) == 56


def test_kernel_arguments_pack_as_cupy_packs_them():
    assert cuda_launch._kernel_arg(-3).value == -3
    assert isinstance(cuda_launch._kernel_arg(7), ctypes.c_int64)
    assert isinstance(cuda_launch._kernel_arg(0.5), ctypes.c_double)
    raw = bytes(cuda_launch._kernel_arg(np.float32(1.5)))
    assert raw == np.float32(1.5).tobytes()
    assert bytes(cuda_launch._kernel_arg(np.int32(-2))) == np.int32(-2).tobytes()
    with pytest.raises(ConfigError, match="bool"):
        cuda_launch._kernel_arg(True)
    with pytest.raises(ConfigError, match="str"):
        cuda_launch._kernel_arg("x")
    assert cuda_launch._dim3(5) == (5, 1, 1)
    assert cuda_launch._dim3((2, 3)) == (2, 3, 1)
    with pytest.raises(ConfigError):
        cuda_launch._dim3((1, 1, 1, 1))


def test_the_step_state_layout_in_rope_cu_matches_base():
    """rope.cu reads the step state's RoPE table words by the numbers base.py defines (the
    table decode_step_advance writes and kv_write_step / qkv_rope.cu copy): one owner, checked."""
    from tinyloop.backends import base
    text = (SRC / "rope.cu").read_text(encoding="utf-8")
    got = {k: int(v) for k, v in re.findall(r"#define (STEP_\w*) (\d+)", text)}
    assert got == {"STEP_POS": base.STEP_POS, "STEP_ROPE_POS": base.STEP_ROPE_POS,
                   "STEP_ROPE": base.STEP_ROPE, "STEP_ROPE_MAX": base.STEP_ROPE_MAX}
    assert base.STEP_WORDS == base.STEP_ROPE + base.STEP_ROPE_MAX
    assert base.STEP_ROPE_POS not in (base.STEP_ID, base.STEP_FAULT, base.STEP_POS)
