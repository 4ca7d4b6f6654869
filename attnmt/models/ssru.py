"""The simpler simple recurrent unit (SSRU), a Transformer decoder's self-attention replaced by
a recurrence (Kim et al. 2019, "From Research to Production and Back: Ludicrously Fast Neural
Machine Translation", https://aclanthology.org/D19-5632, sec. 3; Marian's `ssru` cell, the
decoder of Firefox's translation models):

    f_t = σ(W_f x_t + b_f)                  forget gate
    c_t = f_t ⊙ c_{t−1} + (1 − f_t) ⊙ W x_t   c_0 = 0
    o_t = ReLU(c_t)

A decoding step keeps one vector per layer (c_t) instead of every position's keys and values.
Training runs the recurrence over all positions at once: c_t = Σ_{k≤t} (Π_{k<j≤t} f_j) u_k with
u_k = (1 − f_k) ⊙ W x_k, a linear recurrence that prefix sums solve, here in log space (a
log-cumulative-sum-exp per sign of u, in float64) so that no product of gates underflows.
"""

from __future__ import annotations

import torch
from torch import nn

from attnmt.kernels import Linear

# log of "nothing" in the log-space sums: far below any real term, finite so that gradients are.
NOTHING = -1.0e4


class SSRU(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.w = Linear(d_model, d_model, bias=False)  # W
        self.w_f = Linear(d_model, d_model)  # W_f, b_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """All positions at once (training): x (B, T, d) -> o (B, T, d). Right padding needs
        no mask: a position's output depends on the positions before it only."""
        gate = self.w_f(x).double()  # (B, T, d)
        log_f = nn.functional.logsigmoid(gate)  # log f_t
        u = torch.sigmoid(-gate) * self.w(x).double()  # (1 - f_t) ⊙ W x_t
        A = torch.cumsum(log_f, dim=1)  # (B, T, d): log Π_{j≤t} f_j
        magnitude = u.abs().clamp(min=1e-300).log() - A  # log |u_k| - log Π_{j≤k} f_j
        c = torch.zeros_like(u)
        for sign in (1.0, -1.0):  # c = Σ over the positive u_k minus Σ over the negative ones
            terms = torch.where(sign * u > 0, magnitude, NOTHING)
            c = c + sign * torch.exp(A + torch.logcumsumexp(terms, dim=1))
        return torch.relu(c).to(x.dtype)

    def step(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position (decoding): x (N, 1, d), c_{t−1} (N, d) -> o_t (N, 1, d), c_t (N, d)."""
        f = torch.sigmoid(self.w_f(x[:, 0]))  # (N, d)
        c = f * c + (1 - f) * self.w(x[:, 0])
        return torch.relu(c).unsqueeze(1), c
