"""Never lose a run, part 6 (issue 77): one request must not stall the server, and answers say
what their search left out. One test per item; docs/reliability.md counts the round."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from attnmt import Translator
from attnmt.serve.schema import Limits

from helpers import serve, start_server

GREEDY = {"text": ["w1 w2 w3"], "beam": 1}


def answered_beside(url: str, heavy: dict) -> tuple[float, httpx.Response]:
    """Send `heavy`, then (once the server has it) a one-line greedy request: the seconds the
    greedy one took and its response."""

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the test may end the server first
            httpx.post(f"{url}/translate", json=heavy, timeout=300)

    threading.Thread(target=send, daemon=True).start()
    time.sleep(0.5)  # the heavy request is being searched
    start = time.monotonic()
    r = httpx.post(f"{url}/translate", json=GREEDY, timeout=120)
    return time.monotonic() - start, r


def test_1_a_short_request_is_answered_within_2_s_beside_a_large_sampling_request(trained):
    """A sampled request was searched in the search thread, alone: 64 lines x 8 draws kept a
    one-line greedy request waiting 38.5 s. Here a larger one (limits raised to make it take
    tens of seconds on the tiny model) runs in the sampling thread."""
    proc, url = serve(trained[0], "--max-lines", "1024", "--max-search", "65536")
    try:
        line = " ".join(f"w{i % 30}" for i in range(60))
        heavy = {"text": [line] * 1024, "n_best": 64, "sampling": {"seed": 1}}
        seconds, r = answered_beside(url, heavy)
        assert r.status_code == 200, r.text
        assert r.json()["translations"] == Translator.load(trained[0]).translate(GREEDY["text"])
        assert seconds < 2.0, f"the short request waited {seconds:.1f} s"
        print(f"a one-line greedy request beside 1,024 lines x 64 draws: {seconds:.2f} s")
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["queued"] == 0 or health["queued"] == 1, health
    finally:
        proc.kill()
        proc.communicate()


def test_1_constraints_and_terms_count_in_the_work_bound(trained):
    """64 lines x 32 constraints that cannot be met, beam 8, were allowed (the bound counted
    lines x beam) and slowed every pool step: they count now, and what the bound allows
    leaves a short request its speed."""
    phrases = [f"t{i} t{i + 1}" for i in range(32)]
    for url in start_server(Translator.load(trained[0]), Limits()):
        r = httpx.post(
            f"{url}/translate",
            json={"text": ["w1 w2"] * 64, "beam": 8, "constraints": [phrases] * 64},
            timeout=60,
        )
        assert r.status_code == 413, r.text
        assert "64 lines x 8 hypotheses x (1 + their 2,048 constraints and terms)" in r.text
        glossary = [[f"w{i}", f"t{i}"] for i in range(20)]
        r = httpx.post(  # the terms found in the lines count too
            f"{url}/translate",
            json={"text": [" ".join(f"w{i}" for i in range(20))] * 4, "beam": 8,
                  "terminology": glossary},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 413 and "(1 + their 80 constraints and terms)" in r.text
        heavy = {"text": ["w1 w2"], "beam": 8, "constraints": [phrases]}  # 8 x 33: allowed
        seconds, r = answered_beside(url, heavy)
        assert r.status_code == 200, r.text
        assert seconds < 2.0, f"the short request waited {seconds:.1f} s"
        print(f"a one-line greedy request beside 32 constraints, beam 8: {seconds:.2f} s")
        # The longest prefixes the limits allow, on as many lines and beams as they allow.
        prefix = " ".join(["t1"] * 600)
        heavy = {"text": ["w1 w2"] * 64, "beam": 8, "prefix": [prefix] * 64}
        seconds, r = answered_beside(url, heavy)
        assert r.status_code == 200, r.text
        assert seconds < 2.0, f"the short request waited {seconds:.1f} s"
        print(f"a one-line greedy request beside 64 prefixes of 600 words, beam 8: {seconds:.2f} s")


def test_2_http_answers_carry_each_lines_warnings(trained, tmp_path, run_cli):
    """A prefix cut to the output limit and constraints not met came back as plain 200
    translations; they carry the warnings the CLI prints, in its words."""
    model = trained[0]
    long_prefix = " ".join(["t1"] * 600)  # within --max-chars (2,000)
    request = {"text": ["w1 w2", "w3"], "beam": 2, "prefix": [long_prefix, ""]}
    for url in start_server(Translator.load(model), Limits()):
        found = httpx.post(f"{url}/translate", json=request, timeout=60).json()
        clean = httpx.post(f"{url}/translate", json={"text": ["w3"]}, timeout=60).json()
        unmet = httpx.post(
            f"{url}/translate",
            json={"text": ["w1"], "beam": 2, "constraints": [[" ".join(["t2"] * 40)]]},
            timeout=60,
        ).json()
    assert "warnings" not in clean  # an answer with nothing left out is as it was
    assert found["warnings"][1] == []
    (said,) = found["warnings"][0]
    assert said.startswith("its prefix of") and "is cut to the output limit" in said
    src, prefixes = tmp_path / "src.txt", tmp_path / "prefix.txt"
    src.write_text("w1 w2\nw3\n")
    prefixes.write_text(long_prefix + "\n\n")
    r = run_cli(
        "translate", "-m", str(model), "--input", str(src), "--beam", "2", "--prefix",
        str(prefixes),
    )  # fmt: skip
    assert r.code == 0, r.stderr
    assert f"attnmt: warning: input line 1: {said}" in r.stderr  # the same words
    (said,) = unmet["warnings"][0]
    assert (
        said == "1 of 1 constraints not met within the length limit (decode.max_len_a, max_len_b)"
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_2_warnings_come_back_from_the_forked_workers_too(trained, workers):
    proc, url = serve(trained[0], "--workers", workers)
    try:
        r = httpx.post(
            f"{url}/translate",
            json={"text": ["w1", "w2"], "beam": 2, "constraints": [[" ".join(["t2"] * 40)], []]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["warnings"][0][0].startswith("1 of 1 constraints not met")
        assert r.json()["warnings"][1] == []
    finally:
        proc.kill()
        proc.communicate()
