#!/usr/bin/env python
"""Demo data for configs/finetune_few_pairs.yaml: Multi30k's validation pairs (source TAB
target, English-French by default) as a translator's post-edits in a new domain (image
captions, for a model trained on Tatoeba's short sentences): the first 200 to fine-tune on,
the next 100 to validate on, the remaining 714 to test on. Run scripts/get_multi30k.py first.

    python scripts/make_postedits.py [--src en --tgt fr] [--multi30k DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--multi30k", type=Path, default=Path("data/multi30k"))
    ap.add_argument("--out", type=Path, default=Path("data/postedits"))
    ap.add_argument("--src", default="en", help="source language: de, en or fr")
    ap.add_argument("--tgt", default="fr", help="target language")
    args = ap.parse_args()
    sides = []
    for lang in (args.src, args.tgt):
        with gzip.open(args.multi30k / f"val.{lang}.gz", "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])
    pairs = [f"{s}\t{t}" for s, t in zip(*sides, strict=True)]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[:200]), ("dev", pairs[200:300]), ("test", pairs[300:])):
        (args.out / f"{name}.tsv").write_text("\n".join(part) + "\n", encoding="utf-8")
        print(f"{args.out / name}.tsv: {len(part)} pairs")


if __name__ == "__main__":
    main()
