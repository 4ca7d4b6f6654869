"""`scripts/bench.py step`: what one greedy decoding step costs, attnmt against CTranslate2 on
the same model, by the number of rows it decodes (a fixed cost plus the same cost a row).

N sources of 14-17 SentencePiece pieces from Multi30k test_2016_flickr (repeated where fewer),
every row made to decode exactly L steps: CTranslate2 with `min_decoding_length` =
`max_decoding_length` = L, attnmt's greedy search with an output limit of L and a forced
target prefix of L pieces (a row cannot end before it). A step's cost is (t(30) - t(10)) / 20:
the encoder and the first steps cancel out. The two toolkits alternate run by run in one
process (A B A B), --runs times each; the median is printed as one JSON line per rows,
precision and toolkit: {"rows", "precision", "toolkit", "ms_per_step", ...}. With --compile,
attnmt with its compiled step (models.compiled_step) is a third side ("attnmt-compiled").
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from attnmt import Translator
from attnmt.data.batches import pad_sequences
from attnmt.data.text import read_lines
from attnmt.data.tokenizer import EOS_ID, PAD_ID
from attnmt.decoding.batch import decode
from attnmt.decoding.search import Greedy, SearchOptions
from attnmt.interop.ctranslate2 import export_ctranslate2
from attnmt.kernels import matmul_backend

SHORT, LONG = 10, 30  # output lengths timed: their difference is LONG - SHORT steps
CT2_TYPES = {"fp32": "float32", "int8": "int8"}


def bench_step(args: argparse.Namespace) -> None:
    import ctranslate2

    torch.set_num_threads(args.threads)
    lines = read_lines(args.data / "test_2016_flickr.de.gz")
    with tempfile.TemporaryDirectory() as tmp:
        export_ctranslate2(args.model, Path(tmp) / "ct2")
        for precision in args.precision:
            ours = Translator.load(
                args.model, "cpu", precision=precision, threads=args.threads, compile=False
            )
            theirs = ctranslate2.Translator(
                str(Path(tmp) / "ct2"), device="cpu", compute_type=CT2_TYPES[precision],
                intra_threads=args.threads, inter_threads=1,
            )  # fmt: skip
            compiled = None  # --compile: the compiled step too, a third side
            if args.compile:
                compiled = Translator.load(
                    args.model, "cpu", precision=precision, threads=args.threads, compile=True
                )
            ids = [s for s in ours.tokenizer.src.encode(lines) if 14 <= len(s) <= 17]
            for rows in args.rows:
                chosen = [ids[i % len(ids)] for i in range(rows)]
                pieces = [ours.tokenizer.src.sp.id_to_piece(s) for s in chosen]
                sides = {
                    "attnmt": functools.partial(_attnmt, ours, chosen),
                    "ctranslate2": functools.partial(_ct2, theirs, pieces),
                }
                if compiled is not None:
                    sides["attnmt-compiled"] = functools.partial(_attnmt, compiled, chosen)
                for toolkit, ms in _alternated(sides, args.runs).items():
                    print(json.dumps({
                        "bench": "step", "rows": rows, "precision": precision,
                        "toolkit": toolkit, "ms_per_step": round(statistics.median(ms), 3),
                        "ms_all": [round(x, 3) for x in ms], "threads": args.threads,
                        "model": str(args.model),
                    }), flush=True)  # fmt: skip


def _alternated(sides: dict, runs: int) -> dict[str, list[float]]:
    """Each side's ms a step over `runs` rounds, the sides alternating within each round (one
    untimed round first)."""
    found: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(runs + 1):
        for name, run in sides.items():
            short, long = run(SHORT), run(LONG)
            if round_:
                found[name].append((long - short) / (LONG - SHORT) * 1000)
    return found


def _attnmt(translator: Translator, chosen: list[list[int]], length: int) -> float:
    """Seconds to decode the rows for exactly `length` steps (greedy, a forced prefix)."""
    src = pad_sequences([[*s, EOS_ID] for s in chosen], PAD_ID)  # (N, S)
    forced = [[10] * length for _ in chosen]  # any piece but the special ones
    options = SearchOptions(Greedy(), max_len_a=0.0, max_len_b=length, scores=False)
    with torch.inference_mode(), matmul_backend(translator.matmul):
        start = time.perf_counter()
        decode(translator.model, src, src == PAD_ID, options, forced)
        return time.perf_counter() - start


def _ct2(translator, pieces: list[list[str]], length: int) -> float:
    start = time.perf_counter()
    translator.translate_batch(
        pieces, beam_size=1, min_decoding_length=length, max_decoding_length=length,
        max_batch_size=len(pieces), batch_type="examples",
    )  # fmt: skip
    return time.perf_counter() - start
