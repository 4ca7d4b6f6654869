"""Never lose a run, part 2: the model directory's lock, outputs complete or absent, damaged or
foreign model files, lost checkpoint pointer, full disks, hostile configs, signals, long lines,
usage errors. Each test reproduces a defect of the adversarial pass of 2026-11-23."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnmt.models.directory import BEST_FILE, save_weights
from attnmt.training.checkpoints import CKPT_DIR, LATEST, lock_model_dir
from attnmt.training.loop import train

from conftest import default_sigint, make_pairs, tiny_config, write_config, write_lines
from helpers import (
    assert_user_error,
    attnmt,
    one_error_line,
    running_trainer,
    start_training,
    trained_steps,
    wait_for,
)


@pytest.fixture
def model(trained: tuple[Path, dict[str, Path]], tmp_path: Path) -> Path:
    """A copy of conftest's tiny trained model directory, free to change."""
    return Path(shutil.copytree(trained[0], tmp_path / "model"))


# --- 1. the model directory's lock ---


def test_a_second_trainer_is_refused_and_touches_nothing(tmp_path: Path, corpus):
    with running_trainer(tmp_path, corpus) as (cfg, out, proc):
        stray = out / CKPT_DIR / ".step-00000009.safetensors.x.tmp"  # as a save in progress
        stray.write_bytes(b"half")
        before = (out / "config.yaml").read_bytes()
        for flags in (["--resume"], ["--overwrite", "--set", "train.seed=7"]):
            r = attnmt("train", "-c", str(cfg), "--out", str(out), "-q", *flags)
            one_error_line(r, f"in use by another attnmt train (pid {proc.pid})")
        assert stray.exists() and (out / "config.yaml").read_bytes() == before
        assert proc.poll() is None  # the first one trains on
    lock_model_dir(out).close()  # kill -9 released the lock: nothing stale


# --- 2. outputs complete or absent, write errors reported ---


def test_a_full_stdout_is_an_error_not_a_truncation(model: Path, tmp_path: Path):
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "attnmt", "translate", "-m", str(model)],
            input="w1 w2\n" * 50, stdout=full, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "attnmt: error: cannot write to standard output (No space left on device)"
    ]


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))


def test_output_that_cannot_be_written_leaves_no_file(model: Path, tmp_path: Path):
    src = write_lines(tmp_path / "in.txt", ["w1 w2 w3"] * 1000)
    out_dir = tmp_path / "outs"
    out_dir.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model), "-i", str(src),
         "-o", str(out_dir / "out.txt")],
        capture_output=True, text=True, preexec_fn=_limit_file_size,
    )  # fmt: skip
    one_error_line(r, "out.txt: cannot write (File too large", "MiB free there")
    assert list(out_dir.iterdir()) == []  # neither the file nor a temporary one


@pytest.mark.parametrize("command", ["translate", "eval"])
def test_output_path_is_checked_before_any_work(model, tmp_path, run_cli, monkeypatch, command):
    from attnmt.decoding.translator import Translator

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr(Translator, "load", never)
    src = write_lines(tmp_path / "in.txt", ["w1"])
    args = ["-m", str(model), "-i" if command == "translate" else "-s", str(src)]
    if command == "eval":
        args += ["-r", str(src)]
    for output, why in ((tmp_path / "none" / "o.txt", "does not exist"), (tmp_path, "directory")):
        assert_user_error(run_cli(command, *args, "-o", str(output)), "--output", why)


# --- 3. forked workers die with their parent ---


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers and /proc: Linux")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_search_workers_die_with_their_parent(model: Path, tmp_path: Path, sig):
    src = write_lines(tmp_path / "in.txt", [" ".join(f"w{i % 12}" for i in range(n % 7 + 1))
                                            for n in range(40000)])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # 1 thread per worker: forked processes
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model), "-i", str(src),
         "--workers", "2", "--batch-tokens", "40", "--beam", "2", "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    workers: set[int] = set()
    try:
        wait_for(lambda: len(_children(proc.pid)) >= 2, proc, timeout=120)
        workers = _children(proc.pid)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while any(map(_alive, workers)) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), "orphaned search workers"
    finally:
        proc.kill()
        for pid in filter(_alive, workers):  # orphans would hold the stderr pipe open
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=30)


