"""Training-speed building blocks that compute the same thing as the plain PyTorch ops, faster
on CPU: dropout with a cheaper mask, the feed-forward block's ReLU and dropout fused into its
second matmul, and the output projection fused with label-smoothed cross-entropy. On other
devices they fall back to the plain ops (which are fast there).

Why: `bernoulli_`, the mask behind `F.dropout`, is slow on CPU, and the output projection +
log-softmax + its backward write and re-read a (tokens × vocabulary) float tensor five times.
Their gains on whole training steps: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnmt.kernels import matmul


def _use_plain_ops(x: torch.Tensor) -> bool:
    """Off the CPU the plain ops are fast; under torch.compile the compiler fuses them itself
    (and our NumPy draws would break its graph)."""
    return x.device.type != "cpu" or torch.compiler.is_compiling()


# --- dropout ---


_PART_LANES = 1 << 18  # lanes per independently seeded part of a mask


def _keep_part(out: np.ndarray, seed: int, part: int, threshold: int) -> None:
    """Fill `out` (float32) with part `part` of a keep mask: 1 where a lane >= threshold."""
    words = np.random.PCG64DXSM([seed, part]).random_raw((out.size + 3) // 4)  # (W,) uint64
    lanes = words.view(np.int16)[: out.size]  # uniform in [-2^15, 2^15)
    np.greater_equal(lanes, threshold, out=out)


# The threads that draw a mask's parts inside mask_threads(); None: the calling thread alone.
_mask_pool: contextvars.ContextVar[ThreadPoolExecutor | None] = contextvars.ContextVar(
    "attnmt_mask_pool", default=None
)


@contextlib.contextmanager
def mask_threads(threads: int) -> Iterator[None]:
    """Draw dropout masks' parts on `threads` threads inside the block (NumPy releases the
    GIL); the pool lives as long as the block. Training opens one for the run with torch's
    intra-op thread count. The masks do not depend on it."""
    if threads <= 1:
        yield
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="attnmt-mask") as pool:
        token = _mask_pool.set(pool)
        try:
            yield
        finally:
            _mask_pool.reset(token)


def keep_mask(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """CPU float tensor of `shape`: 0 (drop) with probability p, else 1. Float, not bool:
    multiplying by a bool tensor converts it to float on every use, a copy each time.

    `bernoulli_` draws one random number per element from torch's Mersenne Twister, slowly, and
    torch's own compare and bool-to-float kernels run at about 1 GB/s here. Instead, one draw
    from torch's global generator (seeded by train.seed, saved in checkpoints) seeds NumPy's
    PCG64DXSM for each part of 2^18 elements ([seed, part]: independent streams); each 64-bit
    word gives four uniform 16-bit lanes, one per element, and NumPy's compare writes the float
    mask directly. Parts run on the threads of mask_threads() where one is open; the mask
    depends only on the seed and the shape, not on the thread count. p is rounded to a
    multiple of 2^-16: 0.1 becomes 0.100006.
    """
    numel = math.prod(shape)
    seed = int(torch.randint(0, 2**62, (1,)))
    out = np.empty(numel, np.float32)
    threshold = round(p * 65536) - 32768
    parts = [
        (out[start : start + _PART_LANES], seed, k, threshold)
        for k, start in enumerate(range(0, numel, _PART_LANES))
    ]
    pool = _mask_pool.get()
    if pool is None or len(parts) == 1:
        for part in parts:
            _keep_part(*part)
    else:
        list(pool.map(lambda args: _keep_part(*args), parts))
    return torch.from_numpy(out).view(shape)


def dropout_scale(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """CPU float tensor of `shape`: 0 with probability p, else 1 / (1 - p) (see keep_mask).
    Multiplying by it is inverted dropout."""
    return keep_mask(shape, p).mul_(1.0 / (1.0 - p))


def dropout(x: torch.Tensor, p: float, training: bool, inplace: bool = False) -> torch.Tensor:
    """Inverted dropout: zero each element with probability p, scale the rest by 1 / (1 - p).

    inplace=True overwrites x, saving a copy; only for tensors that autograd does not keep for
    a backward pass (a linear layer's output, not a softmax's or tanh's).
    """
    if not training or p == 0.0:
        return x
    if _use_plain_ops(x):
        return F.dropout(x, p, True, inplace)
    scale = dropout_scale(tuple(x.shape), p).to(x.dtype)
    # A multiply by a saved float mask: one pass forward and one backward (masked_fill and a
    # scale were two passes each way). Never in place on a view: autograd would then copy the
    # whole base tensor in backward (CopySlices), costing more than it saves.
    return x.mul_(scale) if inplace and x._base is None else x * scale


def dropout_add(x: torch.Tensor, y: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """x + dropout(y), the residual connection: on CPU one fused pass (addcmul)."""
    if not training or p == 0.0:
        return x + y
    if _use_plain_ops(x):
        return x + F.dropout(y, p, True)
    # The scale rides along as addcmul's `value`.
    return torch.addcmul(x, y, keep_mask(tuple(y.shape), p), value=1.0 / (1.0 - p))


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * (a @ b) in the matmul itself (addmm's alpha; beta=0 ignores the zero input);
    with oneDNN (attnmt.matmul), the smallest of a, b and the result scaled."""
    M, N = a.size(0), b.size(1)
    if matmul.use_onednn(a, M * a.size(1) * N):
        smallest = min(a.numel(), b.numel(), M * N)
        if smallest == M * N:  # a weight gradient: (d_out, d_in) against (tokens, ·) operands
            return matmul.mm(a, b).mul_(scale)
        return matmul.mm(a * scale, b) if smallest == a.numel() else matmul.mm(a, b * scale)
    zeros = a.new_zeros(()).expand(M, N)
    return torch.addmm(zeros, a, b, beta=0, alpha=scale)


class _ReluDropoutLinear(torch.autograd.Function):
    """y = (relu(h) ⊙ keep) Wᵀ / (1 - p) + b for h (N, d_in), keep a float 0/1 mask.

    Forward overwrites h with a = relu(h) ⊙ keep (unscaled) and keeps only a: a > 0 exactly
    where both ReLU and dropout pass the gradient, so backward needs one pass over the wide
    (N, d_in) activation besides the matmuls (threshold_backward), and the 1 / (1 - p) scale
    rides in the matmuls' alpha both ways.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        a = h.mul_(keep).relu_()  # (N, d_in), in place of h
        ctx.save_for_backward(a, weight)
        ctx.scale = scale  # type: ignore[attr-defined]
        if bias is None:
            return _scaled_mm(a, weight.t(), scale)  # (N, d_out)
        if matmul.use_onednn(a, a.numel() * weight.size(0)):
            return matmul.linear(a, weight * scale, bias)  # (N, d_out)
        return torch.addmm(bias, a, weight.t(), alpha=scale)  # (N, d_out)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        a, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = ctx.scale  # type: ignore[attr-defined]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        grad_h = grad_w = grad_b = None
        if need_h:
            grad_a = _scaled_mm(grad_y, weight, scale)  # (N, d_in)
            # In place on the fresh grad_a: a new (N, d_in) output would cost its page faults.
            grad_h = torch.ops.aten.threshold_backward.grad_input(grad_a, a, 0.0, grad_input=grad_a)
        if need_w:
            grad_w = _scaled_mm(grad_y.t(), a, scale)  # (d_out, d_in)
        if need_b:
            grad_b = grad_y.sum(dim=0)  # (d_out,)
        return grad_h, grad_w, grad_b, None, None


def relu_dropout_linear(
    h: torch.Tensor, linear: nn.Linear, p: float, training: bool
) -> torch.Tensor:
    """linear(dropout(relu(h))) for h (N, d_in), the inner half of a feed-forward block.

    On CPU in fp32: dropout before ReLU equals dropout after it, so both work in place on h
    (which must be a fresh tensor that autograd does not keep, e.g. another linear layer's
    output) and the 1 / (1 - p) scale moves into the matmuls' alpha (_ReluDropoutLinear): one
    pass over the widest activation for dropout and ReLU each way instead of five.
    """
    plain = (
        not training
        or p == 0.0
        or type(linear) not in (nn.Linear, matmul.Linear)  # one that computes more than W x + b
        or _use_plain_ops(h)
        or h._base is not None
        or h.dtype != torch.float32
        or torch.is_autocast_enabled("cpu")
    )
    if plain:
        # Without a gradient to take (decoding), ReLU overwrites h, W_1's output: one pass
        # over the widest activation instead of a pass and a new tensor.
        mine = h._base is None and not (torch.is_grad_enabled() and h.requires_grad)
        return linear(dropout(torch.relu_(h) if mine else torch.relu(h), p, training))
    keep = keep_mask(tuple(h.shape), p)  # (N, d_in)
    out = _ReluDropoutLinear.apply(h, linear.weight, linear.bias, keep, 1.0 / (1.0 - p))
    return cast(torch.Tensor, out)


def feed_forward(
    x: torch.Tensor, w_1: nn.Linear, w_2: nn.Linear, p: float, training: bool
) -> torch.Tensor:
    """FFN(x) = W_2 dropout(ReLU(W_1 x)) for x (..., d) -> (..., d), with relu_dropout_linear."""
    shape = x.shape
    # On 2-D rows, so that W_1's output is a tensor of its own, not a view, and
    # relu_dropout_linear may work on it in place.
    h = w_1(x.reshape(-1, shape[-1]))  # (N, ff)
    return relu_dropout_linear(h, w_2, p, training).view(shape)  # (..., d)


class Dropout(nn.Module):
    """nn.Dropout with the cheaper CPU mask of `dropout`."""

    def __init__(self, p: float, inplace: bool = False) -> None:
        super().__init__()
        self.p = p
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.inplace)

    def scale(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """The multiplier this layer would apply to a tensor of `shape` (like `like`'s device
        and dtype): 0 or 1 / (1 - p) per element; None when it is off. For code that must apply
        one mask in two places."""
        if not self.training or self.p == 0.0:
            return None
        if _use_plain_ops(like):
            ones = torch.ones(shape, device=like.device, dtype=like.dtype)
            return F.dropout(ones, self.p, True)
        return dropout_scale(shape, self.p).to(like.device, like.dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


# --- output projection + label-smoothed cross-entropy ---


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of logits = hidden @ weightᵀ, computed in row chunks.

    Forward computes each chunk's logits, its loss and (when a gradient is needed) the
    gradients of hidden and weight at once, so the full (N, V) logits never exist; backward
    only scales the stored gradients by the incoming one. Per row with target t and
    smoothing ε over V classes (the same definition as F.cross_entropy), with
    log p = log_softmax(z):
        loss = -(1 - ε) log p_t - ε/V Σ_v log p_v,   Σ_v log p_v = Σ_v z_v - V lse(z)
        ∂loss/∂z = p - (1 - ε) onehot(t) - ε/V
    Only two passes touch a (chunk, V) tensor besides the matmuls (the fused log_softmax
    kernel and exp): Σ_v z_v is h · Σ_v W_v, and the constant -ε/V of the gradient enters
    ∂h and ∂W as rank-one terms (-ε/V Σ_v W_v per row; -ε/V Σ_rows h per row of W).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        smoothing: float,
        chunk: int,
        matmul_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        N, V, d = hidden.size(0), weight.size(0), hidden.size(1)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums in fp32+
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        d_hidden = (
            torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_grad else None
        )
        # oneDNN's products start the sum themselves (and leave it transposed: matmul.mm).
        onednn = dtype == (matmul_dtype or dtype) and matmul.use_onednn(hidden, N * V * d)
        d_weight = (
            torch.zeros(weight.shape, dtype=dtype, device=hidden.device)
            if need_grad and not onednn
            else None
        )
        # Matmul operands (autocast's lower precision when it is on); the rest in fp32+.
        mm_dtype = matmul_dtype or dtype
        h_mm, w_mm = hidden.to(mm_dtype), weight.to(mm_dtype)  # (N, d), (V, d)
        w_sum = weight.to(dtype).sum(dim=0)  # (d,) Σ_v W_v
        # One (chunk, V) buffer serves every chunk's logits, log-probabilities and softmax, in
        # place: a fresh tensor per chunk and pass was slower (its pages were new each time).
        buffer = hidden.new_empty((min(chunk, N), V), dtype=dtype)  # (chunk, V)
        # bf16/fp16 matmuls: their (chunk, V) logits and then the softmax gradient in one buffer
        # of the matmul dtype, and the (V, d) product for ∂W in another (new pages cost more
        # than the products' casts).
        low = mm_dtype != dtype
        mm_buffer = hidden.new_empty(buffer.shape, dtype=mm_dtype) if low else None
        dw_buffer = weight.new_empty(weight.shape, dtype=mm_dtype) if low and need_grad else None
        for start in range(0, N, chunk):
            h = h_mm[start : start + chunk]  # (c, d)
            t = target[start : start + chunk, None]  # (c, 1)
            z = buffer[: h.size(0)]  # (c, V)
            _logits_into(z, h, w_mm, onednn, mm_buffer)
            z_t = z.gather(1, t)  # (c, 1)
            # In place: the kernel reduces a row (max, log-sum-exp) before it writes it, and
            # writes each element from its own input (checked on CPU; not yet run on CUDA).
            logp = torch.log_softmax(z, dim=1, out=z)  # (c, V)
            logp_t = logp.gather(1, t)  # (c, 1)
            rows = -(1.0 - smoothing) * logp_t  # (c, 1)
            if smoothing > 0.0:
                lse = z_t - logp_t  # (c, 1)
                sum_logp = hidden[start : start + chunk].to(dtype) @ w_sum - V * lse.squeeze(1)
                rows = rows.squeeze(1) - (smoothing / V) * sum_logp  # (c,)
            total += rows.sum()
            if need_grad:
                assert d_hidden is not None
                g = logp.exp_()  # (c, V) softmax, in place of log p
                g.scatter_add_(1, t, g.new_full(t.shape, -(1.0 - smoothing)))
                d_rows = d_hidden[start : start + chunk]  # (c, d)
                d_weight = _grads_into(d_rows, d_weight, g, h, w_mm, onednn, mm_buffer, dw_buffer)
        if need_grad and smoothing > 0.0:
            assert d_hidden is not None and d_weight is not None
            d_hidden.sub_(w_sum, alpha=smoothing / V)  # every row: -ε/V Σ_v W_v
            d_weight.sub_(hidden.to(dtype).sum(dim=0), alpha=smoothing / V)  # -ε/V Σ_rows h
        if need_grad:
            assert d_hidden is not None and d_weight is not None
            d_hidden, d_weight = d_hidden.to(hidden.dtype), d_weight.to(weight.dtype)
        ctx.save_for_backward(d_hidden, d_weight)
        return total

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        d_hidden, d_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        return d_hidden * grad_out, d_weight * grad_out, None, None, None, None


def _logits_into(
    z: torch.Tensor, h: torch.Tensor, w: torch.Tensor, onednn: bool, low: torch.Tensor | None
) -> None:
    """z (c, V) ← h (c, d) @ wᵀ: by oneDNN or the BLAS in fp32, or in the matmul dtype of h and
    w through `low` (a (chunk, V) buffer of that dtype), then cast into z."""
    if low is not None:
        z.copy_(torch.mm(h, w.t(), out=low[: h.size(0)]))
    elif onednn:
        z.copy_(matmul.mm(h, w.t()))
    else:
        torch.mm(h, w.t(), out=z)


def _grads_into(
    d_rows: torch.Tensor,
    d_weight: torch.Tensor | None,
    g: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    onednn: bool,
    low: torch.Tensor | None,
    dw_low: torch.Tensor | None,
) -> torch.Tensor:
    """A chunk's gradients from g = ∂loss/∂z (c, V): d_rows (c, d) ← g w, and d_weight (V, d)
    += gᵀ h, which is returned (oneDNN starts the sum from None and keeps it transposed,
    matmul.mm; in the matmul dtype g goes through `low` and gᵀ h through `dw_low`)."""
    if onednn:
        d_rows.copy_(matmul.mm(g, w))
        return matmul.mm(g.t(), h, add=d_weight)
    assert d_weight is not None
    if low is None:
        torch.mm(g, w, out=d_rows)
        return d_weight.addmm_(g.t(), h)
    assert dw_low is not None
    g_low = low[: h.size(0)].copy_(g)  # (c, V), over the logits
    d_rows.copy_(g_low @ w)
    return d_weight.add_(torch.mm(g_low.t(), h, out=dw_low))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float = 0.0,
    chunk: int = 1024,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy of F.linear(hidden, weight, bias) against target.

    Same value and gradients as F.cross_entropy(F.linear(hidden, weight), target,
    ignore_index=..., label_smoothing=..., reduction="sum"). On CPU without building the
    logits of positions whose target is ignore_index, nor ever holding all logits; elsewhere
    (a GPU, torch.compile) the plain functions, which the host need not wait for.

    Args:
        hidden: (..., d); weight: (V, d); target: (...) class ids.
    Returns:
        (summed loss, number of positions that count), 0-dim tensors.
    """
    d = hidden.size(-1)
    keep = target.reshape(-1) != ignore_index  # (N,)
    if bias is not None and not _use_plain_ops(hidden):  # the fused form has no bias: plain
        logits = F.linear(hidden.reshape(-1, d)[keep], weight, bias).float()  # (n, V)
        loss = F.cross_entropy(
            logits, target.reshape(-1)[keep], label_smoothing=label_smoothing, reduction="sum"
        )
        return loss, keep.sum()
    if _use_plain_ops(hidden):
        # Every position through the projection, padding ignored by the loss: picking the real
        # positions first would make the host wait for the device to count them.
        logits = F.linear(hidden.reshape(-1, d), weight, bias).float()  # (N, V)
        loss = F.cross_entropy(
            logits, target.reshape(-1), ignore_index=ignore_index,
            label_smoothing=label_smoothing, reduction="sum",
        )  # fmt: skip
        return loss, keep.sum()
    h = hidden.reshape(-1, d)[keep]  # (n, d): padding never reaches the projection
    t = target.reshape(-1)[keep]  # (n,)
    # Under CPU autocast the matmuls take its dtype, as F.linear would; the function's own
    # casts are explicit, so autocast is off inside it.
    mm_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    with torch.autocast("cpu", enabled=False):
        loss = _LinearCrossEntropy.apply(h, weight, t, label_smoothing, chunk, mm_dtype)
    return loss, keep.sum()
