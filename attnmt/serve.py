"""`attnmt serve`: translation over HTTP (FastAPI + uvicorn), concurrent requests batched.

Requests wait in one queue; a single search thread takes the first waiting request, then
whatever else arrives within `batch_wait_ms` (up to `batch_lines` lines, only requests with the
same beam), searches all their lines as one call of the Translator (which batches them by
length) and answers each request with its own lines; a long request is searched over several
batches, interleaved with the others (Batcher). Limits give JSON errors, never a crash: too
many lines or characters, or a body too large (refused before it is read whole) 413, a
malformed request (NaN, Infinity and lone surrogates included) 422, a full queue 503.
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from attnmt.api import Translator
from attnmt.errors import AttnmtError


@dataclass(frozen=True)
class Limits:
    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line
    max_queue: int = 256  # requests waiting
    batch_wait_ms: float = 5.0  # how long the first request of a batch waits for others
    batch_lines: int = 256  # lines searched at most in one batch
    batch_chars: int = 8000  # characters searched at most in one batch (at least one line)

    @property
    def max_body(self) -> int:
        """Request bytes at most: every character JSON-escaped as a surrogate pair (12
        bytes), plus room for the rest of the object."""
        return self.max_lines * (12 * self.max_chars + 8) + 4096


class TranslateRequest(BaseModel):
    text: list[str] = Field(description="Sentences to translate, one per item.")
    beam: int | None = Field(None, ge=1, le=100, description="Beam size (default: the model's).")
    target_lang: str | None = Field(
        None, description="A multilingual model: the language to translate into."
    )


class TranslateResponse(BaseModel):
    translations: list[str]


@dataclass(eq=False)
class _Job:
    lines: list[str]
    beam: int
    target_lang: str | None
    future: Future = field(default_factory=Future)
    done: list[str] = field(default_factory=list)  # translations of lines[: len(done)]
    cancelled: bool = False  # its client left: no more work for it


class Batcher:
    """The queue and the search thread that empties it in batches.

    A batch takes the lines of the waiting requests with the oldest one's beam, one line of
    each in turn, up to batch_lines lines and batch_chars characters: a long request is
    searched over several batches, and one that arrives meanwhile joins the next batch
    instead of waiting for the long one to finish.
    """

    def __init__(self, translator: Translator, limits: Limits) -> None:
        self.translator, self.limits = translator, limits
        self.jobs: queue.Queue[_Job] = queue.Queue(maxsize=limits.max_queue)
        self.batches = 0  # searches run (for /health: batching at work)
        threading.Thread(target=self._run, name="attnmt-search", daemon=True).start()

    def submit(self, lines: list[str], beam: int, target_lang: str | None = None) -> _Job:
        """Queue a job (queue.Full when the queue is full)."""
        job = _Job(lines, beam, target_lang)
        self.jobs.put_nowait(job)
        return job

    def _run(self) -> None:
        active: list[_Job] = []  # taken from the queue, not finished
        while True:
            if not active:
                active.append(self.jobs.get())
                deadline = time.monotonic() + self.limits.batch_wait_ms / 1000
            else:
                deadline = time.monotonic()  # work is waiting: take only what has come
            while len(active) < self.limits.max_queue:
                try:
                    active.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            active = [job for job in active if not job.cancelled]
            if active:
                self._search(self._take(active))
                active = [job for job in active if not job.future.done()]

    def _take(self, active: list[_Job]) -> dict[_Job, int]:
        """The next batch: {job: how many of its next lines}, one line of each job with the
        first job's beam and target language in turn, within the batch limits (at least one
        line)."""
        kind, limits = (active[0].beam, active[0].target_lang), self.limits
        taken: dict[_Job, int] = {}
        lines = chars = 0
        while True:
            before = lines
            for job in (j for j in active if (j.beam, j.target_lang) == kind):
                i = len(job.done) + taken.get(job, 0)
                if i == len(job.lines):
                    continue
                if lines and (
                    lines == limits.batch_lines or chars + len(job.lines[i]) > limits.batch_chars
                ):
                    return taken
                taken[job] = taken.get(job, 0) + 1
                lines, chars = lines + 1, chars + len(job.lines[i])
            if lines == before:
                return taken

    def _search(self, batch: dict[_Job, int]) -> None:
        parts = [(job, len(job.done), len(job.done) + n) for job, n in batch.items()]
        lines = [line for job, start, end in parts for line in job.lines[start:end]]
        first = next(iter(batch))
        try:
            out = self.translator.translate(lines, beam=first.beam, target_lang=first.target_lang)
        except Exception as e:  # the server answers 500 and keeps serving
            for job in batch:
                job.future.set_exception(e)
            return
        self.batches += 1
        at = 0
        for job, start, end in parts:
            job.done.extend(out[at : at + end - start])
            at += end - start
            if len(job.done) == len(job.lines):
                job.future.set_result(job.done)


class RequestError(Exception):
    """A request refused: its HTTP status and the message of its JSON body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it passes `limit` bytes: before it is
    read whole when Content-Length says so, else as it streams in."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise RequestError(413, f"request body of {int(length):,} bytes; at most {limit:,}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"request body over {limit:,} bytes")
    return bytes(body)


