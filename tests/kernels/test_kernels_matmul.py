"""attnmt.matmul: oneDNN products equal the plain ones up to rounding, and the backend choice."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from attnmt.kernels import matmul
from attnmt.kernels.ops import linear_cross_entropy, relu_dropout_linear

from helpers import random_batch, tiny_model

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch):
    """oneDNN for every product, however small (the tests' dims are far below the threshold)."""
    monkeypatch.setattr(matmul, "ONEDNN_MIN_WORK", 0)
    with matmul.matmul_backend("onednn") as name:
        assert name == "onednn"
        yield


def calls_onednn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls into oneDNN from now on."""
    calls: list[int] = []
    real = matmul._dnnl

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(matmul, "_dnnl", counting)
    return calls


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear_forward_and_backward(onednn, monkeypatch, bias: bool):
    torch.manual_seed(0)
    layer = matmul.Linear(16, 24, bias=bias)
    x = torch.randn(3, 5, 16, requires_grad=True)  # (B, T, K)
    calls = calls_onednn(monkeypatch)
    y = layer(x)  # (B, T, N)
    assert y.shape == (3, 5, 24)
    assert len(calls) == 1
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *layer.parameters()], g)
    assert len(calls) == 3  # and ∂x, ∂W
    ref = F.linear(x, layer.weight, layer.bias)
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()], g)
    torch.testing.assert_close(y, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref)
    # An expanded incoming gradient (stride 0, from a sum) works too.
    gx = torch.autograd.grad(layer(x).sum(), x)[0]
    ref_gx = torch.autograd.grad(F.linear(x, layer.weight, layer.bias).sum(), x)[0]
    torch.testing.assert_close(gx, ref_gx)


@needs_onednn
def test_mm_with_and_without_addend(onednn):
    torch.manual_seed(1)
    a, b, c = torch.randn(7, 9), torch.randn(11, 9).t(), torch.randn(7, 11)  # b strided
    torch.testing.assert_close(matmul.mm(a, b), a @ b)
    torch.testing.assert_close(matmul.mm(a, b, add=c), a @ b + c)
    assert torch.equal(c, c.clone())  # the addend is not written
    # A slice with gaps between its rows (oneDNN's reference kernel would take it) is copied.
    wide = torch.randn(11, 20)
    torch.testing.assert_close(matmul.mm(a, wide[:, 3:12].t()), a @ wide[:, 3:12].t())
    torch.testing.assert_close(matmul.linear(a, wide[:, 3:12]), F.linear(a, wide[:, 3:12]))


@needs_onednn
def test_mm_of_a_transposed_input_copies_the_smaller_operand(onednn, monkeypatch):
    """A weight gradient ∂yᵀ x: oneDNN would copy the wide transposed ∂yᵀ, so the product is
    taken as (xᵀ ∂y)ᵀ, copying x; equal values, the result (and a running sum) transposed."""
    torch.manual_seed(6)
    grad_y, x = torch.randn(40, 30), torch.randn(40, 4)  # (M, N) wide, (M, K) narrow
    inputs: list[tuple[int, ...]] = []
    real = matmul._dnnl
    monkeypatch.setattr(
        matmul, "_dnnl", lambda x, w, b=None: inputs.append(x.shape) or real(x, w, b)
    )
    total = matmul.mm(grad_y.t(), x)  # (N, K)
    assert inputs == [(4, 40)]  # xᵀ is oneDNN's input (copied), ∂yᵀ its weight (read in place)
    total = matmul.mm(grad_y.t(), x, add=total)
    torch.testing.assert_close(total, 2 * grad_y.t() @ x)
    assert total.shape == (30, 4) and total.t().is_contiguous()


def test_blas_and_small_or_non_fp32_products_are_the_plain_ops(monkeypatch):
    torch.manual_seed(2)
    layer = matmul.Linear(8, 6)
    x = torch.randn(4, 8)
    calls = calls_onednn(monkeypatch)
    with matmul.matmul_backend("blas"):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with matmul.matmul_backend("onednn"):  # 4 x 8 x 6 is far below ONEDNN_MIN_WORK
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        monkeypatch.setattr(matmul, "ONEDNN_MIN_WORK", 0)
        x64, w64 = x.double(), layer.weight.double()
        assert torch.equal(matmul.linear(x64, w64), F.linear(x64, w64))
        assert torch.equal(matmul.linear(x, w64[:1].float()), F.linear(x, w64[:1].float()))
    assert calls == []


@needs_onednn
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_linear_cross_entropy_with_onednn(onednn, monkeypatch, smoothing: float):
    torch.manual_seed(3)
    h = torch.randn(2, 5, 8, requires_grad=True)  # (B, T, d)
    w = torch.randn(11, 8, requires_grad=True)  # (V, d)
    target = torch.randint(1, 11, (2, 5))
    target[1, 2:] = 0
    calls = calls_onednn(monkeypatch)
    loss, n = linear_cross_entropy(h, w, target, 0, smoothing, chunk=3)
    assert n == 7 and calls
    ref = F.cross_entropy(
        F.linear(h, w).reshape(-1, 11), target.reshape(-1), ignore_index=0,
        label_smoothing=smoothing, reduction="sum",
    )  # fmt: skip
    torch.testing.assert_close(loss, ref)
    for a, b in zip(
        torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w)), strict=True
    ):
        torch.testing.assert_close(a, b)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_relu_dropout_linear_with_onednn(onednn, bias: bool):
    torch.manual_seed(4)
    layer = matmul.Linear(12, 5, bias=bias)
    h = torch.randn(30, 12, requires_grad=True)
    params = [p for p in layer.parameters()]
    torch.manual_seed(5)
    fast = relu_dropout_linear(h * 1.0, layer, 0.3, True)  # a fresh tensor, as it needs
    fast_grads = torch.autograd.grad(fast.sum(), [h, *params])
    with matmul.matmul_backend("blas"):
        torch.manual_seed(5)
        plain = relu_dropout_linear(h * 1.0, layer, 0.3, True)
        plain_grads = torch.autograd.grad(plain.sum(), [h, *params])
    torch.testing.assert_close(fast, plain)
    for a, b in zip(fast_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b)


@needs_onednn
def test_feed_forward_keeps_its_fused_relu_dropout_with_onednn(onednn, monkeypatch):
    """oneDNN's linear gives 2-D rows as a tensor of their own, so the feed-forward block's
    fused ReLU-dropout (which works in place) still runs, not the plain composition."""
    from attnmt.kernels import ops

    fused: list[int] = []
    real = ops._ReluDropoutLinear.apply
    monkeypatch.setattr(ops._ReluDropoutLinear, "apply", lambda *a: fused.append(1) or real(*a))
    w_1, w_2 = matmul.Linear(8, 16), matmul.Linear(16, 8)
    x = torch.randn(2, 5, 8, requires_grad=True)  # (B, T, d)
    y = ops.feed_forward(x, w_1, w_2, 0.2, True)
    y.sum().backward()
    assert y.shape == (2, 5, 8) and fused == [1] and x.grad is not None


@needs_onednn
@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_model_loss_and_gradients_match_blas(onednn, monkeypatch, arch: str):
    model = tiny_model(arch, dropout=0.0)
    batch = random_batch(6, B=5)
    calls = calls_onednn(monkeypatch)
    loss, n = model.loss(batch, 1.0, 0.1)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert calls
    with matmul.matmul_backend("blas"):
        ref, ref_n = model.loss(batch, 1.0, 0.1)
        ref_grads = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    assert n == ref_n
    torch.testing.assert_close(loss, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


INTEL = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f avx512bw amx_tile\n"
AMD_ZEN5 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 fma avx2 avx512f avx512_bf16\n"
AMD_AVX2 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 fma avx2\n"


def test_auto_picks_onednn_only_for_non_intel_avx512():
    assert matmul.prefers_onednn(AMD_ZEN5)
    assert not matmul.prefers_onednn(AMD_AVX2)
    assert not matmul.prefers_onednn(INTEL)
    assert not matmul.prefers_onednn("")
    for faster, expected in ((True, "onednn"), (False, "blas")):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(matmul, "onednn_is_faster", lambda f=faster: f)
            if expected == "onednn" and not torch.backends.mkldnn.is_available():
                continue
            with matmul.matmul_backend("auto") as name:
                assert name == expected == matmul.active_backend()


def test_the_backend_is_scoped():
    before = matmul.active_backend()
    with matmul.matmul_backend("onednn"), matmul.matmul_backend("blas"):
        assert matmul.active_backend() == "blas"
    assert matmul.active_backend() == before
    with pytest.raises(RuntimeError), matmul.matmul_backend("onednn"):
        raise RuntimeError("a failure inside the block")
    assert matmul.active_backend() == before
    with pytest.raises(ValueError, match="auto, blas, onednn"):
        matmul.resolve("mkl")


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_column_major_weights_keep_every_output(arch: str):
    """Decoding's weights stored transposed give the same logits step by step, leave the
    embeddings row-major (a tied output layer gets its own copy), and change fp32 CPU
    weights only."""
    model = tiny_model(arch).eval()
    batch = random_batch(seed=1)
    src, src_mask = batch.src, batch.src_pad_mask
    with torch.no_grad():
        before = _steps(model, src, src_mask)
        tied = (
            model.output.weight is model.tgt_embed.embed.weight if arch == "transformer" else None
        )
        matmul.column_major_weights(model)
        after = _steps(model, src, src_mask)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert embeddings and all(m.weight.is_contiguous() for m in embeddings)
    if tied:
        assert model.output.weight is not model.tgt_embed.embed.weight
    half = tiny_model(arch).half()
    matmul.column_major_weights(half)
    assert all(m.weight.is_contiguous() for m in half.modules() if isinstance(m, torch.nn.Linear))


def _steps(model, src: torch.Tensor, src_mask: torch.Tensor, n: int = 4) -> torch.Tensor:
    """The logits of n greedy steps (n, B, V)."""
    memory = model.encode(src, src_mask)
    state = model.init_state(memory)
    prev = torch.full((src.size(0),), 2, dtype=torch.long)
    out = []
    for _ in range(n):
        logits, state, _ = model.decode_step(memory, state, prev)
        out.append(logits)
        prev = logits.argmax(1)
    return torch.stack(out)


@needs_onednn
@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_onednn_packed_weights_give_the_same_steps(onednn, monkeypatch, arch: str):
    """Where `auto` picks oneDNN, decoding's fp32 linear layers also hold their weights in
    oneDNN's layout, and every oneDNN product of encoding and steps (the lean step's stacked
    q, k, v too) reads it, with the same logits; elsewhere nothing is packed."""
    from attnmt.decoding.precision import for_decoding

    model = tiny_model(arch).eval()
    batch = random_batch(seed=1)
    src, src_mask = batch.src, batch.src_pad_mask
    monkeypatch.setattr(matmul, "onednn_is_faster", lambda: False)
    with torch.no_grad():
        before = _steps(for_decoding(copy.deepcopy(model), "fp32"), src, src_mask)
    plain = for_decoding(copy.deepcopy(model), "fp32")
    assert all(getattr(m, "packed", None) is None for m in plain.modules())
    monkeypatch.setattr(matmul, "onednn_is_faster", lambda: True)
    packed = for_decoding(model, "fp32")
    linears = [m for m in packed.modules() if isinstance(m, matmul.Linear) and m.out_features >= 16]
    assert linears and all(m.packed is not None for m in linears)
    used: list[bool] = []
    real = matmul._dnnl
    monkeypatch.setattr(
        matmul, "_dnnl", lambda x, w, b=None, p=None: used.append(p is not None) or real(x, w, b, p)
    )
    with torch.no_grad():
        after = _steps(packed, src, src_mask)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert used and all(used)
    with torch.no_grad():  # a weight changed in place: its packed copy is made again
        for net in (plain, packed):
            net.output.weight.mul_(-1.0)
        torch.testing.assert_close(
            _steps(packed, src, src_mask), _steps(plain, src, src_mask), rtol=1e-5, atol=1e-5
        )
        # a copy (oneDNN's layout has no storage to copy) packs again at its first step
        torch.testing.assert_close(_steps(copy.deepcopy(packed), src, src_mask),
                                   _steps(packed, src, src_mask))  # fmt: skip
