"""Batched beam search as a pool of sentences that may join and leave at every step.

`beam_search` puts one batch into a pool and steps it until every sentence is done: the batch
path. `attnmt serve` keeps one pool running and adds the sentences of requests as they arrive
(step-level batching). All sentences and all their beams advance as one (sentences × beam)
tensor; each sentence counts its own steps (output limit, prefix, length penalty), so its
result does not depend on when it joined.
"""

from __future__ import annotations

import math

import torch

from attnmt.config import LengthNorm
from attnmt.decoding.constraints import Constraints, Phrases
from attnmt.decoding.search import (
    Beam,
    Cohort,
    Hypothesis,
    SearchOptions,
    append_attention,
    encode_joining,
    forced_at,
    join_forced,
    length_penalty,
    max_output_lengths,
    never_output,
    step_log_probs,
)
from attnmt.kernels import topk_rows
from attnmt.models.rows import kept_order
from attnmt.models.seq2seq import Seq2Seq

# With the length^alpha normalisation a sentence goes on while its best live beam, normalised
# as if this many tokens longer, would outscore its best finished hypothesis (BeamPool). The
# 30-minute T, beam 5, 500 sentences: 2 tokens BLEU 40.57 at 0.94x the speed of stopping at
# once, 5 tokens 40.63 at 0.86x (docs/benchmarks.md).
LOOKAHEAD = 2


