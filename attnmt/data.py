"""Reading and validating parallel files as streams (two files or one TSV, plain, .gz or a
pipe); length-bucketed token batching.

Pairs are kept together from the moment they are read: line i of the source is only ever paired
with line i of the target, and a pair is skipped as a whole (never one side of it), so the two
sides cannot shift against each other.
"""

from __future__ import annotations

import gzip
import itertools
import os
import select
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from attnmt.config import SplitConfig
from attnmt.errors import DataError


def decode_line(raw: bytes, name: str, number: int) -> str:
    """One line's bytes (without its '\n'; a trailing '\r' is dropped) as UTF-8, or a
    DataError naming name:number and the bad byte."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{name}:{number}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
        ) from None


CHUNK_LINES = 4096  # input lines translated together at most (memory stays bounded)
MAX_LINE_BYTES = 1 << 20  # a longer line is refused (file:line): input is sentences


def input_chunks(path: Path | None, size: int = CHUNK_LINES) -> Iterator[list[str]]:
    """The lines of a file (plain or .gz), a pipe (`<(zcat x.gz)`, `/dev/stdin`) or standard
    input (None or '-'), decoded as UTF-8 (file:line on an error), in chunks of at most `size`
    lines. From a pipe or a terminal a chunk also ends when no more input is waiting, so a line
    sent alone is answered at once; the input is never held whole."""
    stdin = path is None or str(path) == "-"
    name = "<stdin>" if stdin else str(path)
    if stdin and sys.stdin is None:
        raise DataError("standard input is closed; give the input with --input FILE")
    stream = sys.stdin.buffer if stdin else open_input(path)  # type: ignore[arg-type]
    fd = _interactive_fd(stream)
    number, chunk, pending = 0, [], b""
    try:
        while data := (os.read(fd, 1 << 16) if fd is not None else stream.read(1 << 16)):
            *complete, pending = (pending + data).split(b"\n")
            if len(pending) > MAX_LINE_BYTES:  # /dev/zero, a binary file: never a sentence
                raise DataError(
                    f"{name}:{number + len(complete) + 1}: a line longer than "
                    f"{MAX_LINE_BYTES >> 20} MiB; is this a text file of sentences?"
                )
            for raw in complete:
                number += 1
                chunk.append(decode_line(raw, name, number))
                if len(chunk) == size:
                    yield chunk
                    chunk = []
            if chunk and fd is not None and not select.select([fd], [], [], 0)[0]:
                yield chunk  # nothing more is waiting: answer what came
                chunk = []
    except (OSError, EOFError) as e:  # EOFError: a cut-off .gz
        raise DataError(f"cannot read {name}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        if not stdin:
            stream.close()
    if pending:
        chunk.append(decode_line(pending, name, number + 1))
    if chunk:
        yield chunk


def check_input(path: Path) -> None:
    """Fail early, without opening it, if `path` cannot be an input: a pipe or FIFO must be
    opened once only (a writer that finds its reader gone gets SIGPIPE, and a second open
    then waits for a writer forever)."""
    if not path.exists():
        raise DataError(f"file not found: {path}")
    if path.is_dir():
        raise DataError(f"not a regular file: {path}")
    if not os.access(path, os.R_OK):
        raise DataError(f"cannot read {path}: Permission denied")


def open_input(path: Path) -> IO[bytes]:
    check_input(path)
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _interactive_fd(stream: IO[bytes]) -> int | None:
    """The file descriptor to read a pipe or terminal from as input arrives; None for a
    regular or compressed file, or a stream without one (tests)."""
    if isinstance(stream, gzip.GzipFile):
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return None if stat.S_ISREG(os.fstat(fd).st_mode) else fd


def read_lines(path: Path) -> list[str]:
    """Read a text file (optionally .gz) or a pipe as a list of lines, validating UTF-8."""
    return [line for chunk in input_chunks(path, 1 << 16) for line in chunk]


def read_references(paths: Sequence[Path], lines: int) -> list[list[str]]:
    """Further reference sets (eval's --ref given more than once), each `lines` lines long."""
    found = []
    for path in paths:
        refs = read_lines(path)
        if len(refs) != lines:
            raise DataError(f"{path}: {len(refs)} lines, but the first reference has {lines}")
        found.append(refs)
    return found


@dataclass
class ParallelText:
    """Aligned sentence pairs from one split, with how many were skipped and why."""

    src: list[str]
    tgt: list[str]
    skipped_empty: int


def _lines(path: Path) -> Iterator[str]:
    """path's lines as a stream, validated as input_chunks does."""
    for chunk in input_chunks(path, 1 << 16):
        yield from chunk


@dataclass
class PairCounts:
    read: int = 0  # pairs read
    empty: int = 0  # skipped: a side empty or whitespace


def read_pairs(
    src_path: Path, tgt_path: Path, counts: PairCounts | None = None, keep_empty: bool = False
) -> Iterator[tuple[str, str]]:
    """Stream the (source, target) pairs with text on both sides, stripped (keep_empty: every
    pair, as it is: a test set); pairs are never shifted (line i with line i). Files of
    different lengths are a DataError naming both counts, found when the shorter one ends."""
    counts = counts if counts is not None else PairCounts()
    src, tgt = _lines(src_path), _lines(tgt_path)
    for s in src:
        t = next(tgt, None)
        if t is None:
            n = counts.read + 1 + sum(1 for _ in src)
            raise DataError(
                f"line counts differ: {src_path} has {n} lines, {tgt_path} has {counts.read}"
            )
        counts.read += 1
        if (pair := _kept(s, t, counts, keep_empty)) is not None:
            yield pair
    rest = sum(1 for _ in tgt)
    if rest:
        raise DataError(
            f"line counts differ: {src_path} has {counts.read} lines, "
            f"{tgt_path} has {counts.read + rest}"
        )


def _kept(s: str, t: str, counts: PairCounts, keep_empty: bool) -> tuple[str, str] | None:
    """The pair (s, t) stripped if both sides have text (None, counted as empty, if not), or
    as it is with keep_empty. A plain function, not a generator: it runs once per pair."""
    if keep_empty:
        return s, t
    s, t = s.strip(), t.strip()
    if s and t:
        return s, t
    counts.empty += 1
    return None


def read_tsv(
    path: Path,
    src_field: int,
    tgt_field: int,
    counts: PairCounts | None = None,
    keep_empty: bool = False,
) -> Iterator[tuple[str, str]]:
    """Stream the pairs of a TSV file's 1-based fields src_field and tgt_field, stripped, with
    text on both sides (keep_empty: every pair, as it is); a line with too few fields is a
    DataError with file:line."""
    counts = counts if counts is not None else PairCounts()
    need = max(src_field, tgt_field)
    for line in _lines(path):
        counts.read += 1
        fields = line.split("\t")
        if len(fields) < need:
            raise DataError(
                f"{path}:{counts.read}: {len(fields)} tab-separated field(s); src_field "
                f"{src_field} and tgt_field {tgt_field} need {need}"
            )
        pair = _kept(fields[src_field - 1], fields[tgt_field - 1], counts, keep_empty)
        if pair is not None:
            yield pair


def read_split(
    split: SplitConfig, counts: PairCounts | None = None, keep_empty: bool = False
) -> Iterator[tuple[str, str]]:
    """A corpus's pairs, from two files or one TSV file, as a stream."""
    if split.tsv is not None:
        return read_tsv(split.tsv, split.src_field, split.tgt_field, counts, keep_empty)
    assert split.src is not None and split.tgt is not None
    return read_pairs(split.src, split.tgt, counts, keep_empty)


def read_test_set(split: SplitConfig) -> tuple[list[str], list[str]]:
    """A test set's sources and references, every line as it is (an empty one too): what
    evaluate.score_translations scores."""
    pairs = list(read_split(split, keep_empty=True))
    return [s for s, _ in pairs], [t for _, t in pairs]


def read_corpora(
    splits: list[SplitConfig], counts: PairCounts | None = None
) -> Iterator[tuple[str, str]]:
    """The pairs of several corpora, one after the other, as a stream."""
    for split in splits:
        yield from read_split(split, counts)


def read_split_text(split: SplitConfig) -> ParallelText:
    """A small corpus (dev, test) in memory."""
    return _collect(read_split, split)


def read_parallel(src_path: Path, tgt_path: Path) -> ParallelText:
    """A source/target file pair in memory (read_pairs)."""
    return _collect(read_pairs, src_path, tgt_path)


def _collect(read: Any, *args: Any) -> ParallelText:
    counts = PairCounts()
    pairs = list(read(*args, counts))
    return ParallelText([s for s, _ in pairs], [t for _, t in pairs], skipped_empty=counts.empty)


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
