#!/usr/bin/env python
"""Probe for issue 79: a Transformer's greedy decoding step written to be compiled, timed
against today's step (the lean step attnmt decodes with) at N rows, 1 thread.

The step reads the model's own weights (no copy of the architecture's maths elsewhere than
here, for the probe): caches preallocated as (layers, N, h, capacity, d_h) and written in place
at the step's position, attention over the whole capacity with the positions past the step
masked, the output layer and the argmax inside; rows the one dynamic dimension.

    python scripts/probe_compiled_step.py --model runs/t8 --rows 1,8,64 [--mode default]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnmt import Translator
from attnmt.data.batches import pad_sequences
from attnmt.data.text import read_lines
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


@torch.library.custom_op("attnmt_probe::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d_h + bias) v, one query a row: q (N, h, d_h), k, v (N, h, T, d_h), bias
    broadcast to (N, h, T) -> (N, h, d_h). An op Inductor calls as it is (its products stay
    batched matrix products, not loops of Inductor's own)."""
    s = torch.matmul(k, q.unsqueeze(-1)).squeeze(-1) / q.size(-1) ** 0.5 + bias  # (N, h, T)
    return torch.matmul(s.softmax(-1).unsqueeze(-2), v).squeeze(-2)


@attend.register_fake
def _(q, k, v, bias):
    return torch.empty_like(q)


OPAQUE = False
FREEZE = False


def _attend(q, k, v, bias):
    if OPAQUE:
        return attend(q, k, v, bias)
    s = torch.einsum("nhd,nhtd->nht", q, k) / q.size(-1) ** 0.5 + bias  # (N, h, T)
    return torch.einsum("nht,nhtd->nhd", s.softmax(-1), v)


def make_step(model, capacity: int):
    """The model's greedy step as a pure function of tensors (pre-norm, sinusoidal, ReLU)."""
    layers = model.decoder_layers
    h = layers[0].self_attn.num_heads
    d = model.output.weight.size(1)
    d_h = d // h
    w_qkv = [torch.cat([L.self_attn.q_proj.weight, L.self_attn.k_proj.weight,
                        L.self_attn.v_proj.weight]).t().contiguous() for L in layers]  # fmt: skip
    b_qkv = [torch.cat([L.self_attn.q_proj.bias, L.self_attn.k_proj.bias,
                        L.self_attn.v_proj.bias]) for L in layers]  # fmt: skip
    w_o = [L.self_attn.out_proj.weight.t().contiguous() for L in layers]
    b_o = [L.self_attn.out_proj.bias for L in layers]
    w_cq = [L.cross_attn.q_proj.weight.t().contiguous() for L in layers]
    b_cq = [L.cross_attn.q_proj.bias for L in layers]
    w_co = [L.cross_attn.out_proj.weight.t().contiguous() for L in layers]
    b_co = [L.cross_attn.out_proj.bias for L in layers]
    w_1 = [L.ff.w_1.weight.t().contiguous() for L in layers]
    b_1 = [L.ff.w_1.bias for L in layers]
    w_2 = [L.ff.w_2.weight.t().contiguous() for L in layers]
    b_2 = [L.ff.w_2.bias for L in layers]
    norms = [(L.res_self.norm, L.res_cross.norm, L.res_ff.norm) for L in layers]
    emb = model.tgt_embed.embed.weight
    scale = model.tgt_embed.scale
    pe = model.tgt_embed.pe[:capacity].contiguous()
    out_w = model.output.weight.t().contiguous()  # (d, V)
    final = model.dec_norm
    arange = torch.arange(capacity)

    def ln(norm, x):
        return F.layer_norm(x, (d,), norm.weight, norm.bias, norm.eps)

    def step(tokens, position, k_cache, v_cache, mem_k, mem_v, src_bias):
        """tokens (N,), position () int64, caches a layer's each (N, h, T, d_h), mem_k/v (layers, N,
        h, S, d_h), src_bias (N, 1, S) additive -> the next tokens (N,)."""
        N = tokens.size(0)
        x = emb.index_select(0, tokens) * scale + pe.index_select(0, position.view(1))  # (N, d)
        seen = torch.where(arange <= position, 0.0, float("-inf"))  # (T,)
        for i in range(len(layers)):
            n_self, n_cross, n_ff = norms[i]
            y = ln(n_self, x)
            qkv = torch.addmm(b_qkv[i], y, w_qkv[i])  # (N, 3d)
            q, k, v = qkv.view(N, 3, h, d_h).unbind(1)  # (N, h, d_h)
            k_cache[i].index_copy_(2, position.view(1), k.unsqueeze(2))
            v_cache[i].index_copy_(2, position.view(1), v.unsqueeze(2))
            a = _attend(q, k_cache[i], v_cache[i], seen).reshape(N, d)
            x = x + torch.addmm(b_o[i], a, w_o[i])
            y = ln(n_cross, x)
            q = torch.addmm(b_cq[i], y, w_cq[i]).view(N, h, d_h)
            a = _attend(q, mem_k[i], mem_v[i], src_bias).reshape(N, d)
            x = x + torch.addmm(b_co[i], a, w_co[i])
            y = ln(n_ff, x)
            x = x + torch.addmm(b_2[i], torch.relu(torch.addmm(b_1[i], y, w_1[i])), w_2[i])
        logits = ln(final, x) @ out_w  # (N, V)
        return logits.argmax(-1)

    return step


