"""Word alignments from attention: which source words each output word came from.

Words are the whitespace tokens of the input and the output, read off the pieces (a piece
starting with SentencePiece's ▁ starts a word). A target word's attention over the source
words is the mean over its pieces of each piece's attention summed over the word's pieces;
the source EOS (and a multilingual model's language tag) takes part in no word. Each target
word is aligned to the source word it attends to most: Moses-style `i-j` pairs, source word i,
target word j, both from 0 (as fast_align, Marian's --alignment and CTranslate2 write them).
"""

from __future__ import annotations

import re

import torch

from attnmt.decoding.translation import Translation

WORD_START = "▁"
# A Transformer's default layer: the second from the top (a 1-layer decoder: its only one),
# which aligned best of the T model's layers (docs/benchmarks.md, scripts/alignment_layers.py).
DEFAULT_LAYER = -2


SPECIAL = re.compile(r"</s>|<s>|<pad>|<2[^>\s]+>")  # no word: EOS, BOS, padding, tags
UNKNOWN = "<unk>"  # a word of its own (SentencePiece writes it " ⁇ ")


def word_of_pieces(pieces: list[str]) -> list[int]:
    """Each piece's word index, -1 for a special piece (`</s>`, a `<2xx>` language tag)."""
    out, word, alone = [], -1, False
    for p in pieces:
        if SPECIAL.fullmatch(p):
            out.append(-1)
            continue
        if p.startswith(WORD_START) or word < 0 or alone or p == UNKNOWN:
            word += 1
        alone = p == UNKNOWN
        out.append(word)
    # A bare ▁ with nothing after it in its word writes no word: the words that remain count.
    kept = sorted({w for w, p in zip(out, pieces, strict=True) if w >= 0 and p.strip(WORD_START)})
    renumber = {w: i for i, w in enumerate(kept)}
    return [renumber.get(w, -1) for w in out]


def word_weights(
    src_pieces: list[str], tgt_pieces: list[str], attention: torch.Tensor
) -> torch.Tensor:
    """(target words, source words): each target word's attention over the source words (see
    the module's docstring); empty when either side has no word."""
    src_word, tgt_word = word_of_pieces(src_pieces), word_of_pieces(tgt_pieces)
    S, T = max(src_word, default=-1) + 1, max(tgt_word, default=-1) + 1
    if S <= 0 or T <= 0:
        return torch.zeros(max(T, 0), max(S, 0))
    a = attention[: len(tgt_pieces), : len(src_pieces)].float()  # (t, s)
    to_words = torch.zeros(len(src_pieces), S)  # (s, S): piece -> its word
    for i, w in enumerate(src_word):
        if w >= 0:
            to_words[i, w] = 1.0
    rows = torch.zeros(T, len(tgt_pieces))  # (T, t): the mean over a word's pieces
    for i, w in enumerate(tgt_word):
        if w >= 0:
            rows[w, i] = 1.0
    return (rows / rows.sum(1, keepdim=True).clamp(min=1)) @ (a @ to_words)  # (T, S)


def word_alignment(
    src_pieces: list[str], tgt_pieces: list[str], attention: torch.Tensor
) -> list[tuple[int, int]]:
    """(source word, target word) pairs from a hypothesis's attention (len(tgt_pieces),
    len(src_pieces)), one per target word, in target order."""
    weights = word_weights(src_pieces, tgt_pieces, attention)  # (T, S)
    if weights.numel() == 0:
        return []
    return [(int(s), j) for j, s in enumerate(weights.argmax(1).tolist())]


def moses(found: Translation) -> str:
    """A translation's word alignment as `i-j` pairs separated by spaces."""
    return " ".join(f"{i}-{j}" for i, j in align(found))


def align(found: Translation) -> list[tuple[int, int]]:
    """A translation's word alignment; it must have been searched with an attention spec."""
    if found.attention is None:
        return []  # an empty line, or a search that kept no attention
    return word_alignment(found.src_pieces, found.tgt_pieces, found.attention)
