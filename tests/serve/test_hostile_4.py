"""Never lose a run, part 4: what a hostile client and a tampered distillation still broke
(issue 44), one test per item. docs/reliability.md counts the round."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from attnmt import Translator
from attnmt.errors import AttnmtError, DataError
from attnmt.training.distill import distill, partial_path, progress_path, save_progress

from conftest import make_pairs, tiny_config, write_config, write_lines
from helpers import attnmt, one_error_line, serve

# The request that took the server down: 64 lines of 2,000 characters, beam 100, n_best 100,
# attention maps (130 KB, inside every other limit).
LONG_LINE = ("w1 w2 w3 w4 w5 " * 134)[:2000]
HEAVY = {"text": [LONG_LINE] * 64, "beam": 100, "n_best": 100, "attention": True}


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) / 1024


def stopped(proc: subprocess.Popen, signum: int) -> tuple[int, float, str]:
    """Send signum; (exit code, seconds to exit, stderr)."""
    start = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, time.monotonic() - start, err


def test_1_an_in_limit_heavy_request_is_refused_before_any_work(trained):
    proc, url = serve(trained[0])
    try:
        before = rss_mb(proc.pid)
        r = httpx.post(f"{url}/translate", json=HEAVY, timeout=30)
        assert r.status_code == 413 and "--max-search" in r.json()["error"], r.text
        one_beam = {**HEAVY, "beam": 1, "n_best": 1}  # the search fits; its maps would not
        r = httpx.post(f"{url}/translate", json=one_beam, timeout=30)
        assert r.status_code == 413 and "--max-attention" in r.json()["error"], r.text
        small = {"text": ["w1 w2"], "beam": 2, "attention": True}
        assert httpx.post(f"{url}/translate", json=small, timeout=30).status_code == 200
        assert rss_mb(proc.pid) - before < 100  # bounded: nothing grows after the refusals
    finally:
        _, seconds, _ = stopped(proc, signal.SIGTERM)
    assert seconds < 5


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_1_and_10_a_signal_stops_the_server_promptly_with_a_search_in_flight(trained, signum):
    # Limits raised so that the heavy search runs: the server must still stop at once.
    proc, url = serve(trained[0], "--max-search", "100000", "--max-attention", "10000000000000")
    client = threading.Thread(
        target=lambda: httpx.post(f"{url}/translate", json=HEAVY, timeout=60), daemon=True
    )
    client.start()
    time.sleep(1.0)  # the search has started
    code, seconds, err = stopped(proc, signum)
    assert seconds < 10, seconds
    if signum == signal.SIGINT:  # as every other command: 130 and one line
        assert code == 130 and err.strip().splitlines()[-1] == "attnmt: interrupted", err
    else:
        assert code == 128 + signal.SIGTERM and err.strip().splitlines()[-1] == "attnmt: terminated"


def _interrupted_distill(trained, tmp_path: Path) -> tuple[Path, Path, Translator]:
    """A distillation of 200 lines stopped after 4 chunks of 25: (source, output, teacher)."""
    model = trained[0]
    src = write_lines(tmp_path / "src.txt", make_pairs(200, 3)[0])
    out = tmp_path / "out.txt"
    teacher = Translator.load(model, device="cpu")
    real, calls = teacher.search, []

    def search(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt  # the kill
        return real(*args, **kwargs)

    teacher.search = search  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        distill(teacher, [model], "best", src, out, beam=1, chunk_lines=25, progress=False)
    teacher.search = real  # type: ignore[method-assign]
    return src, out, teacher


def _edit(progress: Path, change) -> None:
    state = json.loads(progress.read_text())
    change(state)
    progress.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("bytes not a number", lambda s: s.update(bytes="abc")),
        ("a missing key", lambda s: s.pop("lines")),
        ("negative bytes", lambda s: s.update(bytes=-1)),
        ("lines not a number", lambda s: s.update(lines="x")),
        ("bytes 5", lambda s: s.update(bytes=5)),
        ("lines +50", lambda s: s.update(lines=s["lines"] + 50)),
        ("lines -50", lambda s: s.update(lines=s["lines"] - 50)),
        ("lines 2.5", lambda s: s.update(lines=2.5)),
    ],
)
def test_2_a_tampered_distill_progress_file_is_refused(trained, tmp_path, name, change):
    src, out, teacher = _interrupted_distill(trained, tmp_path)
    _edit(progress_path(out), change)
    with pytest.raises(DataError) as e:
        distill(teacher, [trained[0]], "best", src, out, beam=1, chunk_lines=25, progress=False)
    assert "out.txt.distill.json" in str(e.value) and "--force" in str(e.value)
    assert not out.exists()


def test_2_a_changed_partial_file_is_refused_and_an_untouched_one_finishes_exactly(
    trained, tmp_path
):
    src, out, teacher = _interrupted_distill(trained, tmp_path)
    partial = partial_path(out)
    original = partial.read_bytes()
    partial.write_bytes(original.replace(b"\n", b" ", 1))  # same size, one line fewer
    with pytest.raises(DataError, match=r"not what out\.txt\.distill\.json records"):
        distill(teacher, [trained[0]], "best", src, out, beam=1, chunk_lines=25, progress=False)
    partial.write_bytes(original)
    done = distill(teacher, [trained[0]], "best", src, out, beam=1, chunk_lines=25, progress=False)
    assert done.lines == 200 and len(out.read_text().splitlines()) == 200


def test_2_a_resealed_progress_that_disagrees_with_the_source_never_finishes(trained, tmp_path):
    # A consistent but wrong total (as if the source had grown): the output is not published.
    src, out, teacher = _interrupted_distill(trained, tmp_path)
    state = json.loads(progress_path(out).read_text())
    state["total"] += 50
    save_progress(progress_path(out), state)
    with pytest.raises(DataError, match=r"200 lines for 250 source lines"):
        distill(teacher, [trained[0]], "best", src, out, beam=1, chunk_lines=25, progress=False)
    assert not out.exists()


def test_3_a_second_distill_on_one_output_is_refused(trained, tmp_path):
    src = write_lines(tmp_path / "src.txt", make_pairs(10_000, 4)[0])
    out = tmp_path / "k.en"
    cmd = ["distill", "-t", str(trained[0]), "-s", str(src), "-o", str(out), "--device", "cpu"]
    first = subprocess.Popen([sys.executable, "-m", "attnmt", *cmd, "--chunk-lines", "100"])
    lock = tmp_path / "k.en.distill.lock"
    deadline = time.monotonic() + 60
    while not progress_path(out).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = attnmt(*cmd)
    assert first.wait(timeout=300) == 0
    one_error_line(second, "another attnmt distill is writing it")
    assert out.exists() and not lock.exists() and not progress_path(out).exists()


def test_4_a_torn_log_line_is_dropped_before_resume_appends(trained, tmp_path):
    model = Path(shutil.copytree(trained[0], tmp_path / "m"))
    log = model / "train_log.jsonl"
    with open(log, "ab") as f:
        f.write(b'{"event": "valid')  # killed mid-write
    r = attnmt("train", "-c", str(model / "config.yaml"), "--out", str(model), "-q", "--resume",
               "--set", "train.max_steps=8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    events = [json.loads(x) for x in lines]  # every line is JSON again
    assert any(e["event"] == "log_repaired" and e["dropped_bytes"] == 16 for e in events)
    assert attnmt("plot", str(model), "-o", str(tmp_path / "c.png")).returncode == 0


def test_5_user_text_never_becomes_a_language_tag(corpus):
    from attnmt.config import SplitConfig, TokenizerConfig
    from attnmt.data.tokenizer import Tokenizer, language_tag

    split = SplitConfig(src=corpus["train_src"], tgt=corpus["train_tgt"])
    tags = [language_tag("en"), language_tag("fr")]
    tokenizer = Tokenizer.train_on_files([split], TokenizerConfig(vocab_size=40), 1, tags)
    tag = tokenizer.tag_id("en")
    assert tag is not None
    ids = tokenizer.src.encode(["<2en> w1 w2", "w3 <2fr>"])  # as translate and training encode
    assert all(i not in (tag, tokenizer.tag_id("fr")) for line in ids for i in line)
    plain = tokenizer.src.encode(["w1 w2"])[0]
    assert ids[0][-len(plain) :] == plain  # the rest of the line is encoded as before


def test_6_a_refused_init_from_leaves_no_half_made_run(trained, tmp_path: Path, corpus):
    source = Path(shutil.copytree(trained[0], tmp_path / "source"))
    (source / "best.safetensors").write_bytes(b"not weights")
    raw = tiny_config(corpus)
    raw["train"]["init_from"] = str(source)
    cfg = write_config(tmp_path / "c.yaml", raw)
    out = tmp_path / "run"
    one_error_line(attnmt("train", "-c", str(cfg), "--out", str(out), "-q"))
    assert not out.exists()
    # A bad dev file found after SentencePiece and the store were made: nothing is left either.
    raw = tiny_config(corpus)
    bad = write_lines(tmp_path / "dev.tgt", ["one line"])
    raw["data"]["dev"]["tgt"] = str(bad)
    cfg = write_config(tmp_path / "c2.yaml", raw)
    one_error_line(attnmt("train", "-c", str(cfg), "--out", str(out), "-q"), "dev.tgt")
    assert not out.exists()


def test_7_cross_origin_forms_and_foreign_hosts_are_refused(trained):
    proc, url = serve(trained[0])
    try:
        body = json.dumps({"text": ["w1"]})
        for kind in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"origin": "http://evil.example"} | ({"content-type": kind} if kind else {})
            r = httpx.post(f"{url}/translate", content=body, headers=headers, timeout=30)
            assert r.status_code == 415 and "application/json" in r.json()["error"], kind
        r = httpx.post(f"{url}/translate", json={"text": ["w1"]}, headers={"host": "evil.example"})
        assert r.status_code == 400 and "--allowed-host" in r.json()["error"]
        for host in ("localhost", f"127.0.0.1:{url.rsplit(':', 1)[1]}"):
            assert httpx.get(f"{url}/health", headers={"host": host}).status_code == 200
        assert httpx.get(f"{url}/docs").status_code == 404  # Swagger UI would load a CDN
        # The model's name, not its path on the server (issue 47): serve --name sets another.
        assert httpx.get(f"{url}/health").json()["model"] == trained[0].name
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_8_score_caps_a_very_long_target_line(trained, tmp_path: Path):
    src = write_lines(tmp_path / "s.txt", ["w1 w2"])
    tgt = write_lines(tmp_path / "t.txt", ["t1 " * 50_000])
    start = time.monotonic()
    r = attnmt("score", "-m", str(trained[0]), "--src", str(src), "--tgt", str(tgt))
    assert r.returncode == 0, r.stderr
    assert "target line 1" in r.stderr and "decode.max_output_len" in r.stderr
    assert time.monotonic() - start < 60


def test_9_a_port_in_use_is_one_line_before_any_announcement(trained):
    proc, url = serve(trained[0])
    try:
        r = attnmt("serve", "-m", str(trained[0]), "--port", url.rsplit(":", 1)[1])
        one_error_line(r, "cannot serve on 127.0.0.1:", "Address already in use")
        assert "serving" not in r.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_11_a_boolean_beam_and_a_target_language_of_a_bilingual_model_are_refused(trained):
    translator = Translator.load(trained[0], device="cpu")
    with pytest.raises(AttnmtError, match="names no target language"):
        translator.translate(["w1"], target_lang="fr")
    proc, url = serve(trained[0])
    try:
        for body in ({"text": ["w1"], "beam": True}, {"text": ["w1"], "beam": "5"}):
            assert httpx.post(f"{url}/translate", json=body).status_code == 422, body
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
