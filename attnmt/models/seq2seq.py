"""The seq2seq interface every architecture implements, and the loss helpers they share.

A model is used through four explicit methods:
    memory = model.encode(src, src_pad_mask)
    state = model.init_state(memory)
    logits, state, attn = model.decode_step(memory, state, prev_tokens)   # one target position
    loss_sum, n_tokens = model.loss(batch, tf_ratio, label_smoothing, generator)
and `select_memory` / `select_state` to keep a subset of rows (or repeat them), which search
uses; `join_memory` / `join_state` put the rows of two batches together, the second's
sentences possibly at an earlier step than the first's (serve's step-level pool: sentences
join a running search). The state may have G times as many rows as the memory (G >= 1): rows
i*G .. i*G+G-1 of the state and of prev_tokens then all attend over memory row i. Beam search
keeps one memory row per sentence for its K beams that way, so the source side is read once
per sentence, not once per beam, and reordering beams touches only the state.

`decode_cohorts` steps several (memory, state) pairs at once, each with rows of its own: a
pool of sentences that joined at different steps keeps each step's newcomers as a cohort of
their own, so that a cohort's caches are as long as its own steps, not its oldest
neighbour's. A model that shares the step's products among cohorts says how many cohorts it
takes (`max_cohorts`); the others take one (join_state puts newcomers with the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.data.batches import Batch
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class AttentionSpec:
    """Which attention weights decode_step should return (rnn: its only attention).

    layer: decoder layer, negative counts from the top; head: one head, or None for the mean;
    all_heads: every head of the layer, (N, h, S) instead of (N, S) (a Transformer only).
    """

    layer: int = -1
    head: int | None = None
    all_heads: bool = False


class Seq2Seq(nn.Module):
    """Base class of the encoder-decoder models; see the module docstring for the contract."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> Any:
        """Encode a (B, S) batch of source ids; returns an arch-specific memory object."""
        raise NotImplementedError

    def encode_packed(self, src: torch.Tensor, src_pad_mask: torch.Tensor, packing: Any) -> Any:
        """encode, with the sentences packed one after another into packing's rows
        (attnmt.models.packing.Packing); None where the architecture does not pack."""
        return None

    def init_state(self, memory: Any) -> Any:
        """The decoder state before the first target token."""
        raise NotImplementedError

    def decode_step(
        self,
        memory: Any,
        state: Any,
        prev_tokens: torch.Tensor,
        attention: AttentionSpec | None = None,
    ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """Advance one position: prev_tokens (N,) -> logits (N, V), new state, and the source
        attention (N, S) chosen by `attention` (None when not asked for). N = G * B for a
        memory of B rows: rows i*G .. i*G+G-1 share memory row i."""
        raise NotImplementedError

    # Cohorts decode_cohorts shares a step among (1: each would be a step of its own).
    max_cohorts = 1

    def decode_cohorts(
        self,
        memories: list[Any],
        states: list[Any],
        prev_tokens: torch.Tensor,
        sizes: list[int],
        attention: AttentionSpec | None = None,
    ) -> tuple[torch.Tensor, list[Any], torch.Tensor | None]:
        """decode_step of several cohorts, each a (memory, state) pair whose rows are
        `sizes[i]` consecutive rows of prev_tokens (N,) -> logits (N, V), each cohort's new
        state, the attention (N, S) (one cohort only). Here one decode_step each."""
        if len(states) == 1:
            logits, state, attn = self.decode_step(memories[0], states[0], prev_tokens, attention)
            return logits, [state], attn
        assert attention is None, "attention weights are returned for one cohort only"
        logits, new = [], []
        for memory, state, prev in zip(memories, states, prev_tokens.split(sizes), strict=True):
            out, state, _ = self.decode_step(memory, state, prev)
            logits.append(out)
            new.append(state)
        return torch.cat(logits), new, None

    def select_memory(self, memory: Any, index: torch.Tensor) -> Any:
        """Keep rows `index` (B',) of the memory (drop finished sentences, expand to beams)."""
        raise NotImplementedError

    def select_state(self, state: Any, index: torch.Tensor) -> Any:
        """Keep rows `index` (B',) of the decoder state (reorder beams, drop finished rows)."""
        raise NotImplementedError

    def keep_memory(self, memory: Any, order: torch.Tensor) -> Any:
        """select_memory for a memory not used again (rows leaving a running search): a
        model may move only the rows that change place (order[i] != i), within its tensors."""
        return self.select_memory(memory, order)

    def keep_rows(self, memory: Any, state: Any, order: torch.Tensor) -> tuple[Any, Any]:
        """keep_memory and select_state at once, for rows leaving a running search: order
        (N',) from rows.kept_order (where order[i] == i the row stays). A model may move
        only the rows that change place in the state too: it is not used again."""
        return self.keep_memory(memory, order), self.select_state(state, order)

    def join_memory(self, first: Any, second: Any) -> Any:
        """The rows of `first`, then those of `second` (sources of other lengths: padded)."""
        raise NotImplementedError

    def join_state(self, first: Any, second: Any) -> Any:
        """The rows of `first`, then those of `second`, whose sentences may have decoded fewer
        positions: each row goes on from its own position."""
        raise NotImplementedError

    def source_side(self) -> list[nn.Module]:
        """The modules whose products run over whole sources at once, once per batch (the
        encoder, the projections of its output), not over a decoding step's few rows: where
        the CPU has them, int8 decoding gives these its kernels for many rows."""
        return []

    def forward(
        self,
        batch: Batch,
        tf_ratio: float = 1.0,
        label_smoothing: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same as `loss`: the call that DistributedDataParallel and torch.compile wrap."""
        return self.loss(batch, tf_ratio, label_smoothing, generator)

    def loss(
        self,
        batch: Batch,
        tf_ratio: float = 1.0,
        label_smoothing: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed token loss of a batch and its number of real target tokens.

        tf_ratio is the probability of feeding the gold previous token (teacher forcing); with
        probability 1 - tf_ratio the model's own argmax prediction is fed instead, per token.
        """
        raise NotImplementedError


def pad_to(
    x: torch.Tensor, dim: int, size: int, value: float | bool, left: bool = False
) -> torch.Tensor:
    """x padded with `value` along `dim` to `size` (at the end, or at the start if `left`)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    filler = x.new_full(shape, value)
    return torch.cat([filler, x] if left else [x, filler], dim=dim)


def sequence_loss(
    logits: torch.Tensor, target: torch.Tensor, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Label-smoothed cross-entropy summed over non-pad positions.

    Args:
        logits: (B, T, V); target: (B, T) with PAD_ID at padding.
    Returns:
        (summed loss, number of non-pad target tokens), both 0-dim tensors: reading the
        count here would make the host wait for the device (and break a compiled graph).
    """
    V = logits.size(-1)
    loss = F.cross_entropy(
        logits.reshape(-1, V).float(),  # (B*T, V)
        target.reshape(-1),  # (B*T,)
        ignore_index=PAD_ID,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    return loss, (target != PAD_ID).sum()


def gold_coins(
    shape: tuple[int, ...], tf_ratio: float, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Bool tensor of `shape`, True (feed gold) with probability tf_ratio, drawn on the CPU
    from `generator` so the draw is reproducible and resumable on any device."""
    coins = torch.rand(shape, generator=generator) < tf_ratio
    return coins.to(device)
