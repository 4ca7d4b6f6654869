"""Cleaning one's own corpus and splitting it into train, dev and test (`attnmt split`).

A corpus found on the web is rarely ready: the same pair many times, empty or copied sides,
sentences whose translation is three times as long (misaligned), and no dev or test set, or
one cut from the end of a file sorted by length. `split` reads one or more corpora (TSV files
or source/target file pairs, validated as training reads them), drops what each rule catches
(counted per rule), shuffles the unique source sentences with a seed, and writes dev and test
sets of unique sources that the training set then never contains.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from attnmt.data.files import atomic_write
from attnmt.data.text import PairCounts, read_pairs, read_tsv
from attnmt.errors import DataError

SPLITS = ("train", "dev", "test")


@dataclass
class SplitCounts:
    read: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # rule -> pairs it dropped
    written: dict[str, int] = field(default_factory=dict)  # split -> pairs written

    def drop(self, rule: str) -> None:
        self.dropped[rule] = self.dropped.get(rule, 0) + 1


@dataclass(frozen=True)
class Rules:
    max_words: int = 200  # either side longer (whitespace words): dropped
    max_ratio: float = 3.0  # longer side / shorter side, in words, above this: dropped
    ratio_min_words: int = 5  # the ratio rule applies where the longer side has this many


def read_corpora(
    tsvs: Iterable[Path],
    pairs: Iterable[tuple[Path, Path]],
    counts: SplitCounts,
    fields: tuple[int, int] = (1, 2),
):
    """Every (source, target) pair of the corpora, stripped, empty sides dropped (counted);
    `fields`: the TSV columns of the source and the target, from 1."""
    empty = PairCounts()
    for path in tsvs:
        yield from read_tsv(path, *fields, empty)
    for src, tgt in pairs:
        yield from read_pairs(src, tgt, empty)
    counts.read += empty.read
    if empty.empty:
        counts.dropped["empty side"] = empty.empty


def clean(
    pairs: Iterable[tuple[str, str]], rules: Rules, counts: SplitCounts
) -> list[tuple[str, str]]:
    """The pairs that no rule drops, in order: identical sides, too long, a length ratio of a
    misalignment, an exact duplicate of an earlier pair."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for src, tgt in pairs:
        ls, lt = len(src.split()), len(tgt.split())
        if src == tgt:
            counts.drop("source = target")
        elif max(ls, lt) > rules.max_words:
            counts.drop(f"over {rules.max_words} words")
        elif max(ls, lt) >= rules.ratio_min_words and max(ls, lt) > rules.max_ratio * min(ls, lt):
            counts.drop(f"length ratio over {rules.max_ratio:g}")
        elif (src, tgt) in seen:
            counts.drop("duplicate pair")
        else:
            seen.add((src, tgt))
            kept.append((src, tgt))
    return kept


def split(
    pairs: list[tuple[str, str]], dev: int, test: int, seed: int, counts: SplitCounts
) -> dict[str, list[tuple[str, str]]]:
    """Dev and test sets of `dev` and `test` unique source sentences (one pair each), drawn
    with `seed`; train holds the other pairs, none with a dev or test source (counted)."""
    by_source: dict[str, list[tuple[str, str]]] = {}
    for pair in pairs:
        by_source.setdefault(pair[0], []).append(pair)
    sources = sorted(by_source)  # an order that does not depend on the input's
    if dev + test >= len(sources):
        raise DataError(
            f"--dev {dev} and --test {test} need more unique source sentences than the "
            f"{len(sources):,} left after cleaning"
        )
    random.Random(seed).shuffle(sources)
    held = {"dev": sources[:dev], "test": sources[dev : dev + test]}
    out = {name: [by_source[s][0] for s in chosen] for name, chosen in held.items()}
    out["train"] = [p for s in sources[dev + test :] for p in by_source[s]]
    dropped = sum(len(by_source[s]) - 1 for s in sources[: dev + test])
    if dropped:
        counts.dropped["another translation of a dev/test source"] = dropped
    return out


def check_outputs(out: Path, inputs: Iterable[Path], force: bool) -> None:
    """Refuse, before anything is read, an --out whose files would replace an input, or that
    exist already (unless `force`), or an --out that is a file."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    given = [p.resolve() for p in inputs]
    for name in SPLITS:
        for suffix in ("src", "tgt"):
            path = out / f"{name}.{suffix}"
            if path.resolve() in given:
                raise DataError(f"--out {out}: {path} is an input; write the splits elsewhere")
            if path.exists() and not force:
                raise DataError(f"--out {out}: {path} exists; --force replaces it")


def write_splits(out: Path, found: dict[str, list[tuple[str, str]]], counts: SplitCounts) -> None:
    """out/{train,dev,test}.{src,tgt}, each written whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    for name in SPLITS:
        for side, suffix in ((0, "src"), (1, "tgt")):
            text = "".join(pair[side] + "\n" for pair in found[name]).encode("utf-8")
            atomic_write(out / f"{name}.{suffix}", lambda tmp, text=text: tmp.write_bytes(text))
        counts.written[name] = len(found[name])
