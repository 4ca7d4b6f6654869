"""The `attnmt` app: its commands (train, translate, average, split, import, export, plot,
serve, shortlist, distill, eval, score, and the group tm) registered from their groups'
modules, and --version.

training_commands, decoding_commands and model_commands parse arguments and call library
functions; attnmt.cli.main runs them and turns any AttnmtError (a problem with what the user
gave us) into one line on stderr and exit code 2.
"""

from __future__ import annotations

from typing import Annotated

import typer

from attnmt import __version__
from attnmt.cli import decoding_commands as decoding
from attnmt.cli import model_commands as models
from attnmt.cli import training_commands as training
from attnmt.cli.tm_commands import tm_app

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


# The commands, in the order --help lists them: name, summary, the function that runs it.
COMMANDS = [
    ("train", "Train a model from a YAML config.", training.train_command),
    ("translate", "Translate lines: greedy, beam, sampling, n-best.", decoding.translate),
    ("average", "Average checkpoints into averaged.safetensors.", training.average),
    ("split", "Clean a corpus and split it into train, dev and test.", training.split_corpus),
    ("import", "Import a pretrained OPUS-MT / MarianMT model.", models.import_model),
    ("export", "Export to CTranslate2, Hugging Face, ONNX or a web page.", models.export),
    ("pack", "Copy what translating needs into a folder to ship.", models.pack),
    ("plot", "Draw training curves into a PNG.", training.plot),
    ("serve", "Serve translations over HTTP, with a page.", models.serve),
    ("shortlist", "Build a model's lexical shortlist (faster decoding).", decoding.shortlist),
    ("distill", "Translate a corpus with a teacher (distillation).", training.distill_command),
    ("eval", "Score translations with sacreBLEU.", decoding.evaluate),
    ("score", "Forced decoding: log-probabilities of translations.", decoding.score_command),
]
for _name, _summary, _run in COMMANDS:
    app.command(_name, short_help=_summary)(_run)
app.add_typer(tm_app, name="tm", short_help="Translation memories: import, export, stats, add.")
