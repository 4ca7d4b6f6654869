"""The decoding options a user may ask for, declared once: name, type, bounds, default, help,
and where each applies. The CLI's options (attnmt.cli.options.decoding_options), the Python
API's checks (Translator.options), the HTTP request schema (attnmt.serve.schema) and the
ONNX/web manifest (attnmt.interop.onnx.manifest) are all made from OPTIONS; the test
tests/decoding/test_options.py walks it and fails when a surface misses one.

Adding one: a DecodeOption here, then its use in the search (docs/development.md shows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

from attnmt.config import LengthNorm
from attnmt.errors import AttnmtError

SAMPLING = "sampling"  # the group of the options that only a sampled search reads


@dataclass(frozen=True)
class DecodeOption:
    """One option: its name is the API's keyword and the HTTP field (inside the request's
    `sampling` object for the sampling group); its flag is --name with dashes."""

    name: str
    kind: type  # int, float or str
    default: Any  # None: the model's decode section decides
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    group: str = ""  # SAMPLING: read only with sampling (HTTP: inside `sampling`)
    commands: tuple[str, ...] = ("translate",)  # the CLI commands that take it
    # The exports (ONNX manifest, web page): "" where their search honours the option (its
    # default is the model's, written in the manifest), else why it cannot (said at export
    # and in the page).
    not_exported: str = ""
    short: str = ""  # the CLI flag's one-letter form ("-b"), if any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        if self.choices:
            return " or ".join(self.choices)
        if self.kind is int:
            return f"an integer from {self.low} to {self.high}"
        return f"a number from {self.low:g} to {self.high:g}"

    def check(self, value: object) -> None:
        """One clear error (AttnmtError naming the option and its bounds) for a value the
        option does not take; None is the default and always taken."""
        if value is None:
            return
        if self.choices:
            ok = isinstance(value, str) and value in self.choices
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value)  # type: ignore[arg-type]
        if ok and not self.choices:
            ok = self.low <= value <= self.high  # type: ignore[operator]
        if not ok:
            raise AttnmtError(f"{self.name} {value!r}: expected {self.bounds()}")


_SAMPLED = "an export searches, greedy or beam: it does not sample"
OPTIONS: dict[str, DecodeOption] = {
    o.name: o
    for o in (
        DecodeOption(
            "beam",
            int,
            None,
            "Beam size; 1 = greedy (default: the model's decode.beam; distill: 5).",
            1,
            100,
            commands=("translate", "eval", "distill"),
            short="-b",
        ),
        DecodeOption(
            "n_best",
            int,
            1,
            "Hypotheses per line with their scores (at most the beam; with sampling, draws).",
            1,
            1000,
            not_exported="an export returns one translation a line",
        ),
        DecodeOption(
            "length_penalty",
            float,
            None,
            "Beam search's length penalty alpha (default: the model's decode.length_penalty).",
            0.0,
            10.0,
        ),
        DecodeOption(
            "length_norm",
            str,
            None,
            "Beam search's length normalisation: gnmt ((5 + "
            "length) / 6)^alpha, or length (length^alpha, CTranslate2's and Marian's) "
            "(default: the model's decode.length_norm).",
            choices=get_args(LengthNorm),
        ),
        DecodeOption(
            "temperature",
            float,
            1.0,
            "Sampling: divide the logits by this.",
            0.01,
            100.0,
            group=SAMPLING,
            commands=("translate", "distill"),
            not_exported=_SAMPLED,
        ),
        DecodeOption(
            "top_k",
            int,
            0,
            "Sampling: draw from the K likeliest tokens (0: all).",
            0,
            1 << 30,
            group=SAMPLING,
            commands=("translate", "distill"),
            not_exported=_SAMPLED,
        ),
        DecodeOption(
            "seed",
            int,
            0,
            "Sampling: the seed of the draws.",
            0,
            (1 << 63) - 1,
            group=SAMPLING,
            commands=("translate", "distill"),
            not_exported=_SAMPLED,
        ),
    )
}


# The sampling group in the order of the API's `sampling` tuple and of search.Sampling.
SAMPLING_NAMES = tuple(n for n, o in OPTIONS.items() if o.group == SAMPLING)


def sampling_of(asked: dict[str, Any]) -> tuple[float, int, int]:
    """The sampling group's values (temperature, top_k, seed) from named values, defaults
    where absent: the API's `sampling` tuple."""
    return tuple(asked.get(n, OPTIONS[n].default) for n in SAMPLING_NAMES)  # type: ignore[return-value]


def exported() -> dict[str, DecodeOption]:
    """The options an export's search honours."""
    return {n: o for n, o in OPTIONS.items() if not o.not_exported}


def not_exported() -> dict[str, str]:
    """The options an export cannot do, and why."""
    return {n: o.not_exported for n, o in OPTIONS.items() if o.not_exported}


def exports_note() -> str:
    """What `attnmt export --format onnx | web` says of the options: those its search
    honours, and those it cannot do with why (the page lists the latter too)."""
    why: dict[str, list[str]] = {}
    for name, reason in not_exported().items():
        why.setdefault(reason, []).append(name)
    cannot = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in why.items())
    return f"the export's search takes {', '.join(exported())}; not {cannot}"


def api_arguments(asked: dict[str, Any], sampling: bool) -> dict[str, Any]:
    """Named option values (the CLI's, the HTTP request's) as Translator.options' keywords:
    the sampling group as its `sampling` tuple when sampling, else left out."""
    given = {n: v for n, v in asked.items() if OPTIONS[n].group != SAMPLING}
    return given | {"sampling": sampling_of(asked) if sampling else None}
