"""Fuzzy matches from a translation memory (attnmt.data.tm): the segments whose source is
most like a sentence, scored as CAT tools score them.

The fuzzy score is 1 - (word-level edit distance / the longer sentence's words): words and
punctuation marks are the units, case counts (a CAT tool's 100 % is the same text, and one
word changed in ten is 90 %). Computing it against a million segments is too slow, so an
index chooses candidates first: the sentence's rarest words (document frequencies from the
TM's FTS5 index) are looked up, the segments holding most of them ranked by BM25, and only
those CANDIDATES are scored (rapidfuzz's Levenshtein distance over word lists).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rapidfuzz.distance import Levenshtein

from attnmt.data.tm import Segment, TranslationMemory
from attnmt.data.tokenizer import FM_TAG

WORD = re.compile(r"\w+|[^\w\s]")
CANDIDATES = 60  # segments scored per lookup, chosen by the index
LOOKUP_WORDS = 4  # the sentence's rarest words the index looks up
COMMON = 0.01  # the second lookup leaves out words in more than this share of the segments
ALWAYS = 1000  # ... unless in at most this many (a small TM looks every word up)
GOOD = 0.8  # a candidate this good ends the lookups


@dataclass(frozen=True)
class Match:
    segment: Segment
    score: float  # 1.0: the same source (a 100 % match)


def augmented_source(source: str, targets: list[str]) -> str:
    """What a model trained with data.tm reads (Neural Fuzzy Repair): the source, then each
    match's target after FM_TAG; training (training.tm_pairs) and translation write it alike."""
    return " ".join([source.strip(), *(f"{FM_TAG} {t.strip()}" for t in targets)])


def words(text: str) -> list[str]:
    return WORD.findall(text)


def fuzzy_score(a: str, b: str) -> float:
    """1 - word-level edit distance / max(words): CAT tools' fuzzy match score."""
    return Levenshtein.normalized_similarity(words(a), words(b))


def best_matches(
    tm: TranslationMemory,
    source: str,
    pair: tuple[str, str],
    k: int = 1,
    threshold: float = 0.5,
    leave_out: tuple[str, str] | None = None,
) -> list[Match]:
    """The k segments of `pair` whose sources are most like `source`, best first, each
    scoring at least `threshold`; an exact match (the newest) first with 1.0. `leave_out`:
    a (source, target) segment never returned (a training pair's own entry)."""
    source = source.strip()
    if not source:
        return []
    found: dict[int, Match] = {}
    left = {-1} if leave_out is None else {s.id for s in tm.same(*leave_out, pair)}
    exact = tm.exact(source, pair)
    if exact is not None and exact.id not in left:
        found[exact.id] = Match(exact, 1.0)
    terms = sorted({w.lower() for w in words(source) if w.isalnum()})
    df = tm.document_frequencies(terms)
    rare = sorted((t for t in terms if df.get(t)), key=lambda t: df[t])[:LOOKUP_WORDS]
    # Segments holding all of the rarest words first (a near repeat does, unless the word
    # changed is one of them), then all but one of them (each left out in turn); where none
    # of those is a good match, those holding any of them by BM25, the words in more than
    # COMMON of the segments left out.
    common = max(COMMON * tm.size(), ALWAYS)
    lookups = [(" AND ", rare)]
    if len(rare) > 2:
        lookups += [(" AND ", [t for t in rare if t != left]) for left in rare]
    lookups.append((" OR ", [t for t in rare if df[t] <= common] or rare[:1]))
    for joint, looked_up in lookups:
        for segment in _holding(tm, looked_up, joint, pair):
            if segment.id not in found and segment.id not in left:
                found[segment.id] = Match(segment, fuzzy_score(source, segment.source))
        if any(m.score >= GOOD for m in found.values()):
            break
    ranked = sorted(found.values(), key=lambda m: (-m.score, -m.segment.id))
    return [m for m in ranked if m.score >= threshold][:k]


def _holding(
    tm: TranslationMemory, terms: list[str], joint: str, pair: tuple[str, str]
) -> list[Segment]:
    """At most CANDIDATES segments holding all (joint " AND ") or any (" OR ") of the
    words, best by BM25."""
    if not terms:
        return []
    rows = tm.db.execute(
        "SELECT s.* FROM segments_words w JOIN segments s ON s.id = w.rowid "
        "WHERE segments_words MATCH ? AND s.src_lang = ? AND s.tgt_lang = ? "
        "ORDER BY w.rank LIMIT ?",
        (joint.join(f'"{t}"' for t in terms), *pair, CANDIDATES),
    )
    return [Segment(*row) for row in rows]


@dataclass
class TmLookup:
    """A TM that translation consults: each line's best match of `pair` scoring at least
    `threshold` (translate --tm, serve --tm). One connection shared by the threads that
    translate and the one that stores post-edits, used one at a time."""

    tm: TranslationMemory
    pair: tuple[str, str]
    threshold: float = 0.5
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, path: Path, pair: str | None, threshold: float = 0.5) -> TmLookup:
        """The TM at `path`, for `pair` ("de-en"; default: the TM's only one)."""
        tm = TranslationMemory(path)
        return cls(tm, tm.pair(pair), threshold)

    def best(self, line: str) -> Match | None:
        with self.lock:
            found = best_matches(self.tm, line, self.pair, 1, self.threshold)
        return found[0] if found else None

    def add(self, source: str, target: str, origin: str) -> int:
        """Store an approved pair of this language pair; returns its segment id."""
        with self.lock:
            return self.tm.add(source, target, *self.pair, origin)
