"""The command line: the Typer app and its commands, shared options, and main (errors as one line,
exit code 2). May import every other package.
"""
