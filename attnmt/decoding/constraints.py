"""Lexically constrained beam search: dynamic beam allocation (Post & Vilar 2018,
https://aclanthology.org/N18-1119), vectorized over sentences and beams as Hu et al. 2019
(https://aclanthology.org/N19-1090) do it.

Each sentence has phrases (lists of target ids) that its output must contain. Every beam row
tracks which phrases it has met and how far it is into the one it is in the middle of; its
*bank* is the number of constraint tokens it has met so far. At each step the candidates are
the usual 2K best extensions, plus each row's best token and its next constraint tokens (the
next token of the phrase it is in, or the first token of every phrase it has not met). The K
beam slots are dealt out round-robin over the banks, the bank with most met first and each
bank's candidates best first (Hu et al.'s rank trick: one sort, no loop per hypothesis), so a
hypothesis that has met more constraints stays even when it scores lower, and the slots of an
empty bank go to the others. A hypothesis may end (EOS) only once it has met every phrase.

With subwords, a phrase's last piece could be followed by more of the same word ("Haus" made
"Hauses"): given the pieces that continue a word (`inner`), a phrase counts as met only once the
token after it is not one of them (a new word, punctuation, EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnmt.kernels import topk_rows


@dataclass(frozen=True)
class Phrases:
    """What a batch's outputs must contain: per sentence, phrases of target ids; `inner`, if
    given, (V,) bool, the pieces that continue the word before them (see the module's docstring)."""

    phrases: Sequence[Sequence[Sequence[int]]]
    inner: torch.Tensor | None = None


@dataclass
class Candidates:
    """One step's candidates of every active sentence, best score first: (n, M) each."""

    scores: torch.Tensor  # summed log-probabilities after the token
    beams: torch.Tensor  # the beam (0..K-1) each extends
    tokens: torch.Tensor
    key: torch.Tensor  # the allocation order: the K smallest keys take the beam's slots
    full: torch.Tensor  # bool: every phrase met after this token
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (cur, pos, met), n * M rows


class Constraints:
    """The phrases of a batch's sentences and every beam row's progress through them.

    Rows are sentence-major (row = sentence * K + beam), as in beam_search; `sent` holds each
    row's sentence (its index in the batch), so sentences can leave the batch (keep)."""

    def __init__(self, phrases: Phrases, K: int, device: torch.device):
        inner, phrases = phrases.inner, phrases.phrases
        B = len(phrases)
        C = max(1, max(map(len, phrases)))
        L = max([1, *(len(p) for line in phrases for p in line)])
        self.ids = torch.full((B, C, L), -1, dtype=torch.long)  # (B, C, L) phrase tokens
        self.lens = torch.zeros(B, C, dtype=torch.long)  # (B, C); 0: no such phrase
        for b, line in enumerate(phrases):
            for c, p in enumerate(line):
                self.ids[b, c, : len(p)] = torch.tensor(list(p), dtype=torch.long)
                self.lens[b, c] = len(p)
        self.ids, self.lens = self.ids.to(device), self.lens.to(device)
        self.inner = None if inner is None else inner.to(device)  # (V,) bool
        self.banks = 2 * int(self.lens.sum(1).max()) + 1  # 0 .. all, in half tokens
        self.sent = torch.arange(B, device=device).repeat_interleave(K)  # (R,)
        self.met = (self.lens == 0).repeat_interleave(K, 0)  # (R, C); absent phrases: met
        self.cur = torch.full((B * K,), -1, dtype=torch.long, device=device)  # phrase in progress
        self.pos = torch.zeros(B * K, dtype=torch.long, device=device)  # its tokens matched
        # A row whose phrase's tokens are all there (pos == its length) waits for a boundary.

    def unmet(self) -> torch.Tensor:
        """(R,) the number of phrases each row has not met."""
        return (~self.met).sum(1)

    def forbid_eos(self, logp: torch.Tensor, eos_id: int) -> None:
        """In place on (R, V) log-probs: rows that have not met every phrase cannot end (EOS
        after a phrase's last token is the boundary that meets it)."""
        lacking = (~self.met).sum(1) - self.waiting().long()  # (R,)
        logp[lacking > 0, eos_id] = -torch.inf

    def waiting(self) -> torch.Tensor:
        """(R,) bool: rows whose phrase has all its tokens and waits for a word boundary."""
        lens = self.lens[self.sent]  # (R, C)
        ar = torch.arange(self.cur.numel(), device=self.cur.device)
        return (self.cur >= 0) & (self.pos == lens[ar, self.cur.clamp(min=0)])

    def next_tokens(self) -> torch.Tensor:
        """(R, C): per row, the tokens that advance a constraint, -1 elsewhere: in a phrase,
        its next token (in that phrase's column); otherwise the first token of each unmet."""
        ids = self.ids[self.sent]  # (R, C, L)
        nxt = ids[:, :, 0].masked_fill(self.met, -1)  # (R, C)
        nxt[self.waiting()] = -1  # any boundary meets it (candidates adds the best one)
        rows = ((self.cur >= 0) & ~self.waiting()).nonzero().squeeze(1)  # (r,)
        if rows.numel():
            cur = self.cur[rows]
            cont = ids[rows, cur, self.pos[rows]]  # (r,)
            nxt[rows] = -1
            nxt[rows, cur] = cont
        return nxt

    def advance(
        self, rows: torch.Tensor, tok: torch.Tensor, eos_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The state (cur, pos, met) of each row of `rows` (N,) after token `tok` (N,): a
        phrase waiting for a boundary is met if tok is one (else abandoned); a phrase in
        progress goes on if tok is its next token, else it is abandoned (Post & Vilar: its
        tokens no longer count); tok may start an unmet phrase. A phrase whose last token this
        is waits for the next token's boundary (met at once without `inner`)."""
        cur, pos, met = self.cur[rows], self.pos[rows], self.met[rows].clone()
        ids, lens = self.ids[self.sent[rows]], self.lens[self.sent[rows]]  # (N, C, L), (N, C)
        ar = torch.arange(rows.numel(), device=rows.device)
        in_phrase = cur >= 0
        full = in_phrase & (pos == lens[ar, cur.clamp(min=0)])  # waiting for a boundary
        assert self.inner is not None or not full.any()
        if self.inner is not None:
            closes = full & (~self.inner[tok] | (tok == eos_id))
            met[ar[closes], cur[closes]] = True
        want = ids[ar, cur.clamp(min=0), pos.clamp(max=ids.size(2) - 1)]  # (N,)
        goes_on = in_phrase & ~full & (tok == want)
        starts = ~met & (ids[:, :, 0] == tok.unsqueeze(1))  # (N, C)
        starting = starts.any(1) & ~goes_on
        first = starts.long().argmax(1)  # (N,) the first phrase tok starts
        cur = torch.where(goes_on, cur, torch.where(starting, first, -1))
        pos = torch.where(goes_on, pos + 1, starting.long())
        if self.inner is None:  # no boundary to wait for: met with its last token
            done = (cur >= 0) & (pos == lens[ar, cur.clamp(min=0)])
            met[ar[done], cur[done]] = True
            cur, pos = cur.masked_fill(done, -1), pos.masked_fill(done, 0)
        return cur, pos, met

    def candidates(self, scores: torch.Tensor, logp: torch.Tensor, eos_id: int) -> Candidates:
        """The step's candidates from beam scores (n, K) and next-token log-probs (n*K, V),
        deduplicated, best first, with their allocation keys (see the module's docstring)."""
        n, K = scores.shape
        V, dev = logp.size(1), logp.device
        flat = scores.view(-1, 1)  # (n*K, 1)
        per_beam = min(2 * K, V)
        beam_lp, beam_tok = topk_rows(logp, per_beam)  # (n*K, P): the usual candidates, and
        nxt = self.next_tokens()  # (n*K, C)                      the constraints' tokens
        waiting = self.waiting().nonzero().squeeze(1)
        if waiting.numel() and self.inner is not None:  # and the best word boundary
            nxt[waiting, 0] = logp[waiting].masked_fill(self.inner, -torch.inf).argmax(1)
        nxt_s = (flat + logp.gather(1, nxt.clamp(min=0))).masked_fill(nxt < 0, -torch.inf)
        C = nxt.size(1)
        s = torch.cat([(flat + beam_lp).view(n, -1), nxt_s.view(n, -1)], 1)  # (n, M)
        t = torch.cat([beam_tok.view(n, -1), nxt.view(n, -1)], 1)
        ks = torch.arange(K, device=dev)
        b = torch.cat([ks.repeat_interleave(per_beam), ks.repeat_interleave(C)]).expand(n, -1)
        # The same (beam, token) twice would take two slots: the copies drop out.
        pair = b * V + t.clamp(min=0)  # (n, M)
        sorted_pair, order = pair.sort(1)
        dup = torch.zeros_like(s, dtype=torch.bool)
        dup.scatter_(1, order[:, 1:], sorted_pair[:, 1:] == sorted_pair[:, :-1])
        s = s.masked_fill(dup, -torch.inf)
        s, order = s.sort(1, descending=True)
        b, t = b.gather(1, order), t.gather(1, order)
        rows = (torch.arange(n, device=dev).unsqueeze(1) * K + b).view(-1)  # (n*M,)
        cur, pos, met = self.advance(rows, t.reshape(-1), eos_id)
        lens = self.lens[self.sent[rows]]  # (n*M, C)
        # Banks count half tokens: a phrase waiting for its boundary ranks below a met one.
        ar = torch.arange(rows.numel(), device=dev)
        waits = (cur >= 0) & (pos == lens[ar, cur.clamp(min=0)])
        bank = (2 * ((met * lens).sum(1) + pos) - waits.long()).view(n, -1)  # (n, M)
        valid = s > -torch.inf  # (n, M)
        # Rank within the bank, by score: the candidates are sorted, so a running count.
        in_bank = F.one_hot(bank, self.banks).bool() & valid.unsqueeze(2)  # (n, M, NB)
        rank = (in_bank.cumsum(1) * in_bank).sum(2) - 1  # (n, M)
        key = (rank * self.banks + (self.banks - 1 - bank)).masked_fill(~valid, 1 << 40)
        full = met.all(1).view(n, -1)
        return Candidates(s, b, t, key, full, (cur, pos, met))

    def step(
        self, scores: torch.Tensor, logp: torch.Tensor, eos_id: int, K: int
    ) -> tuple[torch.Tensor, ...]:
        """beam_search's choice under the constraints: the candidates' scores, beams and
        tokens (n, M) each, which finish, which K continue and whether the best candidate
        that met every phrase is EOS (see choose); `logp` (n*K, V) loses EOS where a row has
        not met its phrases."""
        self.forbid_eos(logp, eos_id)
        cands = self.candidates(scores, logp, eos_id)  # (n, M) each
        finish, pick, best_is_eos = self.choose(cands, eos_id, K)
        return cands.scores, cands.beams, cands.tokens, finish, pick, best_is_eos

    def choose(
        self, cands: Candidates, eos_id: int, K: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which candidates finish (EOS within the first K by key: (n, M) bool), which K
        continue ((n, K) indices, the K first by key that are not EOS), and for each sentence
        whether its best candidate among those that met every phrase is EOS ((n,) bool); the
        rows take the continuing candidates' states."""
        is_eos = cands.tokens == eos_id  # (n, M)
        position = cands.key.argsort(1).argsort(1)  # (n, M) place in the allocation order
        finish = is_eos & (position < K) & (cands.scores > -torch.inf)
        _, pick = cands.key.masked_fill(is_eos, 1 << 41).topk(K, dim=1, largest=False)
        first_full = cands.full.long().argmax(1, keepdim=True)  # (n, 1)
        best_is_eos = is_eos.gather(1, first_full).squeeze(1) & cands.full.any(1)
        n, M = cands.tokens.shape
        chosen = (torch.arange(n, device=pick.device).unsqueeze(1) * M + pick).view(-1)
        cur, pos, met = cands.state
        self.cur, self.pos, self.met = cur[chosen], pos[chosen], met[chosen]
        return finish, pick, best_is_eos

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (sentences left the batch)."""
        self.sent, self.cur, self.pos, self.met = (
            self.sent[rows],
            self.cur[rows],
            self.pos[rows],
            self.met[rows],
        )

    def join(self, other: Constraints) -> None:
        """Add another batch's sentences and rows after these (beam search's pool); the
        phrases of sentences that left are dropped."""
        used, self.sent = torch.unique(self.sent, return_inverse=True)  # sentences with rows
        ids, lens = self.ids[used], self.lens[used]  # (B, C, L), (B, C)
        C = max(ids.size(1), other.ids.size(1))
        L = max(ids.size(2), other.ids.size(2))
        self.ids = torch.cat(
            [F.pad(x, (0, L - x.size(2), 0, C - x.size(1)), value=-1) for x in (ids, other.ids)]
        )  # (B + B2, C, L)
        self.lens = torch.cat([F.pad(x, (0, C - x.size(1))) for x in (lens, other.lens)])
        self.banks = max(self.banks, other.banks)
        self.sent = torch.cat([self.sent, other.sent + used.numel()])  # (R + R2,)
        met = [F.pad(m, (0, C - m.size(1)), value=True) for m in (self.met, other.met)]
        self.met = torch.cat(met)  # (R + R2, C); absent phrases: met
        self.cur, self.pos = torch.cat([self.cur, other.cur]), torch.cat([self.pos, other.pos])
