"""Tag-preserving translation: tags put back around the aligned words, always balanced."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from attnmt import Translator
from attnmt.decoding.markup import TAG, parse, restore
from attnmt.serve.schema import Limits

from conftest import make_pairs, write_lines
from helpers import start_server

HOSTILE = [
    'Ein <b>großer</b> Hund <a href="x<y>z" title=\'>\'>läuft</a> schnell<x id="1"/>.',
    "<i>a <b>b</i> c</b> &amp; d &lt;e&gt;",  # crossing tags, entities
    "</p>x<br/> y",  # a closing tag never opened
    "<b>never closed a b",
    "<p><span><b></b></span></p>",  # nothing but tags
    "a<b>b</b>c <x/><y/>",
]


EMPTY = re.compile(r"<([A-Za-z_][\w:.-]*)\b[^>]*></\1>")  # an element with nothing inside


def tags_of(text: str) -> list[str]:
    return [m.group(0) for m in TAG.finditer(text)]


def balanced(text: str) -> bool:
    stack = []
    for m in TAG.finditer(text):
        if m.group(4):
            continue
        if m.group(1):
            if not stack or stack.pop() != m.group(2):
                return False
        else:
            stack.append(m.group(2))
    return not stack


@pytest.mark.parametrize("line", HOSTILE)
def test_any_alignment_gives_balanced_tags_and_keeps_every_element(line):
    text, root = parse(line)
    assert "&amp;" not in text and "</" not in text  # entities decoded, tags gone
    n = len(text.split())
    opened = sorted(t for t in tags_of(line) if not t.startswith("</"))
    rng = random.Random(0)
    for _ in range(50):
        out_words = [f"w{j}" for j in range(rng.randint(0, n + 3))]
        pairs = [(rng.randrange(max(n, 1)), j) for j in range(len(out_words)) if rng.random() < 0.8]
        out = restore(root, " ".join(out_words), pairs)
        assert balanced(out), (line, out)
        assert sorted(t for t in tags_of(out) if not t.startswith("</")) == opened, (line, out)
        assert TAG.sub(" ", out).split() == out_words, out  # the words, in order, untouched
        if out_words:  # an element empty in the output was empty in the source
            assert sorted(EMPTY.findall(out)) == sorted(EMPTY.findall(line)), (line, out)


def test_an_identity_alignment_gives_the_line_back():
    line = 'Ein <b>großer</b> Hund <a href="x<y>z">läuft</a> &amp; bellt.'
    text, root = parse(line)
    assert text == "Ein großer Hund läuft & bellt."
    n = len(text.split())
    assert restore(root, text, [(i, i) for i in range(n)]) == line
    # A reordering model reorders the elements: "Hund großer" keeps <b> on großer.
    words = text.split()
    swapped = [words[2], words[1], words[0], *words[3:]]
    pairs = [(2, 0), (1, 1), (0, 2), *((i, i) for i in range(3, n))]
    assert restore(root, " ".join(swapped), pairs).startswith("Hund <b>großer</b> Ein <a")


def test_a_far_link_does_not_stretch_an_element_and_backup_links_fill_gaps():
    _, root = parse("Ein <b>Hund</b> bellt <i>laut</i> .")
    # Hund is aligned to "dog" and, wrongly, to the far "." too: <b> keeps to "dog".
    out = restore(root, "A dog barks loudly .", [(0, 0), (1, 1), (2, 2), (1, 4)])
    assert out.startswith("A <b>dog</b> barks") and "<i></i>" not in out  # laut: no link
    # With the output word that attends to laut most, <i> goes around "loudly".
    out = restore(root, "A dog barks loudly .", [(0, 0), (1, 1), (2, 2)], {3: 3})
    assert out == "A <b>dog</b> barks <i>loudly</i> ."


def test_markup_from_the_cli_and_over_http(trained, tmp_path, run_cli):
    lines = [f"<b>{a}</b> {b}" for a, b in zip(*[make_pairs(6, 3)[0]] * 2, strict=True)]
    lines += ['w1 <x id="1"/> w2 &amp; <i>w3</i>', ""]
    src = write_lines(tmp_path / "src.txt", lines)
    r = run_cli("translate", "-m", str(trained[0]), "-i", str(src), "--markup")
    assert r.code == 0, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == len(lines) and out[-1] == ""
    for line, o in zip(lines, out, strict=True):
        assert balanced(o) and sorted(tags_of(o)) == sorted(tags_of(line)), (line, o)
    translator = Translator.load(trained[0], device="cpu")
    found = [r[0].text for r in translator.search(lines, translator.options(), markup=True)]
    assert found == out
    assert "tags" not in r.stderr  # with --markup: no warning
    for url in start_server(translator, Limits()):
        body = {"text": lines, "markup": True}
        reply = httpx.post(f"{url}/translate", json=body, timeout=60).json()
        assert reply["translations"] == out and "warnings" not in reply
        # Without markup the tags are translated as words: each such line says so.
        reply = httpx.post(f"{url}/translate", json={"text": lines[-2:]}, timeout=60).json()
        assert "XML/HTML tags, translated as words" in reply["warnings"][0][0]
        assert reply["warnings"][1] == []
    plain = run_cli("translate", "-m", str(trained[0]), "-i", str(src))
    said = [x for x in plain.stderr.splitlines() if "XML/HTML tags" in x]
    assert len(said) == len(lines) - 1 and said[0].startswith("attnmt: warning: input line 1:")
    assert "a < b" not in "".join(said)


def test_59_siblings_aligned_to_one_word_nest_instead_of_leaving_one_empty():
    _, root = parse("Ich mag <b>Kaffee</b> <i>sehr</i>.")
    # Both source words went to "coffee": <i> wraps <b>, no empty <i></i> after it.
    out = restore(root, "I like coffee.", [(0, 0), (1, 1), (2, 2), (3, 2)])
    assert out == "I like <i><b>coffee</b></i>."
    _, root = parse("<b>a</b> <b>b</b> <b>c</b>")
    assert restore(root, "x", [(0, 0), (1, 0), (2, 0)]) == "<b><b><b>x</b></b></b>"


def test_59_punctuation_outside_a_tag_in_the_source_stays_outside():
    from attnmt.decoding.markup import restore

    pairs = [(0, 0), (1, 1), (2, 2), (3, 3)]
    _, tree = parse("Ich verlor meine <b>Brieftasche</b>.")
    assert restore(tree, "I lost my wallet.", pairs) == "I lost my <b>wallet</b>."
    _, tree = parse('Wo ist <a href="/k">das Krankenhaus?</a>')  # inside there: inside here
    assert (
        restore(tree, "Where is the hospital?", pairs) == 'Where is <a href="/k">the hospital?</a>'
    )
    _, tree = parse('Er hält <a href="/x">seinen <b>Hund</b></a>.')  # nested: out of both
    out = restore(tree, "He holds his dog.", [(0, 0), (1, 1), (2, 2), (3, 3)])
    assert out == 'He holds <a href="/x">his <b>dog</b></a>.'
    _, tree = parse("<b>Tom</b> und Jerry")
    assert restore(tree, "Tom & Jerry", [(0, 0), (1, 1), (2, 2)]) == "<b>Tom</b> &amp; Jerry"
