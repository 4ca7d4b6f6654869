"""Issue 77, item 0: a training step computes the same bits on any number of threads, so a run
chooses its threads again as other processes take or let go of CPUs and a resume is still
byte-identical to the uninterrupted run, whatever the load during either.

Each training here is its own process: MKL takes its reproducible mode at its first call, which
in this test process came long before."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attnmt.config import from_dict
from attnmt.training import setup as setup_mod
from attnmt.training.loop import train

from conftest import tiny_config, write_config
from helpers import busy_elsewhere, start_training, trained_steps, wait_for

CPUS = len(os.sched_getaffinity(0))


def config(corpus, arch: str, **train_overrides) -> dict:
    """Wide enough that torch splits the step's reductions among threads (at tiny widths each
    runs on one thread whatever the count, and the test could not fail)."""
    raw = tiny_config(corpus, arch)
    raw["model"].update(
        emb_size=64, hidden_size=64, heads=4, ff_size=256, enc_layers=2, dec_layers=2,
        dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    raw["train"].update(batch_tokens=600, clip_grad_norm=0.5, **train_overrides)
    return raw


def events(out: Path, kind: str) -> list[dict]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def run(cfg: Path, out: Path, *extra: str) -> None:
    proc = start_training(cfg, out, *extra)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def same_results(a: Path, b: Path, logs: bool = True) -> None:
    """The same weights and (with `logs`) the same dev losses at the same steps. A kill -9
    may land between a checkpoint and its validation's log line: its log may then lack one."""
    for name in ("last.safetensors", "best.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    scores = [[(e["step"], e["dev_loss"]) for e in events(d, "validation")] for d in (a, b)]
    if logs:
        assert scores[0] == scores[1]
    else:  # every dev loss `a` logged (some twice, one maybe missing) is `b`'s at its step
        assert set(scores[0]) <= set(scores[1])


@contextlib.contextmanager
def busy_cpus(n: int) -> Iterator[None]:
    """n processes that spin, each holding a CPU, for the block."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_0_the_same_config_trains_to_the_same_bytes_on_1_and_2_threads(tmp_path, corpus, arch):
    raw = config(corpus, arch, max_steps=12, eval_every=6)
    if arch == "rnn":  # the fused recurrence (one layer, additive attention) and MKL's GEMMs
        raw["model"].update(enc_layers=1, dec_layers=1, attention="bahdanau")
    cfg = write_config(tmp_path / "c.yaml", raw)
    for threads in (1, 2):
        run(cfg, tmp_path / f"t{threads}", "--set", f"train.threads={threads}")
    same_results(tmp_path / "t1", tmp_path / "t2")


@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs: one held by a busy loop, one to train on")
def test_0_stopped_under_load_and_resumed_idle_is_byte_identical(tmp_path, corpus):
    raw = config(corpus, "transformer", max_steps=100000, eval_every=4, log_every=1)
    cfg = write_config(tmp_path / "c.yaml", raw)
    part = tmp_path / "part"
    with busy_cpus(CPUS - 1):
        proc = start_training(cfg, part)
        wait_for(lambda: trained_steps(part) >= 6, proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
    assert [e["threads"] for e in events(part, "threads")][:1] == [1], "the load was not seen"
    stopped = json.loads((part / "checkpoints" / "latest.json").read_text())["step"]
    end = ["--set", f"train.max_steps={stopped + 6}"]
    run(cfg, part, "--resume", *end)  # idle: on every CPU
    run(cfg, tmp_path / "full", *end)
    assert not events(tmp_path / "full", "threads"), "the uninterrupted run was not idle"
    same_results(part, tmp_path / "full")


@pytest.mark.slow
@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs: one held by a busy loop, one to train on")
def test_0_twenty_kill_9_under_changing_load_then_resume_is_byte_identical(tmp_path, corpus):
    raw = config(
        corpus, "transformer", max_steps=100000, eval_every=1, log_every=1, keep_last=2,
        patience=100000,
    )  # fmt: skip
    raw["model"].update(enc_layers=1, dec_layers=1)  # saves every step: quick ones
    cfg = write_config(tmp_path / "c.yaml", raw)
    out, rng, kills = tmp_path / "m", random.Random(0), 0
    while kills < 20:
        with busy_cpus(CPUS - 1) if kills % 2 else contextlib.nullcontext():
            before = trained_steps(out)
            proc = start_training(cfg, out, "--resume")
            wait_for(lambda b=before: trained_steps(out) > b, proc, timeout=120)  # it trains
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()
            kills += 1
    stopped = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    end = ["--set", f"train.max_steps={stopped + 4}"]
    run(cfg, out, "--resume", *end)
    run(cfg, tmp_path / "full", *end)
    assert {e["threads"] for e in events(out, "threads")} == {1}, "no run saw the load"
    same_results(out, tmp_path / "full", logs=False)


def test_0_a_cpu_let_go_is_trained_on_and_one_taken_is_given_back(tmp_path, corpus, monkeypatch):
    """The threads are chosen again every THREADS_EVERY_S (here 0.5 s): under a busy loop the
    run trains on fewer threads, and on all of them again once the loop ends."""
    if CPUS < 2:
        pytest.skip("needs 2 CPUs")
    monkeypatch.setattr(setup_mod, "THREADS_EVERY_S", 0.5)
    raw = config(corpus, "transformer", max_steps=100000, time_budget="25s", eval_every=100000)
    out = tmp_path / "m"
    # Another program's loops take the CPUs from 3 s into the run to 13 s (the run's first
    # choice is made while they are free): the run goes down to 1 thread and back up.
    spin = "import time; time.sleep(3); end = time.time() + 10\nwhile time.time() < end: pass"
    before = torch.get_num_threads()
    torch.set_num_threads(CPUS)  # what a new process starts with
    try:
        with busy_elsewhere(CPUS - 1, spin):
            train(from_dict(raw), out, quiet=True)
    finally:
        torch.set_num_threads(before)
    counts = [e["threads"] for e in events(out, "threads")]
    assert 1 in counts and counts[-1] == CPUS, counts
