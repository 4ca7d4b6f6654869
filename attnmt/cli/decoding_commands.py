"""The `attnmt` commands that search with a trained model: translate, eval, score and
shortlist.

Parsed here, computed by the library (attnmt.cli.commands registers them on the app).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from attnmt.cli.options import (
    ModelLoad,
    ModelsOption,
    ShortlistOption,
    TargetLangOption,
    TerminologyOption,
    TermsIgnoreCaseOption,
    TermsPrefixOption,
    TmOption,
    TmPairOption,
    TmThresholdOption,
    decoding_options,
    model_options,
)
from attnmt.data.files import OutputSink, atomic_write_bytes, check_output_path
from attnmt.decoding.options import api_arguments
from attnmt.errors import AttnmtError

if TYPE_CHECKING:
    from attnmt.decoding.translation import Translation


@model_options()
@decoding_options("translate")
def translate(
    model: ModelsOption,
    input: Annotated[Path | None, typer.Option(
        "--input", "-i", help="Input file (default: stdin).")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Output file (default: stdout).")] = None,
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
        "--sampling", help="Draw translations instead of searching (--temperature, --top-k, "
        "--seed).")] = False,
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
    tm: TmOption = None,
    tm_pair: TmPairOption = None,
    tm_threshold: TmThresholdOption = 0.5,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Say on stderr, per line, the TM segment it met and its "
        "score.")] = False,
    *,
    load: ModelLoad,
    asked: dict[str, Any],
) -> None:  # fmt: skip
    """Translate text, one line in, one line out (beam search, greedy with --beam 1, or
    --sampling: --n-best K draws K per line)."""
    # Long: typer declares each of the command's options in its signature; the body is short.
    from attnmt.data.text import check_input
    from attnmt.decoding.alignment import moses
    from attnmt.decoding.heatmap import AttentionMaps
    from attnmt.decoding.translation import format_results

    if output is not None:
        check_output_path(output, "--output")
    source = None if input is None or str(input) == "-" else input
    if source is not None:
        check_input(source)  # a missing or unreadable file fails before the model loads
    prefixes, required = per_line_inputs(prefix, constraints, terminology)
    translator = load.translator(model, terminology, shortlist, (terms_ignore_case, terms_prefix))
    if tm is not None:
        translator.use_tm(tm, tm_pair, tm_threshold)
    spec, maps = None, None
    if attention is not None:
        spec = translator.attention_spec(attention_layer, attention_head)
        maps = AttentionMaps(attention, translator.cfg.model, spec)  # creates the directory
    elif alignments or markup:  # with --attention, from its layer and head
        spec = translator.alignment_spec(alignment_layer)
    options = translator.options(**api_arguments(asked, sampling), attention=spec)
    done = 0  # lines translated so far
    # Written chunk by chunk as each is done: a line sent alone through a pipe or typed at a
    # terminal is answered at once.
    with OutputSink(output) as sink:
        chunks = translator.stream(
            source, options, batch_tokens, None, target_lang, prefixes, required, markup
        )
        for lines, results in chunks:
            aligned = moses if alignments else None
            sink.write(format_results(results, asked["n_best"], done, aligned))
            if maps is not None:
                maps.write([r[0] for r in results], first=done)
            if verbose:
                say_tm([r[0] for r in results], done)
            done += len(lines)


def say_tm(results: list[Translation], first: int) -> None:
    """translate --verbose: each line's TM match on stderr (input lines numbered from 1)."""
    for i, found in enumerate(results, first + 1):
        use = found.tm
        if use is None:
            continue
        how = "100 % match, the translation" if use.exact else f"{use.score:.0%} fuzzy match"
        typer.echo(f"attnmt: tm: input line {i}: {how}, segment {use.segment}: "
                   f"{use.source} ||| {use.target}", err=True)  # fmt: skip


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


def shortlist(
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


@model_options()
@decoding_options("eval")
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
    target_lang: TargetLangOption = None,
    shortlist: ShortlistOption = None,
    *,
    load: ModelLoad,
    asked: dict[str, Any],
) -> None:  # fmt: skip
    """Score translations with sacreBLEU (BLEU, chrF, TER); translate --src first if --model is
    given."""
    from attnmt.config import SplitConfig
    from attnmt.data.text import read_references, read_test_set
    from attnmt.decoding.scores import score

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
        _, hyps = translator.score_test_set(lines, refs, asked["beam"], target_lang)
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


@model_options(workers=False, search=False)
def score_command(
    model: ModelsOption,
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
