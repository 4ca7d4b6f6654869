import json
from pathlib import Path

import pytest

from attnmt.data.files import atomic_write_bytes
from attnmt.errors import CheckpointError
from attnmt.models.directory import load_model_dir
from attnmt.training.checkpoints import prepare_output_dir


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_atomic_write_failure_keeps_old_file(tmp_path: Path):
    from attnmt.data.files import WriteError, atomic_write

    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")

    def failing(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(WriteError, match=r"f.bin: cannot write \(disk full; .* MiB free there\)"):
        atomic_write(target, failing)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_output_dir_rules(tmp_path: Path):
    out = tmp_path / "run"
    prepare_output_dir(out, overwrite=False, resume=False)  # new: created
    (out / "config.yaml").write_text("x")
    (out / ".best.safetensors.abc.tmp").write_text("half-written")
    with pytest.raises(CheckpointError, match=r"already holds a run.*--resume.*--overwrite"):
        prepare_output_dir(out, overwrite=False, resume=False)
    prepare_output_dir(out, overwrite=False, resume=True)  # kept, stale temp file removed
    assert (out / "config.yaml").exists()
    assert not (out / ".best.safetensors.abc.tmp").exists()
    prepare_output_dir(out, overwrite=True, resume=False)
    assert not (out / "config.yaml").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        prepare_output_dir(blocker, overwrite=False, resume=False)
    # A directory that cannot be created fails at once, before any data is read.
    with pytest.raises(CheckpointError, match="cannot write there"):
        prepare_output_dir(blocker / "sub", overwrite=False, resume=False)


def test_not_a_model_directory(tmp_path: Path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        load_model_dir(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="is not an attnmt model directory"):
        load_model_dir(tmp_path)


def test_newer_format_is_refused(tmp_path: Path):
    (tmp_path / "config.yaml").write_text("{}")
    meta = {"format_version": 999, "src_vocab_size": 10, "tgt_vocab_size": 10}
    (tmp_path / "attnmt.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format version 999 is newer"):
        load_model_dir(tmp_path)


def test_average_is_the_mean_of_the_chosen_checkpoints(tmp_path: Path, corpus, run_cli):
    import torch
    from safetensors.torch import load_file

    from attnmt.config import from_dict
    from attnmt.training.loop import train

    from conftest import tiny_config

    raw = tiny_config(corpus)
    raw["train"].update(max_steps=6, eval_every=2, keep_last=3, keep_best=3)
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    step = {s: out / "checkpoints" / f"step-{s:08d}.safetensors" for s in (2, 4, 6)}
    assert all(f.is_file() for f in step.values())
    r = run_cli("average", str(out), "--last", "2")
    # Step 2 is warmup's (warmup_steps 2): left out, as train.average_last leaves it out.
    assert r.code == 0 and "mean of steps 4, 6 (left out 2: before the lr peak" in r.stdout, r
    averaged, four, six = (load_file(f) for f in (out / "averaged.safetensors", step[4], step[6]))
    assert averaged.keys() == four.keys()
    for name, t in averaged.items():
        torch.testing.assert_close(t, (four[name].double() + six[name].double()).div(2).float())
    r = run_cli("translate", "-m", str(out), "--weights", "averaged", stdin=b"w1 w2\n")
    assert r.code == 0 and r.stdout.count("\n") == 1, r
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    bleu = {e["step"]: e["dev_bleu"] for e in log if e["event"] == "validation"}
    best = sorted(sorted((s for s in bleu if s > 2), key=lambda s: (-bleu[s], -s))[:2])
    r = run_cli("average", str(out), "--best", "2")
    assert r.code == 2 and "averaged.safetensors exists (training writes it); --force" in r.stderr
    r = run_cli("average", str(out), "--best", "2", "--force")
    assert r.code == 0 and f"mean of steps {best[0]}, {best[1]}" in r.stdout, r
    r = run_cli("average", str(out), "--last", "3", "--force")
    assert r.code == 2 and "3 checkpoints asked for, 2 kept after the lr peak" in r.stderr
    assert "--include-early" in r.stderr
    r = run_cli("average", str(out), "--last", "3", "--force", "--include-early")
    assert r.code == 0 and "mean of steps 2, 4, 6" in r.stdout, r
    r = run_cli("average", str(out), "--last", "5", "--force", "--include-early")
    assert r.code == 2 and "5 checkpoints asked for, 3 kept" in r.stderr
    assert run_cli("average", str(out)).code == 2  # neither --last nor --best
