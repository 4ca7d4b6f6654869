"""Subword regularization (Kudo 2018, https://arxiv.org/abs/1804.10959): each epoch, a training
sentence is segmented anew, so that the model sees a word in many spellings and learns what
they share.

Kudo's l-best sampling (sec. 3.1): from the l best segmentations x_1..x_l of the sentence
under the unigram language model, draw one with probability

    P(x_i | X) = P(x_i)^α / Σ_j P(x_j)^α,    log P(x) = Σ_pieces log p(piece)

(α → 0: uniform over the l; large α: the best one). SentencePiece's own sampling draws from
one generator per thread that cannot be seeded again, so the draw is ours: a generator seeded
by (seed, epoch, line, side), which makes a resumed run draw exactly what an uninterrupted one
draws, whatever the batching or the threads that make the batches.

The encoded store keeps the best segmentation; a sentence's text is its decoded pieces (the
segmentation is lossless), so nothing more is kept. A sentence holding <unk> keeps its
segmentation (its text no longer says which character was unknown), leading reserved pieces
(a language tag) stay in front, and a drawn segmentation longer than data.max_len pieces is
not taken (the batches were cut for the stored lengths; drawn ones are a little longer).
"""

from __future__ import annotations

import numpy as np

from attnmt.config import Config, SubwordSampling
from attnmt.data.tokenizer import UNK_ID, SubwordVocab, Tokenizer
from attnmt.errors import ConfigError


class Resegmenter:
    """Draws a segmentation of each training sentence per epoch (the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, cfg: SubwordSampling, seed: int, max_len: int) -> None:
        self.cfg, self.seed, self.max_len = cfg, seed, max_len
        sides = {"both": (0, 1), "src": (0,), "tgt": (1,)}[cfg.side]
        self.vocabs = {side: (tokenizer.src, tokenizer.tgt)[side] for side in sides}
        for vocab in self.vocabs.values():
            _check_unigram(vocab)
        self.log_p = {  # (V,) log p(piece) of each side's pieces
            side: np.array([v.sp.get_score(i) for i in range(len(v))], dtype=np.float64)
            for side, v in self.vocabs.items()
        }

    @classmethod
    def of(cls, cfg: Config, tokenizer: Tokenizer) -> Resegmenter | None:
        """A run's (tokenizer.sampling), or None when it does not sample."""
        sampling = cfg.tokenizer.sampling
        return (
            None if sampling is None else cls(tokenizer, sampling, cfg.train.seed, cfg.data.max_len)
        )

    def pairs(
        self, src: list[list[int]], tgt: list[list[int]], lines: list[int], epoch: int
    ) -> tuple[list[list[int]], list[list[int]]]:
        """The pairs (lines: their indices in the corpus) as epoch `epoch` segments them."""
        sides = [src, tgt]
        for side in self.vocabs:
            sides[side] = [
                self.draw(ids, side, (self.seed, epoch, line, side))
                for ids, line in zip(sides[side], lines, strict=True)
            ]
        return sides[0], sides[1]

    def draw(self, ids: list[int], side: int, key: tuple[int, ...]) -> list[int]:
        """One sentence's ids (side 0 source, 1 target) segmented anew, drawn by `key`."""
        vocab = self.vocabs[side]
        lead = 0
        while lead < len(ids) and ids[lead] in vocab.reserved:
            lead += 1
        if UNK_ID in ids or len(ids) - lead < 2:
            return ids
        text = vocab.sp.decode(ids[lead:])
        found = vocab.sp.nbest_encode_as_ids(text, self.cfg.nbest)
        if len(found) < 2:
            return ids
        scores = self.cfg.alpha * np.array([self.log_p[side][x].sum() for x in found])
        p = np.exp(scores - scores.max())
        choice = np.random.default_rng(key).choice(len(found), p=p / p.sum())
        drawn = ids[:lead] + vocab.spelled(found[choice])  # text is never a reserved piece
        return drawn if len(drawn) <= self.max_len else ids  # data.max_len holds


def _check_unigram(vocab: SubwordVocab) -> None:
    """SentencePiece gives n-best segmentations of unigram models only."""
    try:
        vocab.sp.nbest_encode_as_ids("ab", 2)
    except RuntimeError:
        raise ConfigError(
            "tokenizer.sampling: the SentencePiece model is not a unigram model (BPE has no "
            "n-best segmentations to draw from); train one with tokenizer.model_type: unigram"
        ) from None
