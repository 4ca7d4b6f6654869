"""Scaled dot-product attention in torch's fused kernel (flash / memory-efficient / C++), or,
training on a CPU with attention dropout, head by head (_HeadwiseAttention), where either is
the faster way to compute attnmt.models.attention's equations.

Why not always the fused kernel: it returns no weights, and on CPU it draws its dropout mask
with the slow `bernoulli_`. Why head by head there: the heads of (B, T, h, d) projections are
(B, h, T, d) views whose (B, h) cannot merge into one batch axis, so a batched matmul over them
copies q, k, v and the output first, and its backward as many again; one head's (B, T, d) view
is a plain strided batch that bmm reads in place.

On a GPU, cuDNN's attention is left out of torch's choice: it builds an execution plan for
every new shape (13 ms of host time a call on an H100, measured), and training batches come in
hundreds of shapes; flash and memory-efficient attention have no such cost.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnmt.kernels.fixed_order import softmax_backward
from attnmt.kernels.ops import dropout_scale

# From this many keys a row, a decoding step's attention on a CPU is faster as two batched
# products than as sums of element-wise products (step_attention).
PRODUCTS_FROM_KEYS = 16

# The kernels torch may pick from on a GPU (module docstring): not cuDNN's.
GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
) -> torch.Tensor | None:
    """softmax(q kᵀ / sqrt(d) + mask (+ causal mask)) v by F.scaled_dot_product_attention or,
    with dropout on CPU (fp32, or bf16 under autocast), head by head; None where the plain
    equations are faster (dropout on CPU in other dtypes, under torch.compile, or without a
    gradient to take).

    Args:
        q: (B, h, T_q, d); k: (B, h, T_k, d); v: (B, h, T_k, d_v).
        mask: additive float mask broadcastable to (B, h, T_q, T_k), or None.
        causal: position t attends to keys <= t only.
    Returns:
        (B, h, T_q, d_v), or None.
    """
    if dropout_p > 0.0 and q.device.type == "cpu":
        # fp32, or bf16 under CPU autocast (the projections' outputs): the weights in fp32.
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else torch.float32
        headwise = (
            q.dtype == k.dtype == v.dtype == dtype
            and dtype in (torch.float32, torch.bfloat16)
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )
        if not headwise:
            return None
        if causal:
            mask = _with_causal(mask, q.size(-2), k.size(-2), q.device)
        with torch.autocast("cpu", enabled=False):  # the casts are the function's own
            out = _HeadwiseAttention.apply(q, k, v, mask, dropout_p)
        return out  # type: ignore[no-any-return]
    if causal and mask is not None:
        # The kernel's is_causal flag cannot be combined with a mask: add the causal one.
        mask, causal = _with_causal(mask, q.size(-2), k.size(-2), q.device), False
    backends = sdpa_kernel(GPU_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
        )  # (B, h, T_q, d_v)


def _with_causal(
    mask: torch.Tensor | None, T_q: int, T_k: int, device: torch.device
) -> torch.Tensor:
    """mask (or none: fp32) plus the causal mask, -inf where key t' > query t:
    (B|1, h|1, T_q, T_k)."""
    dtype = torch.float32 if mask is None else mask.dtype
    future = torch.ones(T_q, T_k, dtype=torch.bool, device=device).triu(1)  # (T_q, T_k)
    causal = torch.zeros(T_q, T_k, dtype=dtype, device=device)
    causal = causal.masked_fill(future, float("-inf"))
    return causal if mask is None else mask + causal


class _HeadwiseAttention(torch.autograd.Function):
    """out = (softmax(q kᵀ / √d + mask) ⊙ keep) v per head (Vaswani et al. eq. 1, with
    nn.MultiheadAttention's dropout on the weights), forward and backward one head at a time.
    q, k, v in fp32 or bf16 (the products in their dtype, as autocast runs them); the scores,
    weights and their gradients in fp32.

    q (B, h, T_q, d), k, v (B, h, T_k, d): views of (B, T, h, d) projections; each head's (B, T,
    d) slice goes to bmm as it is. Scores, weights and their gradients live as (h, B, T_q, T_k),
    one contiguous block per head. The dropout mask is drawn for (B, h, T_q, T_k), the plain
    equations' shape, so both draw the same mask from the same seed. Backward, with
    s = q kᵀ / √d + mask, w = softmax(s) and w̃ = w ⊙ keep:
        ∂v = w̃ᵀ ∂out,   ∂w = (∂out vᵀ) ⊙ keep,   ∂s = w ⊙ (∂w - Σ_k ∂w ⊙ w)  (softmax's),
        ∂q = ∂s k / √d,   ∂k = ∂sᵀ q / √d.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        p: float,
    ) -> torch.Tensor:
        B, h, T_q, d = q.shape
        T_k = k.size(2)
        scores = q.new_empty(h, B, T_q, T_k)  # in q's dtype: fp32, or bf16 (then cast)
        for i in range(h):
            torch.bmm(q[:, i], k[:, i].transpose(1, 2), out=scores[i])  # (B, T_q, T_k)
        scores = scores.float().mul_(1.0 / math.sqrt(d))  # no copy in fp32
        if mask is not None:
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # 4-D
            scores.add_(mask.transpose(0, 1))  # (h|1, B|1, T_q|1, T_k)
        weights = torch.softmax(scores, dim=-1)  # (h, B, T_q, T_k), fp32
        keep = dropout_scale((B, h, T_q, T_k), p).transpose(0, 1)  # (h, B, T_q, T_k) view
        dropped = torch.mul(weights, keep, out=scores).to(v.dtype)  # w̃, over the scores
        out = v.new_empty(h, B, T_q, v.size(-1))
        for i in range(h):
            torch.bmm(dropped[i], v[:, i], out=out[i])  # (B, T_q, d_v)
        ctx.save_for_backward(q, k, v, weights, keep)
        # (B, T_q, h, d_v) in memory, as the output projection reads it; (B, h, T_q, d_v) view.
        return out.permute(1, 2, 0, 3).contiguous().transpose(1, 2)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, weights, keep = ctx.saved_tensors  # type: ignore[attr-defined]
        B, h, T_q, d = q.shape
        T_k, scale = k.size(2), 1.0 / math.sqrt(d)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        grad_w = torch.empty_like(weights, dtype=v.dtype)  # (h, B, T_q, T_k)
        grad_v = v.new_empty(h, B, T_k, v.size(-1))  # (h, B, T_k, d_v)
        dropped = (weights * keep).to(v.dtype)  # (h, B, T_q, T_k)
        for i in range(h):
            g = grad_out[:, i]  # (B, T_q, d_v)
            torch.bmm(g, v[:, i].transpose(1, 2), out=grad_w[i])  # ∂w̃ (B, T_q, T_k)
            torch.bmm(dropped[i].transpose(1, 2), g, out=grad_v[i])  # (B, T_k, d_v)
        grad_w = grad_w.float().mul_(keep)  # fp32 from here (no copy in fp32)
        grad_s = softmax_backward(grad_w, weights)  # not torch's: the same on any threads
        grad_s = grad_s.mul_(scale).to(q.dtype)  # (h, B, T_q, T_k)
        grad_q = q.new_empty(h, B, T_q, d)
        grad_k = k.new_empty(h, B, T_k, d)
        for i in range(h):
            torch.bmm(grad_s[i], k[:, i], out=grad_q[i])
            torch.bmm(grad_s[i].transpose(1, 2), q[:, i], out=grad_k[i])
        heads_second = (1, 0, 2, 3)  # (h, B, T, d) -> (B, h, T, d)
        return (
            grad_q.permute(heads_second), grad_k.permute(heads_second),
            grad_v.permute(heads_second), None, None,
        )  # fmt: skip


