"""`scripts/bench.py export`: attnmt's own decoding beside the same model exported to
CTranslate2 (`attnmt export`), run in fp32 and in int8, on Multi30k test_2016_flickr.

Both sides decode the same way as `bench.py decode` times attnmt: 1,000 sentences, batches of
64, at most --max-len output pieces, --threads threads in all (--workers W: W batches at once,
which is CTranslate2's inter_threads=W, intra_threads=threads/W), model loading excluded,
median of --runs after one warm-up. CTranslate2's time includes SentencePiece encoding and
decoding, as attnmt's does. Its length penalty divides by length^alpha (alpha 1 here), ours
by ((5 + length) / 6)^alpha, so beam-search outputs may differ slightly; greedy ones match.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from itertools import product
from pathlib import Path

import sentencepiece as spm

from attnmt.data.text import read_lines
from attnmt.data.tokenizer import Tokenizer
from attnmt.decoding.scores import score
from attnmt.interop.ctranslate2 import export_ctranslate2
from attnmt.models.directory import read_run_files


def bench_export(args: argparse.Namespace) -> None:
    """CTranslate2's rows: per compute type, workers and beam (bench.py prints attnmt's first)."""
    import ctranslate2

    src = read_lines(args.data / "test_2016_flickr.de.gz")[: args.sentences]
    ref = read_lines(args.data / "test_2016_flickr.en.gz")[: args.sentences]
    threads = args.threads or len(os.sched_getaffinity(0))  # CTranslate2 has no --threads 0
    for model_dir in args.model:
        cfg, _ = read_run_files(model_dir)
        joint = cfg.tokenizer.joint
        names = [Tokenizer.JOINT_FILE] * 2 if joint else [Tokenizer.SRC_FILE, Tokenizer.TGT_FILE]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ct2"
            export_ctranslate2(model_dir, out)
            sps = [spm.SentencePieceProcessor(model_file=str(out / n)) for n in names]
            for compute_type, workers in product(args.compute_types, args.workers):
                translator = ctranslate2.Translator(
                    str(out), device="cpu", compute_type=compute_type,
                    inter_threads=workers, intra_threads=max(1, threads // workers),
                )  # fmt: skip
                for beam in args.beams:
                    row = time_ct2(translator, sps, src, ref, beam, args)
                    row.update(
                        toolkit=f"ctranslate2 {ctranslate2.__version__}", model=str(model_dir),
                        compute_type=compute_type, inter_threads=workers,
                        intra_threads=max(1, threads // workers),
                    )  # fmt: skip
                    print(json.dumps(row), flush=True)


def time_ct2(
    translator, sps: list, src: list[str], ref: list[str], beam: int, args: argparse.Namespace
) -> dict:
    """Median time of translating src (pieces in, text out) after one warm-up, and its scores."""
    src_sp, tgt_sp = sps

    def run() -> list[str]:
        pieces = src_sp.encode(src, out_type=str)
        found = translator.translate_batch(
            pieces, max_batch_size=64, batch_type="examples", beam_size=beam,
            max_decoding_length=args.max_len,
        )  # fmt: skip
        return [tgt_sp.decode(r.hypotheses[0]) for r in found]

    run()
    times, hyps = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        hyps = run()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    s = score(hyps, ref)
    return {
        "bench": "export", "beam": beam, "sentences": len(src), "runs": args.runs,
        "seconds_all": [round(x, 3) for x in times],
        "sentences_per_s": round(len(src) / seconds, 1),
        "bleu": round(s.bleu, 2), "chrf": round(s.chrf, 2), "bleu_signature": s.bleu_signature,
    }  # fmt: skip
