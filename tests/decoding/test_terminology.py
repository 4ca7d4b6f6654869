"""Terminology and constraint files: what users give, from the CLI, the API and over HTTP."""

from __future__ import annotations

import httpx
import pytest

from attnmt import Translator
from attnmt.decoding.terminology import Term, Terminology, read_constraints
from attnmt.errors import AttnmtError, DataError
from attnmt.serve.schema import Limits

from conftest import make_pairs, write_lines
from helpers import assert_user_error, start_server

LINES = make_pairs(12, 5)[0]


def test_terms_are_found_on_word_boundaries_with_the_files_case():
    terms = Terminology(
        [Term("Haus", "house"), Term("grünes Haus", "green house"), Term("C++", "C++")]
    )
    assert terms.find("Ein grünes Haus, ein Haus.") == [
        Term("grünes Haus", "green house"),  # the longest term at a place
        Term("Haus", "house"),  # each term once
    ]
    assert terms.find("Hausboot und Rathaus; haus") == []  # inside words, another case
    assert terms.find("(Haus) C++!") == [Term("Haus", "house"), Term("C++", "C++")]


def test_bad_files_are_refused_naming_the_line(tmp_path):
    tsv = write_lines(tmp_path / "t.tsv", ["# comment", "Haus\thouse", "Baum tree", ""])
    with pytest.raises(DataError, match=r"t\.tsv:3: expected a source term and a target term"):
        Terminology.load(tsv)
    clash = write_lines(tmp_path / "c.tsv", ["Haus\thouse", "Haus\thome"])
    with pytest.raises(DataError, match=r"c\.tsv:2: 'Haus' is already translated as 'house'"):
        Terminology.load(clash)
    cons = write_lines(tmp_path / "c.jsonl", ['["a b"]', "", "[]", '["x", 3]'])
    with pytest.raises(DataError, match=r"c\.jsonl:4: expected a JSON list of non-empty"):
        list(read_constraints(cons))
    assert list(read_constraints(write_lines(tmp_path / "ok", ['["a b"]', ""]))) == [["a b"], []]


def test_terminology_and_constraints_from_the_cli(trained, tmp_path, run_cli):
    model = trained[0]
    src = write_lines(tmp_path / "src.txt", ["w1 w2", "w3", "w4 w2"])
    cons = write_lines(tmp_path / "c.jsonl", ['["t9"]', "[]", '["t7 t7"]'])
    terms = write_lines(tmp_path / "t.tsv", ["w2\tt5"])
    args = ("-m", str(model), "-i", str(src), "--beam", "3")
    r = run_cli("translate", *args, "--constraints", str(cons), "--terminology", str(terms))
    assert r.code == 0, r.stderr
    out = [f" {line} " for line in r.stdout.splitlines()]
    assert " t9 " in out[0] and " t5 " in out[0] and " t7 t7 " in out[2] and " t5 " in out[2]
    r = run_cli("translate", "-m", str(model), "-i", str(src), "--beam", "1", "--constraints",
                str(cons))  # fmt: skip
    assert_user_error(r, "constraints and terminology need beam search")
    short = write_lines(tmp_path / "short.jsonl", ["[]"])
    r = run_cli("translate", *args, "--constraints", str(short))
    assert_user_error(r, "--constraints: 1 lines, fewer than the input's")


def test_constraints_and_applied_terms_over_http(trained, tmp_path):
    translator = Translator.load(trained[0], device="cpu")
    translator.terminology = Terminology([Term("w3", "t8")])
    with pytest.raises(AttnmtError, match="constraints: expected a list of phrases per line"):
        translator.translate(LINES, constraints=[["t1"]])
    for url in start_server(translator, Limits()):
        body = {"text": ["w3 w1", "w2"], "constraints": [[], ["t6"]], "beam": 3}
        reply = httpx.post(f"{url}/translate", json=body, timeout=60).json()
        assert reply["terms"] == [[{"source": "w3", "target": "t8"}], []]
        assert reply["translations"] == translator.translate(
            body["text"], beam=3, constraints=body["constraints"]
        )
        assert (
            " t8 " in f" {reply['translations'][0]} " and " t6 " in f" {reply['translations'][1]} "
        )
        bad = httpx.post(f"{url}/translate", json={"text": ["w1"], "constraints": [["a"], []]})
        assert (
            bad.status_code == 422
            and "constraints: expected a list of phrases per line, 2 for 1 lines"
            in bad.json()["error"]
        )
        greedy = httpx.post(f"{url}/translate", json={**body, "beam": 1})
        assert greedy.status_code == 422 and "need beam search" in greedy.json()["error"]


