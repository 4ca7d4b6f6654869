"""attnmt plot's curves, read from a run's train_log.jsonl."""

import json
from pathlib import Path

from attnmt.training.plot import read_curves


def test_the_lr_curve_takes_the_validations_lr_too(tmp_path: Path):
    # A short budget run logs few train events; its validations show the decay after them.
    events = [
        {"event": "train", "step": 100, "loss": 5.0, "lr": 1e-3, "elapsed_s": 60.0},
        {"event": "validation", "step": 50, "dev_loss": 6.0, "dev_bleu": 1.0, "lr": 5e-4,
         "elapsed_s": 30.0},
        {"event": "validation", "step": 150, "dev_loss": 4.0, "dev_bleu": 2.0, "lr": 2e-4,
         "elapsed_s": 90.0},
    ]  # fmt: skip
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lr = read_curves(tmp_path).lr
    assert [(step, value) for step, _, value in lr] == [(50, 5e-4), (100, 1e-3), (150, 2e-4)]
