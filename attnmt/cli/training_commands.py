"""The `attnmt` commands that make models and their training data: train, average, split,
plot and distill.

Parsed here, computed by the library (attnmt.cli.commands registers them on the app).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from attnmt.cli.options import (
    ModelLoad,
    TargetLangOption,
    decoding_options,
    model_options,
)
from attnmt.data.files import check_output_path
from attnmt.decoding.options import api_arguments
from attnmt.errors import AttnmtError


def train_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config file.")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="Model directory to create.")] = Path("model"),
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="Override a config key by dotted path, value parsed as YAML (repeatable), "
        "e.g. --set train.lr=0.001")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the run in --out from its last checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace the run in --out with a new one.")] = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No progress bar or log lines on stderr.")] = False,
    init_from: Annotated[Path | None, typer.Option(
        "--init-from", help="Fine-tune: start from this model directory.")] = None,
    weights: Annotated[str | None, typer.Option(
        "--weights", help="With --init-from: which of its weights start the run: best "
        "(default), last, averaged or step-N (train.init_weights).")] = None,
    time_budget: Annotated[str | None, typer.Option(
        "--time-budget", help="Stop by wall clock, e.g. 30m, 2h, 1h30m, 90s.")] = None,
) -> None:  # fmt: skip
    """Train a SentencePiece model and an encoder-decoder from a YAML config."""
    from attnmt.config import load_config
    from attnmt.training.loop import train

    if resume and overwrite:
        raise AttnmtError("--resume and --overwrite contradict each other; pick one")
    overrides = list(overrides or [])
    if init_from is not None:
        overrides.append(f"train.init_from={json.dumps(str(init_from))}")  # JSON is YAML
    if weights is not None:
        overrides.append(f"train.init_weights={json.dumps(weights)}")
    if time_budget is not None:
        overrides.append(f"train.time_budget={json.dumps(time_budget)}")
    cfg = load_config(config, overrides)
    train(cfg, out, overwrite=overwrite, resume=resume, quiet=quiet)


def average(
    model: Annotated[Path, typer.Argument(help="Trained model directory.")],
    last: Annotated[int | None, typer.Option(
        "--last", min=1, help="Average the last N kept checkpoints.")] = None,
    best: Annotated[int | None, typer.Option(
        "--best", min=1, help="Average the N kept checkpoints with the best dev score.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing averaged.safetensors.")] = False,
    include_early: Annotated[bool, typer.Option(
        "--include-early", help="Also average checkpoints from before the lr peak or from "
        "the run's first half (left out by default, as train.average_last leaves them).")
    ] = False,
) -> None:  # fmt: skip
    """Average checkpoints' weights into DIR/averaged.safetensors (use with --weights averaged)."""
    from attnmt.models.directory import AVERAGED_FILE, read_run_files
    from attnmt.training.checkpoints import (
        average_checkpoints,
        first_averaged_step,
        kept_checkpoints,
    )

    if (last is None) == (best is None):
        raise AttnmtError("give one of --last N or --best N")
    if not model.is_dir():
        raise AttnmtError(f"model directory not found: {model}")
    if (model / AVERAGED_FILE).exists() and not force:
        raise AttnmtError(
            f"{model / AVERAGED_FILE} exists (training writes it); --force replaces it"
        )
    by, n = ("last", last) if last is not None else ("best", best)
    kept = sorted(kept_checkpoints(model))
    start = (
        0
        if include_early
        else first_averaged_step(kept, read_run_files(model)[0].train.warmup_steps)
    )
    early = [s for s in kept if s < start]
    if early and len(kept) - len(early) < int(n):  # type: ignore[arg-type]
        raise AttnmtError(
            f"{n} checkpoints asked for, {len(kept) - len(early)} kept after the lr peak and in "
            f"the run's second half (left out: {', '.join(map(str, early))}); --include-early "
            "averages those too"
        )
    path, steps = average_checkpoints(model, int(n), by, start)  # type: ignore[arg-type]
    left = (
        f" (left out {', '.join(map(str, early))}: before the lr peak or in the run's first half)"
    )
    typer.echo(f"{path}: mean of steps {', '.join(map(str, steps))}" + (left if early else ""))


