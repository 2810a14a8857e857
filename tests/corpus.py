"""A varied text corpus shared by the tests (tokenizer equality, decode round trip, peer checks).

``CORPUS``: several hundred distinct strings: prose with accents, CJK and other scripts, emoji
(ZWJ sequences, skin tones, flags, variation selectors), digits and long numbers, code (Python,
C, JSON, shell), runs of spaces / tabs / newlines, odd Unicode spacing and marks, the chat
special tokens, and mixtures. Deterministic: built from literals and fixed loops only.

``PASSAGES``: a few longer natural texts (prose, code, chat) for teacher-forced model checks.
"""

from __future__ import annotations

PROSE = [
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "It's a dog's life, isn't it? We'll see; they'd know, I'm sure, you've heard.",
    "IT'S LOUD. DON'T SHOUT! WE'LL, THEY'D, I'M, YOU'VE, SHE'S",
    "A sentence with trailing space ",
    " leading space",
    "  two leading spaces",
    "Multiple     spaces     between     words",
    "Tabs\tbetween\twords",
    "Line one\nLine two\nLine three",
    "Windows\r\nline\r\nendings\r\n",
    "Paragraph one.\n\nParagraph two.\n\n\nParagraph three.",
    "Ends with newline\n",
    "Ends with two newlines\n\n",
    "Mr. Smith went to Washington, D.C., on Jan. 5th -- or was it the 6th?",
    "e.g., i.e., etc., vs. ... — – - hyphen-ated words",
    "\"Quoted text\" and 'single quotes' and `backticks`",
    "“Curly quotes” and ‘apostrophes’ and «guillemets» and „German quotes“",
    "Parentheses (like this) [and this] {and this} <and this>",
    "Email: someone@example.com, URL: https://example.org/path?q=1&r=two#frag",
    "#hashtag @mention $dollar %percent ^caret &ampersand *star",
    "Once upon a time, in a land far, far away, there lived a small robot who loved to count stars.",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "I can't believe it's not butter!",
    "lowercase sentence without punctuation",
    "ALLCAPSWORDWITHOUTSPACES",
    "CamelCaseIdentifierName and snake_case_identifier and kebab-case-name",
    "Supercalifragilisticexpialidocious",
    "Pneumonoultramicroscopicsilicovolcanoconiosis is a long word.",
    "a", "I", "?", "!", ".", ",", "'", "''", "'s", "x's", "'re", "'ll", "'d", "'ve", "'m", "'t",
    "ok", "OK", "Ok.", "yes", "No!", "Why?", "Hmm...", "Wait—what?",
]

ACCENTS = [
    "café", "naïve", "résumé", "façade", "jalapeño", "über", "Straße", "smörgåsbord",
    "crème brûlée", "Ångström", "São Paulo", "Kraków", "Zürich", "Dvořák", "Bjørn",
    "Ça va? Très bien, merci.",
    "Él está en la niñez; ¿qué pasa? ¡Olé!",
    "Größenwahn und Übermut; Öl, Äpfel.",
    "Ελληνικά: Καλημέρα κόσμε",
    "Русский: Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Українська: Ґанок, їжак, є",
    "Polski: Zażółć gęślą jaźń",
    "Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy",
    "Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi",
    "Tiếng Việt: Xin chào thế giới",
    "Română: Înțeleg și știu",
    "Íslenska: Þú ert ljósið",
    "decomposed e\u0301 and a\u0308 and n\u0303",
    "combining marks: a\u0300\u0301\u0302\u0303",
    "Ångström (precomposed) vs A\u030angstro\u0308m (decomposed)",
]

