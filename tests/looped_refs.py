"""Tiny random checkpoints of the published looped architectures, and an independent float64
forward of each, written from the published modeling code (Ouro: LoopedLMs/ouro_rl
modeling_ouro.py; Huginn-0125: seal-rg/recurrent-pretraining raven_modeling_minimal.py;
Nanbeige: llama.cpp src/models/nanbeige.cpp) and calling none of tinyloop's functions: its own
RMSNorm, RoPE (each checkpoint's own convention: rotate-half for Ouro and Nanbeige, adjacent
pairs for Huginn), attention, SwiGLU and loop.

The weights lie on the INT8 grid of ``tinyloop.quant.quantize`` (per group of 32 input
columns: an FP16 scale s and integer codes in -127..127, one of them +-127), so an INT8
conversion holds them exactly and the oracle can run on the checkpoint's own float values.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

GROUP = 32


# --- weights ------------------------------------------------------------------------------
def grid_matrix(rng, rows: int, cols: int, std: float | None = None) -> np.ndarray:
    """float32 [rows, cols] that INT8 group quantization (g = 32) represents exactly: codes in
    -127..127 (one +-127 per group) times a power-of-two scale per group, so every value has
    at most 7 significant bits and BF16 and FP16 hold it exactly too."""
    std = 1.0 / math.sqrt(cols) if std is None else std
    g = cols // GROUP
    q = rng.integers(-127, 128, size=(rows, g, GROUP))
    lead = rng.integers(0, GROUP, size=(rows, g))
    np.put_along_axis(q, lead[..., None], np.where(rng.random((rows, g, 1)) < 0.5, 127, -127),
                      axis=2)
    s = np.exp2(np.round(np.log2(std / 73.0)) + rng.integers(-1, 2, size=(rows, g, 1)))
    return (q * s).astype(np.float32).reshape(rows, cols)


def _mat(exact: bool, rng, rows: int, cols: int, std: float | None = None) -> np.ndarray:
    """``grid_matrix`` with ``exact``, else plain Gaussian weights of the same std (what
    quantization loses on: benchmarks/looped_quant.py)."""
    if exact:
        return grid_matrix(rng, rows, cols, std)
    std = 1.0 / math.sqrt(cols) if std is None else std
    return (std * rng.standard_normal((rows, cols))).astype(np.float32)


def bf16_exact(a) -> np.ndarray:
    """float32 ``a`` rounded to the nearest BF16 value (8 significant bits), as float32."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def norm_weight(rng, d: int) -> np.ndarray:
    """Norm weights near 1 that BF16 and FP16 hold exactly (1 + k / 64)."""
    return (1.0 + rng.integers(-8, 9, d) / 64.0).astype(np.float32)


def small(rng, shape, std=0.1) -> np.ndarray:
    """Small float32 values BF16 and FP16 hold exactly (k / 256, |k| < 128)."""
    return (np.clip(np.round(rng.standard_normal(shape) * std * 256), -127, 127) / 256.0
            ).astype(np.float32)


