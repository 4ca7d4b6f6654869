"""Forced decoding: how likely a model finds a given translation (`attnmt score`).

    log p(y | x) = sum over t of log p(y_t | y_<t, x),   y ending with EOS

computed with the decoder fed the given target instead of its own choices, step by step
through `decode_step` (the search's contract), so any model scores: both architectures, an
ensemble, int8. The tool for filtering a corpus (low scores flag misaligned pairs) and for
reranking n-best lists (fairseq's --score-reference, marian-scorer).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnmt.data.batches import pad_sequences, sorted_batches
from attnmt.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from attnmt.errors import DataError
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq


@dataclass(frozen=True)
class ForcedScore:
    log_prob: float  # natural log of p(target | source), EOS included
    pieces: int  # target pieces scored, EOS included

    @property
    def per_piece(self) -> float:
        return self.log_prob / self.pieces


@torch.inference_mode()
def force_decode(model: Seq2Seq, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Summed log-probabilities of the targets: src (B, S), tgt (B, T) ids padded with PAD,
    each target ending with EOS -> (B,)."""
    src_pad_mask = src == PAD_ID  # (B, S)
    memory = model.encode(src, src_pad_mask)
    state = model.init_state(memory)
    prev = torch.full((src.size(0),), model.bos_id, dtype=torch.long, device=src.device)
    total = torch.zeros(src.size(0), device=src.device)  # (B,)
    for t in range(tgt.size(1)):
        logits, state, _ = model.decode_step(memory, state, prev)  # (B, V)
        gold = tgt[:, t]  # (B,)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(1, gold[:, None]).squeeze(1)
        total += logp.masked_fill(gold == PAD_ID, 0.0)
        prev = gold.masked_fill(gold == PAD_ID, EOS_ID)  # finished rows: anything valid
    return total


@torch.inference_mode()
def attention_maps(
    model: Seq2Seq,
    src: list[int],
    tgt: list[int],
    specs: Sequence[AttentionSpec],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The source attention while the model reads the target `tgt` (ids, EOS included if the
    translation ended) after the source `src` (ids, EOS included), once per spec (a
    Transformer's layers, each with all_heads; the GRU model's one attention): (len(specs),
    heads, len(tgt), len(src)), each row summing to 1."""
    source = torch.tensor([src], device=device)  # (1, S)
    memory = model.encode(source, source == PAD_ID)
    found = []
    for spec in specs:
        state = model.init_state(memory)
        prev, rows = torch.tensor([model.bos_id], device=device), []
        for token in tgt:
            _, state, attn = model.decode_step(memory, state, prev, spec)
            assert attn is not None
            rows.append(attn[0].float().reshape(-1, len(src)).cpu())  # (heads, S)
            prev = torch.tensor([token], device=device)
        found.append(torch.stack(rows, dim=1))  # (heads, T, S)
    return torch.stack(found)  # (layers, heads, T, S)


def _cut(ids: list[int], limit: int, what: str, key: str, end: int | None) -> list[int]:
    """ids cut to `limit` (ending in `end` when given), with a warning on stderr."""
    if len(ids) <= limit:
        return ids
    print(
        f"attnmt: warning: {what}: {len(ids) - 1:,} subwords, cut to the first "
        f"{limit - (end is not None):,} ({key})",
        file=sys.stderr,
    )
    return [*ids[: limit - 1], end] if end is not None else ids[:limit]


def score_pairs(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    batch_tokens: int,
    device: torch.device | str = "cpu",
    source_prefix: Sequence[int] = (),
    max_src_len: int = 1000,
    max_tgt_len: int = 1500,
) -> list[ForcedScore]:
    """The forced-decoding score of each (source, target) pair, in order; sources are encoded
    as translate encodes them (`source_prefix`: a multilingual model's target-language tag). A
    source is cut to max_src_len subwords as translate cuts it, a target to max_tgt_len (its
    score is then that of its first pieces), each with a warning: one long line must not stall
    the rest."""
    if len(sources) != len(targets):
        raise DataError(f"line counts differ: {len(sources)} sources, {len(targets)} targets")
    was_training = model.training
    model.eval()
    src = [[*source_prefix, *s, EOS_ID] for s in tokenizer.src.encode([s.strip() for s in sources])]
    tgt = [[*t, EOS_ID] for t in tokenizer.tgt.encode([t.strip() for t in targets])]
    for i in range(len(src)):
        src[i] = _cut(src[i], max_src_len, f"source line {i + 1}", "decode.max_src_len", EOS_ID)
        tgt[i] = _cut(tgt[i], max_tgt_len, f"target line {i + 1}", "decode.max_output_len", None)
    lengths = [max(len(s), len(t)) for s, t in zip(src, tgt, strict=True)]
    found = [0.0] * len(src)
    for batch in sorted_batches(lengths, batch_tokens):
        sums = force_decode(
            model,
            pad_sequences([src[i] for i in batch], PAD_ID).to(device),
            pad_sequences([tgt[i] for i in batch], PAD_ID).to(device),
        )
        for i, value in zip(batch, sums.tolist(), strict=True):
            found[i] = value
    model.train(was_training)
    return [ForcedScore(f, len(t)) for f, t in zip(found, tgt, strict=True)]
