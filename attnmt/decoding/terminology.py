"""What a translation must contain, as users give it: terminology ("this term is translated as
that": a TSV file of source term TAB target term; where a source line contains a term, on word
boundaries and with the case the file gives, its target term becomes a constraint of that
line's search, attnmt.decoding.constraints) and constraint files (a JSON list of phrases per
input line)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attnmt.data.text import read_lines
from attnmt.errors import DataError


@dataclass(frozen=True)
class Term:
    source: str
    target: str


class Terminology:
    """Terms, found in a line by one regular expression: the longest term at each place,
    none overlapping, and only where no letter or digit touches it on either side."""

    def __init__(self, terms: list[Term]) -> None:
        self.terms = {t.source: t for t in terms}
        longest_first = sorted(self.terms, key=len, reverse=True)
        alternatives = "|".join(map(re.escape, longest_first))
        self.pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)") if terms else None

    @classmethod
    def load(cls, path: Path) -> Terminology:
        """Read a TSV file (plain or .gz) of `source<TAB>target` lines; blank lines and lines
        starting with # are skipped; anything else is an error naming the file and line."""
        terms: dict[str, tuple[int, Term]] = {}
        for n, raw in enumerate(read_lines(path), 1):
            line = raw.rstrip("\r\n")
            if not line.strip() or line.startswith("#"):
                continue
            fields = line.split("\t")
            if len(fields) != 2 or not all(x.strip() for x in fields):
                raise DataError(
                    f"{path}:{n}: expected a source term and a target term separated by one "
                    f"tab, found {len(fields)} field(s): {line[:80]!r}"
                )
            term = Term(fields[0].strip(), fields[1].strip())
            if term.source in terms and terms[term.source][1] != term:
                raise DataError(
                    f"{path}:{n}: {term.source!r} is already translated as "
                    f"{terms[term.source][1].target!r} on line {terms[term.source][0]}"
                )
            terms[term.source] = (n, term)
        if not terms:
            raise DataError(f"{path}: no terms (a line is: source term<TAB>target term)")
        return cls([t for _, t in terms.values()])

    def find(self, line: str) -> list[Term]:
        """The terms `line` contains, in their order there, each once."""
        if self.pattern is None:
            return []
        found = [self.terms[m.group(0)] for m in self.pattern.finditer(line)]
        return list(dict.fromkeys(found))


def read_constraints(path: Path) -> Iterator[list[str]]:
    """A constraints file's lines, each a JSON list of target phrases (`[]`: none; an empty
    line too); anything else is an error naming the file and line."""
    for n, line in enumerate(read_lines(path), 1):
        try:
            phrases = json.loads(line) if line.strip() else []
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg}): {line[:80]!r}") from None
        except RecursionError:
            raise DataError(f"{path}:{n}: JSON nested too deeply to be a list of phrases") from None
        if not isinstance(phrases, list) or not all(
            isinstance(p, str) and p.strip() for p in phrases
        ):
            raise DataError(
                f'{path}:{n}: expected a JSON list of non-empty phrases, e.g. ["Haus", '
                f'"grüne Wiese"], found {line[:80]!r}'
            )
        yield phrases
