"""`attnmt tm`: a translation memory's commands (import, export, stats, add, match).

Parsed here, computed by the library (attnmt.data.tm, attnmt.data.fuzzy, attnmt.interop.tmx);
attnmt.cli.commands registers the group on the app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from attnmt.errors import AttnmtError

tm_app = typer.Typer(
    name="tm",
    help="Translation memories: import TMX or TSV, export, stats, add a pair, match.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
DbOption = Annotated[Path, typer.Option("--db", metavar="TM", help="The TM file (SQLite).")]
PairOption = Annotated[
    str | None,
    typer.Option("--pair", metavar="SRC-TGT", help="Language pair, e.g. de-en (default: the "
                 "TM's only one)."),
]  # fmt: skip


@tm_app.command("import")
def import_command(
    file: Annotated[Path, typer.Argument(help="A .tmx file, or a .tsv of source TAB target.")],
    db: DbOption,
    src_lang: Annotated[str | None, typer.Option(
        "--src-lang", help="Source language (TSV: required; TMX: default its header's).")] = None,
    tgt_lang: Annotated[str | None, typer.Option(
        "--tgt-lang", help="Target language (TSV: required; TMX: default its other one).")] = None,
    origin: Annotated[str | None, typer.Option(
        "--origin", help="Where the segments come from (default: the file's name).")] = None,
) -> None:  # fmt: skip
    """Add a TMX or TSV file's pairs to a TM (created if missing), in one transaction."""
    from attnmt.data.tm import TranslationMemory
    from attnmt.interop.tmx import read_tmx, read_tsv

    attributes = None
    if file.suffix.lower() == ".tmx":
        pairs, attributes, src_lang, tgt_lang = read_tmx(file, src_lang, tgt_lang)
    else:
        if src_lang is None or tgt_lang is None:
            raise AttnmtError(f"{file}: a TSV names no languages: give --src-lang and --tgt-lang")
        pairs = read_tsv(file)
    with TranslationMemory(db, create=True) as tm:
        added = tm.add_many(pairs, src_lang, tgt_lang, origin or file.name, attributes)
    typer.echo(f"{db}: {added:,} new segments {src_lang}-{tgt_lang} of {len(pairs):,} in {file}")


@tm_app.command("export")
def export_command(
    output: Annotated[Path, typer.Argument(help="A .tmx or .tsv file to write.")],
    db: DbOption,
    pair: PairOption = None,
) -> None:
    """Write a TM's segments of one language pair as TMX or TSV."""
    from attnmt.data.files import atomic_write_bytes, check_output_path
    from attnmt.data.tm import TranslationMemory
    from attnmt.interop.tmx import tmx_bytes, tsv_bytes

    check_output_path(output, "OUTPUT")
    with TranslationMemory(db) as tm:
        src, tgt = tm.pair(pair)
        segments = list(tm.segments((src, tgt)))
    data = tmx_bytes(segments, src, tgt) if output.suffix == ".tmx" else tsv_bytes(segments)
    atomic_write_bytes(output, data)
    typer.echo(f"{output}: {len(segments):,} segments {src}-{tgt}")


@tm_app.command("stats")
def stats_command(
    db: DbOption,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Segments per language pair and origin, the first and last addition, the file's size."""
    import datetime

    from attnmt.data.tm import TranslationMemory

    with TranslationMemory(db) as tm:
        stats = tm.stats()
    if as_json:
        typer.echo(json.dumps(stats))
        return

    def when(t: object) -> str:
        if t is None:
            return "-"
        return datetime.datetime.fromtimestamp(float(t)).isoformat(" ", "seconds")  # type: ignore[arg-type]

    typer.echo(f"{db}: {stats['segments']:,} segments, {stats['bytes']:,} bytes")
    for name in ("pairs", "origins"):
        for key, n in stats[name].items():  # type: ignore[attr-defined]
            typer.echo(f"  {name[:-1]} {key}: {n:,}")
    typer.echo(f"  first added {when(stats['first'])}, last added {when(stats['last'])}")


@tm_app.command("add")
def add_command(
    db: DbOption,
    source: Annotated[str, typer.Option("--source", help="The source segment.")],
    target: Annotated[str, typer.Option("--target", help="Its approved translation.")],
    pair: Annotated[str, typer.Option("--pair", metavar="SRC-TGT", help="e.g. de-en.")],
    origin: Annotated[str, typer.Option("--origin", help="Where it comes from.")] = "post-edit",
) -> None:
    """Store one approved pair (a post-edit): the next translation of a similar sentence
    finds it."""
    from attnmt.data.tm import TranslationMemory, parse_pair

    src, tgt = parse_pair(pair)
    with TranslationMemory(db, create=True) as tm:
        found = tm.add(source, target, src, tgt, origin)
    typer.echo(f"{db}: segment {found}")


@tm_app.command("match")
def match_command(
    db: DbOption,
    pair: PairOption = None,
    k: Annotated[int, typer.Option("--k", min=1, max=100, help="Matches per line.")] = 3,
    threshold: Annotated[float, typer.Option(
        "--threshold", min=0.0, max=1.0, help="The lowest fuzzy score shown.")] = 0.5,
) -> None:  # fmt: skip
    """Each stdin line's best fuzzy matches, as JSON lines: [{"id", "score", "source",
    "target"}, ...] (score 1.0: a 100 % match)."""
    import sys

    from attnmt.data.fuzzy import best_matches
    from attnmt.data.tm import TranslationMemory

    with TranslationMemory(db) as tm:
        langs = tm.pair(pair)
        for line in sys.stdin:
            found = best_matches(tm, line, langs, k, threshold)
            typer.echo(json.dumps([
                {"id": m.segment.id, "score": round(m.score, 4), "source": m.segment.source,
                 "target": m.segment.target} for m in found
            ], ensure_ascii=False))  # fmt: skip
