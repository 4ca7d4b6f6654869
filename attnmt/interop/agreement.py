"""How many sentences an export translates exactly as attnmt does, and on which sentences."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from attnmt.data.text import read_lines, read_test_set
from attnmt.errors import AttnmtError
from attnmt.models.directory import read_run_files

CHECK_LINES = 100  # sentences `attnmt export` compares the export on


@dataclass
class Agreement:
    same: int  # sentences translated identically
    total: int
    source: str  # where they came from
    direction: str = ""  # a multilingual model's: "into en"
    search: str = "greedy"  # or "beam 5"
    ours: list[str] = field(default_factory=list)  # attnmt's translations (fp32)
    theirs: list[str] = field(default_factory=list)  # the export's

    def __str__(self) -> str:
        share = self.same / self.total if self.total else 1.0
        into = f", {self.direction}" if self.direction else ""
        where = f"{self.total} sentences of {self.source}{into}"
        return (
            f"agreement with attnmt ({self.search}, {where}): "
            f"{self.same}/{self.total} identical ({share:.0%})"
        )


def check_lines(model_dir: Path, given: Path | None) -> tuple[list[str], str, list[str]]:
    """The sentences to check an export on: the first CHECK_LINES of `given`, else of the
    model's (first) dev set's source where it is still readable (with its references), else
    none."""
    if given is not None:
        return read_lines(given)[:CHECK_LINES], str(given), []
    cfg, _ = read_run_files(model_dir)
    if not cfg.data.dev_sets:  # an imported model names no data
        return [], "", []
    dev = cfg.data.dev_sets[0]
    try:
        sources, refs = read_test_set(dev)
    except AttnmtError:
        return [], "", []
    return sources[:CHECK_LINES], str(dev.tsv or dev.src), refs[:CHECK_LINES]


def report_agreement(
    check: Callable[[list[str], str], list[Agreement]],
    model_dir: Path,
    given: Path | None,
    quantization: str | None,
) -> None:
    """Print an export's agreement with attnmt (`check` on check_lines' sentences), with a
    warning on stderr where an unquantized export disagrees on more than a tenth; a quantized
    one's what its rounding costs (quantization_cost), and a warning where that says broken."""
    lines, source, refs = check_lines(model_dir, given)
    if not lines:
        print("no sentences to check the export on (the dev set is gone); use --check FILE")
        return
    for found in check(lines, source):
        print(found, flush=True)
        if found.same < 0.9 * found.total and quantization is None:
            print("warning: an fp32 export should agree on nearly every sentence", file=sys.stderr)
        if quantization is not None and found.theirs:
            line, broken = quantization_cost(found, quantization, [] if found.direction else refs)
            print(line, flush=True)
            if broken:
                print(f"warning: the {quantization} export looks broken: its translations "
                      "share little with attnmt's (chrF below 50)", file=sys.stderr)  # fmt: skip


def quantization_cost(found: Agreement, quantization: str, refs: list[str]) -> tuple[str, bool]:
    """What a quantized export's rounding costs on the check lines: BLEU and chrF of attnmt's
    fp32 translations and of the export's against the references (where the dev set gives
    them), and chrF of the export's against attnmt's; broken where that is below 50 (a weak
    model's near-ties flip often, but its int8 translations stay close to its fp32 ones)."""
    from attnmt.decoding.scores import score

    close = score(found.theirs, found.ours).chrf
    cost = f"cost of {quantization} ({found.search}): chrF {close:.1f} against attnmt's fp32"
    if refs:
        fp32, rounded = score(found.ours, refs), score(found.theirs, refs)
        cost += (
            f"; against the references BLEU {fp32.bleu:.2f} (fp32) -> {rounded.bleu:.2f}, "
            f"chrF {fp32.chrf:.2f} -> {rounded.chrf:.2f}"
        )
    return cost, close < 50.0
