#!/usr/bin/env python
"""What to expect from an OPUS-MT-sized model on this machine (docs/exporting.md): a random
MarianMTModel of OPUS-MT's shape (6 + 6 layers, d 512, 8 heads, FFN 2048, swish, one shared
SentencePiece model of about 58k pieces trained on Tatoeba), imported with `attnmt import`,
then timed: greedy decoding sentences/s (fp32 and int8, batches of 64, at most 60 pieces: a
random model rarely ends a line, so each takes the cap, an upper bound on the work) and
fine-tuning seconds a step (`attnmt train` with `train.init_from`, 4,096-token batches).

    python scripts/opus_size.py [--work runs/opus_size] [--sentences 256] [--steps 20]

Needs transformers (the test extra) and ../shared/data/tatoeba/fra-eng.tsv.gz (or --tatoeba).
Nothing is downloaded. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import sentencepiece as spm
import yaml

TATOEBA = Path(__file__).resolve().parent.parent.parent / "shared/data/tatoeba/fra-eng.tsv.gz"


def marian_dir(work: Path, pairs: list[tuple[str, str]], vocab_size: int) -> Path:
    import transformers

    text = work / "text.txt"
    text.write_text("".join(f"{s}\n{t}\n" for s, t in pairs))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(work / "sp"), vocab_size=vocab_size,
        hard_vocab_limit=False, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(work / "sp.model"))
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=512, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
        decoder_ffn_dim=2048, activation_function="swish", pad_token_id=vocab["<pad>"],
        eos_token_id=0, decoder_start_token_id=vocab["<pad>"], max_position_embeddings=512,
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )  # fmt: skip
    out = work / "hf"
    transformers.MarianMTModel(config).save_pretrained(out, safe_serialization=True)
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes((work / "sp.model").read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab))
    return out


def decode_rate(model: Path, lines: list[str], precision: str) -> float:
    from attnmt import Translator

    translator = Translator.load(model, "cpu", precision=precision, threads=2)
    options = replace(translator.options(1), max_len_a=0.0, max_len_b=60, scores=False)
    translator.search(lines[:64], options)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        translator.search(lines, options, batch_tokens=1 << 30)
        times.append(time.perf_counter() - start)
    return len(lines) / statistics.median(times)


def finetune_step_s(model: Path, work: Path, pairs: list[tuple[str, str]], steps: int) -> float:
    src, tgt = work / "ft.fr", work / "ft.en"
    src.write_text("".join(s + "\n" for s, _ in pairs))
    tgt.write_text("".join(t + "\n" for _, t in pairs))
    split = {"src": str(src), "tgt": str(tgt)}
    train = {"init_from": str(model), "max_steps": steps, "eval_every": steps + 1,
             "log_every": 1, "batch_tokens": 4096, "threads": 2, "warmup_steps": 10}  # fmt: skip
    config = {"data": {"train": split, "dev": split}, "train": train}
    (work / "ft.yaml").write_text(yaml.safe_dump(config))
    subprocess.run(
        [sys.executable, "-m", "attnmt", "train", "--config", str(work / "ft.yaml"), "--out",
         str(work / "ft"), "--overwrite", "--quiet"], check=True,
    )  # fmt: skip
    events = [json.loads(x) for x in (work / "ft" / "train_log.jsonl").read_text().splitlines()]
    # log_every 1: each train event's window is one step; the first steps warm up.
    return statistics.median(
        e["seconds"] for e in events if e["event"] == "train" and e["step"] > 5
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/opus_size"))
    ap.add_argument("--tatoeba", type=Path, default=TATOEBA)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=58_000)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.tatoeba, "rt", encoding="utf-8") as f:
        pairs = [tuple(line.rstrip("\n").split("\t")[:2]) for line in f]
    pairs = [(fr, en) for en, fr in pairs]  # French -> English, as OPUS-MT's fr-en
    hf = marian_dir(args.work, pairs, args.vocab)
    model = args.work / "attnmt"
    subprocess.run(
        [sys.executable, "-m", "attnmt", "import", str(hf), "--out", str(model), "--force"],
        check=True,
    )
    lines = [s for s, _ in pairs[-args.sentences :]]
    from attnmt import Translator

    t = Translator.load(model, "cpu")
    row = {
        "parameters": sum(p.numel() for p in t.model.parameters()),
        "target_pieces": len(t.tokenizer.tgt),
        "greedy_fp32_sentences_per_s": round(decode_rate(model, lines, "fp32"), 1),
        "greedy_int8_sentences_per_s": round(decode_rate(model, lines, "int8"), 1),
    }
    step_s = finetune_step_s(model, args.work, pairs[:20_000], args.steps)
    row |= {"finetune_s_per_step": round(step_s, 2), "steps_per_30_min": int(1800 / step_s)}
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
