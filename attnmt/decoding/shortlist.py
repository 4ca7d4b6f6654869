"""Lexical shortlists (`attnmt shortlist`, `translate --shortlist on`): the output layer and its
softmax computed only over the target pieces likely for a batch's source pieces, as Marian's
`--shortlist` does for Firefox's translation models (Bogoychev et al. 2020; Junczys-Dowmunt et
al. 2018, "Marian: Cost-effective high-quality neural machine translation in C++").

Built from parallel text (the model's training data, or the distilled data a student learned
from) by IBM Model 1 (Brown et al. 1993), the lexical translation table fast_align also starts
from, estimated by EM over subword pieces:

    t(f | e) ∝ Σ_pairs Σ_j Σ_i  t(f_j | e_i) / Σ_i' t(f_j | e_i')   [f_j = f, e_i = e]

with a NULL source piece for target pieces that translate nothing. Co-occurrence counts alone
rank every frequent target piece first for every source piece; IBM 1 explains each target
piece by the source pieces that predict it best, so a source piece's list holds its
translations. The shortlist keeps, per source piece, its K most likely target pieces, plus the
N most frequent target pieces (function words, punctuation) for every sentence.

At decode time a batch may output the union of its source pieces' lists, the frequent pieces,
EOS and UNK, and whatever its prefix and constraints need; the output projection runs over
those rows only, and every other piece gets log-probability −inf (so the search and its
scores are those of a softmax over the subset).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from attnmt.data.files import atomic_write
from attnmt.data.tokenizer import EOS_ID, UNK_ID, Tokenizer
from attnmt.errors import AttnmtError, CheckpointError
from attnmt.kernels.int8 import Int8Linear

SHORTLIST_FILE = "shortlist.safetensors"
CHUNK_PAIRS = 20_000  # pairs whose links are built at once (the EM rounds visit every chunk)


@dataclass(frozen=True)
class Shortlist:
    """table (V_src, K): each source piece's K most likely target pieces (-1 pads a piece seen
    with fewer); frequent (N,): the target pieces every sentence may use."""

    table: torch.Tensor
    frequent: torch.Tensor
    pairs: int  # the sentence pairs it was estimated from

    def allowed(self, src: torch.Tensor, extra: Iterable[int] = ()) -> torch.Tensor:
        """The sorted target ids a batch of source ids (B, S) may output: (V',) long."""
        ids = self.table.to(src.device)[src.flatten()]  # (B*S, K)
        more = torch.tensor([EOS_ID, UNK_ID, *extra], dtype=torch.long, device=src.device)
        union = torch.cat([ids.flatten(), self.frequent.to(src.device), more])
        return torch.unique(union[union >= 0])  # sorted

    def save(self, path: Path) -> None:
        meta = {"k": self.table.size(1), "frequent": self.frequent.numel(), "pairs": self.pairs}
        tensors = {"table": self.table.int().contiguous(), "frequent": self.frequent.int()}
        atomic_write(
            path,
            lambda tmp: save_file(tensors, str(tmp), metadata={"attnmt": json.dumps(meta)}),
        )

    @classmethod
    def load(cls, path: Path, src_vocab: int, tgt_vocab: int) -> Shortlist:
        """Read a shortlist, checked against the model's vocabulary sizes."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {}).get("attnmt", "{}"))
                table, frequent = f.get_tensor("table").long(), f.get_tensor("frequent").long()
        except (SafetensorError, OSError, ValueError, KeyError, RecursionError) as e:
            raise CheckpointError(f"{path}: not a shortlist ({str(e)[:200]})") from None
        if not isinstance(meta, dict) or type(meta.get("pairs", 0)) is not int:
            raise CheckpointError(f"{path}: not a shortlist (its metadata is not attnmt's)")
        ok = table.dim() == 2 and table.size(0) == src_vocab and frequent.dim() == 1
        ids = torch.cat([table.flatten(), frequent]) if ok else torch.tensor([])
        if not ok or (ids.numel() and not -1 <= int(ids.min()) <= int(ids.max()) < tgt_vocab):
            raise CheckpointError(
                f"{path}: made for another vocabulary (rebuild it: attnmt shortlist)"
            )
        return cls(table, frequent, meta.get("pairs", 0))


def build_shortlist(
    pairs: Sequence[tuple[list[int], list[int]]],
    src_vocab: int,
    tgt_vocab: int,
    k: int = 50,
    frequent: int = 100,
    iterations: int = 5,
) -> Shortlist:
    """A shortlist from pairs of (source ids, target ids) without EOS: IBM Model 1's t(f | e),
    `iterations` rounds of EM from uniform, each source piece's k best target pieces, and the
    `frequent` commonest target pieces."""
    NULL = src_vocab  # the NULL source piece
    counts = torch.bincount(torch.tensor([f for _, tgt in pairs for f in tgt]), minlength=tgt_vocab)

    def chunks() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in range(0, len(pairs), CHUNK_PAIRS):  # built twice rather than held at once
            yield _links(pairs[i : i + CHUNK_PAIRS], NULL)

    keys = torch.unique(torch.cat([torch.unique(e * tgt_vocab + f) for e, f, _ in chunks()]))
    # Each link kept as (its key's index, its target position): int32, 8 bytes a link.
    links = [(torch.searchsorted(keys, e * tgt_vocab + f).int(), g.int()) for e, f, g in chunks()]
    prob = torch.ones(keys.numel(), dtype=torch.float64)  # uniform start: t(f | e) = 1
    source = keys // tgt_vocab  # (L,): each key's e
    for _ in range(iterations):
        expected = torch.zeros_like(prob)
        for at, group in links:
            t = prob[at]  # t(f_j | e_i) for every link
            z = torch.zeros(int(group.max()) + 1, dtype=prob.dtype).index_add_(0, group, t)
            expected.index_add_(0, at, t / z[group])
        per_source = torch.zeros(src_vocab + 1, dtype=prob.dtype).index_add_(0, source, expected)
        prob = expected / per_source[source]
    table = _top_k(keys, prob, src_vocab, tgt_vocab, min(k, tgt_vocab))
    return Shortlist(table, counts.topk(min(frequent, tgt_vocab)).indices, len(pairs))


def _links(
    chunk: Sequence[tuple[list[int], list[int]]], null: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (source piece e_i, target piece f_j) of each pair, NULL included, and the target
    position each belongs to (its normaliser's group): three (L,) long tensors."""
    es, fs, groups = [], [], []
    group = 0
    for src, tgt in chunk:
        e = torch.tensor([*src, null], dtype=torch.long)
        f = torch.tensor(tgt, dtype=torch.long)
        es.append(e.repeat(len(tgt)))  # (T * (S+1),): e_0..e_S for f_0, then for f_1, ...
        fs.append(f.repeat_interleave(len(e)))
        groups.append(torch.arange(group, group + len(tgt)).repeat_interleave(len(e)))
        group += len(tgt)
    return torch.cat(es), torch.cat(fs), torch.cat(groups)


def _top_k(keys: torch.Tensor, prob: torch.Tensor, V_src: int, V_tgt: int, k: int) -> torch.Tensor:
    """(V_src, k): each source piece's k target pieces of highest t(f | e), -1 where it has
    fewer (sorted, never a dense V_src x V_tgt table)."""
    order = torch.argsort(prob, descending=True)
    order = order[torch.argsort(keys[order] // V_tgt, stable=True)]  # by e, then t(f|e) desc
    e, f = keys[order] // V_tgt, keys[order] % V_tgt
    starts = torch.searchsorted(e, e, right=False)  # where each e's run begins
    rank = torch.arange(e.numel()) - starts
    keep = (rank < k) & (e < V_src)  # NULL's row is not kept
    table = torch.full((V_src, k), -1, dtype=torch.long)
    table[e[keep], rank[keep]] = f[keep]
    return table


def load_shortlist(model_dir: Path, tokenizer: Tokenizer) -> Shortlist:
    """The model directory's shortlist, or one line saying how to make it."""
    path = model_dir / SHORTLIST_FILE
    if not path.is_file():
        raise AttnmtError(
            f"{model_dir} has no shortlist: make it with `attnmt shortlist -m {model_dir}`"
        )
    return Shortlist.load(path, len(tokenizer.src), len(tokenizer.tgt))


def shortlist_from_text(
    tokenizer: Tokenizer, src: Sequence[str], tgt: Sequence[str], k: int, frequent: int
) -> Shortlist:
    """build_shortlist over parallel lines, cut into pieces by the model's tokenizer."""
    pairs = [
        (s, t)
        for s, t in zip(
            tokenizer.src.encode(list(src)), tokenizer.tgt.encode(list(tgt)), strict=True
        )
        if s and t
    ]
    if not pairs:
        raise AttnmtError("no sentence pairs to build a shortlist from")
    return build_shortlist(pairs, len(tokenizer.src), len(tokenizer.tgt), k, frequent)


class ShortlistOutput(nn.Module):
    """A model's output projection (nn.Linear or kernels.Int8Linear) that, while a thread has
    set rows (`use`), computes only those rows' logits and gives the others −inf."""

    def __init__(self, output: nn.Module, vocab: int) -> None:
        super().__init__()
        self.full = output
        self.vocab = vocab
        self._local = threading.local()  # per search thread (--workers): rows, projection

    def use(self, rows: torch.Tensor | None) -> None:
        """The target ids (V',) this thread's next steps may output; None: all. The same
        `rows` tensor as the last one this thread used reuses its projection (a server's
        pool sets its rows at every step and changes them only as lines join or leave)."""
        last = getattr(self._local, "last", None)
        if rows is None:
            self._local.part = None
        elif last is not None and last[0] is rows:
            self._local.part = last
        elif isinstance(self.full, Int8Linear):
            self._local.part = self._local.last = (rows, self.full.rows(rows))
        else:
            bias = None if self.full.bias is None else self.full.bias.index_select(0, rows)
            # Columns of Wᵀ: column-major rows, as the full weight's (column_major_weights).
            projection = (self.full.weight.t().index_select(1, rows).t(), bias)  # (V', d)
            self._local.part = self._local.last = (rows, projection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> logits (..., V), −inf outside the rows in use."""
        part = getattr(self._local, "part", None)
        if part is None:
            return self.full(x)
        rows, projection = part
        sub = (
            projection(x)
            if isinstance(projection, nn.Module)
            else nn.functional.linear(x, *projection)
        )
        logits = sub.new_full((*sub.shape[:-1], self.vocab), -torch.inf)
        return logits.index_copy_(-1, rows, sub)  # (..., V)


def attach(model: nn.Module, vocab: int) -> None:
    """Wrap the output projection of the model (of each model of an ensemble), nn.Linear or
    Int8Linear, in a ShortlistOutput over `vocab` target pieces."""
    for module in list(model.modules()):
        output = module._modules.get("output")
        if isinstance(output, (nn.Linear, Int8Linear)):
            module.output = ShortlistOutput(output, vocab)


@contextmanager
def restricted(model: nn.Module, rows: torch.Tensor | None) -> Iterator[None]:
    """Within the block, this thread's steps of `model` output only `rows` (None: all)."""
    outputs = (
        [m for m in model.modules() if isinstance(m, ShortlistOutput)] if rows is not None else []
    )
    for output in outputs:
        output.use(rows)
    try:
        yield
    finally:
        for output in outputs:
            output.use(None)
