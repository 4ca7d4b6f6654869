"""Bidirectional GRU encoder and attentional GRU decoder (Bahdanau et al. 2015).

Decoder step t (https://arxiv.org/abs/1409.0473, appendix A):
    c_t = Attention(s_{t-1}, encoder states)            context from the previous state
    s_t = GRU([E y_{t-1}; c_t], s_{t-1})                 new state
    o_t = tanh(W_o [s_t; c_t; E y_{t-1}])                pre-output, emb_size wide
    p(y_t) = softmax(W_out o_t)                          W_out may be tied to E
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnmt.config import ModelConfig
from attnmt.data.batches import Batch
from attnmt.data.tokenizer import PAD_ID
from attnmt.kernels import (
    Dropout,
    Linear,
    ScheduledSampling,
    bigru_recurrence,
    gru_attention_recurrence,
    linear_cross_entropy,
)
from attnmt.models.attention import AdditiveAttention, DotAttention, SourceAttention
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq, gold_coins, pad_to


@dataclass
class RNNMemory:
    enc_out: torch.Tensor  # (B, S, 2H) encoder states (attention values)
    proj_keys: torch.Tensor  # (B, S, A) attention keys, projected once per sentence
    pad_mask: torch.Tensor  # (B, S) bool, True at padding
    final: torch.Tensor  # (B, 2H) last forward state ++ first backward state


class GRUEncoder(nn.Module):
    """Embedding -> dropout -> bidirectional multi-layer GRU over packed sequences."""

    def __init__(self, embed: nn.Embedding, hidden_size: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = embed
        self.dropout = Dropout(dropout)
        self.rnn = nn.GRU(
            embed.embedding_dim,
            hidden_size,
            num_layers=layers,
            batch_first=True,
            bidirectional=True,
            dropout=dropout if layers > 1 else 0.0,
        )

    def forward(
        self, src: torch.Tensor, src_pad_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) -> states (B, S, 2H) and final summary (B, 2H): torch.nn.GRU over packed
        sequences, or where it applies (see attnmt.kernels) the same recurrence fused."""
        x = self.dropout(self.embed(src))  # (B, S, E)
        fused = bigru_recurrence(x, ~src_pad_mask, self.rnn.all_weights)
        if fused is not None:
            return fused  # (B, S, 2H), (B, 2H)
        lengths = (~src_pad_mask).sum(dim=1).cpu()  # (B,)
        # Packing keeps padding out of the recurrence, so the backward direction starts at
        # each sentence's last real token.
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h_n = self.rnn(packed)  # h_n: (layers * 2, B, H)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))  # (B, S, 2H)
        final = torch.cat([h_n[-2], h_n[-1]], dim=-1)  # (B, 2H)
        return out, final


