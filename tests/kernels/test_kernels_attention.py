"""attnmt.kernels.attention: attention with dropout on CPU, head by head, equals the plain
equations (attnmt.models.attention.scaled_dot_product) with the same dropout mask; a decoding
step's attention (step_attention) equals them too."""

from __future__ import annotations

import pytest
import torch

from attnmt.kernels import fused_attention
from attnmt.kernels.attention import PRODUCTS_FROM_KEYS, step_attention
from attnmt.models.attention import additive_mask, causal_mask, scaled_dot_product


def heads(B: int, T: int, h: int, d: int) -> torch.Tensor:
    """(B, h, T, d) view of a (B, T, h, d) projection, as MultiHeadAttention.split_heads gives."""
    return torch.randn(B, T, h * d).view(B, T, h, d).transpose(1, 2).requires_grad_()


@pytest.mark.parametrize("causal", [False, True])
def test_headwise_attention_equals_the_plain_equations(causal: bool):
    torch.manual_seed(0)
    B, h, T_q, T_k, d = 3, 4, 5, 5 if causal else 7, 8
    q, k, v = heads(B, T_q, h, d), heads(B, T_k, h, d), heads(B, T_k, h, d)
    pad = torch.zeros(B, T_k, dtype=torch.bool)
    pad[1, -2:] = True
    mask = additive_mask(pad, None, torch.float32)  # (B, 1, 1, T_k)
    torch.manual_seed(1)
    out = fused_attention(q, k, v, mask, causal, 0.3)
    assert out is not None and out.shape == (B, h, T_q, d)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    plain_mask = mask
    if causal:
        plain_mask = mask + additive_mask(None, causal_mask(T_q), torch.float32)
    torch.manual_seed(1)  # the same dropout mask
    ref, _ = scaled_dot_product(q, k, v, plain_mask, 0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
    # Dropout happened (some weights zeroed), and the output is laid out as (B, T_q, h, d).
    assert not torch.allclose(out, scaled_dot_product(q, k, v, plain_mask, 0.0)[0])
    assert out.transpose(1, 2).is_contiguous()


def test_headwise_attention_only_where_it_is_the_faster_form():
    torch.manual_seed(2)
    q = k = v = heads(2, 3, 2, 4)
    with torch.no_grad():  # nothing to differentiate: the plain equations
        assert fused_attention(q, k, v, None, False, 0.1) is None
    assert fused_attention(q.double(), k.double(), v.double(), None, False, 0.1) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 heads under bf16 autocast
        assert fused_attention(q, k, v, None, False, 0.1) is None
    assert fused_attention(q, k, v, None, False, 0.1) is not None


def test_headwise_attention_under_bf16_autocast_matches_the_plain_equations():
    """bf16 heads (what autocast's projections give): products in bf16, weights in fp32."""
    torch.manual_seed(3)
    B, h, T, d = 2, 4, 6, 8
    q, k, v = (heads(B, T, h, d).detach().bfloat16().requires_grad_() for _ in range(3))
    mask = additive_mask(None, causal_mask(T), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(4)
        out = fused_attention(q, k, v, None, True, 0.2)
        assert out is not None and out.dtype == torch.bfloat16
        torch.manual_seed(4)
        ref, _ = scaled_dot_product(q, k, v, mask, 0.2)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref.to(out.dtype), atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b.to(a.dtype), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("queries", [1, 3])  # one query a row (sums, or products), several
@pytest.mark.parametrize("T", [6, PRODUCTS_FROM_KEYS])  # one query: sums, then products
@pytest.mark.parametrize("keys_dtype", [torch.float32, torch.bfloat16])
def test_step_attention_equals_the_plain_equations(queries: int, T: int, keys_dtype: torch.dtype):
    torch.manual_seed(1)
    B, h, d = 3, 4, 8
    q = torch.randn(B, h, queries, d)
    k, v = (torch.randn(B, h, T, d).to(keys_dtype) for _ in range(2))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[2, -3:] = True
    mask = additive_mask(pad, None, torch.float32)  # (B, 1, 1, T)
    plain, _ = scaled_dot_product(q, k.float(), v.float(), mask)  # (B, h, G, d)
    out = step_attention(q, k, v, mask)
    assert out.dtype == keys_dtype and out.shape == (B, h, queries, d)
    tolerance = 1e-5 if keys_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), plain, rtol=tolerance, atol=tolerance)
