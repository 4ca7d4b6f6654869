"""Options that several `attnmt` commands share (translate, eval, serve, distill)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
WorkersOption = Annotated[
    int | None,
    typer.Option(
        "--workers",
        min=1,
        max=64,
        help="CPU: batches searched at once, each on its share of the threads (default: config).",
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
ShortlistOption = Annotated[
    bool | None,
    typer.Option(
        "--shortlist/--no-shortlist",
        help="Output only each batch's lexical shortlist (the model directory's, from "
        "`attnmt shortlist`; default: config decode.shortlist).",
    ),
]
