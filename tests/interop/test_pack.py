"""attnmt pack: the packed copy holds only what translating needs and translates as the model
directory does, with the weights asked for; an occupied OUT is refused in one line."""

from __future__ import annotations

from pathlib import Path


def test_the_packed_copy_translates_as_the_model_directory(trained, run_cli, tmp_path: Path):
    model, corpus = trained
    lines = ["-i", str(corpus["dev_src"])]
    for weights in ("best", "last"):
        out = tmp_path / f"packed-{weights}"
        packed = run_cli("pack", str(model), str(out), "--weights", weights)
        assert packed.code == 0, packed.stderr
        assert f"attnmt translate -m {out}" in packed.stdout
        assert sorted(p.name for p in out.iterdir()) == [
            "attnmt.json", "best.safetensors", "config.yaml", "spm.model",
        ]  # fmt: skip
        ours = run_cli("translate", "-m", str(out), *lines)
        theirs = run_cli("translate", "-m", str(model), "--weights", weights, *lines)
        assert ours.code == 0 and ours.stdout == theirs.stdout
    assert (model / "checkpoints").is_dir()  # the model directory is left as it was


def test_an_occupied_out_is_refused_unless_forced(trained, run_cli, tmp_path: Path):
    model, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    refused = run_cli("pack", str(model), str(out))
    assert refused.code == 2 and refused.stderr.count("\n") == 1
    assert "not empty; --force replaces it" in refused.stderr
    assert run_cli("pack", str(model), str(out), "--force").code == 0
    assert not (out / "notes.txt").exists()
    assert run_cli("pack", str(model), str(model)).code == 2  # never into the model itself
