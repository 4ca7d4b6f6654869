"""The HTTP API's shapes: the server's limits, and the request and answer models that
/openapi.json documents (closed and strict, as the config is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from attnmt.data.tm import MAX_SEGMENT_CHARS
from attnmt.decoding.options import OPTIONS, SAMPLING, DecodeOption
from attnmt.decoding.translator import MAX_CONSTRAINTS


@dataclass(frozen=True)
class Limits:
    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line
    max_queue: int = 256  # requests waiting
    batch_wait_ms: float = 5.0  # how long an idle server's first request waits for others
    batch_lines: int = 256  # lines in the running search at most (the others wait their turn)
    batch_chars: int = 8000  # their characters at most (at least one line)
    max_search: int = 512  # lines × beam (or draws) per request
    max_attention: int = 2_000_000  # attention weights a request may ask for (at most)

    @property
    def max_body(self) -> int:
        """Request bytes at most: every character JSON-escaped as a surrogate pair (12
        bytes), plus room for the rest of the object."""
        return self.max_lines * (12 * self.max_chars + 8) + 4096


MAX_TERMS = 256  # [source, target] pairs of a request's own glossary
MAX_TERM_CHARS = 200  # characters of a glossary's source (all its forms) or target


class _Closed(BaseModel):
    """Closed, as the config is: an unknown field is refused (422), not ignored; strict, so
    `"beam": true` or `"beam": "5"` is refused too, as the Python API refuses them."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _field(option: DecodeOption) -> Any:
    """A declared decoding option as a request field: its type, bounds, default and help."""
    kind: Any = Literal[option.choices] if option.choices else option.kind
    kind = kind if option.default is not None else kind | None
    bounds = {} if option.choices else {"ge": option.low, "le": option.high}
    return kind, Field(option.default, description=option.help, **bounds)


def _declared(group: str) -> dict[str, Any]:
    return {n: _field(o) for n, o in OPTIONS.items() if o.group == group}


SamplingRequest = create_model(
    "SamplingRequest", __base__=_Closed, __doc__="Draw translations instead of searching "
    "(translate --sampling).", **_declared(SAMPLING),
)  # fmt: skip


class _Request(_Closed):
    """A request to translate: its text and what to return besides translations (the
    decoding options, declared in attnmt.decoding.options, are added by TranslateRequest)."""

    text: list[str] = Field(description="Sentences to translate, one per item.")
    sampling: SamplingRequest | None = Field(None, description="Draw instead of searching.")
    attention: bool = Field(
        False, description="Also return each hypothesis's source attention (`attention`)."
    )
    target_lang: str | None = Field(
        None, description="A multilingual model: the language to translate into."
    )
    prefix: list[str] | None = Field(
        None, description="Per line of `text`, the text its translation starts with "
        '(prefix-constrained search: interactive MT); "" for none.',
    )  # fmt: skip
    constraints: list[list[str]] | None = Field(
        None, description="Per line of `text`, target phrases its translation must contain "
        f"(lexically constrained beam search; at most {MAX_CONSTRAINTS} a line, terms "
        "included); [] for none.",
    )  # fmt: skip
    alignments: bool = Field(
        False, description="Also return each line's word alignment (`alignments`)."
    )
    terminology: list[list[str]] | None = Field(
        None, description="A glossary of this request's own: [source, target] pairs (a "
        "source may list forms separated by |), found in each line as serve --terminology's "
        f"terms are and joined to them (beam search); at most {MAX_TERMS} pairs.",
    )  # fmt: skip
    terms_ignore_case: bool | None = Field(
        None, description="true: the request's glossary and the server's terminology match "
        "whatever their case (HANDY finds Handy); default: as serve --terms-ignore-case.",
    )  # fmt: skip
    markup: bool = Field(
        False, description="The lines hold inline XML/HTML tags: each is put back around "
        "the aligned output words (as translate --markup).",
    )  # fmt: skip


TranslateRequest = create_model(
    "TranslateRequest", __base__=_Request, __doc__=_Closed.__doc__, **_declared(""),
)  # fmt: skip


class TmEntry(_Closed):
    """POST /tm: an approved pair (a post-edit), stored in the server's translation memory
    (serve --tm TM --tm-write); the next request for a similar sentence meets it."""

    source: str = Field(min_length=1, max_length=MAX_SEGMENT_CHARS, description="The source.")
    target: str = Field(min_length=1, max_length=MAX_SEGMENT_CHARS, description="Its translation.")


class TmMatch(BaseModel):
    segment: int = Field(description="The TM segment's id.")
    score: float = Field(description="Its fuzzy score: 1 - word edit distance / words.")
    source: str
    target: str
    exact: bool = Field(description="A 100 % match: the translation is the segment's target.")
    fed: bool = Field(description="Given to a model trained with matches after the line.")


class Scored(BaseModel):
    text: str
    score: float


class AttentionMap(BaseModel):
    src_pieces: list[str] = Field(description="Source pieces, EOS included (the columns).")
    tgt_pieces: list[str] = Field(description="Output pieces, EOS included if it ended (rows).")
    weights: list[list[list[list[float]]]] = Field(
        description="layers x heads x target pieces x source pieces; each row sums to 1. A "
        "Transformer: every decoder layer and head; the GRU model (or an ensemble): one."
    )


class AppliedTerm(BaseModel):
    source: str
    target: str


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="The best translation of each line.")
    alignments: list[list[tuple[int, int]]] | None = Field(
        None, description="With alignments: per line, [source word, target word] pairs of "
        "its best translation (whitespace words, from 0; as translate --alignments).",
    )  # fmt: skip
    terms: list[list[AppliedTerm]] | None = Field(
        None, description="With serve --terminology: each line's terms, found in it and "
        "required in its translation.",
    )  # fmt: skip
    n_best: list[list[Scored]] | None = Field(
        None, description="With n_best above 1: each line's hypotheses, best first."
    )
    attention: list[list[AttentionMap]] | None = Field(
        None, description="With attention: each line's maps, one per hypothesis (as n_best)."
    )
    tm: list[TmMatch | None] | None = Field(
        None, description="With serve --tm: each line's translation memory match (null: none "
        "scoring serve --tm-threshold); an exact one is the line's translation.",
    )  # fmt: skip
    warnings: list[list[str]] | None = Field(
        None, description="Where a line's search left something out (a source or prefix cut "
        "to a limit, constraints not met): per line, what, in the words translate prints on "
        "stderr after 'input line N: '; [] for the others. Absent when no line has one.",
    )  # fmt: skip


class ErrorResponse(BaseModel):
    error: str = Field(description="What was wrong, in one line (every error has this shape).")
