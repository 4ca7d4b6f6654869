"""The `attnmt` program's entry point: runs the CLI (attnmt.cli.commands); any AttnmtError (a
problem with what the user gave us) becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import signal
import sys

import typer

from attnmt.cli.commands import app
from attnmt.errors import AttnmtError, TrainingInterrupted


def main() -> None:
    """Entry point: run the app; a user error (ours or a usage error) is one line and exit
    code 2, an interrupt one line and 128 + the signal's number, never a traceback."""
    try:
        code = app(standalone_mode=False, prog_name="attnmt")  # errors here, not in Typer's boxes
    except AttnmtError as e:
        _fail(str(e))
    except TrainingInterrupted as e:
        name = signal.Signals(e.signum).name
        print(
            f"attnmt: {name} at step {e.step}: checkpoint saved; continue with --resume",
            file=sys.stderr,
        )
        sys.exit(128 + e.signum)
    except (KeyboardInterrupt, typer.Abort):
        code = 130
    except Exception as e:
        if type(e).__name__ == "Abort":  # Click's form of Ctrl-C, where Typer does not convert it
            print("attnmt: interrupted", file=sys.stderr)
            sys.exit(130)
        if not hasattr(e, "format_message"):  # not a Click usage error: a bug, show it
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # plain `attnmt`: the help
            print(e.format_message())
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        _fail(" ".join(e.format_message().split()) + where)
    if code == 130:  # Typer turns Ctrl-C into exit code 130
        print("attnmt: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str) -> None:
    print(f"attnmt: error: {message}", file=sys.stderr)
    sys.exit(2)
