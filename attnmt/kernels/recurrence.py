"""The rnn model's recurrences as autograd functions with hand-written backpropagation through
time: the teacher-forced decoder (one GRU layer, Bahdanau attention) and the one-layer
bidirectional encoder. Each equals its plain PyTorch form (tests/test_kernels_recurrence.py);
its measured gain is in docs/benchmarks.md.

Why: stepped through autograd, every decoder step's backward ran its own weight-gradient
matmuls (K = batch, 64 rows: the least efficient shape there is), accumulated them into the
weight gradients (`add_` of a 1536 × 768 tensor per step and weight), summed bias gradients
per step, and zero-filled whole-sequence gradient buffers for each per-step slice. Here the
backward loop computes only what the next-earlier step needs (the gradient of the state and
of the context, three small matmuls); every weight gradient is one large matmul over all
T × B rows at the end, and so are the gradients of the embeddings and the encoder states.
The embedding part of the GRU input projection is likewise one matmul for all steps, before
the loop.

Step t, with s the previous state (Bahdanau et al. 2015, https://arxiv.org/abs/1409.0473, and
torch.nn.GRU's gate layout r, z, n):
    q = W_q s + b_q                          e = tanh(q + K)            (K: projected keys)
    α = softmax(v · e) over unmasked sources  c = Σ_j α_j values_j
    gi = W_ie y + W_ic c + b_ih              gh = W_hh s + b_hh
    r = σ(gi_r + gh_r)   z = σ(gi_z + gh_z)   n = tanh(gi_n + r ⊙ gh_n)
    s' = (1 - z) ⊙ n + z ⊙ s
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from attnmt.kernels import matmul

Tensor = torch.Tensor


def _mm(a: Tensor, b: Tensor, md: torch.dtype, out: torch.dtype) -> Tensor:
    """a @ b (batched when 3-D) with both operands in the matmul dtype md, the result in out.
    Casting a tensor already in md is free, so hot loops pass weights cast once. In fp32 the
    products take the backend of attnmt.matmul (a 3-D one as one product per batch entry)."""
    if md == out == torch.float32:
        if a.dim() == 2:
            return matmul.mm(a, b)
        if matmul.use_onednn(a, a.numel() * b.size(-1)):
            return torch.stack([matmul.mm(x, y) for x, y in zip(a, b, strict=True)])
    return (a.to(md) @ b.to(md)).to(out)


def _autocast_matmul_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast would run matmuls in here, or None when it is off. The functions
    below run with autocast off and cast their matmul operands themselves, keeping the
    element-wise math in fp32 (as ops.linear_cross_entropy does)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _gru_cell(
    gi: Tensor, gh: Tensor, h: Tensor, gates: Tensor, gh_n: Tensor, out: Tensor
) -> Tensor:
    """One GRU update from the input and hidden projections gi, gh (..., 3H) of state h
    (..., H); writes r, z, n into gates (3, ..., H), W_hn h + b_hn into gh_n and the new state
    into out, which it returns."""
    H = h.size(-1)
    r = torch.sigmoid(gi[..., :H] + gh[..., :H], out=gates[0])
    z = torch.sigmoid(gi[..., H : 2 * H] + gh[..., H : 2 * H], out=gates[1])
    gh_n.copy_(gh[..., 2 * H :])
    n = torch.tanh(torch.addcmul(gi[..., 2 * H :], r, gh_n), out=gates[2])
    return torch.lerp(n, h, z, out=out)  # (1 - z) n + z h


def _gru_cell_backward(
    d_out: Tensor, h: Tensor, gates: Tensor, gh_n: Tensor, d_gi: Tensor, d_gh: Tensor
) -> Tensor:
    """Backward of _gru_cell for the gradient d_out of its new state: writes the gradients of
    gi and gh into d_gi, d_gh (..., 3H) and returns the part of h's gradient that does not go
    through W_hh (d_out ⊙ z)."""
    r, z, n = gates
    d_npre = d_out * (1 - z) * (1 - n * n)  # through n's tanh
    d_rpre = d_npre * gh_n * r * (1 - r)
    d_zpre = d_out * (h - n) * z * (1 - z)
    torch.cat([d_rpre, d_zpre, d_npre], dim=-1, out=d_gi)
    torch.cat([d_rpre, d_zpre, d_npre * r], dim=-1, out=d_gh)
    return d_out * z


@dataclass(frozen=True)
class ScheduledSampling:
    """Scheduled sampling's choice of inputs (Bengio et al. 2015,
    https://arxiv.org/abs/1506.03099), made as the recurrence runs: input t > 0 is the gold
    token where use_gold[:, t], else the argmax of step t-1's logits
        W_out · dropout(tanh(W_o [s_{t-1}; c_{t-1}; E y_{t-2}]))
    with the same dropout scales the loss uses, so the choice is the argmax of the loss's own
    logits. No gradient flows through the choice; the chosen tokens' embeddings get theirs."""

    gold: Tensor  # (B, T) gold inputs y_0..y_{T-1}
    use_gold: Tensor  # (B, T) bool
    emb_scale: Tensor | None  # (B, T, E) dropout scale of the input embeddings; None: off
    pre_scale: Tensor | None  # (B, T, E) dropout scale of the pre-outputs; None: off
    embed_weight: Tensor  # (V, E) E
    w_o: Tensor  # (E, 2D + E) W_o, over [s; c; E y]
    b_o: Tensor  # (E,)
    output_weight: Tensor  # (V, E) W_out
    pad_id: int  # the embedding row that gets no gradient (nn.Embedding's padding_idx)


