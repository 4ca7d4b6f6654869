import pytest
import torch
import torch.nn.functional as F

from attnmt.kernels.ops import (
    Dropout,
    dropout,
    dropout_scale,
    keep_mask,
    linear_cross_entropy,
    mask_threads,
    relu_dropout_linear,
)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [3, 512])
def test_linear_cross_entropy_matches_plain_ops(smoothing: float, chunk: int):
    torch.manual_seed(0)
    h = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)  # (B, T, d)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)  # (V, d)
    target = torch.randint(1, 11, (2, 5))
    target[0, 3:] = 0  # padding
    ref = F.cross_entropy(
        F.linear(h, w).reshape(-1, 11), target.reshape(-1), ignore_index=0,
        label_smoothing=smoothing, reduction="sum",
    )  # fmt: skip
    ref_gh, ref_gw = torch.autograd.grad(ref * 0.7, (h, w))
    loss, n = linear_cross_entropy(h, w, target, 0, smoothing, chunk=chunk)
    gh, gw = torch.autograd.grad(loss * 0.7, (h, w))
    assert n == 8
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)
    # Padded positions get no gradient.
    assert gh[0, 3:].abs().sum() == 0
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, target, 0, smoothing)[0], ref)


def test_linear_cross_entropy_under_bf16_autocast_matches_autocast_linear():
    """Under CPU autocast the fused path does its matmuls in bf16 (as F.linear would) and the
    softmax in fp32; loss and gradients agree with F.linear + F.cross_entropy under autocast
    to bf16 precision, and the gradients come back in the parameters' fp32."""
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 0.3).requires_grad_()
    target = torch.randint(1, 50, (40,))
    target[-5:] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keep = target != 0
        logits = F.linear(h[keep], w).float()
        ref = F.cross_entropy(logits, target[keep], label_smoothing=0.1, reduction="sum")
        loss, n = linear_cross_entropy(h, w, target, 0, 0.1, chunk=7)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert n == 35 and loss.dtype == torch.float32
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=0.0)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-2, atol=1e-2)
    # Not the fp32 result: the matmuls did run in bf16.
    fp32_loss, _ = linear_cross_entropy(h, w, target, 0, 0.1)
    assert not torch.equal(loss, fp32_loss)


def test_dropout_scale_rate_lanes_and_determinism():
    torch.manual_seed(1)
    m = dropout_scale((1000, 301), 0.1)
    assert m.shape == (1000, 301) and m.dtype == torch.float32
    assert torch.allclose(m.unique(), torch.tensor([0.0, 1 / 0.9]))
    assert abs((m == 0).float().mean().item() - 0.1) < 0.003
    torch.manual_seed(1)
    assert torch.equal(dropout_scale((1000, 301), 0.1), m)
    # Each of the four 16-bit lanes of a random word drops at the rate p, the top one too.
    lanes = (m.reshape(-1)[: 4 * 60_000] == 0).reshape(-1, 4).float().mean(0)
    assert ((lanes - 0.1).abs() < 0.006).all(), lanes
    assert (dropout_scale((64,), 0.0) == 1.0).all()
    assert (dropout_scale((64,), 1.0 - 2**-16) == 0.0).all()


def test_dropout_scales_keeps_expectation_and_is_identity_in_eval():
    torch.manual_seed(2)
    x = torch.ones(200_000)
    y = dropout(x, 0.25, training=True)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - 0.25) < 0.01
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    assert abs(y.mean().item() - 1.0) < 0.01
    assert dropout(x, 0.25, training=False) is x
    module = Dropout(0.5).eval()
    assert module(x) is x


def test_inplace_dropout_equals_copying_dropout_and_backpropagates():
    x = torch.randn(50, 40, requires_grad=True)
    torch.manual_seed(3)
    a = dropout(x * 2, 0.3, True)
    a.sum().backward()
    grad_copy = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    b = dropout(x * 2, 0.3, True, inplace=True)
    b.sum().backward()
    assert torch.equal(a, b)
    assert torch.equal(grad_copy, x.grad)


@pytest.mark.parametrize("bias", [True, False])
def test_relu_dropout_linear_equals_the_plain_composition(bias):
    linear = torch.nn.Linear(12, 5, bias=bias)
    x = torch.randn(30, 7, requires_grad=True)
    w_1 = torch.nn.Linear(7, 12)
    params = [p for p in (linear.weight, linear.bias, w_1.weight, w_1.bias) if p is not None]
    torch.manual_seed(4)
    fast = relu_dropout_linear(w_1(x), linear, 0.3, True)
    fast.sum().backward()
    fast_grads = [t.grad.clone() for t in [x, *params]]
    for t in [x, *params]:
        t.grad = None
    torch.manual_seed(4)
    mask = keep_mask((30, 12), 0.3)
    assert 0 < int(mask.sum()) < mask.numel()
    plain = linear(torch.relu(w_1(x)) * mask / 0.7)
    plain.sum().backward()
    torch.testing.assert_close(fast, plain)
    for a, b in zip(fast_grads, [t.grad for t in [x, *params]], strict=True):
        torch.testing.assert_close(a, b)
    # In eval mode it is the plain composition: h left as it was where autograd keeps it,
    # overwritten by its ReLU where no gradient is taken (decoding: one pass fewer).
    h = w_1(x)
    before = h.detach().clone()
    torch.testing.assert_close(relu_dropout_linear(h, linear, 0.3, False), linear(torch.relu(h)))
    assert torch.equal(h, before)
    with torch.no_grad():
        h = w_1(x)
        expected = linear(torch.relu(h))
        assert bool((h < 0).any())
        torch.testing.assert_close(relu_dropout_linear(h, linear, 0.3, False), expected)
        assert torch.equal(h, torch.relu(before))


def test_keep_mask_does_not_depend_on_the_thread_count():
    masks = []
    for n in (1, 2, 3):
        with mask_threads(n):
            torch.manual_seed(6)
            masks.append(keep_mask((600, 1000), 0.1))  # 3 parts of 2^18 elements
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    # The parts are independent streams: no two parts repeat each other.
    flat = masks[0].reshape(-1)
    assert not torch.equal(flat[: 1 << 18], flat[1 << 18 : 2 << 18])
