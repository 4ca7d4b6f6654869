#!/usr/bin/env python
"""Benchmarks (figures for the README and issues; never timed in unit tests).

    python scripts/bench.py train [--data DIR] [--steps 200] [--warmup 50] [--configs T,R,base]
                                  [--device cpu|cuda] [--threads 2] [--procs 1]
                                  [--dev-sentences 500] [--synthetic N] [--tatoeba TSV]
                                  [--vocab 8000] [--tokenizer SPM] [--batch-tokens N]
                                  [--set KEY=VALUE ...]
    python scripts/bench.py data [--pairs 1000000] [--steps 20] [--tatoeba TSV] [--work DIR]
    python scripts/bench.py serve --model DIR [--clients 1,8,32] [--sizes 1,16] [--eole CKPT]
                                  [--beam 5] [--threads 2] [--batch-wait-ms 5] [--workers 1]
                                  [--precision int8] [--tm TM]
    python scripts/bench.py decode --model DIR [--model DIR ...] [--data DIR] [--runs N]
                                   [--beams 1,5] [--batch-sentences 64] [--max-len 60]
                                   [--threads 2] [--workers 1[,2]] [--precision fp32]
                                   [--matmul auto] [--shortlist off[,on]]
    python scripts/bench.py export (decode's options) [--compute-types float32,int8]
    python scripts/bench.py tm [--sizes 10000,100000,1000000] [--tatoeba TSV]
    python scripts/bench.py step --model DIR [--rows 1,8,64,256] [--precision fp32,int8]
                                 [--runs 5] [--threads 1]

decode: translates Multi30k test_2016_flickr (1,000 sentences, from --data, default
data/multi30k) with each model and beam size, the way ../shared/peers measures JoeyNMT and
OpenNMT-py: batches of 64 sentences, at most 60 output pieces, GNMT length penalty 1.0 (or
--length-norm length: length^1, CTranslate2's default, for `export`), 2 threads, model
loading excluded. Prints one JSON line per (model, beam, workers) with the median over --runs
runs (after one untimed run) of sentences/s and output pieces/s (EOS excluded), the mean output
length, and BLEU/chrF with sacreBLEU signatures. --workers 2 searches two batches at once, each
in its own forked process on one of the 2 threads (`attnmt translate --workers`); --precision
bf16, fp16 or int8 decodes in that format (`attnmt translate --precision`), and the row gives
the share of lines whose translation differs from the fp32 model's (differs_from_fp32). Each
row also gives the size of the weights file (weights_mb) and the process's peak resident memory
so far (max_rss_mb: run one model per process to read it per model).
--matmul auto|blas|onednn picks the CPU fp32 matmul library (`attnmt translate --matmul`).
--shortlist on decodes with the model directory's lexical shortlist (`attnmt shortlist`); the
row gives the share of lines it changes (differs_from_off).

export: decode's rows, then the same model exported to CTranslate2 (scripts/bench_export.py).

tm: see scripts/bench_tm.py (fuzzy matches from a translation memory of 10 k, 100 k and
1 M segments: ms a query, median and 95th percentile).

step: see scripts/bench_step.py (a greedy step's ms at N rows, attnmt against CTranslate2
alternating in one process: one JSON line per rows, precision and toolkit).

serve: see scripts/bench_serve.py (`attnmt serve`, or `eole serve` with --eole CHECKPOINT,
under 1, 8, 32 (--clients) concurrent loopback clients sending 1 or 16 sentences a request:
sentences/s, p50/p99 latency, idle latency, against the batch path).

data: see scripts/bench_data.py (a synthetic corpus of --pairs pairs from Tatoeba: time and
memory from the text to the first steps, and a resume's start-up).

train: see scripts/bench_train.py (training speed of T, R or the base Transformer on Multi30k
or a synthetic Tatoeba corpus, on the CPU or a GPU: tokens/s, model FLOPs and their share
of the peak, the MFU).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from bench_data import TATOEBA
from bench_train import add_train_args, bench_train

from attnmt.data.processes import keep_freed_memory
from attnmt.data.text import read_lines
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.scores import score
from attnmt.decoding.search import Beam, Greedy, SearchOptions
from attnmt.decoding.shortlist import attach, load_shortlist
from attnmt.decoding.translate import search_lines
from attnmt.device import DECODE_PRECISIONS, MATMUL_BACKENDS, ThreadFit
from attnmt.kernels import matmul
from attnmt.models import compiled_step
from attnmt.models.directory import load_model_dir


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def precisions(text: str) -> list[str]:
    names = text.split(",")
    for name in names:
        if name not in DECODE_PRECISIONS:
            raise argparse.ArgumentTypeError(f"{name}: one of {', '.join(DECODE_PRECISIONS)}")
    return names


def bench_decode(args: argparse.Namespace) -> None:
    if args.device == "cpu":  # as a Translator decoding on the CPU does (translate, serve)
        keep_freed_memory()
    with matmul.matmul_backend(args.matmul) as backend:
        decode_models(args, backend)


def decode_models(args: argparse.Namespace, backend: str) -> None:
    # --threads 0: attnmt's own choice, the CPUs other processes leave free (chosen per run).
    fit = ThreadFit(args.threads or None, torch.get_num_threads())
    fit.apply()
    src = read_lines(args.data / "test_2016_flickr.de.gz")[: args.sentences]
    ref = read_lines(args.data / "test_2016_flickr.en.gz")[: args.sentences]
    for model_dir in args.model:
        for precision in args.precision:
            cfg, tokenizer, model = load_model_dir(model_dir)
            plain = copy.deepcopy(model).to(args.device) if precision != "fp32" else None
            model = for_decoding(model.to(args.device), precision)
            if args.compile:  # the compiled step (fp32 on the CPU; else a line says why not)
                compiled_step.attach(model, precision, args.device)
            short = None
            if "on" in args.shortlist:  # off: the wrapped projection without rows is the plain one
                short = load_shortlist(model_dir, tokenizer)
                attach(model, len(tokenizer.tgt))
            for batch_sentences, beam, workers, shortlist in itertools.product(
                args.batch_sentences, args.beams, args.workers, args.shortlist
            ):
                # As `attnmt translate` does: no scores unless it writes n-best lists.
                method = Greedy() if beam == 1 else Beam(beam, 1.0, length_norm=args.length_norm)
                options = SearchOptions(method, max_len_a=0.0, max_len_b=args.max_len, scores=False)
                batches = {"batch_tokens": 1 << 30, "batch_sentences": batch_sentences}
                batches |= {"device": args.device}
                fp32, unlisted = None, None
                if plain is not None:
                    fp32 = search_lines(plain, tokenizer, src, options, **batches)
                if shortlist == "on":
                    unlisted = search_lines(model, tokenizer, src, options, **batches)
                    batches["shortlist"] = short
                # One untimed pass of what is timed, as `export` gives CTranslate2: the workers
                # forked, int8's graph made and profiled, CUDA's lazy start-up.
                search_lines(model, tokenizer, src, options, workers=workers, **batches)
                times, result, chosen = [], None, []
                for _ in range(args.runs):
                    chosen.append(fit.apply())
                    start = time.perf_counter()
                    result = search_lines(
                        model, tokenizer, src, options, workers=workers, **batches
                    )
                    times.append(time.perf_counter() - start)
                assert result is not None
                hyps = [r[0].text for r in result]
                pieces = sum(
                    len(r[0].tgt_pieces) - int(r[0].tgt_pieces[-1:] == ["</s>"]) for r in result
                )
                seconds = statistics.median(times)
                s = score(hyps, ref)
                row = {
                    "bench": "decode",
                    "model": str(model_dir),
                    "arch": cfg.model.arch,
                    "device": args.device,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                    "beam": beam,
                    "length_norm": args.length_norm,
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
                    "threads": args.threads or f"auto: {chosen}",
                    "workers": workers,
                    "precision": precision,
                    "matmul": backend,
                    "batch_sentences": batch_sentences,
                    "max_len": args.max_len,
                    # Lines whose translation differs from the fp32 model's (same search).
                    "differs_from_fp32": None if fp32 is None else round(
                        sum(a[0].text != b for a, b in zip(fp32, hyps, strict=True)) / len(src), 4
                    ),
                    "shortlist": shortlist,
                    "compiled": args.compile,
                    # Lines the shortlist changes (against the same model and search without).
                    "differs_from_off": None if unlisted is None else round(
                        sum(a[0].text != b for a, b in zip(unlisted, hyps, strict=True))
                        / len(src), 4,
                    ),
                    "weights_mb": round(_weights_bytes(model_dir) / 2**20, 1),
                    "max_rss_mb": round(
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
                    ),
                }  # fmt: skip
                print(json.dumps(row), flush=True)


def _weights_bytes(model_dir: Path) -> int:
    """The size on disk of the weights a model directory decodes with (best, else last)."""
    best = model_dir / "best.safetensors"
    return (best if best.is_file() else model_dir / "last.safetensors").stat().st_size


def add_decode_args(d: argparse.ArgumentParser) -> None:
    """The options of `decode` (and of `export`, which runs decode first)."""
    d.add_argument("--model", type=Path, action="append", required=True, help="model directory")
    d.add_argument("--data", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    d.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median)")
    d.add_argument(
        "--beams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5], help="e.g. 1,5"
    )
    d.add_argument(
        "--batch-sentences", type=ints, default=[64], help="sentences a batch, e.g. 1,64,1024"
    )
    d.add_argument("--sentences", type=int, help="only the first N test sentences")
    d.add_argument("--device", default="cpu", help="cpu or cuda")
    d.add_argument("--max-len", type=int, default=60, help="output pieces at most")
    d.add_argument("--compile", action="store_true", help="attnmt's compiled step (fp32, CPU)")
    d.add_argument(
        "--length-norm", choices=["gnmt", "length"], default="gnmt",
        help="beam search's length normalisation (length: CTranslate2's, for export)",
    )  # fmt: skip
    d.add_argument(
        "--threads", type=int, default=2,
        help="threads in all; 0: attnmt's choice (as many as other processes leave free)",
    )  # fmt: skip
    d.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1],
        help="batches searched at once, sharing the threads; e.g. 1,2 measures both",
    )
    d.add_argument(
        "--precision", type=precisions, default=["fp32"], help="e.g. fp32,bf16 (each a row)"
    )
    d.add_argument(
        "--matmul", choices=list(MATMUL_BACKENDS), default="auto", help="CPU fp32 matmul library"
    )
    d.add_argument(
        "--shortlist",
        type=lambda s: s.split(","),
        default=["off"],
        help="off, on (the model's attnmt shortlist) or off,on",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode", help="translation speed and BLEU on test_2016_flickr")
    add_decode_args(d)
    e = sub.add_parser("export", help="attnmt beside its CTranslate2 export (fp32, int8)")
    add_decode_args(e)
    e.add_argument(
        "--compute-types", type=lambda s: s.split(","), default=["float32", "int8"],
        help="CTranslate2 compute types, e.g. float32,int8",
    )  # fmt: skip
    t = sub.add_parser("train", help="training speed (CPU or CUDA), MFU")
    add_train_args(t)
    g = sub.add_parser("data", help="a large synthetic corpus: encoding, memory, resume")
    g.add_argument("--pairs", type=int, default=1_000_000, help="synthetic training pairs")
    g.add_argument("--steps", type=int, default=20, help="training steps")
    g.add_argument(
        "--tatoeba", type=Path, default=TATOEBA,
        help="English<TAB>French pairs to build the corpus from",
    )  # fmt: skip
    g.add_argument("--work", type=Path, default=Path("runs/bench-data"), help="where to build")
    v = sub.add_parser("serve", help="attnmt serve under concurrent clients")
    v.add_argument("--model", type=Path, required=True, help="model directory")
    v.add_argument("--data", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    v.add_argument("--clients", type=ints, default=[1, 8, 32], help="e.g. 1,8,32")
    v.add_argument("--sizes", type=ints, default=[1, 16], help="sentences per request")
    v.add_argument("--beam", type=int, default=5)
    v.add_argument("--threads", type=int, default=2, help="threads of the server (and CLI)")
    v.add_argument("--batch-wait-ms", type=float, default=5.0, help="attnmt serve --batch-wait-ms")
    v.add_argument("--workers", type=int, default=1, help="attnmt serve --workers (processes)")
    v.add_argument("--precision", default="", help="attnmt serve --precision (default: config)")
    v.add_argument("--tm", type=Path, help="also measure the server with this TM (serve --tm)")
    v.add_argument("--compile", action="store_true", help="also the server with --compile")
    v.add_argument("--eole", type=Path, help="measure `eole serve` with this checkpoint instead")
    v.add_argument("--eole-python", type=Path, help="the eole venv's python")
    v.add_argument("--eole-spm", type=Path, help="the SentencePiece model of its data")
    v.add_argument("--eole-batch-rate", type=float, default=0.0,
                   help="its batch path's sentences/s (the peers harness's decode)")  # fmt: skip
    m = sub.add_parser("tm", help="fuzzy retrieval from a TM of 10 k / 100 k / 1 M segments")
    m.add_argument("--tatoeba", type=Path, default=TATOEBA, help="English<TAB>French pairs")
    m.add_argument("--sizes", type=ints, default=[10_000, 100_000, 1_000_000])
    m.add_argument("--work", type=Path, default=Path("runs/bench-tm"), help="where the TMs go")
    m.add_argument("--keep", action="store_true", help="reuse the TMs built by an earlier run")
    p = sub.add_parser("step", help="a greedy step's ms by rows, attnmt against CTranslate2")
    p.add_argument("--model", type=Path, required=True, help="model directory")
    p.add_argument("--data", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    p.add_argument("--rows", type=ints, default=[1, 8, 64, 256], help="e.g. 1,8,64,256")
    p.add_argument("--precision", type=lambda s: s.split(","), default=["fp32", "int8"])
    p.add_argument("--runs", type=int, default=5, help="alternated rounds (median)")
    p.add_argument("--threads", type=int, default=1, help="threads of each toolkit")
    p.add_argument("--compile", action="store_true", help="attnmt compiled too")
    o = sub.add_parser("onnx", help="ONNX and the web page beside attnmt (fp32, int8)")
    o.add_argument("--model", type=Path, required=True, help="model directory")
    o.add_argument("--data", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    o.add_argument("--sentences", type=int, default=1000)
    o.add_argument("--runs", type=int, default=3)
    o.add_argument("--threads", type=int, default=1, help="attnmt's and onnxruntime's threads")
    o.add_argument("--precision", type=lambda s: s.split(","), default=["fp32", "int8"])
    o.add_argument("--browser", action="store_true", help="also the page in headless Chromium")
    o.add_argument("--page-threads", type=ints, default=[1, 2], help="the page's threads")
    for parser in (d, e, t):
        parser.add_argument(
            "--busy", type=int, default=0,
            help="run N one-core busy loops beside the measurement (a busy machine)",
        )  # fmt: skip
    args = ap.parse_args()
    with busy_loops(getattr(args, "busy", 0)):
        return run(ap, args)


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """N processes that each keep a core busy (`while True: pass`) while the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if loops else 0.0)  # running before the measurement starts
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.what == "serve":
        from bench_serve import bench_serve

        bench_serve(args)
    elif args.what == "tm":
        from bench_tm import bench_tm

        bench_tm(args)
    elif args.what == "step":
        from bench_step import bench_step

        bench_step(args)
    elif args.what == "onnx":
        from bench_onnx import bench_onnx

        bench_onnx(args)
    elif args.what == "data":
        from bench_data import bench_data

        bench_data(args)
    elif args.what == "decode":
        bench_decode(args)
    elif args.what == "export":
        from bench_export import bench_export

        bench_decode(args)  # attnmt's rows, then CTranslate2's
        bench_export(args)
    elif args.what == "train":
        if not 0 <= args.warmup < args.steps:
            ap.error("--warmup must be below --steps")
        if not 1 <= args.procs <= max(args.threads, 1):
            ap.error("--procs must be between 1 and --threads")
        bench_train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
