"""An ensemble of models decoded as one: at every step the mean of their log-probabilities.

Each model keeps its own memory and incremental state (an ensemble may mix architectures);
search (greedy, beam, sampling) sees one model with the seq2seq interface, so every method
decodes ensembles unchanged. The models share the vocabularies (attnmt.decoding.translator checks
that their SentencePiece files are the same).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnmt.models.seq2seq import AttentionSpec, Seq2Seq


class Ensemble(Seq2Seq):
    """Models whose next-token distributions are combined: log p(y) = mean_m log p_m(y)."""

    def __init__(self, models: list[Seq2Seq]) -> None:
        super().__init__()
        assert models, "an ensemble of no models"
        self.models = nn.ModuleList(models)

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> list[Any]:
        return [m.encode(src, src_pad_mask) for m in self.models]

    def init_state(self, memory: list[Any]) -> list[Any]:
        return [m.init_state(mem) for m, mem in zip(self.models, memory, strict=True)]

    def decode_step(
        self,
        memory: list[Any],
        state: list[Any],
        prev_tokens: torch.Tensor,
        attention: AttentionSpec | None = None,
    ) -> tuple[torch.Tensor, list[Any], torch.Tensor | None]:
        """The mean of the models' log-softmaxed logits (N, V), as the logits of one model;
        with `attention`, the mean of their attention weights (N, S)."""
        log_probs, states, weights = [], [], []
        for m, mem, st in zip(self.models, memory, state, strict=True):
            logits, st, attn = m.decode_step(mem, st, prev_tokens, attention)  # (N, V)
            log_probs.append(torch.log_softmax(logits.float(), dim=-1))
            states.append(st)
            weights.append(attn)
        mean = torch.stack(log_probs).mean(dim=0)  # (N, V)
        attn = None if attention is None else torch.stack(weights).float().mean(dim=0)  # (N, S)
        return mean, states, attn

    def select_memory(self, memory: list[Any], index: torch.Tensor) -> list[Any]:
        return [m.select_memory(mem, index) for m, mem in zip(self.models, memory, strict=True)]

    def select_state(self, state: list[Any], index: torch.Tensor) -> list[Any]:
        return [m.select_state(st, index) for m, st in zip(self.models, state, strict=True)]

    def keep_memory(self, memory: list[Any], order: torch.Tensor) -> list[Any]:
        return [m.keep_memory(mem, order) for m, mem in zip(self.models, memory, strict=True)]

    def keep_rows(
        self, memory: list[Any], state: list[Any], order: torch.Tensor
    ) -> tuple[list[Any], list[Any]]:
        kept = [
            m.keep_rows(a, b, order) for m, a, b in zip(self.models, memory, state, strict=True)
        ]
        return [mem for mem, _ in kept], [st for _, st in kept]

    def join_memory(self, first: list[Any], second: list[Any]) -> list[Any]:
        return [m.join_memory(a, b) for m, a, b in zip(self.models, first, second, strict=True)]

    def join_state(self, first: list[Any], second: list[Any]) -> list[Any]:
        return [m.join_state(a, b) for m, a, b in zip(self.models, first, second, strict=True)]
