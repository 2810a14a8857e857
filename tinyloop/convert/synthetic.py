"""Synthetic random looped models of any dims, deterministic from a seed (tests, benchmarks).

``synthetic_weights(cfg, seed)`` draws float32 weights with ``numpy.random.default_rng(seed)``
in a fixed order, quantizes them (INT4 or INT8, group g) and ``write_synthetic`` stores them as a
.tlm file. Scales keep the residual stream O(1) at any depth: projection weights ~ N(0, 1/in),
norm weights ~ 1 + N(0, 0.02^2), embeddings ~ N(0, 4/d) (logits of std ~2), and the injection adapter is
[0.5*I + N(0, 0.1/2d) | 0.5*I + N(0, 0.1/2d)] so that looping stays bounded.

When ``vocab_size >= 258`` a byte-level BPE tokenizer is embedded (256 byte tokens, ``<|bos|>``
= 256, ``<|eos|>`` = 257, then merges of byte pairs to fill the vocabulary) so text prompts
work; smaller vocabularies get no tokenizer (prompts are token ids).
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..format import expected_tensors, write_tlm
from ..quant import quantize

SMOLLM2_DIMS = dict(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                    ffn_dim=1536, n_prelude=10, n_recurrent=10, n_coda=10, rope_theta=100000.0,
                    norm_eps=1e-5, tied_head=True)


def float_tensor(rng, name: str, shape) -> np.ndarray:
    """A random float32 tensor of ``expected_tensors``' "float" kind: biases and the exit gate
    near 0, norm weights near 1 (N(base, 0.02^2))."""
    base = 0.0 if name.endswith("_bias") or name.startswith("exit_gate.") else 1.0
    return (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)


def synthetic_weights(cfg: ModelConfig, seed: int, bits: int = 4,
                      group_size: int = 32) -> dict:
    """Name -> QuantWeight / float32 array for every tensor ``cfg`` needs (deterministic)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (kind, shape) in expected_tensors(cfg).items():
        if kind == "float":
            out[name] = float_tensor(rng, name, shape)
            continue
        rows, cols = shape
        if name == "inject.adapter":
            d = cfg.d_model
            w = 0.1 / np.sqrt(cols) * rng.standard_normal(shape)
            w[:, :d] += 0.5 * np.eye(d)
            w[:, d:] += 0.5 * np.eye(d)
        elif name in ("token_embd", "output"):
            w = 2.0 / np.sqrt(cols) * rng.standard_normal(shape)   # logits ~ N(0, 2^2)
        else:
            w = rng.standard_normal(shape) / np.sqrt(cols)
        out[name] = quantize(w.astype(np.float32), bits, group_size)
    return out


def byte_level_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE (tokenizers JSON) with exactly ``vocab_size`` ids (>= 258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())              # the 256 byte symbols
    vocab = {s: i for i, s in enumerate(alphabet)}
    specials = ["<|bos|>", "<|eos|>"]
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    merges = []
    n_merges = vocab_size - 256 - len(specials)
    for a in alphabet:
        for b in alphabet:
            if len(merges) >= n_merges:
                break
            merges.append((a, b))
    for k, (a, b) in enumerate(merges):
        vocab[a + b] = 256 + len(specials) + k
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)      # already in the vocab: they keep ids 256 and 257
    return tok.to_str()


def synthetic_config(seed_dims: dict | None = None, **overrides) -> ModelConfig:
    """A ModelConfig from SmolLM2-like defaults (``SMOLLM2_DIMS``) updated with overrides."""
    d = dict(SMOLLM2_DIMS if seed_dims is None else seed_dims)
    d.update(overrides)
    return ModelConfig(**d)


def write_synthetic(path, cfg: ModelConfig, seed: int = 0, bits: int = 4,
                    group_size: int = 32, tokenizer: bool = True) -> ModelConfig:
    """Write a deterministic random .tlm model for ``cfg``; returns the config written."""
    tok_json = None
    if tokenizer and cfg.vocab_size >= 258:
        tok_json = byte_level_tokenizer_json(cfg.vocab_size)
        if cfg.bos_token_id == -1 and cfg.eos_token_id == -1:
            cfg = ModelConfig(**{**cfg.to_dict(), "bos_token_id": 256, "eos_token_id": 257})
    write_tlm(path, cfg, synthetic_weights(cfg, seed, bits, group_size),
              tokenizer_json=tok_json, chat_template="",
              metadata={"source": "synthetic", "seed": seed, "bits": bits,
                        "group_size": group_size})
    return cfg
