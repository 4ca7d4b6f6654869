"""attnmt score (forced decoding) and eval's TER and multiple references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu

from attnmt import Translator

from conftest import make_pairs, write_lines

LINES = make_pairs(30, 17)[0]


def test_forced_decoding_gives_the_search_its_own_scores(trained):
    """A beam hypothesis's raw score (length penalty 0) is its log-probability: forced
    decoding of the same pieces must give it back; an ensemble of a model with itself too."""
    model, _ = trained
    one, two = Translator.load(model, device="cpu"), Translator.load([model, model], device="cpu")
    best = [h[0] for h in one.hypotheses(LINES, beam=3, n_best=2, length_penalty=0.0)]
    forced = one.score_pairs(LINES, [h.text for h in best])
    same_pieces = 0
    for line, h, f in zip(LINES, best, forced, strict=True):
        pieces = [*one.tokenizer.tgt.pieces(one.tokenizer.tgt.encode([h.text])[0]), "</s>"]
        if pieces != h.tgt_pieces or not line.strip():  # re-encoding may segment otherwise
            continue
        same_pieces += 1
        assert f.log_prob == pytest.approx(h.score, abs=1e-4) and f.pieces == len(pieces)
    assert same_pieces >= 20
    again = two.score_pairs(LINES, [h.text for h in best])
    assert [f.log_prob for f in again] == pytest.approx([f.log_prob for f in forced], abs=1e-5)


def test_score_from_the_cli(trained, tmp_path: Path, run_cli):
    model, corpus = trained
    src, tgt = corpus["dev_src"], corpus["dev_tgt"]
    r = run_cli("score", "-m", str(model), "-s", str(src), "-t", str(tgt))
    assert r.code == 0, r.stderr
    sums = [float(x) for x in r.stdout.split()]
    assert len(sums) == 20 and all(x < 0 for x in sums)
    r = run_cli("score", "-m", str(model), "-s", str(src), "-t", str(tgt), "--normalize")
    want = Translator.load(model).score_pairs(src.read_text().splitlines(),
                                              tgt.read_text().splitlines())  # fmt: skip
    assert [float(x) for x in r.stdout.split()] == pytest.approx(
        [f.per_piece for f in want], abs=1e-4
    )
    short = write_lines(tmp_path / "short.txt", ["t1"])
    r = run_cli("score", "-m", str(model), "-s", str(src), "-t", str(short))
    assert r.code == 2 and "line counts differ" in r.stderr


def test_eval_scores_ter_and_several_references(tmp_path: Path, run_cli):
    _hyps, refs = make_pairs(40, 3)
    other = [r.replace("t1", "t2") for r in refs]
    h, r1, r2 = (write_lines(tmp_path / n, x) for n, x in (("h", refs[::-1]), ("r1", refs),
                                                          ("r2", other)))  # fmt: skip
    out = run_cli("eval", "--hyp", str(h), "--ref", str(r1), "--ref", str(r2), "--json")
    assert out.code == 0, out.stderr
    got = json.loads(out.stdout)
    mine = refs[::-1]
    assert got["bleu"] == round(sacrebleu.corpus_bleu(mine, [refs, other]).score, 2)
    assert got["ter"] == round(sacrebleu.corpus_ter(mine, [refs, other]).score, 2)
    assert got["ter_signature"].startswith("nrefs:2|")
    text = run_cli("eval", "--hyp", str(h), "--ref", str(r1)).stdout
    assert f"TER = {sacrebleu.corpus_ter(mine, [refs]).score:.2f}" in text
    bad = write_lines(tmp_path / "bad", refs[:3])
    out = run_cli("eval", "--hyp", str(h), "--ref", str(r1), "--ref", str(bad))
    assert out.code == 2 and "3 lines, but the first reference has 40" in out.stderr
