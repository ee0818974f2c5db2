"""Write the offline lm-evaluation-harness tasks shipped in calibration/tasks/ (their data files).

    python scripts/make_local_tasks.py

Both read paragraphs of WikiText-2 test from its second half only: the perplexity protocol
(40 windows of 2048 tokens) reads the first third, so no task item repeats a scored window.
An item is a paragraph's text up to the last word of one of its sentences (at most 120 words
of context) and that word:

- ``wikitext_cloze.jsonl``: multiple choice between the word and three other items' words;
- ``wikitext_lastword.jsonl``: the word generated greedily (exact match, case-insensitive).

Deterministic (seed 0): running it again writes the same files.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "calibration"
CLOZE_ITEMS, LASTWORD_ITEMS = 500, 300
CONTEXT_WORDS = 120
WORD = re.compile(r"^[A-Za-z]{4,}$")  # a plain word: no numbers, no wikitext escapes (@-@)


def items(text: str) -> list[dict]:
    """One item per eligible paragraph: its longest context ending before a sentence's last word."""
    found = []
    for line in text.split("\n"):
        line = line.strip()
        if line.startswith("=") or len(line.split()) < 40:
            continue
        words = line.split()
        ends = [i for i in range(20, len(words) - 1) if words[i + 1] == "." and WORD.match(words[i])]
        if not ends:
            continue
        end = ends[-1]
        context = words[max(0, end - CONTEXT_WORDS) : end]
        found.append({"context": " ".join(context), "word": words[end]})
    return found


def main() -> None:
    text = (ROOT / "wikitext-2" / "wiki.test.raw").read_text(encoding="utf-8")
    pool = items(text[len(text) // 2 :])
    rng = random.Random(0)
    rng.shuffle(pool)
    if len(pool) < CLOZE_ITEMS + LASTWORD_ITEMS:
        raise SystemExit(f"only {len(pool)} paragraphs qualify")
    cloze, lastword = pool[:CLOZE_ITEMS], pool[CLOZE_ITEMS : CLOZE_ITEMS + LASTWORD_ITEMS]
    words = sorted({item["word"] for item in pool})
    out = ROOT / "tasks"
    out.mkdir(exist_ok=True)
    with open(out / "wikitext_cloze.jsonl", "w", encoding="utf-8") as f:
        for item in cloze:
            others = rng.sample([w for w in words if w.lower() != item["word"].lower()], 3)
            label = rng.randrange(4)
            choices = others[:label] + [item["word"]] + others[label:]
            f.write(json.dumps({"context": item["context"], "choices": choices, "label": label}) + "\n")
    with open(out / "wikitext_lastword.jsonl", "w", encoding="utf-8") as f:
        for item in lastword:
            f.write(json.dumps(item) + "\n")
    print(f"wrote {len(cloze)} + {len(lastword)} items in {out} (of {len(pool)} paragraphs)")


if __name__ == "__main__":
    main()
