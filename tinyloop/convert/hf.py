"""Hugging Face folder (config.json + .safetensors) -> .tlm, for the looped architectures.

``convert_hf(src_dir, dst, bits=4, group_size=32)`` reads ``config.json``, the weights of one
``model.safetensors``, of the shards named by ``model.safetensors.index.json``, or of every
``*.safetensors`` file in the folder (F32 / F16 / BF16), an optional ``tokenizer.json``
(+ the chat template of ``chat_template.jinja``, else ``tokenizer_config.json``) and an
optional ``generation_config.json``, whose ``eos_token_id`` (an id or a list: what
transformers' ``generate`` stops at) goes into the metadata's ``eos_token_ids``, each ending a
generation beside the config's eos. ``config.json``'s ``architectures`` (else its
``model_type``) picks the name map:

- ``OuroForCausalLM`` (model_type ``ouro``): the whole stack loops ``total_ut_steps`` times
  (P = 0, R = layers, C = 0, default = max depth = total_ut_steps), four norms per layer
  (``layer_norms="pre_post"``), the final norm after every loop (``loop_norm``), the exit gate
  kept (``exit_gate``), sliding-window layers from ``layer_types`` / ``max_window_layers``.
- ``RavenForCausalLM`` (model_type ``huginn_raven``, Huginn-0125): prelude / core block / coda,
  SandwichBlock norms (``layer_norms="sandwich"``), ``ln_f`` on the state leaving the loop and
  after the coda (``exit_norm``), the adapter over concat(state, prelude output)
  (``injection="adapter"``), the seeded truncated-normal initial state (``state_init="normal"``,
  std ``init_values.std * init_values.embed_scale``, seed ``state_seed``), the embedding scale,
  the Q/K bias (``qk_bias``; V's bias rows are 0), tied head; default depth
  ``mean_recurrence``.
- ``NanbeigeForCausalLM`` (model_type ``nanbeige``): llama names, the stack loops
  ``num_loops`` times (``len(loop_loss_weights) + 1`` when that list is not empty, as the
  published modeling code counts them), the final norm at each loop boundary unless
  ``skip_loop_final_norm`` (``loop_norm``), as llama.cpp's src/models/nanbeige.cpp. The
  modeling code's other options (shared-KV loops, double-loop split, hyper-connections /
  mHC, depth attention, QK layer norm, n-gram embeddings, sliding-window layers:
  ``NANBEIGE_OPTIONS``) are off in the released checkpoints and not run here: a config that
  turns one on is refused, never run without it.

Another architecture is a ConversionError "unsupported architecture X". RoPE: Ouro and
Nanbeige store Q/K rows in rotate-half (NeoX) order, so their rows (and Q/K bias) are
permuted to the interleaved-pair order of TinyLoop's RoPE (llama.cpp's ``LlamaModel.permute``);
Huginn already rotates adjacent pairs.

Files from outside are hostile: every size, count, shape and offset of config.json, the index
and each safetensors header is checked against the file's length with Python integers (no
overflow) before anything is read or allocated (:func:`check_safetensors`); each failure is a
ConversionError naming the file and the field. Only then does the ``safetensors`` library read
F32 / F16 tensors; BF16 (which NumPy has no dtype for) is read from the checked byte range and
widened to float32.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct

import numpy as np

from ..config import GROUP_SIZES, MAX_DEPTH, MAX_LAYERS, ModelConfig
from ..errors import ConfigError, ConversionError, FormatError
from ..fileio import NotRegularFileError, open_regular
from ..format import expected_tensors, write_tlm
from ..quant import quantize

CONVERTER_VERSION = 3           # bump when convert_hf's output changes for the same input
MAX_JSON_BYTES = 16 << 20       # config.json, the index, tokenizer_config.json
MAX_TOKENIZER_BYTES = 64 << 20
MAX_HEADER_BYTES = 100 << 20    # a safetensors header larger than this is refused
MAX_ENTRIES = 1 << 20           # tensors in one header
MAX_RANK = 8
MAX_DIM = 1 << 24               # any one config dim
MAX_EOS_IDS = 64                # generation_config.json eos_token_id entries
INDEX_NAME = "model.safetensors.index.json"
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
FLOAT_DTYPES = ("F32", "F16", "BF16")
ARCHITECTURES = {"OuroForCausalLM": "ouro", "RavenForCausalLM": "huginn",
                 "NanbeigeForCausalLM": "nanbeige"}
MODEL_TYPES = {"ouro": "ouro", "huginn_raven": "huginn", "nanbeige": "nanbeige"}


# --------------------------------------------------------------------------------------------
# The hostile-file checks
# --------------------------------------------------------------------------------------------
def _regular_size(path: str, what: str) -> int:
    """The byte size of ``path``; ConversionError when it cannot be stat'ed or is not a
    regular file (a FIFO would block the read, a folder cannot be read)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConversionError(f"{path}: {what} is not a regular file")
    return st.st_size


