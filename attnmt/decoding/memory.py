"""A translation memory consulted as lines are translated (translate --tm, serve --tm,
Translator.use_tm): each line's match, a 100 % one returned in place of decoding, a fuzzy one
reported, and given after its line to a model trained with data.tm (Neural Fuzzy Repair)."""

from __future__ import annotations

from pathlib import Path

from attnmt.config import Config
from attnmt.data.fuzzy import TmLookup, augmented_source
from attnmt.decoding.translation import TmUse
from attnmt.errors import AttnmtError


def open_tm(path: Path, pair: str | None, threshold: float, cfg: Config) -> TmLookup:
    """The TM at `path` for a model of config `cfg`: of `pair` (default: the TM's only one),
    refused where the model's corpora name other languages."""
    if not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0:
        raise AttnmtError(f"threshold {threshold!r}: expected a number from 0 to 1")
    lookup = TmLookup.open(Path(path), pair, threshold)
    named = [(c.src_lang, c.tgt_lang) for c in cfg.data.corpora]
    if named and all(named[0]) and lookup.pair not in named:  # the model's languages
        lookup.tm.close()
        raise AttnmtError(
            f"{path}: a TM of {'-'.join(lookup.pair)}; this model translates "
            f"{'-'.join(named[0])} (--tm-pair)"  # type: ignore[arg-type]
        )
    return lookup


def tm_matches(
    tm: TmLookup | None,
    reads_matches: bool,
    originals: list[str],
    lines: list[str],
    target_prefix: list[list[int]] | None,
    phrases: list[list[list[int]]] | None,
) -> tuple[list[str], list[TmUse | None] | None]:
    """Each line's TM match (its text as given, tags included: a TM segment holds its tags)
    and the lines to search: a line with a 100 % match and nothing asked of its output (no
    prefix, no phrases) is not searched (its text emptied: Prepared.finish puts the TM's
    target, tags and all, in its place); a model that `reads_matches` (trained with data.tm)
    gets a fuzzy match's target after its line (augmented_source; not with markup)."""
    if tm is None:
        return lines, None
    found: list[TmUse | None] = []
    for i, original in enumerate(originals):
        match = tm.best(original)
        if match is None:
            found.append(None)
            continue
        free = not (target_prefix and target_prefix[i]) and not (phrases and phrases[i])
        exact = match.score == 1.0 and free
        s = match.segment
        fed = not exact and reads_matches and lines[i] == original
        found.append(TmUse(s.id, match.score, s.source, s.target, exact, fed))
        if exact:
            lines[i] = ""
        elif fed:
            lines[i] = augmented_source(lines[i], [s.target])
    return lines, found
