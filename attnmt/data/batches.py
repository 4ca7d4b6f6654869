"""Batches: padding and collating token ids, bucketed shapes, length-bucketed token batching with a
resumable sampler, and a step's batches made ahead in a thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """A padded batch. tgt_in starts with BOS; tgt_out is the same tokens shifted, ending in EOS."""

    src: torch.Tensor  # (B, S) token ids, padded with pad_id
    src_pad_mask: torch.Tensor  # (B, S) bool, True at padding
    tgt_in: torch.Tensor  # (B, T)
    tgt_out: torch.Tensor  # (B, T)
    index: list[int]  # position of each row in the dataset
    pad_id: int = 0

    @property
    def n_tokens(self) -> int:
        """Real (non-pad) target tokens, EOS included."""
        return int((self.tgt_out != self.pad_id).sum())

    @property
    def n_src_tokens(self) -> int:
        """Real (non-pad) source tokens, EOS included."""
        return int((~self.src_pad_mask).sum())

    def pinned(self) -> Batch:
        """The batch in page-locked memory, which the GPU copies from while the host works."""
        return Batch(
            self.src.pin_memory(), self.src_pad_mask.pin_memory(), self.tgt_in.pin_memory(),
            self.tgt_out.pin_memory(), self.index, self.pad_id,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`; to a GPU from pinned memory, so the copies run beside the
        host's work instead of before it."""
        on_host = self.src.device.type == "cpu" and not self.src.is_pinned()
        pin = torch.device(device).type == "cuda" and on_host

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return Batch(
            move(self.src), move(self.src_pad_mask), move(self.tgt_in), move(self.tgt_out),
            self.index, self.pad_id,
        )  # fmt: skip


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Right-pad token id lists into a (B, max_len) long tensor (one NumPy scatter: a tensor
    per row cost milliseconds a batch at GPU batch sizes)."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))  # (B,)
    out = np.full((len(seqs), int(lengths.max())), pad_id, dtype=np.int64)  # (B, L)
    filled = np.arange(out.shape[1]) < lengths[:, None]  # (B, L), row-major as the ids
    out[filled] = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, int(lengths.sum()))
    return torch.from_numpy(out)


def collate(
    src: Sequence[Sequence[int]],
    tgt: Sequence[Sequence[int]],
    index: list[int],
    pad_id: int,
    bos_id: int,
    eos_id: int,
) -> Batch:
    """Build a Batch; sources get EOS appended, targets get BOS (input) and EOS (output)."""
    src_ids = pad_sequences([[*list(s), eos_id] for s in src], pad_id)  # (B, S)
    tgt_in = pad_sequences([[bos_id, *list(t)] for t in tgt], pad_id)  # (B, T)
    tgt_out = pad_sequences([[*list(t), eos_id] for t in tgt], pad_id)  # (B, T)
    return Batch(src_ids, src_ids == pad_id, tgt_in, tgt_out, index, pad_id)


def shape_bucket(n: int) -> int:
    """The smallest of 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four sizes an octave, each at
    most 25 % above the one before) that is at least n."""
    if n <= 8:
        return 8
    step = 1 << (n.bit_length() - 3)  # n in [4 * step, 8 * step): sizes step apart
    return -(-n // step) * step


def pad_to_bucket(batch: Batch, bos_id: int, eos_id: int) -> Batch:
    """The batch grown to shape_bucket of its rows and lengths, so that a run sees a few
    shapes (CUDA graphs are recorded per shape). Added rows are a source of EOS alone and a
    target of padding alone: the loss ignores them, and no row attends to them."""
    (B, S), T = batch.src.shape, batch.tgt_in.size(1)
    rows, S2, T2 = shape_bucket(B), shape_bucket(S), shape_bucket(T)

    def grow(x: torch.Tensor, length: int, first: int | None) -> torch.Tensor:
        out = x.new_full((rows, length), batch.pad_id)  # (rows, length)
        out[:B, : x.size(1)] = x
        if first is not None:
            out[B:, 0] = first  # the added rows: one real token, so attention has a key
        return out

    src = grow(batch.src, S2, eos_id)
    return Batch(
        src, src == batch.pad_id, grow(batch.tgt_in, T2, bos_id), grow(batch.tgt_out, T2, None),
        batch.index, batch.pad_id,
    )  # fmt: skip


class Prefetcher:
    """Makes a step's batches on the host (`make`: collate, pad, pin) in a background thread
    while the device computes the step before: `ahead(idxs)` starts them, `get(idxs)` returns
    them (made now when they were not asked for ahead). The main thread waits for the device
    at each step's end, and the thread works meanwhile; the batches are the same either way."""

    def __init__(self, make: Callable[[list[list[int]]], list[Batch]], enabled: bool) -> None:
        self.make = make
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="attnmt-prefetch") if enabled else None
        self.pending: tuple[list[list[int]], Future[list[Batch]]] | None = None

    def ahead(self, idxs: list[list[int]] | None) -> None:
        if self.pool is not None and idxs is not None:
            self.pending = (idxs, self.pool.submit(self.make, idxs))

    def get(self, idxs: list[list[int]]) -> list[Batch]:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == idxs:
            return pending[1].result()
        return self.make(idxs)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def token_batches(
    lengths: Sequence[int],
    batch_tokens: int,
    order: Sequence[int],
    max_sentences: int | None = None,
) -> list[list[int]]:
    """Cut `order` into consecutive batches whose padded size (rows × longest) fits batch_tokens
    (and, if given, at most max_sentences rows).

    A single sentence longer than batch_tokens still gets a batch of its own.
    """
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        full = max_sentences is not None and len(cur) >= max_sentences
        if cur and (full or max(longest, n) * (len(cur) + 1) > batch_tokens):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


