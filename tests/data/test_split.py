"""attnmt split: one's own corpus cleaned (each rule counted) and split by unique source."""

from pathlib import Path

from conftest import write_lines


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_split_cleans_counts_and_keeps_dev_and_test_sources_out_of_train(tmp_path, run_cli):
    good = [f"ein satz nummer {i}\tsentence number {i}" for i in range(300)]
    bad = [
        "ein satz nummer 1\tsentence number 1",  # a duplicate pair
        "gleich\tgleich",  # source = target
        "kurz\tthis is a far far far far too long translation",  # misaligned
        " \tnothing",  # an empty side
        " ".join(["wort"] * 250) + "\tword",  # too long
        "ein satz nummer 2\tanother translation of number 2",  # a second translation
    ]
    corpus = write_lines(tmp_path / "corpus.tsv", good + bad)
    out = tmp_path / "splits"
    r = run_cli("split", "--tsv", str(corpus), "--out", str(out), "--dev", "20", "--test", "30")
    assert r.code == 0, r.stderr
    for rule in ("(duplicate pair)", "(source = target)", "(length ratio over 3)",
                 "(empty side)", "(over 200 words)"):  # fmt: skip
        assert f"dropped 1 {rule}" in r.stderr, (rule, r.stderr)
    src = {name: lines(out / f"{name}.src") for name in ("train", "dev", "test")}
    tgt = {name: lines(out / f"{name}.tgt") for name in ("train", "dev", "test")}
    assert [len(src["dev"]), len(src["test"])] == [20, 30]
    assert all(len(src[n]) == len(tgt[n]) for n in src)
    held = set(src["dev"]) | set(src["test"])
    assert len(held) == 50 and not held & set(src["train"])  # no dev/test source in train
    assert len(src["train"]) + 50 in (300, 301)  # number 2's second translation: kept or not
    again = tmp_path / "again"
    run_cli("split", "--tsv", str(corpus), "--out", str(again), "--dev", "20", "--test", "30")
    assert lines(again / "dev.src") == src["dev"]  # the seed decides


def test_split_refuses_unpaired_files_and_too_small_a_corpus(tmp_path, run_cli):
    a = write_lines(tmp_path / "a", ["x y", "z w"])
    b = write_lines(tmp_path / "b", ["1 2", "3 4"])
    r = run_cli("split", "--src", str(a), "--out", str(tmp_path / "o"))
    assert r.code == 2 and "give them in pairs" in r.stderr
    r = run_cli("split", "--src", str(a), "--tgt", str(b), "--out", str(tmp_path / "o"))
    assert r.code == 2 and "need more unique source sentences than the 2 left" in r.stderr
