"""What a search is asked for (Greedy, Beam, Sampling: SearchOptions) and what one step of any
of them shares: output limits, prefixes, the ids never output, the length penalty, and what a
search returns (Hypothesis). The searches: attnmt.decoding.greedy (greedy and sampling) and
attnmt.decoding.beam, behind one entry, attnmt.decoding.batch.decode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnmt.config import DecodeConfig, LengthNorm
from attnmt.data.tokenizer import UNK_ID
from attnmt.models.packing import Packing
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq, pad_to


@dataclass(frozen=True)
class Greedy:
    """The likeliest token at every step (what beam size 1 means)."""

    n_best = 1


@dataclass(frozen=True)
class Beam:
    """Beam search with `size` beams per sentence; finished hypotheses ranked by
    log-probability / length penalty (alpha = length_penalty, in the form `length_norm`:
    length_penalty()); n_best (<= size) of them."""

    size: int = 5
    length_penalty: float = 1.0
    n_best: int = 1
    length_norm: LengthNorm = "gnmt"  # DecodeConfig.length_norm


@dataclass(frozen=True)
class Sampling:
    """n_best draws per sentence from the model's distribution softened by temperature and
    cut to the top_k tokens (0: all), from a generator seeded with seed."""

    n_best: int = 1
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0


Method = Greedy | Beam | Sampling


@dataclass(frozen=True)
class SearchOptions:
    """How to decode: the method and what every method shares (built from a config's decode
    section by search_options)."""

    method: Method = field(default_factory=Greedy)
    max_len_a: float = 1.5  # output limit a * source length + b, at most max_output_len
    max_len_b: int = 10
    max_output_len: int = 1500
    max_src_len: int = 1000  # source subwords per line (EOS included); translate cuts the rest
    attention: AttentionSpec | None = None  # return this attention per hypothesis
    # Greedy search only (beam search needs them): compute Hypothesis.score, else NaN.
    scores: bool = True
    max_len_round: str = "floor"  # a * source length rounded down, or up ("ceil": Marian's rule)
    allow_unk: bool = True  # False: <unk> is never an output (marian-decoder's default)

    @property
    def n_best(self) -> int:
        """Hypotheses per sentence."""
        return self.method.n_best


def search_options(
    cfg: DecodeConfig,
    *,
    beam: int | None = None,
    length_penalty: float | None = None,
    n_best: int = 1,
    attention: AttentionSpec | None = None,
    sampling: tuple[float, int, int] | None = None,
    length_norm: LengthNorm | None = None,
) -> SearchOptions:
    """The one place SearchOptions are built: a config's decode section, with beam, length
    penalty and its form overridable (flags, train.eval_beam); beam 1 is greedy search.
    Scores are computed only for n-best lists, the one output that shows them. `sampling`:
    (temperature, top_k, seed) to sample n_best draws instead."""
    beam = cfg.beam if beam is None else beam
    alpha = cfg.length_penalty if length_penalty is None else length_penalty
    method: Method
    if sampling is not None:
        method = Sampling(n_best, *sampling)
    elif beam == 1 and n_best == 1:
        method = Greedy()
    else:
        method = Beam(beam, alpha, n_best, cfg.length_norm if length_norm is None else length_norm)
    return SearchOptions(
        method, cfg.max_len_a, cfg.max_len_b, cfg.max_output_len, cfg.max_src_len, attention,
        scores=n_best > 1, max_len_round=cfg.max_len_round, allow_unk=cfg.allow_unk,
    )  # fmt: skip


def forced_tokens(
    prefix: Sequence[Sequence[int]] | None, B: int, device: torch.device
) -> torch.Tensor | None:
    """The prefixes as a (B, P) tensor, -1 where a sentence's prefix has ended; None without."""
    if not prefix or not any(prefix):
        return None
    assert len(prefix) == B
    forced = torch.full((B, max(map(len, prefix))), -1, dtype=torch.long)  # (B, P)
    for i, ids in enumerate(prefix):
        forced[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return forced.to(device)


def forced_at(forced: torch.Tensor | None, steps: torch.Tensor) -> torch.Tensor | None:
    """Each row's prefix token at its own step (steps (n,) into forced (n, P)), -1 where its
    prefix has ended; None when no row has one."""
    if forced is None:
        return None
    P = forced.size(1)
    inside = steps < P  # (n,)
    if P == 0 or not bool(inside.any()):
        return None
    want = forced.gather(1, steps.clamp(max=P - 1).unsqueeze(1)).squeeze(1)  # (n,)
    return want.masked_fill(~inside, -1)


def join_forced(
    old: torch.Tensor | None,
    new: torch.Tensor | None,
    n_old: int,
    n_new: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Two rows' sets of prefixes (N, P) as one, -1 where a row has none; None if no row has."""
    if old is None and new is None:
        return None
    old = torch.full((n_old, 0), -1, device=device) if old is None else old
    new = torch.full((n_new, 0), -1, device=device) if new is None else new
    P = max(old.size(1), new.size(1))
    return torch.cat([pad_to(old, 1, P, -1), pad_to(new, 1, P, -1)])


def append_attention(history: torch.Tensor | None, step: torch.Tensor) -> torch.Tensor:
    """A pool's attention history (N, t, S) with this step's (N, S') appended; newcomers may
    have brought longer sources, and the longest may have left: both are padded to the wider
    (with zeros: no row attends past its source)."""
    a = step.float().unsqueeze(1)  # (N, 1, S')
    if history is None:
        return a
    S = max(history.size(2), a.size(2))
    return torch.cat([pad_to(history, 2, S, 0.0), pad_to(a, 2, S, 0.0)], dim=1)  # (N, t+1, S)


def keep_forced(values: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: each row whose token is >= 0 keeps that token's value, the others -inf."""
    rows = (tokens >= 0).nonzero().squeeze(1)  # (n,)
    if rows.numel():
        kept = values[rows, tokens[rows]]  # (n,)
        values[rows] = -torch.inf
        values[rows, tokens[rows]] = kept


def never_output(model: Seq2Seq, options: SearchOptions) -> list[int]:
    """The ids no translation holds: padding and the start token, and <unk> where the options
    do not allow it."""
    return [model.pad_id, model.bos_id] + ([] if options.allow_unk else [UNK_ID])


def step_log_probs(
    logits: torch.Tensor, banned: list[int], forced: torch.Tensor | None
) -> torch.Tensor:
    """Beam search's next-token log-probabilities (n, V), normalised over the whole
    vocabulary, then -inf for what may not come next: the `banned` ids (never_output, see
    pick_output) and, in rows within a prefix (`forced` >= 0), all but its token. fp32
    logits are overwritten: computed in place, the (n, V) tensor is not written a second
    time in new memory (a third of the log-softmax's time at beam 5)."""
    logp = logits.float()  # (n, V): the logits themselves if fp32
    if logp.is_contiguous():
        logp = torch.log_softmax(logp, dim=-1, out=logp)
    else:
        logp = torch.log_softmax(logp, dim=-1)
    logp[:, banned] = -torch.inf
    if forced is not None:
        keep_forced(logp, forced)
    return logp


@dataclass
class Cohort:
    """Beam search's sentences that joined its pool at one step (Seq2Seq.decode_cohorts), or
    later ones put with them once the model's cohorts are all in use: their memory, decoder
    state and number."""

    memory: Any
    state: Any
    n: int  # sentences
    fresh: bool  # no step taken yet: one decoding row per sentence, not K

    def rows(self, K: int) -> int:
        """Its decoding rows: K per sentence (its beams) unless fresh."""
        return self.n if self.fresh else self.n * K


@dataclass
class Hypothesis:
    tokens: list[int]  # output ids, without BOS and EOS
    score: float  # log-probability, divided by the length penalty in beam search (NaN: not asked)
    ended: bool  # True if it ended with EOS, False if the length limit cut it
    attention: torch.Tensor | None = None  # (steps, S): one row per token, EOS included
    unmet: int = 0  # constrained search: constraints it lacks (the length limit came first)


def pick_output(
    logits: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor], banned: list[int]
) -> torch.Tensor:
    """pick(logits) (B, V) -> (B,) among the tokens a translation may hold: never a `banned`
    id (padding and the start token: a model's probability for them is not a choice, and
    transformers' Marian models forbid the pad id the same way; <unk> where it is not
    allowed). Only the rows whose pick was one of them pick again, without them: the same
    choice as masking first (for a draw, the same distribution), and no copy of the logits on
    the common path. `logits` is left as it was, for scores."""
    nxt = pick(logits)  # (B,)
    hit = nxt == banned[0]  # (B,)
    for token in banned[1:]:
        hit |= nxt == token
    again = hit.nonzero().squeeze(1)  # (n,)
    if again.numel():
        rows = logits[again]  # (n, V): a copy
        rows[:, banned] = -torch.inf
        nxt[again] = pick(rows)
    return nxt


def output_limit(src_len: int, options: SearchOptions) -> int:
    """The output limit of one sentence of src_len subwords (EOS included): round(a *
    src_len) + b output tokens (EOS included), rounded down or up (max_len_round), at least 1
    and at most max_output_len. Marian's rule is a = --max-length-factor, b = 0, rounded up."""
    scaled = round(options.max_len_a * src_len, 6)  # 1.1 * 10 is 11, not 11.000000000000002
    rounded = math.ceil(scaled) if options.max_len_round == "ceil" else math.floor(scaled)
    return max(1, min(rounded + options.max_len_b, options.max_output_len))


def max_output_lengths(src_pad_mask: torch.Tensor, options: SearchOptions) -> torch.Tensor:
    """output_limit of every sentence of a batch: (B,) long."""
    src_len = (~src_pad_mask).sum(dim=1).tolist()  # (B,)
    limits = [output_limit(n, options) for n in src_len]
    return torch.tensor(limits, dtype=torch.long, device=src_pad_mask.device)


def length_penalty(
    length: int | torch.Tensor, alpha: float, norm: LengthNorm = "gnmt"
) -> float | torch.Tensor:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016,
    https://arxiv.org/abs/1609.08144, eq. 14), or with norm "length" length ** alpha (the
    log-probability per token at alpha 1: CTranslate2's, Marian's and fairseq's); alpha = 0
    scores by raw log-probability."""
    return length**alpha if norm == "length" else ((5 + length) / 6) ** alpha


def encode_joining(model: Seq2Seq, src: torch.Tensor, src_pad_mask: torch.Tensor) -> Any:
    """model.encode(src (B, S), src_pad_mask (B, S)), with the sentences packed one after
    another (attnmt.models.packing) where the architecture can and that saves a quarter of
    the positions or more: sentences that join a running search come in any order and length,
    and padded to the longest, a group of ten holds about half padding (serve, 64 clients).
    A batch of sorted lengths (the batch path's) is encoded as it is."""
    packing = Packing.of(src_pad_mask)
    memory = None if packing is None else model.encode_packed(src, src_pad_mask, packing)
    return model.encode(src, src_pad_mask) if memory is None else memory
