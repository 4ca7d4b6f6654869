"""attnmt distill: the teacher's beam translations of a corpus, resumable after SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from hashlib import sha256
from pathlib import Path

import pytest

from attnmt import Translator
from attnmt.training.distill import save_progress

from conftest import make_pairs, write_lines
from helpers import wait_for

SOURCE = make_pairs(1500, 31)[0]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_lines(tmp_path / "train.src", SOURCE)


def _distill(model: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "attnmt", "distill", "--teacher", str(model), "--src", str(src),
        "--output", str(out), "--beam", "2", "--device", "cpu", *extra,
    ]  # fmt: skip


def test_distill_writes_the_teachers_beam_translations(trained, source, tmp_path, run_cli):
    model, _ = trained
    out = tmp_path / "train.distilled"
    r = run_cli(*_distill(model, source, out, "--chunk-lines", "400")[3:])
    assert r.code == 0, r.stderr
    assert f"distill: 1,500 lines in {out}" in r.stderr
    want = Translator.load(model, device="cpu").translate(SOURCE, beam=2)
    assert out.read_text(encoding="utf-8").splitlines() == want
    assert not (tmp_path / "train.distilled.partial").exists()
    assert not (tmp_path / "train.distilled.distill.json").exists()
    # Finished: the same command is refused rather than redone; --force redoes it.
    r = run_cli(*_distill(model, source, out)[3:])
    assert r.code == 2 and "exists (a finished distillation?); --force redoes it" in r.stderr
    out.write_text("stale\n")
    assert run_cli(*_distill(model, source, out, "--force")[3:]).code == 0
    assert out.read_text(encoding="utf-8").splitlines() == want


def test_distill_killed_and_rerun_ends_byte_identical(trained, source, tmp_path, run_cli):
    model, _ = trained
    whole, cut = tmp_path / "whole.txt", tmp_path / "cut.txt"
    assert run_cli(*_distill(model, source, whole, "--chunk-lines", "25")[3:]).code == 0
    progress = tmp_path / "cut.txt.distill.json"

    def lines_done() -> int:
        try:
            return json.loads(progress.read_text())["lines"]
        except (OSError, ValueError):
            return 0

    proc = subprocess.Popen(_distill(model, source, cut, "--chunk-lines", "25"))
    wait_for(lambda: lines_done() >= 200, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = lines_done()
    assert 200 <= done < len(SOURCE) and not cut.exists()
    partial = tmp_path / "cut.txt.partial"
    with open(partial, "ab") as f:  # a chunk written but not recorded when the kill came
        f.write(b"half a chunk\nof lines")
    r = run_cli(*_distill(model, source, cut, "--chunk-lines", "25")[3:])
    assert r.code == 0, r.stderr
    assert f"({len(SOURCE) - done:,} translated now" in r.stderr
    assert cut.read_bytes() == whole.read_bytes()


def test_distill_refuses_to_continue_with_other_settings(trained, source, tmp_path, run_cli):
    model, _ = trained
    out = tmp_path / "d.txt"
    (tmp_path / "d.txt.partial").write_bytes(b"")
    job = {
        "job": {"beam": 4},
        "lines": 0,
        "bytes": 0,
        "total": 1500,
        "sha256": sha256().hexdigest(),
    }
    save_progress(tmp_path / "d.txt.distill.json", job)
    r = run_cli(*_distill(model, source, out)[3:])
    assert r.code == 2 and "an interrupted distillation with other settings (beam" in r.stderr
    r = run_cli(*_distill(model, tmp_path / "missing.txt", out)[3:])
    assert r.code == 2 and "file not found" in r.stderr


def test_4_distill_refuses_a_beam_with_sampling_in_one_line(trained, source, tmp_path, run_cli):
    """Issue 77, item 4: `distill --sampling --beam 3` used to sample and ignore the beam."""
    model, _ = trained
    out = tmp_path / "bt.txt"
    r = run_cli(*_distill(model, source, out, "--sampling")[3:])  # _distill gives --beam 2
    assert r.code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "sampling draws instead of searching: drop the beam (--beam)" in r.stderr
    assert not out.exists()
    args = [a for a in _distill(model, source, out, "--sampling")[3:] if a not in ("--beam", "2")]
    assert run_cli(*args).code == 0  # without --beam it samples
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(SOURCE)
