"""Scaled dot-product attention in torch's fused kernel (flash / memory-efficient / C++), where
it is the faster way to compute attnmt.models.attention's equations.

Why not always: the fused kernel returns no weights, and on CPU it draws its dropout mask with
the slow `bernoulli_`, where the plain equations with kernels.ops.dropout are faster.

On a GPU, cuDNN's attention is left out of torch's choice: it builds an execution plan for
every new shape (13 ms of host time a call on an H100, measured), and training batches come in
hundreds of shapes; flash and memory-efficient attention have no such cost.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    """softmax(q kᵀ / sqrt(d) + mask (+ causal mask)) v by F.scaled_dot_product_attention, or
    None where the plain equations are faster (dropout on CPU).

    Args:
        q: (B, h, T_q, d); k: (B, h, T_k, d); v: (B, h, T_k, d_v).
        mask: additive float mask broadcastable to (B, h, T_q, T_k), or None.
        causal: position t attends to keys <= t only.
    Returns:
        (B, h, T_q, d_v), or None.
    """
    if dropout_p > 0.0 and q.device.type == "cpu":
        return None
    if causal and mask is not None:
        # The kernel's is_causal flag cannot be combined with a mask: add the causal one.
        T_q, T_k = q.size(-2), k.size(-2)
        future = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).triu(1)  # (T_q, T_k)
        causal_mask = torch.zeros(T_q, T_k, dtype=mask.dtype, device=q.device)
        mask = mask + causal_mask.masked_fill(future, float("-inf"))  # (B, h|1, T_q, T_k)
        causal = False
    backends = sdpa_kernel(GPU_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
        )  # (B, h, T_q, d_v)
