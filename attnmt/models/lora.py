"""LoRA adapters (Hu et al. 2021, https://arxiv.org/abs/2106.09685): fine-tune a model by
training, beside each adapted projection's frozen weight W (out, in), a low-rank update

    h = W x + b + (α / r) B A x,    A (r, in), B (out, r),    eq. 3

for the attention projections (as the paper) and, where asked, the feed-forward layers
(which a far domain needs: docs/benchmarks.md, "Quality", fine-tuning).
A starts random and B at zero, so the adapted model starts as its base (sec. 4.1). Only A and
B train, a few MB where the model has hundreds; a model directory of adapters keeps them
alone and names its base (models.directory), and decoding merges them into W once:
W' = W + (α / r) B A, the same function at the base model's speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnmt.config import AdapterConfig
from attnmt.errors import ConfigError
from attnmt.kernels import Linear
from attnmt.kernels.matmul import linear
from attnmt.models.attention import MultiHeadAttention
from attnmt.models.transformer import FeedForward

# train.adapters.targets: the attention projections and the feed-forward block's two layers.
PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
FEED_FORWARD = {"ff1": "w_1", "ff2": "w_2"}


class LoRALinear(Linear):
    """A Linear whose weight and bias are its base's (frozen, the same parameters and state
    names) plus a trained low-rank update `lora_a`, `lora_b` (module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear's weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        update = F.linear(F.linear(x, self.lora_a), self.lora_b)  # (..., out): B A x
        return linear(x, self.weight, self.bias) + self.scale * update

    def merged(self) -> Linear:
        """A plain Linear computing the same function: W + (α / r) B A."""
        out = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        out.to(self.weight.device, self.weight.dtype)
        with torch.no_grad():
            delta = self.scale * (self.lora_b.float() @ self.lora_a.float())  # (out, in)
            out.weight.copy_(self.weight.float() + delta)
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out


def attach_adapters(model: nn.Module, cfg: AdapterConfig) -> int:
    """Freeze every parameter of `model` and give the layers that cfg.targets names (q, k, v,
    o of every self- and cross-attention; ff1, ff2 of every feed-forward block) a LoRA
    adapter; returns how many."""
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for module in list(model.modules()):
        if isinstance(module, MultiHeadAttention):
            names = PROJECTIONS
        elif isinstance(module, FeedForward):
            names = FEED_FORWARD
        else:
            continue
        for target in cfg.targets:
            if target in names:
                layer = getattr(module, names[target])
                check_rank(cfg.rank, target, layer)
                setattr(module, names[target], LoRALinear(layer, cfg.rank, cfg.alpha))
                count += 1
    return count


def check_rank(rank: int, target: str, layer: nn.Linear) -> None:
    """Refuse an adapter with as many parameters as the weight it adapts (rank x (in + out)
    >= in x out): it is no longer low-rank, only larger (a rank of 4,096 on a d64 model)."""
    n_in, n_out = layer.in_features, layer.out_features
    if rank * (n_in + n_out) >= n_in * n_out:
        most = (n_in * n_out - 1) // (n_in + n_out)
        raise ConfigError(
            f"train.adapters.rank {rank}: an adapter of {target} ({n_out} x {n_in}) would have "
            f"{rank * (n_in + n_out):,} parameters, no fewer than the {n_in * n_out:,} of the "
            f"weight it adapts; at most {most} for this model"
        )


def has_adapters(model: nn.Module) -> bool:
    """Whether any module of `model` is a LoRALinear."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def is_adapter_weight(name: str) -> bool:
    """Whether a state-dict name is an adapter's (what an adapter directory stores)."""
    return name.endswith((".lora_a", ".lora_b"))


def merge_adapters(model: nn.Module) -> None:
    """In place: every LoRALinear becomes the plain Linear it computes (for decoding)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
