"""Never lose a run, part 5 (issue 55): `attnmt split` never overwrites its input and drops a
byte order mark; issue 59: it takes the TSV's columns."""

from __future__ import annotations

from pathlib import Path

from conftest import write_lines
from helpers import assert_user_error


def test_11_split_drops_a_byte_order_mark(tmp_path, run_cli):
    tsv = tmp_path / "c.tsv"
    rows = [f"w{i} w{j}\tt{i} t{j}" for i in range(12) for j in range(12)]
    tsv.write_bytes(("\ufeff" + "\n".join(rows) + "\n").encode())
    r = run_cli("split", "--tsv", str(tsv), "--out", str(tmp_path / "o"), "--dev", "5",
                "--test", "5")  # fmt: skip
    assert r.code == 0, r.stderr
    texts = [(tmp_path / "o" / f"{s}.src").read_text() for s in ("train", "dev", "test")]
    assert all("\ufeff" not in t for t in texts) and "w0 w0" in "".join(texts)


def _split_inputs(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    d.mkdir()
    pairs = [(f"w{i} w{j}", f"t{i} t{j}") for i in range(12) for j in range(12)]
    write_lines(d / "train.src", [s for s, _ in pairs])
    write_lines(d / "train.tgt", [t for _, t in pairs])
    return d


def test_6_split_never_overwrites_its_input(tmp_path, run_cli):
    d = _split_inputs(tmp_path)
    before = (d / "train.src").read_text()
    args = ("--src", str(d / "train.src"), "--tgt", str(d / "train.tgt"), "--dev", "5",
            "--test", "5")  # fmt: skip
    assert_user_error(run_cli("split", *args, "--out", str(d), "--force"), "is an input")
    assert (d / "train.src").read_text() == before
    r = run_cli("split", "--tsv", str(d / "train.src"), "--out", str(d), "--force")
    assert_user_error(r, "train.src is an input")  # the TSV itself, named as a split's file
    assert (d / "train.src").read_text() == before
    (tmp_path / "file").write_text("x")
    r = run_cli("split", *args, "--out", str(tmp_path / "file"))
    assert_user_error(r, "exists and is not a directory")


def test_6_split_replaces_existing_splits_only_with_force(tmp_path, run_cli):
    d = _split_inputs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "test.src").write_text("curated\n")
    args = ("--src", str(d / "train.src"), "--tgt", str(d / "train.tgt"), "--out", str(out),
            "--dev", "5", "--test", "5")  # fmt: skip
    assert_user_error(run_cli("split", *args), "test.src exists; --force replaces it")
    assert (out / "test.src").read_text() == "curated\n"
    assert run_cli("split", *args, "--force").code == 0
    assert len((out / "test.src").read_text().splitlines()) == 5


def test_59_split_takes_its_columns(tmp_path, run_cli):
    rows = [f"t{i} t{j}\tw{i} w{j}" for i in range(12) for j in range(12)]  # target first
    tsv = write_lines(tmp_path / "c.tsv", rows)
    r = run_cli("split", "--tsv", str(tsv), "--out", str(tmp_path / "o"), "--src-field", "2",
                "--tgt-field", "1", "--dev", "5", "--test", "5")  # fmt: skip
    assert r.code == 0, r.stderr
    assert (tmp_path / "o" / "train.src").read_text().startswith("w")
    assert (tmp_path / "o" / "train.tgt").read_text().startswith("t")