SCRIPTS = [
    "中文：你好，世界！",
    "我爱自然语言处理。今天天气很好。",
    "日本語のテキスト：こんにちは、世界。カタカナとひらがな。",
    "東京は日本の首都です。",
    "한국어: 안녕하세요, 세계!",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "বাংলা: হ্যালো বিশ্ব",
    "தமிழ்: வணக்கம் உலகம்",
    "ไทย: สวัสดีชาวโลก",
    "ქართული: გამარჯობა მსოფლიო",
    "Հայերեն: Բարեւ աշխարհ",
    "አማርኛ: ሰላም ለዓለም",
    "Mixed 中文 and English 和日本語 in one line",
    "全角文字：ＡＢＣ　１２３",
    "CJK punctuation：「引用」『二重』【括弧】〜・",
    "中文数字一二三四五六七八九十百千万",
    "𠀀𠀁𠀂 (CJK Extension B)",
    "Ideographic\u3000space",
]

EMOJI = [
    "😀", "😀😃😄", "I love 🍕 and 🍣!", "❤️", "❤", "♥️ ♠️ ♦️ ♣️",
    "👍", "👍🏻👍🏼👍🏽👍🏾👍🏿", "👩‍💻", "👨‍👩‍👧‍👦", "👩‍👩‍👧", "🏳️‍🌈", "🏴‍☠️",
    "🇺🇸🇫🇷🇯🇵🇩🇪", "🇬🇧", "1️⃣ 2️⃣ #️⃣", "🧑🏽‍🚀 to the 🌕",
    "Emoji at end 🎉", "🎉 Emoji at start", "text😀text", "  😀  ", "🙂\n🙃",
    "★☆✓✗✔✘→←↑↓⇒⇔", "©®™℠", "∑∫∂∇√∞≈≠≤≥±×÷", "αβγδεζηθ λμνξ πρστ φχψω",
    "♪♫ ♩♬", "⌘⌥⇧⌃", "☃❄☀☁☂", "🀄🃏🎴",
]

NUMBERS = [
    "0", "1", "12", "123", "1234", "12345", "123456789", "1234567890123456789012345",
    "3.14159265358979", "-42", "+7", "1,000,000", "1.000.000,00", "1e10", "6.022e23",
    "0x1F", "0xDEADBEEF", "0b101010", "0o777", "1_000_000", "99%", "$19.99", "€5,00", "£3",
    "¥1000", "12:30:45", "2024-01-15", "15/01/2024", "v1.2.3", "3rd 4th 21st 22nd",
    "Phone: +1 (555) 123-4567", "IPv4 192.168.0.1", "½ ¼ ¾", "x² + y³ = z⁴", "H₂O CO₂",
    "Ⅻ Ⅳ ⅸ", "٠١٢٣٤٥٦٧٨٩", "१२३", "①②③", "１２３４５", "3.0 vs 3.00 vs 3.000",
    "Room 101, floor 7, building 42B", "π ≈ 3.14", "10^9 + 7 = 1000000007",
]

CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)",
    "if __name__ == \"__main__\":\n    main()\n",
    "class Foo(Bar):\n    def __init__(self, x: int = 0) -> None:\n        self.x = x\n",
    "    indented with four spaces",
    "        eight spaces",
    "\tone tab",
    "\t\ttwo tabs",
    "x = [i**2 for i in range(100) if i % 3 == 0]",
    "lambda x: x * 2",
    "import numpy as np\nimport torch.nn.functional as F",
    "print(f\"{name!r:>10} = {value:.3f}\")",
    "# comment\n\"\"\"docstring\"\"\"\n'''other'''",
    "@decorator\nasync def fetch(url):\n    await session.get(url)",
    "try:\n    pass\nexcept (ValueError, KeyError) as e:\n    raise RuntimeError from e",
    "#include <stdio.h>\n\nint main(void) {\n    printf(\"Hello, world!\\n\");\n    return 0;\n}\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * c[i]; }",
    "struct node { int val; struct node *next; };",
    "#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "ptr->field = &other; *out++ = x << 2 | y >> 3;",
    "__global__ void kernel(float *x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; }",
    "template <typename T> std::vector<T> v{1, 2, 3};",
    "{\"name\": \"TinyLoop\", \"version\": 1, \"tags\": [\"a\", \"b\"], \"nested\": {\"x\": null}}",
    "{\n  \"key\": \"value\",\n  \"number\": 42,\n  \"float\": -1.5e-3,\n  \"bool\": true\n}",
    "[1, 2, 3, {\"a\": [4, 5]}, \"six\"]",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "$ ls -la /usr/local/bin | grep python && echo \"done\"",
    "git commit -m \"Fix bug #123\" && git push origin main",
    "<html><body><div class=\"x\">Hello</div></body></html>",
    "fn main() { let v: Vec<u32> = (0..10).collect(); println!(\"{:?}\", v); }",
    "function f(x) { return x === undefined ? null : x?.y ?? 0; }",
    "a==b!=c<=d>=e&&f||g",
    "x+=1;y-=2;z*=3;w/=4;",
    "/* block comment */ // line comment",
    "https://github.com/user/repo/blob/main/src/lib.rs#L10-L20",
    "C:\\Users\\name\\Documents\\file.txt",
    "~/projects/tinyloop/tests/test_tokenizer.py::test_corpus[17]",
    "matrix[0][1] = matrix[1][0]",
    "def f():\n\n\n    return 1\n\n\n",
    "key=value\nother_key = other value\n# ini comment",
    "---\ntitle: YAML\nitems:\n  - one\n  - two\n",
    "| col1 | col2 |\n|------|------|\n| a    | b    |",
    "```python\nprint('hi')\n```",
    "$$\\frac{a}{b} + \\sqrt{x^2 + y^2}$$",
]

