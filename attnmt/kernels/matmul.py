"""Which library runs the fp32 matmuls of our linear layers on CPU: the BLAS torch links (MKL)
or oneDNN. The result is the same up to float rounding (summation order); only speed differs.

Why: torch sends every fp32 CPU matmul to MKL, and MKL's sgemm runs AVX2 kernels on AMD CPUs
even where they have AVX-512; oneDNN, which torch also ships, chooses kernels by instruction set.
`auto` picks oneDNN on non-Intel x86 CPUs with AVX-512 and the BLAS elsewhere. A call into
oneDNN costs more than one into MKL, so products smaller than ONEDNN_MIN_WORK multiply-adds (a
decoding step's few-row products) stay with the BLAS. Rates per CPU: docs/benchmarks.md.

The backend is chosen for a block of work with `matmul_backend(name)` (training and each
translation call open one, in the thread that runs them) and restored after it; `linear` and
`mm` read it, and fall back to the plain ops off the CPU, outside fp32, under autocast and
under torch.compile.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.device import MATMUL_BACKENDS, cpuinfo_fields

# Below this many multiply-adds (M * K * N) a product stays with the BLAS: oneDNN's fixed cost
# per call outweighs its speed (docs/benchmarks.md).
ONEDNN_MIN_WORK = 1 << 20

# A product of this many rows or fewer (a decoding step of one sentence, beam search's first
# step) stays with the BLAS whatever its size: it reads each weight once, bound by memory, and
# MKL reads the column-major weight (column_major_weights) faster than oneDNN its packed copy
# (the 30-minute T, fp32, batches of 1, 1 thread: greedy +5 %, beam 5 +1 to +6 %;
# docs/benchmarks.md).
BLAS_MAX_ROWS = 2

# Inside matmul_backend(): "blas" or "onednn". A context variable, not a module global: each
# thread (and asyncio task) sees the backend of its own block, so two Translators with
# different backends in one process do not switch each other's.
_active: contextvars.ContextVar[str] = contextvars.ContextVar("attnmt_matmul", default="blas")


def prefers_onednn(cpuinfo: str) -> bool:
    """From the text of /proc/cpuinfo: a non-Intel x86 CPU with AVX-512, whose AVX-512 units
    MKL leaves unused."""
    fields = cpuinfo_fields(cpuinfo)
    vendor, flags = fields.get("vendor_id", ""), fields.get("flags", "").split()
    return vendor not in ("", "GenuineIntel") and "avx512f" in flags


@functools.cache
def onednn_is_faster() -> bool:
    """Whether `auto` picks oneDNN on this machine (prefers_onednn). Decided from the CPU's
    flags, not by timing, so that every run on one machine computes the same numbers."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return prefers_onednn(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return False


def resolve(name: str) -> str:
    """'auto' -> 'onednn' where onednn_is_faster(), else 'blas'; the others as they are."""
    if name not in MATMUL_BACKENDS:
        raise ValueError(
            f"matmul backend must be one of {', '.join(MATMUL_BACKENDS)}, not {name!r}"
        )
    if name == "auto":
        return "onednn" if onednn_is_faster() else "blas"
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        return "blas"
    return name


@contextlib.contextmanager
def matmul_backend(name: str) -> Iterator[str]:
    """Use `name` (auto | blas | onednn) inside the block, then the previous backend again;
    yields the one in use ('blas' or 'onednn')."""
    token = _active.set(resolve(name))
    try:
        yield _active.get()
    finally:
        _active.reset(token)


def active_backend() -> str:
    """The backend in use: 'blas' or 'onednn'."""
    return _active.get()


