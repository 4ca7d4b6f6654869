"""Translate lists of sentences with a trained model: search_lines (batched by length, on
workers) and LinePool (lines that join and leave a running search: the server's)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from attnmt.data.batches import pad_sequences, sorted_batches
from attnmt.data.search_workers import map_batches
from attnmt.data.tokenizer import PAD_ID, Tokenizer
from attnmt.decoding.batch import decode, new_pool
from attnmt.decoding.constraints import Phrases
from attnmt.decoding.search import (
    Hypothesis,
    Sampling,
    SearchOptions,
    forced_tokens,
)
from attnmt.decoding.shortlist import Shortlist, restricted
from attnmt.decoding.sources import needed_tokens, prepare_sources, unmet_warning
from attnmt.decoding.translation import Translation
from attnmt.kernels import matmul_backend
from attnmt.kernels.matmul import active_backend
from attnmt.models.seq2seq import Seq2Seq


def search_lines(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    options: SearchOptions,
    *,
    batch_tokens: int,
    batch_sentences: int | None = None,
    device: torch.device | str = "cpu",
    workers: int = 1,
    first_line: int = 0,
    matmul: str | None = None,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    shortlist: Shortlist | None = None,
) -> list[list[Translation]]:
    """Translate each line: options.n_best translations per input, in input order.

    Sentences are batched by length (longest first, at most batch_tokens source tokens and
    batch_sentences sentences per batch) and put back in order; an empty or whitespace-only
    line gives empty translations without touching the model. Each batch is decoded by
    search.decode with options.method (greedy, beam or sampling).

    workers > 1 searches that many batches at once, sharing the intra-op threads (see
    search_workers.map_batches); the results do not depend on it. `matmul`: the CPU fp32 matmul
    backend (blas or onednn) to search with; None: the one in use here (kernels.matmul_backend).
    `source_prefix`: ids before every source (a multilingual model's target-language tag), shown as
    source pieces. `target_prefix`: per line, the target ids its translations start with.
    `constraints`: per line, target phrases (ids) its translations must contain (beam search);
    a line whose best translation lacks one (the length limit came first) is named on stderr.
    `shortlist`: each batch outputs only its lexical shortlist's pieces (the model's output
    projections wrapped by decoding.shortlist.attach).
    """
    was_training = model.training
    model.eval()
    outputs = [[Translation("", 0.0, [], [], None) for _ in range(options.n_best)] for _ in lines]
    todo = [i for i, line in enumerate(lines) if line.strip()]
    src, starts, warned = prepare_sources(
        tokenizer, lines, todo, source_prefix, target_prefix, options
    )
    batches = list(sorted_batches([len(s) for s in src], batch_tokens, batch_sentences))
    phrases = None if constraints is None else [[list(p) for p in constraints[i]] for i in todo]
    inner = None if constraints is None else torch.tensor(tokenizer.tgt.word_inner)
    job = _SearchJob(
        model, src, options, device, first_line, matmul or active_backend(), starts, phrases,
        inner, shortlist,
    )  # fmt: skip
    kept = (model,) if shortlist is None else (model, shortlist)
    version = _version(model) if workers > 1 else None  # the kept workers' (map_batches)
    results = map_batches(job, batches, workers, device, kept, version)
    for batch, found in zip(batches, results, strict=True):
        for j, hyps in zip(batch, found, strict=True):
            unmet_warning(hyps[0], phrases[j] if phrases else [], warned[j])
            outputs[todo[j]] = translations(tokenizer, src[j], hyps, warned[j])
    for j, said in enumerate(warned):  # the CLI's and the API's stderr, in input order
        for warning in said:
            print(
                f"attnmt: warning: input line {first_line + todo[j] + 1}: {warning}",
                file=sys.stderr,
            )
    model.train(was_training)
    return outputs


def _version(model: Seq2Seq) -> tuple[tuple[int, int], ...]:
    """Where each parameter and buffer lives and how often it was changed in place (an int8
    GRU's packed cells, which are not tensors: which object): workers that kept a copy of the
    model from an earlier call may search with it while it is equal."""
    return tuple(
        (t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else (id(t), 0)
        for t in model.state_dict(keep_vars=True).values()
    )


def translations(
    tokenizer: Tokenizer, src: list[int], hyps: list[Hypothesis], warnings: list[str]
) -> list[Translation]:
    """A source's hypotheses (src: its ids, EOS included) as text, pieces and attention, with
    what its search left out."""
    src_pieces = tokenizer.src.pieces(src)
    return [
        Translation(
            tokenizer.tgt.decode(h.tokens),
            h.score,
            src_pieces,
            tokenizer.tgt.pieces(h.tokens) + (["</s>"] if h.ended else []),
            None if h.attention is None else h.attention[:, : len(src_pieces)].cpu(),
            h.unmet,
            warnings=warnings,
        )
        for h in hyps
    ]


class LinePool:
    """Lines searched together as they come (serve's step-level batching): lines join the
    running search (add) and leave it as each is done (step returns them). One pool searches
    one kind of line: one SearchOptions (greedy or beam), one source prefix, constrained
    or not; what differs per line (the prefix its output starts with, its phrases) is the
    line's own. With a shortlist, the pool outputs its lines' shortlists' union, chosen again
    when lines join or leave (the batch path does the same per batch)."""

    def __init__(
        self,
        model: Seq2Seq,
        tokenizer: Tokenizer,
        options: SearchOptions,
        *,
        device: torch.device,
        matmul: str,
        source_prefix: Sequence[int] = (),
        constrained: bool = False,
        shortlist: Shortlist | None = None,
        before_step: Callable[[], None] = lambda: None,
    ) -> None:
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.device, self.matmul = device, matmul
        self.source_prefix = tuple(source_prefix)
        self.shortlist, self.before_step = shortlist, before_step
        self.pool = new_pool(model, options, constrained)
        self.inner = torch.tensor(tokenizer.tgt.word_inner) if constrained else None
        self.src: dict[int, list[int]] = {}  # a searching line's pool id: its source ids
        self.phrases: dict[int, list[list[int]]] = {}  # ... the phrases it must hold
        self.allowed: dict[int, torch.Tensor] = {}  # ... its shortlist (and prefix, phrases)
        self.rows: torch.Tensor | None = None  # the shortlists' union in use
        self.warned: dict[int, list[str]] = {}  # ... what its search left out so far
        self.ready: dict[int, list[Translation]] = {}  # empty lines: answered at the next step
        self.next_empty = -1  # their keys: negative, apart from the pool's ids

    def __len__(self) -> int:
        """Lines still searching (or answered at the next step)."""
        return len(self.pool) + len(self.ready)

    def add(
        self,
        lines: Sequence[str],
        target_prefix: Sequence[Sequence[int]] | None = None,
        phrases: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> list[int]:
        """Encode lines (per line: the ids its output starts with, the phrases it holds) and
        add them; returns each line's key (step's)."""
        keys = [0] * len(lines)
        todo = []
        for i, line in enumerate(lines):
            if line.strip():
                todo.append(i)
                continue
            keys[i], self.next_empty = self.next_empty, self.next_empty - 1
            empty = Translation("", 0.0, [], [], None)
            self.ready[keys[i]] = [empty for _ in range(self.options.n_best)]
        if not todo:
            return keys
        src, starts, warned = prepare_sources(
            self.tokenizer, lines, todo, self.source_prefix, target_prefix, self.options
        )
        tokens = pad_sequences(src, PAD_ID).to(self.device)  # (B, S)
        forced = forced_tokens(starts, len(todo), self.device)
        extra = ()
        if self.inner is not None:
            extra = (Phrases([phrases[i] if phrases else [] for i in todo], self.inner),)
        with torch.inference_mode(), matmul_backend(self.matmul):
            ids = self.pool.add(tokens, tokens == PAD_ID, forced, *extra)
        for j, (i, key) in enumerate(zip(todo, ids, strict=True)):
            keys[i] = key
            self.src[key], self.warned[key] = src[j], warned[j]
            self.phrases[key] = list(phrases[i]) if phrases else []
            if self.shortlist is not None:
                needed = needed_tokens([starts[j]] if starts else [], [self.phrases[key]])
                self.allowed[key] = self.shortlist.allowed(tokens[j : j + 1], needed)
        self.rows = None
        return keys

    def step(self) -> dict[int, list[Translation]]:
        """One step of every searching line; returns the lines that are done, by key."""
        done, self.ready = self.ready, {}
        if not len(self.pool):
            return done
        self.before_step()
        if self.shortlist is not None and self.rows is None:
            self.rows = torch.unique(torch.cat(list(self.allowed.values())))
        rows = self.rows
        with torch.inference_mode(), matmul_backend(self.matmul), restricted(self.model, rows):
            found = self.pool.step()
        for key, hyps in found.items():
            hyps, warned = _as_list(hyps), self.warned.pop(key)
            unmet_warning(hyps[0], self.phrases.pop(key), warned)
            done[key] = translations(self.tokenizer, self.src.pop(key), hyps, warned)
            if self.allowed.pop(key, None) is not None:
                self.rows = None  # its shortlist leaves with it
        return done


def _as_list(hyps: Hypothesis | list[Hypothesis]) -> list[Hypothesis]:
    """A greedy pool's hypothesis, or a beam pool's n-best list, as a list."""
    return hyps if isinstance(hyps, list) else [hyps]


SEED_MASK = 2**63 - 1  # torch generators take seeds below 2 ** 64


@dataclass(frozen=True)
class _SearchJob:
    """What searching a batch needs besides the batch: a batch is a list of indices into src."""

    model: Seq2Seq
    src: list[list[int]]  # source ids, EOS included
    options: SearchOptions
    device: torch.device | str
    first_line: int  # lines of the input before these (a chunk's offset): sampling seeds
    matmul: str  # the CPU fp32 matmul backend, set in whichever thread searches
    target_prefix: list[list[int]] | None = None  # per source: the ids its output starts with
    constraints: list[list[list[int]]] | None = None  # per source: phrases its output holds
    word_inner: torch.Tensor | None = None  # (V,) bool: target pieces inside a word
    shortlist: Shortlist | None = None  # restrict each batch's output to its shortlist

    @torch.inference_mode()  # per thread, like grad mode: set in the thread that searches
    def __call__(self, batch: list[int]) -> list[list[Hypothesis]]:
        tokens = pad_sequences([self.src[j] for j in batch], PAD_ID).to(self.device)  # (B, S)
        pad_mask = tokens == PAD_ID  # (B, S)
        options, method = self.options, self.options.method
        if isinstance(method, Sampling):  # a seed per batch, from its first line's place in
            # the input: the draws depend on neither --workers nor how the input was chunked
            seed = hash((method.seed, self.first_line + batch[0])) & SEED_MASK
            options = replace(options, method=replace(method, seed=seed))
        starts = None if self.target_prefix is None else [self.target_prefix[j] for j in batch]
        phrases = None
        if self.constraints is not None:
            phrases = Phrases([self.constraints[j] for j in batch], self.word_inner)
        rows = None
        if self.shortlist is not None:  # what the prefix and constraints need, too
            needed = needed_tokens(starts or [], phrases.phrases if phrases is not None else [])
            rows = self.shortlist.allowed(tokens, needed)
        with matmul_backend(self.matmul), restricted(self.model, rows):
            return decode(self.model, tokens, pad_mask, options, starts, phrases)


def translate_lines(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    options: SearchOptions,
    *,
    batch_tokens: int,
    device: torch.device | str = "cpu",
    workers: int = 1,
    source_prefix: Sequence[int] = (),
) -> list[str]:
    """The best translation of each line as text; exactly one output per input, in order."""
    assert options.n_best == 1, "translate_lines gives one translation per line"
    n1 = replace(options, attention=None, scores=False)
    found = search_lines(
        model, tokenizer, lines, n1, batch_tokens=batch_tokens, device=device, workers=workers,
        source_prefix=source_prefix,
    )  # fmt: skip
    return [t[0].text for t in found]
