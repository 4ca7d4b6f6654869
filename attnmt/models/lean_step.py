"""The Transformer's decoding step with fewer operations: the same function as
TransformerSeq2Seq.decode_step (tests/models/test_lean_step.py compares them), computed on 2-D
rows (N, d) with the self-attention's q, k and v from one product (an SSRU's W and W_f
likewise), the bias added by the product (addmm) and the residual in place, the model's modules
called only for the embedding and the output layer. A step of the 30-minute T at 36 rows, 1
thread: 5.5 -> 4.3 ms (docs/benchmarks.md).

Why: at a decoding step's few rows the products are small, and the module path's per-call
costs (module calls, the matmul backend's checks, views to and from (N, 1, d), a residual add
and a bias copy per sublayer, dropout calls that do nothing) add up to a fifth of the step.

`attach(model)` gives each Transformer in the model a lean step (decoding only: for_decoding);
decode_step uses it unless attention weights are asked for. Layers with rotary positions keep
their own form; int8 products (Int8Linear) are called as modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.kernels import matmul
from attnmt.kernels.attention import step_attention
from attnmt.kernels.int8 import Int8Linear
from attnmt.models.decoding_state import (
    LayerCache,
    RecurrentCache,
    Room,
    TransformerMemory,
    TransformerState,
    append_position,
    per_row,
    room_for_next,
)
from attnmt.models.transformer import ACTIVATIONS, DecoderLayer, TransformerSeq2Seq

Tensor = torch.Tensor


@dataclass
class Product:
    """x Wᵀ + b (+ a residual): fp32 by addmm on Wᵀ (contiguous where column_major_weights
    stored W so), anything else (int8) by its module."""

    weight_t: Tensor | None  # (K, N), or None: `module` computes it
    bias: Tensor | None  # (N,)
    module: nn.Module
    packed: matmul.PackedWeight | None = None  # W in oneDNN's layout (onednn_packed_weights)

    @classmethod
    def of(cls, module: nn.Module) -> Product:
        w = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(w, Tensor) and w.dtype == torch.float32:
            b = module.bias
            packed = getattr(module, "packed", None)
            return cls(w.detach().t(), None if b is None else b.detach(), module, packed)
        return cls(None, None, module)

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x (N, K) -> (N, N_out), plus `residual` (N, N_out) if given. The residual is added
        after the product, not inside it (addmm's C): there a row's sum would depend on how
        many rows the product has (the BLAS's blocking), and a server's pool of lines would
        score them otherwise than the CLI's batches."""
        work = 0 if self.weight_t is None else x.size(0) * self.weight_t.numel()  # M K N
        if self.weight_t is None:
            y = self.module(x)
        elif (
            work >= matmul.ONEDNN_MIN_WORK
            and matmul.use_onednn(x, work)
            and x.size(0) > matmul.BLAS_MAX_ROWS
        ):
            # the matmul backend in use says oneDNN (`auto` on AMD CPUs with AVX-512)
            w = self.weight_t.t()  # (N, K)
            packed = None if self.packed is None else self.packed.of(w)
            y = matmul.linear(x, w, self.bias, packed)
        elif self.bias is None:
            y = x @ self.weight_t
        else:
            y = torch.addmm(self.bias, x, self.weight_t)
        return y if residual is None else y.add_(residual)


def stacked(modules: list[nn.Module]) -> Product | None:
    """One product for several projections of the same input, their outputs side by side
    (self-attention's q, k, v; an SSRU's W x and W_f x + b_f): fp32 or int8, else None."""
    int8 = [m for m in modules if isinstance(m, Int8Linear)]
    if len(int8) == len(modules) and len({m.engine for m in int8}) == 1:
        return Product(None, None, Int8Linear.stacked(int8))
    parts = [Product.of(m) for m in modules]
    weights = [p.weight_t for p in parts if p.weight_t is not None]
    if len(weights) < len(parts):
        return None
    bias = matmul.side_by_side([p.bias for p in parts], [w.size(1) for w in weights])
    weight_t = torch.cat(weights, dim=1).contiguous()  # (K, N_all)
    packed = None
    if all(p.packed is not None for p in parts):  # oneDNN's layout of the stacked weight
        packed = matmul.PackedWeight(weight_t.t())
    return Product(weight_t, bias, modules[0], packed)


