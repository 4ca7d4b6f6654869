"""A request checked and prepared once, then searched: what `Translator.prepare` makes of
lines and their per-line options, and what `Translator.decode` searches.

The CLI, the Python API and the server all go through it: the server prepares a request when
it arrives (so a bad one is refused before it is queued, and nothing is computed twice), then
joins the parts of several requests into one batch and gives each its own results back
(`part`, `join`, `finish`). Finishing is per request: a line whose tags cannot be put back
fails its own request, never a batch-mate's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from attnmt.decoding.markup import Element, put_back
from attnmt.decoding.search import SearchOptions
from attnmt.decoding.terminology import Term
from attnmt.decoding.translation import TmUse, Translation


@dataclass(frozen=True)
class Prepared:
    """Lines ready to search: the text the model reads (a line's tags taken out), and per
    line what its search starts from and must contain."""

    options: SearchOptions
    lines: list[str]  # the text searched (without its tags, with markup)
    source_prefix: tuple[int, ...] = ()  # ids before every source (a language tag)
    target_prefix: list[list[int]] | None = None  # per line: the ids its output starts with
    terms: list[list[Term]] | None = None  # per line: the terminology's terms found in it
    phrases: list[list[list[int]]] | None = None  # per line: the phrases (ids) it must hold
    trees: list[Element] | None = None  # per line: its tags (markup), put back when finished
    tm: list[TmUse | None] | None = None  # per line: its TM match (exact ones not searched)

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def kind(self) -> tuple[SearchOptions, tuple[int, ...]]:
        """Prepared lines of one kind can be searched in one call."""
        return self.options, self.source_prefix

    def part(self, start: int, end: int) -> Prepared:
        """Lines start..end with what belongs to them."""

        def cut(items: list | None) -> list | None:
            return None if items is None else items[start:end]

        return replace(
            self, lines=self.lines[start:end], target_prefix=cut(self.target_prefix),
            terms=cut(self.terms), phrases=cut(self.phrases), trees=cut(self.trees),
            tm=cut(self.tm),
        )  # fmt: skip

    @staticmethod
    def join(parts: Sequence[Prepared]) -> Prepared:
        """Parts of one kind as one (what one has and another lacks: nothing for its lines)."""
        first = parts[0]
        assert all(p.kind == first.kind for p in parts), "one search, one kind"

        def joined(name: str, fill: Callable[[], object] = list) -> list | None:
            """Each part's list; a part without one gives fill() a line."""
            if all(getattr(p, name) is None for p in parts):
                return None
            return [x for p in parts for x in getattr(p, name) or [fill() for _ in p.lines]]

        return Prepared(
            first.options, [line for p in parts for line in p.lines], first.source_prefix,
            joined("target_prefix"), joined("terms"), joined("phrases"),
            tm=joined("tm", lambda: None),
        )  # fmt: skip

    def finish(self, found: list[list[Translation]]) -> list[list[Translation]]:
        """The search's results for these lines, with each line's terms and its tags put
        back around the aligned words (in place; returned for convenience)."""
        assert len(found) == len(self.lines), "a result per line"
        if self.terms is not None:
            for results, applied in zip(found, self.terms, strict=True):
                for r in results:
                    r.terms = applied
        if self.trees is not None:
            put_back(found, self.trees)
        for results, use in zip(found, self.tm or (), strict=False):
            for r in results:
                r.tm = use
                if use is not None and use.exact:
                    r.text = use.target
        return found
