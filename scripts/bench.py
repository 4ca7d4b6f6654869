#!/usr/bin/env python
"""Benchmarks (figures for the README and issues; never timed in unit tests).

    python scripts/bench.py decode --model DIR [--model DIR ...] [--data DIR] [--runs N]
                                   [--beams 1,5] [--batch-sentences 64] [--max-len 60]
                                   [--threads 2]

decode: translates Multi30k test_2016_flickr (1,000 sentences, from --data, default
data/multi30k) with each model and beam size, the way ../shared/peers measures JoeyNMT and
OpenNMT-py: batches of 64 sentences, at most 60 output pieces, GNMT length penalty 1.0, 2
threads, model loading excluded. Prints one JSON line per (model, beam) with the median over
--runs runs of sentences/s and output pieces/s (EOS excluded), the mean output length, and
BLEU/chrF with sacreBLEU signatures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnmt.checkpoint import load_model_dir
from attnmt.data import read_lines
from attnmt.evaluate import SearchOptions, score, translate


def bench_decode(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    src = read_lines(args.data / "test_2016_flickr.de.gz")
    ref = read_lines(args.data / "test_2016_flickr.en.gz")
    for model_dir in args.model:
        cfg, tokenizer, model = load_model_dir(model_dir)
        for beam in args.beams:
            options = SearchOptions(
                beam=beam, length_penalty=1.0, max_len_a=0.0, max_len_b=args.max_len
            )
            times, result = [], None
            for _ in range(args.runs):
                start = time.perf_counter()
                with torch.inference_mode():
                    result = translate(
                        model, tokenizer, src, options, 1 << 30, args.batch_sentences
                    )
                times.append(time.perf_counter() - start)
            assert result is not None
            hyps = [r[0].text for r in result]
            pieces = sum(
                len(r[0].tgt_pieces) - int(r[0].tgt_pieces[-1:] == ["</s>"]) for r in result
            )
            seconds = statistics.median(times)
            s = score(hyps, ref)
            print(
                json.dumps(
                    {
                        "bench": "decode",
                        "model": str(model_dir),
                        "arch": cfg.model.arch,
                        "beam": beam,
                        "sentences": len(src),
                        "runs": args.runs,
                        "seconds_median": round(seconds, 3),
                        "seconds_all": [round(x, 3) for x in times],
                        "sentences_per_s": round(len(src) / seconds, 1),
                        "pieces_per_s": round(pieces / seconds, 1),
                        "mean_output_pieces": round(pieces / len(src), 2),
                        "bleu": round(s.bleu, 2),
                        "chrf": round(s.chrf, 2),
                        "bleu_signature": s.bleu_signature,
                        "threads": args.threads,
                        "batch_sentences": args.batch_sentences,
                        "max_len": args.max_len,
                    }
                ),
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode", help="translation speed and BLEU on test_2016_flickr")
    d.add_argument("--model", type=Path, action="append", required=True, help="model directory")
    d.add_argument("--data", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    d.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median)")
    d.add_argument(
        "--beams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5], help="e.g. 1,5"
    )
    d.add_argument("--batch-sentences", type=int, default=64)
    d.add_argument("--max-len", type=int, default=60, help="output pieces at most")
    d.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.what == "decode":
        bench_decode(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
