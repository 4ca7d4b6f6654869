import pytest
import torch

from attnmt.model import AttentionSpec, sequence_loss

from models import V, random_batch, stepwise_logits, tiny_model


@pytest.mark.parametrize("attention", ["bahdanau", "dot"])
def test_shapes_and_teacher_forced_equals_stepwise(attention):
    model = tiny_model("rnn", attention=attention).eval()
    batch = random_batch()
    B, S = batch.src.shape
    memory = model.encode(batch.src, batch.src_pad_mask)
    assert memory.enc_out.shape == (B, S, 32)  # 2 directions x 16
    assert memory.proj_keys.shape[:2] == (B, S)
    state = model.init_state(memory)
    assert state.shape == (2, B, 32)
    logits, _, attn = model.decode_step(memory, state, batch.tgt_in[:, 0], AttentionSpec())
    assert logits.shape == (B, V) and attn.shape == (B, S)
    assert torch.all(attn[batch.src_pad_mask] == 0)
    loss, n = model.loss(batch, 1.0, 0.0)
    stepwise = stepwise_logits(model, batch, batch.tgt_in)
    torch.testing.assert_close(loss, sequence_loss(stepwise, batch.tgt_out, 0.0)[0])
    assert n == batch.n_tokens


def test_encoder_ignores_padding():
    model = tiny_model("rnn").eval()
    batch = random_batch()
    n = int((~batch.src_pad_mask[1]).sum())
    full = model.encode(batch.src, batch.src_pad_mask)
    alone = model.encode(batch.src[1:2, :n], batch.src_pad_mask[1:2, :n])
    torch.testing.assert_close(full.enc_out[1, :n], alone.enc_out[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(full.final[1], alone.final[0], atol=1e-6, rtol=1e-5)


def test_scheduled_sampling_feeds_own_predictions():
    model = tiny_model("rnn").eval()
    batch = random_batch()
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    model.loss(batch, 1.0, 0.0, g)
    assert torch.equal(g.get_state(), state), "ratio 1.0 must not draw coins"
    sampled, _ = model.loss(batch, 0.0, 0.0, g)
    # ratio 0 is free-running greedy decoding: each step feeds the previous argmax.
    memory = model.encode(batch.src, batch.src_pad_mask)
    h = model.init_state(memory)
    prev, steps = batch.tgt_in[:, 0], []
    for _ in range(batch.tgt_in.size(1)):
        logits, h, _ = model.decode_step(memory, h, prev)
        steps.append(logits)
        prev = logits.argmax(-1)
    expected = sequence_loss(torch.stack(steps, 1), batch.tgt_out, 0.0)[0]
    torch.testing.assert_close(sampled, expected)


def test_tied_embeddings():
    model = tiny_model("rnn")
    assert model.output.weight is model.tgt_embed.weight
    assert model.encoder.embed is model.tgt_embed
