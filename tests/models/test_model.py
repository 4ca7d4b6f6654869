"""build_model picks the architecture; the modules import without a circle."""

import subprocess
import sys

import pytest

from attnmt.config import ModelConfig
from attnmt.models.build import build_model
from attnmt.models.rnn import RNNSeq2Seq
from attnmt.models.seq2seq import Seq2Seq
from attnmt.models.transformer import TransformerSeq2Seq


@pytest.mark.parametrize(
    ("arch", "cls"), [("rnn", RNNSeq2Seq), ("transformer", TransformerSeq2Seq)]
)
def test_build_model_picks_the_architecture(arch, cls):
    cfg = ModelConfig(arch=arch, emb_size=8, hidden_size=8, heads=2, ff_size=16)
    model = build_model(cfg, 30, 30, joint=True)
    assert isinstance(model, cls) and isinstance(model, Seq2Seq)
    assert model.output.out_features == 30


@pytest.mark.parametrize("first", [
    "attnmt.models.rnn", "attnmt.models.transformer", "attnmt.models.seq2seq", "attnmt.kernels",
    "attnmt.models.build", "attnmt.training.loop", "attnmt.decoding.translator", "attnmt.cli.main",
])  # fmt: skip
def test_every_module_imports_first(first):
    """With an import circle, importing one side of it first fails or half-initialises."""
    r = subprocess.run([sys.executable, "-c", f"import {first}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
