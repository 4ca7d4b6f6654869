"""Tag placement measured on tagged Multi30k test lines (`translate --markup`).

    python scripts/markup_check.py --model runs/t30 [--data data/multi30k] [--lines 200]

Each of the first N test_2016_flickr German lines gets tags around words, in four patterns,
one after another: a word in bold; the last word in bold with its punctuation outside the tag
("... <b>Straße</b>."); two neighbouring words in sibling tags; a link around two words, one
of them in bold inside it. The lines are translated with markup, and the plain lines with
their word alignment (what markup places tags by). Printed, as JSON:

- balanced: the output's tags are the source's, balanced and properly nested;
- punctuation: of the lines where no element's content ends in punctuation in the source,
  those where none does in the output (the "<b>wallet.</b>" case);
- no_empty: no element is empty in the output (none is in the source);
- right_word: of the tagged source words the plain translation aligns to an output word, how
  often the element in the output holds that word (the alignments allow no more).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

from attnmt import Translator
from attnmt.decoding.markup import TAG

PUNCT = re.compile(r"[.,!?:;…]+$")


def tagged(line: str, n: int) -> tuple[str, list[int]]:
    """Line n's tagged version (pattern n % 4) and the word indices put in tags."""
    words = line.split()
    k = min(len(words) - 1, 1 + n % max(1, len(words) - 1))  # a word past the first
    pattern = n % 4
    if pattern == 1 or len(words) < 3:  # the last word, punctuation outside the tag
        last = words[-1]
        bare = PUNCT.sub("", last) or last
        words[-1] = f"<b>{bare}</b>{last[len(bare) :]}"
        return " ".join(words), [len(words) - 1]
    k = min(k, len(words) - 2)
    if pattern == 0:
        words[k] = f"<b>{words[k]}</b>"
        return " ".join(words), [k]
    if pattern == 2:
        words[k], words[k + 1] = f"<b>{words[k]}</b>", f"<i>{words[k + 1]}</i>"
        return " ".join(words), [k, k + 1]
    words[k] = f'<a href="/x">{words[k]}'
    words[k + 1] = f"<b>{words[k + 1]}</b></a>"
    return " ".join(words), [k, k + 1]


def balanced(text: str) -> list[str] | None:
    """The opening tags' names (sorted), or None if the tags are not properly nested."""
    stack, names = [], []
    for m in TAG.finditer(text):
        if m.group(4):
            continue
        if m.group(1):
            if not stack or stack.pop() != m.group(2):
                return None
        else:
            stack.append(m.group(2))
            names.append(m.group(2))
    return sorted(names) if not stack else None  # siblings may come in another order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path("data/multi30k"))
    ap.add_argument("--lines", type=int, default=200)
    args = ap.parse_args()
    with gzip.open(args.data / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f][: args.lines]
    translator = Translator.load(args.model)
    options = translator.options()
    pairs = [tagged(line, n) for n, line in enumerate(lines)]
    out = [r[0].text for r in translator.search([t for t, _ in pairs], options, markup=True)]
    plain = translator.aligned(lines)
    counts = dict.fromkeys(["balanced", "no_empty", "punctuation", "right_word"], 0)
    counts |= {"punctuation_of": 0, "decidable": 0}
    for (src, chosen), text, (plain_text, links) in zip(pairs, out, plain, strict=True):
        counts["balanced"] += balanced(text) == balanced(src)
        inner = _contents(text)
        counts["no_empty"] += all(TAG.sub("", c).strip() for c in inner)
        if not any(PUNCT.search(TAG.sub("", c).strip()) for c in _contents(src)):
            counts["punctuation_of"] += 1  # no element ends in punctuation in the source
            counts["punctuation"] += not any(PUNCT.search(TAG.sub("", c).strip()) for c in inner)
        words = plain_text.split()
        inside = {_bare(w) for c in inner for w in TAG.sub(" ", c).split()}
        for k in chosen:
            want = {_bare(words[j]) for i, j in links if i == k and j < len(words)}
            if want:
                counts["decidable"] += 1
                counts["right_word"] += bool(want & inside)
    n = len(lines)
    print(json.dumps({
        "lines": n, "balanced": counts["balanced"] / n, "no_empty": counts["no_empty"] / n,
        "punctuation": round(counts["punctuation"] / max(1, counts["punctuation_of"]), 3),
        "punctuation_of": counts["punctuation_of"],
        "right_word": round(counts["right_word"] / max(1, counts["decidable"]), 3),
        "right_word_of": counts["decidable"], "example": [pairs[1][0], out[1]],
    }, ensure_ascii=False))  # fmt: skip


def _contents(text: str) -> list[str]:
    """Every element's content, nested ones included (the text between its tags)."""
    found, stack = [], []
    for m in TAG.finditer(text):
        if m.group(4):
            continue
        if m.group(1):
            if stack:
                found.append(text[stack.pop() : m.start()])
        else:
            stack.append(m.end())
    return found


def _bare(word: str) -> str:
    return PUNCT.sub("", word).lower()


if __name__ == "__main__":
    main()
