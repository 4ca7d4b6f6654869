"""Options that several `attnmt` commands share, and the one way a command loads a model
(translate, eval, score, serve, distill: `model_options` and ModelLoad)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

if TYPE_CHECKING:
    from attnmt.decoding.options import DecodeOption
    from attnmt.decoding.translator import Translator

ModelsOption = Annotated[
    list[Path],
    typer.Option(
        "--model", "-m", metavar="DIR",
        help="Trained model directory (more than once: an ensemble).",
    ),
]  # fmt: skip
WeightsOption = Annotated[
    str,
    typer.Option(
        "--weights",
        help="Which weights: best (falls back to last while there is no best), last, averaged "
        "(attnmt average), step-N (a kept checkpoint), or a .safetensors path.",
    ),
]
DeviceOption = Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]
PrecisionOption = Annotated[
    str | None,
    typer.Option(
        "--precision",
        help="Number format to decode in: fp32, bf16, fp16 or int8 (CPU) (default: config).",
    ),
]
MatmulOption = Annotated[
    str | None,
    typer.Option(
        "--matmul",
        help="CPU fp32 matmuls: auto, blas or onednn (default: config).",
    ),
]
TargetLangOption = Annotated[
    str | None,
    typer.Option(
        "--target-lang",
        metavar="LANG",
        help="A multilingual model: the language to translate into.",
    ),
]
CompileOption = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Decode with the Transformer's step compiled ahead of time (fp32 or int8, CPU): "
        "compiled once per model and machine (15-30 s), then loaded from its cache folder. "
        "Default: on where it applies and a C++ compiler is found, unless ATTNMT_COMPILE=0.",
        show_default=False,
    ),
]
WorkersOption = Annotated[
    int | None,
    typer.Option(
        "--workers",
        min=1,
        max=64,
        help="CPU: batches searched at once, each on its share of the threads (serve: search "
        "processes of one thread each; default: config).",
    ),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        min=1,
        max=1024,
        help="CPU threads (default: as many as other processes leave free, chosen again as "
        "the machine's load changes).",
    ),
]
UnkOption = Annotated[
    bool | None,
    typer.Option(
        "--allow-unk/--no-unk",
        help="Whether <unk> may be an output (default: config decode.allow_unk; a model "
        "imported from Marian: --no-unk, as marian-decoder).",
    ),
]
TerminologyOption = Annotated[
    Path | None,
    typer.Option(
        "--terminology",
        help="A TSV file of source term TAB target term: a term found in a line (on word "
        "boundaries) must be translated as given (beam search).",
    ),
]
TermsIgnoreCaseOption = Annotated[
    bool,
    typer.Option(
        "--terms-ignore-case",
        help="--terminology: match its terms whatever their case (Fahrrad, fahrrad, FAHRRAD).",
    ),
]
TermsPrefixOption = Annotated[
    bool,
    typer.Option(
        "--terms-prefix",
        help="--terminology: a term also matches where it starts a longer word (a compound's "
        "first part: Fahrrad in Fahrradhelm).",
    ),
]
TmOption = Annotated[
    Path | None,
    typer.Option(
        "--tm",
        metavar="TM",
        help="A translation memory (attnmt tm import): a 100 % match is the translation "
        "(not decoded), a fuzzy match is reported with it.",
    ),
]
TmPairOption = Annotated[
    str | None,
    typer.Option("--tm-pair", metavar="SRC-TGT", help="--tm: its language pair (default: "
                 "the TM's only one)."),
]  # fmt: skip
TmThresholdOption = Annotated[
    float,
    typer.Option("--tm-threshold", min=0.0, max=1.0, help="--tm: the lowest fuzzy score "
                 "reported (1.0: exact matches only)."),
]  # fmt: skip
ShortlistOption = Annotated[
    bool | None,
    typer.Option(
        "--shortlist/--no-shortlist",
        help="Output only each batch's lexical shortlist (the model directory's, from "
        "`attnmt shortlist`; default: config decode.shortlist).",
    ),
]


@dataclass(frozen=True)
class ModelLoad:
    """How a command loads its model(s): the options every model-using command shares."""

    weights: str = "best"
    device: str = "auto"
    precision: str | None = None
    matmul: str | None = None
    workers: int | None = None
    threads: int | None = None
    allow_unk: bool | None = None
    compile: bool | None = None

    def translator(
        self,
        models: list[Path],
        terminology: Path | None = None,
        shortlist: bool | None = None,
        terms: tuple[bool, bool] = (False, False),
    ) -> Translator:
        """The one way a command loads a Translator (a terminology file is checked first);
        `terms`: the terminology's forms matched whatever their case, and as a longer word's
        start (--terms-ignore-case, --terms-prefix)."""
        from attnmt.data.text import check_input
        from attnmt.decoding.translator import Translator

        if terminology is not None:
            check_input(terminology)
        translator = Translator.load(
            models, self.device, self.weights, self.precision, self.matmul, self.workers,
            terminology, shortlist, self.threads, *terms, compile=self.compile,
        )  # fmt: skip
        if self.allow_unk is not None:  # every search of this command: the config's default
            decode = translator.cfg.decode.model_copy(update={"allow_unk": self.allow_unk})
            translator.cfg = translator.cfg.model_copy(update={"decode": decode})
        return translator


_SHARED = {
    "weights": (WeightsOption, "best"),
    "device": (DeviceOption, "auto"),
    "workers": (WorkersOption, None),
    "precision": (PrecisionOption, None),
    "matmul": (MatmulOption, None),
    "threads": (ThreadsOption, None),
    "allow_unk": (UnkOption, None),
    "compile": (CompileOption, None),
}


def model_options(
    workers: bool = True, search: bool = True
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command --weights, --device, --precision, --matmul, --threads, --compile (and
    --workers, and --allow-unk/--no-unk for commands that search) and pass them to it as one
    `load: ModelLoad` argument: declared once, read once."""
    names = [n for n in _SHARED if (workers or n != "workers") and (search or n != "allow_unk")]
    added = [_keyword(n, _SHARED[n][1], _SHARED[n][0]) for n in names]
    return lambda command: _with_options(command, "load", added, lambda v: ModelLoad(**v))


