"""`attnmt serve --workers N`: forked search processes, each with its own step-level pool."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from attnmt import Translator
from attnmt.serve.schema import Limits
from attnmt.serve.workers import WORKER_DIED, ForkedScheduler

from conftest import make_pairs
from helpers import free_port, wait_healthy

LINES = make_pairs(24, 5)[0]


def children(pid: int) -> list[int]:
    """The processes whose parent is pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_forked_workers_answer_mixed_clients_with_the_batch_paths_lines(trained):
    """16 concurrent clients, 6 kinds of request, each request in one of 2 worker processes:
    each gets what the batch path gives it."""
    model, _ = trained
    translator = Translator.load(model, device="cpu")
    words = [line.split()[0] for line in LINES]
    kinds = [
        {"beam": 1},
        {"beam": 2},
        {"beam": 3, "n_best": 2},
        {"beam": 2, "prefix": True},
        {"beam": 2, "constraints": True},
        {"sampling": {"temperature": 1.0, "top_k": 5, "seed": 3}},
    ]

    def fields(i: int) -> dict:
        out = dict(kinds[i % len(kinds)])
        if out.pop("prefix", False):
            out["prefix"] = [words[i]]
        if out.pop("constraints", False):
            out["constraints"] = [[words[(i + 1) % len(words)]]]
        return out

    def expected(i: int) -> list[str]:
        args = fields(i)
        if "sampling" in args:
            args["sampling"] = tuple(args["sampling"].values())  # temperature, top_k, seed
        return [h.text for h in translator.hypotheses([LINES[i]], **args)[0]]

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "serve", "-m", str(model), "--port", str(port),
         "--device", "cpu", "--workers", "2", "--threads", "2", "--no-access-log"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        assert len(children(proc.pid)) == 2

        def client(i: int) -> list[str]:
            r = httpx.post(f"{url}/translate", json={"text": [LINES[i]], **fields(i)}, timeout=60)
            assert r.status_code == 200, r.text
            answer = r.json()
            return [h["text"] for h in answer["n_best"][0]] if "n_best" in answer else (
                answer["translations"])  # fmt: skip

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(client, range(16)))
        health = httpx.get(f"{url}/health").json()
        assert health["steps"] >= 1 and health["searching"] == 0 and health["queued"] == 0
        workers = children(proc.pid)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 143  # SIGTERM, as every command; the workers die with it
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{w}/stat").exists() for w in workers)
    for i, g in enumerate(got):
        want = expected(i)
        assert g == want[: len(g)] and len(g) == (2 if "n_best" in kinds[i % 6] else 1), i


def _prepared(translator: Translator, lines: list[str], beam: int = 2):
    return translator.prepare(lines, translator.options(beam))


def test_a_failure_a_cancelled_request_and_a_dead_worker(trained, monkeypatch):
    """A request that fails in a worker fails alone, with its error's text; a request whose
    client left stops counting at once; a worker that dies fails the requests it held, the
    other serves on, and with none left run() returns."""
    from attnmt.decoding.request import Prepared

    finish = Prepared.finish

    def failing(self: Prepared, found: list) -> list:
        if any("boom" in line for line in self.lines):
            raise ValueError("boom")
        return finish(self, found)

    monkeypatch.setattr(Prepared, "finish", failing)  # before the fork: the workers' too
    translator = Translator.load(trained[0], device="cpu")
    search = ForkedScheduler(translator, Limits(), 2)
    stop = threading.Event()
    runner = threading.Thread(target=search.run, kwargs={"alive": lambda: not stop.is_set()})
    runner.start()
    try:
        first = search.submit(_prepared(translator, LINES[:2]))
        failed = search.submit(_prepared(translator, ["boom " + LINES[0]]))
        found = first.future.result(timeout=60)
        assert [r[0].text for r in found] == translator.translate(LINES[:2], beam=2)
        with pytest.raises(RuntimeError, match="ValueError: boom"):
            failed.future.result(timeout=60)
        job = search.submit(_prepared(translator, LINES * 4, beam=3))
        job.cancelled = True
        assert search.held == {} and search.lines == [0, 0]
        os.kill(search.processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while search.alive[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert search.alive == [False, True]
        again = search.submit(_prepared(translator, LINES[:3]))
        assert again.worker == 1 and len(again.future.result(timeout=60)) == 3
        held = search.submit(_prepared(translator, LINES * 4, beam=3))
        os.kill(search.processes[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=WORKER_DIED.split(" (")[0]):
            held.future.result(timeout=30)
        runner.join(timeout=30)
        assert not runner.is_alive()  # no worker left: run() returns, the server ends
        with pytest.raises(queue.Full):  # and meanwhile refuses (503)
            search.submit(_prepared(translator, LINES[:1]))
    finally:
        stop.set()
        runner.join(timeout=30)
        for p in search.processes:
            p.kill()
            p.join()