def _open_checked(path: str, what: str):
    """(binary file, byte size) of ``path``, the size fstat'ed on the open descriptor, so the
    check and the read see one file; ConversionError as :func:`_regular_size`."""
    try:
        f = open_regular(path)
    except (NotRegularFileError, IsADirectoryError):
        raise ConversionError(f"{path}: {what} is not a regular file") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    return f, os.fstat(f.fileno()).st_size


def _unique_keys(pairs):
    """json.loads' object_pairs_hook: a dict, ValueError on a repeated key (which a plain
    dict would resolve silently to the last one)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r:.80} appears twice")
        out[k] = v
    return out


def _read_text(path: str, what: str, limit: int) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``limit`` bytes; ConversionError
    naming ``what`` otherwise."""
    f, size = _open_checked(path, what)
    try:
        with f:
            if size > limit:
                raise ConversionError(f"{path}: {what} is {size} bytes, over the {limit}-byte "
                                      "limit")
            raw = f.read(limit + 1)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path}: {what} is not UTF-8 ({e.reason})") from None


def _read_json(path: str, what: str, limit: int = MAX_JSON_BYTES):
    text = _read_text(path, what, limit)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: {what} is not UTF-8 JSON: {str(e)[:200]}") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_safetensors(path: str) -> tuple[int, dict]:
    """Walk a safetensors file's header with every size checked against the file's length.

    Returns (data_start, {name: (dtype, shape, begin, end)}) with begin/end relative to
    data_start. Raises ConversionError naming the file and the field: a header length past
    the file or over MAX_HEADER_BYTES, a header that is not a JSON object, more than
    MAX_ENTRIES tensors, a key listed twice, a ``__metadata__`` that is not an object of
    strings, an unknown dtype, a shape that is not a list of at most MAX_RANK non-negative
    ints, data_offsets that are not [begin, end] with 0 <= begin <= end <= the data section,
    a byte count that disagrees with shape x itemsize, tensors that overlap or leave bytes
    of the data section to none (the format requires them to tile it), a path that is not a
    regular file."""
    f, size = _open_checked(path, "the safetensors file")
    try:
        with f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ConversionError(f"{path}: {size} bytes, shorter than the 8-byte header "
                                      "length")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise ConversionError(f"{path}: header length {n} runs past the end of the "
                                      f"{size}-byte file")
            if n > MAX_HEADER_BYTES:
                raise ConversionError(f"{path}: header length {n} is over the "
                                      f"{MAX_HEADER_BYTES}-byte limit")
            raw = f.read(n)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: header is not UTF-8 JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: header must be a JSON object")
    if len(header) > MAX_ENTRIES:
        raise ConversionError(f"{path}: {len(header)} header entries (limit {MAX_ENTRIES})")
    data_start = 8 + n
    data_len = size - data_start
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConversionError(f"{path}: __metadata__ must be an object of strings")
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict):
            raise ConversionError(f"{where}: entry must be an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in ITEMSIZE:
            raise ConversionError(f"{where}: unknown dtype {dt!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(_is_int(s) and s >= 0 for s in shape)):
            raise ConversionError(f"{where}: shape {shape!r:.80} is not a list of at most "
                                  f"{MAX_RANK} non-negative ints")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_len):
            raise ConversionError(f"{where}: data_offsets {offs!r:.80} lie outside the "
                                  f"{data_len}-byte data section")
        count = 1
        for s in shape:
            count *= s                       # Python ints: no overflow
        if count * ITEMSIZE[dt] != offs[1] - offs[0]:
            raise ConversionError(f"{where}: data_offsets hold {offs[1] - offs[0]} bytes, "
                                  f"shape {shape} of {dt} needs {count * ITEMSIZE[dt]}")
        out[name] = (dt, tuple(shape), offs[0], offs[1])
    # the format's rule (safetensors' own validation): the tensors tile the data section,
    # in offset order, with no hole, no overlap and nothing after the last one
    at, prev = 0, None
    for b, e, nm in sorted((b, e, nm) for nm, (_, _, b, e) in out.items()):
        if b < at:
            raise ConversionError(f"{path}: tensors {prev!r} and {nm!r} overlap (the first "
                                  f"ends at {at}, the second begins at {b})")
        if b > at:
            raise ConversionError(f"{path}: data bytes [{at}, {b}) belong to no tensor")
        at, prev = e, nm
    if at != data_len:
        raise ConversionError(f"{path}: data bytes [{at}, {data_len}) after the last tensor "
                              "belong to no tensor")
    return data_start, out


def _shards(src: str) -> tuple[list[str], dict | None]:
    """The safetensors files of the folder and the index's weight_map (None without an
    index): the index's shards, else model.safetensors, else every *.safetensors file."""
    index = os.path.join(src, INDEX_NAME)
    if os.path.lexists(index):
        spec = _read_json(index, "the shard index")
        wm = spec.get("weight_map") if isinstance(spec, dict) else None
        if not isinstance(wm, dict) or not wm or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise ConversionError(f"{index}: weight_map must be a non-empty object of tensor "
                                  "name -> shard file name")
        names = sorted(set(wm.values()))
        for nm in names:
            if os.path.basename(nm) != nm or not nm.endswith(".safetensors"):
                raise ConversionError(f"{index}: weight_map names shard {nm!r}, not a "
                                      ".safetensors file name in the folder")
            if not os.path.lexists(os.path.join(src, nm)):
                raise ConversionError(f"{index}: shard {nm!r} is missing from {src}")
        return [os.path.join(src, nm) for nm in names], wm
    one = os.path.join(src, "model.safetensors")
    if os.path.isfile(one):
        return [one], None
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"{src}: no .safetensors file (and no {INDEX_NAME})")
    return [os.path.join(src, f) for f in files], None


