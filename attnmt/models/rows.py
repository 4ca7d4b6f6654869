"""Rows of a running search's tensors kept in place (serve's pool, greedy search).

A pool of sentences drops finished rows and takes newcomers' rows at many steps. Gathering
every tensor into a new one each time copies every row that stays; these helpers copy only
the rows that change place, into the tensors' own storage:

- a pool dropping finished rows keeps the first N' rows where they are and moves the last
  rows still decoding into the finished ones' places (`kept_order`, `move_rows`);
- tensors get rows to spare (`spare_rows`), so that newcomers are written after the rows
  already there (`put_rows`) until they are used up.

torch does not let a tensor made under torch.inference_mode be written outside it
(`writable`): such a tensor is copied instead.
"""

from __future__ import annotations

import torch


def spare_rows(n: int) -> int:
    """Rows allocated beyond n, for sentences that join later: a quarter more, at least 8."""
    return max(8, n // 4)


def writable(x: torch.Tensor) -> bool:
    """Whether torch lets x be written in place here (an inference-mode tensor only inside
    inference mode)."""
    return not x.is_inference() or torch.is_inference_mode_enabled()


def kept_order(live: torch.Tensor) -> torch.Tensor:
    """The rows to keep when the rows not `live` (N,) bool leave: (N',) with order[i] == i
    for a live row among the first N', the others' places taken by the live rows after
    them, in order."""
    n = int(live.sum())
    order = torch.arange(n, device=live.device)  # (N',)
    holes = (~live[:n]).nonzero().squeeze(1)  # finished rows among the first N'
    order[holes] = live[n:].nonzero().squeeze(1) + n  # as many live rows after them
    return order


def moved_rows(order: torch.Tensor) -> torch.Tensor:
    """The places i where order[i] != i: the rows move_rows copies, (M,)."""
    return (order != torch.arange(order.numel(), device=order.device)).nonzero().squeeze(1)


def move_rows(x: torch.Tensor, order: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, order) in x's own first rows, copying only the rows `moved`
    (moved_rows(order)): x itself changes, and the result is its first order.numel() rows.
    x may be a view (a cache's first positions): the rows of what it views change."""
    if moved.numel():
        x.index_copy_(0, moved, x.index_select(0, order[moved]))
    return x[: order.numel()]


def put_rows(buffer: torch.Tensor, at: int, x: torch.Tensor, dim: int, fill: float) -> None:
    """Write x's rows into buffer's rows at.. (both (., ..., width, ...), the width in `dim`),
    x's positions first (as many as the buffer is wide) and `fill` in the buffer's past x's."""
    width = min(x.size(dim), buffer.size(dim))
    rows = buffer[at : at + x.size(0)]
    rows.narrow(dim, 0, width).copy_(x.narrow(dim, 0, width))
    rows.narrow(dim, width, buffer.size(dim) - width).fill_(fill)
