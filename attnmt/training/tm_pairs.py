"""Training pairs with their translation memory matches (data.tm, Neural Fuzzy Repair: Bulté
& Tezcan 2019): each pair whose source has a match scoring data.tm.threshold or more becomes
one more pair, "SOURCE <FM> MATCH TARGET" -> TARGET, written once into the run directory as a
TSV that the encoded store reads as a corpus of its own (a resume finds it unchanged)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from attnmt.config import DataConfig
from attnmt.data.files import atomic_write_bytes
from attnmt.data.fuzzy import augmented_source, best_matches
from attnmt.data.text import read_corpora
from attnmt.data.tm import TranslationMemory
from attnmt.errors import ConfigError
from attnmt.training.runlog import RunLog

TM_PAIRS = "tm_pairs.tsv"  # in the run directory
SELF_TM = ".tm_self.db"  # the training corpora as a TM (data.tm.path: self), built once
PROGRESS_EVERY = 25_000  # a log line each time this many more pairs have their matches


def write_tm_pairs(data: DataConfig, out: Path, log: RunLog) -> Path:
    """The augmented pairs' TSV in `out` (made unless it is there: a resume reuses it)."""
    path = out / TM_PAIRS
    if path.is_file():
        return path
    assert data.tm is not None
    if data.tm.path != "self" and not Path(data.tm.path).is_file():
        raise ConfigError(f"data.tm.path: no translation memory at {data.tm.path} "
                          "(attnmt tm import FILE --db TM makes one)")  # fmt: skip
    start = time.monotonic()
    pairs = list(read_corpora(data.corpora))
    minutes = len(pairs) * 2e-3 / 60  # about 2 ms a pair (bench.py tm)
    log.event(
        "tm", f"tm: looking up {len(pairs):,} training pairs' matches (about {minutes:.0f} min)",
        pairs=len(pairs),
    )  # fmt: skip
    lines = []
    for n, line in enumerate(_augmented(data, out, pairs), 1):
        lines.append(line)
        if n % PROGRESS_EVERY == 0:
            log.event("tm", f"tm: {n:,} pairs with matches so far", matched=n)
    matched = len(lines)
    atomic_write_bytes(path, "".join(lines).encode("utf-8"))
    log.event(
        "tm", f"tm: {matched:,} of {len(pairs):,} training pairs have a match of "
        f"{data.tm.threshold:.0%} or more ({time.monotonic() - start:.1f} s): {path}",
        pairs=len(pairs), matched=matched,
    )  # fmt: skip
    return path


def _augmented(data: DataConfig, out: Path, pairs: list[tuple[str, str]]) -> Iterator[str]:
    """The TSV lines of the pairs that have matches."""
    tm_cfg = data.tm
    assert tm_cfg is not None
    if tm_cfg.path == "self":
        db = out / SELF_TM
        db.unlink(missing_ok=True)
        with TranslationMemory(db, create=True) as tm:
            tm.add_many(_clean(pairs), "src", "tgt", "training corpus")
        pair = ("src", "tgt")
    else:
        db = Path(tm_cfg.path)
        with TranslationMemory(db) as tm:
            pair = tm.pair(tm_cfg.pair)
    with TranslationMemory(db) as tm:
        for source, target in pairs:
            own = (source, target)  # its own entry (the TM may hold the pair): left out
            found = best_matches(tm, source, pair, tm_cfg.k, tm_cfg.threshold, own)
            if found and "\t" not in source + target:
                matches = [m.segment.target for m in found]
                yield f"{augmented_source(source, matches)}\t{target.strip()}\n"
    if tm_cfg.path == "self":
        db.unlink(missing_ok=True)


def _clean(pairs: list[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    for source, target in pairs:
        if source.strip() and target.strip() and max(len(source), len(target)) <= 2000:
            yield source, target