class RNNSeq2Seq(Seq2Seq):
    """GRU encoder-decoder with Bahdanau (additive) or scaled dot-product attention."""

    def __init__(self, cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint: bool) -> None:
        super().__init__()
        E, H = cfg.emb_size, cfg.hidden_size
        D = 2 * H  # decoder width = encoder output width
        self.dec_layers = cfg.dec_layers
        self.tgt_embed = nn.Embedding(tgt_vocab, E, padding_idx=self.pad_id)
        share_src = joint and cfg.tie_embeddings
        src_embed = self.tgt_embed if share_src else nn.Embedding(src_vocab, E, self.pad_id)
        self.encoder = GRUEncoder(src_embed, H, cfg.enc_layers, cfg.dropout)
        self.bridge = Linear(D, D)
        if cfg.attention == "bahdanau":
            self.attention: SourceAttention = AdditiveAttention(D, D, D)
        else:
            self.attention = DotAttention(D, D)
        self.rnn = nn.GRU(
            E + D,
            D,
            num_layers=cfg.dec_layers,
            batch_first=True,
            dropout=cfg.dropout if cfg.dec_layers > 1 else 0.0,
        )
        self.pre_output = Linear(D + D + E, E)
        self.dropout = Dropout(cfg.dropout)
        self.output = Linear(E, tgt_vocab, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.output.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if "embed" in name:
                # N(0, E^-1/2), not Xavier: Xavier's bound shrinks with the vocabulary (±0.027
                # for 8k words), and inputs that small leave the GRUs nearly blind to the
                # source for the first epochs (a long loss plateau on Multi30k).
                nn.init.normal_(p, mean=0.0, std=p.size(1) ** -0.5)
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif "bias" in name:
                nn.init.zeros_(p)
        with torch.no_grad():
            self.tgt_embed.weight[self.pad_id].zero_()
            self.encoder.embed.weight[self.pad_id].zero_()

    # --- the seq2seq interface ---

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> RNNMemory:
        enc_out, final = self.encoder(src, src_pad_mask)  # (B, S, 2H), (B, 2H)
        proj_keys = self.attention.project_keys(enc_out)  # (B, S, A)
        return RNNMemory(enc_out, proj_keys, src_pad_mask, final)

    def init_state(self, memory: RNNMemory) -> torch.Tensor:
        s0 = torch.tanh(self.bridge(memory.final))  # (B, D)
        return s0.unsqueeze(0).repeat(self.dec_layers, 1, 1).contiguous()  # (L, B, D)

    def _recur(
        self, memory: RNNMemory, hidden: torch.Tensor, emb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The recurrent half of a step, from an embedded previous token emb (B, E): the GRU
        output s_t (B, D), the context c_t (B, D), the new state (L, B, D) and the attention
        weights (B, S)."""
        context, weights = self.attention(
            hidden[-1], memory.proj_keys, memory.enc_out, memory.pad_mask
        )  # (B, D), (B, S)
        rnn_in = torch.cat([emb, context], dim=-1).unsqueeze(1)  # (B, 1, E + D)
        out, hidden = self.rnn(rnn_in, hidden)  # (B, 1, D), (L, B, D)
        return out.squeeze(1), context, hidden, weights

    def _pre_output(
        self,
        out: torch.Tensor,
        context: torch.Tensor,
        emb: torch.Tensor,
        dropout_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_t = dropout(tanh(W_o [s_t; c_t; E y_{t-1}])) for any leading shape (..., E), with
        a given dropout_scale (Dropout.scale) or a fresh mask.

        Nothing feeds back from o_t into the recurrence, so training computes it for all
        positions at once after the loop (one large matmul instead of one small one per step).
        """
        o = torch.tanh(self.pre_output(torch.cat([out, context, emb], dim=-1)))
        return o * dropout_scale if dropout_scale is not None else self.dropout(o)

    def teacher_forced(
        self, memory: RNNMemory, hidden: torch.Tensor, embs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence over gold inputs embs (B, T, E) from state hidden (L, B, D): the GRU
        outputs and the contexts, (B, T, D) each. The usual setup (one GRU layer, Bahdanau
        attention) runs as one fused function (attnmt.kernels); others step through autograd.
        """
        fused = gru_attention_recurrence(
            embs, hidden[0], memory.proj_keys, memory.enc_out, memory.pad_mask,
            self.attention.additive_weights(), self.rnn.all_weights,
        )  # fmt: skip
        if fused is not None:
            outs, contexts, _ = fused  # (T, B, D) each
            return outs.transpose(0, 1), contexts.transpose(0, 1)
        outs, contexts = [], []
        # unbind, not embs[:, t]: the backward of T slices would zero-fill T tensors of embs's
        # full size and add them up; unbind's backward stacks the T gradients once.
        for emb in embs.unbind(dim=1):
            out, context, hidden, _ = self._recur(memory, hidden, emb)
            outs.append(out)
            contexts.append(context)
        return torch.stack(outs, dim=1), torch.stack(contexts, dim=1)

    def decode_step(
        self,
        memory: RNNMemory,
        state: torch.Tensor,
        prev_tokens: torch.Tensor,
        attention: AttentionSpec | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        emb = self.dropout(self.tgt_embed(prev_tokens))  # (B, E)
        out, context, state, weights = self._recur(memory, state, emb)
        pre = self._pre_output(out, context, emb)  # (B, E)
        return self.output(pre), state, weights if attention is not None else None  # (B, V)

    def select_memory(self, memory: RNNMemory, index: torch.Tensor) -> RNNMemory:
        return RNNMemory(
            memory.enc_out.index_select(0, index),
            memory.proj_keys.index_select(0, index),
            memory.pad_mask.index_select(0, index),
            memory.final.index_select(0, index),
        )

    def select_state(self, state: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return state.index_select(1, index)  # (L, B', D)

    def join_memory(self, first: RNNMemory, second: RNNMemory) -> RNNMemory:
        S = max(first.enc_out.size(1), second.enc_out.size(1))
        return RNNMemory(
            torch.cat([pad_to(first.enc_out, 1, S, 0.0), pad_to(second.enc_out, 1, S, 0.0)]),
            torch.cat([pad_to(first.proj_keys, 1, S, 0.0), pad_to(second.proj_keys, 1, S, 0.0)]),
            torch.cat([pad_to(first.pad_mask, 1, S, True), pad_to(second.pad_mask, 1, S, True)]),
            torch.cat([first.final, second.final]),
        )  # (B1 + B2, S, ...): padding is masked, so each row attends as before

    def join_state(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return torch.cat([first, second], dim=1)  # (L, N1 + N2, D): no positions to keep

    def loss(
        self,
        batch: Batch,
        tf_ratio: float = 1.0,
        label_smoothing: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.encode(batch.src, batch.src_pad_mask)
        hidden = self.init_state(memory)
        if tf_ratio < 1.0:
            use_gold = gold_coins(tuple(batch.tgt_in.shape), tf_ratio, generator, batch.src.device)
            h = self.scheduled_sampling(memory, hidden, batch.tgt_in, use_gold)  # (B, T, E)
        else:  # All inputs known: embed them at once, run the recurrence, project once.
            embs = self.dropout(self.tgt_embed(batch.tgt_in))  # (B, T, E)
            outs, contexts = self.teacher_forced(memory, hidden, embs)  # (B, T, D) each
            h = self._pre_output(outs, contexts, embs)  # (B, T, E)
        return linear_cross_entropy(h, self.output.weight, batch.tgt_out, PAD_ID, label_smoothing)

    def scheduled_sampling(
        self,
        memory: RNNMemory,
        hidden: torch.Tensor,
        gold: torch.Tensor,
        use_gold: torch.Tensor,
    ) -> torch.Tensor:
        """Scheduled sampling (Bengio et al. 2015, https://arxiv.org/abs/1506.03099): input
        t > 0 is the gold token where use_gold[:, t], else the argmax of step t-1's logits (the
        ones the loss scores, same dropout). No gradient flows through the choice. Returns the
        pre-outputs o_1..o_T (B, T, E); gold, use_gold (B, T).
        """
        shape = (*gold.shape, self.tgt_embed.embedding_dim)
        emb_scale, pre_scale = self.dropout.scale(shape, hidden), self.dropout.scale(shape, hidden)
        gold_embs = self.tgt_embed(gold)  # (B, T, E)
        if emb_scale is not None:
            gold_embs = gold_embs * emb_scale
        sampling = ScheduledSampling(
            gold, use_gold, emb_scale, pre_scale, self.tgt_embed.weight, self.pre_output.weight,
            self.pre_output.bias, self.output.weight, self.pad_id,
        )  # fmt: skip
        fused = gru_attention_recurrence(
            gold_embs, hidden[0], memory.proj_keys, memory.enc_out, memory.pad_mask,
            self.attention.additive_weights(), self.rnn.all_weights, sampling,
        )  # fmt: skip
        if fused is not None:
            outs, contexts, inputs = fused  # (T, B, D), (T, B, D), (B, T)
            assert inputs is not None
            embs = self.tgt_embed(inputs)  # (B, T, E)
            embs = embs * emb_scale if emb_scale is not None else embs
            return self._pre_output(outs.transpose(0, 1), contexts.transpose(0, 1), embs, pre_scale)
        pres, emb = [], gold_embs[:, 0]  # (B, E)
        for t in range(gold.size(1)):
            out, context, hidden, _ = self._recur(memory, hidden, emb)  # (B, D) ...
            scale = None if pre_scale is None else pre_scale[:, t]
            pres.append(self._pre_output(out, context, emb, scale))  # (B, E)
            if t + 1 < gold.size(1):
                with torch.no_grad():
                    predicted = self.output(pres[-1]).argmax(dim=-1)  # (B,)
                emb = torch.where(
                    use_gold[:, t + 1, None], gold_embs[:, t + 1], self.tgt_embed(predicted)
                    * (emb_scale[:, t + 1] if emb_scale is not None else 1.0),
                )  # fmt: skip
        return torch.stack(pres, dim=1)
