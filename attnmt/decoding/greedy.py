"""Greedy search (and ancestral sampling, which is greedy search with a draw for the argmax)
as a pool of sentences that may join and leave at every step.

`greedy_search` puts one batch into a pool and steps it until every sentence has finished:
the batch path. `attnmt serve` keeps one pool running and adds the sentences of requests as
they arrive (step-level batching): a sentence's output does not depend on when it joined,
since rows never mix (each row has its own position, its own output limit and prefix).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnmt.decoding.search import (
    Hypothesis,
    Sampling,
    SearchOptions,
    append_attention,
    encode_joining,
    forced_at,
    join_forced,
    max_output_lengths,
    never_output,
    pick_output,
)
from attnmt.kernels import argmax_rows
from attnmt.models.rows import kept_order
from attnmt.models.seq2seq import Seq2Seq

# Finished sentences leave the batch once this share of its rows has finished (1/8):
# gathering the memory and caches after every step where one sentence ends costs more than
# decoding a few finished rows along.
COMPACT_SHARE = 8


class GreedyPool:
    """Sentences decoded greedily together, each from the step it joined (add) to its end.

    Each row is one sentence: its tokens so far (the last `steps[r]` columns of `tokens`),
    summed log-probability, output limit and prefix. A finished sentence is answered at once
    (step returns it); its row stays, decoded and ignored, until COMPACT_SHARE of the rows
    have finished, which changes nothing in the others: rows never mix.
    """

    def __init__(
        self,
        model: Seq2Seq,
        options: SearchOptions,
        pick: Callable[[torch.Tensor], torch.Tensor] = argmax_rows,
    ) -> None:
        self.model, self.options, self.pick = model, options, pick
        self.banned = never_output(model, options)
        self.memory = self.state = None
        self.ids: list[int] = []  # each row's sentence id
        self.next_id = 0
        self.live = torch.zeros(0, dtype=torch.bool)  # (N,) rows still decoding

    def __len__(self) -> int:
        """Sentences still decoding."""
        return int(self.live.sum())

    def add(
        self, src: torch.Tensor, src_pad_mask: torch.Tensor, forced: torch.Tensor | None = None
    ) -> list[int]:
        """Encode a batch (src (B, S), src_pad_mask (B, S), prefixes (B, P) or None) and add
        its sentences; returns their ids (step's keys)."""
        B, device, model = src.size(0), src.device, self.model
        memory = encode_joining(model, src, src_pad_mask)
        new = {
            "state": model.init_state(memory),
            "prev": torch.full((B,), model.bos_id, dtype=torch.long, device=device),
            "live": torch.ones(B, dtype=torch.bool, device=device),
            "steps": torch.zeros(B, dtype=torch.long, device=device),
            "limits": max_output_lengths(src_pad_mask, self.options),
            "total": torch.zeros(B, device=device),
            "tokens": torch.zeros(B, 0, dtype=torch.long, device=device),
            "forced": forced,
        }
        ids = list(range(self.next_id, self.next_id + B))
        self.next_id += B
        if self.memory is None:
            self.memory, self.ids, self.attn = memory, list(ids), None
            for name, value in new.items():
                setattr(self, name, value)
            return ids
        self._compact()
        self.memory = model.join_memory(self.memory, memory)
        self.state = model.join_state(self.state, new["state"])
        for name in ("prev", "live", "steps", "limits", "total"):
            setattr(self, name, torch.cat([getattr(self, name), new[name]]))
        T = self.tokens.size(1)  # a newcomer's tokens are the last steps[r] columns
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(B, T)])
        if self.attn is not None:  # (N, T, S)
            self.attn = torch.cat([self.attn, self.attn.new_zeros(B, T, self.attn.size(2))])
        self.forced = join_forced(self.forced, forced, len(self.ids), B, device)
        self.ids += ids
        return ids

    @torch.no_grad()
    def step(self) -> dict[int, Hypothesis]:
        """Decode one position of every row; returns the sentences that finished, by id."""
        model, options = self.model, self.options
        logits, self.state, attn = model.decode_step(
            self.memory, self.state, self.prev, options.attention
        )  # (N, V)
        nxt = pick_output(logits, self.pick, self.banned)  # (N,)
        if (want := forced_at(self.forced, self.steps)) is not None:  # a prefix's token
            nxt = torch.where(want >= 0, want, nxt)
        if options.scores:
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, nxt[:, None])  # (N, 1)
            self.total += logp.squeeze(1).masked_fill(~self.live, 0.0)
        self.tokens = torch.cat(
            [self.tokens, nxt.masked_fill(~self.live, model.pad_id)[:, None]], dim=1
        )
        if attn is not None:
            self.attn = append_attention(self.attn, attn.masked_fill(~self.live.unsqueeze(1), 0))
        self.steps += 1
        ends = self.live & ((nxt == model.eos_id) | (self.limits <= self.steps))  # (N,)
        rows = ends.nonzero().squeeze(1)  # (n,)
        done = self._hypotheses(rows) if rows.numel() else {}
        self.live &= ~ends
        self.prev = nxt
        n_live = int(self.live.sum())
        if n_live == 0:
            self.memory = self.state = None
            self.live = self.live[:0]
        elif self.live.numel() - n_live >= max(1, self.live.numel() // COMPACT_SHARE):
            self._compact()
        return done

    def _hypotheses(self, rows: torch.Tensor) -> dict[int, Hypothesis]:
        """The sentences of `rows` (n,) as they stand, by id: each its own steps, EOS (if it
        ended so) cut off; one read of the tensors for all of them."""
        T = self.tokens.size(1)
        tokens, steps = self.tokens[rows].tolist(), self.steps[rows].tolist()
        scores = self.total[rows].tolist() if self.options.scores else [float("nan")] * len(steps)
        out = {}
        for i, (r, n) in enumerate(zip(rows.tolist(), steps, strict=True)):
            own = tokens[i][T - n :]
            ended = own[-1] == self.model.eos_id
            a = None if self.attn is None else self.attn[r, self.attn.size(1) - n :]  # (n, S)
            out[self.ids[r]] = Hypothesis(own[:-1] if ended else own, scores[i], ended, a)
        return out

    def _compact(self) -> None:
        """Drop the rows of finished sentences."""
        if bool(self.live.all()):
            return
        # The last live rows take the finished rows' places: only they are copied.
        keep = kept_order(self.live)  # (N',)
        self.memory, self.state = self.model.keep_rows(self.memory, self.state, keep)
        self.ids = [self.ids[r] for r in keep.tolist()]
        for name in ("prev", "live", "steps", "limits", "total", "tokens", "attn", "forced"):
            if (value := getattr(self, name)) is not None:
                setattr(self, name, value[keep])
        # Columns no row has any more: a newcomer's left padding, once its elders left.
        cut = self.tokens.size(1) - int(self.steps.max())
        if cut > 0:
            self.tokens = self.tokens[:, cut:]
            self.attn = None if self.attn is None else self.attn[:, cut:]


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

    Args:
        src: (B, S) source ids; src_pad_mask: (B, S) bool, True at padding.
        options: the output limit; `attention` returns each hypothesis's source attention per
            step (slower); without `scores` the scores are NaN (no log-softmax per step).
        forced: (B, P) prefix tokens, -1 after a sentence's prefix (search.forced_tokens).
    Returns:
        One hypothesis per sentence; score = summed log-probability.
    """
    pool = GreedyPool(model, options, pick)
    ids = pool.add(src, src_pad_mask, forced)
    found: dict[int, Hypothesis] = {}
    while len(pool):
        found.update(pool.step())
    return [found[i] for i in ids]


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
