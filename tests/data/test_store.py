"""The encoded training store: streamed reading, parallel encoding, fingerprint, reuse."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

import attnmt.data.store as store_mod
import attnmt.data.tokenizer as tokenizer_mod
from attnmt.config import SplitConfig, TokenizerConfig, from_dict
from attnmt.data.store import TokenStore, build_store
from attnmt.data.text import read_pairs, read_parallel
from attnmt.data.tokenizer import Tokenizer
from attnmt.errors import DataError
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config, write_lines


def _corpus(tmp_path: Path, n: int = 300) -> tuple[Path, Path]:
    src, tgt = make_pairs(n, 1)
    src[5], tgt[9] = "   ", ""  # skipped as empty
    src[20] = " ".join(["w1"] * 40)  # longer than max_len
    return write_lines(tmp_path / "s.txt", src), write_lines(tmp_path / "t.txt", tgt)


@pytest.mark.parametrize("workers", [1, 2])
def test_store_equals_direct_encoding(tmp_path: Path, workers, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK_PAIRS", 37)  # many chunks, out of step with workers
    src_path, tgt_path = _corpus(tmp_path)
    split = SplitConfig(src=src_path, tgt=tgt_path)
    tok = Tokenizer.train_on_files([split], TokenizerConfig(vocab_size=40), seed=1)
    meta = build_store(tmp_path, [split], (tok.src.proto, tok.tgt.proto), 20, workers, [src_path])
    text = read_parallel(src_path, tgt_path)
    src, tgt = tok.src.encode(text.src), tok.tgt.encode(text.tgt)
    keep = [i for i in range(len(src)) if len(src[i]) <= 20 and len(tgt[i]) <= 20]
    store = TokenStore(tmp_path / "encoded")
    assert len(store) == len(keep) == meta["pairs"]
    assert [store.src[i] for i in range(len(store))] == [src[i] for i in keep]
    assert [store.tgt[i] for i in range(len(store))] == [tgt[i] for i in keep]
    for _ in range(2):  # pairs() drops the pages it read from the process; they read again
        idx = [3, 0, len(store) - 1, 3]
        assert store.pairs(idx) == ([src[keep[i]] for i in idx], [tgt[keep[i]] for i in idx])
    assert (meta["skipped_empty"], meta["skipped_too_long"]) == (2, len(src) - len(keep))
    src_len, tgt_len = store.lengths()
    assert src_len.tolist() == [len(src[i]) for i in keep]
    assert tgt_len.tolist() == [len(tgt[i]) for i in keep]


def test_streamed_reading_gives_the_same_pairs_and_errors(tmp_path: Path):
    src_path, tgt_path = _corpus(tmp_path)
    text = read_parallel(src_path, tgt_path)
    gz = tmp_path / "s.txt.gz"
    gz.write_bytes(gzip.compress(src_path.read_bytes()))
    assert list(read_pairs(gz, tgt_path)) == list(zip(text.src, text.tgt, strict=True))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a\nb\n\xff\nd\n")
    short = write_lines(tmp_path / "short.txt", ["a", "b"])
    four = write_lines(tmp_path / "four.txt", ["a", "b", "c", "d"])
    for pair in ((bad, four), (four, short), (short, four)):
        with pytest.raises(DataError) as streamed:
            list(read_pairs(*pair))
        with pytest.raises(DataError) as whole:
            read_parallel(*pair)
        assert str(streamed.value) == str(whole.value)


def test_sentencepiece_samples_with_its_seed(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "SAMPLE_SENTENCES", 200)  # fewer than the corpus has
    src_path, tgt_path = _corpus(tmp_path, 600)
    cfg = TokenizerConfig(vocab_size=40)

    def vocab(seed: int) -> bytes:
        return Tokenizer.train_on_files(
            [SplitConfig(src=src_path, tgt=tgt_path)], cfg, seed
        ).src.proto

    assert vocab(1) == vocab(1)
    assert len({vocab(1), vocab(2), vocab(3)}) > 1  # another sample, another vocabulary


def _run(tmp_path: Path, corpus, **train) -> dict:
    raw = tiny_config(corpus)
    raw["train"].update(train)
    return raw


def test_resume_reuses_the_store_and_refuses_changed_data(tmp_path: Path, corpus, monkeypatch):
    raw = _run(tmp_path, corpus, max_steps=4, eval_every=2)
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    raw["train"]["max_steps"] = 6

    def never(*args, **kwargs):
        raise AssertionError("--resume encoded the corpus again")

    monkeypatch.setattr("attnmt.training.prepare.build_store", never)
    train(from_dict(raw), out, resume=True, quiet=True)
    raw["train"]["max_steps"] = 8
    for key, lines in (("train_tgt", 299), ("dev_src", 20)):
        path = corpus[key]
        original = path.read_bytes()
        kept = original.splitlines(keepends=True)[:lines]
        path.write_bytes(b"".join(reversed(kept)))  # shortened or shuffled
        with pytest.raises(DataError, match=f"{path}: changed since the run started"):
            train(from_dict(raw), out, resume=True, quiet=True)
        path.write_bytes(original)
    train(from_dict(raw), out, resume=True, quiet=True)  # the same files again: goes on


def test_reservoir_sample_is_uniform_and_whole_when_small():
    import random
    from collections import Counter

    from attnmt.data.tokenizer import reservoir_sample

    items = [str(i) for i in range(100)]
    assert reservoir_sample(iter(items[:7]), 10, random.Random(0)) == items[:7]
    counts: Counter[str] = Counter()
    for seed in range(2000):
        sample = reservoir_sample(iter(items), 10, random.Random(seed))
        assert len(set(sample)) == 10
        counts.update(sample)
    assert len(counts) == 100
    assert all(140 < c < 260 for c in counts.values())  # 200 expected per item


def test_a_tsv_corpus_gives_the_pairs_of_two_files(tmp_path: Path, corpus):
    from attnmt.data.text import read_split
    from attnmt.errors import ConfigError

    src, tgt = (
        corpus["train_src"].read_text().splitlines(),
        corpus["train_tgt"].read_text().splitlines(),
    )
    tsv = write_lines(
        tmp_path / "c.tsv",
        [f"{t}\t{s}\tattribution #{i}" for i, (s, t) in enumerate(zip(src, tgt, strict=True))],
    )
    pairs = list(read_split(SplitConfig(tsv=tsv, src_field=2, tgt_field=1)))
    assert pairs == list(read_pairs(corpus["train_src"], corpus["train_tgt"]))
    write_lines(tmp_path / "bad.tsv", ["a\tb", "only one field", "c\td"])
    with pytest.raises(DataError, match=r"bad.tsv:2: 1 tab-separated field\(s\); src_field 1"):
        list(read_split(SplitConfig(tsv=tmp_path / "bad.tsv")))
    for bad in (
        {"src": "a", "tsv": "b"},
        {"src": "a"},
        {"tsv": "b", "src_field": 2, "tgt_field": 2},
    ):
        raw = tiny_config(corpus)
        raw["data"]["train"] = bad
        with pytest.raises(ConfigError, match=r"data\.train"):
            from_dict(raw)
    raw = tiny_config(corpus)  # trains from the TSV as from the two files
    raw["data"]["train"] = {"tsv": str(tsv), "src_field": 2, "tgt_field": 1}
    summary = train(from_dict(raw), tmp_path / "m", quiet=True)
    assert summary["steps"] == raw["train"]["max_steps"]


def test_weighted_corpora_take_their_shares_of_an_epoch():
    from collections import Counter

    from attnmt.data.batches import BucketSampler

    lengths = [3] * 100 + [5] * 900  # corpus A: 100 pairs, B: 900
    s = BucketSampler(lengths, lengths, 60, seed=2, corpus_pairs=[100, 900], weights=[1, 1])
    assert s.shares() == [500, 500]
    e1 = [i for b in s.epoch(1) for i in b]
    from_a = [i for i in e1 if i < 100]
    assert len(e1) == 1000 and len(from_a) == 500
    assert set(Counter(from_a).values()) == {5}  # A repeated 5 times, each pair alike
    assert len(set(e1) - set(from_a)) == 500  # B: 500 distinct of its 900
    e2 = [i for b in s.epoch(2) for i in b]
    assert set(e2) != set(e1) and s.epoch(1).as_lists() == s.epoch(1).as_lists()


def test_training_on_two_weighted_corpora_logs_their_shares(tmp_path: Path, corpus):
    import json

    raw = tiny_config(corpus)
    other = (
        write_lines(tmp_path / "o.src", ["w1 w2"] * 30),
        write_lines(tmp_path / "o.tgt", ["t2 t1"] * 30),
    )
    raw["data"]["train"] = [
        {**raw["data"]["train"], "weight": 1},
        {"src": str(other[0]), "tgt": str(other[1]), "weight": 3},
    ]
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    rows = next(e for e in log if e["event"] == "corpora")["corpora"]
    assert [(r["pairs"], r["weight"], r["per_epoch"]) for r in rows] == [(300, 1, 82), (30, 3, 248)]
