"""Training: exact resume, signals, kill -9, non-finite guards, safe loading."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from attnmt import errors
from attnmt.config import from_dict
from attnmt.decoding.search import Beam, SearchOptions
from attnmt.decoding.translate import translate_lines
from attnmt.device import (
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_VARIABLES,
    cpu_matmul_hardware,
    resolve_precision,
)
from attnmt.errors import CheckpointError, ConfigError, TrainingError
from attnmt.models.directory import load_model_dir
from attnmt.models.transformer import TransformerSeq2Seq
from attnmt.training import checkpoints, distributed, loop, runlog, schedules, validation
from attnmt.training import setup as setup_mod
from attnmt.training import step as step_mod
from attnmt.training.checkpoints import latest_checkpoint, load_train_state
from attnmt.training.loop import train

from conftest import tiny_config, write_config
from helpers import start_training, trained_steps, wait_for


def config(corpus, arch="transformer", **train_overrides):
    raw = tiny_config(corpus, arch)
    raw["model"]["dropout"] = 0.3
    raw["train"]["teacher_forcing"] = {"schedule": "linear", "start": 0.9, "end": 0.5, "steps": 10}
    raw["train"].update(train_overrides)
    return raw


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("arch", "accumulate"), [("transformer", 1), ("rnn", 1), ("transformer", 2), ("rnn", 2)]
)
def test_resume_is_byte_identical(tmp_path: Path, corpus, arch, accumulate):
    raw = config(corpus, arch, max_steps=12, eval_every=4, keep_last=2, accumulate=accumulate)
    train(from_dict(raw), tmp_path / "full", quiet=True)
    # Interrupted at step 4 (a run that ends there), resumed to step 12 (the max_steps change
    # is allowed on resume).
    raw_k = config(corpus, arch, max_steps=4, eval_every=4, keep_last=2, accumulate=accumulate)
    train(from_dict(raw_k), tmp_path / "part", quiet=True)
    summary = train(from_dict(raw), tmp_path / "part", resume=True, quiet=True)
    assert summary["steps"] == 12
    for name in ("last.safetensors", "best.safetensors"):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "part" / name).read_bytes()
    full = [e for e in events(tmp_path / "full") if e["event"] == "validation"]
    part = [e for e in events(tmp_path / "part") if e["event"] == "validation"]
    assert [(e["step"], e["dev_loss"]) for e in full] == [(e["step"], e["dev_loss"]) for e in part]
    # keep_last=2, keep_best=1: at most 3 step checkpoints remain
    files = sorted(p.name for p in (tmp_path / "part" / "checkpoints").glob("step-*.safetensors"))
    assert 2 <= len(files) <= 3 and "step-00000012.safetensors" in files


def test_resume_refuses_a_changed_model(tmp_path: Path, corpus):
    raw = config(corpus, max_steps=4)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    raw["model"]["hidden_size"] = 32
    with pytest.raises(ConfigError, match=r"'model.hidden_size' = 32 differs from the run's 16"):
        train(from_dict(raw), tmp_path / "m", resume=True, quiet=True)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nonfinite_steps_are_skipped_then_stop(tmp_path: Path, corpus, monkeypatch, precision):
    original = TransformerSeq2Seq.loss
    calls = {"n": 0}

    def flaky_loss(self, batch, *args, **kwargs):
        calls["n"] += 1
        loss, n = original(self, batch, *args, **kwargs)
        return (loss * float("nan"), n) if calls["n"] in (3, 4) else (loss, n)

    monkeypatch.setattr(TransformerSeq2Seq, "loss", flaky_loss)
    raw = config(corpus, max_steps=6, precision=precision)
    summary = train(from_dict(raw), tmp_path / "a", quiet=True)
    assert summary["steps"] == 6 and summary["skipped_nonfinite_steps"] == 2
    assert [e["in_a_row"] for e in events(tmp_path / "a") if e["event"] == "nonfinite"] == [1, 2]
    _, _, model = load_model_dir(tmp_path / "a", "last.safetensors")
    assert all(torch.isfinite(p).all() for p in model.parameters())

    def inf_loss(self, batch, *args, **kwargs):
        loss, n = original(self, batch, *args, **kwargs)
        return loss * float("inf"), n

    monkeypatch.setattr(TransformerSeq2Seq, "loss", inf_loss)
    with pytest.raises(TrainingError, match=r"3 steps in a row .*\(train\.max_bad_steps = 3\)"):
        raw = config(corpus, max_steps=6, max_bad_steps=3, precision=precision)
        train(from_dict(raw), tmp_path / "b", quiet=True)
    assert not (tmp_path / "b" / "best.safetensors").exists()


def test_nonfinite_dev_score_is_never_best(tmp_path: Path, corpus, monkeypatch):
    monkeypatch.setattr("attnmt.training.scoring.dev_loss", lambda *a, **k: float("nan"))
    train(from_dict(config(corpus, max_steps=4)), tmp_path / "m", quiet=True)
    assert not (tmp_path / "m" / "best.safetensors").exists()
    assert (tmp_path / "m" / "last.safetensors").exists()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_crafted_pickle_is_refused_and_its_code_never_runs(tmp_path: Path, corpus, run_cli):
    cfg = write_config(tmp_path / "c.yaml", config(corpus, max_steps=4))
    out = tmp_path / "m"
    assert run_cli("train", "-c", str(cfg), "--out", str(out), "-q").code == 0
    _, state_path = latest_checkpoint(out)
    marker = tmp_path / "pwned"
    torch.save({"format_version": 1, "payload": _Evil(marker)}, state_path)
    assert not marker.exists()
    r = run_cli("train", "-c", str(cfg), "--out", str(out), "--resume", "-q")
    assert r.code == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "refused to load" in r.stderr and "could run code" in r.stderr
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused to load"):
        load_train_state(state_path)
    assert not marker.exists()


def test_damaged_state_is_a_one_line_error(tmp_path: Path, corpus, run_cli):
    cfg = write_config(tmp_path / "c.yaml", config(corpus, max_steps=4))
    out = tmp_path / "m"
    assert run_cli("train", "-c", str(cfg), "--out", str(out), "-q").code == 0
    _, state_path = latest_checkpoint(out)
    state = load_train_state(state_path)
    state["progress"]["surprise"] = 1
    torch.save(state, state_path)
    r = run_cli("train", "-c", str(cfg), "--out", str(out), "--resume", "-q")
    assert r.code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot restore the training state" in r.stderr


def test_newer_state_format_is_refused(tmp_path: Path):
    path = tmp_path / "s.pt"
    torch.save({"format_version": 99}, path)
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        load_train_state(path)


def test_existing_run_needs_resume_or_overwrite(tmp_path: Path, corpus, run_cli):
    cfg = write_config(tmp_path / "c.yaml", config(corpus, max_steps=2))
    out = str(tmp_path / "m")
    assert run_cli("train", "-c", str(cfg), "--out", out, "-q").code == 0
    r = run_cli("train", "-c", str(cfg), "--out", out, "-q")
    assert r.code == 2 and "already holds a run" in r.stderr and "--resume" in r.stderr
    r = run_cli("train", "-c", str(cfg), "--out", out, "-q", "--resume", "--overwrite")
    assert r.code == 2 and "contradict" in r.stderr


# --- subprocess tests: real signals and kill -9 ---


def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path: Path, corpus):
    cfg = write_config(
        tmp_path / "c.yaml", config(corpus, max_steps=100000, eval_every=100000, log_every=1)
    )
    out = tmp_path / "m"
    proc = start_training(cfg, out)
    wait_for(lambda: trained_steps(out) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM at step" in err and err.count("checkpoint saved") == 1, err
    step = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    assert step >= 3
    # No validation ran, so there is no best yet: the interrupt's weights are last, which
    # translate takes by default then, and step-N names the checkpoint.
    assert not (out / "best.safetensors").exists()
    for weights in ("best", "last", f"step-{step}"):
        _, tok, model = load_model_dir(out, weights)
        assert len(translate_lines(model, tok, ["w1 w2"], SearchOptions(), batch_tokens=100)) == 1
    proc = start_training(cfg, out, "--resume", "--set", f"train.max_steps={step + 2}")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert events(out)[-1]["steps"] == step + 2
    # A second signal does not wait for the checkpoint: the process exits at once.
    out2 = tmp_path / "m2"
    proc = start_training(cfg, out2)
    wait_for(lambda: trained_steps(out2) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # Both are pending at once; CPython runs the handlers in signal-number order, so the
    # second one handled (whichever it is) ends the process without the checkpoint message.
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    assert "checkpoint saved" not in err


def test_kill_9_never_breaks_the_model_directory(tmp_path: Path, corpus):
    """kill -9 at random moments (many inside a save): every time the directory still
    translates and --resume still continues."""
    cfg = write_config(
        tmp_path / "c.yaml",
        config(corpus, max_steps=100000, eval_every=1, log_every=1, keep_last=2),
    )
    out = tmp_path / "m"
    rng = random.Random(0)
    kills = mid_save = 0

    def temp_files() -> list[Path]:
        return [*out.glob(".*.tmp"), *(out / "checkpoints").glob(".*.tmp")]

    while kills < 24:
        proc = start_training(cfg, out, "--resume")
        wait_for(lambda: (out / "checkpoints" / "latest.json").exists(), proc)
        if kills % 2:
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment
        else:
            # The moment a save has begun: its temporary file exists, the rename has not run.
            deadline = time.time() + 20
            while not temp_files() and proc.poll() is None and time.time() < deadline:
                pass
        if proc.poll() is not None:
            proc.communicate()  # closes its pipes
            continue
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        kills += 1
        mid_save += bool(temp_files())
        _, state = latest_checkpoint(out)
        assert load_train_state(state)["progress"]["step"] >= 1
        _, tok, model = load_model_dir(out)  # best.safetensors: complete and loadable
        assert (
            len(
                translate_lines(
                    model, tok, ["w1 w2", "", "w3"], SearchOptions(Beam(2)), batch_tokens=100
                )
            )
            == 3
        )
    assert mid_save >= 3, f"only {mid_save} of {kills} kills landed inside a save"
    print(f"{kills} kills, {mid_save} left a save half-written")
    before = load_train_state(latest_checkpoint(out)[1])["progress"]["step"]
    proc = start_training(cfg, out, "--resume", "--set", f"train.max_steps={before + 2}")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert events(out)[-1]["steps"] == before + 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path: Path, corpus, monkeypatch, precision):
    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    raw = config(corpus, max_steps=6, eval_every=6, precision=precision)
    summary = train(from_dict(raw), tmp_path / "m", quiet=True)
    # oneDNN's kernel caches (its own and ideep's) are bounded for low-precision CPU runs.
    for name in ONEDNN_CACHE_VARIABLES:
        assert os.environ[name] == str(ONEDNN_CACHE_CAPACITY)
    assert summary["steps"] == 6
    _, _, model = load_model_dir(tmp_path / "m")
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    assert "bf16" in (tmp_path / "m" / "train.log").read_text() or precision == "fp16"


@pytest.mark.parametrize("hardware", [True, False])
def test_low_precision_without_cpu_hardware_is_flagged(
    tmp_path: Path, corpus, monkeypatch, hardware
):
    monkeypatch.setattr("attnmt.device.cpu_matmul_hardware", lambda precision: hardware)
    raw = config(corpus, max_steps=2, eval_every=2, precision="bf16")
    train(from_dict(raw), tmp_path / "m", quiet=True)
    flagged = [e for e in events(tmp_path / "m") if e["event"] == "precision"]
    assert len(flagged) == (0 if hardware else 1)
    log_text = (tmp_path / "m" / "train.log").read_text()
    assert ("slower than fp32" in log_text) == (not hardware)


@pytest.mark.parametrize("hardware", [True, False])
def test_auto_precision_is_bf16_only_on_native_hardware(
    tmp_path: Path, corpus, monkeypatch, hardware
):
    monkeypatch.setattr("attnmt.device.cpu_matmul_hardware", lambda precision: hardware)
    raw = config(corpus, max_steps=2, eval_every=2, precision="auto", device="cpu")
    train(from_dict(raw), tmp_path / "m", quiet=True)
    model_event = next(e for e in events(tmp_path / "m") if e["event"] == "model")
    assert model_event["precision"] == ("bf16" if hardware else "fp32")
    assert not [e for e in events(tmp_path / "m") if e["event"] == "precision"]
    assert resolve_precision("fp16", torch.device("cpu")) == "fp16"  # named formats stay


def test_cpu_matmul_hardware_answers_from_the_cpu_probes(monkeypatch):
    probes = {"_is_amx_tile_supported": False, "_is_avx512_bf16_supported": False,
              "_is_amx_fp16_supported": False}  # fmt: skip
    for name, value in probes.items():
        monkeypatch.setattr(torch.cpu, name, lambda v=value: v, raising=False)
    assert cpu_matmul_hardware("fp32") is True
    assert not cpu_matmul_hardware("bf16") and not cpu_matmul_hardware("fp16")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu_matmul_hardware("bf16") and not cpu_matmul_hardware("fp16")
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
    assert cpu_matmul_hardware("fp16")
    monkeypatch.delattr(torch.cpu, "_is_amx_fp16_supported")  # an older torch: no probe
    assert not cpu_matmul_hardware("fp16")


def test_users_onednn_cache_setting_wins(tmp_path: Path, corpus, monkeypatch):
    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.setenv(name, "7")
    raw = config(corpus, max_steps=1, eval_every=1, precision="bf16")
    train(from_dict(raw), tmp_path / "m", quiet=True)
    assert all(os.environ[name] == "7" for name in ONEDNN_CACHE_VARIABLES)


@pytest.mark.slow  # torch.compile builds C++ with g++: minutes on a busy 2-core machine
@pytest.mark.parametrize(
    ("arch", "device"),
    [("rnn", "cpu"), pytest.param("transformer", "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)  # fmt: skip
def test_compiled_step_matches_eager(tmp_path: Path, corpus, arch, device):
    # No dropout: the compiled graph draws its own masks, so only then are the runs comparable.
    raw = config(corpus, arch, max_steps=3, eval_every=3, device=device)
    raw["model"]["dropout"] = 0.0
    raw["train"]["teacher_forcing"] = {"schedule": "constant", "start": 1.0}
    train(from_dict(raw), tmp_path / "eager", quiet=True)
    raw["train"]["compile"] = True
    train(from_dict(raw), tmp_path / "compiled", quiet=True)
    losses = [
        next(e["dev_loss"] for e in events(tmp_path / d) if e["event"] == "validation")
        for d in ("eager", "compiled")
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4 if device == "cpu" else 1e-3)


def test_prefetched_batches_train_the_same_weights(tmp_path: Path, corpus):
    # The next step's batches made in a thread while this step runs (on by default on a GPU).
    raw = config(corpus, max_steps=6, eval_every=6, accumulate=2)
    for name, prefetch in (("plain", False), ("ahead", True)):
        raw["train"]["prefetch"] = prefetch
        train(from_dict(raw), tmp_path / name, quiet=True)
    weights = [load_model_dir(tmp_path / d, "last.safetensors")[2] for d in ("plain", "ahead")]
    assert torch.equal(weights_of(weights[0]), weights_of(weights[1]))


def test_cuda_graphs_are_refused_off_a_gpu_and_with_accumulation(tmp_path: Path, corpus):
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs: CUDA graphs need a CUDA device"):
        train(from_dict(config(corpus, cuda_graphs=True)), tmp_path / "m", quiet=True)
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs with train\.accumulate = 2"):
        from_dict(config(corpus, cuda_graphs=True, accumulate=2))


# --- the loop's parts, one at a time ---


@pytest.fixture
def run(tmp_path: Path, corpus):
    """A training run set up (data, tokenizer, model, optimizer) but not yet started."""
    cfg = from_dict(config(corpus, eval_every=1000))
    out = tmp_path / "m"
    checkpoints.prepare_output_dir(out, overwrite=False, resume=False)
    log = runlog.RunLog(out, quiet=True)
    yield setup_mod.setup(cfg, out, False, distributed.Ranks(), torch.device("cpu"), log)
    log.close()


def weights_of(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_setup_builds_a_fresh_run(run):
    assert run.progress.step == 0 and run.progress.epoch == 1
    assert run.step_model is run.model and run.model.training
    assert len(run.train_data.src) == 300 and len(run.dev_sets[0].encoded.src) == 20
    assert (run.out / "config.yaml").is_file() and (run.out / "spm.model").is_file()
    # The tokenizer and the encoding said as they happen, then the data and the model.
    assert [e["event"] for e in events(run.out)] == ["prepare"] * 4 + ["data", "model"]


def test_train_step_updates_and_reports(run):
    idx = run.sampler.epoch(1)[0]
    before = weights_of(run.model)
    result = step_mod.train_step(run, [idx], False)
    assert result.updated and result.step == 1 and not result.signalled
    assert result.tokens == sum(len(run.train_data.tgt[i]) + 1 for i in idx)
    assert 0 < result.real <= result.positions
    assert result.loss == pytest.approx(result.loss_sum / result.tokens, rel=1e-9)
    assert (result.lr, result.teacher_forcing) == schedules.step_schedules(1, run.cfg, 1.0)
    assert not torch.equal(before, weights_of(run.model))
    assert run.progress.step == 0, "the loop, not the step, counts steps"
    assert step_mod.train_step(run, [idx], True).signalled


def test_a_nonfinite_step_changes_nothing_and_is_counted(run, monkeypatch):
    idx = run.sampler.epoch(1)[0]
    before = weights_of(run.model)
    loss = run.model.loss
    monkeypatch.setattr(run, "step_model", lambda *a: (loss(*a)[0] * float("nan"), 0))
    result = step_mod.train_step(run, [idx], False)
    assert not result.updated and not result.loss_finite
    assert torch.equal(before, weights_of(run.model))
    for n in range(1, run.cfg.train.max_bad_steps):
        step_mod.skip_step(run, result)
        assert run.progress.bad_steps_in_a_row == n and run.progress.skipped_steps == n
    with pytest.raises(TrainingError, match="steps in a row had a non-finite loss"):
        step_mod.skip_step(run, result)
    assert [e["in_a_row"] for e in events(run.out) if e["event"] == "nonfinite"][-1] == 10


def set_up(raw: dict, out: Path) -> setup_mod.Run:
    checkpoints.prepare_output_dir(out, overwrite=False, resume=False)
    log = runlog.RunLog(out, quiet=True)
    return setup_mod.setup(
        from_dict(raw), out, False, distributed.Ranks(), torch.device("cpu"), log
    )


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_accumulated_batches_update_as_their_union(tmp_path: Path, corpus, arch):
    """In float64, without dropout: one step over two batches gives the gradients, loss and
    tokens of one step over the union of their pairs."""
    found = []
    for n, split in enumerate((True, False)):
        raw = config(corpus, arch, clip_grad_norm=0.0, accumulate=2 if split else 1)
        raw["model"].update(dropout=0.0, attention_dropout=0.0)
        raw["train"]["teacher_forcing"] = {"schedule": "constant", "start": 1.0, "end": 1.0}
        run = set_up(raw, tmp_path / str(n))
        run.model.double()
        idx = [int(i) for i in run.sampler.epoch(1)[0]]
        halves = [idx[: len(idx) // 2], idx[len(idx) // 2 :]]
        result = step_mod.train_step(run, halves if split else [idx], False)
        found.append((result, [p.grad.clone() for p in run.model.parameters()]))
        run.log.close()
    (acc, acc_grads), (union, union_grads) = found
    assert acc.tokens == union.tokens and acc.loss == pytest.approx(union.loss, rel=1e-12)
    for a, u in zip(acc_grads, union_grads, strict=True):
        torch.testing.assert_close(a, u, rtol=1e-10, atol=1e-12)


def test_accumulation_takes_n_batches_per_step_and_logs_the_update(tmp_path: Path, corpus):
    raw = config(corpus, max_steps=3, eval_every=3, accumulate=3)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    model = next(e for e in events(tmp_path / "m") if e["event"] == "model")
    assert model["batches_per_update"] == 3
    assert "an update: 3 batches" in (tmp_path / "m" / "train.log").read_text()
    run = set_up(config(corpus, eval_every=1000), tmp_path / "one")
    per_batch = len(run.sampler.epoch(1))
    run.log.close()
    steps = next(e for e in events(tmp_path / "m") if e["event"] == "done")["steps"]
    assert steps == min(3, per_batch // 3)


def test_schedules_of_a_step_share_its_number(run):
    cfg = run.cfg  # linear teacher forcing 0.9 -> 0.5 over 10 steps; warmup 2
    lr1, tf1 = schedules.step_schedules(1, cfg, 1.0)
    assert tf1 == pytest.approx(0.9) and lr1 == pytest.approx(cfg.train.lr / 2)
    assert schedules.step_schedules(11, cfg, 1.0)[1] == pytest.approx(0.5)


def test_validate_saves_weights_checkpoint_and_logs_the_trained_steps_ratio(run):
    run.progress.step = 4
    assert not validation.validate(run)
    assert (run.out / "best.safetensors").is_file() and (run.out / "last.safetensors").is_file()
    assert latest_checkpoint(run.out)[0].name == "step-00000004.safetensors"
    event, samples = events(run.out)[-2:]
    assert event["event"] == "validation" and event["step"] == 4
    assert event["teacher_forcing"] == pytest.approx(schedules.step_schedules(4, run.cfg, 1.0)[1])
    # JoeyNMT-style examples: the first dev sentences with reference and translation
    assert samples["event"] == "samples" and samples["step"] == 4
    assert [(e["src"], e["ref"]) for e in samples["examples"]] == list(
        zip(run.dev_sets[0].text.src[:3], run.dev_sets[0].text.tgt[:3], strict=True)
    )
    assert "  example 3 | src: " in (run.out / "train.log").read_text()
    run.progress.bad_validations = run.cfg.train.patience - 1
    run.progress.best_score = 1000.0
    assert validation.validate(run), "patience ran out: stop"


def test_interrupt_saves_last_weights_and_raises(run):
    run.progress.step = 3
    with pytest.raises(errors.TrainingInterrupted) as e:
        validation.interrupt(run, signal.SIGINT)
    assert (e.value.signum, e.value.step) == (signal.SIGINT, 3)
    assert (run.out / "last.safetensors").is_file()
    assert latest_checkpoint(run.out)[0].name == "step-00000003.safetensors"
    assert "SIGINT at step 3" in (run.out / "train.log").read_text()


def test_test_with_best_and_finish(run, corpus):
    run.cfg.data.test = run.cfg.data.dev
    validation.validate(run)
    validation.test_with(run, run.out / "best.safetensors", "best")
    test = events(run.out)[-1]
    assert test["event"] == "test" and test["pairs"] == 20 and "nrefs:1" in test["bleu_signature"]
    assert test["weights"] == "best"
    trained_s = run.elapsed() - 90  # as if the scoring above had taken a minute and a half
    summary = loop.finish(run, "max_steps", trained_s)
    assert summary["stop_reason"] == "max_steps" and events(run.out)[-1]["event"] == "done"
    assert summary["trained_s"] == round(trained_s, 1)
    assert summary["elapsed_s"] >= round(trained_s + 90, 1)  # both rounded to 0.1 s
    assert "min training + 1.5 min test scoring and averaging (after the time budget)" in (
        (run.out / "train.log").read_text()
    )


def test_model_files_take_the_umask_mode(tmp_path: Path, corpus):
    old = os.umask(0o022)
    try:
        train(from_dict(config(corpus, max_steps=2, eval_every=2)), tmp_path / "m", quiet=True)
    finally:
        os.umask(old)
    for name in ("best.safetensors", "config.yaml", "spm.model", "checkpoints/latest.json"):
        assert (tmp_path / "m" / name).stat().st_mode & 0o777 == 0o644, name


def test_average_last_averages_at_the_end_and_scores_the_test_set(tmp_path: Path, corpus):
    raw = config(corpus, max_steps=6, eval_every=2, keep_last=3, average_last=2)
    raw["data"]["test"] = raw["data"]["dev"]
    out = tmp_path / "m"
    train(from_dict(raw), out, quiet=True)
    log = events(out)
    assert next(e for e in log if e["event"] == "average")["steps"] == [4, 6]
    assert [e["weights"] for e in log if e["event"] == "test"] == ["best", "averaged"]
    assert (out / "averaged.safetensors").is_file()
    # Checkpoints from before the lr peak (the end of warmup) are left out, and the log says so.
    raw["train"].update(warmup_steps=5, average_last=3)
    train(from_dict(raw), out, quiet=True, overwrite=True)
    average = next(e for e in events(out) if e["event"] == "average")
    assert average["steps"] == [6] and average["skipped"] == "2, 4"
    assert "(left out 2, 4: before the lr peak or in the run's first half)" in (
        (out / "train.log").read_text()
    )
    with pytest.raises(ConfigError, match=r"average_last = 3 needs train\.keep_last >= 3"):
        from_dict(config(corpus, average_last=3, keep_last=2))


def test_without_a_terminal_progress_lines_reach_train_log(tmp_path: Path, corpus):
    """Under nohup or CI (stderr not a terminal, here pytest's capture) no progress bar shows:
    a line every train.log_every steps goes to train.log instead."""
    raw = config(corpus, max_steps=4, eval_every=4, log_every=2)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    text = (tmp_path / "m" / "train.log").read_text()
    for step in (2, 4):
        assert f"step {step} | epoch 1 | train loss " in text and " tokens/s | " in text


def test_a_budget_that_allows_too_few_steps_is_said_early(run):
    # 20 steps took half the budget: about 40 steps in all, far too few to translate.
    run.progress.step = 20
    step_mod.log_budget(run, 0.5, steps_per_epoch=100)
    run.progress.step = 20
    step_mod.log_budget(run, 0.01, steps_per_epoch=100)  # 2,000 steps, 20 epochs: enough
    run.progress.step = 20
    step_mod.log_budget(run, 20 / 616, steps_per_epoch=5000)  # 616 steps gave BLEU 23: enough
    found = [e for e in events(run.out) if e["event"] == "budget"]
    assert [(e["steps"], e["epochs"], e["few"]) for e in found] == [
        (40, 0.4, True),
        (2000, 20.0, False),
        (616, 0.123, False),
    ]
    lines = (run.out / "train.log").read_text()
    assert "about 40 steps (0.40 epochs)" in lines and "cannot translate yet" in lines
    assert "configs/own_data_small.yaml" in lines  # the warning names what to change


def test_the_model_line_says_when_bf16_would_be_faster(tmp_path: Path, corpus, monkeypatch):
    monkeypatch.setattr(
        "attnmt.training.setup.resolve_precision", lambda p, d: "bf16" if p == "auto" else p
    )
    train(from_dict(config(corpus, max_steps=1, eval_every=1)), tmp_path / "m", quiet=True)
    assert "bf16 is native on this CPU" in (tmp_path / "m" / "train.log").read_text()
    chosen = config(corpus, max_steps=1, eval_every=1)
    chosen["train"]["precision"] = "fp32"  # a config that chose fp32 is not told otherwise
    train(from_dict(chosen), tmp_path / "m2", quiet=True)
    assert "bf16 is native" not in (tmp_path / "m2" / "train.log").read_text()


def test_the_train_line_is_the_mean_loss_since_the_last_line(tmp_path: Path, corpus, monkeypatch):
    train(from_dict(config(corpus, max_steps=6, eval_every=100, log_every=3)), tmp_path / "m",
          quiet=True)  # fmt: skip
    found = [e for e in events(tmp_path / "m") if e["event"] == "train"]
    assert [e["step"] for e in found] == [1, 3, 6]
    # A window's mean is its steps' token losses, weighted by their tokens.
    steps = {e["step"]: e for e in found}
    assert steps[1]["mean_loss"] == round(steps[1]["loss"], 5)
    lines = (tmp_path / "m" / "train.log").read_text()
    assert "train loss" in lines and "(mean of 3 steps)" in lines


def test_without_a_terminal_a_line_comes_at_least_every_so_often(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr("attnmt.training.loop.QUIET_S", 0.0)  # every step is "a while"
    train(from_dict(config(corpus, max_steps=4, eval_every=100, log_every=100)), tmp_path / "m",
          quiet=True)  # fmt: skip
    assert [e["step"] for e in events(tmp_path / "m") if e["event"] == "train"] == [1, 2, 3, 4]


def test_a_time_budget_holds_with_its_last_validation(tmp_path: Path, corpus):
    # No validation is due (eval_every is huge): one at half the budget measures what the last
    # costs, and the run stops so that setup, steps and that last validation fit the budget.
    raw = config(corpus, max_steps=1_000_000, eval_every=1_000_000, time_budget="6s")
    summary = train(from_dict(raw), tmp_path / "m", quiet=True)
    validations = [e for e in events(tmp_path / "m") if e["event"] == "validation"]
    assert len(validations) == 2 and validations[0]["step"] < validations[1]["step"]
    done = next(e for e in events(tmp_path / "m") if e["event"] == "done")
    assert done["trained_s"] <= 6.0 * 1.25, done  # a step or two over at most
    assert summary["stop_reason"] == "time_budget"


def test_a_run_resumed_where_patience_ran_out_stops_at_once(tmp_path: Path, corpus):
    """kill -9 after the checkpoint of the validation that ran out of patience, before the
    process ended: --resume used to train on (one more step and validation) where the
    uninterrupted run had stopped."""
    raw = config(corpus, max_steps=1000, eval_every=2, patience=1, early_stopping="loss")
    raw["train"]["lr"] = 0.3  # diverges: the second validation is worse
    summary = train(from_dict(raw), tmp_path / "m", quiet=True)
    assert summary["stop_reason"] == "early_stopping", summary
    last = (tmp_path / "m" / "last.safetensors").read_bytes()
    again = train(from_dict(raw), tmp_path / "m", resume=True, quiet=True)
    assert (again["steps"], again["stop_reason"]) == (summary["steps"], "early_stopping")
    assert (tmp_path / "m" / "last.safetensors").read_bytes() == last
