"""The `attnmt` commands: train, translate, average, split, import, export, plot, serve,
shortlist, distill, eval, score (and --version).

Parses arguments and calls library functions; attnmt.cli.main runs them and turns any AttnmtError
(a problem with what the user gave us) into one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from attnmt import __version__
from attnmt.cli.options import (
    ModelLoad,
    ShortlistOption,
    TargetLangOption,
    TerminologyOption,
    TermsIgnoreCaseOption,
    TermsPrefixOption,
    model_options,
)
from attnmt.data.files import OutputSink, atomic_write_bytes, check_output_path
from attnmt.errors import AttnmtError

app = typer.Typer(
    name="attnmt",
    help="Attention-based neural machine translation: train, translate, evaluate.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnmt {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Attention-based neural machine translation: train, translate, evaluate."""


@app.command("train", short_help="Train a model from a YAML config.")
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
    if time_budget is not None:
        overrides.append(f"train.time_budget={json.dumps(time_budget)}")
    cfg = load_config(config, overrides)
    train(cfg, out, overwrite=overwrite, resume=resume, quiet=quiet)


@app.command(short_help="Translate lines: greedy, beam, sampling, n-best.")
@model_options()
def translate(
    model: Annotated[list[Path], typer.Option(
        "--model", "-m", metavar="DIR",
        help="Trained model directory (more than once: an ensemble).")],
    input: Annotated[Path | None, typer.Option(
        "--input", "-i", help="Input file (default: stdin).")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Output file (default: stdout).")] = None,
    beam: Annotated[int | None, typer.Option(
        "--beam", "-b", min=1, max=100, help="Beam size; 1 = greedy (default: config).")] = None,
    n_best: Annotated[int, typer.Option(
        "--n-best", min=1, max=1000,
        help="Write the N best hypotheses per input: 'LINE ||| TEXT ||| SCORE'.")] = 1,
    length_penalty: Annotated[float | None, typer.Option(
        "--length-penalty", min=0.0, max=10.0,
        help="Length penalty alpha (default: config).")] = None,
    length_norm: Annotated[str | None, typer.Option(
        "--length-norm",
        help="Beam search's length normalisation: gnmt ((5 + length) / 6)^alpha, or length "
        "(length^alpha, CTranslate2's and Marian's) (default: config).")] = None,
    batch_tokens: Annotated[int | None, typer.Option(
        "--batch-tokens", min=1, help="Source tokens per batch (default: config).")] = None,
    attention: Annotated[Path | None, typer.Option(
        "--attention",
        help="Write each sentence's attention (JSON + PNG) to this directory.")] = None,
    attention_layer: Annotated[int, typer.Option(
        "--attention-layer", help="Transformer: decoder layer (-1 = top).")] = -1,
    attention_head: Annotated[int | None, typer.Option(
        "--attention-head", min=0, help="Transformer: one head (default: mean of heads).")] = None,
    sampling: Annotated[bool, typer.Option(
        "--sampling", help="Draw translations instead of searching.")] = False,
    temperature: Annotated[float, typer.Option(
        "--temperature", min=0.01, max=100.0, help="Sampling temperature.")] = 1.0,
    top_k: Annotated[int, typer.Option(
        "--top-k", min=0, help="Sample from the K likeliest tokens (0: all).")] = 0,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Sampling seed.")] = 0,
    target_lang: TargetLangOption = None,
    prefix: Annotated[Path | None, typer.Option(
        "--prefix", help="A target prefix per input line: each translation starts with its "
        "line's (interactive MT, autocompletion); an empty line: none.")] = None,
    constraints: Annotated[Path | None, typer.Option(
        "--constraints", help='Per input line, a JSON list of target phrases its translation '
        'must contain, e.g. ["Haus"] (beam search); [] or an empty line: none.')] = None,
    terminology: TerminologyOption = None,
    terms_ignore_case: TermsIgnoreCaseOption = False,
    terms_prefix: TermsPrefixOption = False,
    shortlist: ShortlistOption = None,
    alignments: Annotated[bool, typer.Option(
        "--alignments", help="End each output line in ' ||| ' and its word alignment: "
        "Moses-style i-j pairs (source word i, target word j, from 0).")] = False,
    alignment_layer: Annotated[int | None, typer.Option(
        "--alignment-layer", help="Transformer: the decoder layer to align with (default: "
        "the second from the top).")] = None,
    markup: Annotated[bool, typer.Option(
        "--markup", help="Lines hold inline XML/HTML tags: translate the text and put each "
        "tag back around the aligned output words.")] = False,
    *,
    load: ModelLoad,
) -> None:  # fmt: skip
    """Translate text, one line in, one line out (beam search, greedy with --beam 1, or
    --sampling: --n-best K draws K per line)."""
    # Long: typer declares each of the command's options in its signature; the body is short.
    from attnmt.data.text import check_input
    from attnmt.decoding.alignment import moses
    from attnmt.decoding.heatmap import AttentionMaps
    from attnmt.decoding.translate import format_results

    if output is not None:
        check_output_path(output, "--output")
    source = None if input is None or str(input) == "-" else input
    if source is not None:
        check_input(source)  # a missing or unreadable file fails before the model loads
    prefixes, wanted = per_line_inputs(prefix, constraints, terminology)
    translator = load.translator(model, terminology, shortlist, (terms_ignore_case, terms_prefix))
    spec, maps = None, None
    if attention is not None:
        spec = translator.attention_spec(attention_layer, attention_head)
        maps = AttentionMaps(attention, translator.cfg.model, spec)  # creates the directory
    elif alignments or markup:  # with --attention, from its layer and head
        spec = translator.alignment_spec(alignment_layer)
    draws = (temperature, top_k, seed) if sampling else None
    options = translator.options(beam, n_best, length_penalty, spec, draws, length_norm)
    done = 0  # lines translated so far
    # Written chunk by chunk as each is done: a line sent alone through a pipe or typed at a
    # terminal is answered at once.
    with OutputSink(output) as sink:
        chunks = translator.stream(
            source, options, batch_tokens, None, target_lang, prefixes, wanted, markup
        )
        for lines, results in chunks:
            sink.write(format_results(results, n_best, done, moses if alignments else None))
            if maps is not None:
                maps.write([r[0] for r in results], first=done)
            done += len(lines)


def per_line_inputs(
    prefix: Path | None, constraints: Path | None, terminology: Path | None
) -> tuple[Iterator[str] | None, Iterator[list[str]] | None]:
    """translate's --prefix and --constraints as per-line iterators (checked before the model
    loads, as --terminology is)."""
    from attnmt.data.text import check_input, read_lines
    from attnmt.decoding.terminology import read_constraints

    for given in (prefix, constraints, terminology):
        if given is not None:
            check_input(given)
    prefixes = None if prefix is None else iter(read_lines(prefix))
    return prefixes, None if constraints is None else read_constraints(constraints)


@app.command(short_help="Average checkpoints into averaged.safetensors.")
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


@app.command("split", short_help="Clean a corpus and split it into train, dev and test.")
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


@app.command("import", short_help="Import a pretrained OPUS-MT / MarianMT model.")
def import_model(
    source: Annotated[Path, typer.Argument(
        help="A pretrained model: a directory, a Marian decoder.yml or model.npz.")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="attnmt model directory to create.")],
    format: Annotated[str | None, typer.Option(
        "--format", help="huggingface (a MarianMTModel directory) or marian (a native Marian "
        "model.npz with its decoder.yml); default: detected.")] = None,
    spm: Annotated[list[Path] | None, typer.Option(
        "--spm", help="marian: the SentencePiece model of the vocabularies' pieces (twice: "
        "source, then target), when the vocabularies are not SentencePiece models.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
) -> None:  # fmt: skip
    """Import a pretrained model (OPUS-MT's MarianMT, or a native Marian model) as an attnmt
    model directory."""
    from attnmt.interop.huggingface import import_huggingface
    from attnmt.interop.marian import import_marian

    if format is None:
        native = source.suffix in (".npz", ".yml") or not (source / "config.json").exists()
        format = "marian" if native else "huggingface"
    if format not in ("huggingface", "marian"):
        raise AttnmtError(f"--format {format!r}: expected huggingface or marian")
    if spm and format != "marian":
        raise AttnmtError("--spm is for --format marian (a MarianMTModel has its own)")
    if format == "marian":
        done = import_marian(source, out, force, spm or [])
    else:
        done = import_huggingface(source, out, force)
    for note in done.notes:
        typer.echo(f"attnmt: note: {note}", err=True)
    if done.unknown_pieces:
        typer.echo(
            f"attnmt: note: {done.unknown_pieces:,} SentencePiece pieces are not in the model's "
            "vocabulary: they read and write as <unk>", err=True,
        )  # fmt: skip
    typer.echo(
        f"attnmt: imported {source} into {out}: {done.parameters:,} parameters, "
        f"{done.src_pieces:,} / {done.tgt_pieces:,} source / target pieces", err=True,
    )  # fmt: skip


@app.command(short_help="Export to CTranslate2, Hugging Face, ONNX or a web page.")
def export(
    model: Annotated[Path, typer.Argument(help="Trained model directory.")],
    out: Annotated[Path, typer.Argument(help="Directory to write the exported model to.")],
    format: Annotated[str, typer.Option(
        "--format", help="ctranslate2, huggingface (a MarianMTModel directory), onnx, or web "
        "(a page that translates in the browser).")
    ] = "ctranslate2",
    weights: Annotated[str, typer.Option(
        "--weights", help="best, last, averaged, step-N or a file.")] = "best",
    quantization: Annotated[str | None, typer.Option(
        "--quantization", help="Store weights as int8 (ctranslate2 also int16, float16, ...).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    check: Annotated[Path | None, typer.Option(
        "--check", help="Compare the export with attnmt on this file's first 100 lines "
        "(default: the dev set's).")] = None,
    onnx: Annotated[bool, typer.Option(
        "--onnx", help="huggingface: also onnx/ (fp32, int8), tokenizer.json and "
        "generation_config.json, as Optimum and transformers.js load them.")] = False,
    runtime: Annotated[Path | None, typer.Option(
        "--runtime", help="web: a folder with onnxruntime-web's ort.wasm.min.js and .wasm files "
        "(default: the copy installed with attnmt, scripts/get_web_runtime.py).")] = None,
) -> None:  # fmt: skip
    """Export a model, tokenizer included, and report how many sentences the export translates
    exactly as attnmt does: a Transformer to CTranslate2 (pip install 'attnmt[export]') or as
    a MarianMTModel for transformers (--format huggingface); any model to ONNX (pip install
    'attnmt[onnx]'), or as a folder whose index.html translates in the browser (--format web)."""
    from attnmt.data.text import check_input

    if format not in ("ctranslate2", "huggingface", "onnx", "web"):
        raise AttnmtError(f"--format {format!r}: expected ctranslate2, huggingface, onnx or web")
    if not model.is_dir():
        raise AttnmtError(f"model directory not found: {model}")
    if runtime is not None and format != "web":
        raise AttnmtError("--runtime is for --format web")
    if onnx and format != "huggingface":
        raise AttnmtError("--onnx is for --format huggingface (--format onnx exports any model)")
    if format == "huggingface":
        if quantization is not None or check is not None:
            raise AttnmtError("--quantization and --check are not for --format huggingface")
        from attnmt.interop.huggingface import export_huggingface

        if onnx:
            from attnmt.interop.onnx import import_onnx

            import_onnx()
        n = export_huggingface(model, out, weights, force, onnx)
        extra = ", onnx/, tokenizer.json, generation_config.json" if onnx else ""
        typer.echo(f"{out}: a MarianMTModel of {n:,} parameters (config.json, model.safetensors, "
                   f"source.spm, target.spm, vocab.json{extra})")  # fmt: skip
        return
    if check is not None:
        check_input(check)
    if format in ("onnx", "web"):
        _export_onnx(model, out, format, weights, quantization, force, check, runtime)
        return
    from attnmt.interop.ctranslate2 import export_ctranslate2, report_agreement

    files = export_ctranslate2(model, out, weights, quantization, force)
    typer.echo(f"{out}: {', '.join(files)}")
    report_agreement(out, model, weights, check, quantization)


def _export_onnx(
    model: Path, out: Path, format: str, weights: str, quantization: str | None, force: bool,
    check: Path | None, runtime: Path | None,
) -> None:  # fmt: skip
    """attnmt export --format onnx | web."""
    from attnmt.interop import onnx

    if format == "web":
        from attnmt.interop.web import export_web

        files = export_web(model, out, weights, quantization, force, runtime)
        typer.echo(f"{out}: {', '.join(files)} (serve it: python -m http.server -d {out})")
        onnx.report_agreement(out / "model", model, weights, check)
        return
    files = onnx.export_onnx(model, out, weights, quantization, force)
    typer.echo(f"{out}: {', '.join(files)}")
    onnx.report_agreement(out, model, weights, check)


@app.command(short_help="Draw training curves into a PNG.")
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


@app.command(short_help="Serve translations over HTTP, with a page.")
@model_options()
def serve(
    model: Annotated[list[Path], typer.Option(
        "--model", "-m", metavar="DIR",
        help="Trained model directory (more than once: an ensemble).")],
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port.")] = 8000,
    max_lines: Annotated[int, typer.Option(
        "--max-lines", min=1, help="Lines per request (more: 413).")] = 64,
    max_chars: Annotated[int, typer.Option(
        "--max-chars", min=1, help="Characters per line (more: 413).")] = 2000,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", min=1, help="Requests waiting (more: 503).")] = 256,
    batch_wait_ms: Annotated[float, typer.Option(
        "--batch-wait-ms", min=0.0, help="How long an idle server waits for more requests.")] = 5.0,
    max_search: Annotated[int, typer.Option(
        "--max-search", min=1, help="Lines x beam (or draws) per request (more: 413).")] = 512,
    max_attention: Annotated[int, typer.Option(
        "--max-attention", min=1,
        help="Attention weights a request may ask for, at its longest output (more: 413).")
    ] = 2_000_000,
    allowed_host: Annotated[list[str] | None, typer.Option(
        "--allowed-host", metavar="NAME",
        help="Another Host header name to answer to (repeatable; default: the bound address, "
        "and localhost on a loopback address).")] = None,
    docs: Annotated[bool, typer.Option(
        "--docs/--no-docs", help="Swagger UI at /docs (it loads scripts from a CDN).")] = False,
    name: Annotated[str | None, typer.Option(
        "--name", help="The model's name on the page and in /health (default: the model "
        "directories' names, not their paths).")] = None,
    access_log: Annotated[bool, typer.Option(
        "--access-log/--no-access-log", help="A line per request on stderr.")] = True,
    terminology: TerminologyOption = None,
    terms_ignore_case: TermsIgnoreCaseOption = False,
    terms_prefix: TermsPrefixOption = False,
    shortlist: ShortlistOption = None,
    *,
    load: ModelLoad,
) -> None:  # fmt: skip
    """Serve translations over HTTP: POST /translate {"text": [...], "beam": 5}."""
    try:
        import uvicorn  # noqa: F401

        from attnmt.serve.app import create_app
        from attnmt.serve.http import run, served_hosts
        from attnmt.serve.scheduler import Scheduler
        from attnmt.serve.schema import Limits
        from attnmt.serve.workers import ForkedScheduler
    except ImportError as e:
        raise AttnmtError(
            f'attnmt serve needs the serve extra ({e.name} is missing): pip install "attnmt[serve]"'
        ) from None

    translator = load.translator(model, terminology, shortlist, (terms_ignore_case, terms_prefix))
    limits = Limits(
        max_lines, max_chars, max_queue, batch_wait_ms,
        max_search=max_search, max_attention=max_attention,
    )  # fmt: skip
    name = name or " + ".join(m.resolve().name for m in model)
    hosts = served_hosts(host, allowed_host or [])
    if translator.workers > 1 and sys.platform == "linux":  # forked (CPU), before any thread
        search: Scheduler | ForkedScheduler = ForkedScheduler(
            translator, limits, translator.workers
        )
    else:
        search = Scheduler(translator, limits, thread=False)  # run's: in the main thread
    run(create_app(translator, limits, name, access_log, hosts, docs, search), host, port, name,
        search)  # fmt: skip


@app.command("shortlist", short_help="Build a model's lexical shortlist (faster decoding).")
def shortlist_command(
    model: Annotated[Path, typer.Option(
        "--model", "-m", metavar="DIR", help="The model directory to build it for.")],
    src: Annotated[Path | None, typer.Option(
        "--src", "-s", help="Source side of the parallel text (default: the config's "
        "data.train).")] = None,
    tgt: Annotated[Path | None, typer.Option(
        "--tgt", "-t", help="Target side, with --src (e.g. the distilled data).")] = None,
    k: Annotated[int, typer.Option(
        "--k", min=1, help="Target pieces kept per source piece.")] = 50,
    frequent: Annotated[int, typer.Option(
        "--frequent", min=0, help="The commonest target pieces, allowed in every sentence.")
    ] = 100,
    max_pairs: Annotated[int, typer.Option(
        "--max-pairs", min=1, help="Sentence pairs read at most (the first ones).")
    ] = 200_000,
) -> None:  # fmt: skip
    """Estimate IBM Model 1 over the model's pieces on parallel text and save each source
    piece's K likeliest target pieces in DIR/shortlist.safetensors (translate --shortlist)."""
    import itertools
    import time

    from attnmt.config import SplitConfig
    from attnmt.data.text import read_corpora
    from attnmt.data.tokenizer import Tokenizer
    from attnmt.decoding.shortlist import SHORTLIST_FILE, shortlist_from_text
    from attnmt.models.directory import read_run_files

    cfg, meta = read_run_files(model)
    if (src is None) != (tgt is None):
        raise AttnmtError("give both --src and --tgt, or neither (the config's data.train)")
    if src is None and "imported_from" in meta:
        raise AttnmtError(f"{model} was imported: give the parallel text with --src and --tgt")
    splits = [SplitConfig(src=src, tgt=tgt)] if src is not None else cfg.data.corpora
    pairs = list(itertools.islice(read_corpora(splits), max_pairs))
    start = time.monotonic()
    tokenizer = Tokenizer.load(model, cfg.tokenizer.joint)
    built = shortlist_from_text(
        tokenizer, [s for s, _ in pairs], [t for _, t in pairs], k, frequent
    )
    built.save(model / SHORTLIST_FILE)
    typer.echo(
        f"attnmt: wrote {model / SHORTLIST_FILE}: {k} target pieces per source piece and "
        f"{frequent} frequent ones, from {built.pairs:,} pairs in {time.monotonic() - start:.1f} s",
        err=True,
    )  # fmt: skip


@app.command("distill", short_help="Translate a corpus with a teacher (distillation).")
@model_options()
def distill_command(
    teacher: Annotated[list[Path], typer.Option(
        "--teacher", "-t", metavar="DIR",
        help="Teacher model directory (more than once: an ensemble).")],
    src: Annotated[Path, typer.Option(
        "--src", "-s", help="Source side of the training corpus (plain or .gz).")],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="The teacher's translations, one per source line.")],
    beam: Annotated[int | None, typer.Option(
        "--beam", "-b", min=1, max=100, help="Beam size (default 5; not with --sampling).")] = None,
    chunk_lines: Annotated[int, typer.Option(
        "--chunk-lines", min=1, help="Lines translated, then saved, at a time.")] = 2048,
    force: Annotated[bool, typer.Option(
        "--force", help="Start over: replace OUTPUT and any interrupted run.")] = False,
    target_lang: TargetLangOption = None,
    sampling: Annotated[bool, typer.Option(
        "--sampling", help="Draw each translation instead of searching (back-translation: "
        "the corpus entry printed is a synthetic one).")] = False,
    temperature: Annotated[float, typer.Option(
        "--temperature", min=0.01, max=100.0, help="Sampling temperature.")] = 1.0,
    top_k: Annotated[int, typer.Option(
        "--top-k", min=0, help="Sample from the K likeliest tokens (0: all).")] = 0,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Sampling seed.")] = 0,
    *,
    load: ModelLoad,
) -> None:  # fmt: skip
    """Translate a corpus's source side with a teacher for sequence-level distillation, or
    (--sampling, a target-to-source model) monolingual text for back-translation; re-run the
    same command after an interruption to continue where it stopped."""
    from attnmt.training.distill import corpus_entry, distill

    check_output_path(output, "--output")
    translator = load.translator(teacher)
    draws = (temperature, top_k, seed) if sampling else None
    done = distill(
        translator, teacher, load.weights, src, output, beam, target_lang, chunk_lines, force,
        sampling=draws,
    )  # fmt: skip
    rate = done.translated / max(done.seconds, 1e-9)
    typer.echo(
        f"distill: {done.lines:,} lines in {output} ({done.translated:,} translated now, "
        f"{done.seconds:.1f} s, {rate:.1f} lines/s); its entry in data.train:\n"
        f"{corpus_entry(src, output, synthetic=sampling)}", err=True,
    )  # fmt: skip