@dataclass
class LeanLayer:
    """One decoder layer's parameters, as the lean step reads them."""

    norms: list[nn.LayerNorm]  # before (pre-norm) or after (post-norm): self, cross, ff
    ssru: Product | None  # an SSRU layer's W and W_f side by side; None: self-attention
    qkv: Product | None  # self-attention's q, k, v side by side, or None: `separate`
    separate: list[Product] | None  # q, k, v where they do not stack (16-bit weights)
    out: Product | None  # self-attention's output projection
    cross_q: Product
    cross_out: Product
    ff_in: Product
    ff_out: Product
    activation: Callable[[Tensor], Tensor]
    heads: int

    @classmethod
    def of(cls, layer: DecoderLayer) -> LeanLayer | None:
        """The layer's parameters, or None where the lean step does not cover it (rotary
        positions, an SSRU whose products do not stack)."""
        ca, ff = layer.cross_attn, layer.ff
        if layer.rope:
            return None
        ssru: Product | None = None
        qkv: Product | None = None
        out: Product | None = None
        separate: list[Product] | None = None
        if layer.ssru is not None:
            if (ssru := stacked([layer.ssru.w, layer.ssru.w_f])) is None:
                return None
        else:
            sa = layer.self_attn
            projections = [sa.q_proj, sa.k_proj, sa.v_proj]
            if (qkv := stacked(projections)) is None:
                separate = [Product.of(m) for m in projections]
            out = Product.of(sa.out_proj)
        norms = [layer.res_self.norm, layer.res_cross.norm, layer.res_ff.norm]
        return cls(
            norms, ssru, qkv, separate, out,
            cross_q=Product.of(ca.q_proj), cross_out=Product.of(ca.out_proj),
            ff_in=Product.of(ff.w_1), ff_out=Product.of(ff.w_2),
            activation=torch.relu_ if ff.activation == "relu" else ACTIVATIONS[ff.activation],
            heads=ca.num_heads,
        )  # fmt: skip


def _norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


@dataclass
class _Cohort:
    """What a layer of the step reads and writes of one cohort (decode_cohorts): its rows of
    the step's (N, d) rows (None: all of them), its cache of the layer (replaced by the grown
    one), its memory's keys and values, its state (pending row order, positions)."""

    rows: slice | None
    cache: LayerCache | RecurrentCache
    cross_k: Tensor  # (B, h, S, d_h)
    cross_v: Tensor
    src_mask: Tensor  # (B, 1, 1, S)
    state: TransformerState
    self_mask: Tensor | None  # (n, 1, 1, t+1): rows at their own positions, or None

    def of(self, x: Tensor) -> Tensor:
        """The cohort's rows of x (N, ...)."""
        return x if self.rows is None else x[self.rows]


