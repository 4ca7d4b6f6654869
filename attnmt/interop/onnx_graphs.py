"""A model as two graphs that an ONNX runtime can run: the encoder, and one decoder step whose
state is explicit input and output.

    encoder:  src (B, S) int64                      -> memory tensors, initial state tensors
    decoder:  tokens (N,), [position (N,)], [rows (V',)], memory, state
              -> log_probs (N, V) (or (N, V') over the shortlist's rows), new state

Every memory and state tensor has its batch on axis 0, so a runtime keeps, drops, repeats or
reorders rows (beams) with one gather on that axis and needs no knowledge of the architecture.
The decoder's memory has as many rows as its state (a runtime repeats a sentence's memory for
its beams). State that starts empty is made by the runtime from `StateSpec`: a Transformer's
self-attention cache (N, h, 0, d_h), an SSRU layer's c_0 = 0 (N, d); the GRU decoder's first
state comes from the encoder (s_0 = tanh(W_s h_1^backward ...), models.rnn.init_state).

The graphs call the models' own methods (encode, init_state, DecoderLayer.step,
decode_step); only the embedding of a Transformer's new token is written here, with a
gather from the position table (`Embeddings.forward` grows its table on demand, a branch a
graph cannot hold; the table kept covers `MAX_POSITIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.data.tokenizer import PAD_ID
from attnmt.models.decoding_state import LayerCache, RecurrentCache
from attnmt.models.rnn import RNNMemory, RNNSeq2Seq
from attnmt.models.seq2seq import Seq2Seq
from attnmt.models.transformer import TransformerSeq2Seq, sinusoid_table

MAX_POSITIONS = 512  # target positions a Transformer decoder graph can embed


@dataclass(frozen=True)
class StateSpec:
    """One decoder state tensor: its name, and how it starts. init "empty": zeros of shape
    (N, *shape) (a 0 in shape: a cache with no position yet), "encoder": the encoder's output
    of the same name."""

    name: str
    init: Literal["empty", "encoder"]
    shape: tuple[int, ...] = ()


@dataclass
class Graphs:
    encoder: nn.Module
    decoder: nn.Module
    memory: list[str]  # encoder outputs that every decoder step reads
    state: list[StateSpec]
    position: bool  # the decoder takes each row's target position (a Transformer)
    shortlist: bool = False  # the decoder takes the target ids it may output (rows)


def model_graphs(model: Seq2Seq, shortlist: bool = False) -> Graphs:
    """The encoder and decoder-step graphs of a Transformer (pre- or post-norm, attention or
    SSRU decoder, sinusoid or rotary positions; `shortlist`: its decoder over given output
    ids) or of the GRU model."""
    if isinstance(model, TransformerSeq2Seq):
        return _transformer_graphs(model, shortlist)
    if isinstance(model, RNNSeq2Seq):
        return _rnn_graphs(model)
    raise TypeError(f"no ONNX graphs for {type(model).__name__}")


def _transformer_graphs(net: TransformerSeq2Seq, shortlist: bool) -> Graphs:
    memory = ["src_mask"]
    state: list[StateSpec] = []
    for i, layer in enumerate(net.decoder_layers):
        memory += [f"cross_k_{i}", f"cross_v_{i}"]
        attn = layer.cross_attn
        if layer.ssru is not None:
            state.append(StateSpec(f"ssru_c_{i}", "empty", (attn.embed_dim,)))
        else:
            shape = (attn.num_heads, 0, attn.head_dim)
            state += [
                StateSpec(f"self_k_{i}", "empty", shape),
                StateSpec(f"self_v_{i}", "empty", shape),
            ]
    step = ShortlistDecoderStep(net) if shortlist else TransformerDecoderStep(net)
    return Graphs(TransformerEncoder(net), step, memory, state, True, shortlist)


class TransformerEncoder(nn.Module):
    def __init__(self, net: TransformerSeq2Seq) -> None:
        super().__init__()
        self.net = net

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """src (B, S) -> src_mask (B, 1, 1, S), then per decoder layer the cross-attention
        keys and values (B, h, S, d_h)."""
        memory = self.net.encode(src, src == PAD_ID)
        return (memory.src_mask, *(t for kv in memory.cross for t in kv))


class TransformerDecoderStep(nn.Module):
    def __init__(self, net: TransformerSeq2Seq) -> None:
        super().__init__()
        self.net = net
        emb = net.tgt_embed
        width = 0 if emb.layout == "rope" else emb.embed.embedding_dim
        table = sinusoid_table(MAX_POSITIONS, width, layout=emb.layout) if width else None
        self.register_buffer("pe", table, persistent=False)

    def forward(
        self, tokens: torch.Tensor, position: torch.Tensor, src_mask: torch.Tensor, *tensors
    ) -> tuple[torch.Tensor, ...]:
        """tokens (N,), position (N,) -> log_probs (N, V) and the grown state. `tensors`: per
        layer cross keys, values (N, h, S, d_h), then the state in StateSpec order."""
        h, new = self.hidden(tokens, position, src_mask, tensors)
        logits = self.net.output(h)  # (N, V)
        return (torch.log_softmax(logits.float(), dim=-1), *new)

    def hidden(
        self, tokens: torch.Tensor, position: torch.Tensor, src_mask: torch.Tensor, tensors: tuple
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder stack's output (N, d) for the new tokens, and the grown state."""
        layers = self.net.decoder_layers
        cross = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(layers))]
        rest = list(tensors[2 * len(layers) :])
        emb = self.net.tgt_embed
        x = emb.embed(tokens) * emb.scale  # (N, d)
        if self.pe is not None:
            x = x + self.pe[position]  # (N, d): PE(pos) (sec. 3.5)
        x = x.unsqueeze(1)  # (N, 1, d)
        new: list[torch.Tensor] = []
        for layer, (k, v) in zip(layers, cross, strict=True):
            if layer.ssru is not None:
                cache: LayerCache | RecurrentCache = RecurrentCache(rest.pop(0))
            else:
                cache = LayerCache(rest.pop(0), rest.pop(0))
            x, cache, _ = layer.step(x, cache, k, v, src_mask, position=position)
            new += [cache.c] if isinstance(cache, RecurrentCache) else [cache.self_k, cache.self_v]
        return self.net.dec_norm(x).squeeze(1), new


