"""What a resumed run needs to take exactly the steps the uninterrupted run would have taken:
the counters that decide what happens next (Progress), every random generator's state, and the
check that a resumed config computes the same steps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnmt.config import Config
from attnmt.errors import ConfigError

# Keys that may change between a run and its resumption: they do not change what a step computes
# (device and threads only up to floating-point rounding).
RESUMABLE_KEYS = (
    "train.max_steps",
    "train.max_epochs",
    "train.patience",
    "train.device",
    "train.threads",
    "train.matmul",
    "train.compile",
    "train.prefetch",
    "train.log_every",
    "train.keep_best",
    "train.keep_last",
    "train.average_last",
    "train.log_samples",
    "train.tensorboard",
    "train.time_budget",
    "train.max_bad_steps",
    "train.eval_batch_tokens",
    "data.workers",
    "decode.",
)


@dataclass
class Progress:
    """Counters that decide what training does next; saved in every checkpoint."""

    step: int = 0
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of `epoch` already consumed (trained on or skipped)
    best_score: float = -math.inf  # of train.early_stopping's metric, higher is better
    bad_validations: int = 0  # validations since the last improvement (early stopping)
    plateau_scale: float = 1.0
    plateau_bad: int = 0
    bad_steps_in_a_row: int = 0
    skipped_steps: int = 0
    last_validated: int = -1
    elapsed_s: float = 0.0
    validation_s: float = 0.0  # the longest validation: what a time budget keeps for the last
    warmup_used: float = 0.0  # lr_schedule budget: the share of the budget spent by warmup's end
    warmup_done: bool = False  # lr_schedule budget: warmup has ended (by steps or by time)
    checkpoints: list[list[Any]] = field(default_factory=list)  # [step, dev score or None]

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        """From a checkpoint's saved counters (older ones named best_score best_bleu)."""
        state = dict(state)
        if "best_bleu" in state:
            state["best_score"] = state.pop("best_bleu")
        return cls(**state)


def rng_state(tf_generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a step can draw from, as plain tensors and numbers."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "teacher_forcing": tf_generator.get_state(),
    }


def set_rng_state(state: dict[str, Any], tf_generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
         n["cached_gaussian"])
    )  # fmt: skip
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tf_generator.set_state(state["teacher_forcing"])


def check_resumable(saved: Config, new: Config) -> None:
    """Refuse to resume with a config that would compute different steps."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(saved.model_dump(mode="json")), flat(new.model_dump(mode="json"))
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key) and not key.startswith(RESUMABLE_KEYS):
            raise ConfigError(
                f"--resume: '{key}' = {b.get(key)!r} differs from the run's {a.get(key)!r}; "
                f"only {', '.join(k.rstrip('.') for k in RESUMABLE_KEYS)} may change on resume"
            )


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python's, NumPy's and torch's generators; returns scheduled sampling's own
    generator, so that its coin flips are reproducible apart from dropout's draws."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)