class _Chooser:
    """The state of scheduled sampling inside _GRUAttentionRecurrence.forward: the inputs
    chosen so far, the embeddings fed, and the rows that take a prediction at each step."""

    def __init__(self, s: ScheduledSampling, embs: Tensor, md: torch.dtype) -> None:
        f32 = torch.promote_types(embs.dtype, torch.float32)
        self.s, self.md, self.f32 = s, md, f32
        self.inputs = s.gold.clone()  # (B, T) the inputs fed
        self.embs = embs.detach().to(f32).clone()  # (B, T, E) their embeddings, after dropout
        self.predicted = ~s.use_gold  # (B, T) where input t is a prediction
        self.predicted[:, 0] = False
        self.rows = [self.predicted[:, t].nonzero().squeeze(1) for t in range(s.gold.size(1))]
        self.w_oT = s.w_o.detach().t().to(md)  # (2D + E, E)
        self.b_o = s.b_o.detach().to(f32)  # (E,)
        self.w_outT = s.output_weight.detach().t().to(md)  # (E, V)

    def feed(self, t: int, s: Tensor, c: Tensor, ge: Tensor, w_ieT: Tensor, b_ih: Tensor) -> None:
        """After step t (state s, context c: (B, D)), choose input t+1 of the rows that take a
        prediction and replace their input projection in ge (T, B, 3D)."""
        rows = self.rows[t + 1]  # (b,)
        if rows.numel() == 0:
            return
        sc = self.s
        x = torch.cat([s[rows], c[rows], self.embs[rows, t]], dim=-1)  # (b, 2D + E)
        pre = torch.tanh(_mm(x, self.w_oT, self.md, self.f32) + self.b_o)  # (b, E)
        if sc.pre_scale is not None:
            pre = pre * sc.pre_scale[rows, t]
        tokens = _mm(pre, self.w_outT, self.md, self.f32).argmax(dim=-1)  # (b,)
        self.inputs[rows, t + 1] = tokens
        emb = sc.embed_weight.detach()[tokens].to(self.f32)  # (b, E)
        if sc.emb_scale is not None:
            emb = emb * sc.emb_scale[rows, t + 1]
        self.embs[rows, t + 1] = emb
        ge[t + 1, rows] = _mm(emb, w_ieT, self.md, self.f32) + b_ih

    def embedding_grads(self, d_embs: Tensor) -> tuple[Tensor, Tensor]:
        """Split the gradient of the embeddings fed (B, T, E): the gold inputs' part (0 at
        predicted inputs) and the embedding table's part from the predicted ones (V, E)."""
        sc, pred = self.s, self.predicted
        d_pred = d_embs if sc.emb_scale is None else d_embs * sc.emb_scale
        tokens = self.inputs[pred]  # (n,)
        d_rows = d_pred[pred].masked_fill((tokens == sc.pad_id).unsqueeze(1), 0.0)
        weight = sc.embed_weight
        d_table = torch.zeros_like(weight).index_add_(0, tokens, d_rows.to(weight.dtype))
        return d_embs.masked_fill(pred.unsqueeze(-1), 0.0), d_table


