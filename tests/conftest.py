"""Shared fixtures: a tiny synthetic parallel corpus, a tiny config, an in-process CLI runner,
a headless Chromium for the pages' tests."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from attnmt.cli.main import main
from attnmt.data.search_workers import release as release_search_workers

# Decoding compiles its step by default (models.compiled_step), 5-30 s a model: the suite's
# hundreds of tiny models decode as before, but where a test asks for it (its own processes
# inherit this too).
os.environ["ATTNMT_COMPILE"] = "0"

# A toy "language pair": each source word maps to one target word, order reversed.
LEXICON = {f"w{i}": f"t{i}" for i in range(12)}


@pytest.fixture(autouse=True)
def fresh_search_workers():
    """Each test forks its own search workers: kept ones (attnmt.data.search_workers) would
    carry an earlier test's monkeypatched functions, which a fork copies."""
    yield
    release_search_workers()


def default_sigint() -> None:
    """For a child process the tests signal (Popen's preexec_fn): SIGINT's default disposition.
    A suite started in the background (`nohup pytest &`) runs with SIGINT ignored, which
    children inherit, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def make_pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(list(LEXICON)) for _ in range(rng.randint(1, 6))]
        src.append(" ".join(words))
        tgt.append(" ".join(LEXICON[w] for w in reversed(words)))
    return src, tgt


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, Path]:
    """train (300 pairs) and dev (20 pairs) files of the toy language pair."""
    out = {}
    for split, n, seed in (("train", 300, 1), ("dev", 20, 2)):
        src, tgt = make_pairs(n, seed)
        out[f"{split}_src"] = write_lines(tmp_path / f"{split}.src", src)
        out[f"{split}_tgt"] = write_lines(tmp_path / f"{split}.tgt", tgt)
    return out


def tiny_config(corpus: dict[str, Path], arch: str = "transformer") -> dict[str, Any]:
    return {
        "data": {
            "train": {"src": str(corpus["train_src"]), "tgt": str(corpus["train_tgt"])},
            "dev": {"src": str(corpus["dev_src"]), "tgt": str(corpus["dev_tgt"])},
            "max_len": 20,
        },
        "tokenizer": {"vocab_size": 40},
        "model": {
            "arch": arch,
            "emb_size": 16,
            "hidden_size": 16,
            "heads": 2,
            "ff_size": 32,
            "enc_layers": 1,
            "dec_layers": 1,
        },
        "train": {
            "max_steps": 8,
            "batch_tokens": 200,
            "lr": 0.003,
            "warmup_steps": 2,
            "eval_every": 4,
            "seed": 1,
            "device": "cpu",
            "log_every": 2,
            # The tests' tiny models were chosen by BLEU when they were written (the default is
            # now auto: chrF below BLEU 5); tests/test_workflow.py tests auto itself.
            "early_stopping": "bleu",
        },
    }


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny trained transformer's model directory (6 steps) and the corpus files it was
    trained on; shared by the tests that only read it."""
    from attnmt.config import from_dict
    from attnmt.training.loop import train

    base = tmp_path_factory.mktemp("trained")
    corpus = {}
    for split, n, seed in (("train", 300, 1), ("dev", 20, 2)):
        src, tgt = make_pairs(n, seed)
        corpus[f"{split}_src"] = write_lines(base / f"{split}.src", src)
        corpus[f"{split}_tgt"] = write_lines(base / f"{split}.tgt", tgt)
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=6, eval_every=3)
    train(from_dict(raw), base / "m", quiet=True)
    return base / "m", corpus


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run `attnmt ARGS...` in-process through the real entry point."""

    def run(*args: str, stdin: bytes | None = None) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["attnmt", *args])
        if stdin is not None:
            import io

            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder of compiled steps (models.compiled_step) for the suite: a tiny model
    the tests build alike (the same seed, the same weights) compiles once, not once a test."""
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by selenium, headless (skipped, with the reason, without it)."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no Chromium here: apt-get install chromium chromium-driver (as .ci/run does)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1000,900"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    yield driver
    driver.quit()
