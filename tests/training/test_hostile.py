"""Never lose a run, part 3: what an adversarial pass broke (issue 38), one test per item.

docs/reliability.md lists the families of cases and their counts.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from attnmt import Translator
from attnmt.errors import AttnmtError
from attnmt.models.directory import BEST_FILE, load_model_dir, save_weights
from attnmt.serve.app import create_app
from attnmt.serve.schema import Limits
from attnmt.training.checkpoints import CKPT_DIR

from conftest import tiny_config, write_config, write_lines
from helpers import attnmt, free_port, one_error_line, running_trainer, trained_steps, wait_healthy


@pytest.fixture
def model(trained: tuple[Path, dict[str, Path]], tmp_path: Path) -> Path:
    """A copy of conftest's tiny trained model directory, free to damage."""
    return Path(shutil.copytree(trained[0], tmp_path / "model"))


def resume(model: Path, *extra: str) -> subprocess.CompletedProcess:
    return attnmt(
        "train", "-c", str(model / "config.yaml"), "--out", str(model), "-q", "--resume",
        "--set", "train.max_steps=8", *extra,
    )  # fmt: skip


def events(model: Path) -> list[dict]:
    return [json.loads(x) for x in (model / "train_log.jsonl").read_text().splitlines()]


# --- loses work ---


def test_1_a_half_built_store_does_not_stop_resume(model: Path):
    """kill -9 during encoding leaves .encoded.tmp/ (a directory) and no store."""
    shutil.rmtree(model / "encoded")
    (model / ".encoded.tmp").mkdir()
    (model / ".encoded.tmp" / "src.tokens").write_bytes(b"\0" * 10)
    r = resume(model)
    assert r.returncode == 0, r.stderr
    assert not (model / ".encoded.tmp").exists() and (model / "encoded" / "meta.json").is_file()
    assert trained_steps(model) == 8


@pytest.mark.parametrize("inside", ["same", "child", "parent"])
def test_2_export_never_overwrites_the_model_directory(model: Path, inside: str):
    out = {"same": model, "child": model / "ct2", "parent": model.parent}[inside]
    before = sorted(p.name for p in model.iterdir())
    one_error_line(attnmt("export", str(model), str(out), "--force"), "the model directory")
    assert sorted(p.name for p in model.iterdir()) == before


def test_3_a_flipped_byte_in_the_training_state_is_refused(model: Path):
    state = sorted((model / CKPT_DIR).glob("step-*.state.pt"))[-1]  # the one resume takes
    data = bytearray(state.read_bytes())
    data[int(len(data) * 0.6)] ^= 0x40  # inside the sealed payload, the bulk of the file
    state.write_bytes(bytes(data))
    one_error_line(resume(model), str(state), "damaged")


def test_3_a_truncated_store_is_rebuilt_not_trained_on(model: Path):
    tokens = model / "encoded" / "src.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    r = resume(model)
    assert r.returncode == 0, r.stderr
    (warned,) = [e for e in events(model) if e["event"] == "store"]
    assert "src.tokens" in warned["problem"]
    assert "damaged" in (model / "train.log").read_text()
    assert trained_steps(model) == 8


def test_3_ids_outside_the_vocabulary_in_the_store_are_refused(model: Path):
    meta_path = model / "encoded" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("files")  # as a store built before checksums were recorded
    meta_path.write_text(json.dumps(meta))
    tokens = model / "encoded" / "tgt.tokens"
    data = bytearray(tokens.read_bytes())
    data[0:2] = (65535).to_bytes(2, "little")  # uint16 ids
    tokens.write_bytes(bytes(data))
    r = resume(model)
    assert r.returncode == 0, r.stderr
    assert "outside a vocabulary" in (model / "train.log").read_text()


def test_3_weights_of_another_tokenizer_are_refused(model: Path):
    _, _, net = load_model_dir(model)
    save_weights(net, model / BEST_FILE, tokenizer="0" * 64)  # as if copied from another run
    r = attnmt("translate", "-m", str(model), input="w1 w2\n")
    one_error_line(r, BEST_FILE, "another SentencePiece model")


def test_4_deleting_the_lock_file_does_not_let_a_second_trainer_in(tmp_path: Path, corpus):
    with running_trainer(tmp_path, corpus) as (cfg, out, proc):
        (out / ".lock").unlink()
        r = attnmt("train", "-c", str(cfg), "--out", str(out), "-q", "--resume")
        one_error_line(r, "in use by another attnmt train")
        assert proc.poll() is None


def test_5_a_torn_last_log_line_is_skipped_with_a_warning(model: Path, tmp_path: Path):
    with open(model / "train_log.jsonl", "a") as f:
        f.write('{"event": "validation", "step": 9, "dev_bl')  # a full disk cut it here
    r = attnmt("average", str(model), "--best", "1", "--force")
    assert r.returncode == 0 and "skipped a cut-off last line" in r.stderr, r.stderr
    r = attnmt("plot", str(model), "-o", str(tmp_path / "c.png"))
    assert r.returncode == 0 and "skipped a cut-off last line" in r.stderr, r.stderr


