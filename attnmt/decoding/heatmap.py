"""Attention maps: per sentence, the weights as JSON and a heatmap PNG with tokens on the axes."""

from __future__ import annotations

import json
from pathlib import Path

from attnmt.config import ModelConfig
from attnmt.data.files import atomic_write, atomic_write_bytes
from attnmt.decoding.translation import Translation
from attnmt.errors import AttnmtError
from attnmt.models.seq2seq import AttentionSpec


class AttentionMaps:
    """`translate --attention DIR`: a JSON file and a heatmap per input line in DIR, titled
    with which attention they show."""

    def __init__(self, directory: Path, model: ModelConfig, spec: AttentionSpec) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AttnmtError(f"--attention {directory}: cannot create it ({e.strerror})") from None
        self.directory = directory
        layer = spec.layer % model.dec_layers  # -1: the top layer, by its number
        self.what = "Bahdanau attention" if model.arch == "rnn" else (
            f"cross-attention, layer {layer + 1} of {model.dec_layers}, "
            + ("mean of heads" if spec.head is None else f"head {spec.head}")
        )  # fmt: skip

    def write(self, best: list[Translation], first: int) -> None:
        """The maps of consecutive input lines, numbered from `first` (the first line is 0, as
        in n-best lists)."""
        for i, translation in enumerate(best, start=first):
            write_attention_map(self.directory, i, translation, f"line {i}: {self.what}")


def write_attention_map(directory: Path, line: int, translation: Translation, title: str) -> None:
    """Write DIR/NNNNNN.json and DIR/NNNNNN.png for input line number `line` (from 0, as n-best
    lists count lines). Axis labels are the pieces as SentencePiece writes them: ▁ starts a
    word, a piece without it continues the one before."""
    stem = directory / f"{line:06d}"
    weights = translation.attention
    record = {
        "line": line,
        "source_pieces": translation.src_pieces,
        "target_pieces": translation.tgt_pieces,
        "translation": translation.text,
        "weights": []
        if weights is None
        else [[round(float(w), 6) for w in row] for row in weights],
    }
    atomic_write_bytes(stem.with_suffix(".json"), json.dumps(record, ensure_ascii=False).encode())
    if weights is None or weights.numel() == 0:
        return
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows, cols = weights.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * cols + 2), max(3.0, 0.4 * rows + 1.5)))
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(cols), translation.src_pieces, rotation=90, fontsize=8)
    ax.set_yticks(range(rows), translation.tgt_pieces, fontsize=8)
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    atomic_write(stem.with_suffix(".png"), lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
