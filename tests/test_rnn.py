import pytest
import torch

from attnmt.model import AttentionSpec, sequence_loss

from models import V, random_batch, stepwise_logits, tiny_model


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


def test_tied_embeddings():
    model = tiny_model("rnn")
    assert model.output.weight is model.tgt_embed.weight
    assert model.encoder.embed is model.tgt_embed


def _recurrence_grads(model, batch, fused: bool, autocast: bool = False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        memory = model.encode(batch.src, batch.src_pad_mask)
        embs = model.tgt_embed(batch.tgt_in)  # (B, T, E)
        outs, contexts = model.teacher_forced(memory, model.init_state(memory), embs, fused)
        # A loss that weighs every output and context element differently.
        g = torch.Generator().manual_seed(1)
        w_o = torch.randn(outs.shape, generator=g, dtype=torch.float64).to(outs.dtype)
        w_c = torch.randn(contexts.shape, generator=g, dtype=torch.float64).to(outs.dtype)
        loss = (outs * w_o).sum() + (contexts * w_c).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return outs.detach(), contexts.detach(), grads


def test_fused_recurrence_equals_autograd():
    """The hand-written backpropagation through time gives autograd's values and gradients,
    for every parameter (the encoder's and the embeddings' through the recurrence's input
    gradients), with padded sources."""
    model = tiny_model("rnn", dec_layers=1).double()
    batch = random_batch(B=5)
    assert batch.src_pad_mask.any()
    fused = _recurrence_grads(model, batch, True)
    plain = _recurrence_grads(model, batch, False)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-10, atol=1e-12)
    assert fused[2].keys() == plain[2].keys()
    assert {"rnn.weight_ih_l0", "attention.energy_layer.weight", "encoder.rnn.weight_hh_l0"} <= set(
        fused[2]
    )
    for name, grad in plain[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-9, atol=1e-11, msg=name)


def test_fused_recurrence_under_autocast():
    """Under CPU autocast the matmuls run in bf16: close to fp32, gradients in fp32."""
    model = tiny_model("rnn", dec_layers=1)
    batch = random_batch(B=5)
    ref = _recurrence_grads(model, batch, True)
    low = _recurrence_grads(model, batch, True, autocast=True)
    torch.testing.assert_close(low[0].float(), ref[0], rtol=0.05, atol=0.03)
    for name, grad in ref[2].items():
        assert low[2][name].dtype == torch.float32
        torch.testing.assert_close(low[2][name], grad, rtol=0.1, atol=0.05, msg=name)


def test_fused_encoder_equals_packed_gru():
    """The fused bidirectional GRU gives nn.GRU-over-packed-sequences' states, final summary
    and gradients (embeddings and both directions' weights), padding included."""
    model = tiny_model("rnn", enc_layers=1).double()
    batch = random_batch(B=5)
    assert batch.src_pad_mask.any()
    g = torch.Generator().manual_seed(2)
    results = []
    for fused in (True, False):
        model.zero_grad()
        out, final = model.encoder(batch.src, batch.src_pad_mask, fused=fused)
        w_o = torch.randn(out.shape, generator=g.manual_seed(2), dtype=torch.float64)
        w_f = torch.randn(final.shape, generator=g, dtype=torch.float64)
        ((out * w_o).sum() + (final * w_f).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.encoder.named_parameters()}
        results.append((out.detach(), final.detach(), grads))
    (out, final, grads), (ref_out, ref_final, ref_grads) = results
    assert torch.all(out[batch.src_pad_mask] == 0)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-12)
    assert len(grads) == 9  # the embedding and 4 weights per direction
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-11, msg=name)


def test_encoder_without_gradient_runs_packed_gru(monkeypatch):
    """Decoding and validation (no gradient) take nn.GRU's faster loop, with the same states."""
    import attnmt.rnn as rnn

    model = tiny_model("rnn", enc_layers=1).double().eval()
    batch = random_batch(B=5)
    calls = []
    fused_fn = rnn.bigru_recurrence
    monkeypatch.setattr(rnn, "bigru_recurrence", lambda *a: calls.append(1) or fused_fn(*a))
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
    import functools

    curves, weights = [], []
    for fused in (True, False):
        model = tiny_model("rnn", enc_layers=1, dec_layers=1, dropout=0.1).double().train()
        if not fused:
            model.teacher_forced = functools.partial(model.teacher_forced, fused=False)
            model.encoder.forward = functools.partial(model.encoder.forward, fused=False)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        torch.manual_seed(5)  # the dropout masks' seeds come from torch's generator
        losses = []
        for step in range(10):
            loss, n = model.loss(random_batch(seed=step, B=6), 1.0, 0.1)
            opt.zero_grad()
            (loss / n).backward()
            opt.step()
            losses.append(loss.item() / n)
        curves.append(losses)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert curves[0][-1] < curves[0][0]
    assert curves[0] == pytest.approx(curves[1], rel=1e-9)
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-7, atol=1e-9)
