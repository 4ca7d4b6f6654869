"""A translation memory (TM): approved source/target segments with their language pair,
origin and time, in one SQLite file.

SQLite because it is a real database in one file: every write is a transaction (a segment
is there whole once `add` returns, or not at all, whatever kills the process: WAL journal,
synchronous FULL), any number of readers run beside one writer, and its FTS5 index gives
fuzzy retrieval its candidates (attnmt.data.fuzzy). Segments are unique per language pair,
source and target: importing a file twice adds nothing.
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from attnmt.errors import AttnmtError, DataError

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY,
    src_lang TEXT NOT NULL,
    tgt_lang TEXT NOT NULL,
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    origin TEXT NOT NULL,
    created REAL NOT NULL,
    attributes TEXT NOT NULL DEFAULT '{}',
    UNIQUE (src_lang, tgt_lang, source, target)
);
CREATE INDEX IF NOT EXISTS segments_exact ON segments (src_lang, tgt_lang, source);
CREATE VIRTUAL TABLE IF NOT EXISTS segments_words USING fts5(
    source, content='segments', content_rowid='id', tokenize='unicode61 remove_diacritics 0'
);
CREATE VIRTUAL TABLE IF NOT EXISTS segments_vocab USING fts5vocab(segments_words, 'row');
CREATE TRIGGER IF NOT EXISTS segments_indexed AFTER INSERT ON segments BEGIN
    INSERT INTO segments_words (rowid, source) VALUES (new.id, new.source);
END;
CREATE TRIGGER IF NOT EXISTS segments_unindexed AFTER DELETE ON segments BEGIN
    INSERT INTO segments_words (segments_words, rowid, source)
    VALUES ('delete', old.id, old.source);
END;
"""
MAX_SEGMENT_CHARS = 2000  # a segment's source or target at most (a sentence, not a document)


@dataclass(frozen=True)
class Segment:
    id: int
    src_lang: str
    tgt_lang: str
    source: str
    target: str
    origin: str
    created: float  # seconds since the epoch
    attributes: str = "{}"  # JSON: what a TMX unit carried besides its text (interop.tmx)


