"""Training with translation memory matches (issue 80, Neural Fuzzy Repair): data.tm adds each
training pair that has a match, "SOURCE <FM> MATCH" -> TARGET, as a corpus of its own in the
encoded store, made once (a resume is byte-identical); a model trained so reads a fuzzy
match after its line when it translates with --tm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnmt import Translator
from attnmt.config import from_dict
from attnmt.data.store import open_store
from attnmt.data.tm import TranslationMemory
from attnmt.data.tokenizer import FM_TAG
from attnmt.errors import ConfigError
from attnmt.training.loop import train
from attnmt.training.tm_pairs import TM_PAIRS

from conftest import tiny_config


def config(corpus, **tm) -> dict:
    raw = tiny_config(corpus)
    raw["data"]["tm"] = {"path": "self", "threshold": 0.3, **tm}
    raw["train"].update(max_steps=8, eval_every=4)
    return raw


def test_the_store_holds_the_pairs_with_their_matches(tmp_path: Path, corpus):
    train(from_dict(config(corpus)), tmp_path / "m", quiet=True)
    lines = (tmp_path / "m" / TM_PAIRS).read_text().splitlines()
    sources = corpus["train_src"].read_text().splitlines()
    assert 0 < len(lines) <= len(sources)
    for line in lines:
        augmented, target = line.split("\t")
        source, match = augmented.split(f" {FM_TAG} ")
        assert source in sources and match and target
    store = open_store(tmp_path / "m")
    assert store is not None and 0 < store.meta["corpus_pairs"][1] <= len(lines)  # max_len cuts
    events = [json.loads(x) for x in (tmp_path / "m" / "train_log.jsonl").read_text().splitlines()]
    assert any(e["event"] == "tm" and e.get("matched") == len(lines) for e in events)
    ours = Translator.load(tmp_path / "m", device="cpu")
    fm = ours.tokenizer.fm_id()
    assert fm is not None and ours.tokenizer.src.encode([f"w1 {FM_TAG} t1"])[0].count(fm) == 1


def test_training_with_matches_resumes_to_the_byte(tmp_path: Path, corpus):
    raw = config(corpus)
    train(from_dict(raw), tmp_path / "full", quiet=True)
    short = {**raw, "train": {**raw["train"], "max_steps": 4}}
    train(from_dict(short), tmp_path / "part", quiet=True)
    train(from_dict(raw), tmp_path / "part", resume=True, quiet=True)
    for name in ("last.safetensors", "best.safetensors", TM_PAIRS):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "part" / name).read_bytes()


def test_a_tm_file_and_a_model_that_reads_its_fuzzy_matches(tmp_path: Path, corpus):
    sources = corpus["train_src"].read_text().splitlines()
    targets = corpus["train_tgt"].read_text().splitlines()
    with TranslationMemory(tmp_path / "tm.db", create=True) as tm:
        tm.add_many(list(zip(sources[:100], targets[:100], strict=True)), "xx", "yy", "t")
    raw = config(corpus, path=str(tmp_path / "tm.db"))
    train(from_dict(raw), tmp_path / "m", quiet=True)
    assert (tmp_path / "m" / TM_PAIRS).read_text().count(FM_TAG) > 0
    ours = Translator.load(tmp_path / "m", device="cpu")
    ours.use_tm(tmp_path / "tm.db", threshold=0.3)
    words = sources[0].split()
    near = " ".join([*words[:-1], "w0" if words[-1] != "w0" else "w1"])
    prepared = ours.prepare([near], ours.options(beam=1))
    use = prepared.tm[0]
    assert use is not None and use.fed and not use.exact
    assert prepared.lines == [f"{near} {FM_TAG} {use.target}"]  # as training wrote them


def test_a_tm_that_is_not_there_is_one_clear_error(tmp_path: Path, corpus):
    raw = config(corpus, path=str(tmp_path / "none.db"))
    with pytest.raises(ConfigError, match=r"data\.tm\.path: no translation memory"):
        train(from_dict(raw), tmp_path / "m", quiet=True)
    assert not (tmp_path / "m" / TM_PAIRS).exists()
