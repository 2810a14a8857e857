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
