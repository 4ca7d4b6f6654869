"""Word alignments from attention: Moses-style pairs from the CLI, the API and over HTTP."""

from __future__ import annotations

import httpx
import torch

from attnmt import Translator
from attnmt.decoding.alignment import word_alignment, word_of_pieces
from attnmt.serve.schema import Limits

from conftest import make_pairs, write_lines
from helpers import start_server

LINES = make_pairs(12, 5)[0]


def test_pieces_make_words_and_attention_makes_pairs():
    assert word_of_pieces(["<2de>", "▁Ein", "▁Hund", "e", "</s>"]) == [-1, 0, 1, 1, -1]
    assert word_of_pieces(["s", "▁x"]) == [0, 1]  # a first piece without ▁ starts a word
    assert word_of_pieces(["▁9", "9", "<unk>", "9"]) == [0, 0, 1, 2]  # written "99 ⁇ 9"
    assert word_of_pieces(["▁", "▁a", "▁", "b", "▁"]) == [-1, 0, 1, 1, -1]  # "a b"
    src = ["▁Ein", "▁Hund", "e", "</s>"]
    tgt = ["▁Dog", "s", "▁one", "</s>"]
    attention = torch.tensor(
        [  # Ein  Hund  e    </s>
            [0.1, 0.2, 0.2, 0.5],  # ▁Dog: Hund+e = 0.4 beats Ein; </s> takes no part
            [0.1, 0.6, 0.2, 0.1],  # s
            [0.7, 0.1, 0.1, 0.1],  # ▁one
            [0.0, 0.0, 0.0, 1.0],  # </s>
        ]
    )
    assert word_alignment(src, tgt, attention) == [(1, 0), (0, 1)]


def check_pairs(src: str, out: str, pairs: str) -> None:
    links = [tuple(map(int, p.split("-"))) for p in pairs.split()]
    assert [j for _, j in links] == list(range(len(out.split()))), (out, pairs)
    assert all(0 <= i < len(src.split()) for i, _ in links), (src, pairs)


def test_alignments_from_the_cli_one_best_and_n_best(trained, tmp_path, run_cli):
    src = write_lines(tmp_path / "src.txt", [*LINES[:5], ""])
    r = run_cli("translate", "-m", str(trained[0]), "-i", str(src), "--alignments")
    assert r.code == 0, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == 6 and out[5] == " ||| "
    for line, written in zip(LINES[:5], out, strict=False):
        text, pairs = written.split(" ||| ")
        check_pairs(line, text, pairs)
    args = ("--alignments", "--n-best", "2", "--beam", "2", "--alignment-layer", "0")
    r = run_cli("translate", "-m", str(trained[0]), "-i", str(src), *args)
    assert r.code == 0, r.stderr
    for written in r.stdout.splitlines()[:10]:
        n, text, _, pairs = written.split(" ||| ")
        check_pairs(LINES[int(n)], text, pairs)


def test_alignments_over_http_as_the_api_gives_them(trained):
    translator = Translator.load(trained[0], device="cpu")
    aligned = translator.aligned(LINES[:3], beam=3)
    for line, (text, pairs) in zip(LINES, aligned, strict=False):
        check_pairs(line, text, " ".join(f"{i}-{j}" for i, j in pairs))
    for url in start_server(translator, Limits()):
        body = {"text": LINES[:3], "alignments": True, "beam": 3}
        reply = httpx.post(f"{url}/translate", json=body, timeout=60).json()
        assert reply["translations"] == [t for t, _ in aligned]
        assert reply["alignments"] == [[list(p) for p in pairs] for _, pairs in aligned]
        tight = Limits(max_attention=10)
        assert (
            "alignments"
            not in httpx.post(f"{url}/translate", json=body | {"alignments": False}).json()
        )
    for url in start_server(translator, tight):
        reply = httpx.post(f"{url}/translate", json=body, timeout=60)
        assert reply.status_code == 413 and "serve --max-attention" in reply.json()["error"]
