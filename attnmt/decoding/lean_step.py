"""The Transformer's decoding step with fewer operations: the same function as
TransformerSeq2Seq.decode_step (tests/decoding/test_lean_step.py compares them), computed on 2-D
rows (N, d) with the self-attention's q, k and v from one product, the bias added by the product
(addmm) and the residual in place, the model's modules called only for the embedding and the
output layer. A step of the 30-minute T at 36 rows, 1 thread: 5.5 -> 4.3 ms (docs/benchmarks.md).

Why: at a decoding step's few rows the products are small, and the module path's per-call
costs (module calls, the matmul backend's checks, views to and from (N, 1, d), a residual add
and a bias copy per sublayer, dropout calls that do nothing) add up to a fifth of the step.

`attach(model)` gives each Transformer in the model a lean step (decoding only: for_decoding);
decode_step uses it unless attention weights are asked for. Layers it does not cover (an SSRU,
rotary positions) and int8 products (Int8Linear: called as the module) keep their own forms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.kernels.int8 import Int8Linear
from attnmt.models.decoding_state import (
    LayerCache,
    TransformerMemory,
    TransformerState,
    append_position,
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

    @classmethod
    def of(cls, module: nn.Module) -> Product:
        w = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(w, Tensor) and w.dtype == torch.float32:
            b = module.bias
            return cls(w.detach().t(), None if b is None else b.detach(), module)
        return cls(None, None, module)

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x (N, K) -> (N, N_out), plus `residual` (N, N_out) if given. The residual is added
        after the product, not inside it (addmm's C): there a row's sum would depend on how
        many rows the product has (the BLAS's blocking), and a server's pool of lines would
        score them otherwise than the CLI's batches."""
        if self.weight_t is None:
            y = self.module(x)
        elif self.bias is None:
            y = x @ self.weight_t
        else:
            y = torch.addmm(self.bias, x, self.weight_t)
        return y if residual is None else y.add_(residual)


def fused_qkv(q: nn.Module, k: nn.Module, v: nn.Module) -> Product | None:
    """One product for the three projections of self-attention (fp32 or int8, with biases),
    or None."""
    int8 = [m for m in (q, k, v) if isinstance(m, Int8Linear) and m.bias is not None]
    if len(int8) == 3 and len({m.engine for m in int8}) == 1:
        return Product(None, None, Int8Linear.stacked(int8))
    parts = [Product.of(m) for m in (q, k, v)]
    if any(p.weight_t is None or p.bias is None for p in parts):
        return None
    w = torch.cat([p.weight_t for p in parts if p.weight_t is not None], dim=1)  # (d, 3d)
    b = torch.cat([p.bias for p in parts if p.bias is not None])  # (3d,)
    return Product(w.contiguous(), b, q)


@dataclass
class LeanLayer:
    """One decoder layer's parameters, as the lean step reads them."""

    norms: list[nn.LayerNorm]  # before (pre-norm) or after (post-norm): self, cross, ff
    qkv: Product | None  # None: q, k, v below
    q: Product
    k: Product
    v: Product
    out: Product
    cross_q: Product
    cross_out: Product
    ff_in: Product
    ff_out: Product
    activation: Callable[[Tensor], Tensor]
    heads: int

    @classmethod
    def of(cls, layer: DecoderLayer) -> LeanLayer:
        sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
        relu = ff.activation == "relu"
        return cls(
            norms=[layer.res_self.norm, layer.res_cross.norm, layer.res_ff.norm],
            qkv=fused_qkv(sa.q_proj, sa.k_proj, sa.v_proj),
            q=Product.of(sa.q_proj), k=Product.of(sa.k_proj), v=Product.of(sa.v_proj),
            out=Product.of(sa.out_proj),
            cross_q=Product.of(ca.q_proj), cross_out=Product.of(ca.out_proj),
            ff_in=Product.of(ff.w_1), ff_out=Product.of(ff.w_2),
            activation=torch.relu_ if relu else ACTIVATIONS[ff.activation],
            heads=sa.num_heads,
        )  # fmt: skip


