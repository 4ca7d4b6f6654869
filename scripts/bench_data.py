"""`scripts/bench.py data`: training on a large synthetic corpus, from the text to the first
steps, and a resume.

Builds a corpus of --pairs pairs from Tatoeba's English-French pairs (each synthetic pair is
one to three random Tatoeba pairs joined, seeded), then runs `attnmt train` on it in a child
process (a small Transformer, --steps steps, 8,000-piece joint vocabulary) and samples the
proportional memory (PSS) of the child and its worker processes every 0.1 s. Prints one JSON line:
pairs, text MB, seconds to the `data` event (SentencePiece + encoding), encode pairs/s (from
the store), peak PSS (MB, the process tree's sum) before the data event and during training,
the start-up seconds of a `--resume` (until its `model` event; no re-encoding), and the peak
PSS of --steps more steps after a second resume (the training path alone, without the build).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

# Tatoeba's English<TAB>French pairs beside the checkout, where the synthetic corpora come from.
TATOEBA = Path("../shared/data/tatoeba/fra-eng.tsv.gz")


def make_corpus(tsv: Path, pairs: int, out: Path, seed: int = 0) -> dict[str, Path]:
    """train.{en,fr} of `pairs` synthetic pairs and dev.{en,fr} of 500, from Tatoeba."""
    with gzip.open(tsv, "rt", encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t")[:2] for line in f]
    rows = [r for r in rows if len(r) == 2 and r[0] and r[1]]
    files = {f"{split}_{lang}": out / f"{split}.{lang}" for split in ("train", "dev")
             for lang in ("en", "fr")}  # fmt: skip
    if all(f.is_file() for f in files.values()):  # built before: the same seed, the same pairs
        return files
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", pairs), ("dev", 500)):
        with open(files[f"{split}_en"], "w") as en, open(files[f"{split}_fr"], "w") as fr:
            for _ in range(n):
                picked = [rows[rng.randrange(len(rows))] for _ in range(rng.randint(1, 3))]
                en.write(" ".join(p[0] for p in picked) + "\n")
                fr.write(" ".join(p[1] for p in picked) + "\n")
    return files


def tree_pss_mb(pid: int) -> float:
    """Proportional set size of pid and its descendants, MB: forked workers share the parent's
    pages, which a sum of RSS would count once per process."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        grew, tree = bool(more), tree | more
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def events(log: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def watch(cmd: list[str], log: Path, until: str, skip: int = 0) -> dict[str, float]:
    """Run cmd; peak tree RSS before and after the first `until` event (past the first `skip`
    events of the log), and the seconds to it."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = {"before": 0.0, "after": 0.0}
    reached = None
    while proc.poll() is None:
        phase = "after" if reached is not None else "before"
        peak[phase] = max(peak[phase], tree_pss_mb(proc.pid))
        if reached is None and any(e.get("event") == until for e in events(log)[skip:]):
            reached = time.time() - start
        time.sleep(0.1)
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{err}")
    return {"to_event_s": reached or time.time() - start, **peak}


def bench_data(args: argparse.Namespace) -> None:
    work = args.work / f"p{args.pairs}"
    files = make_corpus(args.tatoeba, args.pairs, work / "text")
    cfg = {
        "data": {
            "train": {"src": str(files["train_en"]), "tgt": str(files["train_fr"])},
            "dev": {"src": str(files["dev_en"]), "tgt": str(files["dev_fr"])},
        },
        "tokenizer": {"vocab_size": 8000},
        "model": {"arch": "transformer", "emb_size": 256, "hidden_size": 256, "heads": 4,
                  "ff_size": 1024, "enc_layers": 3, "dec_layers": 3},
        "train": {"max_steps": args.steps, "eval_every": 100000, "batch_tokens": 4096,
                  "eval_batch_tokens": 4096, "log_every": 1},
    }  # fmt: skip
    cfg_file = work / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    out = work / "model"
    cmd = [sys.executable, "-m", "attnmt", "train", "-c", str(cfg_file), "--out", str(out), "-q"]
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: no old log events
    first = watch(cmd, out / "train_log.jsonl", "data")
    data = next(e for e in events(out / "train_log.jsonl") if e["event"] == "data")
    meta = json.loads((out / "encoded" / "meta.json").read_text())
    before = len(events(out / "train_log.jsonl"))
    resume = watch(
        [*cmd, "--resume", "--set", f"train.max_steps={args.steps + 1}"],
        out / "train_log.jsonl",
        "model",
        skip=before,
    )
    # The steps again from a resume: the same code path without the build in the process.
    more = watch(
        [*cmd, "--resume", "--set", f"train.max_steps={2 * args.steps + 1}"],
        out / "train_log.jsonl",
        "model",
        skip=len(events(out / "train_log.jsonl")),
    )
    text_mb = sum(f.stat().st_size for k, f in files.items() if k.startswith("train")) / 2**20
    print(json.dumps({
        "bench": "data", "pairs": args.pairs, "text_mb": round(text_mb, 1),
        "train_pairs": data["train_pairs"], "to_data_event_s": round(first["to_event_s"], 1),
        "encode_pairs_per_s": round(meta["read"] / meta["encode_seconds"]),
        "encode_workers": meta["workers"],
        "peak_pss_mb_before_training": round(first["before"]),
        "peak_pss_mb_training": round(first["after"]),
        "steps": args.steps,
        "resume_startup_s": round(resume["to_event_s"], 1),
        "resume_peak_pss_mb": round(max(resume["before"], resume["after"])),
        "resumed_steps_peak_pss_mb": round(more["after"]),
    }))  # fmt: skip
