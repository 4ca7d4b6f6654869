"""The lean step's decoder layers (attnmt.models.lean_step) compiled by TorchScript: the same
operations in the same order, run by torch's graph interpreter instead of Python.

Why: at a decoding step's few rows a product takes tens of microseconds, and calling each op
from Python costs about as much again: an int8 product (`quantized::linear_dynamic`) pays 12 to
20 µs per call in Python's binding against about 1 µs inside a graph. A decoding step of the
30-minute T in int8 (1 thread, AMD Zen 4) takes 1.30 -> 0.77 ms at 1 row, 3.33 -> 2.74 ms at 32
and 5.30 -> 4.87 ms at 64; the SSRU student's (3 + 1 layers) 1.06-1.15x; fp32, whose
products are most of its step, gained nothing measurable and keeps the Python form
(docs/benchmarks.md).

What stays in Python: the embedding, each cohort's mask, the room each cache writes its next
position into (decoding_state.room_for_next: a copy where beam search reorders rows), the
output layer (which a shortlist may replace) and search. The graph covers the layers only
where every layer has self-attention with stacked q, k, v or an SSRU, and int8 products (no
rotary positions), on the CPU without a gradient; the lean step's Python form runs the rest.
The weights are read when the graph is made (once per process and model): as with the lean
step's stacked q, k, v, a weight changed in place later is not seen.

The graph runs with torch's optimizing passes off (torch.jit.optimized_execution(False)):
they would specialise it to each step's shapes, which change every step. torch 2.13 marks
TorchScript deprecated; this project pins torch 2.13, where it is supported.
"""

# No `from __future__ import annotations`: TorchScript reads a NamedTuple's fields (LayerCaches)
# from its annotations, which that import would leave as strings it cannot resolve.
import warnings
from dataclasses import dataclass
from typing import List, NamedTuple, Optional  # noqa: UP035 (TorchScript reads typing's names)

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.kernels import int8
from attnmt.kernels.attention import step_attention
from attnmt.kernels.int8 import Int8Linear

Tensor = torch.Tensor


@dataclass
class LayerSpec:
    """One decoder layer as the graph takes it (lean_step.LeanLayer, where its products are
    int8): its layer norms before or after self-attention (or the SSRU), cross-attention and
    the feed-forward, and its products: q, k and v stacked and self-attention's output (or
    the SSRU's W and W_f stacked: `ssru`), cross-attention's q and output, the feed-forward's
    first and second."""

    norms: list[nn.LayerNorm]
    products: list[Int8Linear]
    heads: int
    ssru: bool = False


class LayerCaches(NamedTuple):
    """What a layer's self-attention or SSRU reads and writes of its caches at a step
    (lean_step._GraphLayer makes it). Self-attention: each cohort's Room, its keys' and values'
    buffers (C, h, capacity, d_h) one cohort after another, the position this step's k and v
    go to (`ats`) and the first it holds (`starts`). An SSRU: c_{t−1} of all rows (N, d) and the
    buffer (N, d) that takes c_t."""

    buffers: List[Tensor]  # noqa: UP006
    ats: List[int]  # noqa: UP006
    starts: List[int]  # noqa: UP006


class _Int8(nn.Module):
    """An int8 product (Int8Linear: fbgemm's packing, and oneDNN's for calls with many rows)."""

    def __init__(self, layer: Int8Linear) -> None:
        super().__init__()
        self.packed = layer.packed
        self.wide = layer.packed if layer.wide is None else layer.wide
        self.wide_outputs = layer.wide_outputs if layer.wide is not None else -1
        self.out_features = layer.out_features
        self.reduce_range = layer.reduce_range

    def forward(self, x: Tensor) -> Tensor:
        """x (N, K) -> (N, N_out)."""
        packed = self.packed
        rows = x.size(0)
        if (
            self.wide_outputs >= 0
            and rows >= int8.WIDE_ROWS
            and rows * self.out_features >= self.wide_outputs
        ):
            packed = self.wide
        return torch.ops.quantized.linear_dynamic(x, packed, self.reduce_range)