def _norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q kᵀ / √d + mask) v in the dtype k and v are kept in (cache_dtype)."""
    if q.dtype != k.dtype:
        q, mask = q.to(k.dtype), None if mask is None else mask.to(k.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LeanStep:
    """TransformerSeq2Seq.decode_step without attention weights, in fewer operations."""

    def __init__(self, model: TransformerSeq2Seq) -> None:
        self.model = model
        self.pre_norm = model.pre_norm
        self.layers = [
            None if layer.ssru is not None or layer.rope else LeanLayer.of(layer)
            for layer in model.decoder_layers
        ]

    def __call__(
        self, memory: TransformerMemory, state: TransformerState, prev_tokens: Tensor
    ) -> tuple[Tensor, TransformerState, None]:
        model = self.model
        x = model.tgt_embed(prev_tokens.unsqueeze(1), offset=state.position)  # (N, 1, d)
        N, _, d = x.shape
        x = x.view(N, d)  # (N, d)
        self_mask = model._joined_mask(state)  # (N, 1, 1, t+1) or None
        caches: list = []
        for lean, layer, cache, (k, v) in zip(
            self.layers, model.decoder_layers, state.caches, memory.cross, strict=True
        ):
            if lean is None or not isinstance(cache, LayerCache):
                y, cache, _ = layer.step(
                    x.view(N, 1, d), cache, k, v, memory.src_mask, rows=state.rows,
                    position=state.position, self_mask=self_mask,
                )  # fmt: skip
                x = y.view(N, d)
            else:
                x, cache = self._layer(lean, x, cache, k, v, memory.src_mask, state, self_mask)
            caches.append(cache)
        logits = model.output(model.dec_norm(x))  # (N, V)
        return logits, TransformerState(caches, state.position + 1), None

    def _sublayer_in(self, norm: nn.LayerNorm, x: Tensor) -> Tensor:
        return _norm(norm, x) if self.pre_norm else x

    def _sublayer_out(self, norm: nn.LayerNorm, y: Tensor) -> Tensor:
        """y = x + sublayer(...) already; post-norm normalises the sum."""
        return y if self.pre_norm else _norm(norm, y)

    def _layer(
        self,
        lean: LeanLayer,
        x: Tensor,
        cache: LayerCache,
        cross_k: Tensor,
        cross_v: Tensor,
        src_mask: Tensor,
        state: TransformerState,
        self_mask: Tensor | None,
    ) -> tuple[Tensor, LayerCache]:
        """One decoder layer (DecoderLayer.step): x (N, d) -> (N, d) and the grown cache."""
        N, d = x.shape
        h_, d_h = lean.heads, d // lean.heads
        h = self._sublayer_in(lean.norms[0], x)
        if lean.qkv is not None:
            q, k, v = lean.qkv(h).view(N, 3, h_, 1, d_h).unbind(1)  # (N, h, 1, d_h) each
        else:
            q, k, v = (p(h).view(N, h_, 1, d_h) for p in (lean.q, lean.k, lean.v))
        cache = append_position(cache, k, v, state.rows)  # (N, h, t+1, d_h) each
        a = _attention(q, cache.self_k, cache.self_v, self_mask).to(x.dtype)  # (N, h, 1, d_h)
        x = self._sublayer_out(lean.norms[0], lean.out(a.view(N, d), residual=x))  # (N, d)
        h = self._sublayer_in(lean.norms[1], x)
        B = cross_k.size(0)  # a group of N // B rows (a sentence's beams) per memory row
        q = lean.cross_q(h).view(B, N // B, h_, d_h).transpose(1, 2)  # (B, h, G, d_h)
        a = _attention(q, cross_k, cross_v, src_mask)  # (B, h, G, d_h)
        a = a.transpose(1, 2).reshape(N, d).to(x.dtype)  # (N, d)
        x = self._sublayer_out(lean.norms[1], lean.cross_out(a, residual=x))
        h = self._sublayer_in(lean.norms[2], x)
        f = lean.activation(lean.ff_in(h))  # (N, ff)
        return self._sublayer_out(lean.norms[2], lean.ff_out(f, residual=x)), cache


def attach(model: nn.Module) -> None:
    """Give each Transformer in the model (each member of an ensemble) its lean step."""
    for module in model.modules():
        if isinstance(module, TransformerSeq2Seq):
            module.lean_step = LeanStep(module)
