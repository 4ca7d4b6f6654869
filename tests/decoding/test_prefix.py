"""Prefix-constrained decoding: translations that start with given words (interactive MT)."""

from __future__ import annotations

import httpx
import pytest

from attnmt import Translator
from attnmt.decoding.search import Beam, Greedy, SearchOptions
from attnmt.decoding.translate import search_lines
from attnmt.errors import AttnmtError
from attnmt.serve.schema import Limits

from conftest import make_pairs, write_lines
from helpers import start_server

LINES = make_pairs(30, 5)[0]


@pytest.mark.parametrize("method", [Greedy(), Beam(4, length_penalty=1.0)])
def test_the_models_own_start_as_prefix_changes_nothing(trained, method):
    translator = Translator.load(trained[0], device="cpu")
    tok, model = translator.tokenizer, translator.model
    options = SearchOptions(method, max_len_a=0.0, max_len_b=12)
    free = search_lines(model, tok, LINES, options, batch_tokens=400)
    # Each line's own first pieces (two, or all if shorter) as its prefix: the same outputs.
    heads = [[tok.tgt.sp.piece_to_id(p) for p in r[0].tgt_pieces[:2] if p != "</s>"] for r in free]
    forced = search_lines(model, tok, LINES, options, batch_tokens=400, target_prefix=heads)
    assert [r[0].text for r in forced] == [r[0].text for r in free]
    assert [r[0].score for r in forced] == pytest.approx([r[0].score for r in free], rel=1e-5)


@pytest.mark.parametrize("beam", [1, 3])
def test_every_translation_starts_with_its_prefix(trained, beam):
    translator = Translator.load(trained[0], device="cpu")
    prefixes = ["t7 t7 t7", "", "t1"] * 10
    found = translator.translate(LINES, beam=beam, prefix=prefixes)
    for text, prefix in zip(found, prefixes, strict=True):
        assert text.startswith(prefix), (text, prefix)
    draws = translator.hypotheses(LINES[:3], n_best=2, sampling=(1.0, 0, 7), prefix=prefixes[:3])
    assert all(h.text.startswith(p) for hs, p in zip(draws, prefixes[:3], strict=True) for h in hs)
    with pytest.raises(AttnmtError, match="prefix: 2 prefixes for 30 lines"):
        translator.translate(LINES, prefix=["a", "b"])


def test_prefix_from_the_cli_and_over_http(trained, tmp_path, run_cli):
    model = trained[0]
    src = write_lines(tmp_path / "src.txt", LINES[:4])
    pre = write_lines(tmp_path / "prefix.txt", ["t9", "", "t2 t2", "t5"])
    r = run_cli("translate", "-m", str(model), "-i", str(src), "--prefix", str(pre))
    assert r.code == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("t9") and out[2].startswith("t2 t2") and out[3].startswith("t5")
    short = write_lines(tmp_path / "short.txt", ["t9"])
    r = run_cli("translate", "-m", str(model), "-i", str(src), "--prefix", str(short))
    assert r.code == 2 and "--prefix: 1 lines, fewer than the input's" in r.stderr
    translator = Translator.load(model, device="cpu")
    for url in start_server(translator, Limits()):
        body = {"text": LINES[:2], "prefix": ["t3 t3", ""], "beam": 2}
        reply = httpx.post(f"{url}/translate", json=body, timeout=60).json()
        assert reply["translations"][0].startswith("t3 t3"), reply
        assert reply["translations"] == out[:0] + translator.translate(
            LINES[:2], beam=2, prefix=["t3 t3", ""]
        )
        bad = httpx.post(f"{url}/translate", json={"text": ["w1"], "prefix": ["a", "b"]})
        assert bad.status_code == 422 and "prefix: 2 prefixes for 1 lines" in bad.json()["error"]
