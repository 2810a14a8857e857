"""Model configuration and the user's settings, read in one place.

``ModelConfig`` is a frozen dataclass: the dims stored in a .tlm header, plus derived fields.
``SETTINGS`` is the one table of what a user may set through the environment (KV mode,
memory limit, FP16 cache, CUDA graphs; never model dims): each ``Setting`` names its
variable, type, default, parser and meaning, and ``setting(name)`` is the only reader of
``os.environ`` in tinyloop/ (besides ``cache_dir``'s XDG_CACHE_HOME). A bad value raises
``ConfigError`` (a ``ValueError``) naming the variable. Kernel variants are not settings:
they are ``kernels=`` arguments of ``load_model`` (``backends.cuda.KernelChoice``).
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
# Where a layer's RMSNorms sit (f = the attention or the FFN branch, n1/n2 its two norms):
# "pre": x += f(n1(x)) (llama, Nanbeige); "pre_post": x += n2(f(n1(x))) (Ouro's four norms);
# "sandwich": x = n2(x + f(n1(x))) (Huginn's SandwichBlock: the second norm after the add).
LAYER_NORM_KINDS = ("pre", "pre_post", "sandwich")
MAX_LAYERS = 4096           # prelude + recurrent + coda layers a config may declare
MAX_DEPTH = 4096            # the largest max_depth (loops) a config may declare
# What the recurrent state starts from: "prelude" (the prelude output itself), "zeros", or
# "normal": a truncated normal (std ``state_std``, cut at +-3 std) drawn per position from
# ``state_seed`` (backends.base.seeded_state), so equal seeds give equal runs.
STATE_INITS = ("prelude", "zeros", "normal")
# The facts added in .tlm VERSION 2, with the defaults a VERSION 1 file means.
V2_DEFAULTS = {"layer_norms": "pre", "loop_norm": False, "exit_norm": False,
               "state_init": "prelude", "state_std": 0.0, "state_seed": 0, "embed_scale": 1.0,
               "qkv_bias": False, "exit_gate": False, "sliding_window": 0,
               "sliding_layers": ()}
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class ModelConfig:
    """The dims of a looped (recurrent-depth) decoder.

    Layers run as prelude (``n_prelude``) -> recurrent block (``n_recurrent`` layers applied
    ``depth`` times with shared weights) -> coda (``n_coda``) -> final RMSNorm -> LM head.
    A pass at depth d touches ``n_slots(d) = P + R*d + C`` attention slots (KV entries).
    A loop of the whole stack (Ouro, Nanbeige) is P = 0, R = layers, C = 0.

    The architecture facts (VERSION 2; their defaults are today's llama-style loop):
    ``layer_norms`` (LAYER_NORM_KINDS); ``loop_norm``: ``output_norm`` also runs on the state
    between two passes of the recurrent block (Ouro's norm after every loop, Nanbeige's loop
    boundary norm); ``exit_norm``: ``output_norm`` runs on the state leaving the recurrent
    block, before the coda (Huginn's ``ln_f``, used twice); ``state_init`` / ``state_std`` /
    ``state_seed`` (STATE_INITS; ``backends.base.seeded_state``); ``embed_scale``: the
    embedding rows are multiplied by it;
    ``qkv_bias``: a float32 bias over the QKV rows (``blk.{i}.attn_qkv_bias``); ``exit_gate``:
    the file holds Ouro's per-loop exit gate (``exit_gate.weight`` [d], ``exit_gate.bias``
    [1]), which the forward, as vLLM and llama.cpp, does not read (every loop runs);
    ``sliding_window`` (positions, 0 = none) and ``sliding_layers`` (the physical layers that
    attend only to the last ``sliding_window`` positions, the query's own included).
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
    layer_norms: str = "pre"
    loop_norm: bool = False
    exit_norm: bool = False
    state_init: str = "prelude"
    state_std: float = 0.0
    state_seed: int = 0
    embed_scale: float = 1.0
    qkv_bias: bool = False
    exit_gate: bool = False
    sliding_window: int = 0
    sliding_layers: tuple = ()

    def __post_init__(self):
        if isinstance(self.sliding_layers, list):      # from a JSON header
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
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
        if self.n_layers > MAX_LAYERS:
            raise ConfigError(f"{self.n_layers} layers (n_prelude + n_recurrent + n_coda) is "
                              f"over the {MAX_LAYERS}-layer limit")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of "
                              f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if not 1 <= self.default_depth <= self.max_depth:
            raise ConfigError(f"default_depth={self.default_depth} is outside "
                              f"1..max_depth={self.max_depth}")
        if self.max_depth > MAX_DEPTH:
            raise ConfigError(f"max_depth={self.max_depth} is unreasonably large "
                              f"(> {MAX_DEPTH})")
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
        self._validate_arch()

    def _validate_arch(self) -> None:
        """The VERSION 2 facts: kinds, flags, the seeded state, the sliding window."""
        for name, kinds in (("layer_norms", LAYER_NORM_KINDS), ("state_init", STATE_INITS)):
            v = getattr(self, name)
            if not isinstance(v, str) or v not in kinds:
                raise ConfigError(f"{name}={v!r} is not one of {kinds}")
        for name in ("loop_norm", "exit_norm", "qkv_bias", "exit_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("state_std", "embed_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
        if not self.embed_scale > 0:
            raise ConfigError(f"embed_scale must be > 0, got {self.embed_scale!r}")
        if self.state_std < 0 or (self.state_init == "normal") != (self.state_std > 0):
            raise ConfigError(f"state_std={self.state_std!r} must be > 0 exactly when "
                              f"state_init is 'normal' (state_init={self.state_init!r})")
        for name, lo, hi in (("state_seed", 0, (1 << 63) - 1),
                             ("sliding_window", 0, 1 << 24)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{name} must be an int in {lo}..{hi}, got {v!r}")
        if self.state_init != "prelude" and self.n_recurrent == 0:
            raise ConfigError(f"state_init={self.state_init!r} needs a recurrent block")
        if self.state_init != "prelude" and self.injection != "adapter":
            raise ConfigError(f"state_init={self.state_init!r} discards the prelude output, "
                              "so it needs injection='adapter' to feed it to the loop")
        if (self.loop_norm or self.exit_norm) and self.n_recurrent == 0:
            raise ConfigError("loop_norm / exit_norm need a recurrent block (n_recurrent > 0)")
        layers = self.sliding_layers
        if not isinstance(layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ConfigError(f"sliding_layers must be a list of layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.n_layers
                                                      for i in layers):
            raise ConfigError(f"sliding_layers={list(layers)} must be distinct, ascending "
                              f"indices in 0..n_layers-1={self.n_layers - 1}")
        if bool(layers) != (self.sliding_window > 0):
            raise ConfigError(f"sliding_window={self.sliding_window} and sliding_layers="
                              f"{list(layers)} must be given together")

    def window(self, layer: int) -> int:
        """The sliding window of physical layer ``layer`` (positions; 0 = full attention)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def arch_facts(self) -> dict:
        """The VERSION 2 facts that differ from their VERSION 1 meaning (empty for a model a
        VERSION 1 file can hold)."""
        return {k: getattr(self, k) for k, v in V2_DEFAULTS.items() if getattr(self, k) != v}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["sliding_layers"] = list(self.sliding_layers)
        return d

    def identity_dict(self) -> dict:
        """``to_dict`` without the VERSION 2 facts left at their defaults: what a model's
        fingerprint hashes, so a model VERSION 1 could hold keeps its fingerprint (and its
        saved prefix files)."""
        d = self.to_dict()
        for k in V2_DEFAULTS:
            if k not in self.arch_facts:
                del d[k]
        return d

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
# The repetition penalty's window (positions looked back over) when a request names none:
# llama.cpp's repeat_last_n default (HF's processor takes the whole context instead; any
# window up to backends.base.REPEAT_LAST_N_MAX may be asked for).
DEFAULT_REPEAT_LAST_N = 64
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


KV_MODES = ("fp16", "int8", "h_fp16", "h_int8", "h_int4")


def _parse_flag(raw: str, env: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{env}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_kv_mode(raw: str, env: str) -> str:
    v = raw.strip().lower()
    if v not in KV_MODES + ("auto",):
        raise ConfigError(f"{env}={raw!r}: expected one of {KV_MODES} or 'auto'")
    return v


def _parse_limit(raw: str, env: str) -> str:
    """The limit's text, checked as far as it can be without the device total (a
    percentage is resolved by ``memory_limit_from_env``)."""
    text = raw.strip()
    parse_size(text, name=env, total_bytes=None if not text.endswith("%") else 1)
    return text


@dataclass(frozen=True)
class Setting:
    """One user setting: ``name`` (the key of SETTINGS), its environment variable ``env``,
    the ``type`` of its value, the ``default`` when the variable is unset or empty (None:
    the reader decides, e.g. per backend), ``parse(raw, env)`` (raises ConfigError naming
    ``env``) and ``doc`` (what it sets; the README lists the same)."""

    name: str
    env: str
    type: type
    default: object
    parse: object
    doc: str


SETTINGS = {s.name: s for s in (
    Setting("kv_mode", "TINYLOOP_KV_MODE", str, "fp16", _parse_kv_mode,
            "the default kv_mode of load_model: one of KV_MODES or 'auto'"),
    Setting("memory_limit", "TINYLOOP_MEMORY_LIMIT", str, None, _parse_limit,
            "the pool's hard budget: bytes, 512M, 4G or a percentage of the device; unset: "
            "no limit"),
    Setting("fp16_cache", "TINYLOOP_FP16_CACHE", bool, None, _parse_flag,
            "dequantized weight copies for the GEMMs: CUDA FP16 copies of the prefill GEMM "
            "weights (default off), NumPy float32 copies of every weight (default on)"),
    Setting("cuda_graphs", "TINYLOOP_CUDA_GRAPHS", bool, True, _parse_flag,
            "replay the decode step as one captured CUDA graph per key (0: eager launches)"),
)}


def child_environment(updates: dict) -> dict:
    """The environment a child process starts with (the serve router's workers): this
    process's, with ``updates`` (str -> str) set over it. Not a setting: nothing is read from
    it here."""
    env = dict(os.environ)
    env.update(updates)
    return env


def setting(name: str, default=None):
    """The value of setting ``name`` (a key of SETTINGS) from its environment variable,
    parsed; unset or empty: ``default`` when given, else the Setting's default. Raises
    ConfigError naming the variable for a bad value, KeyError for an unknown name."""
    s = SETTINGS[name]
    raw = os.environ.get(s.env)
    if raw is None or raw.strip() == "":
        return s.default if default is None else default
    return s.parse(raw, s.env)


def fp16_cache_enabled(default: bool = False) -> bool:
    """``TINYLOOP_FP16_CACHE`` (``SETTINGS["fp16_cache"]``); unset: ``default`` (the backend's
    ``fp16_cache_default``). Raises ConfigError naming the variable for a non-flag."""
    return bool(setting("fp16_cache", default))


def cuda_graphs_enabled() -> bool:
    """``TINYLOOP_CUDA_GRAPHS`` (``SETTINGS["cuda_graphs"]``, default on). Raises
    ConfigError naming the variable for a non-flag."""
    return bool(setting("cuda_graphs"))


def kv_mode_from_env() -> str:
    """``TINYLOOP_KV_MODE`` (``SETTINGS["kv_mode"]``): the default KV cache storage mode of
    ``load_model`` (unset or empty: "fp16"). Raises ConfigError naming the variable."""
    return setting("kv_mode")


def memory_limit_from_env(total_bytes: int | None) -> int | None:
    """``TINYLOOP_MEMORY_LIMIT`` (``SETTINGS["memory_limit"]``): the pool's hard budget in
    bytes (None when unset; a percentage is of ``total_bytes``). Raises ConfigError naming the
    variable."""
    text = setting("memory_limit")
    if text is None:
        return None
    return parse_size(text, name=SETTINGS["memory_limit"].env, total_bytes=total_bytes)


def cache_dir() -> str:
    """The user's TinyLoop cache folder: ``$XDG_CACHE_HOME/tinyloop`` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tinyloop")