def split_corpus(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for train/dev/test.{src,tgt}.")],
    tsv: Annotated[list[Path] | None, typer.Option(
        "--tsv", help="A corpus as TSV: source TAB target (repeatable).")] = None,
    src: Annotated[list[Path] | None, typer.Option(
        "--src", help="A corpus's source file (repeatable, each with a --tgt).")] = None,
    tgt: Annotated[list[Path] | None, typer.Option(
        "--tgt", help="Its target file, line i the translation of the source's line i.")] = None,
    dev: Annotated[int, typer.Option("--dev", min=0, help="Dev pairs (unique sources).")] = 2000,
    test: Annotated[int, typer.Option("--test", min=0, help="Test pairs (unique sources).")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the shuffle.")] = 1,
    max_words: Annotated[int, typer.Option(
        "--max-words", min=1, help="Drop pairs with a longer side (words).")] = 200,
    max_ratio: Annotated[float, typer.Option(
        "--max-ratio", min=1.0, help="Drop pairs whose sides' lengths differ more.")] = 3.0,
    src_field: Annotated[int, typer.Option(
        "--src-field", min=1, help="--tsv: the source's column (from 1).")] = 1,
    tgt_field: Annotated[int, typer.Option(
        "--tgt-field", min=1, help="--tsv: the target's column (from 1).")] = 2,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace train/dev/test files that exist in --out.")] = False,
) -> None:  # fmt: skip
    """Clean one's own corpus (duplicates, empty or copied sides, over-long and misaligned
    pairs) and split it by unique source sentence into train, dev and test."""
    from attnmt.data.split import (
        Rules,
        SplitCounts,
        check_outputs,
        clean,
        read_corpora,
        split,
        write_splits,
    )

    src, tgt, tsv = src or [], tgt or [], tsv or []
    if len(src) != len(tgt):
        raise AttnmtError(f"{len(src)} --src but {len(tgt)} --tgt: give them in pairs")
    if not tsv and not src:
        raise AttnmtError("give a corpus: --tsv FILE, or --src FILE --tgt FILE")
    if src_field == tgt_field:
        raise AttnmtError(f"--src-field and --tgt-field are both {src_field}: two columns")
    check_outputs(out, [*tsv, *src, *tgt], force)
    counts = SplitCounts()
    corpora = read_corpora(tsv, zip(src, tgt, strict=True), counts, (src_field, tgt_field))
    pairs = clean(corpora, Rules(max_words, max_ratio), counts)
    write_splits(out, split(pairs, dev, test, seed, counts), counts)
    typer.echo(f"attnmt: {counts.read:,} pairs read", err=True)
    for rule, n in counts.dropped.items():
        typer.echo(f"attnmt: dropped {n:,} ({rule})", err=True)
    sizes = ", ".join(f"{name} {n:,}" for name, n in counts.written.items())
    typer.echo(f"attnmt: wrote {out}/{{train,dev,test}}.{{src,tgt}}: {sizes}", err=True)


def plot(
    models: Annotated[list[Path], typer.Argument(help="Model directories (one or more).")],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="PNG file to write.")] = Path("curves.png"),
) -> None:  # fmt: skip
    """Draw training curves (loss, dev BLEU, lr against steps and minutes) of runs into a PNG."""
    from attnmt.training.plot import plot_runs

    check_output_path(output, "--output")
    plot_runs(models, output)
    typer.echo(f"{output}: curves of {', '.join(str(m) for m in models)}")


@model_options()
@decoding_options("distill")
def distill_command(
    teacher: Annotated[list[Path], typer.Option(
        "--teacher", "-t", metavar="DIR",
        help="Teacher model directory (more than once: an ensemble).")],
    src: Annotated[Path, typer.Option(
        "--src", "-s", help="Source side of the training corpus (plain or .gz).")],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="The teacher's translations, one per source line.")],
    chunk_lines: Annotated[int, typer.Option(
        "--chunk-lines", min=1, help="Lines translated, then saved, at a time.")] = 2048,
    force: Annotated[bool, typer.Option(
        "--force", help="Start over: replace OUTPUT and any interrupted run.")] = False,
    target_lang: TargetLangOption = None,
    sampling: Annotated[bool, typer.Option(
        "--sampling", help="Draw each translation instead of searching (back-translation: "
        "the corpus entry printed is a synthetic one).")] = False,
    *,
    load: ModelLoad,
    asked: dict[str, Any],
) -> None:  # fmt: skip
    """Translate a corpus's source side with a teacher for sequence-level distillation, or
    (--sampling, a target-to-source model) monolingual text for back-translation; re-run the
    same command after an interruption to continue where it stopped."""
    from attnmt.training.distill import corpus_entry, distill

    check_output_path(output, "--output")
    translator = load.translator(teacher)
    draws = api_arguments(asked, sampling)["sampling"]
    done = distill(
        translator, teacher, load.weights, src, output, asked["beam"], target_lang, chunk_lines,
        force, sampling=draws,
    )  # fmt: skip
    rate = done.translated / max(done.seconds, 1e-9)
    typer.echo(
        f"distill: {done.lines:,} lines in {output} ({done.translated:,} translated now, "
        f"{done.seconds:.1f} s, {rate:.1f} lines/s); its entry in data.train:\n"
        f"{corpus_entry(src, output, synthetic=sampling)}", err=True,
    )  # fmt: skip
