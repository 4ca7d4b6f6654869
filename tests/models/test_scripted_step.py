"""models.scripted_step: an int8 Transformer's decoder layers (self-attention or SSRU) as a
TorchScript graph step as the lean step's Python form does, through joins at their own
positions, rows that leave, cohorts stepped together and beams reordered at every step; other
models keep the Python form."""

from __future__ import annotations

import copy

import pytest
import torch

from attnmt.decoding.beam import beam_search
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.search import Beam, SearchOptions
from attnmt.models import lean_step

from helpers import keep_and_join, random_batch, tiny_model

VARIANTS = {
    "pre-norm": {},
    "post-norm, gelu": {"norm": "post", "activation": "gelu"},
    "swish, keys and values in bf16": {"activation": "swish", "cache_dtype": torch.bfloat16},
    "ssru": {"decoder": "ssru"},
    "ssru, post-norm": {"decoder": "ssru", "norm": "post"},
}


def _int8(cache_dtype: torch.dtype | None = None, **overrides) -> torch.nn.Module:
    model = for_decoding(tiny_model("transformer", **overrides).eval(), "int8")
    if cache_dtype is not None:
        model.cache_dtype = cache_dtype
    return model


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps the graph runs."""
    calls: list[int] = []
    real = lean_step._run_graph
    monkeypatch.setattr(lean_step, "_run_graph", lambda *a: calls.append(1) or real(*a))
    return calls


def _join_and_cohort_steps(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of 5 steps: 4 rows; at step 2 rows 1 and 3 leave and two join at their own
    positions; from step 3 on a second cohort (beams reordered) steps beside them."""
    a, b, c = (random_batch(seed=s, B=n) for s, n in ((1, 4), (2, 2), (3, 2)))
    memory = model.encode(a.src, a.src_pad_mask)
    state, prev, out = model.init_state(memory), torch.full((4,), 2), []
    other, other_state = None, None
    for step in range(5):
        if step == 2:
            keep = torch.tensor([0, 2])
            memory, state, prev = keep_and_join(model, memory, state, prev, keep, b)
        if step == 3:  # a cohort of two sentences, two beams each
            other = model.encode(c.src, c.src_pad_mask)
            other_state = model.select_state(model.init_state(other), torch.tensor([0, 0, 1, 1]))
        if other is None:
            logits, state, _ = model.decode_step(memory, state, prev)
        else:
            both = torch.cat([prev, torch.tensor([5, 6, 7, 8])])
            logits, (state, other_state), _ = model.decode_cohorts(
                [memory, other], [state, other_state], both, [4, 4]
            )
            other_state = model.select_state(other_state, torch.tensor([1, 0, 3, 3]))
        out.append(logits)
        prev = logits[:4].argmax(1)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_graph_steps_as_the_python_form(variant: str, monkeypatch: pytest.MonkeyPatch):
    graphed = _int8(**VARIANTS[variant])
    python = copy.deepcopy(graphed)
    python.lean_step.scripted = False
    calls = _counted(monkeypatch)
    with torch.no_grad():
        mine = _join_and_cohort_steps(graphed)
        assert len(calls) == 5  # every step by the graph
        theirs = _join_and_cohort_steps(python)
        assert len(calls) == 5
    for x, y in zip(mine, theirs, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["pre-norm", "ssru"])
def test_beam_search_by_the_graph_finds_the_same_hypotheses(
    variant: str, monkeypatch: pytest.MonkeyPatch
):
    graphed = _int8(**VARIANTS[variant])
    python = copy.deepcopy(graphed)
    python.lean_step.scripted = False
    calls = _counted(monkeypatch)
    batch = random_batch(seed=4, B=5)
    options = SearchOptions(method=Beam(size=3, n_best=2))
    with torch.no_grad():
        found = [beam_search(m, batch.src, batch.src_pad_mask, options) for m in (graphed, python)]
    assert calls
    for mine, theirs in zip(*found, strict=True):
        assert [h.tokens for h in mine] == [h.tokens for h in theirs]
        assert [h.score for h in mine] == pytest.approx([h.score for h in theirs], abs=1e-5)


@pytest.mark.parametrize(
    "model",
    [
        lambda: for_decoding(tiny_model("transformer").eval(), "fp32"),  # fp32: no gain
        lambda: for_decoding(tiny_model("transformer", decoder="ssru").eval(), "fp32"),
        lambda: _int8(positions="rope"),
    ],
    ids=["fp32", "fp32 ssru", "int8 rope"],
)
def test_models_the_graph_does_not_cover_keep_the_python_form(model, monkeypatch):
    model = model()
    calls = _counted(monkeypatch)
    batch = random_batch(seed=5, B=2)
    with torch.no_grad():
        memory = model.encode(batch.src, batch.src_pad_mask)
        model.decode_step(memory, model.init_state(memory), torch.full((2,), 2))
    assert model.lean_step.graph() is None and not calls


def test_no_graph_with_a_gradient_and_a_copy_makes_its_own(monkeypatch: pytest.MonkeyPatch):
    model = _int8()
    calls = _counted(monkeypatch)
    batch = random_batch(seed=6, B=2)
    memory = model.encode(batch.src, batch.src_pad_mask)
    model.decode_step(memory, model.init_state(memory), torch.full((2,), 2))
    assert not calls  # gradient enabled: the Python form
    with torch.no_grad():
        model.decode_step(memory, model.init_state(memory), torch.full((2,), 2))
    assert len(calls) == 1
    copied = copy.deepcopy(model)
    assert copied.lean_step._graph is False  # made again at its first use
    assert copied.lean_step.graph() is not None


def test_without_torchscript_the_python_form_decodes(monkeypatch: pytest.MonkeyPatch):
    """Where TorchScript cannot compile (no source files installed), the step is the Python
    form's, with its results."""

    def fails(_module: torch.nn.Module) -> None:
        raise OSError("could not get source code")

    graphed = _int8()
    python = copy.deepcopy(graphed)
    monkeypatch.setattr(torch.jit, "script", fails)
    calls = _counted(monkeypatch)
    python.lean_step.scripted = False
    with torch.no_grad():
        mine, theirs = _join_and_cohort_steps(graphed), _join_and_cohort_steps(python)
    assert graphed.lean_step.graph() is None and not calls
    for x, y in zip(mine, theirs, strict=True):
        torch.testing.assert_close(x, y)