def use_onednn(x: torch.Tensor, work: int) -> bool:
    """Whether a product of `work` multiply-adds (M * K * N) on operand x goes to oneDNN."""
    # The backend's context variable is read last: torch.compile cannot trace its read (a
    # graph break per matmul), and on a GPU the device answers first.
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and work >= ONEDNN_MIN_WORK
        and _active.get() == "onednn"
    )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t (2-D) as it is if it is row- or column-major without gaps, else a contiguous copy.

    oneDNN takes either layout at full speed, but gives a matrix with a gap between rows (a
    slice of a wider weight, such as the GRU's context columns) to its reference kernel: one
    16 x 512 x 1536 product took 0.4 s instead of 1 ms.
    """
    rows, cols = t.shape
    if (t.stride(1) == 1 or cols == 1) and (t.stride(0) == cols or rows == 1):
        return t
    if (t.stride(0) == 1 or rows == 1) and (t.stride(1) == rows or cols == 1):
        return t
    return t.contiguous()


def _dnnl(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ wᵀ + b by oneDNN: x (M, K), w (N, K) -> (M, N); from `packed` (w in oneDNN's
    layout) where given."""
    w = _dense(w) if packed is None else packed
    return torch.ops.mkldnn._linear_pointwise(_dense(x), w, b, "none", [], "")


def _copied(t: torch.Tensor) -> int:
    """Elements oneDNN's linear copies to read t (2-D) as its input: none if t is row-major."""
    rows, cols = t.shape
    return (
        0 if (t.stride(1) == 1 or cols == 1) and (t.stride(0) == cols or rows == 1) else t.numel()
    )


def mm(a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ add) for 2-D a (M, K), b (K, N) and add (M, N), with the backend in use; a new
    tensor, or the transpose of one (no autograd: for use inside autograd functions and under
    no_grad).

    oneDNN's linear reads its input row-major and copies any other layout first. A weight
    gradient ∂yᵀ x has a transposed input, so where copying b is cheaper the product is
    computed as (bᵀ aᵀ)ᵀ: e.g. the output layer's (V, c) ∂zᵀ against its (c, d) hidden rows
    (a d × c copy instead of V × c), and the result comes back transposed.
    """
    if not use_onednn(a, a.size(0) * a.size(1) * b.size(1)):
        return a @ b if add is None else torch.addmm(add, a, b)
    if _copied(b.t()) < _copied(a):
        return mm(b.t(), a.t(), None if add is None else add.t()).t()  # (M, N), transposed
    if add is None:
        return _dnnl(a, b.t())
    # The addition rides in the kernel as a post-op, without a pass of its own.
    return torch.ops.mkldnn._linear_pointwise.binary(
        _dense(a), add.contiguous(), _dense(b.t()), None, "add"
    )


class _OneDNNLinear(torch.autograd.Function):
    """y = x Wᵀ + b for x (M, K) with all three products (forward, ∂x, ∂W) in oneDNN."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return _dnnl(x, weight, bias)  # (M, N)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        need_x, need_w, need_b = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_x = mm(grad_y, weight) if need_x else None  # (M, K) = ∂y W
        grad_w = mm(grad_y.t(), x) if need_w else None  # (N, K) = ∂yᵀ x
        grad_b = grad_y.sum(dim=0) if need_b and ctx.has_bias else None  # type: ignore[attr-defined]
        return grad_x, grad_w, grad_b


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., K), weight (N, K), with the backend in use;
    `packed`: the same weight in oneDNN's layout (PackedWeight), used where oneDNN
    computes the product without a gradient."""
    K, N = weight.shape[1], weight.shape[0]
    M = x.numel() // K if K else 0
    # Matrix-vector products (a Bahdanau energy layer) are bound by memory, not by the kernel.
    # use_onednn first: under torch.compile or an export it answers before reading M, which a
    # test of M would otherwise fix to the example's rows (a guard on a dynamic size).
    if (
        N < 16
        or not use_onednn(x, M * K * N)
        or M <= BLAS_MAX_ROWS
        or weight.dtype != torch.float32
    ):
        return F.linear(x, weight, bias)
    x2 = x.reshape(M, K)  # (M, K)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):  # fmt: skip
        y = cast(torch.Tensor, _OneDNNLinear.apply(x2, weight, bias))
    else:
        y = _dnnl(x2, weight, bias, packed)
    # 2-D rows stay a tensor of their own, not a view: relu_dropout_linear works in place on it.
    return y if x.dim() == 2 else y.view(*x.shape[:-1], N)  # (..., N)


def side_by_side(biases: list[torch.Tensor | None], sizes: list[int]) -> torch.Tensor | None:
    """The biases of products computed as one, their outputs (`sizes` of them each) side by
    side: one (sum sizes,) vector, zeros for a product without; None if none has one."""
    if all(b is None for b in biases):
        return None
    like = next(b for b in biases if b is not None)
    return torch.cat([like.new_zeros(n) if b is None else b
                      for b, n in zip(biases, sizes, strict=True)])  # fmt: skip


def column_major_weights(model: nn.Module) -> nn.Module:
    """The model, in place, with each linear layer's fp32 CPU weight (N, K) stored column-major
    (its transpose contiguous), for decoding. F.linear computes x Wᵀ; with Wᵀ contiguous MKL's
    sgemm reads it as it lies instead of packing a transposed operand at every call, which at
    a decoding step's few rows costs as much as the product: 8 x 256 x 8,000 (the output
    layer) 0.95 -> 0.45 ms, 36 rows 1.29 -> 1.01 ms, 1,280 rows the same (docs/benchmarks.md).
    A weight tied to an embedding gets a copy of its own: an embedding reads rows, which a
    column-major table scatters (1,280 tokens 0.15 -> 2 ms)."""
    for module in model.modules():
        w = module.weight if isinstance(module, nn.Linear) else None
        if w is not None and w.device.type == "cpu" and w.dtype == torch.float32:
            module.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
    return model


class PackedWeight:
    """A fp32 CPU weight (N, K) and its copy in oneDNN's own blocked layout (linear's
    `packed`), made again where the weight was changed in place or replaced since (a
    Translator's model edited by its user)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._pack(weight)

    def _pack(self, weight: torch.Tensor) -> None:
        self.source = (weight.data_ptr(), weight._version)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight` (N, K: the weight it was made from, or a view of it)."""
        if (weight.data_ptr(), weight._version) != self.source:
            self._pack(weight)
        return self.packed

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy, pickle) packs its weight again at its first use: oneDNN's
        layout has no storage to copy."""
        return {"source": None, "packed": None}


def onednn_packed_weights(model: nn.Module) -> nn.Module:
    """The model, in place, with each fp32 CPU Linear also holding its weight in oneDNN's
    layout (`packed`, made once), for decoding where `auto` sends the larger products to
    oneDNN (onednn_is_faster: AMD CPUs with AVX-512); elsewhere the model as it is. Without
    it oneDNN reorders the weight into that layout at every call: the output layer (36 x 256
    x 8,000) 1.78 -> 1.38 ms on 1 thread, 1.03 -> 0.69 ms on 2 (docs/benchmarks.md)."""
    if not onednn_is_faster():
        return model
    for module in model.modules():
        w = module.weight if isinstance(module, Linear) else None
        if w is not None and w.device.type == "cpu" and w.dtype == torch.float32 and len(w) >= 16:
            module.packed = PackedWeight(w)
    return model


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict keys) whose product uses the backend in use
    (and the weight in oneDNN's layout where onednn_packed_weights gave it one)."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = None if self.packed is None else self.packed.of(self.weight)
        return linear(x, self.weight, self.bias, packed)
