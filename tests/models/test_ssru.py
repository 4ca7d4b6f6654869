"""The SSRU decoder (model.decoder: ssru): the parallel scan is the recurrence, a decoding step
is a training position, resume is exact, and what cannot hold one says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnmt import Translator
from attnmt.config import from_dict
from attnmt.decoding.batch import decode
from attnmt.decoding.search import Beam, Greedy, SearchOptions
from attnmt.models.ssru import SSRU
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config
from helpers import assert_user_error, random_batch, tiny_model


def recurrence(cell: SSRU, x: torch.Tensor) -> torch.Tensor:
    """The paper's equations, one position after another."""
    c = torch.zeros(x.size(0), x.size(2), dtype=x.dtype)
    out = []
    for t in range(x.size(1)):
        o, c = cell.step(x[:, t : t + 1], c)
        out.append(o)
    return torch.cat(out, dim=1)


def test_the_parallel_scan_is_the_recurrence_values_and_gradients():
    torch.manual_seed(0)
    cell = SSRU(8)
    with torch.no_grad():  # gates from nearly 0 to nearly 1: products of 300 of them vanish
        cell.w_f.bias.copy_(torch.linspace(-8.0, 8.0, 8))
    x = torch.randn(3, 300, 8, requires_grad=True)
    parallel, stepped = cell(x), recurrence(cell, x)
    torch.testing.assert_close(parallel, stepped, rtol=1e-5, atol=1e-5)
    grads = [torch.autograd.grad(y.square().sum(), [x, cell.w.weight, cell.w_f.weight])
             for y in (cell(x), recurrence(cell, x))]  # fmt: skip
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_decoding_step_is_a_training_position(norm):
    model = tiny_model("transformer", decoder="ssru", norm=norm).eval()
    batch = random_batch(5)
    with torch.no_grad():
        memory = model.encode(batch.src, batch.src_pad_mask)
        full, _ = model.decode_all(memory, batch.tgt_in)  # (B, T, V)
        state, steps = model.init_state(memory), []
        for t in range(batch.tgt_in.size(1)):
            logits, state, _ = model.decode_step(memory, state, batch.tgt_in[:, t])
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
    # Beam search reorders the recurrent states as it reorders attention caches: beam 1 is
    # greedy search.
    opts = SearchOptions(max_len_a=0.0, max_len_b=8)
    greedy = decode(model, batch.src, batch.src_pad_mask, opts)
    beam = decode(model, batch.src, batch.src_pad_mask, SearchOptions(Beam(1, 0.0), 0.0, 8))
    assert [h[0].tokens for h in greedy] == [h[0].tokens for h in beam]
    assert isinstance(opts.method, Greedy)


def test_resume_is_byte_identical_and_int8_translates(tmp_path: Path, corpus, run_cli):
    raw = tiny_config(corpus)
    raw["model"].update(decoder="ssru", dropout=0.3)
    raw["train"].update(max_steps=8, eval_every=4)
    train(from_dict(raw), tmp_path / "full", quiet=True)
    train(from_dict({**raw, "train": {**raw["train"], "max_steps": 4}}), tmp_path / "part",
          quiet=True)  # fmt: skip
    train(from_dict(raw), tmp_path / "part", resume=True, quiet=True)
    full, part = tmp_path / "full" / "last.safetensors", tmp_path / "part" / "last.safetensors"
    assert full.read_bytes() == part.read_bytes()
    lines = make_pairs(6, 2)[0]
    fp32 = Translator.load(tmp_path / "full", device="cpu").translate(lines, beam=3)
    int8 = Translator.load(tmp_path / "full", device="cpu", precision="int8")
    assert len(int8.translate(lines, beam=3)) == len(fp32)
    r = run_cli("export", str(tmp_path / "full"), str(tmp_path / "hf"), "--format", "huggingface")
    assert_user_error(r, "an SSRU decoder")


def test_a_gru_model_cannot_have_one():
    with pytest.raises(ValueError, match=r"model\.decoder ssru is a Transformer decoder's"):
        from attnmt.config import ModelConfig

        ModelConfig(arch="rnn", decoder="ssru")
