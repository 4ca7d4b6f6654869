"""Decoding: greedy search, batched beam search and sampling over any model with the seq2seq
interface, behind one entry, `decode(model, src, src_pad_mask, options)`, that dispatches on
the method's type (Greedy, Beam, Sampling).

All of them decode a whole batch at once and drop finished sentences from the active set, so a
step costs in proportion to the sentences still being decoded. Beam search advances every beam
of every sentence as one (sentences × beam) tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnmt.config import DecodeConfig
from attnmt.data.tokenizer import UNK_ID
from attnmt.decoding.constraints import Constraints, Wanted
from attnmt.kernels import argmax_rows, topk_rows
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq


@dataclass(frozen=True)
class Greedy:
    """The likeliest token at every step (what beam size 1 means)."""

    n_best = 1


@dataclass(frozen=True)
class Beam:
    """Beam search with `size` beams per sentence; finished hypotheses ranked by
    log-probability / GNMT length penalty (alpha = length_penalty); n_best (<= size) of them."""

    size: int = 5
    length_penalty: float = 1.0
    n_best: int = 1


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
) -> SearchOptions:
    """The one place SearchOptions are built: a config's decode section, with beam and length
    penalty overridable (flags, train.eval_beam); beam 1 is greedy search. Scores are computed
    only for n-best lists, the one output that shows them. `sampling`: (temperature, top_k,
    seed) to sample n_best draws instead."""
    beam = cfg.beam if beam is None else beam
    alpha = cfg.length_penalty if length_penalty is None else length_penalty
    method: Method
    if sampling is not None:
        method = Sampling(n_best, *sampling)
    elif beam == 1 and n_best == 1:
        method = Greedy()
    else:
        method = Beam(beam, alpha, n_best)
    return SearchOptions(
        method, cfg.max_len_a, cfg.max_len_b, cfg.max_output_len, cfg.max_src_len, attention,
        scores=n_best > 1, max_len_round=cfg.max_len_round, allow_unk=cfg.allow_unk,
    )  # fmt: skip


def decode(
    model: Seq2Seq,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    options: SearchOptions,
    prefix: Sequence[Sequence[int]] | None = None,
    constraints: Wanted | None = None,
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


def forced_at(
    forced: torch.Tensor | None, t: int, rows: torch.Tensor | list[int]
) -> torch.Tensor | None:
    """Step t's prefix token of each of `rows` (sentence indices), -1 where its prefix has
    ended; None when no sentence has one at step t."""
    return None if forced is None or t >= forced.size(1) else forced[rows, t]


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
    pick_output) and, in rows within a prefix (`forced` >= 0), all but its token."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    logp[:, banned] = -torch.inf
    if forced is not None:
        keep_forced(logp, forced)
    return logp


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


def length_penalty(length: int | torch.Tensor, alpha: float) -> float | torch.Tensor:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016,
    https://arxiv.org/abs/1609.08144, eq. 14); alpha = 0 scores by raw log-probability."""
    return ((5 + length) / 6) ** alpha


# Greedy search drops finished sentences from the batch once this share of its rows has
# finished (1/8): gathering the memory and caches after every step where one sentence ends
# costs more than decoding a few finished rows along.
COMPACT_SHARE = 8


