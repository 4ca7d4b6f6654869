#!/usr/bin/env python
"""One multilingual Transformer against six bilingual ones with the same total wall clock.

    python scripts/bench_multilingual.py [--minutes 60] [--data data/multi30k] [--out runs/ml]

Trains configs/multi30k_multilingual.yaml (all six directions between de, en, fr) for
--minutes, then configs/multi30k_de_en_transformer_30m.yaml on each direction alone for
--minutes / 6, one run after the other (nothing else should run meanwhile), and prints one JSON
line per direction: test_2016_flickr BLEU (best weights, beam 5, sacreBLEU signature) of the
multilingual and of the bilingual model, then the means. Budgets include setup; the test
scoring after each budget is not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

LANGS = ("de", "en", "fr")


def split(data: Path, name: str, src: str, tgt: str) -> str:
    return f"{{src: {data}/{name}.{src}.gz, tgt: {data}/{name}.{tgt}.gz}}"


def train(config: str, out: Path, minutes: float, *sets: str) -> list[dict]:
    """Train one run (a fresh directory); its test events."""
    cmd = [sys.executable, "-m", "attnmt", "train", "--config", config, "--out", str(out),
           "--overwrite", "--quiet", "--time-budget", f"{minutes * 60:.0f}s",
           "--set", "train.average_last=0"]  # fmt: skip
    for assignment in sets:
        cmd += ["--set", assignment]
    subprocess.run(cmd, check=True)
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "test"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="wall clock of each side")
    ap.add_argument("--data", type=Path, default=Path("data/multi30k"))
    ap.add_argument("--out", type=Path, default=Path("runs/multilingual-bench"))
    ap.add_argument("--warmup", type=int, default=50, help="warmup steps of the bilingual runs")
    args = ap.parse_args()
    data = args.data.absolute()
    multi = train("configs/multi30k_multilingual.yaml", args.out / "multi", args.minutes)
    multi_bleu = {e["direction"]: e for e in multi}
    rows = []
    for src in LANGS:
        for tgt in (t for t in LANGS if t != src):
            (test,) = train(
                "configs/multi30k_de_en_transformer_30m.yaml", args.out / f"{src}-{tgt}",
                args.minutes / 6, f"data.train={split(data, 'train', src, tgt)}",
                f"data.dev={split(data, 'val', src, tgt)}",
                f"data.test={split(data, 'test_2016_flickr', src, tgt)}",
                f"train.warmup_steps={args.warmup}",
            )  # fmt: skip
            m = multi_bleu[f"{src}-{tgt}"]
            rows.append({
                "direction": f"{src}-{tgt}", "multilingual": m["bleu"], "bilingual": test["bleu"],
                "signature": test["bleu_signature"],
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    mean = {k: round(sum(r[k] for r in rows) / len(rows), 2) for k in ("multilingual", "bilingual")}
    print(json.dumps({"direction": "mean", **mean, "minutes_each_side": args.minutes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
