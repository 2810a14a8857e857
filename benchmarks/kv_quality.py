"""Quality of each KV storage mode against fp16 on the embedded model (KL, top-1).

    python -m benchmarks kv_quality [--model default] [--backend numpy] [--depths 1,4]
                                    [--modes ...] [--out FILE.json]

Teacher-forced logits of a fixed set of texts of four kinds (``TEXTS`` below, written for
this measurement: prose - stories, technical writing, a recipe, history, a letter; code -
Python, C, JavaScript, SQL, Rust, shell; chat - conversations in the model's chat template;
numbers - tables, lists, timetables, measurements, an invoice) at each depth, once with
``kv_mode="fp16"`` and once per mode. Per mode, depth and kind (and over all kinds): the mean
over every position of KL(p_fp16 || p_mode) (nats) and top-1 agreement (argmax equal), with
the spread over texts (min..max of the per-text means). Targets: int8 <= 2e-3,
h_fp16 <= 1e-4, h_int8 <= 5e-3, h_int4 <= 0.05 (at depth 4, on every kind).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tinyloop
from tinyloop.generate import log_softmax_rows

from .common import DEFAULT, add_model_arg, model_path, write_json

TARGETS = {"int8": 2e-3, "h_fp16": 1e-4, "h_int8": 5e-3, "h_int4": 0.05}

PROSE = [
    "The lighthouse keeper had kept a logbook for forty years. Every evening he wrote down the "
    "wind, the colour of the sea, and the ships that passed before dark. Most entries were "
    "short: a northerly breeze, grey water, two trawlers. But in the winter of the great storm "
    "the entries grew longer, and his handwriting, usually so careful, began to slant as if the "
    "pen itself were leaning into the gale. On the third night he wrote that the lamp had gone "
    "out twice, and that he had climbed the stairs with a candle to relight it, counting each "
    "step aloud so that he would not lose his nerve.",
    "A hash table stores key-value pairs in an array of buckets. To insert a key, we compute "
    "its hash, reduce it modulo the number of buckets, and place the pair in that bucket. When "
    "two keys land in the same bucket we have a collision, which can be resolved by chaining "
    "(each bucket holds a small list) or by open addressing (we probe other buckets in a fixed "
    "order). The load factor, the number of stored pairs divided by the number of buckets, "
    "controls performance: when it grows past a threshold, the table is resized and every key "
    "is rehashed into a larger array, which keeps the expected cost of a lookup constant.",
    "\"Are you coming to the market tomorrow?\" asked Mira.\n\"Only if it stops raining,\" said "
    "her brother. \"Last week the tomatoes were all split from the rain.\"\n\"Then we should go "
    "early, before the stalls are picked over. I want to find the woman who sells honey from "
    "the hills.\"\n\"She was not there last time.\"\n\"She comes every other Saturday. I wrote "
    "it down.\" Mira tapped the calendar on the kitchen wall, where small crosses marked the "
    "days in red ink.",
    "Ingredients for a simple bread: 500 grams of flour, 350 millilitres of warm water, 10 "
    "grams of salt, and 7 grams of dried yeast. Mix the flour and salt in a large bowl. "
    "Dissolve the yeast in the water and pour it in, stirring until no dry flour remains. "
    "Cover the bowl and leave it for one hour. Fold the dough over itself four times, then "
    "leave it for another hour. Shape it into a round loaf, let it rise for forty minutes, "
    "and bake it at 230 degrees Celsius for thirty-five minutes until the crust is deep brown.",
    "The French Revolution began in 1789 and reshaped the political landscape of Europe. "
    "Financial crisis, poor harvests and the ideas of the Enlightenment combined to challenge "
    "the absolute monarchy. The Estates-General was summoned for the first time since 1614, "
    "and the Third Estate soon declared itself a National Assembly. Within months the Bastille "
    "had fallen, feudal privileges were abolished, and the Declaration of the Rights of Man "
    "and of the Citizen proclaimed that men are born and remain free and equal in rights.",
    "Dear Mr. Okafor,\n\nThank you for your letter of 12 March regarding the delayed delivery of "
    "your new kitchen cabinets. I am sorry that the order did not arrive on the date we "
    "promised. Our supplier had a fault at their factory, and several orders were held back "
    "while the machines were repaired. Your cabinets left the factory yesterday and should "
    "reach our warehouse by Friday. Our fitters can then install them on Monday or Tuesday of "
    "next week, whichever suits you better. As an apology, we will not charge for the "
    "installation. Please call me directly if you have any questions.\n\nYours sincerely,\n"
    "Helen Marsh\nCustomer Service Manager",
]

CODE = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\n"
    "def test_merge_sorted():\n    assert merge_sorted([1, 4, 9], [2, 3, 10]) == "
    "[1, 2, 3, 4, 9, 10]\n    assert merge_sorted([], [5]) == [5]\n",
    "#include <stdio.h>\n#include <stdlib.h>\n\nstruct node {\n    int value;\n"
    "    struct node *next;\n};\n\nstatic struct node *push(struct node *head, int value) {\n"
    "    struct node *n = malloc(sizeof *n);\n    if (n == NULL) {\n"
    "        perror(\"malloc\");\n        exit(1);\n    }\n    n->value = value;\n"
    "    n->next = head;\n    return n;\n}\n\nint main(void) {\n    struct node *list = NULL;\n"
    "    for (int i = 0; i < 10; i++)\n        list = push(list, i * i);\n"
    "    for (struct node *p = list; p != NULL; p = p->next)\n"
    "        printf(\"%d\\n\", p->value);\n    return 0;\n}\n",
    "function debounce(fn, wait) {\n  let timer = null;\n  return function (...args) {\n"
    "    clearTimeout(timer);\n    timer = setTimeout(() => fn.apply(this, args), wait);\n"
    "  };\n}\n\nconst input = document.querySelector('#search');\n"
    "const results = document.querySelector('#results');\n\n"
    "input.addEventListener('input', debounce(async (event) => {\n"
    "  const query = event.target.value.trim();\n  if (!query) {\n"
    "    results.innerHTML = '';\n    return;\n  }\n"
    "  const response = await fetch(`/api/search?q=${encodeURIComponent(query)}`);\n"
    "  const items = await response.json();\n"
    "  results.innerHTML = items.map((item) => `<li>${item.title}</li>`).join('');\n"
    "}, 250));\n",
    "SELECT c.name, COUNT(o.id) AS orders, SUM(o.total) AS revenue\nFROM customers AS c\n"
    "JOIN orders AS o ON o.customer_id = c.id\nWHERE o.created_at >= DATE '2023-01-01'\n"
    "  AND o.status <> 'cancelled'\nGROUP BY c.name\nHAVING COUNT(o.id) > 3\n"
    "ORDER BY revenue DESC\nLIMIT 20;\n\nCREATE INDEX idx_orders_customer ON orders "
    "(customer_id, created_at);\n\nUPDATE products\nSET price = ROUND(price * 1.05, 2)\n"
    "WHERE category = 'books' AND price < 30;\n",
    "use std::collections::HashMap;\n\nfn word_counts(text: &str) -> HashMap<String, usize> {\n"
    "    let mut counts = HashMap::new();\n    for word in text.split_whitespace() {\n"
    "        let w = word.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase();\n"
    "        if !w.is_empty() {\n            *counts.entry(w).or_insert(0) += 1;\n        }\n"
    "    }\n    counts\n}\n\nfn main() {\n    let text = \"the cat sat on the mat. The end.\";\n"
    "    let mut pairs: Vec<_> = word_counts(text).into_iter().collect();\n"
    "    pairs.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));\n"
    "    for (word, n) in pairs {\n        println!(\"{word}: {n}\");\n    }\n}\n",
    "#!/bin/sh\nset -eu\n\nBACKUP_DIR=/var/backups/db\nKEEP_DAYS=14\n"
    "STAMP=$(date +%Y%m%d-%H%M%S)\n\nmkdir -p \"$BACKUP_DIR\"\n"
    "pg_dump --format=custom --file=\"$BACKUP_DIR/app-$STAMP.dump\" app\n\n"
    "# remove dumps older than KEEP_DAYS days\nfind \"$BACKUP_DIR\" -name 'app-*.dump' "
    "-mtime +\"$KEEP_DAYS\" -delete\n\nif ! ls \"$BACKUP_DIR\"/app-*.dump >/dev/null 2>&1; then\n"
    "    echo \"no backup written\" >&2\n    exit 1\nfi\necho \"backup $STAMP done\"\n",
]

CHAT = [
    [{"role": "user", "content": "What is the difference between a virus and a bacterium?"},
     {"role": "assistant", "content": "Bacteria are single-celled living organisms that can "
      "grow and divide on their own, and many are harmless or even helpful. Viruses are much "
      "smaller and are not cells at all: they can only copy themselves inside the cells of "
      "another organism. That is why antibiotics work against bacteria but not viruses."},
     {"role": "user", "content": "So why do doctors sometimes give antibiotics for a cold?"},
     {"role": "assistant", "content": "They should not for a plain cold, which is viral. "
      "Sometimes a cold is followed by a bacterial infection, such as in the ear or sinuses, "
      "and then an antibiotic can help."}],
    [{"role": "user", "content": "Can you help me plan a three-day trip to Lisbon?"},
     {"role": "assistant", "content": "Of course. Day one: walk through the Alfama district, "
      "visit the castle and take tram 28. Day two: go to Belem for the monastery, the tower and "
      "the famous custard tarts. Day three: take a train to Sintra to see the palaces in the "
      "hills."},
     {"role": "user", "content": "Is it easy to get around without a car?"},
     {"role": "assistant", "content": "Yes. The metro, trams and buses cover the city, and "
      "trains to Sintra and Cascais leave every twenty minutes or so. Wear good shoes: the "
      "streets are steep and paved with smooth stones."}],
    [{"role": "system", "content": "You are a patient maths tutor."},
     {"role": "user", "content": "I don't understand how to add fractions like 1/3 + 1/4."},
     {"role": "assistant", "content": "First find a common denominator. The smallest number "
      "that both 3 and 4 divide into is 12. Then 1/3 = 4/12 and 1/4 = 3/12, so the sum is "
      "7/12."},
     {"role": "user", "content": "What about 2/5 + 1/10?"},
     {"role": "assistant", "content": "Here 10 already works as the common denominator, "
      "because 5 divides 10. 2/5 = 4/10, and 4/10 + 1/10 = 5/10, which simplifies to 1/2."}],
    [{"role": "user", "content": "My Python script says 'ModuleNotFoundError: No module named "
      "requests'. What should I do?"},
     {"role": "assistant", "content": "The requests package is not installed in the Python "
      "that runs your script. Install it with `python -m pip install requests`, using the same "
      "python command you use to run the script, so the package goes to the right place."},
     {"role": "user", "content": "I did that and it still fails."},
     {"role": "assistant", "content": "Then the script probably runs under a different "
      "interpreter, for example a virtual environment or an editor's own Python. Print "
      "`import sys; print(sys.executable)` at the top of the script and install into that one."}],
    [{"role": "user", "content": "Write a short poem about autumn."},
     {"role": "assistant", "content": "The maples burn in red and gold,\nthe mornings turn "
      "from cool to cold,\nthe geese write letters on the sky,\nand summer waves a slow "
      "goodbye."},
     {"role": "user", "content": "Nice! Can you make it about spring instead?"},
     {"role": "assistant", "content": "The blossom breaks on every bough,\nthe fields are "
      "green and waking now,\nthe swallows stitch the warming air,\nand light is spilling "
      "everywhere."}],
]

NUMBERS = [
    "Quarterly results (in millions of euros)\nQuarter, Revenue, Costs, Profit\n"
    "Q1 2022, 142.7, 118.3, 24.4\nQ2 2022, 151.2, 120.9, 30.3\nQ3 2022, 149.8, 125.6, 24.2\n"
    "Q4 2022, 167.5, 131.0, 36.5\nQ1 2023, 155.1, 127.4, 27.7\nQ2 2023, 162.9, 129.8, 33.1\n"
    "Q3 2023, 158.4, 133.2, 25.2\nQ4 2023, 181.6, 140.7, 40.9\nTotal 2023, 658.0, 531.1, 126.9\n",
    "Primes below 200: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, "
    "67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, "
    "163, 167, 173, 179, 181, 191, 193, 197, 199.\nSquares: 1, 4, 9, 16, 25, 36, 49, 64, 81, "
    "100, 121, 144, 169, 196, 225, 256, 289, 324, 361, 400.\nPowers of two: 1, 2, 4, 8, 16, "
    "32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536.",
    "Train timetable, weekdays\n06:12  07:45  09:03  10:30  12:15  13:50  15:20  16:45  17:30  "
    "18:10  19:40  21:05  22:50\nJourney time 47 minutes; platform 3.\nSaturday: 07:30  "
    "09:30  11:30  13:30  15:30  17:30  19:30  21:30\nSunday: 08:45  11:45  14:45  17:45  "
    "20:45\nSingle fare 12.40, return 21.80, weekly pass 78.00, monthly pass 265.00.",
    "Measurements of the sample (mm): 12.07, 12.11, 11.98, 12.04, 12.15, 12.02, 11.95, 12.09, "
    "12.06, 12.00, 12.13, 11.99, 12.08, 12.03, 12.10.\nn = 15, mean = 12.053, standard "
    "deviation = 0.057, minimum = 11.95, maximum = 12.15, median = 12.06.\nThe 95% confidence "
    "interval for the mean is 12.021 to 12.085. Tolerance 12.00 +/- 0.20: all 15 pass.",
    "Invoice 2024-0387\nDate: 2024-05-14\nItem  Qty  Unit price  Amount\nA-1041  12  3.75  "
    "45.00\nA-2210  4  18.20  72.80\nB-0033  150  0.12  18.00\nC-7719  2  249.99  499.98\n"
    "D-1005  30  1.45  43.50\nSubtotal  679.28\nVAT 20%  135.86\nTotal  815.14\n"
    "Paid 2024-06-02, reference 88123-4471-0095.",
]

# every text of every kind is measured (none left out for its figures); chat texts are
# rendered with the model's own chat template
TEXTS = {"prose": PROSE, "code": CODE, "chat": CHAT, "numbers": NUMBERS}


def kl_and_top1(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(softmax(ref) || softmax(got)) in nats (float64), and argmax equality."""
    lp, lq = log_softmax_rows(ref), log_softmax_rows(got)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return kl, ref.argmax(-1) == got.argmax(-1)


