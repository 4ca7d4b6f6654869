"""Data-parallel training: 2 CPU processes under torchrun, gloo backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import tiny_config, write_config


def torchrun(cfg: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "attnmt", "train", "--config", str(cfg), "--out", str(out), "--quiet", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if run.returncode and "Address already in use" in run.stderr:
        # torchrun's rendezvous port was taken between its choice and its bind (a known race
        # of the launcher, not of attnmt): launch once more; no step had run, and a fresh run's
        # half-made directory (its log, its lock) is started over.
        again = cmd if "--resume" in extra else [*cmd, "--overwrite"]
        run = subprocess.run(again, capture_output=True, text=True, env=env, timeout=300)
    return run


def said(run: subprocess.CompletedProcess) -> str:
    """What a failed torchrun printed: its start (the first error) and its end (the summary)."""
    err = run.stderr
    return err if len(err) <= 6000 else f"{err[:3000]}\n[...]\n{err[-3000:]}"


def differing_tensors(a: Path, b: Path) -> list[str]:
    x, y = load_file(a), load_file(b)
    return [
        k for k in sorted(x.keys() | y.keys()) if k not in x or k not in y or not x[k].equal(y[k])
    ]


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow  # torchrun with two gloo processes, twice
def test_two_processes_train_in_sync_and_resume_exactly(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["model"]["dropout"] = 0.3  # ranks must draw different masks, resumed runs the same
    raw["train"].update({"max_steps": 8, "eval_every": 4, "threads": 1})
    cfg = write_config(tmp_path / "c.yaml", raw)
    full = torchrun(cfg, tmp_path / "full")
    assert full.returncode == 0, said(full)
    log = events(tmp_path / "full")
    model = next(e for e in log if e["event"] == "model")
    assert "2 processes" in (tmp_path / "full" / "train.log").read_text()
    assert model["parameters"] > 0
    checks = [e for e in log if e["event"] == "ranks"]
    assert [e["step"] for e in checks] == [4, 8]
    assert all(e["weights_identical"] and e["world"] == 2 for e in checks)
    # Only rank 0 writes: one model line in the log, not two.
    assert sum(e["event"] == "model" for e in log) == 1
    # Each step takes one batch per rank: twice the tokens of a 1-process step.
    steps = [e for e in log if e["event"] == "train"]
    assert steps[-1]["step"] == 8

    # Interrupted after step 4, resumed to 8: the same weights as the uninterrupted run.
    part = torchrun(cfg, tmp_path / "part", "--set", "train.max_steps=4")
    assert part.returncode == 0, said(part)
    resumed = torchrun(cfg, tmp_path / "part", "--resume")
    assert resumed.returncode == 0, said(resumed)
    a, b = tmp_path / "full" / "last.safetensors", tmp_path / "part" / "last.safetensors"
    assert a.read_bytes() == b.read_bytes(), differing_tensors(a, b)


@pytest.mark.slow
def test_two_processes_accumulate_and_stay_in_sync(tmp_path: Path, corpus):
    """accumulate 2 under DDP: the first batch's backward skips the all-reduce (no_sync), the
    last one sums both; the ranks' weights stay identical."""
    raw = tiny_config(corpus)
    raw["train"].update({"max_steps": 4, "eval_every": 4, "threads": 1, "accumulate": 2})
    cfg = write_config(tmp_path / "c.yaml", raw)
    run = torchrun(cfg, tmp_path / "m")
    assert run.returncode == 0, said(run)
    log = events(tmp_path / "m")
    assert next(e for e in log if e["event"] == "model")["batches_per_update"] == 4
    (check,) = [e for e in log if e["event"] == "ranks"]
    assert check["weights_identical"] and check["world"] == 2
