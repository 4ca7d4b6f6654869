"""Attention maps: JSON and PNG per input line, numbered from 0 as n-best lists are, labelled
with the pieces as SentencePiece writes them."""

import json
from pathlib import Path

import matplotlib.axes
import matplotlib.image
import torch

from attnmt.decoding.heatmap import write_attention_map
from attnmt.decoding.translation import Translation


def test_writes_json_and_png_named_by_line_number(tmp_path: Path, monkeypatch):
    labels: list[list[str]] = []
    for axis in ("set_xticks", "set_yticks"):
        real = getattr(matplotlib.axes.Axes, axis)
        monkeypatch.setattr(
            matplotlib.axes.Axes, axis,
            lambda self, ticks, names, real=real, **kw: labels.append(list(names))
            or real(self, ticks, names, **kw),
        )  # fmt: skip
    weights = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    t = Translation("a dog", -1.0, ["▁Ein", "</s>"], ["▁a", "▁dog"], weights)
    write_attention_map(tmp_path, 0, t, "line 0: Bahdanau attention")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000000.json", "000000.png"]
    record = json.loads((tmp_path / "000000.json").read_text(encoding="utf-8"))
    assert record["line"] == 0 and record["source_pieces"] == ["▁Ein", "</s>"]
    assert record["weights"] == [[0.7, 0.3], [0.2, 0.8]]
    assert labels == [["▁Ein", "</s>"], ["▁a", "▁dog"]]  # as SentencePiece writes them
    image = matplotlib.image.imread(tmp_path / "000000.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_an_empty_line_gets_json_only(tmp_path: Path):
    write_attention_map(tmp_path, 3, Translation("", 0.0, [], [], None), "line 3")
    assert [p.name for p in tmp_path.iterdir()] == ["000003.json"]
