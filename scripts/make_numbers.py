#!/usr/bin/env python
"""Build the quickstart corpus: numbers written in German words -> the same numbers in English.

    python scripts/make_numbers.py OUT_DIR [--train N] [--dev N] [--test N] [--max N] [--seed S]

Writes OUT_DIR/{train,dev,test}.{de,en}, one number per line, e.g.
    dreihundertzweiundvierzigtausendsiebenhundertneunundachtzig
    three hundred and forty-two thousand, seven hundred and eighty-nine
Every number appears in one split only: dev and test numbers are never seen in training.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from num2words import num2words


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path, help="output directory")
    ap.add_argument("--train", type=int, default=30_000, help="training pairs (default 30000)")
    ap.add_argument("--dev", type=int, default=500, help="dev pairs (default 500)")
    ap.add_argument("--test", type=int, default=1000, help="test pairs (default 1000)")
    ap.add_argument("--max", type=int, default=999_999, help="largest number (default 999999)")
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    args = ap.parse_args()

    total = args.train + args.dev + args.test
    if total > args.max + 1:
        ap.error(f"{total} distinct numbers requested but only {args.max + 1} exist")
    rng = random.Random(args.seed)
    numbers = rng.sample(range(args.max + 1), total)
    splits = {
        "train": numbers[: args.train],
        "dev": numbers[args.train : args.train + args.dev],
        "test": numbers[args.train + args.dev :],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, nums in splits.items():
        for lang in ("de", "en"):
            lines = [num2words(n, lang=lang) for n in nums]
            (args.out / f"{name}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.train}/{args.dev}/{args.test} train/dev/test pairs to {args.out}")


if __name__ == "__main__":
    main()
