"""Constrained decoding and tag-preserving translation on a test set (docs/benchmarks.md).

constraints: beam search without and with 1 or 2 constraints per line taken from the reference:
content words of the reference (4+ letters, not a stopword, the longest first) that the
unconstrained output lacks. Prints BLEU (sacreBLEU, with its signature), the share of lines
whose translation holds every constraint as whole words, and sentences per second, each
decoding run once after a warm-up, one after another in this process.

markup: tags inserted around random source words (<b>…</b> around one word, <i>…</i> around
two, a <x id="1"/> placeholder before a word; seeded), translated with markup=True: the share
of outputs whose tags are balanced and complete, and a sample of tagged source and output
words written to --sample for checking by hand.

    python scripts/decoding_bench.py constraints --model runs/t30 \
        --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz
    python scripts/decoding_bench.py markup --model runs/t30 \
        --src data/multi30k/test_2016_flickr.de.gz --lines 200 --sample markup_sample.txt
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import sacrebleu

from attnmt import Translator
from attnmt.data.text import read_lines
from attnmt.decoding.markup import TAG

STOP_WORDS = (
    "a an the and or of in on at to with from by for into onto over under near next while "
    "some two three four five this that these those there their his her its they them he she "
    "it is are was were be been being has have had who which what where when as up down out "
    "off very one other another each"
)
STOP = set(STOP_WORDS.split())


def content_words(line: str) -> list[str]:
    words = [w.strip(".,;:!?\"'()") for w in line.split()]
    found = [w for w in words if len(w) >= 4 and w.lower() not in STOP and w.isalpha()]
    return sorted(dict.fromkeys(found), key=len, reverse=True)


def holds(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def constraints(args: argparse.Namespace) -> None:
    tr = Translator.load(args.model, device="cpu")
    src, ref = read_lines(args.src)[: args.lines], read_lines(args.ref)[: args.lines]
    tr.translate(src[:50], beam=args.beam)  # warm-up
    free, t_free = timed(lambda: tr.translate(src, beam=args.beam))
    bleu = sacrebleu.BLEU()
    score = bleu.corpus_score(free, [ref]).score
    print(f"unconstrained beam {args.beam}: BLEU {score:.2f}, {len(src) / t_free:.1f} sent/s "
          f"({t_free:.1f} s)  [{bleu.get_signature()}]")  # fmt: skip
    for k in (1, 2):
        constrained(tr, src, ref, free, k, args.beam)


def constrained(
    tr: Translator, src: list[str], ref: list[str], free: list[str], k: int, beam: int
) -> None:
    """k constraints on each line whose reference has k content words the output lacks."""
    bleu = sacrebleu.BLEU()
    lacking = [
        [w for w in content_words(r) if not holds(h, w)] for r, h in zip(ref, free, strict=True)
    ]
    given = [i for i, w in enumerate(lacking) if len(w) >= k]
    wanted = [w[:k] if i in set(given) else [] for i, w in enumerate(lacking)]
    found, t = timed(lambda: tr.translate(src, beam=beam, constraints=wanted))
    met = sum(all(holds(found[i], w) for w in wanted[i]) for i in given)
    lines = [src[i] for i in given]
    _, t_before = timed(lambda: tr.translate(lines, beam=beam))
    _, t_after = timed(
        lambda: tr.translate(lines, beam=beam, constraints=[wanted[i] for i in given])
    )
    before = bleu.corpus_score([free[i] for i in given], [[ref[i] for i in given]]).score
    after = bleu.corpus_score([found[i] for i in given], [[ref[i] for i in given]]).score
    print(f"{k} constraint(s) on {len(given)} lines: all met on {met} "
          f"({100 * met / max(len(given), 1):.1f} %); BLEU, all lines: "
          f"{bleu.corpus_score(found, [ref]).score:.2f}, those lines: {before:.2f} -> {after:.2f}; "
          f"all lines {len(src) / t:.1f} sent/s; those lines: {len(given) / t_before:.1f} -> "
          f"{len(given) / t_after:.1f} sent/s (slowdown {t_after / t_before:.2f}x)")  # fmt: skip


def markup(args: argparse.Namespace) -> None:
    tr = Translator.load(args.model, device="cpu")
    rng = random.Random(args.seed)
    lines, tagged = [], []
    for line in read_lines(args.src)[: args.lines]:
        words = line.split()
        b = rng.randrange(len(words))
        i = rng.randrange(len(words) - 1) if len(words) > 2 else None
        x = rng.randrange(len(words))
        out = []
        for j, w in enumerate(words):
            if j == x:
                w = '<x id="1"/>' + w
            if j == b:
                w = f"<b>{w}</b>"
            if i is not None and j == i:
                w = "<i>" + w
            if i is not None and j == i + 1:
                w = w + "</i>"
            out.append(w)
        lines.append(" ".join(out))
        tagged.append(words[b])
    found = [r[0].text for r in tr.search(lines, tr.options(args.beam), markup=True)]
    ok = 0
    for line, out in zip(lines, found, strict=True):
        tags = sorted(TAG.findall(out)) == sorted(TAG.findall(line))
        stack, fine = [], tags
        for m in TAG.finditer(out):
            if m.group(4):
                continue
            if m.group(1):
                fine = fine and bool(stack) and stack.pop() == m.group(2)
            else:
                stack.append(m.group(2))
        ok += fine and not stack
    print(f"markup: {ok} of {len(lines)} outputs with every tag, balanced and nested "
          f"({100 * ok / len(lines):.1f} %)")  # fmt: skip
    with open(args.sample, "w", encoding="utf-8") as f:
        for line, out, word in zip(lines, found, tagged, strict=True):
            inside = re.search(r"<b>(.*?)</b>", out)
            f.write(f"{word}\t{inside.group(1) if inside else ''}\t{line}\t{out}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["constraints", "markup"])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--ref", type=Path)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sample", type=Path, default=Path("markup_sample.txt"))
    args = ap.parse_args()
    constraints(args) if args.what == "constraints" else markup(args)


if __name__ == "__main__":
    main()