# --- 4. and 5. damaged weights, foreign tokenizer or config ---


def _translate(model: Path, *extra: str) -> subprocess.CompletedProcess:
    return attnmt("translate", "-m", str(model), *extra, input="w1 w2\n")


def test_damaged_weights_are_refused(model: Path):
    weights = model / BEST_FILE
    data = bytearray(weights.read_bytes())
    for i in range(len(data) - 200, len(data)):  # inside the tensor data
        data[i] ^= 0x5A
    weights.write_bytes(bytes(data))
    one_error_line(_translate(model), f"{weights}: damaged", "checksum")


def test_non_finite_weights_are_refused(model: Path):
    from attnmt.models.directory import load_model_dir

    _, _, net = load_model_dir(model)
    with torch.no_grad():
        next(net.parameters())[0, 0] = float("nan")
    save_weights(net, model / BEST_FILE)  # a valid checksum over a NaN
    one_error_line(_translate(model), f"{model / BEST_FILE}: damaged", "NaN or infinite")


def test_a_foreign_or_empty_tokenizer_is_refused(model: Path, tmp_path: Path):
    from attnmt.data.tokenizer import train_sentencepiece

    spm_file = model / "spm.model"
    spm_file.write_bytes(train_sentencepiece(make_pairs(200, 5)[0], 30))
    one_error_line(_translate(model), "spm.model: not the SentencePiece model")
    spm_file.write_bytes(b"")
    one_error_line(_translate(model), "spm.model: not the SentencePiece model")


def test_an_edited_or_broken_config_is_refused(model: Path, corpus, tmp_path: Path):
    cfg_file = model / "config.yaml"
    text = cfg_file.read_text()
    cfg_file.write_text(text.replace("heads: 2", "heads: 4"))
    one_error_line(_translate(model), "model.heads is 4, but the model was trained with 2")
    cfg_file.write_text(text.replace("model:", "model: [", 1))
    line = one_error_line(_translate(model), "config.yaml:", "not valid YAML")
    assert line.split("config.yaml:")[1].split(":")[0].isdigit()  # file:line
    cfg = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    r = attnmt("train", "-c", str(cfg), "--out", str(model), "--resume", "-q")
    one_error_line(r, "config.yaml:", "not valid YAML")


# --- 6. a lost pointer ---


def test_resume_without_the_pointer_finds_the_newest_checkpoint(tmp_path: Path, corpus):
    from attnmt.config import from_dict

    raw = tiny_config(corpus)
    raw["train"].update(max_steps=4, eval_every=2, keep_last=3)
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    (out / CKPT_DIR / LATEST).unlink()
    raw["train"]["max_steps"] = 6
    summary = train(from_dict(raw), out, resume=True, quiet=True)
    starts = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e.get("resumed_step") for e in starts if e.get("event") == "model"][-1] == 4
    assert summary["steps"] == 6


# --- 7. full disks ---


def test_a_full_disk_during_a_save_is_one_line(tmp_path: Path, corpus, run_cli, monkeypatch):
    import attnmt.models.directory

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(attnmt.models.directory, "save_file", full)
    cfg = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    r = run_cli("train", "-c", str(cfg), "--out", str(tmp_path / "m"), "-q")
    assert_user_error(r, ".safetensors: cannot write (No space left on device", "MiB free there")


def test_a_nearly_full_disk_is_found_before_any_work(tmp_path: Path, corpus):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    r = subprocess.run(
        [sys.executable, "-m", "attnmt", "train", "-c", str(cfg), "--out", str(tmp_path / "m")],
        capture_output=True, text=True, preexec_fn=_limit_file_size,
    )  # fmt: skip
    one_error_line(r, "cannot write there (File too large")
    assert not (tmp_path / "m" / "spm.model").exists()  # before SentencePiece trained