class ShortlistDecoderStep(TransformerDecoderStep):
    """The decoder step over a lexical shortlist: the output layer and its softmax only over
    the target ids `rows` (decoding.shortlist; a runtime chooses them per batch)."""

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        position: torch.Tensor,
        rows: torch.Tensor,
        src_mask: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """As TransformerDecoderStep, with rows (V',): log_probs (N, V') over those ids."""
        h, new = self.hidden(tokens, position, src_mask, tensors)
        out = self.net.output
        bias = None if out.bias is None else out.bias.index_select(0, rows)
        logits = F.linear(h, out.weight.index_select(0, rows), bias)  # (N, V')
        return (torch.log_softmax(logits.float(), dim=-1), *new)


def _rnn_graphs(net: RNNSeq2Seq) -> Graphs:
    L, D = net.dec_layers, net.rnn.hidden_size
    state = [StateSpec("hidden", "encoder", (L, D))]
    return Graphs(
        RNNEncoder(net), RNNDecoderStep(net), ["enc_out", "proj_keys", "pad_mask"], state, False
    )


class RNNEncoder(nn.Module):
    """The GRU model's encoder. Its bidirectional GRU runs over packed sentences (the backward
    direction starts at each sentence's last real token), which a graph cannot hold: here each
    direction is a GRU of its own over padded rows, the backward one over each row reversed
    within its length, then turned back: the same states at every real token."""

    def __init__(self, net: RNNSeq2Seq) -> None:
        super().__init__()
        self.net = net
        gru = net.encoder.rnn
        self.directions = nn.ModuleList(
            nn.ModuleList(_one_direction(gru, layer, suffix) for suffix in ("", "_reverse"))
            for layer in range(gru.num_layers)
        )

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """src (B, S) -> encoder states (B, S, 2H), attention keys (B, S, A), padding (B, S)
        bool, and the decoder's first state (B, L, D)."""
        pad_mask = src == PAD_ID  # (B, S)
        lengths = (~pad_mask).sum(dim=1)  # (B,)
        x = self.net.encoder.embed(src)  # (B, S, E)
        keep = (~pad_mask).unsqueeze(2).to(x.dtype)  # (B, S, 1)
        for forward, backward in self.directions:
            fwd = forward(x)[0]  # (B, S, H)
            bwd = reverse_within(backward(reverse_within(x, lengths))[0], lengths)  # (B, S, H)
            x = torch.cat([fwd, bwd], dim=-1) * keep  # (B, S, 2H), 0 at padding as packed
        last = (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, fwd.size(2))  # (B, 1, H)
        final = torch.cat([fwd.gather(1, last).squeeze(1), bwd[:, 0]], dim=-1)  # (B, 2H)
        memory = RNNMemory(x, self.net.attention.project_keys(x), pad_mask, final)
        s0 = self.net.init_state(memory)  # (L, B, D)
        return memory.enc_out, memory.proj_keys, memory.pad_mask, s0.transpose(0, 1)


def _one_direction(gru: nn.GRU, layer: int, suffix: str) -> nn.GRU:
    """One direction of one layer of a bidirectional GRU, as a GRU of its own."""
    one = nn.GRU(
        gru.input_size if layer == 0 else 2 * gru.hidden_size, gru.hidden_size, batch_first=True
    )
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(one, f"{name}_l0").data = getattr(gru, f"{name}_l{layer}{suffix}").detach()
    return one


def reverse_within(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's first lengths[b] positions in reverse order, the padding after them left
    where it is: x (B, S, d), lengths (B,) -> (B, S, d)."""
    S = x.size(1)
    at = torch.arange(S, device=x.device)  # (S,)
    back = lengths[:, None] - 1 - at  # (B, S)
    index = torch.where(back >= 0, back, at)  # (B, S)
    return x.gather(1, index[:, :, None].expand(-1, -1, x.size(2)))


class RNNDecoderStep(nn.Module):
    def __init__(self, net: RNNSeq2Seq) -> None:
        super().__init__()
        self.net = net

    def forward(
        self,
        tokens: torch.Tensor,
        enc_out: torch.Tensor,
        proj_keys: torch.Tensor,
        pad_mask: torch.Tensor,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (N,), memory of N rows, hidden (N, L, D) -> log_probs (N, V), hidden."""
        # decode_step does not read `final` (the encoder summary that made s_0).
        memory = RNNMemory(enc_out, proj_keys, pad_mask, final=enc_out[:, 0])
        state = hidden.transpose(0, 1).contiguous()  # (L, N, D)
        logits, state, _ = self.net.decode_step(memory, state, tokens)  # (N, V)
        return torch.log_softmax(logits.float(), dim=-1), state.transpose(0, 1)
