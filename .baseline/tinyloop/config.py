"""Model configuration and the environment knobs, parsed in one place.

``ModelConfig`` is a frozen dataclass: the dims stored in a .tlm header, plus derived fields.
Environment variables are operational knobs only (never model dims); each is parsed by one
function here that raises ``ConfigError`` (a ``ValueError``) naming the variable on bad input.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

INJECTION_KINDS = ("none", "adapter")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class ModelConfig:
    """The dims of a looped (recurrent-depth) decoder.

    Layers run as prelude (``n_prelude``) -> recurrent block (``n_recurrent`` layers applied
    ``depth`` times with shared weights) -> coda (``n_coda``) -> final RMSNorm -> LM head.
    A pass at depth d touches ``n_slots(d) = P + R*d + C`` attention slots (KV entries).
    """

    vocab_size: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    n_prelude: int
    n_recurrent: int
    n_coda: int
    default_depth: int = 1
    max_depth: int = 1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    injection: str = "none"
    tied_head: bool = True
    bos_token_id: int = -1
    eos_token_id: int = -1

    def __post_init__(self):
        self.validate()

    # -- derived -------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """Distinct layers with their own weights: P + R + C."""
        return self.n_prelude + self.n_recurrent + self.n_coda

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused QKV projection: q_dim + 2 * kv_dim."""
        return self.q_dim + 2 * self.kv_dim

    def n_slots(self, depth: int) -> int:
        """Attention slots (layer, iteration) touched at ``depth``: P + R*depth + C."""
        return self.n_prelude + self.n_recurrent * depth + self.n_coda

    def check_depth(self, depth: int | None) -> int:
        """Resolve ``None`` to the default depth; raise ConfigError outside 1..max_depth."""
        if depth is None:
            return self.default_depth
        if isinstance(depth, bool) or not hasattr(depth, "__index__"):
            raise ConfigError(f"depth must be an int, got {depth!r}")
        depth = depth.__index__()          # Python or NumPy integer
        if not 1 <= depth <= self.max_depth:
            raise ConfigError(f"depth={depth} is outside 1..max_depth={self.max_depth}")
        return depth

    def validate(self) -> None:
        """Raise ConfigError when the dims are inconsistent."""
        ints = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "n_prelude", "n_recurrent", "n_coda", "default_depth", "max_depth",
                "bos_token_id", "eos_token_id")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an int, got {v!r}")
        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("n_prelude", "n_recurrent", "n_coda"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.n_recurrent == 0 and self.max_depth != 1:
            raise ConfigError("a model with n_recurrent=0 must have max_depth=1")
        if self.n_layers == 0:
            raise ConfigError("the model has no layers (n_prelude + n_recurrent + n_coda == 0)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of "
                              f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if not 1 <= self.default_depth <= self.max_depth:
            raise ConfigError(f"default_depth={self.default_depth} is outside "
                              f"1..max_depth={self.max_depth}")
        if self.max_depth > 4096:
            raise ConfigError(f"max_depth={self.max_depth} is unreasonably large (> 4096)")
        if not isinstance(self.injection, str) or self.injection not in INJECTION_KINDS:
            raise ConfigError(f"injection={self.injection!r} is not one of {INJECTION_KINDS}")
        if self.injection == "adapter" and self.n_recurrent == 0:
            raise ConfigError("injection='adapter' needs a recurrent block (n_recurrent > 0)")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not 0 < self.norm_eps < 1:
            raise ConfigError(f"norm_eps must be in (0, 1), got {self.norm_eps!r}")
        if not isinstance(self.tied_head, bool):
            raise ConfigError(f"tied_head must be true or false, got {self.tied_head!r}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if not -1 <= v < self.vocab_size:
                raise ConfigError(f"{name}={v} is outside -1..vocab_size-1")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a header dict; unknown or missing keys raise ConfigError."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown config keys: {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # a required dim is missing
            raise ConfigError(f"incomplete config: {e}") from None


# --- environment knobs -----------------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# max_new_tokens of Model.generate / stream and of the tinyloop CLI
DEFAULT_MAX_NEW_TOKENS = 64
MAX_SEQ_LEN_LIMIT = 1 << 24    # 16M positions: far past any model here, far below overflow


def as_int(v, name: str) -> int:
    """An int (Python or NumPy integer, not bool) or ConfigError naming ``name``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ConfigError(f"{name} must be an int, got {v!r}")
    return int(v)


def check_load_args(max_seq_len, prefill_chunk) -> tuple[int, int]:
    """Validate ``load_model``'s sizes (Python or NumPy ints); return them as ints.

    Raises ConfigError: max_seq_len outside 1..MAX_SEQ_LEN_LIMIT, prefill_chunk < 0 or above
    the same limit.
    """
    for name, v, lo in (("max_seq_len", max_seq_len, 1), ("prefill_chunk", prefill_chunk, 0)):
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ConfigError(f"{name} must be an int, got {v!r}")
        if not lo <= v.__index__() <= MAX_SEQ_LEN_LIMIT:
            raise ConfigError(f"{name}={v} is outside {lo}..{MAX_SEQ_LEN_LIMIT}")
    return max_seq_len.__index__(), prefill_chunk.__index__()


def parse_size(text: str, *, name: str = "size", total_bytes: int | None = None) -> int:
    """Parse ``"123"``, ``"512K"``, ``"1.5G"``, ``"2GiB"`` or ``"40%"`` into bytes.

    Suffixes are binary (K = 1024). A percentage needs ``total_bytes`` (of the device).
    Raises ConfigError naming ``name`` on bad input.
    """
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ConfigError(f"{name}={text!r}: bad percentage") from None
        if not 0 < pct <= 100:
            raise ConfigError(f"{name}={text!r}: percentage must be in (0, 100]")
        if total_bytes is None:
            raise ConfigError(f"{name}={text!r}: a percentage needs the device total")
        return int(total_bytes * pct / 100.0)
    m = _SIZE_RE.match(s)
    if not m:
        raise ConfigError(f"{name}={text!r}: expected bytes with an optional K/M/G/T suffix "
                          "or a percentage like '50%'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return int(value)


def _env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def fp16_cache_enabled(default: bool = False) -> bool:
    """``TINYLOOP_FP16_CACHE``: keep dequantized copies of weights for the GEMMs.

    CUDA: FP16 copies of the hot prefill GEMM weights (default off). NumPy reference: float32
    copies of every quantized weight (default on: without them every GEMM dequantizes its
    weight first, which makes decode many times slower; the README gives the measured factor
    for the default model). Raises ConfigError naming the variable for a non-flag.
    """
    return _env_flag("TINYLOOP_FP16_CACHE", default)


def cuda_graphs_enabled(default: bool = True) -> bool:
    """``TINYLOOP_CUDA_GRAPHS``: replay the decode step as one captured CUDA graph per key
    (default on; 0 keeps the eager path, one launch per kernel from Python). Raises
    ConfigError naming the variable for a value that is not a flag."""
    return _env_flag("TINYLOOP_CUDA_GRAPHS", default)


def pdl_enabled(default: bool = True) -> bool:
    """``TINYLOOP_PDL``: capture the decode step's kernels with programmatic dependent launch
    (PDL: cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, on GPUs
    of compute capability 9.0 and later), so each kernel's blocks start, and load their
    weights, while the kernel before it still runs (cuda_src/common.cuh ``pdl_wait``). Default
    on; 0 captures plain launches. Eager launches never use it. Raises ConfigError naming the
    variable for a value that is not a flag."""
    return _env_flag("TINYLOOP_PDL", default)


def fused_qkv_rope_enabled(default: bool = True) -> bool:
    """``TINYLOOP_FUSED_QKV_ROPE``: in a decode step with fp16 KV pages, run RMSNorm + the QKV
    GEMV + RoPE + the K/V page write as one kernel (cuda_src/qkv_rope.cu) instead of the fused
    RMSNorm-GEMV then kv_write_step (default on; 0 keeps the pair, the kernel's reference).
    Raises ConfigError naming the variable for a value that is not a flag."""
    return _env_flag("TINYLOOP_FUSED_QKV_ROPE", default)


def megakernel_enabled(default: bool = False) -> bool:
    """``TINYLOOP_MEGAKERNEL``: run an eligible decode step as the persistent megakernel, one
    cooperative launch per token (tinyloop/megakernel.py; 0 or unset: the captured graph, then
    eager). Off by default: on the H200 it measured slower than the captured graph (real
    SmolLM2, depth 1: 887 tok/s at 3 blocks/SM against 1,567; per phase of a layer slot A 8.5,
    B 7.8, C 3.3, D 6.8, E 3.6 us with ~1 us barriers: benchmarks/profile_mega.py,
    docs/architecture.md). Raises ConfigError naming the variable for a non-flag."""
    return _env_flag("TINYLOOP_MEGAKERNEL", default)


MEGA_BLOCKS_PER_SM = 0     # default cap of the megakernel's blocks per SM (0 = as many as fit:
                           # 865 tok/s at 3/SM against 769 at 2/SM and 683 at 1/SM, H200)


def megakernel_blocks_per_sm() -> int:
    """``TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM``: at most this many megakernel blocks per SM (an
    int 1..32; 0 = as many as fit, the occupancy; unset: MEGA_BLOCKS_PER_SM). Fewer blocks make
    each grid barrier cheaper, more give the GEMV phases more warps. Raises ConfigError naming
    the variable for anything else."""
    raw = os.environ.get("TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM", "").strip()
    if raw == "":
        return MEGA_BLOCKS_PER_SM
    try:
        val = int(raw)
    except ValueError:
        val = -1
    if not 0 <= val <= 32:
        raise ConfigError(f"TINYLOOP_MEGAKERNEL_BLOCKS_PER_SM={raw!r}: expected an int 0..32 "
                          "(0 = the occupancy)")
    return val


KV_MODES = ("fp16", "int8", "h_fp16", "h_int8", "h_int4")


def kv_mode_from_env() -> str:
    """``TINYLOOP_KV_MODE``: the default KV cache storage mode of ``load_model`` (one of
    KV_MODES or "auto"; unset or empty: "fp16"). Raises ConfigError naming the variable."""
    raw = os.environ.get("TINYLOOP_KV_MODE")
    if raw is None or raw.strip() == "":
        return "fp16"
    v = raw.strip().lower()
    if v not in KV_MODES + ("auto",):
        raise ConfigError(f"TINYLOOP_KV_MODE={raw!r}: expected one of {KV_MODES} or 'auto'")
    return v


def memory_limit_from_env(total_bytes: int | None) -> int | None:
    """``TINYLOOP_MEMORY_LIMIT``: the pool's hard budget in bytes (None when unset)."""
    raw = os.environ.get("TINYLOOP_MEMORY_LIMIT")
    if raw is None or raw.strip() == "":
        return None
    return parse_size(raw, name="TINYLOOP_MEMORY_LIMIT", total_bytes=total_bytes)


def cache_dir() -> str:
    """The user's TinyLoop cache folder: ``$XDG_CACHE_HOME/tinyloop`` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tinyloop")
