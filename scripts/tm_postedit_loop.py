#!/usr/bin/env python
"""Issue 80's post-edit loop, measured through a real server: `attnmt serve --tm --tm-write`
on a copy of a TM; --edits test sentences are "post-edited" (their references sent with
POST /tm); the other test sentences closest to them (each edit's nearest by fuzzy score) are
translated before and after. Prints one JSON line: BLEU and chrF of those sentences before
and after, with signatures, and how many met one of the new segments.

    python scripts/tm_postedit_loop.py --model runs/tatoeba_tm --tm runs/tatoeba_train.tm \\
        --test data/tatoeba/test.tsv [--edits 200]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from attnmt.data.fuzzy import fuzzy_score
from attnmt.data.text import read_lines
from attnmt.decoding.scores import score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tm", type=Path, required=True, help="copied: the original is kept")
    ap.add_argument("--test", type=Path, required=True, help="source TAB reference")
    ap.add_argument("--edits", type=int, default=200)
    args = ap.parse_args()
    pairs = [tuple(line.split("\t")[:2]) for line in read_lines(args.test) if "\t" in line]
    random.Random(1).shuffle(pairs)
    edits, rest = pairs[: args.edits], pairs[args.edits :]
    closest = sorted({max(range(len(rest)), key=lambda j: fuzzy_score(s, rest[j][0]))
                      for s, _ in edits})  # fmt: skip
    probe = [rest[j] for j in closest]
    with tempfile.TemporaryDirectory() as tmp:
        tm = Path(tmp) / "tm.db"
        shutil.copyfile(args.tm, tm)
        url, proc = serve(args.model, tm)
        try:
            before = translate(url, [s for s, _ in probe])
            new = {post(url, s, t) for s, t in edits}
            after = translate(url, [s for s, _ in probe])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    refs = [t for _, t in probe]
    b, a = score(before[0], refs), score(after[0], refs)
    met = [m for m in after[1] if m is not None and m["segment"] in new]
    exact = sum(m["exact"] for m in met)
    print(json.dumps({
        "edits": len(edits), "probed": len(probe), "met_a_new_segment": len(met),
        "of_them_exact": exact,
        "bleu_before": round(b.bleu, 2), "bleu_after": round(a.bleu, 2),
        "chrf_before": round(b.chrf, 2), "chrf_after": round(a.chrf, 2),
        "bleu_signature": b.bleu_signature, "chrf_signature": b.chrf_signature,
    }))  # fmt: skip


def serve(model: Path, tm: Path) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "serve", "-m", str(model), "--port", str(port),
         "--tm", str(tm), "--tm-write", "--no-access-log"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def translate(url: str, lines: list[str]) -> tuple[list[str], list]:
    texts, matches = [], []
    for at in range(0, len(lines), 32):
        got = httpx.post(f"{url}/translate", json={"text": lines[at : at + 32]}, timeout=300)
        got.raise_for_status()
        texts += got.json()["translations"]
        matches += got.json()["tm"]
    return texts, matches


def post(url: str, source: str, target: str) -> int:
    got = httpx.post(f"{url}/tm", json={"source": source, "target": target}, timeout=60)
    got.raise_for_status()
    return got.json()["segment"]


if __name__ == "__main__":
    main()