def _stacked(parts: list[Tensor]) -> Tensor:
    """The cohorts' rows one after another (N, ...)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class LeanStep:
    """TransformerSeq2Seq.decode_step without attention weights, in fewer operations; and
    decode_cohorts: one step of several cohorts, the products shared, attention per cohort."""

    def __init__(self, model: TransformerSeq2Seq) -> None:
        self.model = model
        self.pre_norm = model.pre_norm
        self.layers = [LeanLayer.of(layer) for layer in model.decoder_layers]
        # The layers compiled ahead of time (compiled_step.attach), run where
        # _run_compiled can; None: not asked for, or not possible here.
        self.compiled: Callable[..., Tensor] | None = None

    def __call__(
        self, memory: TransformerMemory, state: TransformerState, prev_tokens: Tensor
    ) -> tuple[Tensor, TransformerState, None]:
        logits, (state,) = self.cohorts([memory], [state], prev_tokens, [prev_tokens.numel()])
        return logits, state, None

    def cohorts(
        self,
        memories: list[TransformerMemory],
        states: list[TransformerState],
        prev_tokens: Tensor,
        sizes: list[int],
    ) -> tuple[Tensor, list[TransformerState]]:
        """Cohort i's rows are sizes[i] consecutive rows of prev_tokens (N,) -> logits (N, V)
        and each cohort's new state."""
        model = self.model
        if len(states) == 1:
            offset: int | Tensor = states[0].position
        else:
            offset = torch.cat([per_row(s) for s in states])  # (N,)
        x = model.tgt_embed(prev_tokens.unsqueeze(1), offset=offset)  # (N, 1, d)
        N, _, d = x.shape
        x = x.view(N, d)  # (N, d)
        masks = [model._joined_mask(s) for s in states]  # (n, 1, 1, t+1) or None each
        if self.compiled is not None and _compiled_applies(x, states):
            ran = _run_compiled(self.compiled, x, memories, states, sizes, masks)
            if ran is not None:
                return self._logits(*ran, states)
        ends = list(itertools.accumulate(sizes))
        rows = (
            [None]
            if len(sizes) == 1
            else [slice(e - n, e) for n, e in zip(sizes, ends, strict=True)]
        )
        caches: list[list] = [[] for _ in states]
        for i, (lean, layer) in enumerate(zip(self.layers, model.decoder_layers, strict=True)):
            parts = [
                _Cohort(r, s.caches[i], *m.cross[i], m.src_mask, s, mask)
                for r, s, m, mask in zip(rows, states, memories, masks, strict=True)
            ]
            x = self._layer(lean, x, parts) if lean is not None else _module_layer(layer, x, parts)
            for kept, part in zip(caches, parts, strict=True):
                kept.append(part.cache)
        return self._logits(x, caches, states)

    def _logits(
        self, x: Tensor, caches: list[list], states: list[TransformerState]
    ) -> tuple[Tensor, list[TransformerState]]:
        """The last layer's x (N, d) -> logits (N, V), and each cohort's new state."""
        logits = self.model.output(self.model.dec_norm(x))  # (N, V)
        return logits, [
            TransformerState(c, s.position + 1) for c, s in zip(caches, states, strict=True)
        ]

    def _sublayer_in(self, norm: nn.LayerNorm, x: Tensor) -> Tensor:
        return _norm(norm, x) if self.pre_norm else x

    def _sublayer_out(self, norm: nn.LayerNorm, y: Tensor) -> Tensor:
        """y = x + sublayer(...) already; post-norm normalises the sum."""
        return y if self.pre_norm else _norm(norm, y)

    def _layer(self, lean: LeanLayer, x: Tensor, parts: list[_Cohort]) -> Tensor:
        """One decoder layer (DecoderLayer.step): x (N, d) -> (N, d); each cohort's cache
        replaced by the grown one."""
        N, d = x.shape
        h_, d_h = lean.heads, d // lean.heads
        h = self._sublayer_in(lean.norms[0], x)
        if isinstance(parts[0].cache, RecurrentCache):  # an SSRU (attnmt.models.ssru)
            assert lean.ssru is not None
            wx, gate = lean.ssru(h).chunk(2, dim=1)  # (N, d) each: W x, W_f x + b_f
            f = torch.sigmoid(gate)
            c = _stacked([_recurrent(p) for p in parts])  # (N, d)
            c = f * c + (1 - f) * wx  # c_t
            for p in parts:
                p.cache = RecurrentCache(p.of(c))
            y = torch.relu(c).add_(x)  # o_t + x
        else:
            assert lean.out is not None
            if lean.qkv is not None:
                q, k, v = lean.qkv(h).view(N, 3, h_, 1, d_h).unbind(1)  # (N, h, 1, d_h) each
            else:
                assert lean.separate is not None
                q, k, v = (p(h).view(N, h_, 1, d_h) for p in lean.separate)
            a = _self_attention(q, k, v, parts).to(x.dtype)  # (N, h, 1, d_h)
            y = lean.out(a.view(N, d), residual=x)  # (N, d)
        x = self._sublayer_out(lean.norms[0], y)
        h = self._sublayer_in(lean.norms[1], x)
        a = _cross_attention(lean.cross_q(h), h_, parts).to(x.dtype)  # (N, d)
        x = self._sublayer_out(lean.norms[1], lean.cross_out(a, residual=x))
        h = self._sublayer_in(lean.norms[2], x)
        f = lean.activation(lean.ff_in(h))  # (N, ff)
        return self._sublayer_out(lean.norms[2], lean.ff_out(f, residual=x))