# --- 8. hostile YAML ---


def test_hostile_configs_are_refused_quickly(tmp_path: Path, run_cli):
    laughs = ["data: {train: {src: a, tgt: b}, dev: {src: a, tgt: b}}", "junk:"]
    laughs.append('  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]')
    for k in range(1, 9):
        laughs.append(f"  a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]")
    start = time.time()
    r = run_cli("train", "-c", str(write_lines(tmp_path / "laughs.yaml", laughs)))
    assert_user_error(r, "laughs.yaml:1: not valid YAML (its aliases expand to over")
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "y" * (1 << 21))
    assert_user_error(run_cli("train", "-c", str(big)), "a config has at most 1 MiB")
    deep = write_lines(tmp_path / "deep.yaml", ["x: " + "[" * 5000 + "]" * 5000])
    assert_user_error(run_cli("train", "-c", str(deep)), "nested too deeply")
    long = write_lines(tmp_path / "long.yaml", [laughs[0], "model: {arch: " + "x" * 5000 + "}"])
    r = run_cli("train", "-c", str(long))
    assert_user_error(r, "model.arch")
    assert len(r.stderr) < 400
    assert time.time() - start < 30


# --- 9. signals outside the loop, 11. usage errors ---


def test_sighup_stops_training_with_a_checkpoint(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=100000, eval_every=100000, log_every=1)
    out = tmp_path / "m"
    proc = start_training(write_config(tmp_path / "c.yaml", raw), out)
    wait_for(lambda: trained_steps(out) >= 2, proc)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGHUP
    assert "SIGHUP at step" in err and "continue with --resume" in err
    assert (out / "last.safetensors").is_file()


def _reading_stdin(pid: int, since: float) -> bool:
    """Blocked in read(0, ...) (syscall 0 on x86-64); on other machines, 5 s after `since`."""
    if os.uname().machine != "x86_64":
        return time.time() - since > 5
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[:2] == ["0", "0x0"]
    except OSError:
        return False


