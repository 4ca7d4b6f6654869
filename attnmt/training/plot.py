"""Training curves: train loss (and dev loss), dev BLEU and the learning rate of one or more
runs, against steps and against wall-clock minutes, from their train_log.jsonl files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from attnmt.data.files import atomic_write, read_jsonl
from attnmt.errors import AttnmtError
from attnmt.models.directory import LOG_JSONL


@dataclass
class Curves:
    """One run's points, each a list of (step, minutes, value)."""

    name: str
    loss: list[tuple[int, float, float]] = field(default_factory=list)
    dev_loss: list[tuple[int, float, float]] = field(default_factory=list)
    bleu: list[tuple[int, float, float]] = field(default_factory=list)
    lr: list[tuple[int, float, float]] = field(default_factory=list)


def read_curves(model_dir: Path) -> Curves:
    """The curves of a model directory's log. A resumed run logged the steps after its last
    checkpoint twice: the later record of a step wins."""
    path = model_dir / LOG_JSONL
    train: dict[int, dict] = {}
    dev: dict[int, dict] = {}
    seconds = 0.0  # logs without elapsed_s in train events: the sum of the windows
    for number, event in read_jsonl(path):
        kind = event.get("event")
        if kind not in ("train", "validation", "init_from"):
            continue
        if kind == "init_from" and "dev_bleu" not in event:
            continue  # fine-tuning's step-0 point; logs of older versions have no BLEU there
        needs = ("step", "loss", "lr") if kind == "train" else ("step", "dev_loss", "dev_bleu")
        if not all(_is_number(event.get(key)) for key in needs):
            raise AttnmtError(f"{path}:{number}: a {kind} event without {', '.join(needs)}")
        if kind == "train":
            seconds += event.get("seconds", 0.0)
            train[int(event["step"])] = {**event, "elapsed_s": event.get("elapsed_s", seconds)}
        else:
            dev[int(event["step"])] = {**event, "elapsed_s": event.get("elapsed_s", seconds)}
    curves = Curves(model_dir.name or str(model_dir))
    for step, e in sorted(train.items()):
        curves.loss.append((step, e["elapsed_s"] / 60, e["loss"]))
    # The lr of train events (every train.log_every steps) and of validations: a short run
    # that logs few train events still shows its decay.
    lrs = {step: e for step, e in dev.items() if _is_number(e.get("lr"))} | train
    for step, e in sorted(lrs.items()):
        curves.lr.append((step, e["elapsed_s"] / 60, e["lr"]))
    for step, e in sorted(dev.items()):
        curves.dev_loss.append((step, e["elapsed_s"] / 60, e["dev_loss"]))
        curves.bleu.append((step, e["elapsed_s"] / 60, e["dev_bleu"]))
    if not curves.loss and not curves.bleu:
        raise AttnmtError(f"{path}: no training or validation events to plot")
    return curves


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def plot_runs(model_dirs: list[Path], output: Path) -> None:
    """Write a PNG: rows loss, dev BLEU, lr; columns against steps and against minutes;
    one colour per run (train loss solid, dev loss dashed)."""
    runs = [read_curves(d) for d in model_dirs]
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex="col")
    for colour, run in enumerate(runs):
        c = f"C{colour % 10}"
        for col in (0, 1):
            for ax, points, style, label in (
                (axes[0][col], run.loss, "-", f"{run.name} train"),
                (axes[0][col], run.dev_loss, "--", f"{run.name} dev"),
                (axes[1][col], run.bleu, "o-", run.name),
                (axes[2][col], run.lr, "-", run.name),
            ):
                if points:
                    xs = [p[col] for p in points]
                    ax.plot(xs, [p[2] for p in points], style, color=c, label=label, ms=3)
    for row, title in enumerate(("loss per token", "dev BLEU", "learning rate")):
        for col in (0, 1):
            axes[row][col].set_ylabel(title)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[2][0].set_xlabel("step")
    axes[2][1].set_xlabel("minutes")
    fig.tight_layout()
    atomic_write(output, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)