def encode(model, kind: str, text) -> np.ndarray:
    """Token ids of one benchmark text (a chat text: the template over its messages)."""
    if kind == "chat":
        return np.asarray(model.tokenizer.apply_chat_template(text, add_generation_prompt=False,
                                                              tokenize=True), np.int32)
    return model.encode_prompt(text)


def measure(model, texts: dict, depths, modes) -> list[dict]:
    """One row per (mode, depth, text kind) and one per (mode, depth) over every kind
    ("all"): mean KL over the positions, the spread of the per-text means, p99, top-1."""
    ids = [(kind, encode(model, kind, t)) for kind, ts in texts.items() for t in ts]
    rows = []
    for depth in depths:
        refs = [model.logits(x, depth=depth, kv_mode="fp16") for _, x in ids]
        for mode in modes:
            t0 = time.perf_counter()
            got = [kl_and_top1(ref, model.logits(x, depth=depth, kv_mode=mode))
                   for (_, x), ref in zip(ids, refs)]
            for kind in list(texts) + ["all"]:
                mine = [g for (k, _), g in zip(ids, got) if kind in ("all", k)]
                per_text = [float(kl.mean()) for kl, _ in mine]
                allkl = np.concatenate([kl for kl, _ in mine])
                alltop = np.concatenate([t1 for _, t1 in mine])
                rows.append({"mode": mode, "depth": depth, "kind": kind,
                             "texts": len(mine), "positions": int(allkl.size),
                             "mean_kl": float(allkl.mean()), "kl_text_min": min(per_text),
                             "kl_text_max": max(per_text),
                             "p99_kl": float(np.quantile(allkl, .99)),
                             "top1": float(alltop.mean()), "target": TARGETS.get(mode),
                             "seconds": time.perf_counter() - t0})
                r = rows[-1]
                ok = "" if r["target"] is None else ("  ok" if r["mean_kl"] <= r["target"]
                                                     else "  MISSES target")
                print(f"depth {depth}  {mode:<7} {kind:<8} mean KL {r['mean_kl']:.3e} (texts "
                      f"{r['kl_text_min']:.1e}..{r['kl_text_max']:.1e}, p99 "
                      f"{r['p99_kl']:.1e})  top-1 {100 * r['top1']:.1f}%{ok}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arg(ap, default=DEFAULT)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--depths", default="1,4")
    ap.add_argument("--modes", default="int8,h_fp16,h_int8,h_int4")
    ap.add_argument("--texts", type=int, default=None,
                    help="the first N texts of each kind (default: all)")
    ap.add_argument("--out", default=None, help="a .json file or a directory for it")
    a = ap.parse_args(argv)
    path = model_path(a.model)
    model = tinyloop.load_model(path, max_seq_len=1024, backend=a.backend)
    try:
        texts = {k: v[:a.texts] for k, v in TEXTS.items()}
        rows = measure(model, texts, [int(d) for d in a.depths.split(",")],
                       a.modes.split(","))
    finally:
        tinyloop.free_model(model)
    write_json(a.out, "kv_quality.json", {"model": path, "backend": a.backend, "rows": rows})
    return 0
