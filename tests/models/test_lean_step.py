"""models.lean_step: the Transformer's leaner decoding step computes what decode_step does,
step by step, through beam search's reordered rows and a pool's joins, and in every variant
(post-norm, GELU, bias-free output, SSRU layers, bf16 keys and values, rotary positions kept in
their own form, int8)."""

from __future__ import annotations

import copy

import pytest
import torch

from attnmt.decoding.beam import beam_search
from attnmt.decoding.greedy import greedy_search
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.search import Beam, SearchOptions
from attnmt.models import lean_step

from helpers import keep_and_join, random_batch, tiny_model

VARIANTS = {
    "pre-norm": {},
    "post-norm, gelu, output bias, untied": {
        "norm": "post", "activation": "gelu", "output_bias": True, "tie_embeddings": False,
    },
    "rope": {"positions": "rope"},
    "ssru": {"decoder": "ssru"},
    "keys and values in bf16": {"cache_dtype": torch.bfloat16},
    "ssru, bf16": {"decoder": "ssru", "cache_dtype": torch.bfloat16},
}  # fmt: skip


def _pair(
    precision: str = "fp32", cache_dtype: torch.dtype | None = None, **overrides
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same model for decoding twice: with its lean step, and without."""
    model = tiny_model("transformer", **overrides).eval()
    plain = for_decoding(copy.deepcopy(model), precision)
    lean = for_decoding(model, precision)
    plain.lean_step = None
    if cache_dtype is not None:
        lean.cache_dtype = plain.cache_dtype = cache_dtype
    assert isinstance(lean.lean_step, lean_step.LeanStep)
    return lean, plain


def _close(a: torch.Tensor, b: torch.Tensor, precision: str = "fp32") -> None:
    """Equal to rounding. int8 quantizes each product's input, so that attention's sums,
    taken in another order by the lean step, move a value across a quantization step now and
    then: a hypothesis's score then differs by up to a few tenths of a percent."""
    tolerance = 1e-2 if precision == "int8" else 1e-5
    torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_equal_decode_steps_through_joins(variant: str):
    """Greedy steps, rows that leave, and newcomers that join at their own positions."""
    lean, plain = _pair(**VARIANTS[variant])
    a, b = random_batch(seed=1, B=4), random_batch(seed=2, B=2)
    with torch.no_grad():
        for model in (lean, plain):
            memory = model.encode(a.src, a.src_pad_mask)
            state, prev, out = model.init_state(memory), torch.full((4,), 2), []
            for step in range(5):
                if step == 2:  # rows 1 and 3 leave, two newcomers join
                    keep = torch.tensor([0, 2])
                    memory, state, prev = keep_and_join(model, memory, state, prev, keep, b)
                logits, state, _ = model.decode_step(memory, state, prev)
                out.append(logits)
                prev = logits.argmax(1)
            model.out = out
            if model.cache_dtype is not None:
                assert memory.cross[0][0].dtype == model.cache_dtype
                cache = state.caches[0]
                assert getattr(cache, "self_k", torch.empty(0, dtype=model.cache_dtype)).dtype == (
                    model.cache_dtype
                )
    for x, y in zip(lean.out, plain.out, strict=True):
        assert x.dtype == torch.float32
        _close(x, y)


@pytest.mark.parametrize(
    "variant",
    ["pre-norm", "post-norm, gelu, output bias, untied", "keys and values in bf16", "ssru"],
)
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_searches_find_the_same_hypotheses(variant: str, precision: str):
    """Greedy and beam search (beams reordered at every step) with and without the lean step."""
    lean, plain = _pair(precision, **VARIANTS[variant])
    batch = random_batch(seed=3, B=5)
    for options in (SearchOptions(), SearchOptions(method=Beam(size=3, n_best=2))):
        found = []
        for model in (lean, plain):
            with torch.no_grad():
                if isinstance(options.method, Beam):
                    hyps = beam_search(model, batch.src, batch.src_pad_mask, options)
                else:
                    hyps = [
                        [h] for h in greedy_search(model, batch.src, batch.src_pad_mask, options)
                    ]
            found.append(hyps)
        for mine, theirs in zip(*found, strict=True):
            assert [h.tokens for h in mine] == [h.tokens for h in theirs]
            scores = [torch.tensor([h.score for h in hyps]) for hyps in (mine, theirs)]
            _close(*scores, precision)


@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16])
def test_attention_weights_are_asked_of_the_full_step(cache_dtype: torch.dtype | None):
    """With attention weights wanted, decode_step takes its own path (the lean one gives none),
    in the model's dtype whatever the caches'."""
    from attnmt.models.seq2seq import AttentionSpec

    lean, _ = _pair(cache_dtype=cache_dtype)
    batch = random_batch(seed=4, B=2)
    with torch.no_grad():
        memory = lean.encode(batch.src, batch.src_pad_mask)
        state = lean.init_state(memory)
        _, _, attn = lean.decode_step(memory, state, torch.full((2,), 2), AttentionSpec())
    assert attn is not None and attn.shape == (2, batch.src.size(1))
    assert attn.dtype == torch.float32


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_the_lean_step_keeps_the_matmul_backend(monkeypatch):
    """Under the oneDNN backend (`auto` on AMD CPUs with AVX-512) the lean step's products go
    to oneDNN too, with the model's step's results."""
    from attnmt.kernels import matmul

    monkeypatch.setattr(matmul, "ONEDNN_MIN_WORK", 0)
    lean, plain = _pair()
    batch = random_batch(seed=5, B=3)
    calls = []
    real = matmul._dnnl
    monkeypatch.setattr(matmul, "_dnnl", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad(), matmul.matmul_backend("onednn"):
        out = []
        for model in (lean, plain):
            memory = model.encode(batch.src, batch.src_pad_mask)
            state = model.init_state(memory)
            logits, _, _ = model.decode_step(memory, state, torch.full((3,), 2))
            out.append(logits)
            if model is lean:
                lean_calls, calls[:] = len(calls), []
    _close(*out)
    # every product of the step, as the model's own: q, k and v in one instead of three
    assert lean_calls == len(calls) - 2 * len(lean.decoder_layers) > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_cohorts_stepped_together_equal_their_own_steps(variant: str):
    """decode_cohorts: cohorts at different steps (one of beams reordered at every step,
    two rows per memory row) share each step's products and give what each one's own
    decode_step gives."""
    lean, plain = _pair(**VARIANTS[variant])
    a, b = random_batch(seed=6, B=3), random_batch(seed=7, B=2)
    with torch.no_grad():
        out = {}
        for model in (lean, plain):
            old = model.encode(a.src, a.src_pad_mask)
            old_state = model.select_state(
                model.init_state(old), torch.arange(3).repeat_interleave(2)
            )
            new, new_state = None, None
            logits_all = []
            for step in range(4):
                if step == 2:  # the second cohort joins
                    new = model.encode(b.src, b.src_pad_mask)
                    new_state = model.init_state(new)
                memories, states = [old], [old_state]
                if new is not None:
                    memories.append(new)
                    states.append(new_state)
                sizes = [6] + ([2] if new is not None else [])
                prev = torch.arange(sum(sizes)) % 7 + 4
                if model is lean:
                    logits, states, _ = model.decode_cohorts(memories, states, prev, sizes)
                else:  # each cohort its own step
                    steps = [model.decode_step(m, s, p) for m, s, p in
                             zip(memories, states, prev.split(sizes), strict=True)]  # fmt: skip
                    logits = torch.cat([x for x, _, _ in steps])
                    states = [s for _, s, _ in steps]
                logits_all.append(logits)
                flip = torch.tensor([1, 1, 3, 2, 4, 5])  # each sentence's beams reordered
                old_state = model.select_state(states[0], flip)
                new_state = states[1] if new is not None else None
            out[model is lean] = logits_all
    for x, y in zip(out[True], out[False], strict=True):
        _close(x, y)