def step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    products_from_keys: int = PRODUCTS_FROM_KEYS,
) -> torch.Tensor:
    """A decoding step's attention, softmax(q kᵀ / √d + mask) v, in the dtype k and v are kept
    in (a decoder's cache_dtype).

    q (B, h, G, d_h): G queries a row (beam search's cross-attention: a sentence's beams);
    k, v (B, h, T, d_h); mask additive, (B|1, 1, 1, T), or None. On a CPU in fp32, one query a
    row over fewer than `products_from_keys` keys as sums of element-wise products,
    s_t = Σ_i q_i k_ti / √d and o = Σ_t softmax(s)_t v_t, each read of the keys and values one
    pass over memory; more keys, or several queries, as two batched products, the softmax
    between. torch's fused kernel, sized for long queries, makes a product per row and head
    (whole runs, 1 thread, 500 sentences: greedy attention 0.28 → 0.18 s fp32, 0.25 → 0.16 s
    int8; beam 5 0.50 → 0.46 s fp32, 0.45 → 0.43 s int8). From 16 keys the batched products
    win (64 rows, 4 heads of 64, 1 thread, Zen 4: 15 keys 133 µs by sums against 146, 16 keys
    139 against 85, 40 keys 323 against 162; docs/benchmarks.md).
    """
    if q.dtype != k.dtype:  # models.attention.in_keys_dtype
        q = q.to(k.dtype)
        if mask is not None:
            mask = mask.to(k.dtype)
    if q.is_cuda or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if q.size(2) == 1 and k.size(2) < products_from_keys:
        scores = torch.mul(q, k).sum(-1, keepdim=True).mul_(q.size(-1) ** -0.5)  # (B, h, T, 1)
        if mask is not None:
            scores = scores.add_(mask.transpose(-1, -2))
        return torch.mul(scores.softmax(-2), v).sum(-2, keepdim=True)  # (B, h, 1, d_h)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.size(-1) ** -0.5)  # (B, h, G, T)
    if mask is not None:
        scores = scores.add_(mask)
    return torch.matmul(scores.softmax(-1), v)  # (B, h, G, d_h)