def test_entries_list_forms_and_match_by_case_or_as_a_compound_start(tmp_path):
    tsv = write_lines(tmp_path / "t.tsv", ["Fahrrad|Fahrrads|Fahrräder\tbicycle", "Haus\thouse"])
    exact = Terminology.load(tsv)
    assert [t.target for t in exact.find("Zwei Fahrräder, ein Fahrrads")] == ["bicycle"]
    assert exact.find("fahrrad, Fahrradhelm, Hausboot") == []
    folded = Terminology.load(tsv, ignore_case=True)
    assert [t.target for t in folded.find("FAHRRAD und haus")] == ["bicycle", "house"]
    compound = Terminology.load(tsv, ignore_case=True, prefix=True)
    assert [t.target for t in compound.find("ein Fahrradhelm im Hausboot")] == ["bicycle", "house"]
    assert compound.find("Rathaus") == []  # a word's start only, not its end
    clash = write_lines(tmp_path / "c.tsv", ["Haus|Heim\thouse", "heim\thome"])
    with pytest.raises(DataError, match=r"c\.tsv:2: 'heim' is already translated as 'house'"):
        Terminology.load(clash, ignore_case=True)


def test_the_cli_matches_terms_by_case_and_prefix(trained, tmp_path, run_cli):
    # A target no model outputs by itself: three t9 in a row (one t9 a model may choose).
    terms = write_lines(tmp_path / "t.tsv", ["w2\tt9 t9 t9"])
    src = write_lines(tmp_path / "in.txt", ["w1 W2", "w1 w2x"])
    args = ("translate", "-m", str(trained[0]), "-i", str(src), "--beam", "4",
            "--terminology", str(terms))  # fmt: skip
    plain = run_cli(*args).stdout.splitlines()
    assert all("t9 t9 t9" not in line for line in plain)
    r = run_cli(*args, "--terms-ignore-case", "--terms-prefix")
    assert r.code == 0, r.stderr
    assert all("t9 t9 t9" in line for line in r.stdout.splitlines()), r.stdout


def test_a_request_brings_its_own_glossary(trained):
    translator = Translator.load(trained[0], "cpu")
    for url in start_server(translator, Limits(), access_log=False):
        body = {"text": ["w1 w2"], "beam": 3, "terminology": [["w2|w3", "t9"]]}
        r = httpx.post(f"{url}/translate", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert "t9" in r.json()["translations"][0].split()
        assert r.json()["terms"] == [[{"source": "w2|w3", "target": "t9"}]]
        many = {**body, "terminology": [[f"a{i}", "t1"] for i in range(300)]}
        assert httpx.post(f"{url}/translate", json=many, timeout=30).status_code == 413
        bad = {**body, "terminology": [["w2"]]}
        r = httpx.post(f"{url}/translate", json=bad, timeout=30)
        assert r.status_code == 422 and "expected [source, target]" in r.json()["error"]
        plain = httpx.post(f"{url}/translate", json={"text": ["w1 w2"], "beam": 3}, timeout=30)
        assert "terms" not in plain.json()


def test_a_request_matches_terms_whatever_their_case(trained):
    """terms_ignore_case: the request's glossary and the server's (case-sensitive) terms."""
    translator = Translator.load(trained[0], "cpu")
    translator.terminology = Terminology([Term("w3", "t8")])
    for url in start_server(translator, Limits(), access_log=False):
        body = {"text": ["W3 W2 w1"], "beam": 3, "terminology": [["w2", "t9"]]}
        asked = httpx.post(f"{url}/translate", json=body, timeout=30).json()
        assert asked.get("terms", [[]]) == [[]]  # by case: neither W3 nor W2
        body["terms_ignore_case"] = True
        asked = httpx.post(f"{url}/translate", json=body, timeout=30).json()
        found = {(t["source"], t["target"]) for t in asked["terms"][0]}
        assert found == {("w3", "t8"), ("w2", "t9")}
        assert {"t8", "t9"} <= set(asked["translations"][0].split())
