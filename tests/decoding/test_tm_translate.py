"""Translating with a translation memory (issue 80): a 100 % match is the translation (not
decoded), a fuzzy one reported beside the model's; from the CLI, the API and a real server on
a loopback port, where POST /tm stores a post-edit the next request uses."""

from __future__ import annotations

import time

import httpx

from attnmt import Translator
from attnmt.data.tm import TranslationMemory

from helpers import assert_user_error, serve


def make_tm(path, corpus) -> list[str]:
    """A TM of the dev set's first 3 pairs, their targets changed (so that a TM answer is
    told from the model's); returns the dev sources."""
    sources = corpus["dev_src"].read_text().splitlines()
    targets = corpus["dev_tgt"].read_text().splitlines()
    with TranslationMemory(path, create=True) as tm:
        tm.add_many([(s, f"TM {t}") for s, t in zip(sources[:3], targets, strict=False)],
                    "xx", "yy", "test")  # fmt: skip
    return sources


def test_translate_takes_exact_matches_from_the_tm(tmp_path, trained, run_cli):
    model, corpus = trained
    sources = make_tm(tmp_path / "tm.db", corpus)
    targets = corpus["dev_tgt"].read_text().splitlines()
    plain = run_cli("translate", "-m", str(model), stdin="\n".join(sources).encode()).stdout
    result = run_cli("translate", "-m", str(model), "--tm", str(tmp_path / "tm.db"), "-v",
                     stdin="\n".join(sources).encode())  # fmt: skip
    assert result.code == 0, result.stderr
    got, before = result.stdout.splitlines(), plain.splitlines()
    assert got[:3] == [f"TM {t}" for t in targets[:3]]
    assert got[3:] == before[3:]  # the others decoded as without the TM
    assert "input line 1: 100 % match, the translation, segment 1" in result.stderr
    assert_user_error(
        run_cli("translate", "-m", str(model), "--tm", str(tmp_path / "none.db"), stdin=b"w1\n"),
        "no translation memory",
    )


def test_the_api_reports_fuzzy_matches(tmp_path, trained):
    model, corpus = trained
    sources = make_tm(tmp_path / "tm.db", corpus)
    ours = Translator.load(model, device="cpu")
    ours.use_tm(tmp_path / "tm.db", "xx-yy", threshold=0.3)
    words = sources[2].split()
    near = " ".join([*words[:-1], "w0" if words[-1] != "w0" else "w1"])
    found = ours.hypotheses([sources[0], near], beam=1)
    assert found[0][0].tm.exact and found[0][0].text.startswith("TM ")
    fuzzy = found[1][0].tm
    assert fuzzy is not None and not fuzzy.exact and fuzzy.segment == 3 and fuzzy.score < 1
    assert not found[1][0].text.startswith("TM ")  # decoded by the model


def test_serve_answers_from_the_tm_and_stores_post_edits(tmp_path, trained):
    model, corpus = trained
    sources = make_tm(tmp_path / "tm.db", corpus)
    proc, url = serve(model, "--tm", str(tmp_path / "tm.db"), "--tm-write")
    try:
        got = httpx.post(f"{url}/translate", json={"text": sources[:4]}, timeout=30).json()
        assert got["translations"][0].startswith("TM ")
        assert got["tm"][0]["exact"] and got["tm"][0]["segment"] == 1
        stored = httpx.post(f"{url}/tm", json={"source": sources[5], "target": "post-edited"})
        assert stored.status_code == 200, stored.text
        again = httpx.post(f"{url}/translate", json={"text": [sources[5]]}, timeout=30).json()
        assert again["translations"] == ["post-edited"]  # used at once
        assert again["tm"][0]["segment"] == stored.json()["segment"]
        bad = httpx.post(f"{url}/tm", json={"source": "x", "target": "y", "score": 1})
        assert bad.status_code == 422 and "score" in bad.json()["error"]
        huge = httpx.post(f"{url}/tm", json={"source": "x" * 100_000, "target": "y"})
        assert huge.status_code == 413
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, url = serve(model, "--tm", str(tmp_path / "tm.db"))  # read-only
    try:
        refused = httpx.post(f"{url}/tm", json={"source": "a", "target": "b"})
        assert refused.status_code == 403 and "--tm-write" in refused.json()["error"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_kill_9_during_a_burst_of_post_edits_keeps_every_acknowledged_one(tmp_path, trained):
    """POST /tm from 4 clients at once, the server killed (SIGKILL) mid-burst: every pair it
    answered 200 for is in the TM, which opens sound."""
    import signal
    import threading

    model, corpus = trained
    make_tm(tmp_path / "tm.db", corpus)
    proc, url = serve(model, "--tm", str(tmp_path / "tm.db"), "--tm-write")
    acknowledged: list[str] = []

    def client(n: int) -> None:
        with httpx.Client(timeout=10) as http:
            for i in range(10_000):
                source = f"w{n} post edit {i}"
                try:
                    got = http.post(f"{url}/tm", json={"source": source, "target": f"t{i}"})
                except httpx.TransportError:
                    return
                if got.status_code == 200:
                    acknowledged.append(source)

    clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while len(acknowledged) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(acknowledged) >= 50, "the server stored post-edits"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    for c in clients:
        c.join()
    with TranslationMemory(tmp_path / "tm.db") as tm:
        assert tm.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        stored = {s.source for s in tm.segments()}
    assert set(acknowledged) <= stored