def _compiled_applies(x: Tensor, states: list[TransformerState]) -> bool:
    """Whether the compiled step may run this step: on the CPU, without a gradient, every
    self-attention cache a decoding one (with a Room)."""
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return False
    return all(
        isinstance(c, RecurrentCache) or (isinstance(c, LayerCache) and c.room is not None)
        for s in states
        for c in s.caches
    )


def _run_compiled(
    compiled: Callable[..., Tensor],
    x: Tensor,
    memories: list[TransformerMemory],
    states: list[TransformerState],
    sizes: list[int],
    masks: list[Tensor | None],
) -> tuple[Tensor, list[list]] | None:
    """The decoder's layers by the compiled step (models.compiled_step), one call a cohort
    (cohort i: sizes[i] consecutive rows of x (N, d)) -> (N, d), and each cohort's caches
    grown by one position. None where it cannot run every cohort (buffers not fp32 or not
    contiguous): then nothing has been written."""
    ends = list(itertools.accumulate(sizes))
    calls = [
        _CompiledCall.of(x[e - n : e], m, s, mask)
        for n, e, m, s, mask in zip(sizes, ends, memories, states, masks, strict=True)
    ]  # fmt: skip
    if any(call is None for call in calls):
        return None
    outs, caches = [], []
    for call in calls:
        assert call is not None
        outs.append(compiled(*call.inputs))
        caches.append(call.grown())
    return _stacked(outs), caches


@dataclass
class _CompiledCall:
    """One cohort's call of the compiled step: its inputs, and the Rooms (or an SSRU's
    buffers) it writes its rows' position into."""

    inputs: tuple
    kept: list[Room | RecurrentCache]
    buffers: list[Tensor]

    @classmethod
    def of(
        cls, x: Tensor, memory: TransformerMemory, state: TransformerState, mask: Tensor | None
    ) -> _CompiledCall | None:
        """The call for rows x (n, d) at their state (the caches as room_for_next gives them:
        with position `filled` free, in the order of state.rows, nothing written yet); rows
        at their own positions (a pool's joins) see what mask (n, 1, 1, t+1) lets them. None
        where the compiled step cannot take them."""
        N = x.size(0)
        kept: list[Room | RecurrentCache] = []
        for c in state.caches:
            if isinstance(c, RecurrentCache) and c.c.dtype == torch.float32:
                kept.append(RecurrentCache(_in_order(c, state.rows).contiguous()))
            elif (
                isinstance(c, LayerCache) and c.room is not None
                and c.self_k.dtype == torch.float32
            ):  # fmt: skip
                kept.append(room_for_next(c, state.rows, N))
            else:
                return None
        rooms = [r for r in kept if isinstance(r, Room)]
        buffers = [
            b for r in kept
            for b in ((r.k[:N], r.v[:N]) if isinstance(r, Room) else (r.c, torch.empty_like(r.c)))
        ]  # fmt: skip
        if len({(r.filled, r.start, r.k.size(2)) for r in rooms}) > 1 or not all(
            b.is_contiguous() for b in buffers
        ):
            return None
        at, start = (rooms[0].filled, rooms[0].start) if rooms else (0, 0)
        if mask is None:
            mask = x.new_zeros(N, 1, 1, at + 1 - start)
        cross = [t.contiguous() for kv in memory.cross for t in kv]
        inputs = (
            x, torch.tensor([at]), torch.empty(at + 1), mask.contiguous(), buffers, cross,
            memory.src_mask.contiguous(),
        )  # fmt: skip
        return cls(inputs, kept, buffers)

    def grown(self) -> list[LayerCache | RecurrentCache]:
        """The caches after the call: each Room one position fuller, an SSRU's c_t."""
        N = self.inputs[0].size(0)
        grown: list[LayerCache | RecurrentCache] = []
        for i, r in enumerate(self.kept):
            if isinstance(r, Room):
                r.filled += 1
                grown.append(r.cache(N))
            else:
                grown.append(RecurrentCache(self.buffers[2 * i + 1]))
        return grown


