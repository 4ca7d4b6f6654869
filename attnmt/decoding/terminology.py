"""What a translation must contain, as users give it: terminology ("this term is translated as
that": a TSV file of source term TAB target term; where a source line contains a term, on word
boundaries and with the case the file gives, its target term becomes a constraint of that
line's search, attnmt.decoding.constraints) and constraint files (a JSON list of phrases per
input line).

A language that inflects and compounds (German: Fahrrad, Fahrrads, Fahrräder, Fahrradhelm)
needs more than one exact form: an entry's source may list forms separated by `|`
(`Fahrrad|Fahrrads|Fahrräder<TAB>bicycle`), `ignore_case` matches them whatever their case, and
`prefix` also matches a form that starts a longer word (a compound's first part)."""

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
    """Terms, found in a line by one regular expression: the longest form at each place, none
    overlapping, where no letter or digit touches it (with `prefix`: before it only)."""

    def __init__(self, terms: list[Term], ignore_case: bool = False, prefix: bool = False) -> None:
        self.ignore_case, self.prefix = ignore_case, prefix
        key = str.casefold if ignore_case else str
        self.terms = {key(form): t for t in terms for form in t.source.split("|")}
        longest_first = sorted(self.terms, key=len, reverse=True)
        forms = "|".join(map(re.escape, longest_first))
        end = "" if prefix else r"(?!\w)"
        flags = re.IGNORECASE if ignore_case else 0
        self.pattern = re.compile(rf"(?<!\w)(?:{forms}){end}", flags) if terms else None
        self._key = key

    def all_terms(self) -> list[Term]:
        """Each term once (a term with several forms is keyed by each)."""
        return list({id(t): t for t in self.terms.values()}.values())

    @classmethod
    def load(cls, path: Path, ignore_case: bool = False, prefix: bool = False) -> Terminology:
        """Read a TSV file (plain or .gz) of `source<TAB>target` lines (a source may list forms
        separated by `|`); blank lines and lines starting with # are skipped; anything else is
        an error naming the file and line."""
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
            forms = [f.strip() for f in fields[0].split("|")]
            if not all(forms):
                raise DataError(f"{path}:{n}: an empty form in {fields[0][:80]!r} (forms: a|b)")
            term = Term("|".join(forms), fields[1].strip())
            for form in forms:
                seen = terms.get(form.casefold() if ignore_case else form)
                if seen is not None and seen[1].target != term.target:
                    raise DataError(
                        f"{path}:{n}: {form!r} is already translated as {seen[1].target!r} on "
                        f"line {seen[0]}"
                    )
                terms[form.casefold() if ignore_case else form] = (n, term)
        if not terms:
            raise DataError(f"{path}: no terms (a line is: source term<TAB>target term)")
        return cls(list({id(t): t for _, t in terms.values()}.values()), ignore_case, prefix)

    def find(self, line: str) -> list[Term]:
        """The terms `line` contains, in their order there, each once."""
        if self.pattern is None:
            return []
        # A match the key does not fold to a form (Unicode case rules beyond re's) is skipped.
        found = [self.terms.get(self._key(m.group(0))) for m in self.pattern.finditer(line)]
        return list(dict.fromkeys(t for t in found if t is not None))


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