class _NoTensors:
    """Stands in for a folder's tensor table when only config.json is read (``folder_config``):
    dims come from config.json alone."""

    table: dict = {}

    def __contains__(self, name: str) -> bool:
        return False


class _Tensors:
    """The checked tensor table of a folder's shards; reads one tensor as float32."""

    def __init__(self, src: str):
        shards, wm = _shards(src)
        self.table = {}                      # name -> (path, data_start, dtype, shape, b, e)
        for path in shards:
            start, entries = check_safetensors(path)
            for name, (dt, shape, b, e) in entries.items():
                if name in self.table:
                    raise ConversionError(f"{path}: tensor {name!r} is also in "
                                          f"{self.table[name][0]}")
                if wm is not None and wm.get(name) != os.path.basename(path):
                    raise ConversionError(f"{os.path.join(src, INDEX_NAME)}: weight_map puts "
                                          f"{name!r} in {wm.get(name)!r}, it is in "
                                          f"{os.path.basename(path)!r}")
                self.table[name] = (path, start, dt, shape, b, e)
        if wm is not None:
            lost = sorted(set(wm) - set(self.table))
            if lost:
                raise ConversionError(f"{os.path.join(src, INDEX_NAME)}: weight_map names "
                                      f"{lost[:3]}, which no shard holds")
        self.used: set = set()

    def __contains__(self, name: str) -> bool:
        return name in self.table

    def shape(self, name: str) -> tuple:
        if name not in self.table:
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint")
        return self.table[name][3]

    def get(self, name: str, shape: tuple) -> np.ndarray:
        """Tensor ``name`` as float32, after checking its dtype and ``shape``."""
        got = self.shape(name)
        path, start, dt, _, b, e = self.table[name]
        if dt not in FLOAT_DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has dtype {dt}; weights must be "
                                  f"one of {FLOAT_DTYPES}")
        if tuple(got) != tuple(shape):
            raise ConversionError(f"{path}: tensor {name!r} has shape {list(got)}, the "
                                  f"config needs {list(shape)}")
        self.used.add(name)
        if dt == "BF16":                      # bfloat16: the high half of a float32
            raw = np.memmap(path, dtype="<u2", mode="r", offset=start + b,
                            shape=((e - b) // 2,)) if e > b else np.zeros(0, "<u2")
            a = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            from safetensors import SafetensorError, safe_open
            try:
                with safe_open(path, framework="np") as f:
                    a = f.get_tensor(name)
            except (SafetensorError, OSError) as err:   # the file changed since its check
                raise ConversionError(f"{path}: cannot read tensor {name!r}: {err}") from None
        a = np.asarray(a, dtype=np.float32).reshape(shape)
        if not np.isfinite(a).all():
            raise ConversionError(f"{path}: tensor {name!r} holds NaN or inf")
        return a


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------
class _Conf:
    """config.json with typed reads that raise ConversionError naming the key."""

    def __init__(self, d: dict, path: str):
        self.d, self.path = d, path

    def int(self, *keys, default=None, lo: int = 0, hi: int = MAX_DIM):
        for k in keys:
            if k in self.d and self.d[k] is not None:
                v = self.d[k]
                if not _is_int(v) or not lo <= v <= hi:
                    raise ConversionError(f"{self.path}: {k}={v!r:.40} must be an int in "
                                          f"{lo}..{hi}")
                return v
        if default is None:
            raise ConversionError(f"{self.path}: {keys[0]} is missing")
        return default

    def float(self, *keys, default=None):
        for k in keys:
            if k in self.d and self.d[k] is not None:
                v = self.d[k]
                try:                          # an int past float's range: OverflowError
                    f = None if isinstance(v, bool) or not isinstance(v, (int, float)) \
                        else float(v)
                except OverflowError:
                    f = None
                if f is None or not math.isfinite(f):
                    raise ConversionError(f"{self.path}: {k}={v!r:.40} must be a finite "
                                          "number")
                return f
        if default is None:
            raise ConversionError(f"{self.path}: {keys[0]} is missing")
        return default

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConversionError(f"{self.path}: {key}={v!r} must be true or false")
        return v

    def token(self, key: str, vocab: int) -> int:
        v = self.d.get(key)
        if isinstance(v, list) and v:        # some configs list several EOS ids
            v = v[0]
        return v if _is_int(v) and 0 <= v < vocab else -1


def architecture_of(conf: dict, path: str) -> str:
    """"ouro" | "huginn" | "nanbeige" from config.json's ``architectures`` (else its
    ``model_type``); ConversionError "unsupported architecture X" for anything else."""
    archs = conf.get("architectures")
    if isinstance(archs, list) and archs:
        for a in archs:
            if isinstance(a, str) and a in ARCHITECTURES:
                return ARCHITECTURES[a]
        raise ConversionError(f"{path}: unsupported architecture {archs[0]!r:.80} (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    mt = conf.get("model_type")
    if isinstance(mt, str) and mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ConversionError(f"{path}: unsupported architecture {mt!r:.80} (config.json names no "
                          f"architecture; supported: {', '.join(ARCHITECTURES)})")


def permute_rotate_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a Q or K projection (or its bias) from rotate-half (NeoX) order to
    interleaved pairs: per head, row i of the first half and row i of the second half become
    rows 2i and 2i + 1 (llama.cpp's ``LlamaModel.permute``)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _vocab(t: _Tensors, name: str) -> int:
    """The vocabulary size: the row count of the embedding ``name``, which must be a
    non-empty matrix."""
    shape = t.shape(name)
    if len(shape) != 2 or not shape[0]:
        path = t.table[name][0]
        raise ConversionError(f"{path}: tensor {name!r} has shape {list(shape)}, the "
                              "embedding must be a [vocab, hidden] matrix")
    return shape[0]


def _check_llama_like(c: _Conf, kind: str) -> None:
    act = c.d.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{c.path}: hidden_act={act!r} is not supported (only silu)")
    rs = c.d.get("rope_scaling")
    if rs not in (None, {}) and not (isinstance(rs, dict) and
                                     rs.get("rope_type", rs.get("type")) == "default"):
        raise ConversionError(f"{c.path}: rope_scaling={rs!r:.80} is not supported")
    if c.d.get("mlp_bias"):
        raise ConversionError(f"{c.path}: mlp_bias is not supported")


# Options of Nanbeige's published modeling code (config key -> what it turns on) that change
# the forward and that TinyLoop does not run; the released Nanbeige4.2 configs leave them off
# (false, null, 0 or empty), as mlx-lm's and mlx-swift-lm's ports require too
NANBEIGE_OPTIONS = {
    "loop_share_kv": "loops sharing one KV cache",
    "enable_double_loop_split": "the double-loop split",
    "loop_middle_layers": "looping only the middle layers",
    "enable_hyper_connection": "hyper-connections",
    "enable_mhc": "manifold-constrained hyper-connections (mHC)",
    "enable_h_res_identity": "mHC's identity residual",
    "enable_depth_attention": "depth attention",
    "qk_layernorm": "the Q / K layer norm",
    "emb_neighbor_num": "n-gram neighbour embeddings",
    "insert_ngram_layer_idx": "n-gram embedding layers",
    "ngram_insert_all_layers": "n-gram embeddings at every layer",
}


def _nanbeige_loops(c: _Conf, n_layers: int) -> int:
    """The loop count of a Nanbeige config.json; ConversionError for an option of
    ``NANBEIGE_OPTIONS`` turned on, sliding-window layers, or a ``loop_loss_weights`` that is
    not a list of numbers or disagrees with ``num_loops``."""
    for key, what in NANBEIGE_OPTIONS.items():
        v = c.d.get(key)
        if v:                                 # JSON's off values are all falsy
            raise ConversionError(f"{c.path}: {key}={v!r:.40} turns on {what}, which TinyLoop "
                                  "does not run (only configs with it off, as the released "
                                  "Nanbeige4.2 checkpoints, convert)")
    types = c.d.get("layer_types")
    if c.bool("use_sliding_window", False) or (
            types is not None and (not isinstance(types, list) or len(types) != n_layers
                                   or any(x != "full_attention" for x in types))):
        raise ConversionError(f"{c.path}: Nanbeige layers other than full attention "
                              f"(use_sliding_window / layer_types={types!r:.60}) are not "
                              f"supported; layer_types must list 'full_attention' for each "
                              f"of the {n_layers} layers")
    loops = c.int("num_loops", default=1, lo=1, hi=MAX_DEPTH)
    w = c.d.get("loop_loss_weights")
    if w is not None and w != []:
        if not isinstance(w, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in w):
            raise ConversionError(f"{c.path}: loop_loss_weights={w!r:.40} must be a list of "
                                  "numbers")
        # the published modeling code runs len(loop_loss_weights) + 1 loops when it is set
        if "num_loops" in c.d and c.d["num_loops"] is not None and loops != len(w) + 1:
            raise ConversionError(f"{c.path}: loop_loss_weights lists {len(w)} weight"
                                  f"{'s' * (len(w) != 1)}, which the modeling code runs as "
                                  f"{len(w) + 1} loops, but num_loops={loops}")
        if len(w) + 1 > MAX_DEPTH:
            raise ConversionError(f"{c.path}: loop_loss_weights lists {len(w)} weights: "
                                  f"{len(w) + 1} loops is over the {MAX_DEPTH}-loop limit")
        loops = len(w) + 1
    return loops


def _llama_stack(c: _Conf, t: _Tensors, kind: str):
    """ModelConfig facts and tensors of an Ouro / Nanbeige checkpoint (llama names)."""
    d = c.int("hidden_size", lo=1)
    n_layers = c.int("num_hidden_layers", lo=1, hi=MAX_LAYERS)
    heads = c.int("num_attention_heads", lo=1)
    kv_heads = c.int("num_key_value_heads", default=heads, lo=1)
    head_dim = c.int("head_dim", default=d // heads, lo=1)
    if kind == "nanbeige":
        loops = _nanbeige_loops(c, n_layers)
    ffn = c.int("intermediate_size", lo=1)
    vocab = _vocab(t, "model.embed_tokens.weight") if "model.embed_tokens.weight" in t \
        else c.int("vocab_size", lo=1)
    tied = c.bool("tie_word_embeddings", False)
    if kind == "ouro":
        loops = c.int("total_ut_steps", default=4, lo=1, hi=MAX_DEPTH)
        facts = dict(layer_norms="pre_post", loop_norm=True, exit_gate=True)
        window = 0
        if c.bool("use_sliding_window", False):
            window = c.int("sliding_window", default=4096, lo=1)
        types = c.d.get("layer_types")
        if types is None:
            first = c.int("max_window_layers", default=28)
            types = ["sliding_attention" if window and i >= first else "full_attention"
                     for i in range(n_layers)]
        if (not isinstance(types, list) or len(types) != n_layers or not all(
                x in ("full_attention", "sliding_attention") for x in types)):
            raise ConversionError(f"{c.path}: layer_types must list 'full_attention' / "
                                  f"'sliding_attention' for each of the {n_layers} layers")
        sliding = tuple(i for i, x in enumerate(types) if x == "sliding_attention")
        if sliding and not window:
            window = c.int("sliding_window", lo=1)
        if sliding:
            facts.update(sliding_window=window, sliding_layers=sliding)
    else:
        skip = c.bool("skip_loop_final_norm", False)
        facts = dict(loop_norm=not skip)
    bias = c.bool("attention_bias", False)
    if bias:
        facts["qkv_bias"] = True
    cfg = dict(vocab_size=vocab, d_model=d, n_heads=heads, n_kv_heads=kv_heads,
               head_dim=head_dim, ffn_dim=ffn, n_prelude=0, n_recurrent=n_layers, n_coda=0,
               default_depth=loops, max_depth=loops,
               rope_theta=c.float("rope_theta", default=10000.0),
               norm_eps=c.float("rms_norm_eps", default=1e-6), tied_head=tied,
               bos_token_id=c.token("bos_token_id", vocab),
               eos_token_id=c.token("eos_token_id", vocab), **facts)
    qd, kvd = heads * head_dim, kv_heads * head_dim

    def tensors(cfg: ModelConfig):
        yield "token_embd", lambda: t.get("model.embed_tokens.weight", (vocab, d))
        yield "output_norm", lambda: t.get("model.norm.weight", (d,))
        if not tied:
            yield "output", lambda: t.get("lm_head.weight", (vocab, d))
        if kind == "ouro":
            yield "exit_gate.weight", lambda: t.get("model.early_exit_gate.weight",
                                                    (1, d)).reshape(d)
            yield "exit_gate.bias", lambda: t.get("model.early_exit_gate.bias", (1,))
        for i in range(n_layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            a = p + "self_attn."

            def qkv(a=a):
                return np.concatenate([
                    permute_rotate_half(t.get(a + "q_proj.weight", (qd, d)), heads),
                    permute_rotate_half(t.get(a + "k_proj.weight", (kvd, d)), kv_heads),
                    t.get(a + "v_proj.weight", (kvd, d))])
            yield b + "attn_norm", lambda p=p: t.get(p + "input_layernorm.weight", (d,))
            yield b + "attn_qkv", qkv
            if bias:
                yield b + "attn_qkv_bias", lambda a=a: np.concatenate([
                    permute_rotate_half(t.get(a + "q_proj.bias", (qd,)), heads),
                    permute_rotate_half(t.get(a + "k_proj.bias", (kvd,)), kv_heads),
                    t.get(a + "v_proj.bias", (kvd,))])
            yield b + "attn_output", lambda a=a: t.get(a + "o_proj.weight", (d, qd))
            yield b + "ffn_norm", lambda p=p: t.get(p + "post_attention_layernorm.weight", (d,))
            yield b + "ffn_gate_up", lambda p=p: np.concatenate([
                t.get(p + "mlp.gate_proj.weight", (ffn, d)),
                t.get(p + "mlp.up_proj.weight", (ffn, d))])
            yield b + "ffn_down", lambda p=p: t.get(p + "mlp.down_proj.weight", (d, ffn))
            if kind == "ouro":
                yield b + "attn_post_norm", lambda p=p: t.get(p + "input_layernorm_2.weight",
                                                              (d,))
                yield b + "ffn_post_norm", lambda p=p: t.get(
                    p + "post_attention_layernorm_2.weight", (d,))
    ignore = {"lm_head.weight"} if tied else set()
    return cfg, tensors, ignore


def _huginn(c: _Conf, t: _Tensors, state_seed: int):
    """ModelConfig facts and tensors of a Huginn (RavenForCausalLM) checkpoint."""
    d = c.int("n_embd", "hidden_size", lo=1)
    heads = c.int("num_attention_heads", "n_heads", lo=1)
    kv_heads = c.int("num_key_value_heads", default=heads, lo=1)
    if d % heads:
        raise ConversionError(f"{c.path}: n_embd={d} is not a multiple of "
                              f"num_attention_heads={heads}")
    head_dim = d // heads
    ffn = c.int("intermediate_size", lo=1)
    P = c.int("n_layers_in_prelude", hi=MAX_LAYERS)
    R = c.int("n_layers_in_recurrent_block", lo=1, hi=MAX_LAYERS)
    C = c.int("n_layers_in_coda", hi=MAX_LAYERS)
    rec = c.int("mean_recurrence", lo=1, hi=MAX_DEPTH)
    for key, want in (("injection_type", "linear"), ("state_init", "like-init")):
        if c.d.get(key, want) != want:
            raise ConversionError(f"{c.path}: {key}={c.d.get(key)!r} is not supported "
                                  f"(only {want!r})")
    if c.d.get("test_time_noise", 0) not in (0, 0.0, None):
        raise ConversionError(f"{c.path}: test_time_noise={c.d.get('test_time_noise')!r} is "
                              "not supported (only 0)")
    if c.bool("bias", False):
        raise ConversionError(f"{c.path}: bias=true (biased linears) is not supported")
    qk_bias = c.bool("qk_bias", False)
    if qk_bias and kv_heads != heads:
        raise ConversionError(f"{c.path}: qk_bias needs num_key_value_heads == "
                              f"num_attention_heads, got {kv_heads} and {heads}")
    init = c.d.get("init_values") or {}
    if not isinstance(init, dict):
        raise ConversionError(f"{c.path}: init_values must be an object")
    ic = _Conf(init, c.path + " init_values")
    embed_scale = ic.float("embed_scale", default=1.0)
    std = ic.float("std", default=math.sqrt(2.0 / (5.0 * d)))
    if not (embed_scale > 0 and std > 0):
        raise ConversionError(f"{c.path}: init_values embed_scale={embed_scale} and "
                              f"std={std} must be > 0")
    tied = c.bool("tie_embeddings", c.bool("tie_word_embeddings", True))
    vocab = _vocab(t, "transformer.wte.weight") if "transformer.wte.weight" in t \
        else c.int("padded_vocab_size", "vocab_size", lo=1)
    cfg = dict(vocab_size=vocab, d_model=d, n_heads=heads, n_kv_heads=kv_heads,
               head_dim=head_dim, ffn_dim=ffn, n_prelude=P, n_recurrent=R, n_coda=C,
               default_depth=rec, max_depth=rec,
               rope_theta=c.float("rope_base", "rope_theta", default=50000.0),
               norm_eps=c.float("norm_eps", default=1e-6), injection="adapter",
               tied_head=tied, bos_token_id=c.token("bos_token_id", vocab),
               eos_token_id=c.token("eos_token_id", vocab), layer_norms="sandwich",
               exit_norm=True, state_init="normal", state_std=std * embed_scale,
               state_seed=state_seed, embed_scale=embed_scale, qkv_bias=qk_bias)
    kvd = kv_heads * head_dim
    blocks = ([f"transformer.prelude.{i}." for i in range(P)]
              + [f"transformer.core_block.{j}." for j in range(R)]
              + [f"transformer.coda.{k}." for k in range(C)])

    def tensors(cfg: ModelConfig):
        yield "token_embd", lambda: t.get("transformer.wte.weight", (vocab, d))
        yield "output_norm", lambda: t.get("transformer.ln_f.weight", (d,))
        if not tied:
            yield "output", lambda: t.get("lm_head.weight", (vocab, d))
        yield "inject.adapter", lambda: t.get("transformer.adapter.weight", (d, 2 * d))
        for i, p in enumerate(blocks):
            b = f"blk.{i}."
            yield b + "attn_norm", lambda p=p: t.get(p + "norm_1.weight", (d,))
            yield b + "attn_qkv", lambda p=p: t.get(p + "attn.Wqkv.weight", (d + 2 * kvd, d))
            if qk_bias:
                yield b + "attn_qkv_bias", lambda p=p: np.concatenate([
                    t.get(p + "attn.qk_bias", (2, 1, heads, head_dim)).reshape(2 * d),
                    np.zeros(kvd, np.float32)])
            yield b + "attn_output", lambda p=p: t.get(p + "attn.proj.weight", (d, d))
            yield b + "attn_post_norm", lambda p=p: t.get(p + "norm_2.weight", (d,))
            yield b + "ffn_norm", lambda p=p: t.get(p + "norm_3.weight", (d,))
            yield b + "ffn_gate_up", lambda p=p: t.get(p + "mlp.fc.weight", (2 * ffn, d))
            yield b + "ffn_down", lambda p=p: t.get(p + "mlp.proj.weight", (d, ffn))
            yield b + "ffn_post_norm", lambda p=p: t.get(p + "norm_4.weight", (d,))
    ignore = {"freqs_cis"} | ({"lm_head.weight"} if tied else set())
    return cfg, tensors, ignore


# --------------------------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------------------------
def read_hf_folder(src, *, state_seed: int = 0, tensors: bool = True):
    """(architecture, ModelConfig, tensor iterator factory, ignored names, _Tensors) of the
    folder ``src``, every header checked (nothing read yet but the headers); with
    ``tensors=False`` only config.json is read (the vocabulary size then comes from it)."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise ConversionError(f"{src}: not a folder")
    cpath = os.path.join(src, "config.json")
    if not os.path.lexists(cpath):
        raise ConversionError(f"{src}: config.json is missing")
    conf = _read_json(cpath, "config.json")
    if not isinstance(conf, dict):
        raise ConversionError(f"{cpath}: config.json must be a JSON object")
    arch = architecture_of(conf, cpath)
    t = _Tensors(src) if tensors else _NoTensors()
    c = _Conf(conf, cpath)
    if arch == "huginn":
        facts, tensors, ignore = _huginn(c, t, state_seed)
    else:
        _check_llama_like(c, arch)
        facts, tensors, ignore = _llama_stack(c, t, arch)
    try:
        cfg = ModelConfig(**facts)
    except ConfigError as e:
        raise ConversionError(f"{cpath}: the dims do not make a model: {e}") from None
    return arch, cfg, tensors, ignore, t


def folder_config(src) -> tuple[str, ModelConfig]:
    """(architecture, ModelConfig) of the folder ``src`` from its config.json alone (what
    ``tinyloop inspect DIR`` plans with); raises ConversionError as convert_hf."""
    arch, cfg, *_ = read_hf_folder(src, tensors=False)
    return arch, cfg


def _tokenizer(src: str):
    """(tokenizer.json's text or None, the chat template) of the folder ``src``."""
    path = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(path):
        return None, ""
    return _read_text(path, "tokenizer.json", MAX_TOKENIZER_BYTES), _chat_template(src)


def _chat_template(src: str) -> str:
    """The folder's chat template as transformers loads it: ``chat_template.jinja`` when there
    (where newer checkpoints save it), else tokenizer_config.json's ``chat_template``: a
    string, or a list of ``{"name", "template"}`` whose "default" entry is the template;
    "" when there is none. ConversionError as :func:`_read_text` / :func:`_read_json`."""
    path = os.path.join(src, "chat_template.jinja")
    if os.path.lexists(path):
        return _read_text(path, "chat_template.jinja", MAX_JSON_BYTES)
    path = os.path.join(src, "tokenizer_config.json")
    spec = _read_json(path, "tokenizer_config.json") if os.path.lexists(path) else None
    t = spec.get("chat_template") if isinstance(spec, dict) else None
    if isinstance(t, list):
        t = next((e.get("template") for e in t
                  if isinstance(e, dict) and e.get("name") == "default"), None)
    return t if isinstance(t, str) else ""


def generation_eos_ids(src: str, vocab: int) -> list[int]:
    """The sorted ``eos_token_id`` ids of the folder's ``generation_config.json`` (an int or
    a list of at most MAX_EOS_IDS ints), [] without the file or the key. Raises
    ConversionError naming the file for one that is not a regular JSON object or a value
    that is not token ids of the ``vocab``-token vocabulary."""
    path = os.path.join(src, "generation_config.json")
    if not os.path.lexists(path):
        return []
    conf = _read_json(path, "generation_config.json")
    if not isinstance(conf, dict):
        raise ConversionError(f"{path}: generation_config.json must be a JSON object")
    v = conf.get("eos_token_id")
    if v is None:
        return []
    ids = v if isinstance(v, list) else [v]
    if len(ids) > MAX_EOS_IDS or not all(_is_int(i) and 0 <= i < vocab for i in ids):
        raise ConversionError(f"{path}: eos_token_id={v!r:.60} must be a token id or a list "
                              f"of at most {MAX_EOS_IDS} token ids of the {vocab}-token "
                              "vocabulary")
    return sorted(set(ids))


def convert_hf(src, dst, *, bits: int = 4, group_size: int = 32, state_seed: int = 0,
               max_depth: int | None = None) -> ModelConfig:
    """Convert the Hugging Face folder ``src`` (Ouro / Huginn / Nanbeige, see the module
    docstring) into the .tlm file ``dst``; returns the ModelConfig written.

    ``bits`` 4 | 8 and ``group_size`` (GROUP_SIZES) quantize every matrix
    (``quant.quantize``); norm weights, biases and the exit gate stay float32.
    ``state_seed``: the seed of a seeded initial state (Huginn). ``max_depth``: the largest
    depth a request may ask for (default: the checkpoint's loop count). Raises
    ConversionError naming the file and the field (nothing is written then)."""
    if bits not in (4, 8):
        raise ConversionError(f"bits must be 4 or 8, got {bits!r}")
    if group_size not in GROUP_SIZES:
        raise ConversionError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if not _is_int(state_seed) or state_seed < 0:
        raise ConversionError(f"state_seed must be an int >= 0, got {state_seed!r}")
    src = os.fspath(src)
    arch, cfg, tensors, ignore, t = read_hf_folder(src, state_seed=state_seed)
    if max_depth is not None:
        try:
            cfg = ModelConfig(**{**cfg.to_dict(), "max_depth": max_depth})
        except ConfigError as e:
            raise ConversionError(f"max_depth={max_depth!r}: {e}") from None
    want = expected_tensors(cfg)
    out = {}
    for name, fetch in tensors(cfg):
        kind, shape = want[name]
        a = fetch()
        if kind == "quant":
            if shape[1] % group_size:
                raise ConversionError(f"{name}: {shape[1]} input columns are not a multiple "
                                      f"of group_size={group_size}")
            out[name] = quantize(a, bits, group_size)
        else:
            out[name] = a.reshape(shape)
    extra = sorted(set(t.table) - t.used - ignore)
    if extra:
        raise ConversionError(f"{src}: tensors this converter does not map: {extra[:5]}"
                              + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    tok, template = _tokenizer(src)
    meta = {"source": os.path.basename(os.path.abspath(src)), "source_format": "hf",
            "architecture": arch, "converter": "tinyloop.convert.hf",
            "converter_version": CONVERTER_VERSION, "loop": "trained",
            "options": {"bits": bits, "group_size": group_size, "state_seed": state_seed}}
    eos_ids = generation_eos_ids(src, cfg.vocab_size)
    if eos_ids:
        meta["eos_token_ids"] = eos_ids
    try:
        write_tlm(dst, cfg, out, tokenizer_json=tok, chat_template=template, metadata=meta)
    except FormatError as e:
        raise ConversionError(f"{src}: {e}") from None
    return cfg


# --------------------------------------------------------------------------------------------
# load_model(DIR): one conversion in the cache
# --------------------------------------------------------------------------------------------
def folder_key(src: str, options: dict) -> str:
    """16 hex digits over the bytes (SHA-256) of the folder's .json files (config, index,
    tokenizer, generation config), chat_template.jinja and every safetensors file, the
    converter and format versions and the options."""
    from ..default import content_hash
    from ..format import VERSION
    files = {}
    try:
        names = sorted(os.listdir(src))
    except OSError as e:
        raise ConversionError(f"{src}: cannot list the folder: {e.strerror or e}") from None
    for f in names:
        if f.endswith((".safetensors", ".json")) or f == "chat_template.jinja":
            path = os.path.join(src, f)
            _regular_size(path, "a checkpoint file")
            try:
                files[f] = content_hash(path)
            except OSError as e:
                raise ConversionError(f"{path}: cannot read a checkpoint file: "
                                      f"{e.strerror or e}") from None
    ident = {"files": files, "converter": CONVERTER_VERSION, "format": VERSION,
             "options": dict(sorted(options.items()))}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cached_folder_conversion(src, cache: str | None = None, **options) -> str:
    """The .tlm path of the HF folder ``src`` converted (``convert_hf`` with ``options``)
    into ``cache`` (default ``config.cache_dir()``), converting only when no valid file of
    the same folder content and options is there. Raises ConversionError as convert_hf,
    FileWriteError naming the cache folder when it cannot be made."""
    from ..config import cache_dir
    from .cache import cached_tlm
    src = os.fspath(src)
    cache = cache or cache_dir()
    stem = os.path.basename(os.path.abspath(src)) or "model"
    dst = os.path.join(cache, f"{stem}.hf.{folder_key(src, options)}.tlm")
    return cached_tlm(dst, cache, lambda out: convert_hf(src, out, **options))
