"""Sums whose order does not depend on the number of threads: a training step computes the same
bits on 1 thread as on 2, so a run may change its thread count with the machine's load and a
resume stays byte-identical (docs/reliability.md, *Threads*).

Why: torch splits a reduction to one number (`x.sum()`, `vector_norm(x)`) among its threads
and adds their partial sums, so the result's rounding follows the thread count; LayerNorm's
CPU backward does the same for its weight and bias gradients (a buffer a thread). A reduction
over the rows of a matrix into one value a column (`x.sum(0)`) is split by columns instead,
each column summed in the same order whatever the threads (tests/kernels/test_fixed_order.py
checks both on 1 to 4 threads). So every reduction here is a sum over rows into columns,
then a sum of fewer than torch's grain (32,768 elements), which one thread does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

# The width of the columns a long vector is folded into before its rows are summed.
COLUMNS = 1024


def fixed_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖₂ over all elements (0-dim, fp32 or wider), in an order that depends only on x's size."""
    parts = _fold(x.reshape(-1), lambda rows: torch.linalg.vector_norm(rows, dim=0))
    return torch.linalg.vector_norm(parts.to(torch.promote_types(parts.dtype, torch.float32)))


def _fold(flat: torch.Tensor, over_rows) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """`over_rows` of flat's whole rows of COLUMNS (a (COLUMNS,) result), then the tail's
    elements themselves: fewer than 2 * COLUMNS values in all, reduced serially by the caller."""
    whole = flat.numel() - flat.numel() % COLUMNS
    tail = flat[whole:]
    if whole == 0:
        return tail
    return torch.cat([over_rows(flat[:whole].view(-1, COLUMNS)), tail])  # (COLUMNS + tail,)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (the 2-norm of all gradients together, each scaled by
    max_norm / norm where that is below 1), with the norm summed in a fixed order: returns it."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or grads[0].device.type != "cpu":  # a GPU's sums do not follow threads
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    total = fixed_norm(torch.stack([fixed_norm(g) for g in grads]))
    if max_norm < float("inf"):
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch: 1e-6 against 0
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total


class _Softmax(torch.autograd.Function):
    """softmax over the last dimension, with softmax's backward written out (torch's CPU kernel
    for it sums a row in an order that follows the threads):
        ∂s = w ⊙ (∂w - Σ_k ∂w ⊙ w),   w = softmax(s)"""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        weights = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dw: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (w,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return softmax_backward(dw, w)


def softmax_backward(dw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """∂s from ∂w and w = softmax(s) over the last dimension (a new tensor): each row's sum
    in one order whatever the threads (a sum over the last dimension is split by rows)."""
    return (dw - (dw * w).sum(-1, keepdim=True)).mul_(w)


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """torch.softmax(scores, dim=-1), with a CPU backward that does not depend on the threads."""
    if scores.device.type != "cpu" or torch.compiler.is_compiling() or not scores.requires_grad:
        return torch.softmax(scores, dim=-1)
    return _Softmax.apply(scores)  # type: ignore[no-any-return]


class _LayerNorm(torch.autograd.Function):
    """LayerNorm over the last dimension: torch's kernels for the output and ∂x (row by row),
    the weight's and bias's gradients as sums over rows into columns:
        ∂γ = Σ_rows ∂y ⊙ x̂,   ∂β = Σ_rows ∂y,   x̂ = (x - μ) · rstd"""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        y, mean, rstd = torch.native_layer_norm(x, [x.size(-1)], weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
        d = x.size(-1)
        dx = None
        if ctx.needs_input_grad[0]:  # type: ignore[attr-defined]
            dx = torch.ops.aten.native_layer_norm_backward(
                dy, x, [d], mean, rstd, weight, None, [True, False, False]
            )[0]
        x_hat = (x - mean).mul_(rstd)  # (..., d)
        dw = x_hat.mul_(dy).reshape(-1, d).sum(0)  # (d,)
        db = dy.reshape(-1, d).sum(0)  # (d,)
        return dx, dw, db, None


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """norm(x), with gradients summed in a fixed order where the CPU computes them; elsewhere
    (a GPU, torch.compile, no gradient) torch's own."""
    if (
        x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or norm.weight is None
        or norm.bias is None
        or len(norm.normalized_shape) != 1
    ):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    if torch.is_autocast_enabled("cpu"):  # autocast runs LayerNorm in fp32
        x = x.float()
    with torch.autocast("cpu", enabled=False):
        return _LayerNorm.apply(x, norm.weight, norm.bias, norm.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the same parameters and state dict) whose CPU gradients do not depend on
    the thread count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self)
