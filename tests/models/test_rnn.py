import pytest
import torch

from attnmt.models.seq2seq import AttentionSpec, sequence_loss

from helpers import V, random_batch, stepwise_logits, tiny_model


@pytest.mark.parametrize("attention", ["bahdanau", "dot"])
@pytest.mark.parametrize("dec_layers", [1, 2])  # 1 + bahdanau: the fused recurrence
def test_shapes_and_teacher_forced_equals_stepwise(attention, dec_layers):
    model = tiny_model("rnn", attention=attention, dec_layers=dec_layers).eval()
    batch = random_batch()
    B, S = batch.src.shape
    memory = model.encode(batch.src, batch.src_pad_mask)
    assert memory.enc_out.shape == (B, S, 32)  # 2 directions x 16
    assert memory.proj_keys.shape[:2] == (B, S)
    state = model.init_state(memory)
    assert state.shape == (dec_layers, B, 32)
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


def _plain_scheduled_sampling(model, batch, tf_ratio, generator):
    """Scheduled sampling stepped through autograd, as the paper states it: each position
    after the first feeds the gold token (coin) or the argmax of the previous step's logits."""
    from attnmt.models.seq2seq import gold_coins

    memory = model.encode(batch.src, batch.src_pad_mask)
    h = model.init_state(memory)
    use_gold = gold_coins(tuple(batch.tgt_in.shape), tf_ratio, generator, batch.tgt_in.device)
    prev, steps = batch.tgt_in[:, 0], []
    for t in range(batch.tgt_in.size(1)):
        if t > 0:
            prev = torch.where(use_gold[:, t], batch.tgt_in[:, t], steps[-1].argmax(-1))
        logits, h, _ = model.decode_step(memory, h, prev)
        steps.append(logits)
    logits = torch.stack(steps, 1)  # (B, T, V), in float64 (sequence_loss casts to float32)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), batch.tgt_out.reshape(-1), ignore_index=0, label_smoothing=0.1,
        reduction="sum",
    )  # fmt: skip


@pytest.mark.parametrize("dec_layers", [1, 2])  # 1: through the fused recurrence
def test_scheduled_sampling_equals_the_autograd_path(dec_layers):
    """At ratio 0.5 the loss (with one decoder layer, its inputs chosen inside the fused
    recurrence) has the stepped path's value and gradients, with the same per-token coins."""
    model = tiny_model("rnn", dec_layers=dec_layers).double().train()
    batch = random_batch(B=6)
    results = []
    for fn in (model.loss, lambda b, r, s, g: (_plain_scheduled_sampling(model, b, r, g), 0)):
        model.zero_grad()
        loss = fn(batch, 0.5, 0.1, torch.Generator().manual_seed(3))[0]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss, grads), (ref, ref_grads) = results
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_scheduled_sampling_fused_equals_stepped_with_dropout():
    """With dropout, the fused recurrence chooses each input from the loss's own logits (same
    masks) and sends the predicted inputs' gradients to the embedding table, as autograd does."""
    import contextlib

    from attnmt.kernels import plain_recurrences
    from attnmt.models.seq2seq import gold_coins

    model = tiny_model("rnn", dec_layers=1, dropout=0.3).double().train()
    batch = random_batch(B=6)
    use_gold = gold_coins(tuple(batch.tgt_in.shape), 0.5, torch.Generator().manual_seed(1), "cpu")
    results = []
    for fused in (True, False):
        model.zero_grad()
        torch.manual_seed(7)  # the same dropout masks for both
        memory = model.encode(batch.src, batch.src_pad_mask)
        with contextlib.nullcontext() if fused else plain_recurrences():
            h = model.scheduled_sampling(memory, model.init_state(memory), batch.tgt_in, use_gold)
        (h * torch.linspace(-1, 1, h.numel(), dtype=h.dtype).view_as(h)).sum().backward()
        results.append((h.detach(), [p.grad.clone() for p in model.parameters()]))
    (h, grads), (ref, ref_grads) = results
    assert (h == 0).any() and not use_gold[:, 1:].all()  # dropout and predictions took part
    torch.testing.assert_close(h, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_tied_embeddings():
    model = tiny_model("rnn")
    assert model.output.weight is model.tgt_embed.weight
    assert model.encoder.embed is model.tgt_embed


def test_encoder_without_gradient_runs_packed_gru(monkeypatch):
    """Decoding and validation (no gradient) take nn.GRU's faster loop, with the same states."""
    import attnmt.models.rnn as rnn

    model = tiny_model("rnn", enc_layers=1).double().eval()
    batch = random_batch(B=5)
    calls = []
    fused_fn = rnn.bigru_recurrence
    # Counts the calls that ran the fused recurrence (it returns None where it does not apply).
    monkeypatch.setattr(
        rnn,
        "bigru_recurrence",
        lambda *a: ((r := fused_fn(*a)) is not None and calls.append(1)) or r,
    )
    out, final = model.encoder(batch.src, batch.src_pad_mask)  # training path: fused
    assert calls == [1]
    with torch.no_grad():
        ng_out, ng_final = model.encoder(batch.src, batch.src_pad_mask)
    assert calls == [1]
    torch.testing.assert_close(ng_out, out.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ng_final, final.detach(), rtol=1e-10, atol=1e-12)


def test_fused_training_follows_the_autograd_loss_curve():
    """Ten Adam steps with dropout through the fused recurrences and through autograd's
    stepping (nn.GRU, packed encoder) give the same losses and weights, in float64."""
    import contextlib

    from attnmt.kernels import plain_recurrences

    curves, weights = [], []
    for fused in (True, False):
        model = tiny_model("rnn", enc_layers=1, dec_layers=1, dropout=0.1).double().train()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        torch.manual_seed(5)  # the dropout masks' seeds come from torch's generator
        losses = []
        for step in range(10):
            with contextlib.nullcontext() if fused else plain_recurrences():
                loss, n = model.loss(random_batch(seed=step, B=6), 1.0, 0.1)
            opt.zero_grad()
            (loss / n).backward()
            opt.step()
            losses.append(loss.item() / int(n))
        curves.append(losses)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert curves[0][-1] < curves[0][0]
    assert curves[0] == pytest.approx(curves[1], rel=1e-9)
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-7, atol=1e-9)