def test_an_interrupt_anywhere_is_one_line(model: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    start = time.time()
    wait_for(lambda: _reading_stdin(proc.pid, start), proc)  # past the imports and model load
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["attnmt: interrupted"]


def test_usage_errors_are_one_line(run_cli):
    assert_user_error(run_cli("translate", "-m", "x", "--beam", "0"), "--beam", "see: attnmt")
    assert_user_error(run_cli("translate", "--bogus"), "No such option: --bogus")
    assert_user_error(run_cli("nosuch"), "No such command")


# --- 10. one long line ---


def test_a_long_line_is_cut_with_a_warning(model: Path, run_cli):
    cfg_file = model / "config.yaml"
    cfg_file.write_text(cfg_file.read_text().replace("max_src_len: 1000", "max_src_len: 8"))
    r = run_cli("translate", "-m", str(model), stdin=("w1\n" + "w2 " * 3000 + "\n").encode())
    assert r.code == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2
    assert "input line 2:" in r.stderr and "cut to the first 7 (decode.max_src_len)" in r.stderr


def test_work_in_a_child_returns_its_bytes_and_errors():
    from attnmt.data.processes import run_in_child
    from attnmt.errors import ConfigError

    assert run_in_child(lambda: b"spm" * 1000) == b"spm" * 1000

    def refused() -> bytes:
        raise ConfigError("tokenizer.vocab_size = 3 is too small")

    with pytest.raises(ConfigError, match="vocab_size = 3 is too small"):
        run_in_child(refused)


def _slow_first(item: int) -> int:
    if item == 0:
        time.sleep(0.5)
    return item * item


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_forked_workers_give_every_item_in_order_when_the_first_is_slow():
    """While item 0 runs, the other worker fills the buffer of finished results; when item 0
    ends, no worker is busy. The map once stopped there (5 of 30 items: the store lost pairs)."""
    from attnmt.data.processes import imap_forked

    assert list(imap_forked(_slow_first, range(30), 2, "died")) == [i * i for i in range(30)]


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_ctrl_c_does_not_wait_for_work_in_a_child():
    """C code that holds on to the thread (a libc sleep standing in for SentencePiece's
    trainer) runs in a child: the parent's KeyboardInterrupt comes at once, the child dies."""
    import ctypes
    import threading

    from attnmt.data.processes import run_in_child

    pids: list[int] = []

    def work() -> bytes:
        ctypes.CDLL(None).sleep(30)
        return b"late"

    def interrupt() -> None:
        pids.extend(_children(os.getpid()))
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(1.0, interrupt)
    start = time.time()
    # As from a terminal, even when the suite runs in the background with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_child(work)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.time() - start < 10
    assert pids and not any(map(_alive, pids))


# --- issue 22: streaming translate, pipes as inputs ---


@contextlib.contextmanager
def lines_answered_one_by_one(proc: subprocess.Popen, write):
    """On entering: two lines written one at a time with write(line), each answered on proc's
    stdout before the next is written. The block then closes proc's input; on leaving, proc
    has ended with 0."""
    import select

    try:
        for line in (b"w1 w2\n", b"w3\n"):
            write(line)
            ready, _, _ = select.select([proc.stdout], [], [], 90)
            assert ready, "no translation while the input is still open"
            assert proc.stdout.readline().endswith(b"\n")
        yield
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_translate_answers_each_line_before_its_input_closes(model: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model), "--beam", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip

    def write(line: bytes) -> None:
        proc.stdin.write(line)
        proc.stdin.flush()

    with lines_answered_one_by_one(proc, write):
        proc.stdin.close()


def test_translate_answers_each_line_of_a_fifo_before_its_writer_closes(
    model: Path, tmp_path: Path
):
    """The FIFO is opened once: the writer, which starts writing as soon as a reader opens it,
    never meets a closed reader (SIGPIPE), and each line is answered while it stays open."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model), "-i", str(fifo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    writer = open(fifo, "wb", buffering=0)  # noqa: SIM115 (blocks until translate opens it)
    with lines_answered_one_by_one(proc, writer.write):
        writer.close()


def test_pipes_are_inputs(model: Path, tmp_path: Path, run_cli):
    import threading

    from attnmt.data.text import read_lines

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("a\nb\xe9\n\nc"))
    writer.start()
    assert read_lines(fifo) == ["a", "bé", "", "c"]
    writer.join()
    r = attnmt("translate", "-m", str(model), "-i", "/dev/stdin", input="w1\nw2 w3\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stderr


def test_output_is_never_partial_after_kill_9(model: Path, tmp_path: Path):
    n = 60000
    src = write_lines(tmp_path / "in.txt", [f"w{i % 12} w{i % 5}" for i in range(n)])
    out = tmp_path / "outs" / "out.txt"
    out.parent.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "translate", "-m", str(model), "-i", str(src),
         "-o", str(out), "--beam", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: any(out.parent.iterdir()), proc)  # the temporary file has begun
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    assert not out.exists() or out.read_text().count("\n") == n


def test_a_long_line_in_a_later_chunk_names_its_own_line(model: Path, monkeypatch, capsys):
    """The cut's warning counts the lines of the chunks before (a streamed input)."""
    import attnmt.decoding.translator

    cfg_file = model / "config.yaml"
    cfg_file.write_text(cfg_file.read_text().replace("max_src_len: 1000", "max_src_len: 8"))
    monkeypatch.setattr(attnmt.decoding.translator, "CHUNK_LINES", 2)
    translator = attnmt.decoding.translator.Translator.load(model, "cpu")
    lines = ["w1", "w2", "w1", "w2 " * 30]  # the long one is the second chunk's second line
    done = list(translator.stream(iter(lines), translator.options(1)))
    assert [len(chunk) for chunk, _ in done] == [2, 2]
    err = capsys.readouterr().err
    assert "input line 4:" in err and "input line 2:" not in err
