"""One entry for every search: `decode(model, src, src_pad_mask, options)` searches one batch,
dispatching on the method's type (Greedy, Beam, Sampling); `new_pool` makes the pool that
sentences join at any step (what `attnmt serve` keeps running).

Every search drops finished sentences from the active set, so a step costs in proportion to
the sentences still being decoded; beam search advances every beam of every sentence as one
(sentences × beam) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnmt.decoding.beam import BeamPool, beam_search
from attnmt.decoding.constraints import Phrases
from attnmt.decoding.greedy import GreedyPool, greedy_search, sample
from attnmt.decoding.search import Beam, Hypothesis, Sampling, SearchOptions, forced_tokens
from attnmt.models.seq2seq import Seq2Seq


def decode(
    model: Seq2Seq,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    options: SearchOptions,
    prefix: Sequence[Sequence[int]] | None = None,
    constraints: Phrases | None = None,
) -> list[list[Hypothesis]]:
    """Decode a batch: for each sentence, options.n_best hypotheses (best first).

    Args:
        src: (B, S) source ids, EOS included; src_pad_mask: (B, S) bool, True at padding.
        prefix: per sentence, target ids every hypothesis starts with (interactive MT: the
            words a translator typed); the search goes on from there.
        constraints: per sentence, target phrases (ids) its output must contain; beam
            search only (beam_search, attnmt.decoding.constraints).
    """
    method = options.method
    forced = forced_tokens(prefix, src.size(0), src.device)
    if isinstance(method, Beam):
        return beam_search(model, src, src_pad_mask, options, forced, constraints)
    assert not constraints or not any(constraints.phrases), "constraints need beam search"
    if isinstance(method, Sampling):
        return sample(model, src, src_pad_mask, options, forced)
    return [[h] for h in greedy_search(model, src, src_pad_mask, options, forced=forced)]


def new_pool(
    model: Seq2Seq, options: SearchOptions, constrained: bool = False
) -> GreedyPool | BeamPool:
    """An empty pool for options' method (greedy or beam search; sampling's draws are seeded
    per batch, so it has none): sentences join with add(src, src_pad_mask, forced[, phrases]),
    step() returns those that are done. `constrained`: a beam pool whose sentences carry
    phrases (Phrases), each add giving its own."""
    if isinstance(options.method, Beam):
        return BeamPool(model, options, constrained)
    assert not isinstance(options.method, Sampling) and not constrained
    return GreedyPool(model, options)