def save(folder: str, config: dict, tensors: dict, *, shards: int = 1) -> None:
    """config.json and the tensors as one model.safetensors, or ``shards`` files with a
    model.safetensors.index.json (safetensors.numpy.save_file)."""
    from safetensors.numpy import save_file
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(folder, fn))
        weight_map.update({n: fn for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _llama_projections(p, exact, rng, d, heads, kv_heads, head_dim, ffn) -> dict:
    """The q/k/v/o and gate/up/down matrices of layer prefix ``p`` in llama's naming (Ouro and
    Nanbeige), drawn in that order."""
    return {p + "self_attn.q_proj.weight": _mat(exact, rng, heads * head_dim, d),
            p + "self_attn.k_proj.weight": _mat(exact, rng, kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": _mat(exact, rng, kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": _mat(exact, rng, d, heads * head_dim),
            p + "mlp.gate_proj.weight": _mat(exact, rng, ffn, d),
            p + "mlp.up_proj.weight": _mat(exact, rng, ffn, d),
            p + "mlp.down_proj.weight": _mat(exact, rng, d, ffn)}


# --- Ouro -----------------------------------------------------------------------------------
def ouro_checkpoint(seed=0, *, exact=True, d=256, heads=2, kv_heads=2, head_dim=128,
                    ffn=320, layers=2, vocab=96, loops=3, sliding=(1,), window=5, theta=1e6):
    rng = np.random.default_rng(seed)
    cfg = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": d,
           "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "rope_theta": theta, "rope_scaling": None, "tie_word_embeddings": False,
           "total_ut_steps": loops, "vocab_size": vocab, "use_sliding_window": bool(sliding),
           "sliding_window": window if sliding else None, "max_window_layers": layers,
           "layer_types": ["sliding_attention" if i in sliding else "full_attention"
                           for i in range(layers)], "bos_token_id": 1, "eos_token_id": 2}
    t = {"model.embed_tokens.weight": _mat(exact, rng, vocab, d, 1.0),
         "model.norm.weight": norm_weight(rng, d),
         "lm_head.weight": _mat(exact, rng, vocab, d, 2.0 / math.sqrt(d)),
         "model.early_exit_gate.weight": small(rng, (1, d)),
         "model.early_exit_gate.bias": np.array([0.3], np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update(_llama_projections(p, exact, rng, d, heads, kv_heads, head_dim, ffn))
        for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                  "post_attention_layernorm_2"):
            t[p + n + ".weight"] = norm_weight(rng, d)
    return cfg, t


# --- Nanbeige -------------------------------------------------------------------------------
def nanbeige_checkpoint(seed=0, *, exact=True, d=128, heads=4, kv_heads=2, head_dim=64,
                        ffn=192, layers=2, vocab=96, loops=3, skip_loop_final_norm=False, theta=5e5):
    rng = np.random.default_rng(seed)
    cfg = {"architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige",
           "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "rope_theta": theta, "tie_word_embeddings": True, "num_loops": loops,
           "skip_loop_final_norm": skip_loop_final_norm, "vocab_size": vocab}
    t = {"model.embed_tokens.weight": _mat(exact, rng, vocab, d, 0.3),
         "model.norm.weight": norm_weight(rng, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update(_llama_projections(p, exact, rng, d, heads, kv_heads, head_dim, ffn))
        t[p + "input_layernorm.weight"] = norm_weight(rng, d)
        t[p + "post_attention_layernorm.weight"] = norm_weight(rng, d)
    return cfg, t


# --- Huginn ---------------------------------------------------------------------------------
def huginn_checkpoint(seed=0, *, exact=True, d=192, heads=2, ffn=256, prelude=1, core=2,
                      coda=1, vocab=96, recurrence=4, theta=50000.0, adapter_gain=0.7):
    rng = np.random.default_rng(seed)
    std = math.sqrt(2 / (5 * d))
    cfg = {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
           "n_embd": d, "num_attention_heads": heads, "num_key_value_heads": heads,
           "intermediate_size": ffn, "n_layers_in_prelude": prelude,
           "n_layers_in_recurrent_block": core, "n_layers_in_coda": coda,
           "mean_recurrence": recurrence, "norm_eps": 1e-6, "rope_base": theta,
           "qk_bias": True, "bias": False, "tie_embeddings": True, "vocab_size": vocab,
           "padded_vocab_size": vocab, "injection_type": "linear", "state_init": "like-init",
           "test_time_noise": 0, "block_size": 4096,
           "init_values": {"std": std, "embed_scale": math.sqrt(d)}}
    wte = _mat(exact, rng, vocab, d, 0.05)
    t = {"transformer.wte.weight": wte, "lm_head.weight": wte.copy(),
         "transformer.ln_f.weight": norm_weight(rng, d),
         "transformer.adapter.weight": _mat(exact, rng, d, 2 * d, adapter_gain / math.sqrt(d)),
         "freqs_cis": np.zeros((1, 16, 1, d // heads // 2, 2), np.float32)}
    blocks = ([f"transformer.prelude.{i}." for i in range(prelude)]
              + [f"transformer.core_block.{j}." for j in range(core)]
              + [f"transformer.coda.{k}." for k in range(coda)])
    for p in blocks:
        t[p + "attn.Wqkv.weight"] = _mat(exact, rng, 3 * d, d)
        t[p + "attn.qk_bias"] = small(rng, (2, 1, heads, d // heads))
        t[p + "attn.proj.weight"] = _mat(exact, rng, d, d)
        t[p + "mlp.fc.weight"] = _mat(exact, rng, 2 * ffn, d)
        t[p + "mlp.proj.weight"] = _mat(exact, rng, d, ffn)
        for n in ("norm_1", "norm_2", "norm_3", "norm_4"):
            t[p + n + ".weight"] = norm_weight(rng, d)
    return cfg, t


# --- the oracle's pieces (float64) -----------------------------------------------------------
def rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def rope_half(x, pos, theta):
    """HF rotate_half RoPE of x [T, H, hd] (Ouro, Nanbeige's HF layout)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([np.outer(pos, inv)] * 2, axis=1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def rope_pairs(x, pos, theta):
    """Huginn's complex-like RoPE: adjacent pairs (x[2i], x[2i+1]) rotate."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(pos, inv)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = b * np.cos(ang) + a * np.sin(ang)
    return out


def deq8(x, axis_group=None):
    """The documented symmetric INT8 rounding (quant.quantize_rows_int8's rule) over the last
    axis, or over groups of ``axis_group`` along it: s = fp16(max|x| / 127) in float32,
    q = rint(x / s), read back q * s."""
    x = np.asarray(x, np.float32)
    shape = x.shape
    if axis_group:
        x = x.reshape(*shape[:-1], shape[-1] // axis_group, axis_group)
    s = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(s > 0, np.rint(x / s), 0.0)
    return (np.clip(q, -127, 127) * s).astype(np.float64).reshape(shape)


def stored_h(h, mode):
    """What attention rebuilds K and V from in a store-h KV mode (else ``h`` itself)."""
    if mode == "h_fp16":
        return np.asarray(h, np.float32).astype(np.float16).astype(np.float64)
    if mode == "h_int8":
        return deq8(h, 32)
    return h


def stored_kv(k, v, mode):
    """K (after RoPE) and V as the int8 KV mode reads them back: per position and head."""
    if mode == "int8":
        return deq8(k), deq8(v)
    return k, v


def attend(q, k, v, window=None):
    """Causal attention (optionally sliding: key j visible to query i when i - window < j)."""
    T, H, hd = q.shape
    g = H // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    bad = j > i
    if window:
        bad |= j <= i - window
    s = np.where(bad[None], -np.inf, s)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(T, H * hd)


def silu(x):
    return x / (1.0 + np.exp(-x))


def f64(t):
    return {k: np.asarray(v, np.float64) for k, v in t.items()}


def llama_attention(t, p, h, cfg, mode=None, window=None):
    """The llama-style attention branch of layer prefix ``p`` (q/k/v/o_proj, rotate-half RoPE
    at positions 0..T-1, K/V as ``mode`` stores them) over the normed rows ``h`` [T, d]: the
    o_proj output [T, d] (Ouro and Nanbeige share it)."""
    T = len(h)
    H, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pos, theta = np.arange(T), cfg["rope_theta"]
    hk = stored_h(h, mode)
    q = rope_half((h @ t[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd), pos, theta)
    k = rope_half((hk @ t[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, hd), pos, theta)
    v = (hk @ t[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, hd)
    k, v = stored_kv(k, v, mode)
    return attend(q, k, v, window) @ t[p + "self_attn.o_proj.weight"].T


def ouro_logits(cfg, t, ids, loops, mode=None):
    """Ouro's forward (decoder layer with four norms; self.norm after every loop feeding the
    next; lm_head on the normed state) at ``loops`` loops."""
    t = f64(t)
    eps = cfg["rms_norm_eps"]
    x = t["model.embed_tokens.weight"][ids]
    for _ in range(loops):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms(x, t[p + "input_layernorm.weight"], eps)
            win = cfg["sliding_window"] if cfg["layer_types"][i] == "sliding_attention" \
                else None
            a = llama_attention(t, p, h, cfg, mode, win)
            x = x + rms(a, t[p + "input_layernorm_2.weight"], eps)
            h = rms(x, t[p + "post_attention_layernorm.weight"], eps)
            m = (silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
                 ) @ t[p + "mlp.down_proj.weight"].T
            x = x + rms(m, t[p + "post_attention_layernorm_2.weight"], eps)
        x = rms(x, t["model.norm.weight"], eps)
    return x @ t["lm_head.weight"].T


def nanbeige_logits(cfg, t, ids, loops, mode=None):
    """nanbeige.cpp's graph: llama layers over n_loops passes, output_norm at each loop
    boundary unless skip_loop_final_norm, then result_norm and the (tied) output."""
    t = f64(t)
    eps = cfg["rms_norm_eps"]
    x = t["model.embed_tokens.weight"][ids]
    for lp in range(loops):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms(x, t[p + "input_layernorm.weight"], eps)
            x = x + llama_attention(t, p, h, cfg, mode)
            h = rms(x, t[p + "post_attention_layernorm.weight"], eps)
            x = x + (silu(h @ t[p + "mlp.gate_proj.weight"].T)
                     * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        if lp + 1 < loops and not cfg["skip_loop_final_norm"]:
            x = rms(x, t["model.norm.weight"], eps)
    x = rms(x, t["model.norm.weight"], eps)
    return x @ t["model.embed_tokens.weight"].T


_M = (1 << 64) - 1


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def documented_state(T: int, d: int, std: float, seed: int) -> np.ndarray:
    """The seeded initial state as docs/format.md specifies it, in plain Python integers:
    element (p, i) is std * z, z the first Box-Muller draw within +-3 over the uniforms
    mix(base ^ 2a) and mix(base ^ (2a + 1)) (top 53 bits), base = mix(mix(mix(seed) ^ p) ^
    (i << 8)), mix = SplitMix64's output function."""
    out = np.zeros((T, d))
    for p in range(T):
        for i in range(d):
            base = _mix(_mix(_mix(seed) ^ p) ^ ((i << 8) & _M))
            for a in range(64):
                u1 = (_mix(base ^ (2 * a)) >> 11) * 2.0 ** -53
                u2 = (_mix(base ^ (2 * a + 1)) >> 11) * 2.0 ** -53
                z = math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(2.0 * math.pi * u2)
                if abs(z) <= 3.0:
                    out[p, i] = z
                    break
    return out * std


def huginn_logits(cfg, t, ids, steps, mode=None, state_seed=0):
    """raven_modeling_minimal.py's forward at ``steps`` recurrences: wte * embed_scale,
    prelude SandwichBlocks, state = the seeded truncated normal (times embed_scale), each step
    adapter(cat[state, prelude out]) then the core blocks, ln_f, coda, ln_f, tied head."""
    t = f64(t)
    d, H = cfg["n_embd"], cfg["num_attention_heads"]
    hd, eps, theta, T = d // H, cfg["norm_eps"], cfg["rope_base"], len(ids)
    pos = np.arange(T)
    scale = cfg["init_values"]["embed_scale"]

    def block(x, p):
        h = rms(x, t[p + "norm_1.weight"], eps)
        q = (h @ t[p + "attn.Wqkv.weight"].T)[:, :d]
        _, k, v = np.split(stored_h(h, mode) @ t[p + "attn.Wqkv.weight"].T, 3, axis=1)
        q = q.reshape(T, H, hd) + t[p + "attn.qk_bias"][0]
        k = k.reshape(T, H, hd) + t[p + "attn.qk_bias"][1]
        k, v = stored_kv(rope_pairs(k, pos, theta), v.reshape(T, H, hd), mode)
        a = attend(rope_pairs(q, pos, theta), k, v)
        x = rms(a @ t[p + "attn.proj.weight"].T + x, t[p + "norm_2.weight"], eps)
        h = rms(x, t[p + "norm_3.weight"], eps)
        g, u = np.split(h @ t[p + "mlp.fc.weight"].T, 2, axis=1)
        return rms((silu(g) * u) @ t[p + "mlp.proj.weight"].T + x, t[p + "norm_4.weight"], eps)

    e = t["transformer.wte.weight"][ids] * scale
    for i in range(cfg["n_layers_in_prelude"]):
        e = block(e, f"transformer.prelude.{i}.")
    x = documented_state(T, d, cfg["init_values"]["std"] * scale, state_seed)
    for _ in range(steps):
        x = np.concatenate([x, e], axis=1) @ t["transformer.adapter.weight"].T
        for j in range(cfg["n_layers_in_recurrent_block"]):
            x = block(x, f"transformer.core_block.{j}.")
    x = rms(x, t["transformer.ln_f.weight"], eps)
    for c in range(cfg["n_layers_in_coda"]):
        x = block(x, f"transformer.coda.{c}.")
    x = rms(x, t["transformer.ln_f.weight"], eps)
    return x @ t["transformer.wte.weight"].T


def kl_rows(p_logits, q_logits) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, float64."""
    a = np.asarray(p_logits, np.float64)
    b = np.asarray(q_logits, np.float64)
    la = a - a.max(1, keepdims=True)
    la -= np.log(np.exp(la).sum(1, keepdims=True))
    lb = b - b.max(1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(1, keepdims=True))
    return (np.exp(la) * (la - lb)).sum(1)


ARCHS = {"ouro": (ouro_checkpoint, ouro_logits, "total_ut_steps"),
         "huginn": (huginn_checkpoint, huginn_logits, "mean_recurrence"),
         "nanbeige": (nanbeige_checkpoint, nanbeige_logits, "num_loops")}
