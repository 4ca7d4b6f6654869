"""models.compiled_step: the decoder's layers compiled ahead of time (AOTInductor) decode what
the lean step decodes (greedy, and beam search with its beams reordered), are compiled once
and then loaded from the cache folder, and step aside with one line where no compiler is
found; `attnmt translate --compile` gives the uncompiled output."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from attnmt.decoding.beam import beam_search
from attnmt.decoding.greedy import greedy_search
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.search import Beam, SearchOptions
from attnmt.models import compiled_step, lean_step

from helpers import keep_and_join, random_batch, tiny_model

needs_compiler = pytest.mark.skipif(
    compiled_step._compiler_missing() is not None, reason="no C++ compiler (g++) here"
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of the test's own."""
    monkeypatch.setenv("ATTNMT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "steps"


@pytest.fixture
def shared(compile_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The suite's cache folder (conftest.compile_cache): the same tiny models compile once."""
    monkeypatch.setenv("ATTNMT_CACHE", str(compile_cache))
    return compile_cache / "steps"


def _compiled(monkeypatch, precision: str = "fp32", **overrides) -> tuple:
    """A tiny Transformer with its compiled step, the same without, and the list of what each
    step's _run_compiled returned (None: it stepped aside)."""
    model = for_decoding(tiny_model("transformer", **overrides).eval(), precision)
    plain = copy.deepcopy(model)
    compiled_step.attach(model, precision)
    ran: list = []
    run = lean_step._run_compiled
    monkeypatch.setattr(lean_step, "_run_compiled", lambda *a: ran.append(r := run(*a)) or r)
    return model, plain, ran


def _searches(model: torch.nn.Module) -> list[list]:
    batch = random_batch(seed=3, B=5)
    found = []
    with torch.no_grad():
        greedy = greedy_search(model, batch.src, batch.src_pad_mask, SearchOptions())
        found.append([[h] for h in greedy])
        beam = SearchOptions(method=Beam(size=3, n_best=2))
        found.append(beam_search(model, batch.src, batch.src_pad_mask, beam))
    return found


def _same(mine: list[list], theirs: list[list]) -> None:
    for a, b in zip(mine, theirs, strict=True):
        for hyps, others in zip(a, b, strict=True):
            assert [h.tokens for h in hyps] == [h.tokens for h in others]
            scores = [torch.tensor([h.score for h in x]) for x in (hyps, others)]
            torch.testing.assert_close(*scores, rtol=1e-4, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm": "post", "activation": "gelu", "output_bias": True, "tie_embeddings": False},
        {"decoder": "ssru"},
    ],
    ids=["pre-norm", "post-norm, gelu", "ssru"],
)
def test_compiled_layers_find_the_lean_steps_hypotheses(overrides, shared, monkeypatch, capsys):
    model, plain, ran = _compiled(monkeypatch, **overrides)
    assert model.lean_step.compiled is not None
    capsys.readouterr()
    _same(_searches(model), _searches(plain))
    assert ran and all(r is not None for r in ran)  # every step, greedy's and the beams'
    # A second model from the same weights loads the package from the cache, not compiling.
    again = for_decoding(tiny_model("transformer", **overrides).eval(), "fp32")
    compiled_step.attach(again, "fp32")
    assert "compiling" not in capsys.readouterr().err
    assert again.lean_step.compiled.path == model.lean_step.compiled.path
    assert model.lean_step.compiled.path.parent == shared


@needs_compiler
def test_int8_layers_compiled_step_as_int8_does(shared, monkeypatch):
    """int8: the compiled products quantize each input row symmetrically where fbgemm quantizes
    a call's input asymmetrically; a step's logits agree with the lean step's to int8's
    rounding, along the same tokens (the fp32 model's greedy ones)."""
    fp32 = for_decoding(tiny_model("transformer").eval(), "fp32")
    model, plain, ran = _compiled(monkeypatch, "int8")
    batch = random_batch(seed=5, B=4)
    tokens = [torch.full((4,), 2)]  # BOS, then the fp32 model's greedy tokens
    found = []
    with torch.no_grad():
        for m in (fp32, model, plain):
            memory = m.encode(batch.src, batch.src_pad_mask)
            state, out = m.init_state(memory), []
            for step in range(5):
                logits, state, _ = m.decode_step(memory, state, tokens[step])
                out.append(logits)
                if m is fp32:
                    tokens.append(logits.argmax(1))
            found.append(torch.stack(out))
    assert len(ran) == 5 and all(r is not None for r in ran)
    fp32_logits, compiled, lean = found
    scale = fp32_logits.abs().max()
    assert (compiled - lean).abs().max() < 0.05 * scale
    assert (compiled - fp32_logits).abs().max() < 0.05 * scale


@needs_compiler
def test_rows_that_join_a_running_pool_step_as_with_the_lean_step(shared, monkeypatch):
    """A server's greedy pool: rows leave, newcomers join at their own positions (masked)."""
    model, plain, ran = _compiled(monkeypatch)
    a, b = random_batch(seed=1, B=4), random_batch(seed=2, B=2)
    found = []
    with torch.no_grad():
        for m in (model, plain):
            memory = m.encode(a.src, a.src_pad_mask)
            state, prev, out = m.init_state(memory), torch.full((4,), 2), []
            for step in range(7):
                if step == 2:  # rows 1 and 3 leave, two newcomers join
                    keep = torch.tensor([0, 2])
                    memory, state, prev = keep_and_join(m, memory, state, prev, keep, b)
                if step == 4:  # the first rows leave: the caches' first positions are no row's
                    keep = torch.tensor([2, 3])
                    memory, state = m.keep_rows(memory, state, keep)
                    prev = prev[keep]
                    assert state.caches[0].room.start > 0
                logits, state, _ = m.decode_step(memory, state, prev)
                out.append(logits)
                prev = logits.argmax(1)
            found.append(out)
    assert len(ran) == 7 and all(r is not None for r in ran)
    for x, y in zip(*found, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _cohort_steps(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of 5 steps: 4 rows; at step 2 rows 1 and 3 leave and two join at their own
    positions; from step 3 on a second cohort (two sentences, two beams each, reordered)
    steps beside them (beam search's pool)."""
    a, b, c = (random_batch(seed=s, B=n) for s, n in ((1, 4), (2, 2), (3, 2)))
    memory = model.encode(a.src, a.src_pad_mask)
    state, prev, out = model.init_state(memory), torch.full((4,), 2), []
    other, other_state = None, None
    for step in range(5):
        if step == 2:
            keep = torch.tensor([0, 2])
            memory, state, prev = keep_and_join(model, memory, state, prev, keep, b)
        if step == 3:
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


@needs_compiler
@pytest.mark.parametrize("overrides", [{}, {"decoder": "ssru"}], ids=["pre-norm", "ssru"])
def test_cohorts_step_by_the_compiled_layers_as_by_the_lean_step(overrides, shared, monkeypatch):
    """Cohorts (beam search's pool): one compiled call each, nothing written where one of them
    cannot be taken."""
    model, plain, ran = _compiled(monkeypatch, **overrides)
    with torch.no_grad():
        mine, theirs = _cohort_steps(model), _cohort_steps(plain)
    assert len(ran) == 5 and all(r is not None for r in ran)
    assert [len(caches) for _, caches in ran] == [1, 1, 1, 2, 2]
    for x, y in zip(mine, theirs, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_a_package_for_several_threads_serves_any_count(shared, monkeypatch, capsys):
    """Compiled on 2 threads, its loops take the threads decoding has when they run: a load
    on 3 threads takes the same package, and decodes on 1 as the lean step does."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model, plain, ran = _compiled(monkeypatch)
        torch.set_num_threads(3)
        capsys.readouterr()
        again = for_decoding(tiny_model("transformer").eval(), "fp32")
        compiled_step.attach(again, "fp32")
        assert again.lean_step.compiled.path == model.lean_step.compiled.path
        assert "compiling" not in capsys.readouterr().err
        torch.set_num_threads(1)
        _same(_searches(again), _searches(plain))
        assert ran and all(r is not None for r in ran)  # every step by the package
        one = for_decoding(tiny_model("transformer").eval(), "fp32")
        compiled_step.attach(one, "fp32")  # serial loops: a package of its own
        assert one.lean_step.compiled.path != model.lean_step.compiled.path
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_a_cached_package_loads_without_importing_the_compiler(shared, monkeypatch):
    """Loading a package imports no Inductor (a second of every process's start)."""
    model, _, _ = _compiled(monkeypatch)
    code = (
        "import sys; sys.path.insert(0, 'tests'); from helpers import tiny_model; "
        "from attnmt.decoding.precision import for_decoding; "
        "m = for_decoding(tiny_model('transformer').eval(), 'fp32', compile=True); "
        "print(m.lean_step.compiled.path.name, 'torch._inductor' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [model.lean_step.compiled.path.name, "False"]
    assert "compiling" not in done.stderr


def test_without_a_compiler_decoding_goes_on_and_says_why(cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, no g++
    monkeypatch.setenv("CXX", "c++")
    model = for_decoding(tiny_model("transformer").eval(), "fp32")
    plain = copy.deepcopy(model)
    compiled_step.attach(model, "fp32")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not used (no C++ compiler" in err
    assert model.lean_step.compiled is None
    _same(_searches(model), _searches(plain))


@pytest.mark.parametrize(
    ("arch", "precision", "why"),
    [
        ("transformer", "bf16", "fp32 and int8 on the CPU only"),
        ("rnn", "fp32", "a Transformer's decoder"),
    ],
)
def test_what_it_does_not_compile_is_said(arch, precision, why, cache, capsys):
    model = for_decoding(tiny_model(arch).eval(), precision)
    compiled_step.attach(model, precision)
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1
    assert not cache.exists()


@needs_compiler
def test_translate_compiles_by_default_and_gives_the_same_lines(
    trained, run_cli, cache, monkeypatch
):
    """Compiled by default (once: the second run loads it), --no-compile and ATTNMT_COMPILE=0
    decode as before; the same lines every way, and no DeprecationWarning from attnmt's code
    (warnings as errors: TorchScript's, before the compiled step replaced it)."""
    model, corpus = trained
    lines = ["-m", str(model), "-i", str(corpus["dev_src"])]
    plain = run_cli("translate", *lines)  # ATTNMT_COMPILE=0 (conftest)
    assert "compiled step" not in plain.stderr and not cache.exists()
    monkeypatch.delenv("ATTNMT_COMPILE")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module="attnmt")
        runs = [run_cli("translate", *lines, *extra) for extra in ([], [], ["--no-compile"])]
    first, second, off = runs
    assert first.code == 0 and "compiled step: compiled in" in first.stderr
    assert second.code == 0 and "compil" not in second.stderr  # loaded from the cache
    assert "compil" not in off.stderr and len(list(cache.glob("*.pt2"))) == 1
    assert first.stdout == second.stdout == off.stdout == plain.stdout


def test_by_default_models_it_does_not_compile_say_nothing(cache, monkeypatch, capsys):
    monkeypatch.delenv("ATTNMT_COMPILE")
    for arch, precision in (("rnn", "fp32"), ("transformer", "bf16")):
        for_decoding(tiny_model(arch).eval(), precision, compile=None)
    assert capsys.readouterr().err == "" and not cache.exists()
