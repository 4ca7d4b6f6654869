"""`scripts/bench.py tm`: fuzzy retrieval from a translation memory of 10 k / 100 k / 1 M
segments (attnmt.data.fuzzy.best_matches), on one core.

The TMs are built from Tatoeba's English-French pairs: the first N pairs, and past its 167 k,
pairs of two sentences joined (a longer segment, as TMs of documents hold). The queries are
sentences held out of every TM, half as they are and half with one word of a TM segment
changed (what a translator meets: a near repeat). Prints one JSON line per size: the import's
time, the file's size, and per query the median, 95th and 99th percentile time, with the share of
queries that found a match of 50 % or more.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from attnmt.data.fuzzy import best_matches
from attnmt.data.text import read_lines
from attnmt.data.tm import TranslationMemory

QUERIES = 200


def bench_tm(args: argparse.Namespace) -> None:
    pairs = [tuple(line.split("\t")[:2]) for line in read_lines(args.tatoeba)]
    pairs = [(s, t) for s, t in pairs if s.strip() and t.strip()]
    rng = random.Random(1)
    rng.shuffle(pairs)
    held, pool = pairs[:QUERIES], pairs[QUERIES:]
    args.work.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        path = args.work / f"tm{size}.db"
        segments = list(_segments(pool, size, rng))
        start = time.perf_counter()
        if not (args.keep and path.is_file()):
            path.unlink(missing_ok=True)
            with TranslationMemory(path, create=True) as tm:
                tm.add_many(segments, "en", "fr", "tatoeba")
        imported = time.perf_counter() - start
        queries = [s for s, _ in held[: QUERIES // 2]]
        near = [segments[rng.randrange(size)][0] for _ in held[QUERIES // 2 :]]
        queries += [_one_word_changed(s, rng) for s in near]
        originals = [None] * (QUERIES // 2) + near
        times, found, recalled = [], 0, 0
        with TranslationMemory(path) as tm:
            for q in queries[:10]:  # warm the page cache
                best_matches(tm, q, ("en", "fr"), k=3)
            for q, original in zip(queries, originals, strict=True):
                t = time.perf_counter()
                matches = best_matches(tm, q, ("en", "fr"), k=3)
                times.append((time.perf_counter() - t) * 1000)
                found += bool(matches)
                recalled += original in [m.segment.source for m in matches]
        times.sort()
        print(json.dumps({
            "bench": "tm", "segments": size, "import_s": round(imported, 1),
            "bytes": path.stat().st_size, "queries": len(queries),
            "ms_median": round(statistics.median(times), 2),
            "ms_p95": round(times[int(0.95 * len(times))], 2),
            "ms_p99": round(times[int(0.99 * len(times))], 2),
            "found_share": round(found / len(queries), 3),
            "near_repeats_found": round(recalled / len(near), 3),
        }), flush=True)  # fmt: skip


def _segments(pool: list[tuple[str, str]], size: int, rng: random.Random):
    """size (source, target) pairs: the pool's, then two of its pairs joined."""
    for i in range(size):
        if i < len(pool):
            yield pool[i]
        else:
            (a, b), (c, d) = rng.choice(pool), rng.choice(pool)
            yield f"{a} {c}", f"{b} {d}"


def _one_word_changed(sentence: str, rng: random.Random) -> str:
    words = sentence.split()
    words[rng.randrange(len(words))] = rng.choice(["house", "green", "quickly", "seven"])
    return " ".join(words)
