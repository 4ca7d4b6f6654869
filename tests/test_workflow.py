"""After the first model: fine-tuning, a given tokenizer, early-stopping metrics, a time budget,
TensorBoard, curves, sampling."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from attnmt import Translator
from attnmt.config import from_dict, parse_duration
from attnmt.data.text import read_split_text
from attnmt.data.tokenizer import Tokenizer
from attnmt.decoding.scores import score
from attnmt.errors import ConfigError
from attnmt.models.directory import load_model_dir
from attnmt.training.loop import train
from attnmt.training.plot import read_curves
from attnmt.training.prepare import encode_split
from attnmt.training.schedules import budget_lr, budget_warmup
from attnmt.training.scoring import dev_loss

from conftest import make_pairs, tiny_config, write_config, write_lines


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture
def source(trained):
    return trained


def test_fine_tuning_starts_from_the_source_weights_and_tokenizer(tmp_path: Path, source):
    source_dir, corpus = source
    raw = tiny_config(corpus)
    raw["data"]["train"] = raw["data"]["dev"]  # new data: the dev pairs
    raw["model"] = {"dropout": 0.2}  # the architecture comes from the source
    raw["tokenizer"] = {}
    raw["train"].update(max_steps=2, init_from=str(source_dir))
    out = tmp_path / "ft"
    train(from_dict(raw), out, quiet=True)
    init = next(e for e in events(out) if e["event"] == "init_from")
    _, tokenizer, model = load_model_dir(source_dir)
    dev = encode_split(read_split_text(from_dict(raw).data.dev), tokenizer)
    assert init["dev_loss"] == pytest.approx(dev_loss(model, dev, 8000, "cpu"), abs=1e-6)
    # The source's dev BLEU is the step-0 point of the curves: TensorBoard and plot show it.
    hyps = Translator(from_dict(raw), tokenizer, model, torch.device("cpu"), "blas").translate(
        read_split_text(from_dict(raw).data.dev).src, beam=1
    )
    refs = read_split_text(from_dict(raw).data.dev).tgt
    assert init["step"] == 0 and init["dev_bleu"] == pytest.approx(score(hyps, refs).bleu)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert next(e.step for e in board.Scalars("dev/bleu")) == 0
    assert read_curves(out).bleu[0][0] == 0 and read_curves(out).dev_loss[0][0] == 0
    assert (out / "spm.model").read_bytes() == (source_dir / "spm.model").read_bytes()
    cfg, _, _ = load_model_dir(out)
    assert cfg.model.hidden_size == 16 and cfg.model.dropout == 0.2
    assert next(e for e in events(out) if e["event"] == "done")["steps"] == 2


@pytest.mark.parametrize(
    ("section", "key", "value", "theirs"),
    [("model", "hidden_size", 32, 16), ("model", "arch", "rnn", "'transformer'"),
     ("tokenizer", "vocab_size", 50, 40)],
)  # fmt: skip
def test_fine_tuning_refuses_another_architecture_or_tokenizer(
    tmp_path: Path, source, section, key, value, theirs
):
    source_dir, corpus = source
    raw = tiny_config(corpus)
    raw[section][key] = value
    raw["train"]["init_from"] = str(source_dir)
    with pytest.raises(ConfigError, match=rf"{section}\.{key} is .*{value}.* has {theirs}"):
        train(from_dict(raw), tmp_path / "ft", quiet=True)
    assert not (tmp_path / "ft").exists()  # refused before the directory is made


def test_init_from_on_the_command_line(tmp_path: Path, source, run_cli):
    source_dir, corpus = source
    raw = tiny_config(corpus)
    raw["train"]["max_steps"] = 1
    cfg = write_config(tmp_path / "c.yaml", raw)
    r = run_cli("train", "-c", str(cfg), "-o", str(tmp_path / "ft"), "-q", "--init-from", "nope")
    assert r.code == 2 and "model directory not found: " in r.stderr, r
    r = run_cli(
        "train", "-c", str(cfg), "-o", str(tmp_path / "ft"), "-q", "--init-from", str(source_dir)
    )
    assert r.code == 0, r
    init = next(e for e in events(tmp_path / "ft") if e["event"] == "init_from")
    assert init["weights"].endswith("best.safetensors")
    # --weights: which of its weights start the run (train.init_weights).
    args = ["train", "-c", str(cfg), "-q", "--init-from", str(source_dir)]
    r = run_cli(*args, "-o", str(tmp_path / "ft-last"), "--weights", "last")
    assert r.code == 0, r
    init = next(e for e in events(tmp_path / "ft-last") if e["event"] == "init_from")
    assert init["weights"].endswith("last.safetensors")
    r = run_cli(*args, "-o", str(tmp_path / "ft-no"), "--weights", "newest")
    assert r.code == 2 and "train.init_weights" in r.stderr and r.stderr.count("\n") == 1, r


def foreign_spm(path: Path, lines: list[str]) -> Path:
    """A SentencePiece model with spm_train's default ids (unk 0, bos 1, eos 2, no pad)."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=40, hard_vocab_limit=False,
        minloglevel=2,
    )  # fmt: skip
    path.write_bytes(buf.getvalue())
    return path


