#!/usr/bin/env python
"""Put Tatoeba English-French (the d2l.ai attention chapter's corpus) where
configs/tatoeba_en_fr_*.yaml expect it, split by unique English sentence.

    python scripts/get_tatoeba.py [--out data/tatoeba] [--from FILE] [--dev 1000] [--test 2000]

Without --from, downloads fra-eng.zip from manythings.org (Anki's Tatoeba export: English TAB
French TAB attribution). With --from FILE, reads a local .tsv or .tsv.gz of English TAB French
(for example ../shared/data/tatoeba/fra-eng.tsv.gz). The unique English sentences are shuffled
with a fixed seed; --dev and --test of them go, with every French translation each has, to
dev.tsv and test.tsv, the rest to train.tsv: no test sentence is ever seen in training.
"""

from __future__ import annotations

import argparse
import gzip
import io
import random
import sys
import urllib.request
import zipfile
from pathlib import Path

URL = "https://www.manythings.org/anki/fra-eng.zip"


def read_pairs(src: Path | None) -> list[tuple[str, str]]:
    """(English, French) pairs from the local file or the download."""
    if src is None:
        with urllib.request.urlopen(URL, timeout=120) as r:
            text = zipfile.ZipFile(io.BytesIO(r.read())).read("fra.txt").decode("utf-8")
    else:
        opener = gzip.open if src.suffix == ".gz" else open
        with opener(src, "rt", encoding="utf-8") as f:
            text = f.read()
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 2:
            sys.exit(f"get_tatoeba: {src or URL}:{number}: expected English TAB French")
        pairs.append((fields[0].strip(), fields[1].strip()))
    return pairs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/tatoeba"), help="target folder")
    ap.add_argument("--from", dest="src", type=Path, help="read this .tsv[.gz], no download")
    ap.add_argument("--dev", type=int, default=1000, help="unique English sentences in dev")
    ap.add_argument("--test", type=int, default=2000, help="unique English sentences in test")
    ap.add_argument("--seed", type=int, default=1, help="shuffle seed")
    args = ap.parse_args()
    pairs = read_pairs(args.src)
    english = sorted({en for en, _ in pairs})
    random.Random(args.seed).shuffle(english)
    dev, test = set(english[: args.dev]), set(english[args.dev : args.dev + args.test])
    args.out.mkdir(parents=True, exist_ok=True)
    splits = {"train": [], "dev": [], "test": []}
    for en, fr in pairs:
        splits["dev" if en in dev else "test" if en in test else "train"].append(f"{en}\t{fr}\n")
    for name, lines in splits.items():
        (args.out / f"{name}.tsv").write_text("".join(lines), encoding="utf-8")
        print(f"{args.out / name}.tsv: {len(lines):,} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
