"""Lines made ready to search, the same on both paths (search_lines' batches and LinePool):
their source ids (a source prefix, the line, EOS; cut to decode.max_src_len), the target
prefixes, the tokens a shortlist must keep, and what the search left out of each line, in
the words the CLI prints after "input line N: "."""

from __future__ import annotations

import re
from collections.abc import Sequence

from attnmt.data.tokenizer import EOS_ID, Tokenizer
from attnmt.decoding.search import Hypothesis, SearchOptions, output_limit


def prepare_sources(
    tokenizer: Tokenizer,
    lines: Sequence[str],
    todo: list[int],
    source_prefix: Sequence[int],
    target_prefix: Sequence[Sequence[int]] | None,
    options: SearchOptions,
) -> tuple[list[list[int]], list[list[int]] | None, list[list[str]]]:
    """The lines `todo` (not empty) as the search takes them, on both paths (the batch path
    and LinePool): their source ids (the source prefix, then the line, EOS; cut to
    decode.max_src_len), the target ids each output starts with, and per line the warnings so
    far (a source cut, a prefix past the output limit)."""
    encoded = tokenizer.src.encode([lines[i].strip() for i in todo])
    src = [[*source_prefix, *ids, EOS_ID] for ids in encoded]
    warned = _cut_long_sources(src, options)
    for j, i in enumerate(todo):  # markup's lines come here without their tags
        if TAG.search(lines[i]):
            warned[j].append(
                'holds XML/HTML tags, translated as words: --markup (HTTP: "markup": true) '
                "keeps them around the translated text"
            )
    starts = None if target_prefix is None else [list(target_prefix[i]) for i in todo]
    _long_prefixes(src, starts, options, warned)
    return src, starts, warned


# An XML/HTML tag: <b>, </b>, <a href="…">, <br/> (not "a < b", nor "x<y").
TAG = re.compile(r"</?[A-Za-z][\w:.-]*(?:\s[^<>]*)?/?>")


def needed_tokens(
    starts: Sequence[Sequence[int]], phrases: Sequence[Sequence[Sequence[int]]]
) -> list[int]:
    """The target ids a shortlist must keep for these lines: their prefixes' and phrases'."""
    return [t for p in starts for t in p] + [t for line in phrases for p in line for t in p]


def _cut_long_sources(src: list[list[int]], options: SearchOptions) -> list[list[str]]:
    """In place: a source longer than decode.max_src_len is cut (one very long line must not
    stall the rest). Returns per source the warnings so far: this one where it was cut."""
    warned: list[list[str]] = [[] for _ in src]
    for j, ids in enumerate(src):
        if len(ids) > options.max_src_len:
            warned[j].append(
                f"{len(ids) - 1:,} subwords, cut to the first {options.max_src_len - 1:,} "
                "(decode.max_src_len)"
            )
            src[j] = [*ids[: options.max_src_len - 1], EOS_ID]
    return warned


def _long_prefixes(
    src: list[list[int]],
    prefixes: list[list[int]] | None,
    options: SearchOptions,
    warned: list[list[str]],
) -> None:
    """A warning for each line whose prefix is longer than its output limit (the search cuts
    it there)."""
    for ids, prefix, said in zip(src, prefixes or (), warned, strict=False):
        if len(prefix) >= (limit := output_limit(len(ids), options)):
            said.append(
                f"its prefix of {len(prefix):,} pieces is cut to the output limit, "
                f"{limit - 1:,} pieces (decode.max_len_a, max_len_b, max_output_len)"
            )


def unmet_warning(best: Hypothesis, phrases: list[list[int]], warned: list[str]) -> None:
    """A warning where the best translation lacks some of its line's constraints."""
    if best.unmet:
        warned.append(
            f"{best.unmet} of {len(phrases)} constraints not met within the length limit "
            "(decode.max_len_a, max_len_b)"
        )
