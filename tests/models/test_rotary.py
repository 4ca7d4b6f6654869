"""Rotary positions (model.positions: rope): the rotation against RoFormer's equations, the
offset property it exists for, and a RoPE Transformer decoding one position at a time as it
computes all at once."""

from __future__ import annotations

import math

import pytest
import torch

from attnmt.config import ModelConfig
from attnmt.errors import ConfigError
from attnmt.models.attention import rotary

from helpers import random_batch, stepwise_logits, tiny_model


def test_rotary_is_roformers_rotation_of_each_pair():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)  # (B, h, T, d)
    positions = torch.tensor([0, 1, 2, 7, 100])
    got = rotary(x, positions)
    want = torch.empty_like(x)
    for t, m in enumerate(positions.tolist()):
        for i in range(4):
            angle = m * 10000 ** (-2 * i / 8)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., t, 2 * i], x[..., t, 2 * i + 1]
            want[..., t, 2 * i], want[..., t, 2 * i + 1] = a * c - b * s, a * s + b * c
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[..., 0, :], x[..., 0, :])  # position 0 turns nothing
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_a_query_and_a_key_meet_through_their_offset_alone():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        return (rotary(q, torch.tensor([m])) * rotary(k, torch.tensor([n]))).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    torch.testing.assert_close(score(0, 0), score(40, 40))
    assert not torch.allclose(score(5, 2), score(5, 3))


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_rope_transformer_decodes_one_position_at_a_time_as_all_at_once(norm):
    model = tiny_model("transformer", norm=norm, positions="rope").eval()
    batch = random_batch()
    memory = model.encode(batch.src, batch.src_pad_mask)
    full, _ = model.decode_all(memory, batch.tgt_in)
    torch.testing.assert_close(
        stepwise_logits(model, batch, batch.tgt_in), full, atol=1e-5, rtol=1e-4
    )
    assert model.src_embed.pe.numel() == 0  # no table added to the embeddings
    plain = tiny_model("transformer", norm=norm).eval()
    assert not torch.allclose(plain.decode_all(memory, batch.tgt_in)[0], full)


def test_rope_needs_an_even_head_width():
    with pytest.raises(ValueError, match="must be even"):
        ModelConfig(arch="transformer", hidden_size=18, heads=2, positions="rope")


def test_a_rope_model_trains_translates_in_int8_and_refuses_ctranslate2(tmp_path, corpus, run_cli):
    from attnmt import Translator
    from attnmt.config import from_dict
    from attnmt.training.loop import train

    from conftest import tiny_config

    raw = tiny_config(corpus)
    raw["model"]["positions"] = "rope"
    raw["train"].update(max_steps=4, eval_every=4)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    fp32 = Translator.load(tmp_path / "m", "cpu").translate(["w1 w2", "w3"], beam=2)
    int8 = Translator.load(tmp_path / "m", "cpu", precision="int8").translate(["w1 w2", "w3"])
    assert len(fp32) == len(int8) == 2
    pytest.importorskip("ctranslate2")
    r = run_cli("export", str(tmp_path / "m"), str(tmp_path / "ct2"))
    assert r.code == 2 and "rotary positions" in r.stderr, r.stderr
    r = run_cli("export", str(tmp_path / "m"), str(tmp_path / "hf"), "--format", "huggingface")
    assert r.code == 2, r.stderr


def test_config_names_rope():
    with pytest.raises(ConfigError):
        from attnmt.config import from_dict

        from_dict({"model": {"positions": "alibi"}})
