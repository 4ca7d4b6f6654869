"""Transformer encoder-decoder (Vaswani et al. 2017, https://arxiv.org/abs/1706.03762).

Sinusoidal positions, our MultiHeadAttention, position-wise feed-forward, residual + LayerNorm
(pre-norm: x + Sublayer(LN(x)), or post-norm: LN(x + Sublayer(x))). Decoding one position at a
time keeps each layer's self-attention keys/values in the state, and the encoder output is
projected into cross-attention keys/values once per sentence, so a step costs one position
(the state and memory, and how they grow, join and shrink: attnmt.models.decoding_state).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.config import ModelConfig
from attnmt.data.batches import Batch
from attnmt.data.tokenizer import PAD_ID
from attnmt.kernels import (
    Dropout,
    LayerNorm,
    Linear,
    dropout_add,
    feed_forward,
    linear_cross_entropy,
)
from attnmt.models.attention import MultiHeadAttention, additive_mask, rotary
from attnmt.models.decoding_state import (
    ROOM,
    LayerCache,
    RecurrentCache,
    Room,
    TransformerMemory,
    TransformerState,
    append_position,
    join_in_place,
    per_row,
    stack_rows,
)
from attnmt.models.packing import Packing
from attnmt.models.rows import move_rows, moved_rows, spare_rows, writable
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq, gold_coins
from attnmt.models.ssru import SSRU


def sinusoid_table(
    length: int, dim: int, offset: int = 0, layout: str = "interleaved"
) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), for pos in
    [offset, offset + length): (length, dim). Computed on demand, so any length works.
    layout "halves" (transformers' MarianMT): the same sines in columns [0, ceil(d/2)), the
    cosines after; "marian" (Marian C++, tensor2tensor's): halves with the frequencies
    10000^(-i / (d/2 - 1)), i < d/2."""
    pos = torch.arange(offset, offset + length, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    if layout == "marian":
        half = dim // 2
        div = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
        return torch.cat([torch.sin(pos * div), torch.cos(pos * div)], dim=1)  # (L, d)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    sines, cosines = torch.sin(pos * div), torch.cos(pos * div)[:, : dim // 2]  # (L, ~d/2)
    if layout == "halves":
        return torch.cat([sines, cosines], dim=1)  # (L, d)
    table[:, 0::2] = sines  # (L, ceil(d/2))
    table[:, 1::2] = cosines  # (L, floor(d/2))
    return table


def positions_of(length: int, start: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Positions start..start+length-1 as a (length,) tensor; from per-row starts (B,), (B,
    length)."""
    if isinstance(start, int):
        return torch.arange(start, start + length, device=device)
    return start.unsqueeze(1) + torch.arange(length, device=device)  # (B, length)


class Embeddings(nn.Module):
    """Token embedding × sqrt(d) + sinusoidal position, then dropout (sec. 3.4, 3.5). With
    rotary positions (layout rope) no position is added here: self-attention turns q and k."""

    def __init__(self, embed: nn.Embedding, dropout: float, layout: str = "interleaved") -> None:
        super().__init__()
        self.embed = embed
        self.scale = math.sqrt(embed.embedding_dim)
        self.layout = layout
        self.dropout = Dropout(dropout, inplace=True)  # on a sum autograd does not keep
        width = 0 if layout == "rope" else embed.embedding_dim
        table = sinusoid_table(512, width, layout=layout) if width else torch.zeros(0, 0)
        self.register_buffer("pe", table, persistent=False)

    def forward(self, tokens: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """tokens (B, T) at positions offset..offset+T-1 -> (B, T, d); `offset` may be per
        row, (B,) (sentences that joined a running search at other steps), or each token's
        position, (B, T) (sentences packed one after another: encode_packed)."""
        if self.layout == "rope":
            return self.dropout(self.embed(tokens) * self.scale)  # (B, T, d)
        T = tokens.size(1)
        if isinstance(offset, int):
            end = offset + T
        else:
            own = offset.dim() == 2  # each token's position, else each row's first
            end = int(offset.max()) + (1 if own else T)
        if end > self.pe.size(0):
            pe = sinusoid_table(end, self.pe.size(1), layout=self.layout)
            pe = pe.to(self.pe.device, self.pe.dtype)
        else:
            pe = self.pe
        if isinstance(offset, int):
            at = pe[offset : offset + T]  # (T, d)
        else:
            at = pe[offset if own else positions_of(T, offset, pe.device)]  # (B, T, d)
        x = self.embed(tokens) * self.scale + at  # (B, T, d)
        return self.dropout(x)


ACTIVATIONS = {"gelu": F.gelu, "swish": F.silu}  # swish(x) = x sigmoid(x); relu: the kernel


class FeedForward(nn.Module):
    """FFN(x) = W_2 dropout(act(W_1 x)) (sec. 3.3), act ReLU (or GELU, swish)."""

    def __init__(self, d_model: int, ff_size: int, dropout: float, activation: str = "relu"):
        super().__init__()
        self.w_1 = Linear(d_model, ff_size)
        self.w_2 = Linear(ff_size, d_model)
        self.p = dropout
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> (..., d)."""
        if self.activation == "relu":
            return feed_forward(x, self.w_1, self.w_2, self.p, self.training)
        h = ACTIVATIONS[self.activation](self.w_1(x))  # (..., ff)
        return self.w_2(F.dropout(h, self.p, self.training))  # (..., d)


class Residual(nn.Module):
    """Residual connection around a sublayer with LayerNorm before (pre) or after (post) it."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = LayerNorm(d_model)
        self.p = dropout
        self.pre_norm = pre_norm

    def normed_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the sublayer sees."""
        return self.norm(x) if self.pre_norm else x

    def add(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        """Add the sublayer's output back onto the residual stream."""
        y = dropout_add(x, sublayer_out, self.p, self.training)  # x + dropout(sublayer_out)
        return y if self.pre_norm else self.norm(y)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, pre = cfg.hidden_size, cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(d, cfg.heads, dropout=cfg.attention_dropout)
        self.ff = FeedForward(d, cfg.ff_size, cfg.dropout, cfg.activation)
        self.res_attn = Residual(d, cfg.dropout, pre)
        self.res_ff = Residual(d, cfg.dropout, pre)
        self.rope = cfg.positions == "rope"

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, S, d), mask additive (B, 1, 1, S) or (B, 1, S, S) -> (B, S, d); positions
        (B, S): each position's own (packed sentences), else 0..S-1."""
        h = self.res_attn.normed_input(x)
        k, v = self.self_attn.project_kv(h, h)  # (B, h, S, d_h)
        at = None
        if self.rope:
            at = positions if positions is not None else positions_of(x.size(1), 0, x.device)
        if at is not None:
            k = rotary(k, at)  # (B, h, S, d_h)
        x = self.res_attn.add(x, self.self_attn.attend(h, k, v, mask, q_positions=at)[0])
        return self.res_ff.add(x, self.ff(self.res_ff.normed_input(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention (or, model.decoder ssru, a recurrence: attnmt.models.ssru),
    attention over the encoder output, feed-forward; each in a residual block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, pre = cfg.hidden_size, cfg.norm == "pre"
        self.ssru = SSRU(d) if cfg.decoder == "ssru" else None
        if self.ssru is None:
            self.self_attn = MultiHeadAttention(d, cfg.heads, dropout=cfg.attention_dropout)
        self.cross_attn = MultiHeadAttention(d, cfg.heads, dropout=cfg.attention_dropout)
        self.ff = FeedForward(d, cfg.ff_size, cfg.dropout, cfg.activation)
        self.res_self = Residual(d, cfg.dropout, pre)
        self.res_cross = Residual(d, cfg.dropout, pre)
        self.res_ff = Residual(d, cfg.dropout, pre)
        self.rope = cfg.positions == "rope" and self.ssru is None  # an SSRU counts its own

    def forward(
        self,
        x: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        src_mask: torch.Tensor,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All target positions at once (training): x (B, T, d) -> (B, T, d), causal."""
        h = self.res_self.normed_input(x)
        if self.ssru is not None:
            x = self.res_self.add(x, self.ssru(h))
        else:
            k, v = self.self_attn.project_kv(h, h)  # (B, h, T, d_h)
            at = positions_of(x.size(1), 0, x.device) if self.rope else None  # (T,)
            if at is not None:
                k = rotary(k, at)  # (B, h, T, d_h)
            x = self.res_self.add(x, self.self_attn.attend(h, k, v, causal=True, q_positions=at)[0])
        h = self.res_cross.normed_input(x)
        out, weights = self.cross_attn.attend(
            h, cross_k, cross_v, src_mask, need_weights=need_weights
        )
        x = self.res_cross.add(x, out)
        return self.res_ff.add(x, self.ff(self.res_ff.normed_input(x))), weights

    def step(
        self,
        x: torch.Tensor,
        cache: LayerCache | RecurrentCache,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        src_mask: torch.Tensor,
        need_weights: bool = False,
        rows: torch.Tensor | None = None,
        position: int | torch.Tensor = 0,
        self_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LayerCache | RecurrentCache, torch.Tensor | None]:
        """One new position: x (N, 1, d) -> (N, 1, d), the grown cache, and (if asked) the
        per-head cross-attention weights (N, h, 1, S). N = G * B for cross_k of B rows:
        each group of G consecutive rows (a sentence's beams) shares one memory row.
        rows (N,): the cache rows that the N rows of x continue (None: all, in order);
        position: the new position's index, or each row's (N,) (rotary positions turn its q
        and k by it); self_mask (N, 1, 1, t+1): additive, -inf over cached positions a row
        does not have (it joined the search later), or None: every row sees every one."""
        h = self.res_self.normed_input(x)
        new_cache: LayerCache | RecurrentCache
        if isinstance(cache, RecurrentCache):
            assert self.ssru is not None
            c = cache.c if rows is None else cache.c.index_select(0, rows)  # (N, d)
            out, c = self.ssru.step(h, c)
            x, new_cache = self.res_self.add(x, out), RecurrentCache(c)
        else:
            k_new, v_new = self.self_attn.project_kv(h, h)  # (N, h, 1, d_h)
            at = positions_of(1, position, x.device) if self.rope else None  # (1,)
            if at is not None:
                k_new = rotary(k_new, at)  # cached turned: a key keeps its position
            new_cache = append_position(cache, k_new, v_new, rows)  # (N, h, t+1, d_h) each
            k, v = new_cache.self_k, new_cache.self_v
            # The newest position may see every cached one (of its row): no causal mask.
            out = self.self_attn.attend(h, k, v, self_mask, q_positions=at)[0]
            x = self.res_self.add(x, out)
        h = self.res_cross.normed_input(x)
        N, _, d = h.shape
        B = cross_k.size(0)
        # A group's G queries attend together as G query positions of its memory row.
        out, weights = self.cross_attn.attend(
            h.view(B, N // B, d),
            cross_k,
            cross_v,
            src_mask,
            need_weights=need_weights,
            average_attn_weights=False,
        )  # (B, G, d), (B, h, G, S); fmt: skip
        x = self.res_cross.add(x, out.view(N, 1, d))
        if weights is not None:
            weights = weights.transpose(1, 2).reshape(N, -1, 1, weights.size(-1))  # (N, h, 1, S)
        x = self.res_ff.add(x, self.ff(self.res_ff.normed_input(x)))
        return x, new_cache, weights


# A pool's memory is copied narrower once its rows need this share of its width or less.
NARROWER = 0.75
# Cohorts of a pool's sentences (those that joined at one step) that a decoding step shares
# its products among, each attending over caches as long as its own steps (decode_cohorts);
# newcomers beyond them join the youngest, padded to its steps.
COHORTS = 8


class TransformerSeq2Seq(Seq2Seq):
    """Encoder and decoder stacks; target embedding tied to the output projection (and to the
    source embedding when the vocabulary is joint) when model.tie_embeddings is set."""

    def __init__(self, cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint: bool) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.pre_norm = cfg.norm == "pre"
        tgt_embed = nn.Embedding(tgt_vocab, d, padding_idx=self.pad_id)
        share_src = joint and cfg.tie_embeddings
        src_embed = tgt_embed if share_src else nn.Embedding(src_vocab, d, self.pad_id)
        self.src_embed = Embeddings(src_embed, cfg.dropout, cfg.positions)
        self.tgt_embed = Embeddings(tgt_embed, cfg.dropout, cfg.positions)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # Pre-norm stacks end with a LayerNorm: the residual stream itself is never normalised.
        self.enc_norm = LayerNorm(d) if self.pre_norm else nn.Identity()
        self.dec_norm = LayerNorm(d) if self.pre_norm else nn.Identity()
        self.output = Linear(d, tgt_vocab, bias=cfg.output_bias)
        self._init_weights(d)
        if cfg.tie_embeddings:
            self.output.weight = tgt_embed.weight
        # Decoding's leaner form of decode_step (attnmt.models.lean_step, set by for_decoding):
        # the same function in fewer operations, used unless attention weights are asked for.
        # Its `cohorts` shares one step's products among cohorts (decode_cohorts).
        self.lean_step: Callable[..., tuple[torch.Tensor, TransformerState, None]] | None = None
        # Decoding: the dtype the memory's keys and values and the self-attention caches are
        # kept in (int8 decoding keeps them in bf16: half the bytes attention reads), or None:
        # the encoder's. Attention computes in it (MultiHeadAttention.attend).
        self.cache_dtype: torch.dtype | None = None

    def _init_weights(self, d: int) -> None:
        for name, p in self.named_parameters():
            if "embed" in name:
                # Embeddings are scaled by sqrt(d) on input; N(0, d^-1/2) keeps that at unit size.
                nn.init.normal_(p, mean=0.0, std=d**-0.5)
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
        with torch.no_grad():
            self.src_embed.embed.weight[self.pad_id].zero_()
            self.tgt_embed.embed.weight[self.pad_id].zero_()
            if self.output.bias is not None:
                self.output.bias.zero_()

    # --- the seq2seq interface ---

    def source_side(self) -> list[nn.Module]:
        parts: list[nn.Module] = [self.encoder_layers]
        for layer in self.decoder_layers:  # the encoder output's keys and values
            parts += [layer.cross_attn.k_proj, layer.cross_attn.v_proj]
        return parts

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> TransformerMemory:
        x, mask = self.encode_hidden(src, src_pad_mask)  # (B, S, d), (B, 1, 1, S)
        # Decoding needs the encoder output only as these keys and values.
        cross = [self._kept(layer.cross_attn.project_kv(x, x)) for layer in self.decoder_layers]
        return TransformerMemory(mask, cross)

    def _kept(self, kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values in cache_dtype; without a gradient to take (decoding), contiguous
        (B, h, S, d_h): each decoding step reads them, and reads the (B, h, S, d_h) view of
        the (B, S, h, d_h) projections more slowly (greedy, 1 thread, 500 sentences:
        attention 0.22 s against 0.18; attnmt.kernels.attention.step_attention). Training reads
        them once, as they are."""
        k, v = kv if self.cache_dtype is None else (t.to(self.cache_dtype) for t in kv)
        if torch.is_grad_enabled():
            return k, v
        return k.contiguous(), v.contiguous()

    def encode_packed(
        self, src: torch.Tensor, src_pad_mask: torch.Tensor, packing: Packing
    ) -> TransformerMemory:
        """encode(src, src_pad_mask) with the sentences packed one after another (packing:
        attnmt.models.packing): the products see no padding, attention stays within each
        sentence, and every position keeps its place in its sentence."""
        x = self.src_embed(packing.pack(src, self.pad_id), packing.positions)  # (P, L, d)
        block_mask = packing.mask.to(x.dtype)  # (P, 1, L, L)
        for layer in self.encoder_layers:
            x = layer(x, block_mask, packing.positions)
        x = self.enc_norm(x)  # (P, L, d)
        cross = []
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_kv(x, x)  # (P, h, L, d_h)
            cross.append(self._kept((packing.unpack(k), packing.unpack(v))))  # (B, h, S, d_h)
        mask = additive_mask(src_pad_mask, None, x.dtype)  # (B, 1, 1, S)
        assert mask is not None
        return TransformerMemory(mask, cross)

    def encode_hidden(
        self, src: torch.Tensor, src_pad_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder stack's output (B, S, d) and the additive source mask (B, 1, 1, S)."""
        x = self.src_embed(src)  # (B, S, d)
        mask = additive_mask(src_pad_mask, None, x.dtype)  # (B, 1, 1, S)
        assert mask is not None
        for layer in self.encoder_layers:
            x = layer(x, mask)
        return self.enc_norm(x), mask

    def decode_hidden(
        self, memory: TransformerMemory, tgt_in: torch.Tensor, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every position of tgt_in (B, T) at once, up to the output projection: (B, T, d),
        and the last layer's cross-attention weights if asked for."""
        x = self.tgt_embed(tgt_in)  # (B, T, d)
        weights = None
        for layer, (k, v) in zip(self.decoder_layers, memory.cross, strict=True):
            x, weights = layer(x, k, v, memory.src_mask, need_weights=need_weights)
        return self.dec_norm(x), weights

    def decode_all(
        self, memory: TransformerMemory, tgt_in: torch.Tensor, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position of tgt_in (B, T) at once: (B, T, V), last cross weights."""
        h, weights = self.decode_hidden(memory, tgt_in, need_weights)
        return self.output(h), weights  # (B, T, V)

    def init_state(self, memory: TransformerMemory) -> TransformerState:
        k = memory.cross[0][0]
        B, h, _, d_h = k.shape
        dtype = self.tgt_embed.embed.weight.dtype  # the model's, not the cache's
        zeros = k.new_zeros(B, h * d_h, dtype=dtype)  # (B, d): c_0 of an SSRU layer
        caches: list[LayerCache | RecurrentCache] = []
        for layer in self.decoder_layers:
            if layer.ssru is not None:
                caches.append(RecurrentCache(zeros))
                continue
            caches.append(Room.sized(k, B, ROOM, 0).cache(B))  # (B, h, 0, d_h)
        return TransformerState(caches, 0)

    def decode_step(
        self,
        memory: TransformerMemory,
        state: TransformerState,
        prev_tokens: torch.Tensor,
        attention: AttentionSpec | None = None,
    ) -> tuple[torch.Tensor, TransformerState, torch.Tensor | None]:
        if self.lean_step is not None and attention is None:
            return self.lean_step(memory, state, prev_tokens)
        x = self.tgt_embed(prev_tokens.unsqueeze(1), offset=state.position)  # (B, 1, d)
        self_mask = self._joined_mask(state)  # (B, 1, 1, t+1) or None
        n_layers = len(self.decoder_layers)
        want = attention.layer % n_layers if attention is not None else -1
        caches, attn = [], None
        for i, (layer, cache, (k, v)) in enumerate(
            zip(self.decoder_layers, state.caches, memory.cross, strict=True)
        ):
            x, cache, weights = layer.step(
                x, cache, k, v, memory.src_mask, need_weights=i == want, rows=state.rows,
                position=state.position, self_mask=self_mask,
            )  # fmt: skip
            caches.append(cache)
            if weights is not None:
                assert attention is not None
                w = weights.squeeze(2)  # (B, h, S)
                if attention.all_heads:
                    attn = w  # (B, h, S)
                else:
                    attn = w.mean(dim=1) if attention.head is None else w[:, attention.head]
        logits = self.output(self.dec_norm(x)).squeeze(1)  # (B, V)
        return logits, TransformerState(caches, state.position + 1), attn

    @property
    def max_cohorts(self) -> int:  # type: ignore[override]
        """The lean step shares its products among cohorts; the module path would not, nor the
        compiled step, whose one call a cohort costs more than a cohort's attention over the
        youngest's padded steps (a server's beam 5, 64 in flight: 1 cohort 84.6 sentences/s,
        2 83.1, 8 74.5; the lean step's 8 78.4; docs/log/2026-12-compiled-step.md)."""
        if self.lean_step is None or getattr(self.lean_step, "compiled", None) is not None:
            return 1
        return COHORTS

    def decode_cohorts(
        self,
        memories: list[TransformerMemory],
        states: list[TransformerState],
        prev_tokens: torch.Tensor,
        sizes: list[int],
        attention: AttentionSpec | None = None,
    ) -> tuple[torch.Tensor, list[TransformerState], torch.Tensor | None]:
        """One product per layer for all cohorts' rows; attention per cohort, over its own
        caches and source (the lean step's `cohorts`)."""
        if len(states) == 1 or self.lean_step is None or attention is not None:
            return super().decode_cohorts(memories, states, prev_tokens, sizes, attention)
        logits, new = self.lean_step.cohorts(memories, states, prev_tokens, sizes)  # type: ignore[attr-defined]
        return logits, new, None

    def select_memory(self, memory: TransformerMemory, index: torch.Tensor) -> TransformerMemory:
        return TransformerMemory(
            memory.src_mask.index_select(0, index),
            [(k.index_select(0, index), v.index_select(0, index)) for k, v in memory.cross],
        )

    def select_state(self, state: TransformerState, index: torch.Tensor) -> TransformerState:
        rows = index if state.rows is None else state.rows.index_select(0, index)
        position = state.position
        if not isinstance(position, int):
            position = position.index_select(0, index)  # (N',)
        return TransformerState(state.caches, position, rows)

    def keep_memory(self, memory: TransformerMemory, order: torch.Tensor) -> TransformerMemory:
        """Only the rows that change place are copied, within the memory's own buffers."""
        buffers = memory.buffers or memory.tensors()
        if not writable(buffers[0]):
            return self.select_memory(memory, order)
        moved = moved_rows(order)  # (M,)
        for b in buffers:
            move_rows(b, order, moved)
        kept = TransformerMemory.first_rows(buffers, order.numel())
        # The widest sources may have left: a pool that could be a quarter narrower is
        # copied as narrow as it can be (a narrower view of the same buffers would make
        # attention read strided rows at every step, slower than the unused positions).
        width = kept.used_width()
        if width > NARROWER * buffers[0].size(-1):
            return kept
        return kept.resized(order.numel() + spare_rows(order.numel()), width)

    def keep_rows(
        self, memory: TransformerMemory, state: TransformerState, order: torch.Tensor
    ) -> tuple[TransformerMemory, TransformerState]:
        """keep_memory, and the state's rows moved alike within the caches' own buffers
        (where they cannot be written: a reorder pending, buffers shared or locked,
        select_state); the caches drop the positions no row kept has: a view, no copy."""
        memory = self.keep_memory(memory, order)
        if state.rows is not None or not all(
            isinstance(c, RecurrentCache) or (c.room is not None and c.room.owns(c.self_k.size(2)))
            for c in state.caches
        ):
            return memory, self.select_state(state, order)
        n, moved = order.numel(), moved_rows(order)
        position, longest = state.position, None
        if not isinstance(position, int) and n:
            position = position.index_select(0, order)  # (N',)
            longest = int(position.max())  # each row's positions are the last position[n]
        caches: list[LayerCache | RecurrentCache] = []
        for c in state.caches:
            if isinstance(c, RecurrentCache):
                caches.append(RecurrentCache(c.c.index_select(0, order)))
                continue
            assert c.room is not None
            move_rows(c.self_k, order, moved)  # (N', h, t, d_h): rows of the buffers
            move_rows(c.self_v, order, moved)
            if longest is not None:
                c.room.start += c.self_k.size(2) - longest
            caches.append(c.room.cache(n))
        return memory, TransformerState(caches, position)

    def join_memory(self, first: TransformerMemory, second: TransformerMemory) -> TransformerMemory:
        """Second's rows are written after first's, in first's buffers where they fit (rows
        to spare, sources no wider; first is not to be used again), else both are copied into
        buffers with rows to spare. The padding is masked: each row attends as before."""
        N1, N2 = first.src_mask.size(0), second.src_mask.size(0)
        S1, S2 = first.src_mask.size(-1), second.src_mask.size(-1)
        buffers = first.buffers or first.tensors()
        if buffers[0].size(0) >= N1 + N2 and S1 >= S2 and writable(buffers[0]):
            joined = TransformerMemory.first_rows(buffers, N1 + N2)
        else:
            rows = first.resized(N1 + N2 + spare_rows(N1 + N2), max(S1, S2)).buffers
            assert rows is not None
            joined = TransformerMemory.first_rows(rows, N1 + N2)
        joined.put(N1, second)
        return joined

    def join_state(self, first: TransformerState, second: TransformerState) -> TransformerState:
        """Rows of both, each with its own position: the caches are padded at the start (the
        positions a row does not have, masked in its self-attention; _joined_mask), then cut
        to the longest row's positions. Pending row orders (select_state) are applied in the
        same copy. Newcomers that have decoded nothing join in first's buffers where they
        have rows to spare (first is not to be used again)."""
        position = torch.cat([per_row(first), per_row(second)])  # (N1 + N2,)
        if (joined := join_in_place(first, second, position)) is not None:
            return joined
        t = int(position.max())
        # Rows to spare for later newcomers, unless the next step reorders rows (beam search).
        more = first.rows is None and second.rows is None
        caches: list[LayerCache | RecurrentCache] = []
        for x, y in zip(first.caches, second.caches, strict=True):
            if isinstance(x, RecurrentCache) and isinstance(y, RecurrentCache):
                cx = x.c if first.rows is None else x.c.index_select(0, first.rows)
                cy = y.c if second.rows is None else y.c.index_select(0, second.rows)
                caches.append(RecurrentCache(torch.cat([cx, cy])))  # (N1 + N2, d)
                continue
            assert isinstance(x, LayerCache) and isinstance(y, LayerCache)
            k, k_room = stack_rows(
                [(x.self_k, first.rows), (y.self_k, second.rows)], t, True, ROOM, more
            )  # (N1 + N2, h, t, d_h)
            v, v_room = stack_rows(
                [(x.self_v, first.rows), (y.self_v, second.rows)], t, True, ROOM, more
            )  # (N1 + N2, h, t, d_h)
            caches.append(LayerCache(k, v, Room(k_room, v_room, t)))
        return TransformerState(caches, position)

    @staticmethod
    def _joined_mask(state: TransformerState) -> torch.Tensor | None:
        """Rows at their own positions (join_state): each sees the last position[n] cached
        positions and the new one, -inf before them: (N, 1, 1, t + 1); None when rows share
        one position."""
        if isinstance(state.position, int):
            return None
        cache = next((c for c in state.caches if isinstance(c, LayerCache)), None)
        if cache is None:
            return None  # SSRU layers only: no cache to mask
        t = cache.self_k.size(2)
        keys = torch.arange(t + 1, device=state.position.device)  # (t+1,)
        hidden = keys.unsqueeze(0) < (t - state.position).unsqueeze(1)  # (N, t+1)
        mask = torch.zeros(hidden.shape, dtype=cache.self_k.dtype, device=hidden.device)
        return mask.masked_fill(hidden, -torch.inf)[:, None, None, :]  # (N, 1, 1, t+1)

    def loss(
        self,
        batch: Batch,
        tf_ratio: float = 1.0,
        label_smoothing: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.encode(batch.src, batch.src_pad_mask)
        tgt_in = batch.tgt_in  # (B, T)
        if tf_ratio < 1.0:
            # Two-pass scheduled sampling (Mihaylova & Martins 2019,
            # https://arxiv.org/abs/1906.07651): a first pass on gold inputs predicts every
            # position; the second pass takes, per position, the gold token with probability
            # tf_ratio and the first pass's argmax otherwise. Both passes stay parallel.
            with torch.no_grad():
                first, _ = self.decode_all(memory, tgt_in)  # (B, T, V)
            predicted = first.argmax(dim=-1)  # (B, T): prediction for position t+1's input
            use_gold = gold_coins(tuple(tgt_in.shape), tf_ratio, generator, tgt_in.device)
            use_gold[:, 0] = True  # BOS is always given
            shifted = torch.cat([tgt_in[:, :1], predicted[:, :-1]], dim=1)  # (B, T)
            tgt_in = torch.where(use_gold, tgt_in, shifted)
        h, _ = self.decode_hidden(memory, tgt_in)  # (B, T, d)
        return linear_cross_entropy(
            h, self.output.weight, batch.tgt_out, PAD_ID, label_smoothing, bias=self.output.bias
        )
