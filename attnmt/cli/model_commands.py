"""The `attnmt` commands that take models in and out of attnmt, and serve them: import,
export, pack and serve.

Parsed here, computed by the library (attnmt.cli.commands registers them on the app).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from attnmt.cli.options import (
    ModelLoad,
    ModelsOption,
    ShortlistOption,
    TerminologyOption,
    TermsIgnoreCaseOption,
    TermsPrefixOption,
    TmOption,
    TmPairOption,
    TmThresholdOption,
    model_options,
)
from attnmt.errors import AttnmtError


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


def pack(
    model: Annotated[Path, typer.Argument(help="Trained model directory.")],
    out: Annotated[Path, typer.Argument(help="The directory to write (new or empty).")],
    weights: Annotated[str, typer.Option(
        "--weights", help="Which weights: best, last, averaged, step-N or a path.")] = "best",
    force: Annotated[bool, typer.Option("--force", help="Replace OUT.")] = False,
) -> None:  # fmt: skip
    """Copy what translating needs into OUT, to ship: config, tokenizer, the chosen weights
    (as best.safetensors), the shortlist; no checkpoints, corpus or logs."""
    from attnmt.interop.pack import pack_model

    packed = pack_model(model, out, weights, force)
    mb = 1 / 2**20
    typer.echo(
        f"packed {model} ({packed.weights.name}) into {out}: {', '.join(packed.files)}; "
        f"{packed.size * mb:.1f} MB (the model directory: {packed.source_size * mb:.1f} MB). "
        f"Translate with: attnmt translate -m {out}"
    )


def _export_onnx(
    model: Path, out: Path, format: str, weights: str, quantization: str | None, force: bool,
    check: Path | None, runtime: Path | None,
) -> None:  # fmt: skip
    """attnmt export --format onnx | web."""
    from attnmt.decoding.options import exports_note
    from attnmt.interop import onnx, onnx_run

    if format == "web":
        from attnmt.interop.web import export_web

        files = export_web(model, out, weights, quantization, force, runtime)
        typer.echo(f"{out}: {', '.join(files)} (serve it: python -m http.server -d {out})")
        typer.echo(f"note: {exports_note()}")
        onnx_run.report_agreement(out / "model", model, weights, check)
        return
    files = onnx.export_onnx(model, out, weights, quantization, force)
    typer.echo(f"{out}: {', '.join(files)}")
    typer.echo(f"note: {exports_note()}")
    onnx_run.report_agreement(out, model, weights, check)


@model_options()
def serve(
    model: ModelsOption,
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
    tm: TmOption = None,
    tm_pair: TmPairOption = None,
    tm_threshold: TmThresholdOption = 0.5,
    tm_write: Annotated[bool, typer.Option(
        "--tm-write", help="--tm: POST /tm stores approved pairs in it (post-edits).")] = False,
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
            f"attnmt serve needs the serve extra ({e.name} is missing): "
            'pip install torch==2.13.0 "attnmt[serve]"'
        ) from None

    if tm_write and tm is None:
        raise AttnmtError("--tm-write stores post-edits in a TM: give it with --tm TM")
    translator = load.translator(model, terminology, shortlist, (terms_ignore_case, terms_prefix))
    if tm is not None:
        translator.use_tm(tm, tm_pair, tm_threshold)
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
    app = create_app(translator, limits, name, access_log, hosts, docs, search, tm_write)
    run(app, host, port, name, search)
