"""The encoded training corpus: read once as a stream, encoded in parallel, kept on disk as
memory-mapped token arrays in `MODEL_DIR/encoded/`, which training and every `--resume`
(and every DDP rank) map instead of reading the text again.

    encoded/meta.json              counts, token dtype, and the fingerprint of the files read
    encoded/{src,tgt}.tokens       the pairs' token ids, one after another (uint16 or uint32)
    encoded/{src,tgt}.offsets      int64, pair i's tokens are tokens[off[i]:off[i + 1]]

Memory: the text is never held whole (a chunk of pairs at a time per worker), and training
holds two int32 length arrays plus the pages of the map that batches touch. translate and eval
never read `encoded/` (a shipped model can leave it out).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from attnmt.config import SplitConfig
from attnmt.data.batches import Ragged
from attnmt.data.files import atomic_write_bytes, file_sha256, fsync_dir
from attnmt.data.processes import imap_forked
from attnmt.data.text import PairCounts, read_split
from attnmt.errors import DataError

STORE_DIR = "encoded"
STORE_FORMAT = 1
CHUNK_PAIRS = 20_000  # pairs a worker encodes at a time
ENCODING_WORKER_DIED = (
    "an encoding worker process ended unexpectedly (killed, or out of memory?); lower data.workers"
)


def fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """What the store was built from: each file's path, size and SHA-256 (of its bytes)."""
    found = []
    for path in paths:
        h = hashlib.sha256()
        with _open_raw(path) as f:
            while block := f.read(1 << 20):
                h.update(block)
        found.append({"path": str(path), "size": path.stat().st_size, "sha256": h.hexdigest()})
    return found