def aoti_step(step, tokens, kc, vc, mem_k, mem_v, bias):
    """The step exported (rows and the source length dynamic) and compiled ahead of time by
    AOTInductor into a package, loaded back: called without Dynamo or guards."""
    import tempfile

    class Step(torch.nn.Module):
        def forward(self, tokens, position, kc, vc, mem_k, mem_v, bias):
            return step(tokens, position, kc, vc, mem_k, mem_v, bias)

    n, s = torch.export.Dim("n", min=1, max=1024), torch.export.Dim("s", min=2, max=512)
    cache = [{0: n}] * len(kc)
    shapes = ({0: n}, None, cache, cache, {1: n, 3: s}, {1: n, 3: s}, {0: n, 2: s})

    def two(t, dim):  # an example of 2 rows: 1 would be taken as a constant
        return torch.cat([t, t], dim) if t.size(dim) == 1 else t

    kc, vc = [two(c, 0) for c in kc], [two(c, 0) for c in vc]
    args = (two(tokens, 0), torch.tensor(0), kc, vc, two(mem_k, 1), two(mem_v, 1), two(bias, 0))
    exported = torch.export.export(Step(), args, dynamic_shapes=shapes)
    path = Path(tempfile.mkdtemp()) / "step.pt2"
    configs = {"freezing": True} if FREEZE else {}
    torch._inductor.aoti_compile_and_package(
        exported, package_path=str(path), inductor_configs=configs
    )
    loaded = torch._inductor.aoti_load_package(str(path))
    return lambda *a: loaded(*a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--mode", default="default", help="torch.compile mode, or eager")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--capacity", type=int, default=64, help="cache positions preallocated")
    ap.add_argument("--opaque", action="store_true", help="attention as an op Inductor calls")
    ap.add_argument("--skip-guards", action="store_true", help="guards not re-evaluated")
    ap.add_argument("--aoti", action="store_true", help="torch.export + AOTInductor package")
    ap.add_argument("--freeze", action="store_true", help="AOTInductor with freezing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ours = Translator.load(args.model, "cpu", precision="fp32", threads=1)
    model = ours.model
    lines = read_lines(Path("data/multi30k/test_2016_flickr.de.gz"))
    ids = [s for s in ours.tokenizer.src.encode(lines) if 14 <= len(s) <= 17]
    capacity = args.capacity
    global OPAQUE, FREEZE
    FREEZE = args.freeze
    OPAQUE = args.opaque
    step = make_step(model, capacity)
    compiled = (
        step
        if args.mode == "eager" or args.aoti
        else torch.compile(
            step, dynamic=True, fullgraph=True, mode=None if args.mode == "default" else args.mode
        )
    )
    for rows in map(int, args.rows.split(",")):
        src = pad_sequences([[*ids[i % len(ids)], EOS_ID] for i in range(rows)], PAD_ID)
        with torch.inference_mode():
            mem = model.encode(src, src == PAD_ID)
            mem_k = torch.stack([k for k, _ in mem.cross])  # (L, N, h, S, d_h)
            mem_v = torch.stack([v for _, v in mem.cross])
            bias = mem.src_mask.view(rows, 1, -1)  # additive
            L, _, h, _, d_h = mem_k.shape
            kc = [mem_k.new_zeros(rows, h, capacity, d_h) for _ in range(L)]  # a layer's each
            vc = [torch.zeros_like(c) for c in kc]
            tokens = torch.full((rows,), BOS_ID)
            start = time.perf_counter()
            if args.aoti:
                compiled = aoti_step(step, tokens, kc, vc, mem_k, mem_v, bias)
            compiled(tokens, torch.tensor(0), kc, vc, mem_k, mem_v, bias)  # compile
            first = time.perf_counter() - start
            if args.skip_guards:
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
            times = []
            for _ in range(3):
                tokens, ours_out = torch.full((rows,), BOS_ID), []
                start = time.perf_counter()
                for p in range(args.steps):
                    tokens = compiled(tokens, torch.tensor(p), kc, vc, mem_k, mem_v, bias)
                    ours_out.append(tokens)
                times.append((time.perf_counter() - start) / args.steps * 1000)
            # Today's step: the model's decode_step (the lean step) from the same memory.
            state = model.init_state(mem)
            prev = torch.full((rows,), BOS_ID)
            ref = []
            for _ in range(3):
                state = model.init_state(mem)
                prev, today_out = torch.full((rows,), BOS_ID), []
                start = time.perf_counter()
                for _p in range(args.steps):
                    logits, state, _ = model.decode_step(mem, state, prev)
                    prev = logits.argmax(-1)
                    today_out.append(prev)
                ref.append((time.perf_counter() - start) / args.steps * 1000)
            same = bool(torch.equal(torch.stack(ours_out), torch.stack(today_out)))
        if args.skip_guards:
            torch.compiler.set_stance("default")
        row = {"rows": rows, "mode": args.mode, "compile_s": round(first, 1)}
        row |= {"opaque": args.opaque, "skip_guards": args.skip_guards, "aoti": args.aoti}
        row |= {"ms_compiled": round(statistics.median(times), 3)}
        row |= {"ms_today": round(statistics.median(ref), 3), "same_tokens": same}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
