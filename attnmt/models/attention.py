"""Attention: additive (Bahdanau), scaled dot-product, and multi-head.

Every module here is stateless between calls: whatever a decoder wants to reuse across steps
(projected keys, cached key/value heads) is returned to it and passed back in explicitly.
Masks: a boolean `pad_mask` / `key_padding_mask` is True where a key must be ignored (the
convention of torch.nn.MultiheadAttention); masked keys get a weight of exactly 0.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnmt.kernels import Linear, dropout, fused_attention, softmax


def masked_softmax(scores: torch.Tensor, pad_mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis with masked positions set to exactly 0.

    Args:
        scores: (..., S) attention energies.
        pad_mask: (..., S) bool, True where a key is padding; broadcastable to scores.
    """
    if pad_mask is not None:
        scores = scores.masked_fill(pad_mask, float("-inf"))
    return softmax(scores)  # over the last axis


class SourceAttention(nn.Module):
    """Attention of one decoder state over the encoder states (the rnn decoder's attention).

    Subclasses define the score; the keys do not change while a sentence is decoded, so
    `project_keys` is called once per sentence and its result passed to every step.
    """

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """(B, S, key_size) -> (B, S, A), once per sentence."""
        raise NotImplementedError

    def score(self, query: torch.Tensor, proj_keys: torch.Tensor) -> torch.Tensor:
        """query (B, G, query_size), proj_keys (B, S, A) -> energies (B, G, S)."""
        raise NotImplementedError

    def additive_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(W_q, b_q, v) of an additive score v · tanh(W_q q + b_q + W_k k), for the kernels
        that compute it inside a fused recurrence; None for any other score."""
        return None

    def forward(
        self,
        query: torch.Tensor,
        proj_keys: torch.Tensor,
        values: torch.Tensor,
        pad_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder step.

        Args:
            query: (N, query_size) the decoder states; N = G * B, and each group of G
                consecutive rows (a sentence's beams) attends over the same source row.
            proj_keys: (B, S, A) from project_keys.
            values: (B, S, value_size) the encoder states.
            pad_mask: (B, S) bool, True at source padding.
        Returns:
            context (N, value_size) and weights (N, S).
        """
        N, B = query.size(0), values.size(0)
        q = query.view(B, N // B, -1)  # (B, G, query_size)
        weights = masked_softmax(self.score(q, proj_keys), pad_mask.unsqueeze(1))  # (B, G, S)
        context = torch.bmm(weights, values)  # (B, G, V)
        return context.view(N, -1), weights.view(N, -1)


class AdditiveAttention(SourceAttention):
    """Bahdanau et al. (2015), https://arxiv.org/abs/1409.0473: score = v · tanh(W_q q + W_k k)."""

    def __init__(self, query_size: int, key_size: int, hidden_size: int) -> None:
        super().__init__()
        self.key_layer = Linear(key_size, hidden_size, bias=False)
        self.query_layer = Linear(query_size, hidden_size, bias=True)
        self.energy_layer = Linear(hidden_size, 1, bias=False)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        return self.key_layer(keys)  # (B, S, hidden_size): W_k k

    def score(self, query: torch.Tensor, proj_keys: torch.Tensor) -> torch.Tensor:
        q = self.query_layer(query).unsqueeze(2)  # (B, G, 1, H)
        e = torch.tanh(q + proj_keys.unsqueeze(1))  # (B, G, S, H)
        return self.energy_layer(e).squeeze(-1)  # (B, G, S)

    def additive_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.query_layer
        return q.weight, q.bias, self.energy_layer.weight


class DotAttention(SourceAttention):
    """Scaled dot-product attention with a learned key projection (Luong's "general" score,
    scaled as in Vaswani et al.): score = (W_k k) · q / sqrt(d)."""

    def __init__(self, query_size: int, key_size: int) -> None:
        super().__init__()
        self.key_layer = Linear(key_size, query_size, bias=False)
        self.scale = 1.0 / math.sqrt(query_size)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        return self.key_layer(keys)  # (B, S, query_size)

    def score(self, query: torch.Tensor, proj_keys: torch.Tensor) -> torch.Tensor:
        return torch.bmm(query, proj_keys.transpose(1, 2)) * self.scale  # (B, G, S)


def additive_mask(
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Combine a key padding mask and an attention mask into one additive float mask.

    Args:
        key_padding_mask: (B, T_k), bool (True = ignore) or float (added to the scores).
        attn_mask: (T_q, T_k) or (B, heads, T_q, T_k), bool (True = not allowed) or float.
    Returns:
        A float mask broadcastable to (B, heads, T_q, T_k), or None when both are None.
    """

    def as_float(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        mask = as_float(attn_mask)  # (T_q, T_k) or (B, h, T_q, T_k)
    if key_padding_mask is not None:
        kpm = as_float(key_padding_mask)[:, None, None, :]  # (B, 1, 1, T_k)
        mask = kpm if mask is None else mask + kpm  # (B, h|1, T_q, T_k)
    return mask


def in_keys_dtype(
    q: torch.Tensor, mask: torch.Tensor | None, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The queries and the additive mask in the dtype the keys and values are kept in (a
    decoder's cache_dtype: int8 decoding keeps them in bf16), where it differs: attention is
    computed in it."""
    if q.dtype == k.dtype:
        return q, mask
    return q.to(k.dtype), None if mask is None else mask.to(k.dtype)


def causal_mask(size: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T) bool mask, True above the diagonal: position t may not see t' > t."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


def scaled_dot_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / sqrt(d) + mask) v, returning the weights too (Vaswani et al., eq. 1).

    Args:
        q: (B, h, T_q, d); k: (B, h, T_k, d); v: (B, h, T_k, d_v).
        mask: additive float mask broadcastable to (B, h, T_q, T_k), or None.
    Returns:
        out (B, h, T_q, d_v) and weights (B, h, T_q, T_k) (after dropout, as in
        nn.MultiheadAttention).
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, h, T_q, T_k)
    if mask is not None:
        scores = scores + mask
    weights = softmax(scores)  # (B, h, T_q, T_k)
    weights = dropout(weights, dropout_p, True)
    return weights @ v, weights  # (B, h, T_q, d_v)


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (RoFormer, Su et al. 2021, https://arxiv.org/abs/2104.09864,
    eq. 34): each pair (x_2i, x_2i+1) of a head's vector at position m turns by the angle
    m θ_i, θ_i = base^(-2i/d):

        (x_2i, x_2i+1) -> (x_2i cos mθ_i - x_2i+1 sin mθ_i, x_2i sin mθ_i + x_2i+1 cos mθ_i)

    so that a query at m and a key at n meet through their offset m - n alone (eq. 16).
    x (B, h, T, d) with d even, positions (T,) or per row (B, T) -> (B, h, T, d)."""
    d = x.size(-1)
    theta = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # (d/2,)
    angle = positions.to(x.device, torch.float32).unsqueeze(-1) * theta  # ([B,] T, d/2)
    if angle.dim() == 3:
        angle = angle.unsqueeze(1)  # (B, 1, T, d/2): every head of a row alike
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)  # ([B, 1,] T, d/2)
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, h, T, d/2)
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, https://arxiv.org/abs/1706.03762, sec. 3.2.2).

    MultiHead(Q, K, V) = Concat(head_1..head_h) W_O, head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i).
    Batch-first. Gives the same output and head-averaged weights as torch.nn.MultiheadAttention
    (batch_first=True) loaded with the same projection weights; keys and values may have their
    own widths (kdim, vdim).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        assert embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, h, T, d)

    def project_kv(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Project keys and values into heads: (B, T_k, kdim), (B, T_k, vdim) -> (B, h, T_k, d).

        Split out so that a decoder can project the encoder output once per sentence and keep
        the result for every step.
        """
        return self.split_heads(self.k_proj(key)), self.split_heads(self.v_proj(value))

    def attend(
        self,
        query: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        q_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from query (B, T_q, E) over projected heads k, v (B, h, T_k, d).

        Args:
            mask: additive float mask broadcastable to (B, h, T_q, T_k) (see additive_mask).
            causal: apply a causal mask (position t sees keys <= t).
            q_positions: (T_q,) or (B, T_q) the queries' positions, for rotary positions
                (the keys were turned by theirs: rotary).
        Returns:
            out (B, T_q, E) and, if need_weights, weights (B, T_q, T_k) averaged over heads
            or (B, h, T_q, T_k).
        """
        B, T_q, E = query.shape
        q = self.split_heads(self.q_proj(query))  # (B, h, T_q, d)
        if q_positions is not None:
            q = rotary(q, q_positions)  # (B, h, T_q, d)
        dtype = q.dtype  # the answer's
        q, mask = in_keys_dtype(q, mask, k)
        p = self.dropout if self.training else 0.0
        # torch's fused kernel where it is faster (attnmt.kernels); it gives no weights.
        out = None if need_weights else fused_attention(q, k, v, mask, causal, p)
        weights = None
        if out is None:
            if causal:
                cm = additive_mask(None, causal_mask(T_q, query.device), q.dtype)  # (T_q, T_k)
                mask = cm if mask is None else mask + cm
            out, w = scaled_dot_product(q, k, v, mask, p)  # (B, h, T_q, d), (B, h, T_q, T_k)
            if need_weights:
                weights = w.mean(dim=1) if average_attn_weights else w  # (B, T_q, T_k) if mean
                weights = weights.to(dtype)
        out = out.transpose(1, 2).reshape(B, T_q, E).to(dtype)  # (B, T_q, E)
        return self.out_proj(out), weights

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        average_attn_weights: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same arguments and results as torch.nn.MultiheadAttention(batch_first=True)."""
        k, v = self.project_kv(key, value)  # (B, h, T_k, d)
        mask = additive_mask(key_padding_mask, attn_mask, query.dtype)
        return self.attend(
            query,
            k,
            v,
            mask,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
        )
