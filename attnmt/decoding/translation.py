"""What a translation is (Translation: text, score, pieces, attention, warnings) and how the
CLI writes a list of them (format_results)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnmt.decoding.terminology import Term


@dataclass(frozen=True)
class TmUse:
    """The translation memory's segment a line met (translate --tm): its id, fuzzy score,
    source and target; `exact`: a 100 % match, returned as the translation without decoding
    (as CAT tools do); `fed`: a fuzzy match given to a model trained with data.tm after its
    line (Neural Fuzzy Repair); else shown beside the model's translation."""

    segment: int
    score: float
    source: str
    target: str
    exact: bool
    fed: bool = False


@dataclass
class Translation:
    text: str
    score: float
    src_pieces: list[str]  # source subwords (EOS included), the attention's columns
    tgt_pieces: list[str]  # output subwords (and EOS if it ended so), the attention's rows
    attention: torch.Tensor | None  # (len(tgt_pieces), len(src_pieces)) when asked for
    unmet: int = 0  # constrained search: the constraints it lacks (the length limit came first)
    terms: list[Term] = field(default_factory=list)  # the terminology's, found in the source
    # What the search left out of its line (a source or prefix cut, constraints not met), in
    # the words the CLI prints after "input line N: "; the same list for each of its n-best.
    warnings: list[str] = field(default_factory=list)
    tm: TmUse | None = None  # with a translation memory: the segment its line met


def format_results(
    results: list[list[Translation]],
    n_best: int,
    first: int,
    alignment: Callable[[Translation], str] | None = None,
) -> str:
    """Output lines: the 1-best of each input, or its n-best list numbered from `first`;
    with `alignment`, each line ends in ` ||| ` and the translation's word alignment."""

    def tail(t: Translation) -> str:
        return "" if alignment is None else f" ||| {alignment(t)}"

    if n_best == 1:
        return "".join(r[0].text + tail(r[0]) + "\n" for r in results)
    return "".join(
        f"{first + i} ||| {t.text} ||| {t.score:.4f}{tail(t)}\n"
        for i, r in enumerate(results)
        for t in r
    )
