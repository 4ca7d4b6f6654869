"""Translate lists of sentences with a trained model, and score translations with sacreBLEU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu
import torch

from attnmt.data import pad_sequences, sorted_batches
from attnmt.model import Seq2Seq
from attnmt.search import greedy_search
from attnmt.tokenizer import EOS_ID, PAD_ID, Tokenizer


@torch.no_grad()
def translate_lines(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    batch_tokens: int,
    max_len_a: float,
    max_len_b: int,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Translate each line; exactly one output per input, in input order.

    Sentences are batched by length (longest first) and put back in order afterwards; an
    empty or whitespace-only line gives an empty output line without touching the model.
    """
    was_training = model.training
    model.eval()
    outputs = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    ids = tokenizer.src.encode([lines[i].strip() for i in todo])
    src = [[*s, EOS_ID] for s in ids]
    for batch in sorted_batches([len(s) for s in src], batch_tokens):
        tokens = pad_sequences([src[j] for j in batch], PAD_ID).to(device)  # (B, S)
        hyps = greedy_search(model, tokens, tokens == PAD_ID, max_len_a, max_len_b)
        for j, hyp in zip(batch, hyps, strict=True):
            outputs[todo[j]] = tokenizer.tgt.decode(hyp)
    model.train(was_training)
    return outputs


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_detail: str

    def as_dict(self) -> dict[str, object]:
        return {
            "bleu": round(self.bleu, 2),
            "chrf": round(self.chrf, 2),
            "bleu_signature": self.bleu_signature,
            "chrf_signature": self.chrf_signature,
            "bleu_detail": self.bleu_detail,
        }


def score(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
    """Corpus BLEU and chrF (sacreBLEU defaults: 13a tokenization, mixed case)."""
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()), str(b))
