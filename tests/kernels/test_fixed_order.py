"""kernels.fixed_order: LayerNorm, softmax and the gradient norm equal torch's forms, and their
CPU gradients are the same bits on 1 to 4 threads (torch's LayerNorm and softmax backward
are not: their sums follow the thread count)."""

from __future__ import annotations

import pytest
import torch

from attnmt.kernels.fixed_order import LayerNorm, clip_grad_norm, softmax


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def on_threads(work, counts=(1, 2, 3, 4)) -> list[list[torch.Tensor]]:
    out = []
    for n in counts:
        torch.set_num_threads(n)
        out.append(work())
    return out


def test_layer_norm_equals_torchs_and_its_gradients_follow_no_thread_count(threads):
    torch.manual_seed(0)
    ours = LayerNorm(256)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ours.bias.uniform_(-0.5, 0.5)
    plain = torch.nn.LayerNorm(256)
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(3000, 256) * torch.logspace(-2, 2, 3000).unsqueeze(1)
    dy = torch.randn(3000, 256)

    def grads(module):
        def work():
            module.zero_grad()
            xi = x.clone().requires_grad_()
            (module(xi) * dy).sum().backward()
            return [xi.grad, module.weight.grad.clone(), module.bias.grad.clone()]

        return work

    found = on_threads(grads(ours))
    assert all(torch.equal(a, b) for run in found[1:] for a, b in zip(found[0], run, strict=True))
    want = grads(plain)()
    for a, b in zip(found[0], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert torch.equal(ours(x), plain(x))  # the forward is torch's own


def test_softmax_equals_torchs_and_its_backward_follows_no_thread_count(threads):
    torch.manual_seed(0)
    scores = torch.randn(8, 64, 50, 50)
    dw = torch.randn(8, 64, 50, 50)

    def work():
        s = scores.clone().requires_grad_()
        softmax(s).backward(dw)
        return [s.grad]

    found = on_threads(work)
    assert all(torch.equal(found[0][0], run[0]) for run in found[1:])
    s = scores.clone().requires_grad_()
    torch.softmax(s, -1).backward(dw)
    torch.testing.assert_close(found[0][0], s.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(softmax(scores), torch.softmax(scores, -1))  # no gradient: torch's


@pytest.mark.parametrize("max_norm", [0.1, 1e9])
def test_clip_grad_norm_equals_torchs_on_any_thread_count(threads, max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(n) * 3 for n in (7, 1024, 70_000, 300_001)]

    def fresh() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        return params

    def work():
        mine = fresh()
        return [clip_grad_norm(mine, max_norm), *(p.grad for p in mine)]

    found = on_threads(work)
    assert all(torch.equal(a, b) for run in found[1:] for a, b in zip(found[0], run, strict=True))
    theirs = fresh()
    norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(found[0][0], norm, rtol=1e-5, atol=0)  # summed otherwise
    for a, p in zip(found[0][1:], theirs, strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)
