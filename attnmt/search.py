"""Greedy search over any model with the seq2seq interface (encode, init_state, decode_step)."""

from __future__ import annotations

import torch

from attnmt.model import Seq2Seq


def max_output_lengths(src_pad_mask: torch.Tensor, a: float, b: int) -> torch.Tensor:
    """Per-sentence output limit a * source_length + b (EOS included): (B,) long."""
    src_len = (~src_pad_mask).sum(dim=1)  # (B,)
    return (a * src_len.float()).floor().long() + b


@torch.no_grad()
def greedy_search(
    model: Seq2Seq, src: torch.Tensor, src_pad_mask: torch.Tensor, max_len_a: float, max_len_b: int
) -> list[list[int]]:
    """Decode a batch by taking the argmax at every step.

    Sentences that have produced EOS (or reached their length limit) leave the active set, so
    the cost of a step follows the number of unfinished sentences.

    Args:
        src: (B, S) source ids; src_pad_mask: (B, S) bool, True at padding.
    Returns:
        For each sentence, its output ids without BOS/EOS.
    """
    B = src.size(0)
    limits = max_output_lengths(src_pad_mask, max_len_a, max_len_b)  # (B,)
    memory = model.encode(src, src_pad_mask)
    state = model.init_state(memory)
    prev = torch.full((B,), model.bos_id, dtype=torch.long, device=src.device)  # (B,)
    active = torch.arange(B, device=src.device)  # rows of the original batch still decoding
    outputs: list[list[int]] = [[] for _ in range(B)]
    for t in range(int(limits.max())):
        logits, state, _ = model.decode_step(memory, state, prev)  # (B_active, V)
        nxt = logits.argmax(dim=-1)  # (B_active,)
        for row, tok in zip(active.tolist(), nxt.tolist(), strict=True):
            if tok != model.eos_id:
                outputs[row].append(tok)
        done = (nxt == model.eos_id) | (limits[active] <= t + 1)  # (B_active,)
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)  # (B_active',)
            memory, state = model.select(memory, state, keep)
            active, nxt = active[keep], nxt[keep]
        prev = nxt
    return outputs
