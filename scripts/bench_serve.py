"""`scripts/bench.py serve`: `attnmt serve` under concurrent clients on loopback, against the
same sentences translated as one batch job (what `attnmt translate` does with a file).

Starts `attnmt serve` on a free loopback port (its own process, --threads 2 by default), then,
for each number of clients and request size, lets that many client threads send Multi30k
test_2016_flickr sentences (from --data) in requests of that many sentences until all are
translated. Prints one JSON line per (clients, size): sentences/s, p50/p99 request latency
(ms), the server's decoding steps, and batch_sentences_per_s (the same sentences through
Translator.translate in this process, model loading excluded) and their ratio, with single-
sentence requests also chunked_sentences_per_s (the same in chunks of as many lines as there
are clients, in their order: the most that many clients can have in flight) and
search_alone_sentences_per_s (the server's scheduler in this process without HTTP, as many
one-line requests kept in flight as there are clients), and the idle
latency (idle_ms: the median of 50 single-sentence requests one after another) with p50 and
p99 over it.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: Path, port: int, wait_ms: float, threads: int, workers: int = 1, precision: str = "",
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "serve", "-m", str(model), "--port", str(port),
         "--device", "cpu", "--max-queue", "4096", "--batch-wait-ms", str(wait_ms),
         "--workers", str(workers), *(["--precision", precision] if precision else []), *extra],
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("bench serve: the server did not start")


def load(url: str, path: str, body: Any, sentences: list[str], clients: int, size: int) -> dict:
    """POST all sentences to `path`, `size` a request (`body(chunk)`: its JSON), from
    `clients` connections; time it."""
    chunks = [sentences[i : i + size] for i in range(0, len(sentences), size)]
    bodies = [json.dumps(body(c)).encode() for c in chunks]
    before = steps(url)
    start = time.perf_counter()
    latencies = asyncio.run(send_all(url, path, bodies, clients))
    seconds = time.perf_counter() - start
    latencies.sort()
    return {
        "clients": clients,
        "sentences_per_request": size,
        "sentences_per_s": round(len(sentences) / seconds, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
        "server_steps": steps(url) - before,
    }


async def send_all(url: str, path: str, bodies: list[bytes], clients: int) -> list[float]:
    """POST each body (JSON) from `clients` kept-alive connections, each sending its next
    request when its answer has come; the latencies (s). The client is plain asyncio over
    sockets: a Python HTTP library's threads would take the CPU the server is measured on
    (64 httpx threads took about 0.4 of this machine's 2 cores)."""
    host, port = url.split("//")[1].split(":")
    todo: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        todo.put_nowait(body)
    latencies: list[float] = []

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        while not todo.empty():
            body = todo.get_nowait()
            start = time.perf_counter()
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            answer = await reader.readexactly(length)
            if b" 200 " not in status:
                raise SystemExit(f"bench serve: {status.decode().strip()}: {answer[:200]!r}")
            latencies.append(time.perf_counter() - start)
        writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def steps(url: str) -> int:
    """The server's decoding steps so far (its batches, before step-level batching; 0: a
    peer's server, which does not say)."""
    health = httpx.get(f"{url}/health").json()
    return health.get("steps", health.get("batches", 0)) if isinstance(health, dict) else 0


def idle_ms(url: str, path: str, body: Any, sentences: list[str]) -> float:
    """The median latency of single-sentence requests sent one after another."""
    bodies = [json.dumps(body([line])).encode() for line in sentences[:50]]
    return 1000 * statistics.median(asyncio.run(send_all(url, path, bodies, 1)))


def wait_up(url: str, proc: subprocess.Popen) -> None:
    """Wait for a server's health URL (10 minutes at most)."""
    for _ in range(6000):
        if proc.poll() is not None:
            raise SystemExit(f"bench serve: the server exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("bench serve: the server did not start")


def cli_rate(
    model: Path,
    sentences: list[str],
    beam: int,
    threads: int,
    chunks: list[int],
    precision: str,
    compile: bool = False,
) -> tuple[float, dict[int, tuple[float, float]]]:
    """Sentences/s of the batch path (Translator.translate over all sentences: batches of up
    to decode.batch_tokens, sorted by length), load excluded; and for each n of `chunks`, (the
    same in chunks of n lines in their order: what n one-line clients can offer at most, n
    lines in flight arriving in no order; the server's search alone, without HTTP, n lines
    kept in flight: search_alone); compiled (models.compiled_step) with `compile`."""
    import torch

    from attnmt import Translator

    torch.set_num_threads(threads)
    translator = Translator.load(model, device="cpu", precision=precision or None, compile=compile)
    translator.translate(sentences[:64], beam=beam)  # warm up
    start = time.perf_counter()
    translator.translate(sentences, beam=beam)
    whole = len(sentences) / (time.perf_counter() - start)
    chunked = {}
    for n in chunks:
        start = time.perf_counter()
        for i in range(0, len(sentences), n):
            translator.translate(sentences[i : i + n], beam=beam)
        chunked[n] = (
            len(sentences) / (time.perf_counter() - start),
            search_alone(translator, sentences, beam, n),
        )
    return whole, chunked


def search_alone(translator: Any, sentences: list[str], beam: int, in_flight: int) -> float:
    """Sentences/s of the server's scheduler in this process's main thread, as `attnmt
    serve` runs it, fed one-line requests by a thread that keeps `in_flight` of them waiting
    or searching: the server without its HTTP side."""
    import threading

    from attnmt.serve.scheduler import Scheduler
    from attnmt.serve.schema import Limits

    scheduler = Scheduler(translator, Limits(max_queue=4096), thread=False)
    options = translator.options(beam)
    slots, done = threading.Semaphore(in_flight), threading.Event()
    left, lock = [len(sentences)], threading.Lock()

    def answered(_: Any) -> None:
        # In the search thread, or in the feeder's when a line was done before its callback
        # was added: counted under a lock.
        slots.release()
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    def feed() -> None:
        for line in sentences:
            slots.acquire()
            scheduler.submit(translator.prepare([line], options)).future.add_done_callback(answered)

    threading.Thread(target=feed, daemon=True).start()
    start = time.perf_counter()
    scheduler.run(alive=lambda: not done.is_set())
    return len(sentences) / (time.perf_counter() - start)


def bench_serve(args: argparse.Namespace) -> None:
    with gzip.open(args.data / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        sentences = [line.strip() for line in f]
    if getattr(args, "eole", None) is not None:
        return bench_eole(args, sentences)
    chunks = [c for c in args.clients if c > 1]
    cli = cli_rate(
        args.model, sentences, args.beam, args.threads, chunks, args.precision, args.compile
    )
    # With --tm or --compile: the server without, then with it (serve --tm, serve --compile),
    # in the same run.
    extras: list[tuple[str, ...]] = [("--no-compile",)]
    extras += [("--no-compile", "--tm", str(args.tm))] if args.tm is not None else []
    extras += [("--compile",)] if args.compile else []
    for extra in extras:
        port = free_port()
        proc = start_server(
            args.model, port, args.batch_wait_ms, args.threads, args.workers, args.precision,
            extra,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            body = lambda chunk: {"text": chunk, "beam": args.beam}  # noqa: E731
            rows(url, "/translate", body, sentences, args, cli, extra)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def rows(
    url: str,
    path: str,
    body: Any,
    sentences: list[str],
    args: argparse.Namespace,
    batch: tuple[float, dict[int, tuple[float, float]]],
    extra: tuple[str, ...] = (),
) -> None:
    """Warm up, measure the idle latency, then one JSON line per (clients, size), against the
    batch path (`batch`: cli_rate's, or a peer's rate and no chunked rates)."""
    batch, chunked = batch
    load(url, path, body, sentences[:64], 4, 1)  # warm up
    idle = idle_ms(url, path, body, sentences)
    for clients in args.clients:
        for size in args.sizes:
            row = load(url, path, body, sentences, clients, size)
            row |= {
                "beam": args.beam,
                "tm": "--tm" in extra,
                "compiled": "--compile" in extra,
                "batch_wait_ms": args.batch_wait_ms,
                "workers": getattr(args, "workers", 1),
                "batch_sentences_per_s": round(batch, 1),
                "ratio": round(row["sentences_per_s"] / batch, 2),
                "idle_ms": round(idle, 1),
                **(
                    {
                        "chunked_sentences_per_s": round(chunked[clients][0], 1),
                        "ratio_to_chunked": round(row["sentences_per_s"] / chunked[clients][0], 2),
                        "search_alone_sentences_per_s": round(chunked[clients][1], 1),
                    }
                    if clients in chunked and size == 1
                    else {}
                ),
                "p50_over_idle": round(row["p50_ms"] / idle, 2),
                "p99_over_idle": round(row["p99_ms"] / idle, 2),
            }
            print(json.dumps(row), flush=True)


def bench_eole(args: argparse.Namespace, sentences: list[str]) -> None:
    """`eole serve` (--eole: a checkpoint directory, run with --eole-python) under the same
    clients. Its model reads SentencePiece pieces (the peers harness's data), so the pieces
    are sent; its requests are gathered for its batch_timeout (0.1 s) and searched together
    (batch_size 64 at most). Its batch path: --eole-batch-rate (the harness's decode)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(args.eole_spm))
    pieces = [" ".join(sp.encode(s, out_type=str)) for s in sentences]
    work = Path(tempfile.mkdtemp(prefix="eole-serve-"))
    config = work / "server.yaml"
    config.write_text(json.dumps({
        "models_root": str(work),
        "models": [{"id": "peer", "path": str(args.eole.resolve()), "preload": True,
                    "config": {"batch_size": 64, "beam_size": args.beam, "max_length": 60}}],
    }))  # fmt: skip
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [str(args.eole_python), "-m", "eole.bin.main", "serve", "-c", str(config), "--host",
         "127.0.0.1", "--port", str(port)], env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(f"{url}/health", proc)
        body = lambda chunk: {"model": "peer", "inputs": chunk, "beam_size": args.beam}  # noqa: E731
        rows(url, "/infer", body, pieces, args, (args.eole_batch_rate, {}))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
