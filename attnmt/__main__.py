"""`python -m attnmt` (and `torchrun -m attnmt`) run the CLI."""

from attnmt.main import main

main()
