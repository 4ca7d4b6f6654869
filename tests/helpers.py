"""Helpers shared by the tests: tiny models and a random batch; attnmt run as a process (a
trainer, a command) or as a server on a loopback port, and waiting for them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

from attnmt.config import ModelConfig, from_dict
from attnmt.data.batches import Batch, collate
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from attnmt.models.build import build_model
from attnmt.models.seq2seq import Seq2Seq
from attnmt.training.loop import train

from conftest import default_sigint, tiny_config, write_config

if TYPE_CHECKING:
    from attnmt.decoding.translator import Translator
    from attnmt.serve.schema import Limits

V = 23


def tiny_model(arch: str, seed: int = 0, **overrides) -> Seq2Seq:
    torch.manual_seed(seed)
    settings = {
        "emb_size": 12,
        "hidden_size": 16,
        "heads": 2,
        "ff_size": 24,
        "enc_layers": 2,
        "dec_layers": 2,
        "dropout": 0.0,
        "attention_dropout": 0.0,
    }
    cfg = ModelConfig(arch=arch, **{**settings, **overrides})
    return build_model(cfg, V, V, joint=True)


def train_tiny(base: Path, corpus, joint: bool = True, **model) -> Path:
    """A model trained 2 steps on the tiny corpus into base/m (model: model.* settings)."""
    raw = tiny_config(corpus, model.pop("arch", "transformer"))
    raw["train"].update(max_steps=2, eval_every=2)
    raw["model"].update(model)
    raw["tokenizer"]["joint"] = joint
    train(from_dict(raw), base / "m", quiet=True)
    return base / "m"


def random_batch(seed: int = 0, B: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    src, tgt = [], []
    for _ in range(B):
        n = int(torch.randint(1, 7, (1,), generator=g))
        m = int(torch.randint(1, 7, (1,), generator=g))
        src.append(torch.randint(4, V, (n,), generator=g).tolist())
        tgt.append(torch.randint(4, V, (m,), generator=g).tolist())
    return collate(src, tgt, list(range(B)), PAD_ID, BOS_ID, EOS_ID)


def keep_and_join(model, memory, state, prev: torch.Tensor, keep: torch.Tensor, batch: Batch):
    """A running search's step between steps: rows `keep` stay (the others leave) and the
    batch's sentences join at their own first position (BOS); -> memory, state, prev."""
    memory, state = model.keep_rows(memory, state, keep)
    joining = model.encode(batch.src, batch.src_pad_mask)
    memory = model.join_memory(memory, joining)
    state = model.join_state(state, model.init_state(joining))
    return memory, state, torch.cat([prev[keep], torch.full((batch.src.size(0),), BOS_ID)])


def stepwise_logits(model: Seq2Seq, batch: Batch, inputs: torch.Tensor) -> torch.Tensor:
    """Logits from feeding `inputs` (B, T) one position at a time through decode_step."""
    memory = model.encode(batch.src, batch.src_pad_mask)
    state = model.init_state(memory)
    out = []
    for t in range(inputs.size(1)):
        logits, state, _ = model.decode_step(memory, state, inputs[:, t])
        out.append(logits)
    return torch.stack(out, dim=1)  # (B, T, V)


# --- running attnmt: as a process, as a server ---


def trained_steps(out: Path) -> int:
    try:
        lines = (out / "train_log.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if '"event": "train"' in x]
    return max(steps, default=0)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


@contextlib.contextmanager
def busy_elsewhere(n: int, code: str = "while True: pass") -> Iterator[None]:
    """n processes that run `code` (by default: spin, each holding a CPU) for the block, and
    that are not this process's children: another program's load (CpuShare counts a process's
    own children as its own work)."""
    start = f"import subprocess, sys\nfor _ in range({n}):\n"
    start += f"    print(subprocess.Popen([sys.executable, '-c', {code!r}],"
    start += " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"  # no pipes held
    pids = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True).stdout
    try:
        yield
    finally:
        for pid in map(int, pids.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def serve(model: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`attnmt serve` of `model` as a process on a free loopback port (CPU, no access log),
    once healthy: the process (stderr piped) and its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "serve", "-m", str(model), "--port", str(port),
         "--device", "cpu", "--no-access-log", *extra],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def start_training(cfg: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "attnmt", "train", "-c", str(cfg), "--out", str(out), "-q", *extra],
        preexec_fn=default_sigint,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_user_error(result, *fragments: str) -> None:
    assert result.code == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert lines[0].startswith("attnmt: error: ")
    for f in fragments:
        assert f in lines[0]


def start_server(
    translator: Translator, limits: Limits, name: str = "", access_log: bool = True
) -> Iterator[str]:
    """create_app on a uvicorn server in a thread on a loopback port; yields its URL."""
    import uvicorn

    from attnmt.serve.app import create_app

    app = create_app(translator, limits, name, access_log)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    wait_healthy(url)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("server did not come up")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_lines(run_cli, model: Path, lines: list[str], *args: str) -> list[str]:
    r = run_cli(
        "translate", "-m", str(model), *args, stdin="".join(f"{x}\n" for x in lines).encode()
    )
    assert r.code == 0, r
    return r.stdout.splitlines()


@contextlib.contextmanager
def running_trainer(tmp_path: Path, corpus):
    """A trainer in a subprocess that has taken 2 steps: yields (config, out, process); killed
    on leaving."""
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=100000, eval_every=100000, log_every=1)
    cfg = write_config(tmp_path / "c.yaml", raw)
    out = tmp_path / "m"
    proc = start_training(cfg, out)
    try:
        wait_for(lambda: trained_steps(out) >= 2, proc)
        yield cfg, out, proc
    finally:
        proc.kill()
        proc.communicate()


def one_error_line(r: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("attnmt: error: ")
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def attnmt(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnmt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )
