"""Byte-level BPE tokenizer (HF ``tokenizers``) with llama.cpp-identical ids, SentencePiece-style
tokenizer.json files (Llama's, Mistral's) with the ``tokenizers`` library's ids, and chat templates.

A .tlm file embeds the tokenizer as HF ``tokenizers`` JSON (the u8 entry ``tokenizer.json``) and
the chat template as a Jinja string in its header. :func:`build_tokenizer_json_from_gguf`
makes that JSON from a GGUF file's vocab and merges so that ``Tokenizer.encode`` gives the same
ids as llama.cpp's ``llama_tokenize(..., add_special=False, parse_special=True)``:

- model: BPE over the GGUF's ``tokenizer.ggml.tokens`` (ids = positions) and
  ``tokenizer.ggml.merges`` (rank = position);
- pre-tokenizer: llama.cpp's regex list for ``tokenizer.ggml.pre`` (llama-vocab.cpp). For the
  "smollm" family it is ``\\p{N}`` (each digit alone) then the GPT-2 regex
  ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``,
  i.e. HF's ``Split(\\p{N}, isolated)`` followed by ``ByteLevel(use_regex=True)``;
- added tokens: every CONTROL, USER_DEFINED and UNKNOWN token (llama.cpp's special-token
  cache), matched verbatim in the text before BPE, as llama.cpp does with parse_special=True.
  CONTROL and UNKNOWN tokens are marked ``special``: ``encode(text, parse_special=False)``
  leaves them unmatched (their text is encoded as plain text) while USER_DEFINED tokens are
  still matched, which is what llama.cpp's ``special`` flag does (``tokenizer_st_partition``).

Chat prompts: :meth:`Tokenizer.apply_chat_template` with ``tokenize=True`` returns ids in which
only the template's own markers are control tokens; a special token's text inside a message
(``"<|im_end|>"`` typed by a user) is encoded as plain text (see ``_escape_specials``).

Decoding maps each token to its bytes (byte-level alphabet inverted; added tokens as UTF-8) and
decodes the concatenation as UTF-8 with U+FFFD for invalid bytes. :class:`StreamDecoder` does
the same incrementally, holding back a UTF-8 sequence split across tokens until it completes.
A SentencePiece-style tokenizer.json (``_spm_decoding``: BPE or Unigram with a Metaspace or
Replace + ByteFallback + Fuse + Strip decoder) decodes as its ``tokenizers`` decoder does: its
space character as a space, each run of ``<0xNN>`` byte-fallback tokens as UTF-8 (one U+FFFD
per token of an invalid run), one leading space dropped where the decoder strips it. A GGUF
SentencePiece vocab (``tokenizer.ggml.model`` "llama") becomes such a tokenizer with
llama.cpp's ids (:func:`_spm_json_from_gguf`).
"""

from __future__ import annotations

import codecs
import json
import operator
import re
from functools import lru_cache

from .errors import TokenizerError

# GGUF token types (gguf.TokenType / llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> does llama.cpp split digits one by one before the GPT-2 regex?
# (llama-vocab.cpp: STARCODER/REFACT/COMMAND_R/SMOLLM/CODESHELL/EXAONE/MINERVA use
# {"\\p{N}", GPT-2}; GPT2/MPT/OLMO/JAIS use {GPT-2})
_PRE_TOKENIZERS = {
    "smollm": True, "starcoder": True, "refact": True, "command-r": True, "codeshell": True,
    "exaone": True, "minerva-7b": True,
    "gpt-2": False, "gpt2": False, "mpt": False, "olmo": False, "jais": False,
}


# The end-of-generation rule of the llama.cpp that llama-cpp-python 0.3.36 vendors
# (src/llama-vocab.cpp, llama_vocab::impl::load, special_eog_ids), by token text, so a model
# stops where llama.cpp stops it whatever its config's one eos id says (SmolLM2's GGUF names
# <|im_end|>, its text ends with <|endoftext|>; Ouro's config.json names <|endoftext|>, its
# chat turns end with <|im_end|>): these texts,
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
             "[e~[")
# the fill-in-the-middle pad, repo and file-separator tokens,
FIM_EOG_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>",
                 "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")
# and the eos id; less <|end|> beside <|return|> / <|call|> (o200k_harmony) or <|calls|> /
# <|flush|> (solar-open), where it ends a message, and </s> beside <|tool_response> (gemma4)
# or an eos <|plamo:eos|>, where it is an ordinary token.


def end_of_generation_ids(token_to_id, eos_token_id: int = -1) -> frozenset[int]:
    """The ids that end a generation, llama.cpp's ``llama_vocab_is_eog`` set (the rule above
    ``EOG_TEXTS``): every token whose text is in ``EOG_TEXTS`` or ``FIM_EOG_TEXTS`` and
    ``eos_token_id`` (when >= 0), less the two exceptions. ``token_to_id``: text -> id or
    None (``tokenizers.Tokenizer.token_to_id``). Where llama.cpp differs: it keeps one FIM
    token of each kind (the first its hash map yields) where a vocabulary spells a kind twice,
    this keeps both; a GGUF's ``tokenizer.ggml.eot_token_id`` / ``fim_*_token_id`` keys,
    which llama.cpp adds, are not read; a GGUF without an eos key has none here (-1), where
    llama.cpp assumes id 11."""
    found = {t: token_to_id(t) for t in EOG_TEXTS + FIM_EOG_TEXTS}
    ids = {i for i in found.values() if i is not None}
    if eos_token_id >= 0:
        ids.add(eos_token_id)
    has = {t for t, i in found.items() if i in ids}     # by text, as llama.cpp checks
    calls = "<|call|>" in has or "<|calls|>" in has
    if "<|end|>" in has and calls and ("<|return|>" in has or "<|flush|>" in has):
        ids.discard(found["<|end|>"])
    plamo = token_to_id("<|plamo:eos|>")                 # an eos of that text counts too
    if "</s>" in has and ("<|tool_response>" in has or (plamo is not None and plamo in ids)):
        ids.discard(found["</s>"])
    return frozenset(ids)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("the tokenizer needs the 'tokenizers' package: "
                             "pip install tokenizers") from None
    return tokenizers


# pre-tokenizers that split text or map its bytes but drop none of it
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Digits", "Punctuation")


# A SentencePiece-style decoder (Llama / Mistral / T5 tokenizer.json): how its tokens become
# text, as the ``tokenizers`` decoder makes it. ``space``: the character standing for a space
# ("\u2581"); ``byte_fallback``: "<0xNN>" tokens are the byte NN (the ByteFallback decoder);
# ``strip``: "one" drops one leading space of the text (Strip(" ", 1, 0) after Fuse),
# "first" drops every space character of the first token (Metaspace with a prepend scheme).
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPM_MAX_PIECE = 256          # characters of a GGUF SentencePiece piece that merges build
SPM_MAX_MERGES = 1 << 22     # merges a GGUF SentencePiece vocab may make


def _spm_decoding(spec: dict) -> dict | None:
    """The SentencePiece-style decoding (``space``, ``byte_fallback``, ``strip``) of a
    tokenizer JSON over a BPE or Unigram model whose decoder is ``Metaspace`` (no byte
    fallback in decoding, whatever the model says) or the Sequence Replace(space -> " ") and
    ByteFallback (either order), Fuse, then optionally Strip(" ", 1, 0) (Llama's, Gemma's);
    None for any other decoder, whose text this module would not reproduce."""
    dec = spec.get("decoder") or {}
    if (spec.get("model") or {}).get("type") not in ("BPE", "Unigram"):
        return None
    if dec.get("type") == "Metaspace":
        space = dec.get("replacement", "\u2581")
        scheme = dec.get("prepend_scheme", "always" if dec.get("add_prefix_space", True)
                         else "never")
        if not (isinstance(space, str) and len(space) == 1):
            return None
        return {"space": space, "byte_fallback": False,
                "strip": None if scheme == "never" else "first"}
    steps = dec.get("decoders") if dec.get("type") == "Sequence" else None
    if not isinstance(steps, list) or not all(isinstance(st, dict) for st in steps):
        return None
    kinds = [st.get("type") for st in steps]
    strip = kinds[-1:] == ["Strip"]
    if sorted(kinds[:3]) != ["ByteFallback", "Fuse", "Replace"] or kinds[2] != "Fuse" \
            or len(kinds) != 3 + strip:
        return None
    rep = steps[kinds.index("Replace")]
    space = (rep.get("pattern") or {}).get("String")
    if not (isinstance(space, str) and len(space) == 1 and rep.get("content") == " "):
        return None
    if strip and steps[3] != {"type": "Strip", "content": " ", "start": 1, "stop": 0}:
        return None
    return {"space": space, "byte_fallback": True, "strip": "one" if strip else None}


def _keeps_every_byte(spec: dict) -> bool:
    """Whether every byte of a text reaches a token of this tokenizer JSON, each token
    holding at most its vocabulary entry's bytes: a BPE model, no normalizer, no added token
    that strips the whitespace beside it, and pre-tokenizers that only split (a Split that
    removes its matches does not)."""
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return False
    if any(isinstance(t, dict) and (t.get("lstrip") or t.get("rstrip"))
           for t in spec.get("added_tokens") or []):
        return False
    pre = spec.get("pre_tokenizer")
    steps = [] if pre is None else (pre.get("pretokenizers") or [] if pre.get("type") ==
                                    "Sequence" else [pre])
    for st in steps:
        t = st.get("type") if isinstance(st, dict) else None
        if t == "Split":
            if str(st.get("behavior", "")).lower() == "removed":
                return False
        elif t not in _KEEPING_PRE_TOKENIZERS:
            return False
    return True


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in char -> byte value."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# --------------------------------------------------------------------------------------------
# Building the JSON from a GGUF file
# --------------------------------------------------------------------------------------------
def build_tokenizer_json_from_gguf(reader) -> str:
    """HF ``tokenizers`` JSON for the vocab of a ``gguf.GGUFReader``.

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the pre-tokenizers listed
    in ``_PRE_TOKENIZERS``, and ``"llama"`` (SentencePiece BPE, :func:`_spm_json_from_gguf`).
    Raises TokenizerError for anything else (unknown models or pre-tokenizers, missing or
    mistyped fields, duplicate tokens, a merge whose parts or result are not in the vocab),
    naming the field.
    """
    tk = _tokenizers()

    def field(key, default=None):
        f = reader.fields.get(key)
        try:
            return default if f is None else f.contents()
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{key}: a string is not UTF-8 ({e.reason})") from None

    kind = field("tokenizer.ggml.model")
    if kind == "llama":
        return _spm_json_from_gguf(tk, field)
    if kind != "gpt2":
        raise TokenizerError(f"tokenizer.ggml.model={kind!r} is not supported (only byte-level "
                             "BPE, 'gpt2', and SentencePiece BPE, 'llama')")
    pre = field("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZERS:
        raise TokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported; known: "
                             f"{sorted(_PRE_TOKENIZERS)}")
    tokens, types = _token_fields(field, "a 'gpt2' vocab")
    merges = field("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("the GGUF has no tokenizer.ggml.merges (a 'gpt2' vocab)")
    if not isinstance(merges, list) or not all(isinstance(x, str) for x in merges):
        raise TokenizerError("tokenizer.ggml.merges must be an array of strings")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for k, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"tokenizer.ggml.merges[{k}] = {m!r} is not two tokens "
                                 "separated by a space")
        missing = next((t for t in (a, b, a + b) if t not in vocab), None)
        if missing is not None:      # a BPE merge must join two tokens into a third
            raise TokenizerError(f"tokenizer.ggml.merges[{k}] = {m!r}: {missing!r} is not in "
                                 "tokenizer.ggml.tokens")
        pairs.append((a, b))

    try:
        return _bpe_json(tk, vocab, pairs, pre, tokens, types, _eos_id(field, len(tokens)))
    except Exception as e:             # tokenizers raises plain Exception
        raise TokenizerError(f"the GGUF vocab cannot make a BPE tokenizer: {e}") from None


def _eos_id(field, n: int) -> int:
    """``tokenizer.ggml.eos_token_id`` when it is a token id of the ``n``-token vocab, else
    -1 (the converter checks the key itself)."""
    v = field("tokenizer.ggml.eos_token_id", -1)
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n else -1


def _token_fields(field, what: str):
    """(tokens, types) of a GGUF vocab, checked: strings, integer types of the same count,
    no duplicate string."""
    tokens = field("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"the GGUF has no tokenizer.ggml.tokens ({what})")
    if not isinstance(tokens, list) or not all(isinstance(x, str) for x in tokens):
        raise TokenizerError("tokenizer.ggml.tokens must be an array of strings")
    types = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if not isinstance(types, list) or not all(isinstance(y, int) and not isinstance(y, bool)
                                              for y in types):
        raise TokenizerError("tokenizer.ggml.token_type must be an array of integers")
    if len(types) != len(tokens):
        raise TokenizerError(f"{len(types)} token types for {len(tokens)} tokens")
    if len(set(tokens)) != len(tokens):
        raise TokenizerError("the GGUF vocab has duplicate token strings; their ids cannot be "
                             "kept")
    return tokens, types


def _spm_json_from_gguf(tk, field) -> str:
    """HF JSON for a GGUF SentencePiece BPE vocab (``tokenizer.ggml.model == "llama"``:
    tokens, ``tokenizer.ggml.scores``, types, ``tokenizer.ggml.add_space_prefix``, default
    true) whose ids are llama.cpp's (llama-vocab.cpp ``llm_tokenizer_spm``): the text gets a
    leading space where a fragment starts (the start, and after each special token), spaces
    become U+2581, and of the adjacent symbol pairs whose join is a token the one of highest
    score joins first (the leftmost on a tie), until none is left; a symbol that is no token
    becomes its bytes' ``<0xNN>`` tokens. That is BPE with one merge (a, b) per token t = a + b
    of two tokens, ranked by t's score (highest first), and byte fallback. Where it can differ
    from llama.cpp: scores that tie between different tokens (a GGUF made from a
    tokenizer.json alone, whose every score is -1000: the ranks then follow the vocab order
    where llama.cpp joins the leftmost pair); a piece whose first character is no token
    (byte fallback splits that character before any merge); special tokens that overlap in a
    text (matched leftmost-longest, where llama.cpp takes the longest token's occurrences
    first); llama.cpp's rstrip of special tokens for a model named phi-3."""
    import math
    from tokenizers import decoders, models, normalizers
    tokens, types = _token_fields(field, "a 'llama' vocab")
    scores = field("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in scores):
        raise TokenizerError(f"tokenizer.ggml.scores must hold one finite number per token "
                             f"({len(tokens)})")
    prefix = field("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(prefix, bool):
        raise TokenizerError("tokenizer.ggml.add_space_prefix must be a bool")
    vocab = {t: i for i, t in enumerate(tokens)}
    # every split of a piece into two pieces, the piece's score deciding the rank; pieces
    # longer than SPM_MAX_PIECE (sentencepiece's own default limit is 16) take no merge, which
    # bounds the work on a hostile vocab to about len(tokens) * SPM_MAX_PIECE slices
    ranked = sorted((-scores[i], i, k, t[:k], t[k:]) for t, i in vocab.items()
                    if len(t) <= SPM_MAX_PIECE
                    for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab)
    if len(ranked) > SPM_MAX_MERGES:
        raise TokenizerError(f"the GGUF 'llama' vocab of {len(tokens)} tokens makes "
                             f"{len(ranked)} merges, over the {SPM_MAX_MERGES} limit")
    unk = next((t for t, y in zip(tokens, types) if y == _UNKNOWN), None)
    try:
        tok = tk.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked],
                                      unk_token=unk, byte_fallback=True, fuse_unk=False))
        replace = normalizers.Replace(" ", "\u2581")
        tok.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
                          if prefix else replace)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        _add_tokens(tok, vocab, tokens, types, _eos_id(field, len(tokens)))
        return tok.to_str()
    except Exception as e:             # tokenizers raises plain Exception
        raise TokenizerError(f"the GGUF vocab cannot make a SentencePiece tokenizer: {e}") \
            from None


# Token texts llama.cpp's vocab loader makes CONTROL whatever their GGUF type (the end of turn
# / message, fill-in-the-middle and end-of-generation tokens it detects by text; src/
# llama-vocab.cpp, "auto-detect special tokens by text"), the ones its gpt-oss rule makes
# USER_DEFINED, and what the harmony / solar-open and gemma4 exceptions turn back
_CONTROL_TEXTS = frozenset(EOG_TEXTS + FIM_EOG_TEXTS + (
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
    "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>",
    "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>", "<|code_suffix|>",
    "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
    "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"))
_USER_TEXTS = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))


def _added_tokens(vocab: dict, tokens, types, eos: int = -1):
    """(special, user-defined) AddedTokens of a GGUF vocab as llama.cpp's loader types them:
    CONTROL and UNKNOWN tokens are special (matched in text only with parse_special),
    USER_DEFINED ones are matched always; a token of ``_CONTROL_TEXTS`` is CONTROL and one of
    ``_USER_TEXTS`` USER_DEFINED whatever its type, but <|end|> and </s> where
    :func:`end_of_generation_ids` leaves them out (USER_DEFINED / NORMAL there). ``vocab``:
    text -> id of ``tokens``."""
    from tokenizers import AddedToken
    eog = end_of_generation_ids(vocab.get, eos)
    kind = list(types)
    for t, i in vocab.items():
        if t in _CONTROL_TEXTS:
            kind[i] = _CONTROL
        if t in _USER_TEXTS:
            kind[i] = _USER_DEFINED
    for t, y in (("<|end|>", _USER_DEFINED), ("</s>", _NORMAL)):
        if t in vocab and vocab[t] not in eog and t in _CONTROL_TEXTS and vocab[t] != eos:
            kind[vocab[t]] = y
    special, user = [], []
    for t, y in zip(tokens, kind):
        if y in (_CONTROL, _UNKNOWN, _USER_DEFINED):
            (user if y == _USER_DEFINED else special).append(
                AddedToken(t, special=y != _USER_DEFINED, normalized=False, lstrip=False,
                           rstrip=False, single_word=False))
    return special, user


def _add_tokens(tok, vocab: dict, tokens, types, eos: int = -1) -> None:
    """Register the vocab's added tokens on ``tok`` (``_added_tokens``); ``add_tokens`` keeps a
    user-defined token non-special, where ``add_special_tokens`` would mark it special."""
    special, user = _added_tokens(vocab, tokens, types, eos)
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _bpe_json(tk, vocab, pairs, pre, tokens, types, eos: int = -1) -> str:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    tok = tk.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                  byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, vocab, tokens, types, eos)
    return tok.to_str()


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
class Tokenizer:
    """Encode/decode text and render chat prompts.

    ``vocab_size`` (int), ``bos_token_id`` / ``eos_token_id`` (int, -1 when absent),
    ``eog_ids`` (frozenset of int: the ids that end a generation, :func:`end_of_generation_ids`),
    ``chat_template`` (str, Jinja). Raises TokenizerError on bad input (ids out of range, a
    missing template, non-str text).
    """

    def __init__(self, hf_tokenizer, *, bos_token_id: int = -1, eos_token_id: int = -1,
                 chat_template: str = "", dropped_byte_id: int | None = None,
                 keeps_every_byte: bool = False, spm: dict | None = None):
        self._tok = hf_tokenizer
        # None: byte-level tokens; else how SentencePiece-style tokens decode (_spm_decoding)
        self._spm = spm
        # every byte of a text reaches the BPE model (no normalizer, no pre-tokenizer that
        # removes text): the premise of min_tokens' bound
        self._keeps_bytes = keeps_every_byte
        self._bound = None            # (longest token in bytes, bytes no token holds)
        # the unk token from_json adds (the last id; never returned by encode)
        self._dropped = dropped_byte_id
        self.vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True)) \
            - (dropped_byte_id is not None)
        self.bos_token_id = int(bos_token_id)
        self.eos_token_id = int(eos_token_id)
        self.eog_ids = end_of_generation_ids(hf_tokenizer.token_to_id, self.eos_token_id)
        self.chat_template = chat_template or ""
        self._bytes: list[bytes] | None = None
        self._byte_ids: set[int] = set()    # SentencePiece byte-fallback tokens ("<0xNN>")
        added = hf_tokenizer.get_added_tokens_decoder()
        self._special: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # special token text -> id, and a regex matching them leftmost-longest (the way HF's
        # added-token matcher and llama.cpp's partition find them)
        self._special_ids = {added[i].content: i for i in sorted(self._special)}
        alts = [re.escape(t) for t in sorted(self._special_ids, key=len, reverse=True)]
        self._special_re = re.compile("|".join(alts) or "(?!)")
        self._escape_re = re.compile("|".join(alts + [f"[{_ESC_OPEN}{_ESC_CLOSE}]"]))
        self._plain_tok = None        # the same tokenizer with special tokens left unmatched

    @classmethod
    def from_json(cls, json_str: str, *, bos_token_id: int = -1, eos_token_id: int = -1,
                  chat_template: str = "") -> "Tokenizer":
        """Load HF ``tokenizers`` JSON: byte-level BPE, or a SentencePiece-style BPE /
        Unigram (``_spm_decoding``: Llama's and Mistral's tokenizer.json), whose ids and text
        are the ``tokenizers`` library's own; raises TokenizerError if invalid or another
        kind."""
        tk = _tokenizers()
        try:
            spec = json.loads(json_str)
            hf = tk.Tokenizer.from_str(json_str)
        except Exception as e:  # json.JSONDecodeError, or tokenizers' plain Exception
            raise TokenizerError(f"invalid tokenizer JSON: {e}") from None
        dec = (spec.get("decoder") or {}).get("type")
        spm = None if dec == "ByteLevel" else _spm_decoding(spec)
        if dec != "ByteLevel" and spm is None:
            raise TokenizerError(f"only byte-level BPE and SentencePiece-style (Metaspace / "
                                 f"Replace + ByteFallback) tokenizers are supported (decoder "
                                 f"{dec!r}, model {(spec.get('model') or {}).get('type')!r})")
        barrier = None
        model = spec.get("model") or {}
        if dec == "ByteLevel" and model.get("type") == "BPE" and model.get("unk_token") is None:
            # A byte whose byte-level character is not in the vocab (SmolLM2 lacks 21 of the
            # 256) is dropped by both, but llama.cpp drops it *after* the BPE merges: the
            # symbol stays in the word and no merge crosses it ("a<b>c" with b missing gives
            # "a", "c", never "ac"). HF's BPE without an unk token drops it before merging.
            # An unk token of our own, one id past the vocab, reproduces llama.cpp's order;
            # encode() then removes it.
            ids = list(model.get("vocab", {}).values())
            ids += [t.get("id", -1) for t in spec.get("added_tokens") or []]
            barrier = max(ids, default=-1) + 1
            name = "<|tinyloop:dropped-byte|>"
            # an added token missing from the model's vocab (the Qwen2 / Llama-3 layout) gets
            # its id from the vocab's size when HF loads it, not from the JSON: the marker
            # would shift them all by one. In the vocab at their own ids, they keep them
            vocab = model["vocab"]
            for t in spec.get("added_tokens") or []:
                if isinstance(t, dict) and isinstance(t.get("content"), str) \
                        and t["content"] not in vocab and isinstance(t.get("id"), int):
                    vocab[t["content"]] = t["id"]
            vocab[name] = barrier
            model["unk_token"], model["fuse_unk"] = name, False
            try:
                hf = tk.Tokenizer.from_str(json.dumps(spec))
            except Exception as e:
                raise TokenizerError(f"invalid tokenizer JSON: {e}") from None
        return cls(hf, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   chat_template=chat_template, dropped_byte_id=barrier,
                   keeps_every_byte=spm is None and _keeps_every_byte(spec), spm=spm)

    @classmethod
    def from_tlm(cls, tlm) -> "Tokenizer":
        """The tokenizer embedded in an open :class:`tinyloop.format.TLMFile`."""
        js = tlm.tokenizer_json
        if js is None:
            raise TokenizerError(f"{tlm.path}: the file has no embedded tokenizer")
        return cls.from_json(js, bos_token_id=tlm.config.bos_token_id,
                             eos_token_id=tlm.config.eos_token_id,
                             chat_template=tlm.chat_template)

    # -- encode ---------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids (list of int) of ``text``.

        ``parse_special`` is llama.cpp's ``special`` flag: True, a control token written in the
        text (``<|im_start|>``) becomes its single id; False, its text is encoded as plain
        text (for text from users), the ids llama.cpp's ``tokenize(..., special=False)``
        gives. User-defined added tokens are matched either way. ``add_bos`` prepends
        ``bos_token_id`` (when the vocab has one). Raises TokenizerError for a non-str.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode needs a str, got {type(text).__name__}")
        hf = self._tok if parse_special else self._plain()
        # encode_batch releases the GIL while it works (encode holds it throughout, so a long
        # text stalled every other thread, a server's event loop among them); same ids
        ids = hf.encode_batch([text], add_special_tokens=False)[0].ids
        if self._dropped is not None and self._dropped in ids:
            ids = [i for i in ids if i != self._dropped]
        if add_bos and self.bos_token_id >= 0:
            ids = [self.bos_token_id] + ids
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` found without encoding: every token holds
        at most the longest vocabulary entry's bytes, and every byte of the text but those no
        token holds (which encode drops) lands in some token, so the count is at least
        ceil(kept bytes / longest). 0 where that premise is not known to hold (a normalizer,
        a pre-tokenizer that may remove text) or for text that is not valid Unicode."""
        if not self._keeps_bytes or not isinstance(text, str):
            return 0
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            return 0
        if self._bound is None:
            # a byte counts only where the vocabulary holds its byte-level character (a raw
            # " " entry is no token of the byte " ", which the model sees as "Ġ")
            inv = _byte_decoder()
            added = self._tok.get_added_tokens_decoder()
            singles = {inv[t] for t, i in self._tok.get_vocab(with_added_tokens=True).items()
                       if len(t) == 1 and t in inv and i not in added}
            self._bound = (max(map(len, self._table()), default=1) or 1,
                           bytes(b for b in range(256) if b not in singles))
        longest, absent = self._bound
        kept = len(data.translate(None, absent)) if absent else len(data)
        return -(-kept // longest)

    def _plain(self):
        """A copy of the HF tokenizer that leaves special tokens unmatched (made once)."""
        if self._plain_tok is None:
            plain = type(self._tok).from_str(self._tok.to_str())
            plain.encode_special_tokens = True     # special added tokens are plain text
            self._plain_tok = plain
        return self._plain_tok

    # -- decode ---------------------------------------------------------------------------------
    def _table(self) -> list[bytes]:
        if self._bytes is None:
            inv = _byte_decoder()
            added = self._tok.get_added_tokens_decoder()
            table = [b""] * self.vocab_size
            spm = self._spm
            for tok, i in self._tok.get_vocab(with_added_tokens=True).items():
                if i >= self.vocab_size:            # the dropped-byte marker (from_json)
                    continue
                if spm is not None:     # the decoder chain runs over added tokens too
                    m = _BYTE_TOKEN.fullmatch(tok) if spm["byte_fallback"] else None
                    if m:
                        self._byte_ids.add(i)
                        table[i] = bytes([int(m.group(1), 16)])
                    else:
                        table[i] = tok.replace(spm["space"], " ").encode("utf-8")
                elif i not in added and all(c in inv for c in tok):
                    table[i] = bytes(inv[c] for c in tok)
                else:   # added tokens (and any non-byte-level string) stand for their UTF-8
                    table[i] = tok.encode("utf-8")
            self._bytes = table
        return self._bytes

    def _check_id(self, i) -> int:
        try:
            i = operator.index(i)      # int or NumPy integer
        except TypeError:
            raise TokenizerError(f"token id must be an int, got {i!r}") from None
        if not 0 <= i < self.vocab_size:
            raise TokenizerError(f"token id {i} is outside 0..{self.vocab_size - 1}")
        return i

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (may be part of a UTF-8 character)."""
        return self._table()[self._check_id(token_id)]

    def decode_token(self, token_id: int) -> str:
        """One token as text (U+FFFD for an incomplete UTF-8 piece; use :meth:`stream` to
        decode a sequence piece by piece)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return self._check_id(token_id) in self._special

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: bytes concatenated, then UTF-8 (U+FFFD for invalid bytes). A
        SentencePiece-style tokenizer decodes as its ``tokenizers`` decoder does: each run of
        byte-fallback tokens as UTF-8 (one U+FFFD per token of a run that is not), spaces for
        its space character, and one leading space dropped where the decoder strips it."""
        if self._spm is not None:
            st = self.stream(skip_special_tokens)
            return "".join(st.push(i) for i in ids) + st.flush()
        table = self._table()
        parts = []
        for i in ids:
            i = self._check_id(i)
            if skip_special_tokens and i in self._special:
                continue
            parts.append(table[i])
        return b"".join(parts).decode("utf-8", errors="replace")

    @property
    def strips_leading_space(self) -> bool:
        """Whether decoding drops leading space: one space of the text (a SentencePiece
        decoder's Strip) or every space of the first token (Metaspace); byte-level decoders
        keep it."""
        return self._spm is not None and self._spm["strip"] is not None

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        """An incremental decoder: ``push(id) -> str`` then ``flush() -> str``."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, check=None):
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the embedded Jinja
        chat template, as HF ``transformers`` does (sandboxed, trim_blocks, lstrip_blocks).

        ``tokenize=False`` returns the prompt text (str). ``tokenize=True`` returns its token
        ids (list of int) with the messages treated as plain text: the template's own markers
        (``<|im_start|>``, ``<|im_end|>``, bos/eos) are control tokens, while the same text
        inside a message's fields is encoded like ``encode(..., parse_special=False)``, so a
        user cannot forge a turn boundary. Where no message holds a special token's text, the
        ids equal ``encode(apply_chat_template(messages))``. Use ``tokenize=True`` for any
        prompt with text from users: encoding the returned string with ``parse_special=True``
        turns such text back into control tokens. ``check``: with ``tokenize=True``, called
        with the prompt text after rendering and before encoding (to refuse a text too long
        to encode; what it raises propagates).
        Raises TokenizerError when there is no template or it fails to render.
        """
        if not self.chat_template:
            raise TokenizerError("this model has no chat template")
        literals: list[str] = []
        rendered = render_chat_template(self.chat_template,
                                        self._escape_messages(messages, literals),
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self._token_text(self.bos_token_id),
                                        eos_token=self._token_text(self.eos_token_id))
        if not tokenize:
            return _unescape(rendered, literals)
        if check is not None:
            check(_unescape(rendered, literals))
        ids, pos = [], 0
        for m in self._special_re.finditer(rendered):        # the template's markers only
            if m.start() > pos:
                ids += self.encode(_unescape(rendered[pos:m.start()], literals),
                                   parse_special=False)
            ids.append(self._special_ids[m.group()])
            pos = m.end()
        if pos < len(rendered):
            ids += self.encode(_unescape(rendered[pos:], literals), parse_special=False)
        return ids

    def _escape_messages(self, messages, literals: list[str]):
        """``messages`` with every special token's text (and every escape character) in their
        str fields replaced by ``\ufdd0<k>\ufdd1``, ``literals[k]`` holding the original:
        the template renders them as opaque text that no special-token match can see.
        Anything that is not a list of dicts is passed on for the renderer to reject."""
        if not isinstance(messages, (list, tuple)):
            return messages

        def esc(m):
            literals.append(m.group())
            return f"{_ESC_OPEN}{len(literals) - 1}{_ESC_CLOSE}"

        return [{k: self._escape_re.sub(esc, v) if isinstance(v, str) else v for k, v in m.items()}
                if isinstance(m, dict) else m for m in messages]

    def _token_text(self, i: int) -> str:
        return "" if i < 0 else self._table()[i].decode("utf-8", errors="replace")


_ESC_OPEN, _ESC_CLOSE = "\ufdd0", "\ufdd1"      # Unicode noncharacters: never in a template
_ESC_RE = re.compile(f"{_ESC_OPEN}(\\d+){_ESC_CLOSE}")


def _unescape(text: str, literals: list[str]) -> str:
    """Undo ``Tokenizer._escape_messages`` in rendered text."""
    if not literals:
        return text
    return _ESC_RE.sub(lambda m: literals[int(m.group(1))], text)


class StreamDecoder:
    """Decode token ids one at a time without emitting garbage for a UTF-8 character split
    across tokens: bytes of an incomplete character are held back until it completes (for a
    SentencePiece-style tokenizer, a run of byte-fallback tokens until the run ends). The
    concatenation of every ``push`` and the final ``flush`` equals ``Tokenizer.decode``."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._spm = tokenizer._spm is not None
        self._run = bytearray()          # SentencePiece: the byte-fallback run held back
        self._lead = tokenizer.strips_leading_space   # the first text's space is still due

    def _out(self, text: str, first_token: bool = False) -> str:
        """``text`` with the leading space the decoder drops, once: one space (Strip) at
        the start of the text, or (Metaspace) every space of the first token's own text."""
        if not (self._lead and text):
            return text
        self._lead = False
        if self._tok._spm["strip"] == "first":
            return text.replace(" ", "") if first_token else text
        return text[1:] if text.startswith(" ") else text

    def _end_run(self) -> str:
        """The held byte-fallback run as text: its UTF-8, else one U+FFFD per byte
        (tokenizers' ByteFallback decoder)."""
        run, self._run = bytes(self._run), bytearray()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def push(self, token_id: int) -> str:
        """Text completed by ``token_id`` (possibly "")."""
        if self._skip and self._tok.is_special(token_id):
            return ""
        raw = self._tok.token_bytes(token_id)
        if not self._spm:
            return self._out(self._dec.decode(raw))
        if token_id in self._tok._byte_ids:
            self._run += raw
            return ""
        if self._run:
            return self._out(self._end_run()) + self._out(raw.decode("utf-8", errors="replace"))
        return self._out(raw.decode("utf-8", errors="replace"), first_token=True)

    @property
    def holding(self) -> bool:
        """True while the bytes of an incomplete UTF-8 character are held back."""
        return bool(self._run) or bool(self._dec.getstate()[0])

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); resets the state."""
        out = self._out(self._end_run() if self._run else self._dec.decode(b"", final=True))
        self._dec.reset()
        self._lead = self._tok.strips_leading_space
        return out


@lru_cache(maxsize=16)
def _compiled_template(template: str):
    """``template`` compiled in transformers' environment (``render_chat_template``), once per
    template string as transformers caches it: compiling costs more than rendering."""
    import datetime

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template error: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], *,
                         add_generation_prompt: bool = True, **extra) -> str:
    """Render a HF-style chat template with jinja2 in transformers' environment
    (``chat_template_utils._compile_jinja_template``): sandboxed, trim_blocks and
    lstrip_blocks, the loopcontrols extension (``{% break %}``, ``{% continue %}``), a
    ``tojson`` filter that is ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``; Jinja's
    own escapes ``<`` and sorts keys), and the ``raise_exception`` and ``strftime_now``
    (local time) globals; each template string compiles once. Raises TokenizerError for bad
    messages and for any failure of the template (a file's template is untrusted input)."""
    try:
        import jinja2
    except ImportError:
        raise TokenizerError("chat templates need the 'jinja2' package: pip install jinja2") \
            from None
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise TokenizerError("messages must be a list of {'role': str, 'content': str} dicts, "
                             f"got {messages!r:.200}")
    try:
        return _compiled_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    except TokenizerError:
        raise
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed to render: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
            RecursionError, SyntaxError) as e:    # the template's own code
        raise TokenizerError(f"chat template failed to render: {type(e).__name__}: "
                             f"{str(e)[:200]}") from None