class _SelfAttention(nn.Module):
    """Self-attention over each cohort's cache (lean_step._self_attention), the residual added."""

    def __init__(self, qkv: Int8Linear, out: Int8Linear, heads: int) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = _Int8(qkv), _Int8(out), heads

    def forward(
        self,
        h: Tensor,
        x: Tensor,
        bounds: List[int],  # noqa: UP006
        caches: LayerCaches,
        self_masks: List[Optional[Tensor]],  # noqa: UP006, UP045
    ) -> Tensor:
        """x + SelfAttention(h): h, x (N, d) -> (N, d); cohort c's rows bounds[c]:bounds[c+1]
        over its cache (LayerCaches)."""
        N, d = x.size(0), x.size(1)
        h_ = self.heads
        d_h = d // h_
        qkv = self.qkv(h).view(N, 3, h_, 1, d_h)  # (N, 3, h, 1, d_h)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (N, h, 1, d_h) each
        outs: List[Tensor] = []  # noqa: UP006
        buffers = caches.buffers
        for c in range(len(caches.ats)):
            a, b, at, start = bounds[c], bounds[c + 1], caches.ats[c], caches.starts[c]
            keys, values = buffers[2 * c][: b - a], buffers[2 * c + 1][: b - a]  # (n, h, cap, d_h)
            keys[:, :, at : at + 1].copy_(k[a:b])
            values[:, :, at : at + 1].copy_(v[a:b])
            keys, values = keys[:, :, start : at + 1], values[:, :, start : at + 1]
            outs.append(step_attention(q[a:b], keys, values, self_masks[c]))  # (n, h, 1, d_h)
        a = _joined(outs).to(x.dtype)  # (N, h, 1, d_h)
        return self.out(a.view(N, d)).add_(x)


class _Ssru(nn.Module):
    """The SSRU's step (attnmt.models.ssru), the residual added: f = σ(W_f h + b_f),
    c_t = f ⊙ c_{t−1} + (1 − f) ⊙ W h, x + ReLU(c_t)."""

    def __init__(self, w: Int8Linear) -> None:
        super().__init__()
        self.w = _Int8(w)  # W and W_f side by side

    def forward(
        self,
        h: Tensor,
        x: Tensor,
        bounds: List[int],  # noqa: UP006
        caches: LayerCaches,
        self_masks: List[Optional[Tensor]],  # noqa: UP006, UP045
    ) -> Tensor:
        """h, x (N, d) -> (N, d); c_t written into the buffer LayerCaches gives."""
        wx, gate = self.w(h).chunk(2, dim=1)  # (N, d) each: W h, W_f h + b_f
        f = torch.sigmoid(gate)
        c = f * caches.buffers[0] + (1 - f) * wx  # c_t
        caches.buffers[1].copy_(c)
        return torch.relu(c).add_(x)


