"""The CUDA path: training in each precision, fp16 overflow, resume, `device: auto`,
translation equal to the CPU's (compiled training on CUDA: tests/test_train.py). Skipped without
a CUDA GPU (CI has none); docs/gpu.md says where and with which torch they last ran."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# cuBLAS picks deterministic kernels only with a fixed workspace, read when its handle is
# made: set before any test touches the GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from attnmt.config import from_dict
from attnmt.decoding.translator import Translator
from attnmt.device import resolve_device
from attnmt.models.directory import load_model_dir
from attnmt.training.loop import train

from conftest import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def config(corpus, arch: str = "transformer", **train_overrides) -> dict:
    raw = tiny_config(corpus, arch)
    raw["model"]["dropout"] = 0.1
    raw["train"].update({"device": "cuda", **train_overrides})
    return raw


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def finite_weights(out: Path) -> bool:
    _, _, model = load_model_dir(out, "last.safetensors")
    return all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_cuda_gives_finite_losses(tmp_path: Path, corpus, arch, precision):
    out = tmp_path / "m"
    summary = train(from_dict(config(corpus, arch, precision=precision)), out, quiet=True)
    log = events(out)
    model = next(e for e in log if e["event"] == "model")
    assert model["device"].startswith("cuda") and model["precision"] == precision
    losses = [e["loss"] for e in log if e["event"] == "train"]
    assert summary["steps"] == 8 and losses and bool(torch.isfinite(torch.tensor(losses)).all())
    assert finite_weights(out)


def test_fp16_overflow_steps_are_skipped_and_logged(tmp_path: Path, corpus, monkeypatch):
    scaler = torch.amp.GradScaler

    def huge_scale(*args, **kwargs):
        # 2^40 times the loss overflows fp16's gradients (max 65,504) at once: the scaler
        # skips those updates and halves its scale until they fit.
        return scaler(*args, init_scale=2.0**40, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", huge_scale)
    out = tmp_path / "m"
    summary = train(from_dict(config(corpus, precision="fp16")), out, quiet=True)
    overflows = [e for e in events(out) if e["event"] == "fp16_overflow"]
    assert overflows and summary["skipped_nonfinite_steps"] == len(overflows)
    assert overflows[-1]["scale"] < overflows[0]["scale"] <= 2.0**40
    assert summary["steps"] == 8 and finite_weights(out)


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_resume_on_cuda_is_byte_identical(tmp_path: Path, corpus, arch, deterministic):
    raw = config(corpus, arch, max_steps=12, eval_every=4, keep_last=2)
    train(from_dict(raw), tmp_path / "full", quiet=True)
    part = config(corpus, arch, max_steps=4, eval_every=4, keep_last=2)
    train(from_dict(part), tmp_path / "part", quiet=True)
    summary = train(from_dict(raw), tmp_path / "part", resume=True, quiet=True)
    assert summary["steps"] == 12
    for name in ("last.safetensors", "best.safetensors"):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "part" / name).read_bytes()


def test_auto_device_is_cuda(tmp_path: Path, corpus):
    assert resolve_device("auto").type == "cuda"
    out = tmp_path / "m"
    train(from_dict(config(corpus, device="auto", max_steps=2, eval_every=2)), out, quiet=True)
    model = next(e for e in events(out) if e["event"] == "model")
    assert model["device"].startswith("cuda") and model["precision"] == "fp32"


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_translation_on_cuda_equals_cpu(tmp_path: Path, corpus, arch):
    # Trained long enough to translate the toy language, so that lines are not near-ties.
    raw = config(corpus, arch, max_steps=300, eval_every=300, lr=0.01, warmup_steps=20)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    lines = corpus["train_src"].read_text().splitlines()
    for beam in (1, 5):
        on_cpu = Translator.load(tmp_path / "m", device="cpu").translate(lines, beam=beam)
        on_gpu = Translator.load(tmp_path / "m", device="cuda").translate(lines, beam=beam)
        same = sum(a == b for a, b in zip(on_cpu, on_gpu, strict=True))
        assert same >= 0.99 * len(lines), f"beam {beam}: {same} of {len(lines)} lines equal"


def test_an_ssru_decoder_with_a_shortlist_translates_on_cuda_as_on_cpu(tmp_path: Path, corpus):
    from attnmt.data.tokenizer import Tokenizer
    from attnmt.decoding.shortlist import SHORTLIST_FILE, shortlist_from_text

    raw = config(corpus, max_steps=300, eval_every=300, lr=0.01, warmup_steps=20)
    raw["model"]["decoder"] = "ssru"
    cfg = from_dict(raw)
    train(cfg, tmp_path / "m", quiet=True)
    assert finite_weights(tmp_path / "m")
    src = corpus["train_src"].read_text().splitlines()
    tgt = corpus["train_tgt"].read_text().splitlines()
    tokenizer = Tokenizer.load(tmp_path / "m", cfg.tokenizer.joint)
    shortlist_from_text(tokenizer, src, tgt, 3, 2).save(tmp_path / "m" / SHORTLIST_FILE)
    for beam in (1, 5):
        on_cpu = Translator.load(tmp_path / "m", "cpu", shortlist=True).translate(src, beam=beam)
        on_gpu = Translator.load(tmp_path / "m", "cuda", shortlist=True).translate(src, beam=beam)
        same = sum(a == b for a, b in zip(on_cpu, on_gpu, strict=True))
        assert same >= 0.99 * len(src), f"beam {beam}: {same} of {len(src)} lines equal"


def test_cuda_graphs_train_as_the_compiled_step_does(tmp_path: Path, corpus):
    # No dropout: the padded batches of CUDA graphs draw other masks. The dev loss after the
    # same steps agrees with the compiled step's. (With accumulate 2 the second replay
    # overwrote the first batch's gradient: the config refuses that.)
    raw = config(corpus, max_steps=6, eval_every=6, compile=True)
    raw["model"]["dropout"] = 0.0
    raw["train"]["teacher_forcing"] = {"schedule": "constant", "start": 1.0}
    train(from_dict(raw), tmp_path / "compiled", quiet=True)
    raw["train"]["cuda_graphs"] = True
    train(from_dict(raw), tmp_path / "graphs", quiet=True)
    losses = [
        [e["dev_loss"] for e in events(tmp_path / d) if e["event"] == "validation"][-1]
        for d in ("compiled", "graphs")
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    assert finite_weights(tmp_path / "graphs")
