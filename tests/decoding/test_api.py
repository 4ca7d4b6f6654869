"""attnmt.decoding.translator.Translator: what the CLI, serve and eval call (streams, workers,
test sets)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnmt.data.search_workers
import attnmt.decoding.translate
from attnmt import Translator
from attnmt.config import from_dict
from attnmt.errors import AttnmtError
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config, write_lines

LINES = make_pairs(30, 9)[0]


def test_stream_gives_the_lines_of_translate_chunk_by_chunk(trained, tmp_path: Path):
    model, _ = trained
    translator = Translator.load(model, device="cpu")
    options = translator.options(beam=2)
    expected = translator.translate(LINES, beam=2)
    from_file = translator.stream(write_lines(tmp_path / "in.txt", LINES), options)
    from_lines = translator.stream(iter(LINES), options)
    for found in (from_file, from_lines):
        chunks = list(found)
        assert [line for lines, _ in chunks for line in lines] == LINES
        assert [r[0].text for _, results in chunks for r in results] == expected


def test_workers_come_from_the_config_or_the_caller(trained, monkeypatch):
    model, _ = trained
    seen = []
    real = attnmt.decoding.translate.map_batches
    monkeypatch.setattr(
        attnmt.decoding.translate,
        "map_batches",
        lambda job, b, workers, *rest: seen.append(workers) or real(job, b, workers, *rest),
    )
    one = Translator.load(model, device="cpu")
    assert one.workers == one.cfg.decode.workers == 1
    two = Translator.load(model, device="cpu", workers=2)
    assert two.translate(LINES, batch_tokens=20) == one.translate(LINES, batch_tokens=20)
    assert seen == [2, 1]


def test_attention_spec_is_checked_against_the_model(trained):
    translator = Translator.load(trained[0], device="cpu")
    layers, heads = translator.cfg.model.dec_layers, translator.cfg.model.heads
    assert translator.attention_spec(-1, heads - 1).head == heads - 1
    with pytest.raises(AttnmtError, match=f"the decoder has {layers} layers"):
        translator.attention_spec(layers)
    with pytest.raises(AttnmtError, match=f"the model has {heads} heads"):
        translator.attention_spec(0, heads)


def test_a_test_set_scores_the_same_in_training_and_in_eval(tmp_path: Path, corpus, run_cli):
    """An empty source line counts in both: its empty translation against its reference."""
    src, tgt = make_pairs(12, 5)
    src[4] = ""
    raw = tiny_config(corpus)
    raw["data"]["test"] = {
        "src": str(write_lines(tmp_path / "test.src", src)),
        "tgt": str(write_lines(tmp_path / "test.tgt", tgt)),
    }
    raw["train"].update(max_steps=4, eval_every=4)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    log = (tmp_path / "m" / "train_log.jsonl").read_text().splitlines()
    test = next(e for e in map(json.loads, log) if e["event"] == "test")
    assert test["pairs"] == 12 and test["empty_sources"] == 1
    r = run_cli(
        "eval", "-m", str(tmp_path / "m"), "--src", raw["data"]["test"]["src"],
        "--ref", raw["data"]["test"]["tgt"], "--json",
    )  # fmt: skip
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["bleu"] == test["bleu"]
    assert json.loads(r.stdout)["chrf"] == test["chrf"]


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers: Linux")
def test_search_workers_are_kept_between_calls_while_the_model_stays_the_same(trained):
    """Workers with one thread each are forked processes, kept for the next call
    (data/search_workers.py) while the model is the same object, unchanged, and they live."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 2 workers x 1 thread: forked processes
    try:
        two = Translator.load(trained[0], device="cpu", workers=2)
        one = two.translate(LINES, batch_tokens=20, workers=1)
        assert two.translate(LINES, batch_tokens=20) == one
        first = _kept_pids()
        assert len(first) == 2
        assert two.translate(LINES, batch_tokens=20) == one
        assert _kept_pids() == first  # the same processes searched again
        with torch.no_grad():  # changed in place: the kept copies are stale
            two.model.output.weight.mul_(-1.0)
        changed = two.translate(LINES, batch_tokens=20, workers=1)
        assert changed != one
        assert two.translate(LINES, batch_tokens=20) == changed
        again = _kept_pids()
        assert again and not again & first  # forked anew, the old ones gone
        assert not any(Path(f"/proc/{pid}").exists() for pid in first)
        victim = attnmt.data.search_workers._held.workers.processes[0]
        os.kill(victim.pid, signal.SIGKILL)  # a worker killed between calls: forked anew
        victim.join(timeout=30)
        assert two.translate(LINES, batch_tokens=20) == changed
        assert not _kept_pids() & again
    finally:
        torch.set_num_threads(threads)


def _kept_pids() -> set[int]:
    kept = attnmt.data.search_workers._held.workers
    return set() if kept is None else {p.pid for p in kept.processes}


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers: Linux")
def test_an_int8_gru_is_kept_by_its_workers_too(corpus, tmp_path: Path):
    """An int8 GRU's packed cells are not tensors: the kept workers know it by them still."""
    raw = tiny_config(corpus, arch="rnn")
    raw["train"].update(max_steps=4, eval_every=4)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = Translator.load(tmp_path / "m", device="cpu", workers=2, precision="int8")
        one = two.translate(LINES, batch_tokens=20, workers=1)
        assert two.translate(LINES, batch_tokens=20) == one
        first = _kept_pids()
        assert len(first) == 2 and two.translate(LINES, batch_tokens=20) == one
        assert _kept_pids() == first
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_cpu_translator_keeps_the_memory_its_searches_free(trained):
    """A beam search over a vocabulary of 8,000 frees and takes blocks of MiBs at every step
    (its two layers' caches, copied in the beams' new order); once a Translator has loaded for
    the CPU, the process reuses them instead of handing them back to the OS and faulting their
    pages in anew."""
    code = """
import resource, sys, torch
from attnmt import Translator
from attnmt.config import ModelConfig
from attnmt.decoding.beam import beam_search
from attnmt.decoding.search import Beam, SearchOptions
from attnmt.models.build import build_model
if len(sys.argv) > 1:
    Translator.load(sys.argv[1], device="cpu")
torch.manual_seed(0)
cfg = ModelConfig(arch="transformer", emb_size=256, hidden_size=256, heads=4, ff_size=1024,
                  enc_layers=1, dec_layers=2)
model = build_model(cfg, 8000, 8000, True).eval()
src = torch.randint(4, 8000, (64, 20))
def faults(calls):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        with torch.inference_mode():
            beam_search(model, src, src == 0, SearchOptions(Beam(5), max_len_a=0.0, max_len_b=20))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults(2)  # the memory's first use faults in either way
print(faults(4))
"""

    def faults(*args: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    alone, loaded = faults(), faults(str(trained[0]))
    assert alone > 20_000 and loaded < alone / 5, (alone, loaded)