class _Layer(nn.Module):
    """One decoder layer (lean_step.LeanStep._layer): self-attention or an SSRU, then
    cross-attention and the feed-forward."""

    def __init__(self, spec: LayerSpec, pre_norm: bool, activation: str) -> None:
        super().__init__()
        p = spec.products
        if spec.ssru:
            self.mix: nn.Module = _Ssru(p[0])
        else:
            self.mix = _SelfAttention(p[0], p[1], spec.heads)
        cross_q, cross_out, ff_in, ff_out = (_Int8(m) for m in p[-4:])
        self.cross_q, self.cross_out, self.ff_in, self.ff_out = cross_q, cross_out, ff_in, ff_out
        self.norm_w = [n.weight.detach() for n in spec.norms]
        self.norm_b = [n.bias.detach() for n in spec.norms]
        self.eps = [float(n.eps) for n in spec.norms]
        self.pre_norm, self.activation, self.heads = pre_norm, activation, spec.heads

    def _norm(self, i: int, x: Tensor) -> Tensor:
        return F.layer_norm(x, [x.size(1)], self.norm_w[i], self.norm_b[i], self.eps[i])

    def _in(self, i: int, x: Tensor) -> Tensor:
        return self._norm(i, x) if self.pre_norm else x

    def _out(self, i: int, y: Tensor) -> Tensor:
        return y if self.pre_norm else self._norm(i, y)

    def _act(self, f: Tensor) -> Tensor:
        if self.activation == "gelu":
            return F.gelu(f)
        if self.activation == "swish":
            return F.silu(f)
        return torch.relu_(f)

    def forward(
        self,
        x: Tensor,
        bounds: List[int],  # noqa: UP006
        caches: LayerCaches,
        self_masks: List[Optional[Tensor]],  # noqa: UP006, UP045
        memory: List[Tensor],  # noqa: UP006
        src_masks: List[Tensor],  # noqa: UP006
    ) -> Tensor:
        """x (N, d) -> (N, d). Cohort c: rows bounds[c]:bounds[c+1]; its memory's keys and
        values memory[2c], memory[2c+1] (B, h, S, d_h)."""
        h = self._in(0, x)
        x = self._out(0, self.mix(h, x, bounds, caches, self_masks))
        h = self._in(1, x)
        a = self._cross(self.cross_q(h), bounds, memory, src_masks).to(x.dtype)  # (N, d)
        x = self._out(1, self.cross_out(a).add_(x))
        h = self._in(2, x)
        f = self._act(self.ff_in(h))  # (N, ff)
        return self._out(2, self.ff_out(f).add_(x))

    def _cross(
        self,
        q: Tensor,
        bounds: List[int],  # noqa: UP006
        memory: List[Tensor],  # noqa: UP006
        src_masks: List[Tensor],  # noqa: UP006
    ) -> Tensor:
        """Each cohort's rows of q (N, d) over its memory -> (N, d); a memory row is read by
        n // B rows (a sentence's beams) as G queries."""
        d = q.size(1)
        outs: List[Tensor] = []  # noqa: UP006
        for c in range(len(src_masks)):
            mine = q[bounds[c] : bounds[c + 1]]  # (n, d)
            k = memory[2 * c]
            n, B = mine.size(0), k.size(0)
            mine = mine.view(B, n // B, self.heads, d // self.heads).transpose(1, 2)
            a = step_attention(mine, k, memory[2 * c + 1], src_masks[c])  # (B, h, G, d_h)
            outs.append(a.transpose(1, 2).reshape(n, d))  # (n, d)
        return _joined(outs)


def _joined(parts: List[Tensor]) -> Tensor:  # noqa: UP006
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class ScriptedLayers(nn.Module):
    """The decoder's layers as one graph: x (N, d) -> (N, d), each layer's arguments as
    _Layer.forward takes them."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(
        self,
        x: Tensor,
        bounds: List[int],  # noqa: UP006
        caches: List[LayerCaches],  # noqa: UP006
        self_masks: List[Optional[Tensor]],  # noqa: UP006, UP045
        memory: List[List[Tensor]],  # noqa: UP006
        src_masks: List[Tensor],  # noqa: UP006
    ) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, bounds, caches[i], self_masks, memory[i], src_masks)
        return x


def script(
    layers: list[LayerSpec], pre_norm: bool, activation: str
) -> torch.jit.ScriptModule | None:
    """The layers as a graph, or None where TorchScript cannot make one (it compiles from the
    source files: OSError where they are not installed)."""
    modules: list[nn.Module] = [_Layer(spec, pre_norm, activation) for spec in layers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*TorchScript.*")
        try:
            return torch.jit.script(ScriptedLayers(modules))
        except (RuntimeError, OSError, torch.jit.frontend.FrontendError):
            return None
