"""attnmt.kernels.recurrence: the hand-written backpropagation through time equals autograd's."""

import contextlib

import torch

from attnmt.kernels import plain_recurrences

from helpers import random_batch, tiny_model


def _recurrence_grads(model, batch, fused: bool, autocast: bool = False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        memory = model.encode(batch.src, batch.src_pad_mask)
        embs = model.tgt_embed(batch.tgt_in)  # (B, T, E)
        with contextlib.nullcontext() if fused else plain_recurrences():
            outs, contexts = model.teacher_forced(memory, model.init_state(memory), embs)
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
        with contextlib.nullcontext() if fused else plain_recurrences():
            out, final = model.encoder(batch.src, batch.src_pad_mask)
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