def _self_attention(q: Tensor, k: Tensor, v: Tensor, parts: list[_Cohort]) -> Tensor:
    """Each cohort's rows of q, k, v (N, h, 1, d_h) over its own cache, which takes k and v
    as its next position (replaced by the grown one) -> (N, h, 1, d_h)."""
    outs = []
    for p in parts:
        assert isinstance(p.cache, LayerCache)
        p.cache = append_position(p.cache, p.of(k), p.of(v), p.state.rows)  # (n, h, t+1, d_h)
        outs.append(step_attention(p.of(q), p.cache.self_k, p.cache.self_v, p.self_mask))
    return _stacked(outs)


def _cross_attention(q: Tensor, heads: int, parts: list[_Cohort]) -> Tensor:
    """Each cohort's rows of q (N, d) over its own memory -> (N, d); a memory row is read
    by a group of n // B rows (a sentence's beams) as G queries."""
    d = q.size(1)
    outs = []
    for p in parts:
        mine = p.of(q)  # (n, d)
        n, B = mine.size(0), p.cross_k.size(0)
        mine = mine.view(B, n // B, heads, d // heads).transpose(1, 2)  # (B, h, G, d_h)
        a = step_attention(mine, p.cross_k, p.cross_v, p.src_mask)  # (B, h, G, d_h)
        outs.append(a.transpose(1, 2).reshape(n, d))  # (n, d)
    return _stacked(outs)


def _recurrent(part: _Cohort) -> Tensor:
    """An SSRU cohort's c_{t-1} in its rows' order (n, d)."""
    assert isinstance(part.cache, RecurrentCache)
    return _in_order(part.cache, part.state.rows)


def _in_order(cache: RecurrentCache, rows: Tensor | None) -> Tensor:
    """An SSRU's c_{t-1} (n, d) in the order of `rows` (n,), or as it is: None."""
    return cache.c if rows is None else cache.c.index_select(0, rows)


def _module_layer(layer: DecoderLayer, x: Tensor, parts: list[_Cohort]) -> Tensor:
    """A layer the lean step does not cover (rotary positions), as its module steps each
    cohort: x (N, d) -> (N, d)."""
    d = x.size(1)
    outs = []
    for p in parts:
        rows = p.of(x)
        y, p.cache, _ = layer.step(
            rows.view(-1, 1, d), p.cache, p.cross_k, p.cross_v, p.src_mask, rows=p.state.rows,
            position=p.state.position, self_mask=p.self_mask,
        )  # fmt: skip
        outs.append(y.view(-1, d))
    return _stacked(outs)


def attach(model: nn.Module) -> None:
    """Give each Transformer in the model (each member of an ensemble) its lean step."""
    for module in model.modules():
        if isinstance(module, TransformerSeq2Seq):
            module.lean_step = LeanStep(module)
