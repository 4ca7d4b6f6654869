#!/usr/bin/env python
"""Cut Multi30k into the low-resource case of docs/benchmarks.md ("Quality", low resource):
the first --pairs German-English training pairs as parallel data, the English sides of the
rest as monolingual text (their German never used).

    python scripts/make_lowres.py [--multi30k data/multi30k] [--out data/lowres] [--pairs 10000]

Writes train.de.gz, train.en.gz (the pairs) and mono.en.gz (the rest's English) to --out;
configs/lowres_de_en*.yaml read them. Get Multi30k first: python scripts/get_multi30k.py.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".gz.part")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    tmp.replace(path)
    print(f"{path}: {len(lines):,} lines")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--multi30k", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    ap.add_argument("--out", type=Path, default=Path("data/lowres"), help="target folder")
    ap.add_argument("--pairs", type=int, default=10_000, help="parallel pairs kept")
    args = ap.parse_args()
    try:
        de = read_lines(args.multi30k / "train.de.gz")
        en = read_lines(args.multi30k / "train.en.gz")
    except OSError as e:
        print(f"make_lowres: {e} (run scripts/get_multi30k.py first)", file=sys.stderr)
        return 2
    if len(de) != len(en) or not 0 < args.pairs < len(en):
        print(f"make_lowres: need 0 < --pairs < {len(en):,} aligned lines", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write_lines(args.out / "train.de.gz", de[: args.pairs])
    write_lines(args.out / "train.en.gz", en[: args.pairs])
    write_lines(args.out / "mono.en.gz", en[args.pairs :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