class _GRUAttentionRecurrence(torch.autograd.Function):
    """The recurrence of the module docstring over inputs known in advance (embs), or chosen
    as it runs when `sampling` is given (then it also returns the inputs chosen, and the
    gradient of the predicted inputs' embeddings goes to the embedding table embed_w)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        embs: Tensor,
        h0: Tensor,
        proj_keys: Tensor,
        values: Tensor,
        pad_mask: Tensor,
        w_q: Tensor,
        b_q: Tensor,
        v: Tensor,
        w_ih: Tensor,
        b_ih: Tensor,
        w_hh: Tensor,
        b_hh: Tensor,
        mm_dtype: torch.dtype | None,
        embed_w: Tensor | None = None,
        sampling: ScheduledSampling | None = None,
    ) -> tuple[Tensor, ...]:
        B, T, E = embs.shape
        S, A, D = proj_keys.size(1), proj_keys.size(2), h0.size(1)
        f32 = torch.promote_types(embs.dtype, torch.float32)
        md = mm_dtype or f32

        def mm(x: Tensor, w: Tensor) -> Tensor:
            return _mm(x, w, md, f32)

        w_qT, w_hhT = w_q.t().to(md), w_hh.t().to(md)  # (D, A), (D, 3D)
        # A dense copy of the context columns: a slice with gaps between its rows sends
        # oneDNN to its slow reference kernel (attnmt.matmul), once per step here.
        w_icT = w_ih[:, E:].to(md).contiguous().t()  # (D, 3D)
        v_ = v.reshape(A).to(f32)  # (A,)
        K, vals = proj_keys.to(f32), values.to(f32)
        # The embedding part of every step's input projection, one matmul: (T, B, 3D).
        ge = mm(embs.transpose(0, 1).reshape(T * B, E), w_ih[:, :E].t().to(md)).view(T, B, -1)
        b_ih_ = b_ih.to(f32)
        ge += b_ih_
        chooser = None if sampling is None else _Chooser(sampling, embs, md)
        w_ieT = w_ih[:, :E].t().to(md) if chooser else None  # (E, 3D)
        outs = embs.new_empty((T, B, D), dtype=f32)  # s_t
        ctxs = embs.new_empty((T, B, D), dtype=f32)  # c_t
        es = embs.new_empty((T, B, S, A), dtype=f32)  # tanh(q + K)
        alphas = embs.new_empty((T, B, S), dtype=f32)
        gates = embs.new_empty((T, 3, B, D), dtype=f32)  # r, z, n
        gh_ns = embs.new_empty((T, B, D), dtype=f32)  # W_hn s + b_hn
        s = h0.to(f32)
        b_q_, b_hh_ = b_q.to(f32), b_hh.to(f32)
        for t in range(T):
            q = mm(s, w_qT) + b_q_  # (B, A)
            e = torch.add(K, q.unsqueeze(1), out=es[t]).tanh_()  # (B, S, A)
            scores = (e @ v_).masked_fill_(pad_mask, float("-inf"))  # (B, S)
            alpha = alphas[t].copy_(torch.softmax(scores, dim=-1))  # (B, S)
            c = torch.bmm(alpha.unsqueeze(1), vals, out=ctxs[t].unsqueeze(1)).squeeze(1)  # (B, D)
            gi = mm(c, w_icT) + ge[t]  # (B, 3D)
            gh = mm(s, w_hhT) + b_hh_  # (B, 3D)
            s = _gru_cell(gi, gh, s, gates[t], gh_ns[t], outs[t])  # (B, D)
            if chooser is not None and t + 1 < T:
                chooser.feed(t, s, c, ge, w_ieT, b_ih_)  # type: ignore[arg-type]
        embs_fed = embs if chooser is None else chooser.embs
        ctx.save_for_backward(embs_fed, h0, values, w_q, v, w_ih, w_hh, outs, ctxs, es, alphas)
        ctx.gates, ctx.gh_ns, ctx.mm_dtype = gates, gh_ns, mm_dtype  # type: ignore[attr-defined]
        ctx.keys_dtype, ctx.chooser = proj_keys.dtype, chooser  # type: ignore[attr-defined]
        ctx.embs_dtype = embs.dtype  # type: ignore[attr-defined]
        if chooser is None:
            return outs, ctxs
        ctx.mark_non_differentiable(chooser.inputs)
        return outs, ctxs, chooser.inputs

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        d_outs: Tensor | None,
        d_ctxs: Tensor | None,
        *_: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        # Long: the backward loop mirrors forward's step by step, and the weight gradients at the
        # end are single matmuls over the buffers that loop fills; split, they would pass a
        # dozen tensors between the parts.
        embs, h0, values, w_q, v, w_ih, w_hh, outs, ctxs, es, alphas = ctx.saved_tensors  # type: ignore[attr-defined]
        gates, gh_ns = ctx.gates, ctx.gh_ns  # type: ignore[attr-defined]
        B, T, E = embs.shape
        A, D = es.size(3), h0.size(1)
        f32 = outs.dtype
        md = ctx.mm_dtype or f32  # type: ignore[attr-defined]

        def mm(x: Tensor, w: Tensor) -> Tensor:
            return _mm(x, w, md, f32)

        w_q_, w_hh_, w_ic = (
            w_q.to(md),
            w_hh.to(md),
            w_ih[:, E:].to(md).contiguous(),
        )  # (A,D), (3D,D), (3D,D)
        v_ = v.reshape(A).to(f32)
        vals = values.to(f32)
        if d_outs is None:
            d_outs = torch.zeros_like(outs)
        if d_ctxs is None:
            d_ctxs = torch.zeros_like(ctxs)
        d_gi = outs.new_empty((T, B, 3 * D))  # gradient of gi_t (and of ge_t)
        d_gh = outs.new_empty((T, B, 3 * D))  # gradient of gh_t
        d_q = outs.new_empty((T, B, A))
        d_c = outs.new_empty((T, B, D))
        d_scores = outs.new_empty(alphas.shape)  # (T, B, S)
        d_keys = torch.zeros_like(es[0])  # (B, S, A)
        ds = torch.zeros_like(outs[0])  # (B, D): gradient of the state s_t
        for t in range(T - 1, -1, -1):
            ds += d_outs[t]
            s_prev = outs[t - 1] if t > 0 else h0.to(f32)
            ds_prev = _gru_cell_backward(ds, s_prev, gates[t], gh_ns[t], d_gi[t], d_gh[t])
            ds_prev += mm(d_gh[t], w_hh_)  # (B, D)
            dc = torch.add(d_ctxs[t], mm(d_gi[t], w_ic), out=d_c[t])  # (B, D)
            # Attention: c = α values, α = softmax(scores), scores = v · e, e = tanh(q + K).
            alpha = alphas[t]  # (B, S)
            d_alpha = torch.bmm(vals, dc.unsqueeze(2)).squeeze(2)  # (B, S)
            dsc = d_scores[t]
            torch.mul(alpha, d_alpha - (alpha * d_alpha).sum(-1, keepdim=True), out=dsc)
            d_pre = torch.ops.aten.tanh_backward(dsc.unsqueeze(2) * v_, es[t])  # (B, S, A)
            d_keys += d_pre
            dq = torch.sum(d_pre, dim=1, out=d_q[t])  # (B, A)
            ds_prev += mm(dq, w_q_)
            ds = ds_prev
        # Everything that does not feed back: one matmul over all T * B rows each.
        s_prevs = torch.cat([h0.to(f32).unsqueeze(0), outs[:-1]]).view(T * B, D)
        d_gi2, d_gh2, d_q2 = d_gi.view(T * B, -1), d_gh.view(T * B, -1), d_q.view(T * B, A)
        embs_tm = embs.transpose(0, 1).reshape(T * B, E).to(f32)
        d_w_ih = torch.cat(
            [mm(d_gi2.t(), embs_tm.to(md)), mm(d_gi2.t(), ctxs.view(T * B, D).to(md))], dim=1
        )  # (3D, E + D)
        d_w_hh = mm(d_gh2.t(), s_prevs.to(md))  # (3D, D)
        d_w_q = mm(d_q2.t(), s_prevs.to(md))  # (A, D)
        d_v = mm(d_scores.view(1, -1), es.view(-1, A).to(md))  # (1, A)
        d_embs = mm(d_gi2, w_ih[:, :E].to(md)).view(T, B, E).transpose(0, 1)  # (B, T, E)
        d_table = None
        if ctx.chooser is not None:  # type: ignore[attr-defined]
            d_embs, d_table = ctx.chooser.embedding_grads(d_embs)  # type: ignore[attr-defined]
        d_values = mm(alphas.permute(1, 2, 0), d_c.transpose(0, 1).to(md))  # (B, S, D)
        return (
            d_embs.to(ctx.embs_dtype),  # type: ignore[attr-defined]
            ds.to(h0.dtype),
            d_keys.to(ctx.keys_dtype),  # type: ignore[attr-defined]
            d_values.to(values.dtype),
            None,
            d_w_q.to(w_q.dtype),
            d_q2.sum(0),
            d_v.to(v.dtype).view_as(v),
            d_w_ih.to(w_ih.dtype),
            d_gi2.sum(0),
            d_w_hh.to(w_hh.dtype),
            d_gh2.sum(0),
            None,
            d_table,
            None,
        )


# Whether the fused recurrences run where they apply; tests switch them off (plain_recurrences)
# to compare them with autograd's stepping.
_fused: contextvars.ContextVar[bool] = contextvars.ContextVar("attnmt_fused", default=True)


@contextlib.contextmanager
def plain_recurrences() -> Iterator[None]:
    """Inside the block the fused recurrences return None, so their callers step through
    autograd (the form they are tested against)."""
    token = _fused.set(False)
    try:
        yield
    finally:
        _fused.reset(token)


def gru_attention_recurrence(
    embs: Tensor,
    h0: Tensor,
    proj_keys: Tensor,
    values: Tensor,
    pad_mask: Tensor,
    score: tuple[Tensor, Tensor, Tensor] | None,
    gru_weights: list[list[Tensor]],
    sampling: ScheduledSampling | None = None,
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """Run the decoder over T inputs: the GRU outputs s_1..s_T and contexts c_1..c_T; None where
    this does not apply (another attention score, more than one GRU layer, off the CPU's usual
    path: see plain_recurrences), and the caller steps through autograd instead.

    Args:
        embs: (B, T, E) embedded inputs y_0..y_{T-1} (the gold ones, after dropout);
            h0: (B, D) initial state.
        proj_keys: (B, S, A) W_k keys; values: (B, S, D') encoder states; pad_mask: (B, S)
            bool, True at padding.
        score: the additive attention's (W_q (A, D), b_q (A,), v (1, A)); None for another.
        gru_weights: torch.nn.GRU.all_weights, [[W_ih, W_hh, b_ih, b_hh]] for one layer with
            input [E y; c] (E + D') and state D.
        sampling: scheduled sampling: where it says so, an input is the model's own prediction
            from the step before, chosen in the same loop (one recurrence, not a choosing pass
            and a teacher-forced one).
    Returns:
        outs (T, B, D) and contexts (T, B, D'), time-major, and with `sampling` the inputs fed
        (B, T) (else None).

    Under autocast the matmuls run in its dtype and everything else in fp32, as in
    kernels.ops.linear_cross_entropy.
    """
    if score is None or len(gru_weights) != 1 or len(gru_weights[0]) != 4 or not _fused.get():
        return None
    w_q, b_q, v = score
    w_ih, w_hh, b_ih, b_hh = gru_weights[0]
    embed_w = None if sampling is None else sampling.embed_weight
    dev = embs.device.type
    mm_dtype = _autocast_matmul_dtype(dev)
    with torch.autocast(dev, enabled=False):
        found = _GRUAttentionRecurrence.apply(
            embs, h0, proj_keys, values, pad_mask, w_q, b_q, v, w_ih, b_ih, w_hh, b_hh,
            mm_dtype, embed_w, sampling,
        )  # fmt: skip
    return found[0], found[1], found[2] if sampling is not None else None


class _BiGRURecurrence(torch.autograd.Function):
    """Both directions of a one-layer bidirectional GRU over padded sentences, advanced together:
    step i runs the forward direction at position i and the backward one at S - 1 - i, as one
    (2, B, ·) batched matmul. Past a sentence's end (mask 0) the forward state stays as it
    was and the backward state stays at its start value 0, which is what packed sequences do;
    outputs there are 0, as pad_packed_sequence gives."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        keep: Tensor,
        w_ih: Tensor,
        b_ih: Tensor,
        w_hh: Tensor,
        b_hh: Tensor,
        mm_dtype: torch.dtype | None,
    ) -> tuple[Tensor, Tensor]:
        B, S, E = x.shape
        H = w_hh.size(2)
        f32 = torch.promote_types(x.dtype, torch.float32)
        md = mm_dtype or f32
        # Input projections of both directions for all positions: one matmul, (B, S, 6H).
        gi = _mm(x.reshape(B * S, E), w_ih.reshape(6 * H, E).t(), md, f32)
        gi = gi.view(B, S, 2, 3 * H).add_(b_ih.to(f32))  # (B, S, 2, 3H)
        # Step-major: [i, 0] = forward direction at position i, [i, 1] = backward at S-1-i.
        gi = torch.stack([gi[:, :, 0].transpose(0, 1), gi[:, :, 1].flip(1).transpose(0, 1)], 1)
        m = keep.t().to(f32)  # (S, B) 1 at real tokens
        masks = torch.stack([m, m.flip(0)], dim=1).unsqueeze(-1)  # (S, 2, B, 1)
        w_hhT, b_hh_ = w_hh.transpose(1, 2).to(md), b_hh.to(f32).unsqueeze(1)  # (2,H,3H), (2,1,3H)
        h_prev = x.new_empty((S, 2, B, H), dtype=f32)  # state before step i
        h_new = x.new_empty((S, 2, B, H), dtype=f32)  # GRU output at step i
        gates = x.new_empty((S, 3, 2, B, H), dtype=f32)  # r, z, n
        gh_ns = x.new_empty((S, 2, B, H), dtype=f32)
        h = x.new_zeros((2, B, H), dtype=f32)
        for i in range(S):
            h_prev[i] = h
            gh = _mm(h, w_hhT, md, f32) + b_hh_  # (2, B, 3H)
            g = gi[i]  # (2, B, 3H)
            hn = _gru_cell(g, gh, h, gates[i], gh_ns[i], h_new[i])  # (2, B, H)
            h = torch.where(masks[i] > 0, hn, h)
        out_steps = h_new * masks  # (S, 2, B, H), 0 past the end
        out = torch.cat([out_steps[:, 0], out_steps[:, 1].flip(0)], dim=-1)  # (S, B, 2H)
        ctx.save_for_backward(x, w_ih, w_hh)
        ctx.saved = (masks, h_prev, gates, gh_ns, mm_dtype)  # type: ignore[attr-defined]
        return out.transpose(0, 1), torch.cat([h[0], h[1]], dim=-1)  # (B, S, 2H), (B, 2H)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, d_out: Tensor | None, d_final: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        x, w_ih, w_hh = ctx.saved_tensors  # type: ignore[attr-defined]
        masks, h_prev, gates, gh_ns, mm_dtype = ctx.saved  # type: ignore[attr-defined]
        B, S, E = x.shape
        H = w_hh.size(2)
        f32 = h_prev.dtype
        md = mm_dtype or f32
        w_hh_ = w_hh.to(md)  # (2, 3H, H)
        d_o = torch.zeros((S, B, 2 * H), dtype=f32, device=x.device)
        if d_out is not None:
            d_o = d_out.transpose(0, 1).to(f32)
        d_steps = torch.stack([d_o[..., :H], d_o[..., H:].flip(0)], dim=1)  # (S, 2, B, H)
        d_gi = h_prev.new_empty((S, 2, B, 3 * H))
        d_gh = h_prev.new_empty((S, 2, B, 3 * H))
        dh = h_prev.new_zeros((2, B, H))
        if d_final is not None:
            dh += d_final.to(f32).view(B, 2, H).transpose(0, 1)
        for i in range(S - 1, -1, -1):
            mask = masks[i] > 0  # (2, B, 1)
            d_hn = torch.where(mask, dh + d_steps[i], 0.0)  # gradient of the GRU output
            dh = torch.where(mask, 0.0, dh)  # the state passed through unchanged
            dh += _gru_cell_backward(d_hn, h_prev[i], gates[i], gh_ns[i], d_gi[i], d_gh[i])
            dh += _mm(d_gh[i], w_hh_, md, f32)
        # Weight gradients: one batched matmul per weight over all S * B rows.
        d_gh2 = d_gh.transpose(0, 1).reshape(2, S * B, 3 * H)
        d_w_hh = _mm(d_gh2.transpose(1, 2), h_prev.transpose(0, 1).reshape(2, S * B, H), md, f32)
        # Back to positions: (B, S, 2, 3H).
        d_gi_pos = torch.stack([d_gi[:, 0], d_gi[:, 1].flip(0)], dim=2).transpose(0, 1)
        d_gi2 = d_gi_pos.reshape(B * S, 6 * H)
        d_w_ih = _mm(d_gi2.t(), x.reshape(B * S, E), md, f32).reshape(2, 3 * H, E)
        d_x = _mm(d_gi2, w_ih.reshape(6 * H, E), md, f32).view(B, S, E)
        return (
            d_x.to(x.dtype),
            None,
            d_w_ih.to(w_ih.dtype),
            d_gi2.sum(0).view(2, 3 * H),
            d_w_hh.to(w_hh.dtype),
            d_gh2.sum(1),
            None,
        )


def bigru_recurrence(
    x: Tensor, keep: Tensor, gru_weights: list[list[Tensor]]
) -> tuple[Tensor, Tensor] | None:
    """A one-layer bidirectional torch.nn.GRU over padded sentences, as it runs over packed
    ones; None where this does not pay or apply: without gradients (decoding, validation:
    torch's C++ loop is faster when there is no backward to prepare, 1.45x on test batches),
    for more layers, or inside plain_recurrences().

    Args:
        x: (B, S, E) inputs; keep: (B, S) bool, True at real tokens (a prefix of each row).
        gru_weights: torch.nn.GRU.all_weights of a bidirectional GRU with bias:
            [[W_ih, W_hh, b_ih, b_hh] forward, [...] backward] for one layer.
    Returns:
        states (B, S, 2H) (forward ++ backward, 0 at padding) and the final summary (B, 2H):
        the forward state at the last real token ++ the backward state at the first.
    """
    if len(gru_weights) != 2 or not torch.is_grad_enabled() or not _fused.get():
        return None
    (f_ih, f_hh, f_bih, f_bhh), (r_ih, r_hh, r_bih, r_bhh) = gru_weights
    w_ih = torch.stack([f_ih, r_ih])  # (2, 3H, E)
    b_ih = torch.stack([f_bih, r_bih])  # (2, 3H)
    w_hh = torch.stack([f_hh, r_hh])  # (2, 3H, H)
    b_hh = torch.stack([f_bhh, r_bhh])  # (2, 3H)
    dev = x.device.type
    mm_dtype = _autocast_matmul_dtype(dev)
    with torch.autocast(dev, enabled=False):
        out, final = _BiGRURecurrence.apply(x, keep, w_ih, b_ih, w_hh, b_hh, mm_dtype)
    return out, final