@app.command("eval", short_help="Score translations with sacreBLEU.")
@model_options()
def evaluate(
    ref: Annotated[list[Path], typer.Option(
        "--ref", "-r", help="Reference translations (more than once: several per line).")],
    hyp: Annotated[Path | None, typer.Option(
        "--hyp", help="Translations to score (instead of --model).")] = None,
    model: Annotated[list[Path] | None, typer.Option(
        "--model", "-m", metavar="DIR",
        help="Model directory to translate --src (more than once: an ensemble).")] = None,
    src: Annotated[Path | None, typer.Option(
        "--src", "-s", help="Source file, with --model.")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Also write the translations here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    lowercase: Annotated[bool, typer.Option(
        "--lowercase", "-lc", help="Case-insensitive scores (sacreBLEU's -lc).")] = False,
    beam: Annotated[int | None, typer.Option(
        "--beam", "-b", min=1, max=100, help="Beam size with --model (default: config).")] = None,
    target_lang: TargetLangOption = None,
    shortlist: ShortlistOption = None,
    *,
    load: ModelLoad,
) -> None:  # fmt: skip
    """Score translations with sacreBLEU (BLEU, chrF, TER); translate --src first if --model is
    given."""
    from attnmt.config import SplitConfig
    from attnmt.data.text import read_references, read_test_set
    from attnmt.decoding.translate import score

    if (hyp is None) == (model is None):
        raise AttnmtError("give either --hyp FILE, or --model DIR with --src FILE")
    if model is not None and src is None:
        raise AttnmtError("--model needs --src FILE (the source text to translate)")
    if output is not None:
        check_output_path(output, "--output")
    # Every line counts, an empty one too, as in the `test` event of training.
    lines, refs = read_test_set(SplitConfig(src=hyp or src, tgt=ref[0]))  # before the model
    more = read_references(ref[1:], len(refs))
    hyps = lines
    if model is not None:
        translator = load.translator(model, shortlist=shortlist)
        _, hyps = translator.score_test_set(lines, refs, beam, target_lang)
        if output is not None:
            atomic_write_bytes(output, "".join(h + "\n" for h in hyps).encode("utf-8"))
    s = score(hyps, refs, more, ter=True, lowercase=lowercase)
    if as_json:
        typer.echo(json.dumps(s.as_dict()))
    else:
        typer.echo(s.bleu_detail)
        typer.echo(f"chrF2 = {s.chrf:.2f}")
        typer.echo(f"TER = {s.ter:.2f}")
        typer.echo(f"BLEU signature: {s.bleu_signature}")
        typer.echo(f"chrF signature: {s.chrf_signature}")
        typer.echo(f"TER signature: {s.ter_signature}")
        typer.echo(f"BLEU = {s.bleu:.2f}")


@app.command("score", short_help="Forced decoding: log-probabilities of translations.")
@model_options(workers=False, search=False)
def score_command(
    model: Annotated[list[Path], typer.Option(
        "--model", "-m", metavar="DIR", help="Model directory (more than once: an ensemble).")],
    src: Annotated[Path, typer.Option("--src", "-s", help="Source sentences.")],
    tgt: Annotated[Path, typer.Option("--tgt", "-t", help="Their translations to score.")],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Output file (default: stdout).")] = None,
    normalize: Annotated[bool, typer.Option(
        "--normalize", help="Log-probability per target piece, not per sentence.")] = False,
    target_lang: TargetLangOption = None,
    *,
    load: ModelLoad,
) -> None:  # fmt: skip
    """Forced decoding: each translation's log-probability under the model, one per line."""
    from attnmt.config import SplitConfig
    from attnmt.data.text import read_test_set

    if output is not None:
        check_output_path(output, "--output")
    sources, targets = read_test_set(SplitConfig(src=src, tgt=tgt))
    translator = load.translator(model)
    found = translator.score_pairs(sources, targets, target_lang=target_lang)
    with OutputSink(output) as sink:
        sink.write("".join(f"{f.per_piece if normalize else f.log_prob:.4f}\n" for f in found))
