"""TensorBoard: the training log's events as scalars and text, in DIR/tensorboard/.

`RunLog` hands every event to `Board.event`; the events' fields become scalars under
train/, dev/ and test/, and each validation's dev examples a Markdown table in the text tab.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BOARD_DIR = "tensorboard"

# event -> {tag: field}: the scalars each event of train_log.jsonl gives
SCALARS = {
    "train": {
        "train/loss": "loss",
        "train/lr": "lr",
        "train/tokens_per_s": "tokens_per_s",
        "train/teacher_forcing": "teacher_forcing",
        "train/padding": "padding",
    },
    "validation": {
        "dev/loss": "dev_loss",
        "dev/ppl": "dev_ppl",
        "dev/bleu": "dev_bleu",
        "dev/chrf": "dev_chrf",
    },
}
SCALARS["init_from"] = SCALARS["validation"]  # fine-tuning: the source model's step-0 scores


class Board:
    """A SummaryWriter fed with the training log's events."""

    def __init__(self, out: Path, purge_step: int | None) -> None:
        """purge_step: when resuming, the checkpoint's step + 1: what the interrupted run wrote
        after its checkpoint is hidden, as the resumed run trains those steps again."""
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ~1 s

        self.writer = SummaryWriter(str(out / BOARD_DIR), purge_step=purge_step)
        self.step = 0

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        self.step = int(fields.get("step", self.step))
        for tag, key in SCALARS.get(kind, {}).items():
            if fields.get(key) is not None:
                self.writer.add_scalar(tag, fields[key], self.step)
        for name, row in fields.get("directions", {}).items():  # several dev sets
            for key in ("dev_loss", "dev_bleu", "dev_chrf"):
                self.writer.add_scalar(f"dev/{name}/{key[4:]}", row[key], self.step)
        if kind == "samples":
            self.writer.add_text("dev/examples", _table(fields["examples"]), self.step)
        elif kind == "test":
            where = f"/{fields['direction']}" if "direction" in fields else ""
            for metric in ("bleu", "chrf"):
                self.writer.add_scalar(
                    f"test/{metric}_{fields['weights']}{where}", fields[metric], self.step
                )
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _table(rows: list[dict[str, str]]) -> str:
    """Dev examples as a Markdown table (TensorBoard renders text as Markdown)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| source | reference | translation |", "|---|---|---|"]
    lines += [f"| {cell(r['src'])} | {cell(r['ref'])} | {cell(r['hyp'])} |" for r in rows]
    return "\n".join(lines)
