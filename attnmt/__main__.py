"""`python -m attnmt` (and `torchrun -m attnmt`) run the CLI."""

from attnmt.cli.main import main

main()
