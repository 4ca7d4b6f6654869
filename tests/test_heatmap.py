"""Attention maps: JSON and PNG per input line, numbered from 1, with readable piece labels."""

import json
from pathlib import Path

import matplotlib.image
import torch

from attnmt.evaluate import Translation
from attnmt.heatmap import readable, write_attention_map


def test_pieces_read_as_words():
    assert readable("▁Hund") == "Hund"
    assert readable("e") == "##e"  # continues the word before it
    assert readable("▁") == "␣"
    assert readable("</s>") == "</s>"


def test_writes_json_and_png_named_by_line_number(tmp_path: Path):
    weights = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    t = Translation("a dog", -1.0, ["▁Ein", "</s>"], ["▁a", "▁dog"], weights)
    write_attention_map(tmp_path, 1, t, "line 1: Bahdanau attention")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001.json", "000001.png"]
    record = json.loads((tmp_path / "000001.json").read_text(encoding="utf-8"))
    assert record["line"] == 1 and record["source_pieces"] == ["▁Ein", "</s>"]
    assert record["weights"] == [[0.7, 0.3], [0.2, 0.8]]
    image = matplotlib.image.imread(tmp_path / "000001.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_an_empty_line_gets_json_only(tmp_path: Path):
    write_attention_map(tmp_path, 3, Translation("", 0.0, [], [], None), "line 3")
    assert [p.name for p in tmp_path.iterdir()] == ["000003.json"]