class BeamPool:
    """Sentences searched with K beams each, each from the step it joined (add) to its end.

    At each step every live beam is extended by every token; of the 2K best candidates of a
    sentence, those ending in EOS that rank within the top K are finished, and the K best
    others continue. A sentence is done once its best candidate is EOS and it has n_best
    finished hypotheses (the rule of OpenNMT-py), or at its length limit, when its live beams
    are finished as they are; it then leaves the pool and step returns its n-best list.
    Finished hypotheses are ranked by log-probability / length_penalty(length, alpha), with
    length counting EOS. With the length normalised as length^alpha (`length_norm` "length",
    CTranslate2's and Marian's form), which favours longer hypotheses more, a sentence goes on
    after its best candidate ended while its best live beam, normalised as if LOOKAHEAD
    tokens longer, would outscore its best finished one: stopping at once missed the longer
    lines that form prefers (the 30-minute T, beam 5: BLEU 39.10 stopping at once, 40.57 with
    this rule, CTranslate2 40.52; docs/benchmarks.md).

    Constrained (`constrained`): per sentence, phrases (target ids) its output must contain:
    lexically constrained search (attnmt.decoding.constraints); a hypothesis ends only once it
    has met them all, or at the length limit (then Hypothesis.unmet counts those it lacks).
    A pool is constrained or not for its whole life: the choice differs even without phrases.
    """

    def __init__(self, model: Seq2Seq, options: SearchOptions, constrained: bool = False) -> None:
        method = options.method
        assert isinstance(method, Beam) and 1 <= method.n_best <= method.size
        self.model, self.options, self.K = model, options, method.size
        self.constrained = constrained
        self.banned = never_output(model, options)
        self.results = _Finished(method.length_penalty, method.n_best, method.length_norm)
        self.ids: list[int] = []  # each active sentence's id (its block of K rows)
        self.next_id = 0
        # The sentences' memory and state, by the step they joined at (their rows in order).
        self.cohorts: list[Cohort] = []
        # Attention maps are the module path's: a step of its own for each cohort.
        self.max_cohorts = model.max_cohorts if options.attention is None else 1

    def __len__(self) -> int:
        """Sentences still searching."""
        return len(self.ids)

    def add(
        self,
        src: torch.Tensor,
        src_pad_mask: torch.Tensor,
        forced: torch.Tensor | None = None,
        phrases: Phrases | None = None,
    ) -> list[int]:
        """Encode a batch (src (B, S), src_pad_mask (B, S), prefixes (B, P) or None, phrases if
        the pool is constrained) and add its sentences; returns their ids (step's keys)."""
        B, K, device, model = src.size(0), self.K, src.device, self.model
        assert (phrases is not None) == self.constrained
        # One memory row per sentence, shared by its beams. The sentences start as a cohort
        # of their own, one row each until their first step has chosen K tokens (their K
        # beams would be K copies of it); where the pool has as many cohorts as its model
        # shares a step among, they join the youngest, with K rows each unless it is fresh.
        memory = encode_joining(model, src, src_pad_mask)
        last = self.cohorts[-1] if self.cohorts else None
        join = last is not None and (last.fresh or len(self.cohorts) >= self.max_cohorts)
        fresh = last is None or not join or last.fresh
        state = model.init_state(memory)
        if not fresh:
            state = model.select_state(state, torch.arange(B, device=device).repeat_interleave(K))
        if join:
            assert last is not None
            last.memory = model.join_memory(last.memory, memory)
            last.state, last.n = model.join_state(last.state, state), last.n + B
        else:
            self.cohorts.append(Cohort(memory, state, B, fresh=True))
        scores = torch.full((B, K), float("-inf"), device=device)  # summed log-probs
        scores[:, 0] = 0.0  # only the first beam starts alive: not K copies of one token
        limits = max_output_lengths(src_pad_mask, self.options)  # (B,)
        chooser = Constraints(phrases, K, device) if phrases is not None else _ByScore()
        ids = list(range(self.next_id, self.next_id + B))
        self.next_id += B
        prev = torch.full((B if fresh else B * K,), model.bos_id, dtype=torch.long, device=device)
        steps = torch.zeros(B, dtype=torch.long, device=device)
        if not self.ids:
            self.scores, self.limits = scores, limits
            self.chooser, self.ids, self.forced, self.prev, self.steps = (
                chooser, list(ids), forced, prev, steps)  # fmt: skip
            self.tokens = torch.zeros(B * K, 0, dtype=torch.long, device=device)  # (n*K, t)
            self.attn: torch.Tensor | None = None  # (n*K, t, S)
            return ids
        self.forced = join_forced(self.forced, forced, len(self.ids), B, device)
        self.scores, self.limits = (
            torch.cat([self.scores, scores]),
            torch.cat([self.limits, limits]),
        )
        self.prev, self.steps = torch.cat([self.prev, prev]), torch.cat([self.steps, steps])
        T = self.tokens.size(1)  # a newcomer's tokens are the last steps[r] columns
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(B * K, T)])
        if self.attn is not None:
            self.attn = torch.cat([self.attn, self.attn.new_zeros(B * K, T, self.attn.size(2))])
        self.chooser.join(chooser)
        self.ids += ids
        return ids

    @torch.no_grad()
    def step(self) -> dict[int, list[Hypothesis]]:
        """Decode one position of every beam; returns the sentences that are done, by id:
        their n_best hypotheses, the 1-best first, then by score (_Finished)."""
        # Long: one step whose four numbered parts share the beams' state (scores, tokens,
        # state, attention, active sentences); the choice (1, 2) is the chooser's and the
        # finishing (3) _Finished.settle's, the rest would pass all of that state around.
        model, K, n, cohorts = self.model, self.K, len(self.ids), self.cohorts
        device = self.scores.device
        sizes = [c.rows(K) for c in cohorts]  # decoding rows: a fresh cohort's one a sentence
        logits, states, attn = model.decode_cohorts(
            [c.memory for c in cohorts], [c.state for c in cohorts], self.prev, sizes,
            self.options.attention,
        )  # (R, V): R = n*K but for fresh cohorts' sentences, one row each  # fmt: skip
        read = self._rows_read(device) if any(c.fresh for c in cohorts) else None
        want = forced_at(self.forced, self.steps)  # (n,) or None
        if want is not None:
            want = want.repeat_interleave(K) if read is None else want.index_select(0, read[1])
        logp = step_log_probs(logits, self.banned, want)  # (R, V)
        if read is not None:  # each beam's row: a fresh sentence's K beams read its one row
            logp = logp.index_select(0, read[0])  # (n*K, V)
            attn = None if attn is None else attn.index_select(0, read[0])
        if attn is not None:
            self.attn = append_attention(self.attn, attn)  # (n*K, t+1, S)
        # 1. EOS among each sentence's first K candidates finishes a hypothesis; 2. the K
        # first that are not EOS continue (first: by score, or by the constraints' banks).
        top_scores, top_beam, top_tok, finish, pick, best_eos = self.chooser.step(
            self.scores, logp, model.eos_id, K
        )  # candidates (n, M) each; finish (n, M); pick (n, K); best_eos (n,)
        best_is_eos = best_eos.tolist()
        lengths = (self.steps + 1).tolist()  # each sentence's steps with this one
        self.results.add_ended(self.ids, finish, top_beam, top_scores, self.tokens, self.attn,
                               lengths)  # fmt: skip
        new_scores = top_scores.gather(1, pick)  # (n, K)
        new_beam = top_beam.gather(1, pick)  # (n, K)
        new_tok = top_tok.gather(1, pick)  # (n, K)
        rows = (torch.arange(n, device=device).unsqueeze(1) * K + new_beam).view(-1)  # (n*K,)
        origin = rows if read is None else read[0][rows]  # the decoding row each beam goes on from
        self.tokens = torch.cat([self.tokens[rows], new_tok.view(-1, 1)], dim=1)  # (n*K, t+1)
        if self.attn is not None:
            self.attn = self.attn[rows]
        # 3. A sentence is done when its best candidate is EOS (no live beam scores higher)
        # and it has n_best finished hypotheses; at its length limit, its live beams finish
        # as they are. Stopping as soon as K hypotheses finished would not do: on a confident
        # model the EOS extensions of poor beams fill those K places while the best beam is
        # still in mid-sentence.
        at_limit = (self.limits <= self.steps + 1).tolist()
        lacking = self.chooser.unmet() if any(at_limit) else None  # (n*K,) constraints unmet
        keep = self.results.settle(self.ids, lengths, at_limit, best_is_eos, self.tokens,
                                   new_scores, self.attn, lacking)  # fmt: skip
        kept = set(keep)
        done = {i: self.results.pop(i) for r, i in enumerate(self.ids) if r not in kept}
        # 4. Done sentences leave; the others go on with their reordered beams.
        self.scores, self.prev, self.steps = new_scores, new_tok.view(-1), self.steps + 1
        live = None
        if len(keep) < n:
            live = torch.zeros(n, dtype=torch.bool)
            live[keep] = True
        keep_t = self._go_on(states, sizes, origin, live)
        if keep_t is None:
            return done
        if not self.cohorts:
            self.ids = []
            return done
        keep_rows = _beam_rows(keep_t, K)
        self.ids = [self.ids[r] for r in keep_t.tolist()]
        self.scores, self.limits, self.steps = (
            self.scores[keep_t], self.limits[keep_t], self.steps[keep_t])  # fmt: skip
        self.forced = None if self.forced is None else self.forced[keep_t]
        self.prev, self.tokens = self.prev[keep_rows], self.tokens[keep_rows]
        self.attn = None if self.attn is None else self.attn[keep_rows]
        self.chooser.keep(keep_rows)
        cut = self.tokens.size(1) - int(self.steps.max())  # columns no row has any more
        if cut > 0:
            self.tokens = self.tokens[:, cut:]
            self.attn = None if self.attn is None else self.attn[:, cut:]
        return done

    def _rows_read(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a cohort is fresh (one decoding row per sentence): the decoding row each
        beam reads (n*K,), and the sentence each decoding row is (R,)."""
        K, beams, sentences, at, s = self.K, [], [], 0, 0
        for c in self.cohorts:
            mine = torch.arange(s, s + c.n)
            if c.fresh:
                beams.append(torch.arange(at, at + c.n).repeat_interleave(K))
                sentences.append(mine)
            else:
                beams.append(torch.arange(at, at + c.n * K))
                sentences.append(mine.repeat_interleave(K))
            at, s = at + c.rows(K), s + c.n
        return torch.cat(beams).to(device), torch.cat(sentences).to(device)

    def _go_on(
        self, states: list, sizes: list[int], origin: torch.Tensor, live: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Each cohort's new state: its beams' rows in their new order (origin (n*K,): the
        decoding row each continues), without the sentences not `live` (n,) (None: all go
        on), whose places the cohort's last sentences take (only they are copied, within
        its memory's buffers). Returns the sentences kept, in their new order (n',), or None
        when all go on."""
        K, model, kept, orders, s, at = self.K, self.model, [], [], 0, 0
        for c, state, size in zip(self.cohorts, states, sizes, strict=True):
            beams = origin[s * K : (s + c.n) * K]  # (n_c*K,) rows of the cohort's state
            beams = beams - at if at else beams
            c.fresh, mine = False, None
            if live is not None:
                mine = kept_order(live[s : s + c.n]).to(origin.device)  # (n_c',)
                orders.append(mine + s)
            s, at = s + c.n, at + size
            if mine is None or mine.numel() == c.n:
                c.state = model.select_state(state, beams)
                kept.append(c)
            elif mine.numel():
                c.memory = model.keep_memory(c.memory, mine)
                # One gather of the decoder state: the reordered beams of the sentences kept.
                c.state = model.select_state(state, beams[_beam_rows(mine, K)])
                c.n = mine.numel()
                kept.append(c)
        self.cohorts = kept
        return None if live is None else torch.cat(orders)


def _beam_rows(sentences: torch.Tensor, K: int) -> torch.Tensor:
    """The beam rows (n*K,) of sentences (n,): each one's block of K rows."""
    return (sentences.unsqueeze(1) * K + torch.arange(K, device=sentences.device)).view(-1)


@torch.no_grad()
def beam_search(
    model: Seq2Seq,
    src: torch.Tensor,
    src_pad_mask: torch.Tensor,
    options: SearchOptions,
    forced: torch.Tensor | None = None,
    constraints: Phrases | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search over one batch (BeamPool): for each sentence its n_best
    hypotheses, the 1-best first, then by score. `constraints`: per sentence, phrases its
    output must contain (constrained search when any sentence has one)."""
    constrained = constraints is not None and any(constraints.phrases)
    pool = BeamPool(model, options, constrained)
    ids = pool.add(src, src_pad_mask, forced, constraints if constrained else None)
    found: dict[int, list[Hypothesis]] = {}
    while len(pool):
        found.update(pool.step())
    return [found[i] for i in ids]


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

    def join(self, other: _ByScore) -> None:
        """Nothing per row to join."""


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
    """Beam search's finished hypotheses per sentence (by id), and each one's 1-best answer."""

    def __init__(self, alpha: float, n_best: int, norm: LengthNorm = "gnmt") -> None:
        self.alpha, self.n_best, self.norm = alpha, n_best, norm
        self.hyps: dict[int, list[Hypothesis]] = {}
        self.first: dict[int, Hypothesis] = {}

    def add(
        self,
        sent: int,
        tokens: torch.Tensor,
        logprob: float,
        length: int,
        ended: bool,
        attn: torch.Tensor | None,
        unmet: int = 0,
    ) -> None:
        """Finish a hypothesis of sentence `sent` after `length` steps: its tokens (EOS not
        among them), the attention of its beam row, `unmet` of its constraints not met."""
        ids = [int(x) for x in tokens.tolist()]
        score = logprob / float(length_penalty(length, self.alpha, self.norm))
        self.hyps.setdefault(sent, []).append(Hypothesis(ids, score, ended, attn, unmet))

    def add_ended(
        self,
        ids: list[int],
        finish: torch.Tensor,
        beam: torch.Tensor,
        scores: torch.Tensor,
        tokens: torch.Tensor,
        attn: torch.Tensor | None,
        lengths: list[int],
    ) -> None:
        """Finish the candidates that end in EOS: finish (n, M) bool over candidates whose beams
        and scores are beam, scores (n, M); tokens (n*K, t) the beams' tokens so far (sentence
        r's own: the last lengths[r] - 1 columns), attn (n*K, t + 1, S) with this step's."""
        K, t = tokens.size(0) // len(ids), tokens.size(1)
        for r, c in finish.nonzero().tolist():
            row, length = r * K + int(beam[r, c]), lengths[r]
            a = None if attn is None else attn[row, attn.size(1) - length :]
            self.add(ids[r], tokens[row, t - length + 1 :], float(scores[r, c]), length, True, a)

    def settle(
        self,
        ids: list[int],
        lengths: list[int],
        at_limit: list[bool],
        best_is_eos: list[bool],
        tokens: torch.Tensor,
        scores: torch.Tensor,
        attn: torch.Tensor | None,
        unmet: torch.Tensor | None,
    ) -> list[int]:
        """After a step: the live beams (tokens (n*K, t), sentence r's own the last
        lengths[r]; scores (n, K)) of sentences at their length limit finish as they are
        (`unmet`: (n*K,) constraints each lacks); returns the places r in `ids` of the
        sentences that go on (see done)."""
        K, t = scores.size(1), tokens.size(1)
        lacking = [0] * tokens.size(0) if unmet is None else unmet.tolist()
        if self.norm == "length":  # BeamPool's docstring: stop where no live beam can win
            best_is_eos = self._none_can_win(ids, lengths, scores)
        keep = []
        for r, sent in enumerate(ids):
            length = lengths[r]
            for j in range(K if at_limit[r] else 0):
                row = r * K + j
                a = None if attn is None else attn[row, attn.size(1) - length :]
                self.add(sent, tokens[row, t - length :], float(scores[r, j]), length, False, a,
                         lacking[row])  # fmt: skip
            if not self.done(sent, best_is_eos[r], at_limit[r]):
                keep.append(r)
        return keep

    def _none_can_win(self, ids: list[int], lengths: list[int], scores: torch.Tensor) -> list[bool]:
        """Per sentence: whether its best finished hypothesis outscores its best live beam
        (scores (n, K)) normalised as if LOOKAHEAD tokens longer than it is."""
        best_live = scores.max(dim=1).values.tolist()  # (n,)
        out = []
        for r, sent in enumerate(ids):
            top = max((h.score for h in self.hyps.get(sent, [])), default=-math.inf)
            ahead = float(length_penalty(lengths[r] + LOOKAHEAD, self.alpha, self.norm))
            out.append(top >= best_live[r] / ahead)
        return out

    def done(self, sent: int, best_is_eos: bool, at_limit: bool) -> bool:
        """Whether sentence `sent` is done (see BeamPool). Where a 1-best search would stop,
        its answer is kept: it heads the n-best list too."""
        hyps = self.hyps.get(sent, [])
        if sent not in self.first and (at_limit or (best_is_eos and hyps)):
            # Constrained at the length limit: one that met every constraint, if any did.
            self.first[sent] = max(hyps, key=lambda h: (h.unmet == 0, h.score))
        return at_limit or (best_is_eos and len(hyps) >= self.n_best)

    def pop(self, sent: int) -> list[Hypothesis]:
        """A done sentence's n-best list, forgotten here: the 1-best answer, then the other
        hypotheses by score. A longer search for more hypotheses may find one scoring above
        the 1-best; it still comes second, so that the first line of an n-best list is always
        what a 1-best translation gives."""
        hyps, first = self.hyps.pop(sent), self.first.pop(sent)
        rest = [h for h in hyps if h is not first]
        rest.sort(key=lambda h: (h.unmet > 0, -h.score))  # constraints met first
        return [first, *rest][: self.n_best]
