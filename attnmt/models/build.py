"""build_model: the architecture a config names, with freshly initialised weights."""

from __future__ import annotations

from attnmt.config import ModelConfig
from attnmt.models.rnn import RNNSeq2Seq
from attnmt.models.seq2seq import Seq2Seq
from attnmt.models.transformer import TransformerSeq2Seq


def build_model(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint: bool) -> Seq2Seq:
    """Build the architecture named by cfg.arch (rnn or transformer)."""
    if cfg.arch == "rnn":
        return RNNSeq2Seq(cfg, src_vocab, tgt_vocab, joint)
    return TransformerSeq2Seq(cfg, src_vocab, tgt_vocab, joint)
