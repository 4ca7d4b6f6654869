"""`attnmt serve`: translation over HTTP (FastAPI + uvicorn), concurrent requests batched.

Requests wait in one queue; a single search thread takes the first waiting request, then
whatever else arrives within `batch_wait_ms` (up to `batch_lines` lines, only requests with the
same beam), searches all their lines as one call of the Translator (which batches them by
length) and answers each request with its own lines. Limits give JSON errors, never a crash:
too many lines or characters 413, a malformed request 422, a full queue 503.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from attnmt.api import Translator


@dataclass(frozen=True)
class Limits:
    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line
    max_queue: int = 256  # requests waiting
    batch_wait_ms: float = 5.0  # how long the first request of a batch waits for others
    batch_lines: int = 256  # lines searched at most in one batch


class TranslateRequest(BaseModel):
    text: list[str] = Field(description="Sentences to translate, one per item.")
    beam: int | None = Field(None, ge=1, le=100, description="Beam size (default: the model's).")


class TranslateResponse(BaseModel):
    translations: list[str]


@dataclass
class _Job:
    lines: list[str]
    beam: int
    future: Future = field(default_factory=Future)


class Batcher:
    """The queue and the search thread that empties it in batches."""

    def __init__(self, translator: Translator, limits: Limits) -> None:
        self.translator, self.limits = translator, limits
        self.jobs: queue.Queue[_Job] = queue.Queue(maxsize=limits.max_queue)
        self.batches = 0  # searches run (for /health: batching at work)
        threading.Thread(target=self._run, name="attnmt-search", daemon=True).start()

    def submit(self, lines: list[str], beam: int) -> Future:
        """Queue a job (queue.Full when the queue is full)."""
        job = _Job(lines, beam)
        self.jobs.put_nowait(job)
        return job.future

    def _run(self) -> None:
        held: _Job | None = None  # a job taken that did not fit the last batch
        while True:
            first = held or self.jobs.get()
            batch, held = [first], None
            deadline = time.monotonic() + self.limits.batch_wait_ms / 1000
            n_lines = len(first.lines)
            while n_lines < self.limits.batch_lines:
                try:
                    job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job.beam != first.beam or n_lines + len(job.lines) > self.limits.batch_lines:
                    held = job
                    break
                batch.append(job)
                n_lines += len(job.lines)
            self._search(batch)

    def _search(self, batch: list[_Job]) -> None:
        lines = [line for job in batch for line in job.lines]
        try:
            out = self.translator.translate(lines, beam=batch[0].beam)
        except Exception as e:  # the server answers 500 and keeps serving
            for job in batch:
                job.future.set_exception(e)
            return
        self.batches += 1
        start = 0
        for job in batch:
            job.future.set_result(out[start : start + len(job.lines)])
            start += len(job.lines)


def create_app(translator: Translator, limits: Limits, name: str = "") -> FastAPI:
    """The FastAPI application: POST /translate, GET /health, docs at /docs."""
    app = FastAPI(title="attnmt", summary=f"Translate with the attnmt model {name}".strip())
    batcher = Batcher(translator, limits)
    default_beam = translator.cfg.decode.beam

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.post("/translate", response_model=TranslateResponse)
    async def translate(request: TranslateRequest) -> Any:
        if len(request.text) > limits.max_lines:
            return error(413, f"{len(request.text)} lines; at most {limits.max_lines} a request")
        for i, line in enumerate(request.text):
            if len(line) > limits.max_chars:
                return error(413, f"text[{i}]: {len(line)} characters; at most {limits.max_chars}")
        if not request.text:
            return {"translations": []}
        try:
            future = batcher.submit(request.text, request.beam or default_beam)
        except queue.Full:
            return error(503, f"{limits.max_queue} requests waiting; try again shortly")
        return {"translations": await asyncio.wrap_future(future)}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": name,
            "arch": translator.cfg.model.arch,
            "queued": batcher.jobs.qsize(),
            "batches": batcher.batches,
        }

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"{type(exc).__name__}: {exc}")

    return app