SPACING = [
    " ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\t \t", "\n", "\n\n", "\n\n\n",
    "\r\n", "\r", " \n", "\n ", " \n ", "  \n  ", "\n\t\n", "a\n\nb", "a \n b", "a  \n  b",
    "word \t word", "trailing tabs\t\t", "\n\n\nleading newlines", "x\u00a0y (no-break space)",
    "em\u2003space and en\u2002space and thin\u2009space", "zero\u200bwidth\u200bspace",
    "line\u2028separator", "para\u2029separator", "vertical\x0btab and form\x0cfeed",
    "\ufeffBOM at start", "soft\u00adhyphen", "a\u200db (ZWJ between letters)",
    "right-to-left \u202emark\u202c", "   \n\n   \n", "\t\n\t\n", "a" + " " * 17 + "b",
    "a" + "\n" * 9 + "b", "a" + "\t" * 7 + "b", " " * 40, "\n" * 12,
]

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHello!<|im_end|>\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\n2 + 2 = 4.<|im_end|>\n<|endoftext|>",
    "text<|im_end|>text",
    " <|im_start|> spaced <|im_end|> ",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start|>user\n日本語で答えて 😀<|im_end|>",
    "<repo_name>tinyloop<file_sep>README.md<filename>src/main.py",
    "<gh_stars>100<issue_start>Bug report<issue_comment>Fixed.<issue_closed>",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output><jupyter_text>",
    "<|im_start", "im_start|>", "<|im_start |>", "< |im_start|>", "<|IM_START|>",
    "<|im_start|><|im_start|>",
]

MIXED = [
    "The price is $1,234.56 (≈ €1.100) — 10% off! 🎉",
    "Résumé: 3 years @ Google, 2 yrs @ 东京 startup; skills: C++/CUDA, Python 3.12.",
    "User 👩‍💻 wrote: `x = 42  # the answer`\n\nThen left. 😅",
    "Temperatures: -40°C = -40°F; 100°C = 212°F.",
    "Math: ∀x ∈ ℝ, x² ≥ 0. ∃n ∈ ℕ: n > 10¹⁰⁰.",
    "Chemistry: C₆H₁₂O₆ + 6O₂ → 6CO₂ + 6H₂O",
    "Version 2.0.1-beta+build.123 released on 2024-06-01T12:00:00Z",
    "日本語とEnglishと123と😀を混ぜる",
    "<|im_start|>user\nTranslate 'café' to 日本語 & give 3 emoji 🎉🎊🎈<|im_end|>\n",
    "Tab\tseparated\tvalues\n1\t2\t3\n4\t5\t6\n",
    "CSV,line,with,commas\n\"quoted, field\",2,3.5\n",
    "A\u0301B\u0302C\u0303 😀\u200d😃 ١٢٣ ٤٥٦",
    "    def f(x):  # 4 spaces\n\treturn x\t# tab\n",
    "Name: José Ñúñez | Age: 42 | City: México D.F.",
    "!!! ??? ... ,,, ;;; ::: --- ___ *** ### @@@",
    "''' \"\"\" ``` ~~~",
    "Ünïcödé wörds with ümlauts and 2024 numbers",
    "http://例え.テスト/パス?クエリ=値",
    "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n",
    "I'm 25 y/o & it's 2:30pm; we're @ home #blessed 🙏",
]