class TranslationMemory:
    """One TM file, opened for reading and writing (created with `create`)."""

    def __init__(self, path: Path, create: bool = False) -> None:
        path = Path(path)
        if not create and not path.is_file():
            raise AttnmtError(f"{path}: no translation memory there (attnmt tm import FILE --db)")
        self.path = path
        self._df: dict[str, int] = {}
        self._size: int | None = None
        try:
            self.db = sqlite3.connect(path, timeout=30.0, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise AttnmtError(f"{path}: a TM of schema {version}; this attnmt reads 1")
            if version == 0:
                with self.db:
                    self.db.executescript(SCHEMA)
                    self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as e:
            raise AttnmtError(f"{path}: not a translation memory ({e})") from None

    def document_frequencies(self, terms: list[str]) -> dict[str, int]:
        """How many segments hold each word (lowercased; the index's counts). Remembered per
        connection: a count a few additions old chooses the same candidates."""
        new = [t for t in terms if t not in self._df]
        for term in new:
            row = self.db.execute("SELECT doc FROM segments_vocab WHERE term = ?", (term,))
            found = row.fetchone()
            self._df[term] = 0 if found is None else int(found[0])
        return {t: self._df[t] for t in terms}

    def size(self) -> int:
        """Segments in the TM (counted once per connection)."""
        if self._size is None:
            self._size = int(self.db.execute("SELECT MAX(id) FROM segments").fetchone()[0] or 0)
        return self._size

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> TranslationMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_many(
        self,
        pairs: Iterable[tuple[str, str]],
        src_lang: str,
        tgt_lang: str,
        origin: str,
        attributes: Iterable[str] | None = None,
    ) -> int:
        """Add (source, target) pairs in one transaction (all or none); returns how many were
        new. Each is checked first: neither side empty nor longer than MAX_SEGMENT_CHARS.
        `attributes`: per pair, JSON kept with it (a TMX unit's attributes, props, notes)."""
        now = time.time()
        extra = attributes if attributes is not None else itertools.repeat("{}")
        rows = (
            (src_lang, tgt_lang, *_checked(s, t), origin, now, a)
            for (s, t), a in zip(pairs, extra, strict=False)  # extra: repeat, or one a pair
        )
        with self.db:
            done = self.db.executemany(
                "INSERT OR IGNORE INTO segments (src_lang, tgt_lang, source, target, origin, "
                "created, attributes) VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        return done.rowcount  # the segments' rows: the index's, by trigger, do not count

    def add(self, source: str, target: str, src_lang: str, tgt_lang: str, origin: str) -> int:
        """Add one approved pair (a post-edit); returns its segment id (the existing one if
        the same pair is already there)."""
        self.add_many([(source, target)], src_lang, tgt_lang, origin)
        found = self.db.execute(
            "SELECT id FROM segments WHERE src_lang=? AND tgt_lang=? AND source=? AND target=?",
            (src_lang, tgt_lang, source.strip(), target.strip()),
        ).fetchone()
        return int(found[0])

    def segments(self, pair: tuple[str, str] | None = None) -> Iterator[Segment]:
        """Every segment (of one language pair), oldest first."""
        query, args = "SELECT * FROM segments", ()
        if pair is not None:
            query, args = query + " WHERE src_lang=? AND tgt_lang=?", pair
        for row in self.db.execute(query + " ORDER BY id", args):
            yield Segment(*row)

    def get(self, ids: list[int]) -> list[Segment]:
        marks = ",".join("?" * len(ids))
        rows = self.db.execute(f"SELECT * FROM segments WHERE id IN ({marks})", ids)
        return [Segment(*row) for row in rows]

    def exact(self, source: str, pair: tuple[str, str]) -> Segment | None:
        """The newest segment whose source is exactly this one (a 100 % match)."""
        row = self.db.execute(
            "SELECT * FROM segments WHERE src_lang=? AND tgt_lang=? AND source=? "
            "ORDER BY id DESC LIMIT 1",
            (*pair, source.strip()),
        ).fetchone()
        return None if row is None else Segment(*row)

    def same(self, source: str, target: str, pair: tuple[str, str]) -> list[Segment]:
        """The segment of exactly this pair, if there is one (as a list)."""
        rows = self.db.execute(
            "SELECT * FROM segments WHERE src_lang=? AND tgt_lang=? AND source=? AND target=?",
            (*pair, source.strip(), target.strip()),
        )
        return [Segment(*row) for row in rows]

    def pairs(self) -> dict[tuple[str, str], int]:
        """Segments per language pair."""
        rows = self.db.execute(
            "SELECT src_lang, tgt_lang, COUNT(*) FROM segments GROUP BY src_lang, tgt_lang"
        )
        return {(s, t): n for s, t, n in rows}

    def stats(self) -> dict[str, object]:
        """What `attnmt tm stats` prints: segments per pair and origin, first and last time."""
        origins = dict(self.db.execute("SELECT origin, COUNT(*) FROM segments GROUP BY origin"))
        first, last = self.db.execute("SELECT MIN(created), MAX(created) FROM segments").fetchone()
        pairs = {f"{s}-{t}": n for (s, t), n in self.pairs().items()}
        total = sum(pairs.values())
        return {"segments": total, "pairs": pairs, "origins": origins, "first": first,
                "last": last, "bytes": self.path.stat().st_size}  # fmt: skip

    def pair(self, given: str | None) -> tuple[str, str]:
        """The language pair to read: `given` ("de-en"), or the TM's only one."""
        if given is not None:
            return parse_pair(given)
        found = list(self.pairs())
        if len(found) != 1:
            have = ", ".join(f"{s}-{t}" for s, t in found) or "none"
            raise AttnmtError(f"{self.path}: give the language pair (--tm-pair; it holds {have})")
        return found[0]


def parse_pair(text: str) -> tuple[str, str]:
    """'de-en' -> ('de', 'en')."""
    src, sep, tgt = text.partition("-")
    if not sep or not src or not tgt:
        raise AttnmtError(f"language pair {text!r}: expected SRC-TGT, e.g. de-en")
    return src, tgt


def _checked(source: str, target: str) -> tuple[str, str]:
    source, target = source.strip(), target.strip()
    if not source or not target:
        raise DataError(f"a segment needs both sides: {source[:60]!r} / {target[:60]!r}")
    if max(len(source), len(target)) > MAX_SEGMENT_CHARS:
        raise DataError(f"a segment over {MAX_SEGMENT_CHARS} characters: {source[:60]!r}...")
    return source, target
