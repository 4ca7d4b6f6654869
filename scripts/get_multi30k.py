#!/usr/bin/env python
"""Put Multi30k (task 1, raw) where configs/multi30k_*.yaml expect it.

    python scripts/get_multi30k.py [--out data/multi30k] [--from DIR]

Without --from, downloads the gzipped raw files from the dataset's GitHub repository
(github.com/multi30k/dataset, data/task1/raw). With --from DIR, copies them from a local folder
holding the same file names (for example ../shared/data/multi30k). Files already present with
the same size are left alone.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import urllib.request
from pathlib import Path

URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{name}"
SPLITS = ("train", "val", "test_2016_flickr")
LANGS = ("de", "en", "fr")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/multi30k"), help="target folder")
    ap.add_argument("--from", dest="src", type=Path, help="copy from this folder, no download")
    ap.add_argument("--langs", default="de,en,fr", help="comma-separated languages")
    args = ap.parse_args()
    langs = [lang for lang in args.langs.split(",") if lang]
    bad = [lang for lang in langs if lang not in LANGS]
    if bad:
        print(f"get_multi30k: unknown language(s) {bad}; choose from {LANGS}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for lang in langs:
            name = f"{split}.{lang}.gz"
            dest = args.out / name
            tmp = dest.with_suffix(".gz.part")
            if args.src is not None:
                source = args.src / name
                if not source.is_file():
                    print(f"get_multi30k: {source} not found", file=sys.stderr)
                    return 2
                if dest.is_file() and dest.stat().st_size == source.stat().st_size:
                    continue
                shutil.copyfile(source, tmp)
            else:
                if dest.is_file():
                    continue
                try:
                    with urllib.request.urlopen(URL.format(name=name), timeout=60) as r:
                        tmp.write_bytes(r.read())
                except OSError as e:
                    print(f"get_multi30k: download of {name} failed: {e}", file=sys.stderr)
                    return 2
            tmp.replace(dest)
            print(f"{dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