@torch.no_grad()
def greedy_search(
    model: Seq2Seq,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    options: SearchOptions,
    pick: Callable[[torch.Tensor], torch.Tensor] = argmax_rows,
    forced: torch.Tensor | None = None,
) -> list[Hypothesis]:
    """Take the argmax (or what `pick` chooses from each row of logits) at every step.

    Finished sentences leave the batch in groups (see COMPACT_SHARE); until then their rows
    are decoded and ignored, which changes nothing in the others: rows never mix.

    Args:
        src: (B, S) source ids; src_pad_mask: (B, S) bool, True at padding.
        options: the output limit; `attention` returns each hypothesis's source attention per
            step (slower); without `scores` the scores are NaN (no log-softmax per step).
    Returns:
        One hypothesis per sentence; score = summed log-probability.
    """
    B, device = src.size(0), src.device
    limits = max_output_lengths(src_pad_mask, options)  # (B,)
    attention, scores = options.attention, options.scores
    banned = never_output(model, options)
    memory = model.encode(src, src_pad_mask)
    state = model.init_state(memory)
    prev = torch.full((B,), model.bos_id, dtype=torch.long, device=device)  # (B,)
    rows = torch.arange(B, device=device)  # sentence of each row of the batch
    live = torch.ones(B, dtype=torch.bool, device=device)  # (B_r,) rows still decoding
    steps: list[torch.Tensor] = []  # per step: (B,) token, PAD once finished
    total = torch.zeros(B, device=device) if scores else torch.full((B,), torch.nan, device=device)
    attn_steps: list[torch.Tensor] = []  # per step: (B, S)
    for t in range(int(limits.max())):
        logits, state, attn = model.decode_step(memory, state, prev, attention)  # (B_r, V)
        nxt = pick_output(logits, pick, banned)  # (B_r,)
        if (want := forced_at(forced, t, rows)) is not None:  # a prefix's token, where it goes on
            nxt = torch.where(want >= 0, want, nxt)
        if scores:
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, nxt[:, None])  # (B_r, 1)
            total.index_add_(0, rows, logp.squeeze(1).masked_fill(~live, 0.0))
        full = torch.full((B,), model.pad_id, dtype=torch.long, device=device)
        full[rows] = nxt.masked_fill(~live, model.pad_id)
        steps.append(full)
        if attn is not None:
            a = torch.zeros(B, src.size(1), device=device)
            a[rows] = attn.float().masked_fill(~live.unsqueeze(1), 0.0)
            attn_steps.append(a)
        live &= (nxt != model.eos_id) & (limits[rows] > t + 1)
        n_live = int(live.sum())
        if n_live == 0:
            break
        if live.numel() - n_live >= max(1, live.numel() // COMPACT_SHARE):
            keep = live.nonzero().squeeze(1)  # (B_r',)
            memory = model.select_memory(memory, keep)
            state = model.select_state(state, keep)
            rows, nxt, live = rows[keep], nxt[keep], live[keep]
        prev = nxt
    out = torch.stack(steps, dim=1).tolist()  # (B, T)
    hyps = []
    for i, row in enumerate(out):
        n = next((j for j, tok in enumerate(row) if tok in (model.eos_id, model.pad_id)), len(row))
        ended = n < len(row) and row[n] == model.eos_id
        a = torch.stack([s[i] for s in attn_steps[: n + int(ended)]]) if attn_steps else None
        hyps.append(Hypothesis(row[:n], float(total[i]), ended, a))
    return hyps


@torch.no_grad()
def sample(
    model: Seq2Seq,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    options: SearchOptions,
    forced: torch.Tensor | None = None,
) -> list[list[Hypothesis]]:
    """options.n_best draws per sentence, token by token from softmax(logits / temperature)
    over the top_k tokens (ancestral sampling, for back-translation: Edunov et al. 2018,
    https://arxiv.org/abs/1808.09381). Scores are the model's own log-probabilities."""
    method = options.method
    assert isinstance(method, Sampling)
    k = method.n_best
    generator = torch.Generator(device=src.device).manual_seed(method.seed)

    def draw(logits: torch.Tensor) -> torch.Tensor:  # (B_r, V) -> (B_r,)
        logits = logits.float() / method.temperature
        if 0 < method.top_k < logits.size(1):
            kth = logits.topk(method.top_k, dim=1).values[:, -1:]  # (B_r, 1)
            logits = logits.masked_fill(logits < kth, -torch.inf)
        probs = torch.softmax(logits, dim=1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    rows = greedy_search(
        model, src.repeat_interleave(k, 0), src_pad_mask.repeat_interleave(k, 0), options, draw,
        None if forced is None else forced.repeat_interleave(k, 0),
    )  # fmt: skip
    return [rows[i * k : (i + 1) * k] for i in range(src.size(0))]


@torch.no_grad()
def beam_search(
    model: Seq2Seq,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    options: SearchOptions,
    forced: torch.Tensor | None = None,
    constraints: Wanted | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search: all sentences and all their beams advance as one tensor.

    At each step every live beam is extended by every token; of the 2K best candidates of a
    sentence, those ending in EOS that rank within the top K are finished, and the K best
    others continue. A sentence is done once its best candidate is EOS and it has n_best
    finished hypotheses (the rule of OpenNMT-py), or at its length limit, when its live beams
    are finished as they are; it then leaves the batch. Finished hypotheses are ranked by
    log-probability / length_penalty(length, alpha), with length counting EOS.

    `constraints`: per sentence, phrases (target ids) its output must contain: lexically
    constrained search (attnmt.decoding.constraints); a hypothesis ends only once it has met
    them all, or at the length limit (then Hypothesis.unmet counts those it lacks).

    Returns:
        For each sentence, its n_best hypotheses: the 1-best first, then by score (_Finished).
    """
    # Long: one loop whose four numbered parts share the beams' state (scores, tokens, state,
    # attention, active sentences); the choice (1, 2) is the chooser's and the finishing (3)
    # _Finished.settle's, the rest would pass all of that state back and forth.
    method = options.method
    assert isinstance(method, Beam)
    K, n_best, alpha = method.size, method.n_best, method.length_penalty
    attention = options.attention
    assert 1 <= n_best <= K
    B, device = src.size(0), src.device
    limits = max_output_lengths(src_pad_mask, options)  # (B,)
    # One memory row per sentence, shared by its K beams (see attnmt.models.build).
    banned = never_output(model, options)
    memory = model.encode(src, src_pad_mask)
    state, scores = _start_beams(model, memory, B, K, device)
    tokens = torch.full((B * K, 0), model.pad_id, dtype=torch.long, device=device)  # (B_a*K, t)
    attn_hist: torch.Tensor | None = None  # (B_a*K, t, S)
    prev = torch.full((B * K,), model.bos_id, dtype=torch.long, device=device)
    active = list(range(B))  # original sentence index of each active row block
    results = _Finished(alpha, n_best, B)
    constrained = constraints is not None and any(constraints.phrases)
    chooser = Constraints(constraints, K, device) if constrained else _ByScore()
    for t in range(int(limits.max())):
        n = len(active)
        logits, state, attn = model.decode_step(memory, state, prev, attention)  # (n*K, V)
        want = forced_at(forced, t, active)  # (n,) or None
        logp = step_log_probs(logits, banned, None if want is None else want.repeat_interleave(K))
        if attn is not None:
            a = attn.float().unsqueeze(1)  # (n*K, 1, S)
            attn_hist = a if attn_hist is None else torch.cat([attn_hist, a], dim=1)
        # 1. EOS among each sentence's first K candidates finishes a hypothesis; 2. the K
        # first that are not EOS continue (first: by score, or by the constraints' banks).
        top_scores, top_beam, top_tok, finish, pick, best_eos = chooser.step(
            scores, logp, model.eos_id, K
        )  # candidates (n, M) each; finish (n, M); pick (n, K); best_eos (n,)
        best_is_eos = best_eos.tolist()
        results.add_ended(active, finish, top_beam, top_scores, tokens, attn_hist, t + 1)
        new_scores = top_scores.gather(1, pick)  # (n, K)
        new_beam = top_beam.gather(1, pick)  # (n, K)
        new_tok = top_tok.gather(1, pick)  # (n, K)
        rows = (torch.arange(n, device=device).unsqueeze(1) * K + new_beam).view(-1)  # (n*K,)
        tokens = torch.cat([tokens[rows], new_tok.view(-1, 1)], dim=1)  # (n*K, t+1)
        if attn_hist is not None:
            attn_hist = attn_hist[rows]
        # 3. A sentence is done when its best candidate is EOS (no live beam scores higher)
        # and it has n_best finished hypotheses; at its length limit, its live beams finish
        # as they are. Stopping as soon as K hypotheses finished would not do: on a confident
        # model the EOS extensions of poor beams fill those K places while the best beam is
        # still in mid-sentence.
        at_limit = (limits[active] <= t + 1).tolist()
        lacking = chooser.unmet() if any(at_limit) else None  # (n*K,) constraints unmet
        keep = results.settle(active, t + 1, at_limit, best_is_eos, tokens, new_scores,
                              attn_hist, lacking)  # fmt: skip
        # 4. Done sentences leave; the others go on with their reordered beams.
        if not keep:
            break
        scores = new_scores
        prev = new_tok.view(-1)
        if len(keep) < n:
            keep_t = torch.tensor(keep, device=device)
            keep_rows = (keep_t.unsqueeze(1) * K + torch.arange(K, device=device)).view(-1)
            memory = model.select_memory(memory, keep_t)
            # One gather of the decoder state: the reordered beams of the sentences kept.
            state = model.select_state(state, rows[keep_rows])
            scores, prev, tokens = scores[keep_t], prev[keep_rows], tokens[keep_rows]
            if attn_hist is not None:
                attn_hist = attn_hist[keep_rows]
            chooser.keep(keep_rows)
            active = [active[r] for r in keep]
        else:
            state = model.select_state(state, rows)
    return results.n_best_lists()


def _start_beams(
    model: Seq2Seq, memory: Any, B: int, K: int, device: torch.device
) -> tuple[Any, torch.Tensor]:
    """The decoder state of K beams per sentence (rows sentence-major) and their scores
    (B, K): only the first beam starts alive, so the first step does not pick K copies of one
    token."""
    beams_of = torch.arange(B, device=device).repeat_interleave(K)  # (B * K,)
    state = model.select_state(model.init_state(memory), beams_of)
    scores = torch.full((B, K), float("-inf"), device=device)  # summed log-probs
    scores[:, 0] = 0.0
    return state, scores


class _ByScore:
    """Unconstrained beam search's choice (the constrained one: constraints.Constraints)."""

    def step(
        self, scores: torch.Tensor, logp: torch.Tensor, eos_id: int, K: int
    ) -> tuple[torch.Tensor, ...]:
        """Among each sentence's 2K best candidates (n, 2K) each, best first: their scores,
        beams and tokens; the EOS among the first K finish ((n, 2K) bool); the K best others
        continue ((n, K) indices); whether the best candidate is EOS ((n,) bool)."""
        top_scores, top_beam, top_tok = _best_candidates(scores, logp)  # (n, 2K) each
        is_eos = top_tok == eos_id  # (n, 2K)
        finish = is_eos.clone()
        finish[:, K:] = False
        _, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(K, dim=1)  # (n, K)
        return top_scores, top_beam, top_tok, finish, pick, is_eos[:, 0]

    def unmet(self) -> None:
        """No constraints: none unmet."""
        return None

    def keep(self, rows: torch.Tensor) -> None:
        """Nothing per row to keep."""


def _best_candidates(
    scores: torch.Tensor, logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sentence's 2K best extensions from beam scores (n, K) and next-token log-probs
    (n*K, V): their scores, beams and tokens, (n, 2K) each, best first.

    A sentence's 2K best candidates are among the 2K best continuations of their own beams (a
    better candidate of the same beam is a better one overall), so the beam scores are added
    to those K * 2K only, not to all K * V.
    """
    n, K = scores.shape
    per_beam = min(2 * K, logp.size(-1))
    beam_lp, beam_tok = topk_rows(logp, per_beam)  # (n*K, P)
    cand = (scores.view(-1, 1) + beam_lp).view(n, K * per_beam)  # (n, K*P)
    top_scores, top_idx = cand.topk(2 * K, dim=1)  # (n, 2K)
    top_beam = torch.div(top_idx, per_beam, rounding_mode="floor")  # (n, 2K)
    return top_scores, top_beam, beam_tok.view(n, K * per_beam).gather(1, top_idx)


class _Finished:
    """Beam search's finished hypotheses per sentence, and each sentence's 1-best answer."""

    def __init__(self, alpha: float, n_best: int, sentences: int) -> None:
        self.alpha, self.n_best = alpha, n_best
        self.hyps: list[list[Hypothesis]] = [[] for _ in range(sentences)]
        self.first: list[Hypothesis | None] = [None] * sentences

    def add(
        self,
        sent: int,
        tokens: torch.Tensor,
        logprob: float,
        length: int,
        ended: bool,
        attn_hist: torch.Tensor | None,
        row: int,
        unmet: int = 0,
    ) -> None:
        """Finish a hypothesis of sentence `sent`: tokens (t,), the attention of beam row `row`,
        `unmet` of its constraints not met."""
        attn = attn_hist[row] if attn_hist is not None else None
        hyp = _hypothesis(tokens, logprob, length, self.alpha, ended, attn)
        hyp.unmet = unmet
        self.hyps[sent].append(hyp)

    def add_ended(
        self,
        active: list[int],
        finish: torch.Tensor,
        beam: torch.Tensor,
        scores: torch.Tensor,
        tokens: torch.Tensor,
        attn_hist: torch.Tensor | None,
        length: int,
    ) -> None:
        """Finish the candidates that end in EOS: finish (n, M) bool over candidates whose beams
        and scores are beam, scores (n, M); tokens (n*K, length - 1) the beams' tokens so far."""
        K = tokens.size(0) // len(active)
        for r, c in finish.nonzero().tolist():
            row = r * K + int(beam[r, c])
            self.add(active[r], tokens[row], float(scores[r, c]), length, True, attn_hist, row)

    def settle(
        self,
        active: list[int],
        length: int,
        at_limit: list[bool],
        best_is_eos: list[bool],
        tokens: torch.Tensor,
        scores: torch.Tensor,
        attn_hist: torch.Tensor | None,
        unmet: torch.Tensor | None,
    ) -> list[int]:
        """After a step: the live beams (tokens (n*K, length), scores (n, K)) of sentences at
        their length limit finish as they are (`unmet`: (n*K,) constraints each lacks); returns
        the places r in `active` of the sentences that go on (see done)."""
        K = scores.size(1)
        lacking = [0] * tokens.size(0) if unmet is None else unmet.tolist()
        keep = []
        for r, sent in enumerate(active):
            for j in range(K if at_limit[r] else 0):
                row = r * K + j
                self.add(sent, tokens[row], float(scores[r, j]), length, False, attn_hist, row,
                         lacking[row])  # fmt: skip
            if not self.done(sent, best_is_eos[r], at_limit[r]):
                keep.append(r)
        return keep

    def done(self, sent: int, best_is_eos: bool, at_limit: bool) -> bool:
        """Whether sentence `sent` is done (see beam_search). Where a 1-best search would stop,
        its answer is kept: it heads the n-best list too."""
        hyps = self.hyps[sent]
        if self.first[sent] is None and (at_limit or (best_is_eos and hyps)):
            # Constrained at the length limit: one that met every constraint, if any did.
            self.first[sent] = max(hyps, key=lambda h: (h.unmet == 0, h.score))
        return at_limit or (best_is_eos and len(hyps) >= self.n_best)

    def n_best_lists(self) -> list[list[Hypothesis]]:
        """Per sentence: the 1-best answer, then the other hypotheses by score. A longer search
        for more hypotheses may find one scoring above the 1-best; it still comes second, so
        that the first line of an n-best list is always what a 1-best translation gives."""
        out = []
        for hyps, first in zip(self.hyps, self.first, strict=True):
            assert first is not None
            rest = [h for h in hyps if h is not first]
            rest.sort(key=lambda h: (h.unmet > 0, -h.score))  # constraints met first
            out.append([first, *rest][: self.n_best])
        return out


def _hypothesis(
    tokens: torch.Tensor,
    logprob: float,
    length: int,
    alpha: float,
    ended: bool,
    attn: torch.Tensor | None,
) -> Hypothesis:
    """A finished hypothesis; `length` counts its steps (output tokens, plus EOS if ended)."""
    ids = [int(x) for x in tokens.tolist()]
    return Hypothesis(ids, logprob / float(length_penalty(length, alpha)), ended, attn)
