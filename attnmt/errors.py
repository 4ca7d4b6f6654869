"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class AttnmtError(Exception):
    """Base class: a problem with something the user gave us (config, files, flags)."""


class ConfigError(AttnmtError):
    """A config key is unknown, has the wrong type, or is out of range."""


class DataError(AttnmtError):
    """A corpus or input file is missing, unreadable, misaligned, or not UTF-8."""


class CheckpointError(AttnmtError):
    """A model directory is missing, incomplete, or from an incompatible version."""


class TrainingError(AttnmtError):
    """Training cannot go on (for example, the loss stayed non-finite too long)."""


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM arrived; a checkpoint was saved. Not a user error: exit 128 + signum."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"signal {signum} at step {step}")
        self.signum = signum
        self.step = step


class TooMuchWork(AttnmtError):
    """A request that would take more work than attnmt allows (served as 413)."""
