"""Sentences of a padded batch packed one after another into a few rows (encoding the
sentences that join a running search: serve's pool).

Sentences that join arrive in any order and length: padded to the longest, a group of ten
holds about half padding, and the encoder's products cost as much per padding position as
per word. Packed, the products see the sentences' own positions only; attention stays within
each sentence (a block-diagonal mask), and each position keeps its place in its sentence
(positional encodings). The packed rows are `width` positions at most, so that attention
over a row costs little beside the products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Positions per packed row at most: attention over a row of 256 costs about a sixth of the
# 30-minute T's products over it.
PACK_WIDTH = 256
# Pack only where it saves at least this share of the positions.
PACK_SAVES = 0.25


@dataclass
class Packing:
    """Where each position of a padded batch (B, S) goes in the packed rows (P, L)."""

    real: torch.Tensor  # (B, S) bool: a sentence's own positions (not padding)
    where: torch.Tensor  # (n,) each real position's index in the packed rows, flattened
    positions: torch.Tensor  # (P, L) each packed position's place in its sentence
    mask: torch.Tensor  # (P, 1, L, L) additive: 0 within a sentence, -inf across

    @classmethod
    def of(cls, src_pad_mask: torch.Tensor, width: int = PACK_WIDTH) -> Packing | None:
        """The packing of src_pad_mask's (B, S) sentences (padded at their end), in order,
        into rows of at most max(width, S) positions; None where it saves less than
        PACK_SAVES of the padded batch's positions."""
        B, S = src_pad_mask.shape
        lengths = (~src_pad_mask).sum(dim=1).tolist()
        width = max(width, S)
        starts, row, fill = [], 0, 0
        for n in lengths:  # first fit, in order
            if fill + n > width:
                row, fill = row + 1, 0
            starts.append((row, fill))
            fill += n
        L = max(f + n for (_, f), n in zip(starts, lengths, strict=True))
        P = row + 1
        if P * L > (1 - PACK_SAVES) * B * S:
            return None
        device = src_pad_mask.device
        counts = torch.tensor(lengths, device=device)  # (B,)
        first = torch.tensor([r * L + f for r, f in starts], device=device)  # (B,)
        place = torch.arange(int(counts.sum()), device=device)  # (n,)
        begins = torch.cumsum(counts, 0) - counts  # (B,): each sentence's first in `place`
        own = place - begins.repeat_interleave(counts)  # (n,) place within its sentence
        where = first.repeat_interleave(counts) + own  # (n,)
        positions = torch.zeros(P * L, dtype=torch.long, device=device)
        positions[where] = own
        # Padding positions are each a sentence of their own: they attend to themselves, so
        # nothing in them turns into NaN for a later layer's sentences to read.
        sentence = -torch.arange(1, P * L + 1, device=device)
        sentence[where] = torch.arange(B, device=device).repeat_interleave(counts)
        sentence = sentence.view(P, L)
        same = sentence.unsqueeze(2) == sentence.unsqueeze(1)  # (P, L, L)
        mask = torch.zeros(same.shape, device=device).masked_fill(~same, -torch.inf)
        return cls(~src_pad_mask, where, positions.view(P, L), mask.unsqueeze(1))

    def pack(self, src: torch.Tensor, fill: int) -> torch.Tensor:
        """src (B, S) -> (P, L), `fill` at the packed rows' ends."""
        P, L = self.positions.shape
        out = src.new_full((P * L,), fill)
        out[self.where] = src[self.real]
        return out.view(P, L)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head packed values x (P, h, L, d) -> (B, h, S, d), zeros at the padding."""
        P, h, L, d = x.shape
        B, S = self.real.shape
        out = x.new_zeros(B, h, S, d)
        rows = x.transpose(1, 2).reshape(P * L, h, d)[self.where]  # (n, h, d)
        out.transpose(1, 2)[self.real] = rows
        return out