def _open_raw(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def check_fingerprint(store: Path, files: list[Path]) -> None:
    """Refuse (one line naming the file) when a file differs from what the store was built
    from: resuming over other data would continue at the old batch positions in new pairs."""
    recorded = json.loads((store / "meta.json").read_text(encoding="utf-8"))["fingerprint"]
    if [r["path"] for r in recorded] != [str(p) for p in files]:
        raise DataError(
            f"--resume: the run was trained on {', '.join(r['path'] for r in recorded)}, not on "
            f"{', '.join(map(str, files))}"
        )
    for r, now in zip(recorded, fingerprint(files), strict=True):
        if r["sha256"] != now["sha256"]:
            raise DataError(
                f"{r['path']}: changed since the run started (size {r['size']:,} -> "
                f"{now['size']:,} bytes, content hash differs); train into a new directory"
            )


# --- encoding in worker processes ---


class _Encoder:
    """Encodes chunks of pairs in a forked worker (processes.imap_forked), which gets it, and
    its SentencePiece processors, by memory."""

    def __init__(
        self, protos: tuple[bytes, bytes], max_len: int, dtype: type, prefix: list[int]
    ) -> None:
        import sentencepiece as spm

        self.vocabs = [spm.SentencePieceProcessor(model_proto=p) for p in protos]
        self.max_len, self.dtype, self.prefix = max_len, dtype, prefix

    def __call__(self, pairs: list[tuple[str, str]]) -> tuple[np.ndarray, ...]:
        """Encode a chunk of pairs, `prefix` (a target-language tag) before each source; drop
        those with a side longer than max_len subwords. Returns (src tokens, src lengths, tgt
        tokens, tgt lengths) of the kept pairs."""
        src_ids = self.vocabs[0].encode([s for s, _ in pairs])
        if self.prefix:
            src_ids = [[*self.prefix, *ids] for ids in src_ids]
        src, src_len = _flat(src_ids, self.dtype)
        tgt, tgt_len = _flat(self.vocabs[1].encode([t for _, t in pairs]), self.dtype)
        keep = (src_len <= self.max_len) & (tgt_len <= self.max_len)
        if keep.all():
            return src, src_len, tgt, tgt_len
        return (
            src[np.repeat(keep, src_len)], src_len[keep], tgt[np.repeat(keep, tgt_len)],
            tgt_len[keep],
        )  # fmt: skip


def _flat(ids: list[list[int]], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Sentences of ids as one flat array and their lengths."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((i for seq in ids for i in seq), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def _chunks(pairs: Iterator[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    chunk: list[tuple[str, str]] = []
    for pair in pairs:
        chunk.append(pair)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _Writer:
    """Appends encoded chunks to the store's token and offset files."""

    def __init__(self, directory: Path) -> None:
        self.files = {
            name: open(directory / name, "wb")  # noqa: SIM115 (closed in close)
            for name in ("src.tokens", "src.offsets", "tgt.tokens", "tgt.offsets")
        }
        self.ends = {"src": 0, "tgt": 0}
        self.pairs = 0
        for side in self.ends:
            self.files[f"{side}.offsets"].write(np.zeros(1, np.int64).tobytes())

    def add(self, src: np.ndarray, src_len: np.ndarray, tgt: np.ndarray, tgt_len: np.ndarray):
        for side, tokens, lengths in (("src", src, src_len), ("tgt", tgt, tgt_len)):
            self.files[f"{side}.tokens"].write(tokens.tobytes())
            offsets = self.ends[side] + np.cumsum(lengths, dtype=np.int64)
            self.files[f"{side}.offsets"].write(offsets.tobytes())
            self.ends[side] = int(offsets[-1]) if len(offsets) else self.ends[side]
        self.pairs += len(src_len)

    def close(self) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_store(
    out: Path,
    corpora: list[SplitConfig],
    protos: tuple[bytes, bytes],
    max_len: int,
    workers: int,
    fingerprinted: list[Path],
    prefixes: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Encode the training pairs into out/encoded/ (built beside it, renamed when complete)
    and return its metadata, with the fingerprint of the files `fingerprinted` (the training
    files, and any others a resume must find unchanged). Workers are forked processes (a
    SentencePiece processor each); chunks are read as workers free up, so memory stays
    bounded."""
    start = time.time()
    store, tmp = out / STORE_DIR, out / f".{STORE_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    vocab = max(_vocab_size(p) for p in protos)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    counts, writer = PairCounts(), _Writer(tmp)
    corpus_pairs = []  # pairs kept per corpus; corpus c's are contiguous, after c - 1's
    for i, split in enumerate(corpora):
        before = writer.pairs
        encoder = _Encoder(protos, max_len, dtype, prefixes[i] if prefixes else [])
        chunks = _chunks(read_split(split, counts), CHUNK_PAIRS)
        for encoded in imap_forked(encoder, chunks, workers, ENCODING_WORKER_DIED):
            writer.add(*encoded)
        corpus_pairs.append(writer.pairs - before)
    writer.close()
    meta = {
        "format": STORE_FORMAT,
        "dtype": np.dtype(dtype).name,
        "pairs": writer.pairs,
        "corpus_pairs": corpus_pairs,
        "read": counts.read,
        "skipped_empty": counts.empty,
        "skipped_too_long": counts.read - counts.empty - writer.pairs,
        "max_len": max_len,
        "workers": workers,
        "encode_seconds": round(time.time() - start, 3),
        "fingerprint": fingerprint(fingerprinted),
        "files": {name: _file_record(tmp / name) for name in STORE_FILES},
    }
    atomic_write_bytes(tmp / "meta.json", json.dumps(meta, indent=2).encode())
    shutil.rmtree(store, ignore_errors=True)
    os.replace(tmp, store)
    fsync_dir(out)
    return meta


STORE_FILES = ("src.tokens", "src.offsets", "tgt.tokens", "tgt.offsets")


def _file_record(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def damage(store: TokenStore, vocab_sizes: tuple[int, int]) -> str | None:
    """What is wrong with a store's files (a size or checksum that differs from what was
    recorded when it was built, or a token id outside the vocabulary), or None if nothing."""
    recorded = store.meta.get("files") or {}
    for name, record in recorded.items():
        path = store.directory / name
        try:
            now = _file_record(path)
        except OSError as e:
            return f"{path}: {e.strerror or e}"
        if now["size"] != record.get("size"):
            return f"{path}: {now['size']:,} bytes, built with {record.get('size'):,}"
        if now["sha256"] != record.get("sha256"):
            return f"{path}: its checksum differs from the one recorded when it was built"
    for side, vocab in zip((store.src, store.tgt), vocab_sizes, strict=True):
        top = int(side.values.max()) if len(side.values) else -1
        if top >= vocab:
            return f"{store.directory}: token id {top} outside a vocabulary of {vocab}"
    return None


def _vocab_size(proto: bytes) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=proto).get_piece_size()


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    """path's contents as a read-only memory map, read page by page: batches touch pairs at
    random, and the kernel's default read-ahead (128 KiB per touch) would map far more of the
    file than they use (counted as the process's resident memory)."""
    if not path.stat().st_size:
        return np.zeros(0, dtype)  # an empty file cannot be mapped
    array = np.memmap(path, dtype=dtype, mode="r")
    if hasattr(mmap, "MADV_RANDOM"):
        array._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]
    return array


def _lengths(offsets_file: Path, block: int = 1 << 20) -> np.ndarray:
    """Pair lengths (int32) from an offsets file, a block at a time (no int64 copy of it all)."""
    n = offsets_file.stat().st_size // 8 - 1
    lengths = np.empty(max(n, 0), dtype=np.int32)
    for start in range(0, n, block):
        count = min(block, n - start) + 1
        offsets = np.fromfile(offsets_file, np.int64, count=count, offset=start * 8)
        lengths[start : start + count - 1] = np.diff(offsets)
    return lengths


class TokenStore:
    """The encoded training pairs, memory-mapped: `src[i]`, `tgt[i]` are token-id lists."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        sides, self.maps = {}, []
        for side in ("src", "tgt"):
            tokens = _map(directory / f"{side}.tokens", np.dtype(self.meta["dtype"]))
            offsets = _map(directory / f"{side}.offsets", np.dtype(np.int64))
            sides[side] = Ragged(tokens, offsets)
            self.maps += [tokens, offsets]
        self.src, self.tgt = sides["src"], sides["tgt"]

    def pairs(self, idx: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of pairs idx, read without keeping their pages mapped.

        Batches touch pairs all over the store, so over a run nearly every page of a large
        store would stay in the process's resident memory. MADV_DONTNEED drops them from the
        process (they stay in the OS's page cache, so reading them again is cheap)."""
        src, tgt = [self.src[i] for i in idx], [self.tgt[i] for i in idx]
        if hasattr(mmap, "MADV_DONTNEED"):
            for array in self.maps:
                if isinstance(array, np.memmap):
                    array._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]
        return src, tgt

    def __len__(self) -> int:
        return len(self.src)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) lengths in subwords, int32. Read from the offset files, not through
        the maps: mapped, every page of them would stay counted as resident memory."""
        return tuple(_lengths(self.directory / f"{side}.offsets") for side in ("src", "tgt"))  # type: ignore[return-value]


def open_store(out: Path) -> TokenStore | None:
    """The complete store in out, or None when there is none (or an unreadable one)."""
    try:
        store = TokenStore(out / STORE_DIR)
    except (OSError, ValueError, KeyError):
        return None
    return store if store.meta.get("format") == STORE_FORMAT else None
