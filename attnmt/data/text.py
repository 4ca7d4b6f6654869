"""Reading and validating parallel files as streams (two files or one TSV, plain, .gz or a
pipe); length-bucketed token batching.

Pairs are kept together from the moment they are read: line i of the source is only ever paired
with line i of the target, and a pair is skipped as a whole (never one side of it), so the two
sides cannot shift against each other.
"""

from __future__ import annotations

import gzip
import os
import select
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from attnmt.config import SplitConfig
from attnmt.errors import DataError


def decode_line(raw: bytes, name: str, number: int) -> str:
    """One line's bytes (without its '\n'; a trailing '\r' is dropped) as UTF-8, or a
    DataError naming name:number and the bad byte. A UTF-8 byte order mark starting the first
    line is dropped (editors on Windows write one): it is not text."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
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
    decoding.scores.score_translations scores."""
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