def _generated() -> list[str]:
    """Deterministic combinations that stress digits, contractions and whitespace runs."""
    out = []
    words = ["alpha", "Beta", "GAMMA", "déjà", "日本", "😀", "x1", "42", "it's", "<|im_end|>"]
    seps = [" ", "  ", "\t", "\n", " \n", "\n\n", "", ", ", ". ", " - "]
    for i, w in enumerate(words):
        for j, s in enumerate(seps):
            out.append(w + s + words[(i + j + 1) % len(words)])
    for n in range(1, 26):                       # numbers of every length 1..25
        out.append("".join(str((k * 7 + n) % 10) for k in range(n)))
        out.append("n=" + "9" * n + " ok")
    for k in range(1, 9):                        # whitespace runs before words and punctuation
        out.append(" " * k + "word")
        out.append("word" + " " * k + "!")
        out.append("\n" * k + "x")
        out.append("x" + "\t" * k + "y")
    return out


def _dedupe(items):
    seen, out = set(), []
    for s in items:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


CORPUS: list[str] = _dedupe(PROSE + ACCENTS + SCRIPTS + EMOJI + NUMBERS + CODE + SPACING
                            + SPECIAL + MIXED + _generated())

PASSAGES: list[str] = [
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring circuits; later, stored programs let the same hardware run many tasks. Compilers "
    "turned human-readable code into machine instructions, and operating systems hid the "
    "details of memory and devices. Today, large language models add another layer: people "
    "describe what they want in plain words, and the model writes the code. Whether this makes "
    "programming easier or simply different is still an open question.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "if __name__ == \"__main__\":\n    for i in range(10):\n        print(i, fibonacci(i))\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France, and why is it famous?"
    "<|im_end|>\n<|im_start|>assistant\nThe capital of France is Paris. It is famous for the "
    "Eiffel Tower, the Louvre museum, its cafés and its long history as a centre of art, "
    "fashion and science.<|im_end|>\n",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the air pressure "
    "is lower, so it boils at a lower temperature. In Denver, about 1,600 metres above sea "
    "level, water boils at roughly 95 degrees. This is why cooking instructions sometimes "
    "include adjustments for high altitude.",
    "Le petit prince s'assit sur une pierre et leva les yeux vers le ciel. « Les étoiles sont "
    "éclairées, dit-il, afin que chacun puisse un jour retrouver la sienne. »",
    "#include <stdio.h>\n\n/* Sum the integers from 1 to n. */\nlong sum_to(int n) {\n"
    "    long total = 0;\n    for (int i = 1; i <= n; i++) {\n        total += i;\n    }\n"
    "    return total;\n}\n\nint main(void) {\n    printf(\"%ld\\n\", sum_to(100));\n"
    "    return 0;\n}\n",
    "<|im_start|>user\nGive me three tips for staying focused while studying.<|im_end|>\n"
    "<|im_start|>assistant\n1. Put your phone in another room so notifications cannot "
    "distract you.\n2. Work in short blocks of 25 minutes with 5-minute breaks.\n3. Write down "
    "one clear goal for each session before you start.<|im_end|>\n",
    "{\"name\": \"Ada Lovelace\", \"born\": 1815, \"died\": 1852, \"known_for\": [\"Analytical "
    "Engine\", \"first computer program\"], \"country\": \"United Kingdom\"}\nAda Lovelace "
    "wrote notes on Charles Babbage's Analytical Engine in 1843, including a method for "
    "computing Bernoulli numbers.",
]
