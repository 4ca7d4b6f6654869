"""The Transformer's decoding state (attnmt.models.transformer): the source side each step
reads (TransformerMemory: the encoder output as cross-attention keys and values) and what the
steps so far left (TransformerState: each layer's self-attention cache, or an SSRU's c_t).

Decoding appends one position to every cache per step (append_position), into room kept
past the cached positions (Room); serve's pool joins newcomers into rows kept to spare and
drops finished rows by moving the last ones into their places (attnmt.models.rows), so that
neither copies the rows that stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnmt.models.rows import put_rows, spare_rows, writable

# Positions a decoding cache has room for past those it holds (Room): the next ones are
# written in place, where torch.cat would copy the whole cache at every step.
ROOM = 16


@dataclass
class Room:
    """Buffers (C, h, capacity, d_h) whose first N rows (N <= C: rows to spare for sentences
    that join a running search, join_state) and positions start..filled-1 hold a cache's keys
    and values (start > 0 once the positions before it are no row's: keep_rows). The next
    position is written in place once: a second step from the same cache finds `filled` moved
    on and copies (append_position)."""

    k: torch.Tensor
    v: torch.Tensor
    filled: int
    start: int = 0

    def cache(self, rows: int) -> LayerCache:
        """The cache these buffers hold, of its first `rows` rows."""
        at = slice(self.start, self.filled)
        return LayerCache(self.k[:rows, :, at], self.v[:rows, :, at], self)

    @classmethod
    def sized(cls, like: torch.Tensor, rows: int, capacity: int, filled: int) -> Room:
        """Empty buffers (rows, h, capacity, d_h) shaped as `like` (., h, ., d_h)."""
        h, d = like.size(1), like.size(3)
        return cls(
            like.new_empty(rows, h, capacity, d), like.new_empty(rows, h, capacity, d), filled
        )

    def owns(self, t: int) -> bool:
        """Whether the cache holding t positions may be changed in place: it is the last one
        written here, and torch allows the write (buffers made under torch.inference_mode
        cannot be written outside it)."""
        return self.filled == self.start + t and writable(self.k)

    def takes(self, t: int) -> bool:
        """Whether the cache holding t positions can take the next in place: owns(t), and
        there is room past it."""
        return self.owns(t) and self.k.size(2) > self.filled


@dataclass
class LayerCache:
    self_k: torch.Tensor  # (B, h, t, d_h) keys of the positions decoded so far
    self_v: torch.Tensor  # (B, h, t, d_h)
    room: Room | None = None  # the buffers self_k and self_v begin (decoding), or None


def stack_rows(
    parts: list[tuple[torch.Tensor, torch.Tensor | None]],
    size: int,
    left: bool,
    spare: int = 0,
    more_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of each part (x (N_i, h, L_i, d), at `rows` (M_i,) or all, in order), one
    part after another, as `size` positions each: a part's last `size` (left) or first ones,
    zeros where it has fewer -> (sum M_i, h, size, d), and the buffer it begins, with `spare`
    positions more (and spare_rows more rows: more_rows). One copy of each part, where cat
    after index_select and padding would make three (joining a running search's caches)."""
    x0 = parts[0][0]
    n = sum(x.size(0) if rows is None else rows.numel() for x, rows in parts)
    capacity = n + spare_rows(n) if more_rows else n
    buffer = x0.new_empty(capacity, x0.size(1), size + spare, x0.size(3))
    out = buffer[:n, :, :size]
    at = 0
    for x, rows in parts:
        m, L = x.size(0) if rows is None else rows.numel(), min(size, x.size(2))
        src = x[:, :, x.size(2) - L :] if left else x[:, :, :L]
        dst = out[at : at + m, :, size - L :] if left else out[at : at + m, :, :L]
        if rows is None:
            dst.copy_(src)
        else:
            torch.index_select(src, 0, rows, out=dst)
        (out[at : at + m, :, : size - L] if left else out[at : at + m, :, L:]).zero_()
        at += m
    return out, buffer


def append_position(
    cache: LayerCache, k_new: torch.Tensor, v_new: torch.Tensor, rows: torch.Tensor | None
) -> LayerCache:
    """The cache grown by one position: torch.cat([cache[rows], new], dim=2) for its keys
    and values, with k_new, v_new (N, h, 1, d), rows (N,) or None for all in order -> (N, h,
    t + 1, d) each.

    A decoding cache (init_state's: with a Room) takes the position in place while its rows
    stay as they are, and is copied into buffers with ROOM positions to spare when it has
    none left. Beam search, which reorders the cached beams every step, copies them in the
    new order straight into the grown cache, reading and writing them once instead of twice
    (index_select, then cat). A cache without a Room (an exported graph's), or one whose
    gradient is taken, grows by torch.cat.
    """
    room = cache.room
    grad = torch.is_grad_enabled() and k_new.requires_grad  # autograd keeps what it read
    if rows is None and (room is None or grad):
        return LayerCache(torch.cat([cache.self_k, k_new], 2), torch.cat([cache.self_v, v_new], 2))
    N = k_new.size(0)
    room = room_for_next(cache, rows, N)
    at = room.filled
    room.k[:N, :, at : at + 1].copy_(k_new)
    room.v[:N, :, at : at + 1].copy_(v_new)
    room.filled = at + 1
    return room.cache(N)


def room_for_next(cache: LayerCache, rows: torch.Tensor | None, N: int) -> Room:
    """Buffers holding the cache's positions in its first N rows (in the order `rows` (N,)
    gives, or as they are: None) with position `filled` free for the next (append_position):
    the cache's own Room where it takes the next in place, else a copy."""
    t, room = cache.self_k.size(2), cache.room
    if rows is None and room is not None and room.takes(t):
        return room
    # Reordered rows (beam search: at every step) get no room to spare: a fresh buffer's
    # pages are mapped as they are first written, and room would double them. Rows in
    # order keep the rows to spare they had.
    if rows is None:
        assert room is not None  # else grown by torch.cat (append_position)
        spare, capacity = ROOM, room.k.size(0)
    else:
        spare, capacity = 0, N
    room = Room.sized(cache.self_k, capacity, t + 1 + spare, t)  # in the cache's dtype
    for old, buffer in ((cache.self_k, room.k[:N]), (cache.self_v, room.v[:N])):
        if rows is None:
            buffer[:, :, :t].copy_(old)
        else:
            torch.index_select(old, 0, rows, out=buffer[:, :, :t])
    return room


@dataclass
class RecurrentCache:
    c: torch.Tensor  # (B, d): an SSRU decoder layer's state c_t


@dataclass
class TransformerMemory:
    src_mask: torch.Tensor  # (B, 1, 1, S) additive float mask, -inf at padding
    # Per decoder layer, the encoder output projected into cross-attention keys and values,
    # (B, h, S, d_h) each: computed once per sentence, used by every decoding step.
    cross: list[tuple[torch.Tensor, torch.Tensor]]
    # The tensors whose first B rows the above are (C >= B rows: rows to spare for sentences
    # that join a running search, join_memory): src_mask's, then each layer's keys and values.
    # None: the tensors themselves.
    buffers: list[torch.Tensor] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """src_mask, then each layer's keys and values."""
        return [self.src_mask, *(x for kv in self.cross for x in kv)]

    @classmethod
    def first_rows(cls, buffers: list[torch.Tensor], n: int) -> TransformerMemory:
        """The memory that is the first n rows of `buffers` (as tensors() lists them)."""
        mask, *cross = (b[:n] for b in buffers)
        return cls(mask, list(zip(cross[0::2], cross[1::2], strict=True)), buffers)

    def resized(self, rows: int, width: int) -> TransformerMemory:
        """This memory copied into new buffers of `rows` rows (its own first, the others
        to spare) and `width` source positions (past its own: masked padding; fewer than
        its own: only positions that no row attends to are left out, see used_width)."""
        mask, *cross = self.tensors()
        new = [mask.new_empty(rows, 1, 1, width)]  # src_mask's
        new += [x.new_empty(rows, x.size(1), width, x.size(3)) for x in cross]
        resized = TransformerMemory.first_rows(new, mask.size(0))
        resized.put(0, self)
        return resized

    def used_width(self) -> int:
        """Source positions up to the last one a row attends to (not masked)."""
        used = (self.src_mask[:, 0, 0] == 0).any(dim=0).nonzero()  # (U, 1)
        return int(used[-1]) + 1 if used.numel() else 0

    def put(self, at: int, other: TransformerMemory) -> None:
        """Write other's rows into this memory's buffers, from row `at`, padded to its width."""
        assert self.buffers is not None
        buffers, tensors = self.buffers, other.tensors()
        put_rows(buffers[0], at, tensors[0], dim=3, fill=-torch.inf)  # src_mask (B, 1, 1, S)
        for buffer, x in zip(buffers[1:], tensors[1:], strict=True):
            put_rows(buffer, at, x, dim=2, fill=0.0)  # keys, values (B, h, S, d_h)


@dataclass
class TransformerState:
    caches: list[LayerCache | RecurrentCache]
    # Target positions decoded so far: one int when every row has decoded as many, else per
    # row (N,), its own count, the last `position[n]` positions of the caches (join_state).
    position: int | torch.Tensor
    # The cache rows the state's rows continue, (N,), or None: all, in order. select_state
    # only records them; the next step applies them as it appends its position.
    rows: torch.Tensor | None = None


def per_row(state: TransformerState) -> torch.Tensor:
    """A state's position(s) as one per row: (N,)."""
    if not isinstance(state.position, int):
        return state.position
    if state.rows is not None:
        n, device = state.rows.numel(), state.rows.device
    else:
        c = state.caches[0]
        rows = c.c if isinstance(c, RecurrentCache) else c.self_k  # (N, ...)
        n, device = rows.size(0), rows.device
    return torch.full((n,), state.position, device=device)


def join_in_place(
    first: TransformerState, second: TransformerState, position: torch.Tensor
) -> TransformerState | None:
    """join_state without copying first's caches: second's rows, which have decoded no
    position, written as zeros (masked) into the rows first's buffers have to spare; None
    where that cannot be done (rows pending reorder, no room, buffers shared or locked)."""
    fresh = isinstance(second.position, int) and second.position == 0
    if first.rows is not None or second.rows is not None or not fresh:
        return None
    n = position.numel()
    for c in first.caches:
        if isinstance(c, LayerCache) and not (
            c.room is not None and c.room.owns(c.self_k.size(2)) and c.room.k.size(0) >= n
        ):
            return None
    caches: list[LayerCache | RecurrentCache] = []
    for x, y in zip(first.caches, second.caches, strict=True):
        if isinstance(x, RecurrentCache) and isinstance(y, RecurrentCache):
            caches.append(RecurrentCache(torch.cat([x.c, y.c])))  # (N1 + N2, d)
            continue
        assert isinstance(x, LayerCache) and x.room is not None
        joined = x.room.cache(n)  # (N1 + N2, h, t, d_h)
        joined.self_k[x.self_k.size(0) :].zero_()
        joined.self_v[x.self_v.size(0) :].zero_()
        caches.append(joined)
    return TransformerState(caches, position)