def test_a_given_sentencepiece_model_is_used_and_copied(tmp_path: Path, corpus):
    src, tgt = make_pairs(300, 1)
    given = foreign_spm(tmp_path / "given.model", src + tgt)
    raw = tiny_config(corpus)
    raw["tokenizer"] = {"model": str(given)}
    raw["train"]["max_steps"] = 2
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    theirs = spm.SentencePieceProcessor(model_file=str(given))
    ours = Tokenizer.load(out, joint=True).src.sp
    assert (ours.pad_id(), ours.unk_id(), ours.bos_id(), ours.eos_id()) == (0, 1, 2, 3)
    assert ours.get_piece_size() == theirs.get_piece_size() + 1  # a pad piece added
    for line in src[:20]:
        assert ours.encode(line, out_type=str) == theirs.encode(line, out_type=str)
    _, tokenizer, model = load_model_dir(out)
    assert model.output.weight.shape[0] == len(tokenizer.tgt)


def test_an_unusable_sentencepiece_model_is_one_line(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["tokenizer"] = {"model": str(write_lines(tmp_path / "x.model", ["not a model"]))}
    with pytest.raises(ConfigError, match=r"x\.model: not a SentencePiece model"):
        train(from_dict(raw), tmp_path / "m", quiet=True)
    raw["tokenizer"] = {"model": "a.model", "vocab_size": 100}
    with pytest.raises(ConfigError, match=r"tokenizer\.vocab_size is for training"):
        from_dict(raw)
    raw["tokenizer"] = {"model": "a.model", "joint": False}
    with pytest.raises(ConfigError, match=r"takes tokenizer\.src_model and tokenizer\.tgt_model"):
        from_dict(raw)


@pytest.mark.parametrize("metric", ["loss", "chrf", "auto"])
def test_early_stopping_metric_picks_the_best_checkpoint(tmp_path: Path, corpus, metric):
    """auto, the default, at a tiny model's BLEU (below 5: noise) ranks by chrF."""
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=8, eval_every=2, keep_best=1, keep_last=1)
    raw["train"].pop("early_stopping")  # the default: auto
    if metric != "auto":
        raw["train"]["early_stopping"] = metric
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    vals = [e for e in events(out) if e["event"] == "validation"]
    if metric == "auto":
        assert all(e["dev_bleu"] < 5 for e in vals)
        assert all(e["best_shown"].startswith("chrF ") for e in vals)
        for e in vals:
            e["best"] += 100.0  # chrF - 100 below BLEU 5, so that any BLEU >= 5 ranks above
    key = "dev_loss" if metric == "loss" else "dev_chrf"
    pick = min if metric == "loss" else max
    best = pick(vals, key=lambda e: e[key])
    assert vals[-1]["best"] == pytest.approx(best[key]) and all(e["metric"] == metric for e in vals)
    done = next(e for e in events(out) if e["event"] == "done")
    assert done["best_shown"] == vals[-1]["best_shown"]
    improved = [e["step"] for e in vals if e["improved"]]
    assert improved[-1] == next(e["step"] for e in vals if e[key] == best[key])
    kept = sorted(p.name for p in (out / "checkpoints").glob("*.safetensors"))
    assert f"step-{improved[-1]:08d}.safetensors" in kept  # keep_best ranks by the metric


def test_auto_ranks_by_bleu_from_5_and_by_chrf_below():
    from attnmt.training.dev_metric import dev_score, shown

    noise = [dev_score("auto", b, c, 4.0) for b, c in ((0.12, 5.35), (0.11, 7.29))]
    assert noise[1] > noise[0]  # chrF decides where BLEU is noise
    assert dev_score("auto", 5.0, 20.0, 3.0) > dev_score("auto", 4.9, 60.0, 3.0)
    assert dev_score("auto", 12.3, 30.0, 3.0) > dev_score("auto", 12.2, 45.0, 3.0)
    assert shown("auto", noise[1]) == "chrF 7.29" and shown("auto", 12.3) == "BLEU 12.30"
    assert shown("loss", dev_score("loss", 0, 0, 4.415)) == "loss 4.415"