def decoding_options(command: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the decoding options attnmt.decoding.options declares for it (flag,
    type, bounds, default, help from the one declaration) and pass their values to it as one
    `asked: dict` argument, by the options' names (Translator.options' keywords)."""
    from attnmt.decoding.options import OPTIONS

    declared = [o for o in OPTIONS.values() if command in o.commands]
    added = [_keyword(o.name, o.default, cli_annotation(o)) for o in declared]
    return lambda fn: _with_options(fn, "asked", added, dict)


def cli_annotation(option: DecodeOption) -> Any:
    """The typer option of a declared decoding option."""
    flags = [option.flag, option.short] if option.short else [option.flag]
    kind: Any = Literal[option.choices] if option.choices else option.kind
    kind = kind if option.default is not None else kind | None
    bounds = {} if option.choices else {"min": option.low, "max": option.high}
    return Annotated[kind, typer.Option(*flags, help=option.help, **bounds)]


def _keyword(name: str, default: Any, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=annotation)  # fmt: skip


def _with_options(
    command: Callable[..., None],
    argument: str,
    added: list[inspect.Parameter],
    make: Callable[[dict[str, Any]], Any],
) -> Callable[..., None]:
    """`command` with the options `added` to its signature (what typer reads), their values
    passed to it as one argument: argument=make({name: value})."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != argument]
    names = [p.name for p in added]

    @functools.wraps(command)
    def run(**given: Any) -> None:
        command(**{argument: make({n: given.pop(n) for n in names})}, **given)

    run.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in [*own, *added]}
    return run
