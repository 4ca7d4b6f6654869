"""A training run's scores: the dev loss, BLEU and chrF of each dev set and their means (what
validation and early stopping read), and the test sets, scored as `attnmt eval` scores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnmt.config import Config, SplitConfig
from attnmt.data.batches import BucketSampler, collate
from attnmt.data.text import read_test_set
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from attnmt.decoding.scores import Scores, score, score_translations
from attnmt.decoding.search import search_options
from attnmt.decoding.translate import translate_lines
from attnmt.models.seq2seq import Seq2Seq
from attnmt.training.prepare import DevSet, EncodedSplit, set_names, source_prefix


@torch.no_grad()
def dev_loss(model: Seq2Seq, split: EncodedSplit, batch_tokens: int, device: torch.device) -> float:
    """Mean per-token cross-entropy (no label smoothing) over the dev set."""
    model.eval()
    sampler = BucketSampler(
        [len(s) + 1 for s in split.src], [len(t) + 1 for t in split.tgt], batch_tokens, seed=0
    )
    total, tokens = 0.0, 0
    for idx in sampler.epoch(0):
        batch = collate(
            [split.src[i] for i in idx], [split.tgt[i] for i in idx], idx, PAD_ID, BOS_ID, EOS_ID
        ).to(device)
        loss, n = model.loss(batch)
        total += float(loss)
        tokens += int(n)
    model.train()
    return total / max(tokens, 1)


@dataclass
class DevScores:
    """A validation's figures: the means over the dev sets (what early stopping reads), and
    with several sets each one's."""

    loss: float
    bleu: float
    chrf: float
    directions: dict[str, dict[str, float]]  # set name -> dev_loss, dev_bleu, dev_chrf
    hyps: list[str]  # the first set's translations (the logged examples)


def score_dev_sets(
    model: Seq2Seq, tokenizer: Tokenizer, dev_sets: list[DevSet], cfg: Config, device: torch.device
) -> DevScores:
    """Dev loss, BLEU and chrF (train.eval_beam) of each dev set, and their means."""
    t, rows, first = cfg.train, {}, None
    options = search_options(cfg.decode, beam=t.eval_beam)
    for d in dev_sets:
        loss = dev_loss(model, d.encoded, t.eval_batch_tokens, device)
        hyps = translate_lines(
            model, tokenizer, d.text.src, options, batch_tokens=t.eval_batch_tokens,
            device=device, source_prefix=d.prefix,
        )  # fmt: skip
        s = score(hyps, d.text.tgt)
        rows[d.name] = {"dev_loss": loss, "dev_bleu": s.bleu, "dev_chrf": s.chrf}
        first = hyps if first is None else first
    mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in next(iter(rows.values()))}
    directions = rows if len(rows) > 1 else {}
    assert first is not None
    return DevScores(mean["dev_loss"], mean["dev_bleu"], mean["dev_chrf"], directions, first)


@dataclass
class TestResult:
    """One test set's scores."""

    name: str  # its direction (de-en)
    split: SplitConfig
    pairs: int
    empty_sources: int
    scores: Scores


def score_test_sets(
    model: Seq2Seq, tokenizer: Tokenizer, cfg: Config, device: torch.device
) -> list[TestResult]:
    """Translate each data.test set (decode section, beam decode.beam) and score it: every
    line counts (decoding.scores.score_translations, as `attnmt eval`)."""
    sets, results = cfg.data.test_sets, []
    for split, name in zip(sets, set_names(sets), strict=True):
        sources, references = read_test_set(split)
        prefix = source_prefix(cfg.data, tokenizer, split.tgt_lang)
        scores, _ = score_translations(
            lambda lines, prefix=prefix: translate_lines(
                model, tokenizer, lines, search_options(cfg.decode),
                batch_tokens=cfg.train.eval_batch_tokens, device=device, source_prefix=prefix,
            ),
            sources,
            references,
        )  # fmt: skip
        empty = sum(not line.strip() for line in sources)
        results.append(TestResult(name, split, len(sources), empty, scores))
    return results