def test_durations_and_the_budget_schedule():
    assert [parse_duration(t) for t in ("90", "90s", "30m", "2h", "1h30m", "1.5h")] == [
        90, 90, 1800, 7200, 5400, 5400,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("30 minutes")
    assert budget_lr(50, 1.0, 100, 0.1, 0.0) == 0.5  # warming up
    assert budget_lr(100, 1.0, 100, 0.2, 0.2) == 1.0  # the peak when warmup ends
    assert budget_lr(500, 1.0, 100, 0.6, 0.2) == 0.5  # then decaying with the time spent
    assert budget_lr(500, 1.0, 100, 1.0, 0.2) == 0.0
    # A slow machine: warmup ends by time (warmup_share) long before warmup_steps.
    assert budget_warmup(30, 300, 0.05, 0.1) == 0.5
    assert budget_lr(30, 1.0, 300, 0.05, 0.0, 0.1) == 0.5
    assert budget_lr(37, 1.0, 300, 0.1, 0.1, 0.1) == 1.0


def test_a_budget_run_stops_inside_its_budget_with_lr_near_zero(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["train"].update(
        max_steps=10**6, max_epochs=10**4, time_budget="6s", lr_schedule="budget",
        warmup_steps=10**6, warmup_share=0.4, eval_every=10**6, log_every=1,
    )  # fmt: skip
    out = tmp_path / "m"
    summary = train(from_dict(raw), out, quiet=True)
    assert summary["stop_reason"] == "time_budget" and summary["elapsed_s"] <= 6.5, summary
    lrs = [e["lr"] for e in events(out) if e["event"] == "train"]
    # warmup_steps far beyond the budget: warmup ends by time, at 40 % of it (setup included),
    # and says so.
    peak = next(e for e in events(out) if e["event"] == "warmup")["step"]
    assert 1 < peak < len(lrs) and lrs[peak - 1] == 0.003
    assert lrs[:peak] == sorted(lrs[:peak]) and lrs[peak - 1 :] == sorted(lrs[peak - 1 :])[::-1]
    assert len(lrs) > 20 and lrs[-1] < 0.1 * 0.003
    assert "40% of the time budget (train.warmup_share), before warmup_steps" in (
        (out / "train.log").read_text()
    )
    # No validation was due: one at half the budget measures the last one's cost, kept free.
    checked = [e["step"] for e in events(out) if e["event"] == "validation"]
    assert len(checked) == 2 and checked[0] < checked[1] == len(lrs), checked
    with pytest.raises(ConfigError, match=r"decays to train\.time_budget"):
        from_dict({**raw, "train": {"lr_schedule": "budget"}})


def test_tensorboard_holds_the_logged_scalars_and_examples(tmp_path: Path, corpus):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    raw = tiny_config(corpus)
    raw["train"].update(max_steps=4, eval_every=2, log_every=1)
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    board.Reload()
    tags = board.Tags()
    for tag in ("train/loss", "train/lr", "train/tokens_per_s", "train/teacher_forcing",
                "dev/loss", "dev/ppl", "dev/bleu", "dev/chrf"):  # fmt: skip
        assert tag in tags["scalars"], tag
    log = events(out)
    loss = {e["step"]: e["loss"] for e in log if e["event"] == "train"}
    got = {s.step: s.value for s in board.Scalars("train/loss")}
    assert got == pytest.approx(loss)
    assert [s.step for s in board.Scalars("dev/bleu")] == [2, 4]
    assert "dev/examples/text_summary" in tags["tensors"]


def test_plot_writes_a_png_of_several_runs(tmp_path: Path, source, run_cli):
    import matplotlib.image

    source_dir, _ = source
    png = tmp_path / "curves.png"
    r = run_cli("plot", str(source_dir), str(source_dir), "--output", str(png))
    assert r.code == 0, r
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 500 and image.std() > 0.05
    r = run_cli("plot", str(tmp_path), "--output", str(png))
    assert r.code == 2 and "train_log.jsonl: cannot read" in r.stderr, r


def test_sampling_is_reproducible_and_top_1_is_greedy(source, run_cli):
    source_dir, _ = source
    lines = "".join(f"{s}\n" for s in make_pairs(12, 5)[0]).encode()
    model = ["translate", "-m", str(source_dir)]

    def out(*args: str) -> str:
        r = run_cli(*model, *args, stdin=lines)
        assert r.code == 0, r
        return r.stdout

    drawn = out("--sampling", "--seed", "3", "--n-best", "3", "--temperature", "2")
    assert drawn == out("--sampling", "--seed", "3", "--n-best", "3", "--temperature", "2")
    assert drawn != out("--sampling", "--seed", "4", "--n-best", "3", "--temperature", "2")
    assert len(drawn.splitlines()) == 36
    greedy = out("--beam", "1")
    assert out("--sampling", "--top-k", "1") == greedy
    assert out("--sampling", "--temperature", "3") != greedy
    r = run_cli(*model, "--sampling", "--beam", "2", stdin=lines)
    assert r.code == 2 and "drop the beam" in r.stderr


def test_resumed_budget_keeps_the_time_spent(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=4, eval_every=2)
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    first = next(e for e in events(out) if e["event"] == "done")["elapsed_s"]
    raw["train"]["max_steps"] = 6
    summary = train(from_dict(raw), out, resume=True, quiet=True)
    assert summary["elapsed_s"] >= first  # the 4 steps' time (and setup's) still counts