def parse_request(body: bytes) -> TranslateRequest:
    """A TranslateRequest from JSON bytes; 422 for what JSON or the schema refuse, for the
    non-standard NaN and Infinity, and for text that is not valid Unicode (lone surrogates)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text} is out of range")
        return value

    try:
        data = json.loads(body, parse_constant=refuse, parse_float=finite)
        request = TranslateRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise RequestError(422, f"{where}: {first['msg']}") from None
    except ValueError as e:  # JSONDecodeError included
        raise RequestError(422, f"not a JSON request: {e}") from None
    for i, line in enumerate(request.text):
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(422, f"text[{i}]: not valid Unicode (a lone surrogate)") from None
    return request


def check_limits(request: TranslateRequest, limits: Limits) -> None:
    """413 for more lines, or a longer line, than the limits allow."""
    if len(request.text) > limits.max_lines:
        raise RequestError(413, f"{len(request.text)} lines; at most {limits.max_lines} a request")
    for i, line in enumerate(request.text):
        if len(line) > limits.max_chars:
            raise RequestError(
                413, f"text[{i}]: {len(line)} characters; at most {limits.max_chars}"
            )


def create_app(translator: Translator, limits: Limits, name: str = "") -> FastAPI:
    """The FastAPI application: POST /translate, GET /health, docs at /docs."""
    app = FastAPI(title="attnmt", summary=f"Translate with the attnmt model {name}".strip())
    batcher = Batcher(translator, limits)
    default_beam = translator.cfg.decode.beam

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.post(
        "/translate",
        response_model=TranslateResponse,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": TranslateRequest.model_json_schema()}},
            }
        },
    )
    async def translate(http: Request) -> Any:
        try:
            request = parse_request(await read_body(http, limits.max_body))
            check_limits(request, limits)
            translator.source_prefix(request.target_lang)  # a multilingual model needs it
        except RequestError as e:
            return error(e.status, str(e))
        except AttnmtError as e:
            return error(422, str(e))
        if not request.text:
            return {"translations": []}
        try:
            job = batcher.submit(request.text, request.beam or default_beam, request.target_lang)
        except queue.Full:
            return error(503, f"{limits.max_queue} requests waiting; try again shortly")
        waiting = asyncio.wrap_future(job.future)
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=0.25)
            if not waiting.done() and await http.is_disconnected():
                job.cancelled = True  # the client left: its remaining lines are not searched
                return error(499, "client closed the request")
        return {"translations": waiting.result()}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": name,
            "arch": translator.cfg.model.arch,
            "target_langs": translator.target_langs,
            "queued": batcher.jobs.qsize(),
            "batches": batcher.batches,
        }

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"{type(exc).__name__}: {exc}")

    return app
