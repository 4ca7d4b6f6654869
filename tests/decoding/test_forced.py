"""attnmt score (forced decoding) and eval's TER and multiple references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu
import torch

from attnmt import Translator
from attnmt.data.batches import pad_sequences
from attnmt.data.tokenizer import EOS_ID, PAD_ID
from attnmt.decoding.batch import decode
from attnmt.decoding.forced import force_decode
from attnmt.decoding.search import Beam, SearchOptions

from conftest import make_pairs, write_lines

LINES = make_pairs(30, 17)[0]


def test_forced_decoding_gives_the_search_its_own_scores(trained):
    """A beam hypothesis's raw score (length penalty 0) is its log-probability: forced
    decoding of the same pieces must give it back; an ensemble of a model with itself too."""
    model, _ = trained
    one, two = Translator.load(model, device="cpu"), Translator.load([model, model], device="cpu")
    src = [[*ids, EOS_ID] for ids in one.tokenizer.src.encode(LINES)]
    tokens = pad_sequences(src, PAD_ID)
    options = SearchOptions(Beam(3, length_penalty=0.0), max_len_b=12)
    with torch.inference_mode():
        found = [h[0] for h in decode(one.model, tokens, tokens == PAD_ID, options)]
    targets = pad_sequences([h.tokens + [EOS_ID] * h.ended for h in found], PAD_ID)
    forced = force_decode(one.model, tokens, targets)
    assert forced.tolist() == pytest.approx([h.score for h in found], abs=1e-4)
    assert torch.allclose(force_decode(two.model, tokens, targets), forced, atol=1e-5)
    # From text: the same figures where the text re-encodes to the search's pieces.
    texts = [one.tokenizer.tgt.decode(h.tokens) for h in found]
    by_text = one.score_pairs(LINES, texts)
    for h, text, f, want in zip(found, texts, by_text, forced.tolist(), strict=True):
        if one.tokenizer.tgt.encode([text])[0] == h.tokens and h.ended:
            assert f.log_prob == pytest.approx(want, abs=1e-4) and f.pieces == len(h.tokens) + 1


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