class Ragged:
    """Lists of ints kept as one array cut into pieces: item i is values[starts[i]:ends[i]]
    (ends defaults to starts[1:]: consecutive pieces). An epoch's batches (10 M pairs take
    40 MB, not Python lists of ints) and a side of the encoded store (its tokens and offsets,
    memory-mapped) are both one."""

    def __init__(self, values: np.ndarray, starts: np.ndarray, ends: np.ndarray | None = None):
        self.values, self.starts = values, starts
        self.ends = starts[1:] if ends is None else ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> list[int]:
        return self.values[self.starts[i] : self.ends[i]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))

    def as_lists(self) -> list[list[int]]:
        return list(self)


def _cut_sorted(lengths: np.ndarray, batch_tokens: int, max_sentences: int | None) -> list[int]:
    """token_batches over lengths sorted ascending, vectorised: the longest of a batch is its
    last, so batch [i, i + k) fits while lengths[i + k - 1] * k <= batch_tokens, and that
    product only grows with k. Returns the batch sizes (each at least 1)."""
    sizes = []
    i, n = 0, len(lengths)
    cap = min(batch_tokens, max_sentences or batch_tokens)  # rows of length >= 1
    while i < n:
        window = lengths[i : i + cap].astype(np.int64)  # (w,)
        fits = window * np.arange(1, len(window) + 1) <= batch_tokens
        k = max(1, int(np.argmin(fits)) if not fits.all() else len(window))
        sizes.append(k)
        i += k
    return sizes


class BucketSampler:
    """Length-bucketed token batches, reshuffled each epoch from (seed, epoch) alone.

    A batch's size is its padded length times its rows, where a pair's length is the longer of
    its source and target (OpenNMT-py's definition of a token batch), and at most
    `max_sentences` rows when given. Each epoch: shuffle all indices, sort each chunk of
    `bucket_batches` batches' worth of pairs by (longer side, target), so neighbours have
    similar lengths on both sides and padding stays low, cut into batches, and shuffle the
    batch order. Because the order is a pure function of (seed, epoch), a run can be resumed
    at any batch of any epoch. Lengths are NumPy arrays and the work vectorised (no Python
    object per pair).

    Several corpora (`corpus_pairs`: how many pairs each has, stored one after the other) with
    `weights`: an epoch has as many pairs as all corpora together, corpus c's share of them
    w_c / Σw; a corpus with more than its share is subsampled, one with less repeated, each a
    fresh permutation per epoch (OpenNMT-py's corpus weights).
    """

    def __init__(
        self,
        src_lengths: Sequence[int] | np.ndarray,
        tgt_lengths: Sequence[int] | np.ndarray,
        batch_tokens: int,
        seed: int,
        bucket_batches: int = 100,
        max_sentences: int | None = None,
        corpus_pairs: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        tgt = np.asarray(tgt_lengths)
        longer = np.maximum(np.asarray(src_lengths), tgt)
        # Kept all run long: uint16 where lengths allow halves them (10 M pairs: 40 MB).
        dtype = np.uint16 if len(longer) and longer.max() < 1 << 16 else np.int32
        self.tgt_lengths, self.lengths = tgt.astype(dtype), longer.astype(dtype)
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.bucket_batches = bucket_batches
        self.max_sentences = max_sentences
        self.corpus_pairs = list(corpus_pairs or [len(self.lengths)])
        self.weights = list(weights or [1.0] * len(self.corpus_pairs))

    def shares(self) -> list[int]:
        """Pairs per epoch from each corpus."""
        n, total = sum(self.corpus_pairs), sum(self.weights)
        return [
            0 if size == 0 else max(1, round(n * w / total))
            for size, w in zip(self.corpus_pairs, self.weights, strict=True)
        ]

    def _pool(self, epoch: int) -> np.ndarray | None:
        """The pairs of an epoch with several corpora (None: every pair once)."""
        if len(self.corpus_pairs) == 1:
            return None
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) ^ 0x5EED5)
        parts, start = [], 0
        for size, want in zip(self.corpus_pairs, self.shares(), strict=True):
            perms = [
                torch.randperm(size, generator=g, dtype=torch.int32)
                for _ in range(-(-want // max(size, 1)))
            ]
            if perms:
                parts.append(torch.cat(perms)[:want].numpy() + np.int32(start))
            start += size
        return np.concatenate(parts)

    def epoch(self, epoch: int) -> Ragged:
        pool = self._pool(epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        n = len(self.lengths) if pool is None else len(pool)
        perm = torch.randperm(n, generator=g, dtype=torch.int32).numpy()  # same order as int64
        if pool is not None:
            perm = pool[perm]
        mean_len = max(1, int(self.lengths.sum(dtype=np.int64)) // max(1, n))
        per_batch = self.batch_tokens // mean_len
        if self.max_sentences is not None:
            per_batch = min(per_batch, self.max_sentences)
        chunk = max(1, self.bucket_batches * per_batch)
        sizes: list[int] = []
        for start in range(0, n, chunk):  # sorted in place: perm becomes the epoch's order
            part = perm[start : start + chunk]
            part[:] = part[np.lexsort((self.tgt_lengths[part], self.lengths[part]))]  # stable
            sizes.extend(_cut_sorted(self.lengths[part], self.batch_tokens, self.max_sentences))
        bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        shuffle = torch.randperm(len(sizes), generator=g).numpy()
        # The batches in shuffled order are pieces of perm: no reordered copy of it.
        return Ragged(perm, bounds[:-1][shuffle], bounds[1:][shuffle])


def sorted_batches(
    lengths: Sequence[int], batch_tokens: int, max_sentences: int | None = None
) -> Iterator[list[int]]:
    """Batches for inference: sentences sorted by length (longest first), no shuffling."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    yield from token_batches(lengths, batch_tokens, order, max_sentences)
