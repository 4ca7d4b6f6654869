"""Reading and validating parallel files; length-bucketed token batching.

Pairs are kept together from the moment they are read: line i of the source is only ever paired
with line i of the target, and a pair is skipped as a whole (never one side of it), so the two
sides cannot shift against each other.
"""

from __future__ import annotations

import gzip
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnmt.errors import DataError


def decode_lines(data: bytes, name: str) -> list[str]:
    """Split raw bytes into lines on '\\n' only and decode each as UTF-8.

    Only '\\n' ends a line (a trailing '\\r' is dropped): str.splitlines would also split on
    U+2028, form feeds and the like, and shift every later line of one side of a corpus.
    """
    if not data:
        return []  # an empty file has no lines; b"\n" has one, empty
    if data.endswith(b"\n"):
        data = data[:-1]
    lines = []
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{name}:{i}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
            ) from None
    return lines


def read_lines(path: Path) -> list[str]:
    """Read a text file (optionally .gz) as a list of lines, validating UTF-8."""
    if not path.exists():
        raise DataError(f"file not found: {path}")
    if not path.is_file():
        raise DataError(f"not a regular file: {path}")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    return decode_lines(data, str(path))


def read_stdin_lines() -> list[str]:
    """Read standard input as lines, validating UTF-8."""
    return decode_lines(sys.stdin.buffer.read(), "<stdin>")


@dataclass
class ParallelText:
    """Aligned sentence pairs from one split, with how many were skipped and why."""

    src: list[str]
    tgt: list[str]
    skipped_empty: int


def read_parallel(src_path: Path, tgt_path: Path) -> ParallelText:
    """Read a source/target file pair; skip pairs where either side is empty or whitespace."""
    src = read_lines(src_path)
    tgt = read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}"
        )
    keep_src, keep_tgt = [], []
    for s, t in zip(src, tgt, strict=True):
        s, t = s.strip(), t.strip()
        if s and t:
            keep_src.append(s)
            keep_tgt.append(t)
    return ParallelText(keep_src, keep_tgt, skipped_empty=len(src) - len(keep_src))


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

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.src.to(device, non_blocking=True),
            self.src_pad_mask.to(device, non_blocking=True),
            self.tgt_in.to(device, non_blocking=True),
            self.tgt_out.to(device, non_blocking=True),
            self.index,
            self.pad_id,
        )


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Right-pad token id lists into a (B, max_len) long tensor."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, L)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


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


class BucketSampler:
    """Length-bucketed token batches, reshuffled each epoch from (seed, epoch) alone.

    A batch's size is its padded length times its rows, where a pair's length is the longer of
    its source and target (OpenNMT-py's definition of a token batch), and at most
    `max_sentences` rows when given. Each epoch: shuffle all indices, sort each chunk of
    `bucket_batches` batches' worth of pairs by (longer side, target), so neighbours have
    similar lengths on both sides and padding stays low, cut into batches, and shuffle the
    batch order. Because the order is a pure function of (seed, epoch), a run can be resumed
    at any batch of any epoch.
    """

    def __init__(
        self,
        src_lengths: Sequence[int],
        tgt_lengths: Sequence[int],
        batch_tokens: int,
        seed: int,
        bucket_batches: int = 100,
        max_sentences: int | None = None,
    ) -> None:
        self.tgt_lengths = list(tgt_lengths)
        self.lengths = [max(s, t) for s, t in zip(src_lengths, tgt_lengths, strict=True)]
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.bucket_batches = bucket_batches
        self.max_sentences = max_sentences

    def epoch(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        n = len(self.lengths)
        perm = torch.randperm(n, generator=g).tolist()
        mean_len = max(1, sum(self.lengths) // max(1, n))
        per_batch = self.batch_tokens // mean_len
        if self.max_sentences is not None:
            per_batch = min(per_batch, self.max_sentences)
        chunk = max(1, self.bucket_batches * per_batch)
        batches: list[list[int]] = []
        for start in range(0, n, chunk):
            part = sorted(
                perm[start : start + chunk],
                key=lambda i: (self.lengths[i], self.tgt_lengths[i]),
            )
            batches.extend(token_batches(self.lengths, self.batch_tokens, part, self.max_sentences))
        shuffle = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in shuffle]


def sorted_batches(
    lengths: Sequence[int], batch_tokens: int, max_sentences: int | None = None
) -> Iterator[list[int]]:
    """Batches for inference: sentences sorted by length (longest first), no shuffling."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    yield from token_batches(lengths, batch_tokens, order, max_sentences)
