"""CTranslate2, the inference engine OpenNMT-py exports to, on the quality-matched OpenNMT-py
Transformer (scripts/peer_models.sh T): converts it and times its decoding of Multi30k
test_2016_flickr the way scripts/bench.py decode times attnmt (1,000 sentences, batches of 64,
at most 60 output pieces, 2 threads in all, model loading excluded, median of --runs).

Run it with the peers' OpenNMT-py venv, which has ctranslate2 (our own venv does not):

    $PEERS_RUN/venvs/onmt/bin/python scripts/peer_ct2.py [--beams 1,5] [--runs 3]
        [--inter 2] [--intra 1] [--ref data/multi30k/test_2016_flickr.en.gz]

--inter batches are translated at once, each on --intra threads (CTranslate2's inter_threads
and intra_threads; attnmt translate --workers is the same idea). Prints one JSON line per beam
size. CTranslate2's length penalty divides by length^alpha (alpha 1.0 here), OpenNMT-py's and
attnmt's by ((5 + length) / 6)^alpha, so its beam-search outputs differ slightly.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ctranslate2
import sacrebleu
import sentencepiece as spm
import torch
from ctranslate2.converters import OpenNMTPyConverter


def convert(checkpoint: Path, out: Path) -> None:
    """OpenNMT-py checkpoint -> CTranslate2 model (fp32 weights). The checkpoint names the
    attention kernel it trained with ("scaled-dot-flash"), which the converter does not know;
    the weights are those of plain scaled dot-product attention, so the copy says that."""
    # OpenNMT-py checkpoints hold their options as an argparse.Namespace, which torch.load
    # (weights_only, the default since torch 2.6) refuses unless allowed; the converter loads
    # the file again itself.
    torch.serialization.add_safe_globals([argparse.Namespace])
    ckpt = torch.load(checkpoint, map_location="cpu")
    ckpt["opt"].self_attn_type = "scaled-dot"
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "model.pt"
        torch.save(ckpt, plain)
        OpenNMTPyConverter(str(plain)).convert(str(out), force=True)


def main() -> None:
    run_dir = Path(
        os.environ.get("PEERS_RUN", Path(os.environ.get("TMPDIR", "/tmp")) / "peers-run")
    )
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--checkpoint", type=Path, default=run_dir / "models/onmt_Tq/model_step_1000.pt"
    )
    ap.add_argument("--spm-dir", type=Path, default=run_dir / "data/spm")
    ap.add_argument("--ref", type=Path, default=Path("data/multi30k/test_2016_flickr.en.gz"))
    ap.add_argument("--beams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--inter", type=int, default=2)
    ap.add_argument("--intra", type=int, default=1)
    args = ap.parse_args()

    model_dir = run_dir / "models/ct2_Tq"
    convert(args.checkpoint, model_dir)
    src = [line.split() for line in (args.spm_dir / "test.de").read_text().splitlines()]
    sp = spm.SentencePieceProcessor(model_file=str(args.spm_dir / "spm8k.model"))
    with gzip.open(args.ref, "rt", encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    translator = ctranslate2.Translator(
        str(model_dir), device="cpu", inter_threads=args.inter, intra_threads=args.intra
    )
    for beam in args.beams:

        def run(beam: int = beam) -> list:
            return translator.translate_batch(
                src, max_batch_size=64, batch_type="examples", beam_size=beam,
                max_decoding_length=60, length_penalty=1.0,
            )  # fmt: skip

        run()  # warm-up
        times, out = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
        pieces = [r.hypotheses[0] for r in out]
        metric = sacrebleu.BLEU()
        bleu = metric.corpus_score([sp.decode(p) for p in pieces], [refs])
        seconds = statistics.median(times)
        n_pieces = sum(len(p) for p in pieces)
        print(
            json.dumps(
                {
                    "bench": "decode",
                    "toolkit": f"ctranslate2 {ctranslate2.__version__}",
                    "model": str(args.checkpoint),
                    "beam": beam,
                    "sentences": len(src),
                    "runs": args.runs,
                    "seconds_all": [round(x, 3) for x in times],
                    "sentences_per_s": round(len(src) / seconds, 1),
                    "pieces_per_s": round(n_pieces / seconds, 1),
                    "mean_output_pieces": round(n_pieces / len(src), 2),
                    "bleu": round(bleu.score, 2),
                    "bleu_signature": str(metric.get_signature()),
                    "inter_threads": args.inter,
                    "intra_threads": args.intra,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
