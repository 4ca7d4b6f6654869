"""Helpers shared by the model tests: tiny models and a random batch."""

from __future__ import annotations

import torch

from attnmt.config import ModelConfig
from attnmt.data import Batch, collate
from attnmt.model import build_model
from attnmt.seq2seq import Seq2Seq
from attnmt.tokenizer import BOS_ID, EOS_ID, PAD_ID

V = 23


def tiny_model(arch: str, seed: int = 0, **overrides) -> Seq2Seq:
    torch.manual_seed(seed)
    settings = {
        "emb_size": 12,
        "hidden_size": 16,
        "heads": 2,
        "ff_size": 24,
        "enc_layers": 2,
        "dec_layers": 2,
        "dropout": 0.0,
        "attention_dropout": 0.0,
    }
    cfg = ModelConfig(arch=arch, **{**settings, **overrides})
    return build_model(cfg, V, V, joint=True)


def random_batch(seed: int = 0, B: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    src, tgt = [], []
    for _ in range(B):
        n = int(torch.randint(1, 7, (1,), generator=g))
        m = int(torch.randint(1, 7, (1,), generator=g))
        src.append(torch.randint(4, V, (n,), generator=g).tolist())
        tgt.append(torch.randint(4, V, (m,), generator=g).tolist())
    return collate(src, tgt, list(range(B)), PAD_ID, BOS_ID, EOS_ID)


def stepwise_logits(model: Seq2Seq, batch: Batch, inputs: torch.Tensor) -> torch.Tensor:
    """Logits from feeding `inputs` (B, T) one position at a time through decode_step."""
    memory = model.encode(batch.src, batch.src_pad_mask)
    state = model.init_state(memory)
    out = []
    for t in range(inputs.size(1)):
        logits, state, _ = model.decode_step(memory, state, inputs[:, t])
        out.append(logits)
    return torch.stack(out, dim=1)  # (B, T, V)