# --- hangs or grows without bound ---


def test_6_a_line_without_end_is_an_error_not_a_hang(model: Path, tmp_path: Path):
    r = attnmt("translate", "-m", str(model), "-i", "/dev/zero")
    one_error_line(r, "/dev/zero:1: a line longer than 1 MiB")
    ref = write_lines(tmp_path / "ref", ["a"])
    one_error_line(attnmt("eval", "--hyp", "/dev/zero", "--ref", str(ref)), "/dev/zero:1")


@pytest.fixture
def server(trained):
    """create_app on uvicorn in a thread, with small limits and batches of 2 lines."""
    translator = Translator.load(trained[0], device="cpu")
    limits = Limits(max_lines=8, max_chars=50, max_queue=8, batch_lines=2, batch_wait_ms=1)
    config = uvicorn.Config(
        create_app(translator, limits), host="127.0.0.1", port=free_port(), log_level="warning"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    wait_healthy(url)
    yield url, translator, limits
    srv.should_exit = True
    thread.join(timeout=10)


def test_8_a_body_too_large_is_refused_before_it_is_read(server):
    url, _, limits = server
    big = b'{"text": ["' + b"a" * (limits.max_body + 10) + b'"]}'
    r = httpx.post(f"{url}/translate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "at most" in r.json()["error"]

    def chunks():  # no Content-Length: refused as it streams in
        for _ in range(limits.max_body // 65536 + 2):
            yield b" " * 65536

    json_body = {"content-type": "application/json"}
    r = httpx.post(f"{url}/translate", content=chunks(), headers=json_body, timeout=30)
    assert r.status_code == 413


def test_8_a_long_request_is_interleaved_and_dropped_when_its_client_leaves(server, monkeypatch):
    url, translator, _ = server
    added: list[int] = []  # lines handed to a pool, per call
    real = translator.pool

    def slow(*args, **kw):  # 0.05 s a step
        pool = real(*args, **kw)
        add, step = pool.add, pool.step
        pool.add = lambda lines, *a: added.append(len(lines)) or add(lines, *a)
        pool.step = lambda: time.sleep(0.05) or step()
        return pool

    monkeypatch.setattr(translator, "pool", slow)
    post = lambda text, timeout=60: httpx.post(  # noqa: E731
        f"{url}/translate", json={"text": text}, timeout=timeout
    )
    with ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        long = pool.submit(post, ["w1 w2"] * 8)  # 2 lines at a time (batch_lines 2)
        time.sleep(0.3)
        asked = time.monotonic()
        assert post(["w3"]).status_code == 200  # in the next free place, beside the long one
        short_done = time.monotonic() - asked
        assert long.result().status_code == 200
        long_done = time.monotonic() - start
    assert short_done < 0.6 * long_done, "the short request waited for the whole long one"
    added.clear()
    with pytest.raises(httpx.ReadTimeout):
        post(["w1 w2"] * 8, timeout=0.3)  # the client leaves while its first lines search
    time.sleep(long_done)
    assert sum(added) < 8, added


# --- tracebacks instead of one line ---


@pytest.mark.parametrize(
    "body",
    [
        b'{"text": ["w1"], "beam": NaN}',
        b'{"text": ["w1"], "beam": Infinity}',
        b'{"text": ["w1"], "beam": 1e999}',
        b'{"text": ["\\ud800"]}',
        b'{"text": [1, 2]}',
        b'{"text": "w1"}',
        b"[]",
    ],
)
def test_9_hostile_json_is_422_with_one_message(server, body):
    url, _, _ = server
    r = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and isinstance(r.json()["error"], str), r.text


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.translate("w1 w2"), "a list of sentences"),
        (lambda t: t.translate([1]), "lines[0]: expected a str"),
        (lambda t: t.translate([None]), "lines[0]: expected a str"),
        (lambda t: t.translate(["w1"], beam=10**6), "beam 1000000"),
        (lambda t: t.translate(["w1"], beam=0), "beam 0"),
        (lambda t: t.hypotheses(["w1"], n_best=0), "n_best 0"),
        (lambda t: t.hypotheses(["w1"], sampling=(0.0, 0, 0)), "temperature 0.0"),
        (lambda t: t.hypotheses(["w1"], sampling=(-1.0, 0, 0)), "temperature -1.0"),
        (lambda t: t.hypotheses(["w1"], sampling=(1.0, -3, 0)), "top_k -3"),
        (lambda t: t.translate(["w1"], length_penalty=float("nan")), "length_penalty nan"),
        (lambda t: t.translate(["w1"], batch_tokens=0), "batch_tokens 0"),
        (lambda t: t.translate(["w1"], workers=0), "workers 0"),
        (lambda t: Translator.score([], []), "nothing to score"),
        (lambda t: Translator.score("ab", "ab"), "a list of str"),
    ],
)
def test_10_the_api_checks_its_arguments(trained, call, message):
    translator = Translator.load(trained[0], device="cpu")
    with pytest.raises(AttnmtError, match=re.escape(message)):
        call(translator)


