"""Translations scored with sacreBLEU (BLEU, chrF, TER): `attnmt eval`, training's dev and
test figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sacrebleu

from attnmt.errors import DataError


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_detail: str
    ter: float | None = None  # when asked for (score(..., ter=True))
    ter_signature: str = ""

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "bleu": round(self.bleu, 2),
            "chrf": round(self.chrf, 2),
            "bleu_signature": self.bleu_signature,
            "chrf_signature": self.chrf_signature,
            "bleu_detail": self.bleu_detail,
        }
        if self.ter is not None:
            out |= {"ter": round(self.ter, 2), "ter_signature": self.ter_signature}
        return out


def score(
    hypotheses: Sequence[str],
    references: Sequence[str],
    more_references: Sequence[Sequence[str]] = (),
    ter: bool = False,
    lowercase: bool = False,
) -> Scores:
    """Corpus BLEU and chrF (sacreBLEU defaults: 13a tokenization, mixed case; `lowercase`:
    case-insensitive, sacreBLEU's -lc), and TER if asked, against one or more references per
    line (`more_references`: further sets)."""
    if not hypotheses:
        raise DataError("nothing to score: no lines")
    hyps, refs = list(hypotheses), [list(references), *map(list, more_references)]
    bleu = sacrebleu.metrics.BLEU(lowercase=lowercase)
    chrf = sacrebleu.metrics.CHRF(lowercase=lowercase)
    b, c = bleu.corpus_score(hyps, refs), chrf.corpus_score(hyps, refs)
    found = Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()), str(b))
    if ter:
        metric = sacrebleu.metrics.TER(case_sensitive=not lowercase)
        found.ter = metric.corpus_score(hyps, refs).score
        found.ter_signature = str(metric.get_signature())
    return found


def score_translations(
    translate: Callable[[list[str]], list[str]], sources: list[str], references: list[str]
) -> tuple[Scores, list[str]]:
    """Translate a test set's sources and score them against its references: what `attnmt
    eval --model` and the end of training's `test` event both do, so one test set gives one
    score. Every line counts, an empty one too (its translation is empty)."""
    if len(sources) != len(references):
        raise DataError(
            f"line counts differ: {len(sources)} source lines, {len(references)} references"
        )
    hypotheses = translate(sources)
    return score(hypotheses, references), hypotheses
