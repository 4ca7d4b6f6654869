"""Lexically constrained beam search (dynamic beam allocation): phrases that must appear."""

from __future__ import annotations

import pytest
import torch

from attnmt import Translator
from attnmt.decoding.batch import decode
from attnmt.decoding.constraints import Constraints, Phrases
from attnmt.decoding.search import Beam, SearchOptions
from attnmt.decoding.translate import search_lines

from conftest import make_pairs
from helpers import random_batch, tiny_model

LINES = make_pairs(24, 5)[0]


def test_a_rows_progress_through_its_phrases():
    # One sentence, one beam, phrases [5 6 7] and [9].
    c = Constraints(Phrases([[[5, 6, 7], [9]]]), K=1, device=torch.device("cpu"))
    assert c.next_tokens().tolist() == [[5, 9]]
    step = c.advance(torch.tensor([0]), torch.tensor([5]), 2)
    c.cur, c.pos, c.met = step
    assert (c.cur.item(), c.pos.item()) == (0, 1) and c.next_tokens().tolist() == [[6, -1]]
    # Another token abandons the phrase (its progress no longer counts); 9 meets the second.
    cur, pos, met = c.advance(torch.tensor([0]), torch.tensor([9]), 2)
    assert (cur.item(), pos.item(), met.tolist()) == (-1, 0, [[False, True]])
    c.cur, c.pos, c.met = c.advance(torch.tensor([0]), torch.tensor([6]), 2)
    c.cur, c.pos, c.met = c.advance(torch.tensor([0]), torch.tensor([7]), 2)
    assert c.met.tolist() == [[True, False]] and c.unmet().tolist() == [1]
    logp = torch.zeros(1, 12)
    c.forbid_eos(logp, eos_id=2)
    assert logp[0, 2] == -torch.inf  # [9] is still missing: no end yet


def phrase_ids(translator: Translator, phrases: list[list[str]]) -> list[list[list[int]]]:
    sp = translator.tokenizer.tgt
    return [[sp.encode([p])[0] for p in line] for line in phrases]


@pytest.mark.parametrize("n_best", [1, 3])
def test_every_translation_holds_its_constraints(trained, n_best):
    translator = Translator.load(trained[0], device="cpu")
    tok, model = translator.tokenizer, translator.model
    phrases = [["t3"], ["t8 t2", "t5"], []] * 8
    options = SearchOptions(Beam(4, 1.0, n_best), max_len_a=2.0, max_len_b=8)
    ids = phrase_ids(translator, phrases)
    found = search_lines(model, tok, LINES, options, batch_tokens=200, constraints=ids)
    for line, results in zip(phrases, found, strict=True):
        assert len(results) == n_best
        assert results[0].unmet == 0, (line, results[0].text)
        for r in results:  # an n-best list's others may be cut by the length limit
            assert r.unmet > 0 or all(f" {p} " in f" {r.text} " for p in line), (line, r.text)


def test_lines_without_constraints_translate_as_without_the_option(trained):
    """A line with no phrase in a batch of constrained lines: the same translation and
    score as plain beam search (the constrained candidates are a superset of the usual
    ones, and with one bank the allocation is by score)."""
    translator = Translator.load(trained[0], device="cpu")
    tok, model = translator.tokenizer, translator.model
    options = SearchOptions(Beam(4, 1.0, 2), max_len_a=2.0, max_len_b=8)
    free = search_lines(model, tok, LINES, options, batch_tokens=10_000)
    phrases = phrase_ids(translator, [["t4"] if i % 2 else [] for i in range(len(LINES))])
    mixed = search_lines(model, tok, LINES, options, batch_tokens=10_000, constraints=phrases)
    for i in range(0, len(LINES), 2):
        assert [r.text for r in mixed[i]] == [r.text for r in free[i]]
        assert [r.score for r in mixed[i]] == pytest.approx([r.score for r in free[i]], rel=1e-5)


@pytest.mark.parametrize("arch", ["rnn", "transformer"])
def test_an_untrained_model_of_either_architecture_meets_them_too(arch):
    model = tiny_model(arch).eval()
    batch = random_batch(3, B=4)
    wanted = [[[7, 8, 9]], [[4], [11, 12]], [], [[20, 20]]]
    options = SearchOptions(Beam(5, 1.0, 1), max_len_a=0.0, max_len_b=12)
    found = decode(model, batch.src, batch.src_pad_mask, options, constraints=Phrases(wanted))
    for phrases, (hyp,) in zip(wanted, found, strict=True):
        text = f" {' '.join(map(str, hyp.tokens))} "
        assert all(f" {' '.join(map(str, p))} " in text for p in phrases), (phrases, hyp.tokens)
        assert hyp.unmet == 0  # (an untrained model seldom ends: the limit stops it)


def test_the_length_limit_before_the_constraints_is_said(trained, capsys):
    translator = Translator.load(trained[0], device="cpu")
    tok, model = translator.tokenizer, translator.model
    options = SearchOptions(Beam(3, 1.0, 1), max_len_a=0.0, max_len_b=2)
    ids = phrase_ids(translator, [["t1 t2 t3 t4"], []])
    found = search_lines(model, tok, LINES[:2], options, batch_tokens=200, constraints=ids)
    assert found[0][0].unmet == 1 and found[1][0].unmet == 0
    assert "input line 1: 1 of 1 constraints not met" in capsys.readouterr().err


def test_an_ensemble_meets_them_as_one_model_does(trained):
    one = Translator.load(trained[0], device="cpu")
    pair = Translator.load([trained[0], trained[0]], device="cpu")
    phrases = [["t3"], ["t8 t2"], []] * 3
    found = pair.translate(LINES[:9], beam=4, constraints=phrases)
    assert found == one.translate(LINES[:9], beam=4, constraints=phrases)
    assert all(f" {p} " in f" {t} " for t, line in zip(found, phrases, strict=True) for p in line)