def test_11_closed_stdin_and_empty_files_are_one_line(model: Path, tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    one_error_line(r, "standard input is closed")
    empty = write_lines(tmp_path / "empty", [])
    one_error_line(attnmt("eval", "--hyp", str(empty), "--ref", str(empty)), "nothing to score")


def test_11_export_to_impossible_places_is_one_line(model: Path, tmp_path: Path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    one_error_line(attnmt("export", str(model), str(a_file / "ct2")), "is a file")
    one_error_line(attnmt("export", str(model), str(a_file), "--force"), "not a directory")

    def small_files() -> None:  # RLIMIT_FSIZE: writes past 64 KiB fail (EFBIG)
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    r = subprocess.run(
        [sys.executable, "-m", "attnmt", "export", str(model), str(tmp_path / "ct2")],
        capture_output=True, text=True, timeout=120, preexec_fn=small_files,
    )  # fmt: skip
    one_error_line(r, "cannot write the export")
    assert not (tmp_path / "ct2").exists()


@pytest.mark.parametrize(
    "line", ["[1, 2]", '{"event": "validation", "dev_bleu": 3.0}', b"\xff\xfe".decode("latin-1")]
)
def test_11_bad_log_lines_are_file_and_line(model: Path, tmp_path: Path, line: str):
    log = model / "train_log.jsonl"
    lines = log.read_text().splitlines()
    log.write_bytes("\n".join([lines[0], line, *lines[1:]]).encode("latin-1") + b"\n")
    one_error_line(attnmt("average", str(model), "--best", "1", "--force"), "train_log.jsonl:2")
    one_error_line(attnmt("plot", str(model), "-o", str(tmp_path / "c.png")), "train_log.jsonl:2")


@pytest.mark.parametrize(
    "change", [{"model": "transformer"}, {"sha256": ["x"]}, {"src_vocab_size": "many"}]
)
def test_11_crafted_metadata_is_one_line(model: Path, change: dict):
    meta = json.loads((model / "attnmt.json").read_text())
    (model / "attnmt.json").write_text(json.dumps({**meta, **change}))
    one_error_line(attnmt("translate", "-m", str(model), input="w1\n"), "attnmt.json")


@pytest.mark.parametrize("name", ["spm.model", "attnmt.json"])
def test_11_a_huge_file_in_the_model_directory_is_refused_unread(model: Path, name: str):
    with open(model / name, "r+b") as f:
        f.truncate(5 << 30)  # sparse: 5 GB on paper
    start = time.monotonic()
    one_error_line(attnmt("translate", "-m", str(model), input="w1\n"), name)
    assert time.monotonic() - start < 60


def test_11_a_given_sentencepiece_model_with_duplicate_pieces_is_one_line(
    model: Path, tmp_path: Path, corpus
):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString((model / "spm.model").read_bytes())
    m.pieces.add().CopyFrom(m.pieces[5])  # the same piece twice
    bad = tmp_path / "dup.model"
    bad.write_bytes(m.SerializeToString())
    raw = tiny_config(corpus)
    raw["tokenizer"] = {"model": str(bad)}
    cfg = write_config(tmp_path / "c.yaml", raw)
    one_error_line(attnmt("train", "-c", str(cfg), "--out", str(tmp_path / "m")), "dup.model")


# --- outputs that are not regular files ---


def test_12_output_onto_a_device_a_fifo_or_a_link(model: Path, tmp_path: Path):
    r = attnmt("translate", "-m", str(model), "-o", "/dev/null", input="w1\n")
    assert r.returncode == 0 and Path("/dev/null").is_char_device(), r.stderr
    link = tmp_path / "out-link"
    link.symlink_to("/proc/self/fd/1")
    r = attnmt("translate", "-m", str(model), "-o", str(link), input="w1\nw2\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stderr
    target = tmp_path / "real.txt"
    link2 = tmp_path / "link2"
    link2.symlink_to(target)
    assert attnmt("translate", "-m", str(model), "-o", str(link2), input="w1\n").returncode == 0
    assert link2.is_symlink() and len(target.read_text().splitlines()) == 1
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    r = attnmt("translate", "-m", str(model), "-o", str(fifo), input="w1\nw2\nw3\n")
    reader.join(timeout=60)
    assert r.returncode == 0 and got and len(got[0].splitlines()) == 3, r.stderr
