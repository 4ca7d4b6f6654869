"""Never lose a run, part 5 (issue 55), what decoding is given: constraints, terms, markup,
prefixes and the API's arguments, each test named after its item."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save_file

from attnmt import Translator
from attnmt.decoding.shortlist import SHORTLIST_FILE, Shortlist
from attnmt.decoding.terminology import Terminology, read_constraints
from attnmt.errors import AttnmtError, CheckpointError, DataError, TooMuchWork
from attnmt.serve.schema import Limits

from conftest import write_lines
from helpers import assert_user_error, start_server

# 40 terms, each with a target of its own (two pieces the toy model can write).
TERMS = [(f"a{k}", f"t{k // 12} t{k % 12}") for k in range(40)]
MANY_TERMS_LINE = " ".join(source for source, _ in TERMS)


@pytest.fixture(scope="module")
def translator(trained) -> Translator:
    return Translator.load(trained[0], "cpu")


def test_3_a_constraint_longer_than_any_output_is_refused_at_once(translator):
    phrase = "t1 " * 400_000  # 1.2 MB, every piece one the model can write
    start = time.monotonic()
    with pytest.raises(TooMuchWork, match=r"line 1: constraints of [\d,]+ pieces; no output"):
        translator.search(["w1"], translator.options(2), constraints=[[phrase]])
    assert time.monotonic() - start < 10


def test_4_terms_beyond_the_cap_are_one_line_in_the_cli(trained, tmp_path, run_cli):
    terms = write_lines(tmp_path / "t.tsv", [f"{s}\t{t}" for s, t in TERMS])
    src = write_lines(tmp_path / "in.txt", ["w1", MANY_TERMS_LINE])
    start = time.monotonic()
    r = run_cli("translate", "-m", str(trained[0]), "-i", str(src), "--beam", "2",
                "--terminology", str(terms))  # fmt: skip
    assert_user_error(r, "line 2: 40 constraints and terms; at most 32")
    assert time.monotonic() - start < 30


def test_4_terms_beyond_the_cap_are_413_over_http(trained, tmp_path):
    terms = write_lines(tmp_path / "t.tsv", [f"{s}\t{t}" for s, t in TERMS])
    translator = Translator.load(trained[0], "cpu", terminology=terms)
    for url in start_server(translator, Limits(), access_log=False):
        r = httpx.post(f"{url}/translate", json={"text": [MANY_TERMS_LINE], "beam": 2}, timeout=30)
        assert r.status_code == 413 and "at most 32" in r.json()["error"]
        ok = httpx.post(f"{url}/translate", json={"text": ["a1 a2 w3"], "beam": 2}, timeout=30)
        assert ok.status_code == 200 and "t0 t1" in ok.json()["translations"][0]


def test_5_deep_markup_is_refused_and_fails_no_batch_mate(translator):
    deep = "<a>" * 400 + "x"
    body = {"beam": 2, "markup": True}
    for url in start_server(translator, Limits(batch_wait_ms=50), access_log=False):

        def post(text: str, url: str = url) -> httpx.Response:
            return httpx.post(f"{url}/translate", json={**body, "text": [text]}, timeout=60)

        innocent = [f"<b>w{i % 12}</b> w{(i + 1) % 12}" for i in range(11)]
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(post, [*innocent[:5], deep, *innocent[5:]]))
        assert answers[5].status_code == 422 and "nested more than 64" in answers[5].text
        assert [a.status_code for i, a in enumerate(answers) if i != 5] == [200] * 11
        for a in answers[:5] + answers[6:]:
            assert a.json()["translations"][0].count("<b>") == 1


def test_5_deep_markup_in_the_cli_is_one_line(trained, tmp_path, run_cli):
    src = write_lines(tmp_path / "in.html", ["<b>w1</b>", "<i>" * 1000 + "w2"])
    r = run_cli("translate", "-m", str(trained[0]), "-i", str(src), "--markup")
    assert_user_error(r, "markup: tags nested more than 64 deep")


def test_7_the_api_refuses_none_dicts_and_generators_as_lists(translator):
    options = translator.options(2)
    for bad in ({"t1": 1}, (c for c in [["t1"]]), "t1", [None], [{"t1": 1}], ["t1"]):
        with pytest.raises(AttnmtError, match="constraints"):
            translator.search(["w1"], options, constraints=bad)
    for bad in ({"w1": ""}, (p for p in ["t1"]), [None]):
        with pytest.raises(AttnmtError, match="prefix"):
            translator.search(["w1"], options, prefix=bad)
    assert len(translator.search(["w1"], options, prefix=None, constraints=None)) == 1


def test_7_deeply_nested_json_is_one_line(trained, tmp_path, translator):
    nested = write_lines(tmp_path / "c.jsonl", ["[" * 100_000 + "]" * 100_000])
    with pytest.raises(DataError, match=r"c\.jsonl:1: JSON nested too deeply"):
        list(read_constraints(nested))
    for url in start_server(translator, Limits(), access_log=False):
        body = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
        r = httpx.post(f"{url}/translate", content=body,
                       headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert r.status_code == 422 and "nested too deeply" in r.json()["error"]


def test_7_a_tampered_shortlist_is_one_line(trained, tmp_path):
    path = tmp_path / SHORTLIST_FILE
    table = torch.zeros(40, 3, dtype=torch.int32)
    save_file({"table": table, "frequent": torch.zeros(2, 2, dtype=torch.int32)}, str(path))
    with pytest.raises(CheckpointError, match="made for another vocabulary"):
        Shortlist.load(path, 40, 40)
    frequent = torch.zeros(2, dtype=torch.int32)
    save_file({"table": table, "frequent": frequent}, str(path), metadata={"attnmt": '"hello"'})
    with pytest.raises(CheckpointError, match="its metadata is not attnmt's"):
        Shortlist.load(path, 40, 40)


def test_11_a_byte_order_mark_is_not_part_of_the_first_term(tmp_path, translator):
    tsv = tmp_path / "t.tsv"
    tsv.write_bytes("\ufeffw1\tt9\nw2\tt8\n".encode())
    assert [t.source for t in Terminology.load(tsv).find("w1 w2")] == ["w1", "w2"]
    cons = tmp_path / "c.jsonl"
    cons.write_bytes('\ufeff["t9"]\n'.encode())
    assert list(read_constraints(cons)) == [["t9"]]


def test_12_a_constraint_the_vocabulary_cannot_spell_is_refused(translator):
    with pytest.raises(AttnmtError, match="'自転車' has characters the model cannot write"):
        translator.search(["w1"], translator.options(2), constraints=[["自転車"]])


def test_12_a_prefix_longer_than_the_output_limit_says_so(translator, capsys):
    found = translator.search(["w1"], translator.options(2), prefix=["t1 " * 40])
    assert len(found) == 1
    assert "input line 1: its prefix of" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line",
    ["w1 <!-- <b>w2</b> --> w3", "w1 <![CDATA[<b>w2</b>]]> w3", "w1 <!-- <b>w2</b> w3"],
)
def test_13_comments_and_cdata_stay_as_they_are(translator, line):
    out = translator.search([line], translator.options(2), markup=True)[0][0].text
    opaque = line[line.index("<!") :].split(" w3")[0] if "-->" in line or "]]>" in line else None
    if opaque is not None:
        assert opaque in out and out.count("<b>") == 1, out
    else:  # a comment never closed runs to the line's end and stays whole
        assert out.endswith("<!-- <b>w2</b> w3") and out.count("<b>") == 1, out


def test_59_unk_is_never_an_output_when_not_allowed(trained, run_cli, tmp_path):
    translator = Translator.load(trained[0], "cpu")
    output = translator.model.output
    bias = torch.zeros(output.weight.size(0))
    bias[1] = 100.0  # a model that likes <unk> best
    output.bias = torch.nn.Parameter(bias, requires_grad=False)
    for beam in (1, 3):
        found = translator.search(["w1 w2", "w3"], translator.options(beam))
        assert all("<unk>" in r[0].tgt_pieces or "⁇" in r[0].text for r in found)
        translator.cfg = translator.cfg.model_copy(
            update={"decode": translator.cfg.decode.model_copy(update={"allow_unk": False})}
        )
        found = translator.search(["w1 w2", "w3"], translator.options(beam))
        assert all("<unk>" not in r[0].tgt_pieces for r in found), found
        translator.cfg = translator.cfg.model_copy(
            update={"decode": translator.cfg.decode.model_copy(update={"allow_unk": True})}
        )
    r = run_cli("translate", "-m", str(trained[0]), "--no-unk", stdin=b"w1\n")
    assert r.code == 0, r.stderr
