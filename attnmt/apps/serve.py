"""`attnmt serve`: translation over HTTP (FastAPI + uvicorn), concurrent requests batched.

Requests wait in one queue; a single search thread takes the first waiting request, then
whatever else arrives within `batch_wait_ms` (up to `batch_lines` lines, only requests with the
same search options), searches all their lines as one call of the Translator (which batches
them by length) and answers each request with its own lines; a long request is searched over
several batches, interleaved with the others (Batcher). Limits give JSON errors, never a crash:
too many lines or characters, or a body too large (refused before it is read whole) 413, a
malformed request (NaN, Infinity, lone surrogates, unknown fields) 422, a full queue 503; every
error is {"error": message}. GET / is the translation page (web/index.html).

A request's work is bounded before it starts: lines × beam (or draws) at most max_search, and
the attention maps it asks for at most max_attention weights, counted at the longest output the
search may write. Attention maps are computed in a thread of their own that stops when the
client leaves. Only a JSON body is read (a form or text/plain POST, which any web page may send
cross-origin, is refused), and only Host names the server answers to (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from attnmt.decoding.alignment import align
from attnmt.decoding.search import Beam, Sampling, SearchOptions, output_limit
from attnmt.decoding.translate import Translation
from attnmt.decoding.translator import Translator
from attnmt.errors import AttnmtError


@dataclass(frozen=True)
class Limits:
    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line
    max_queue: int = 256  # requests waiting
    batch_wait_ms: float = 5.0  # how long the first request of a batch waits for others
    batch_lines: int = 256  # lines searched at most in one batch
    batch_chars: int = 8000  # characters searched at most in one batch (at least one line)
    max_search: int = 512  # lines × beam (or draws) per request
    max_attention: int = 2_000_000  # attention weights a request may ask for (at most)

    @property
    def max_body(self) -> int:
        """Request bytes at most: every character JSON-escaped as a surrogate pair (12
        bytes), plus room for the rest of the object."""
        return self.max_lines * (12 * self.max_chars + 8) + 4096


MAX_PHRASES = 32  # constraints per line a request may give


class SamplingRequest(BaseModel):
    """Draw translations instead of searching (translate --sampling)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    temperature: float = Field(1.0, ge=0.01, le=100.0, description="Divide the logits by this.")
    top_k: int = Field(0, ge=0, description="Draw from the K likeliest tokens (0: all).")
    seed: int = Field(0, ge=0, le=(1 << 63) - 1, description="Seed of the draws.")


class TranslateRequest(BaseModel):
    """Closed, as the config is: an unknown field is refused (422), not ignored; strict, so
    `"beam": true` or `"beam": "5"` is refused too, as the Python API refuses them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: list[str] = Field(description="Sentences to translate, one per item.")
    beam: int | None = Field(None, ge=1, le=100, description="Beam size (default: the model's).")
    n_best: int = Field(
        1, ge=1, le=100, description="Hypotheses per line with scores (at most the beam; "
        "with sampling, draws); above 1 the answer has `n_best` lists.",
    )  # fmt: skip
    length_penalty: float | None = Field(
        None, ge=0.0, le=10.0, description="GNMT length penalty alpha (default: the model's)."
    )
    sampling: SamplingRequest | None = Field(None, description="Draw instead of searching.")
    attention: bool = Field(
        False, description="Also return each hypothesis's source attention (`attention`)."
    )
    target_lang: str | None = Field(
        None, description="A multilingual model: the language to translate into."
    )
    prefix: list[str] | None = Field(
        None, description="Per line of `text`, the text its translation starts with "
        '(prefix-constrained search: interactive MT); "" for none.',
    )  # fmt: skip
    constraints: list[list[str]] | None = Field(
        None, description="Per line of `text`, target phrases its translation must contain "
        f"(lexically constrained beam search; at most {MAX_PHRASES} a line); [] for none.",
    )  # fmt: skip
    alignments: bool = Field(
        False, description="Also return each line's word alignment (`alignments`)."
    )
    markup: bool = Field(
        False, description="The lines hold inline XML/HTML tags: each is put back around "
        "the aligned output words (as translate --markup).",
    )  # fmt: skip


class Scored(BaseModel):
    text: str
    score: float


class AttentionMap(BaseModel):
    src_pieces: list[str] = Field(description="Source pieces, EOS included (the columns).")
    tgt_pieces: list[str] = Field(description="Output pieces, EOS included if it ended (rows).")
    weights: list[list[list[list[float]]]] = Field(
        description="layers x heads x target pieces x source pieces; each row sums to 1. A "
        "Transformer: every decoder layer and head; the GRU model (or an ensemble): one."
    )


class AppliedTerm(BaseModel):
    source: str
    target: str


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="The best translation of each line.")
    alignments: list[list[tuple[int, int]]] | None = Field(
        None, description="With alignments: per line, [source word, target word] pairs of "
        "its best translation (whitespace words, from 0; as translate --alignments).",
    )  # fmt: skip
    terms: list[list[AppliedTerm]] | None = Field(
        None, description="With serve --terminology: each line's terms, found in it and "
        "required in its translation.",
    )  # fmt: skip
    n_best: list[list[Scored]] | None = Field(
        None, description="With n_best above 1: each line's hypotheses, best first."
    )
    attention: list[list[AttentionMap]] | None = Field(
        None, description="With attention: each line's maps, one per hypothesis (as n_best)."
    )


class ErrorResponse(BaseModel):
    error: str = Field(description="What was wrong, in one line (every error has this shape).")


@dataclass(eq=False)
class _Job:
    lines: list[str]
    options: SearchOptions
    target_lang: str | None
    prefix: list[str]  # per line, what its translation starts with ("": nothing)
    constraints: list[list[str]]  # per line, phrases its translation contains
    markup: bool = False  # the lines hold tags (translate --markup)
    future: Future = field(default_factory=Future)
    done: list[list[Translation]] = field(default_factory=list)  # results of lines[: len(done)]
    cancelled: bool = False  # its client left: no more work for it

    @property
    def kind(self) -> object:
        """Jobs of one kind may share a batch. Sampled lines are seeded by their place in
        the input, so a sampled job is searched alone (its output then equals the CLI's)."""
        if isinstance(self.options.method, Sampling):
            return self
        return (self.options, self.target_lang, self.markup)


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

    def submit(
        self,
        lines: list[str],
        options: SearchOptions,
        target_lang: str | None = None,
        prefix: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        markup: bool = False,
    ) -> _Job:
        """Queue a job (queue.Full when the queue is full)."""
        n = len(lines)
        job = _Job(lines, options, target_lang, prefix or [""] * n, constraints or [[]] * n, markup)
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
        """The next batch: {job: how many of its next lines}, one line of each job of the
        first job's kind (search options and target language) in turn, within the batch
        limits (at least one line)."""
        kind, limits = active[0].kind, self.limits
        taken: dict[_Job, int] = {}
        lines = chars = 0
        while True:
            before = lines
            for job in (j for j in active if j.kind == kind):
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
        prefix = [p for job, start, end in parts for p in job.prefix[start:end]]
        wanted = [c for job, start, end in parts for c in job.constraints[start:end]]
        first, start = parts[0][0], parts[0][1]  # a sampled job is alone: seeds from start
        try:
            out = self.translator.search(
                lines, first.options, first_line=start, target_lang=first.target_lang,
                prefix=prefix if any(prefix) else None, constraints=wanted, markup=first.markup,
            )  # fmt: skip
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
    phrases = [(f"constraints[{i}]", c) for i, c in enumerate(request.constraints or [])]
    for name, items in (("text", request.text), ("prefix", request.prefix or []), *phrases):
        for i, line in enumerate(items):
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    422, f"{name}[{i}]: not valid Unicode (a lone surrogate)"
                ) from None
    return request


def check_limits(request: TranslateRequest, limits: Limits) -> None:
    """413 for more lines, or a longer line (or prefix), than the limits allow; 422 for a
    prefix list that does not match the lines."""
    if request.prefix is not None:
        if len(request.prefix) != len(request.text):
            raise RequestError(
                422, f"prefix: {len(request.prefix)} prefixes for {len(request.text)} lines"
            )
        for i, p in enumerate(request.prefix):
            if len(p) > limits.max_chars:
                raise RequestError(
                    413, f"prefix[{i}]: {len(p)} characters; at most {limits.max_chars}"
                )
    if request.constraints is not None:
        if len(request.constraints) != len(request.text):
            raise RequestError(422, f"constraints: {len(request.constraints)} lists for "
                                    f"{len(request.text)} lines")  # fmt: skip
        for i, c in enumerate(request.constraints):
            if len(c) > MAX_PHRASES or sum(map(len, c)) > limits.max_chars:
                raise RequestError(413, f"constraints[{i}]: {len(c)} phrases of "
                                        f"{sum(map(len, c))} characters; at most {MAX_PHRASES} "
                                        f"of {limits.max_chars} in all")  # fmt: skip
    if len(request.text) > limits.max_lines:
        raise RequestError(413, f"{len(request.text)} lines; at most {limits.max_lines} a request")
    for i, line in enumerate(request.text):
        if len(line) > limits.max_chars:
            raise RequestError(
                413, f"text[{i}]: {len(line)} characters; at most {limits.max_chars}"
            )


def check_work(
    translator: Translator, request: TranslateRequest, options: SearchOptions, limits: Limits
) -> None:
    """413 for a request whose search, or whose attention maps at the longest output the
    search may write, would pass the limits: bounded before any work starts."""
    width = options.method.size if isinstance(options.method, Beam) else options.n_best
    hypotheses = len(request.text) * width
    if hypotheses > limits.max_search:
        raise RequestError(
            413, f"{len(request.text)} lines x {width} hypotheses (beam or draws) = "
            f"{hypotheses:,}; at most {limits.max_search:,} a request (serve --max-search)",
        )  # fmt: skip
    layers, heads = translator.attention_shape()
    # The maps asked for, and the attention every hypothesis of an aligned search keeps.
    aligned = request.alignments or request.markup
    maps = options.n_best * layers * heads * request.attention + width * aligned
    if maps:
        weights = attention_bound(translator, request.text, options, maps)
        if weights > limits.max_attention:
            raise RequestError(
                413, f"attention maps of up to {weights:,} weights; at most "
                f"{limits.max_attention:,} a request (serve --max-attention): send fewer or "
                "shorter lines, or a smaller n_best",
            )  # fmt: skip


def attention_bound(
    translator: Translator, lines: list[str], options: SearchOptions, maps: int
) -> int:
    """The attention weights of `maps` maps a line at the longest output the search may
    write: maps x output pieces x source pieces (EOS, tag included), summed over lines."""
    total = 0
    for ids in translator.tokenizer.src.encode([line.strip() for line in lines]):
        S = min(len(ids) + 2, options.max_src_len)  # EOS and a language tag
        T = output_limit(S, options) + 1
        total += maps * T * S
    return total


def request_options(translator: Translator, request: TranslateRequest) -> SearchOptions:
    """The request's search, checked as the CLI's options are (an AttnmtError: 422)."""
    draws = request.sampling
    if draws is not None and request.beam is not None:
        raise AttnmtError("sampling draws instead of searching: drop beam")
    sampling = None if draws is None else (draws.temperature, draws.top_k, draws.seed)
    spec = translator.alignment_spec() if request.alignments or request.markup else None
    return translator.options(request.beam, request.n_best, request.length_penalty, spec, sampling)


def answer(results: list[list[Translation]], n_best: int, terms: bool = False) -> dict[str, Any]:
    """The JSON answer: each line's best translation, with n_best above 1 its list, and
    with `terms` the terminology's terms each line's search applied."""
    out: dict[str, Any] = {"translations": [r[0].text for r in results]}
    if terms:
        out["terms"] = [[t.__dict__ for t in r[0].terms] for r in results]
    if n_best > 1:
        out["n_best"] = [[{"text": t.text, "score": round(t.score, 4)} for t in r] for r in results]
    return out


class Cancelled(Exception):
    """The client left: the work for it stops."""


def maps(
    translator: Translator, results: list[list[Translation]], cancel: threading.Event
) -> list[list[dict[str, Any]]]:
    """Each hypothesis's source attention (Translator.attention_maps), as JSON; Cancelled as
    soon as `cancel` is set (checked between hypotheses)."""
    out: list[list[dict[str, Any]]] = []
    for found in results:
        out.append([])
        for t in found:
            if cancel.is_set():
                raise Cancelled
            weights = translator.attention_maps(t).round(decimals=4).tolist()
            out[-1].append(
                {"src_pieces": t.src_pieces, "tgt_pieces": t.tgt_pieces, "weights": weights}
            )
    return out


def in_thread(work: Any, *args: Any) -> Future:
    """work(*args) in a daemon thread: a server stopped by a signal does not wait for it (the
    event loop's executor would, and cannot cancel it)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as e:  # the waiting request answers it
            future.set_exception(e)

    threading.Thread(target=run, name="attnmt-attention", daemon=True).start()
    return future


def create_app(
    translator: Translator,
    limits: Limits,
    name: str = "",
    access_log: bool = True,
    hosts: frozenset[str] | None = None,
    docs: bool = False,
) -> FastAPI:
    """The FastAPI application: POST /translate, GET / (the page), GET /health, the OpenAPI
    document at /openapi.json (and with docs, Swagger UI at /docs, which loads its scripts from
    a CDN); every error is {"error": message}; with access_log, one line per request on stderr;
    with hosts, a request whose Host header names another host is refused (400)."""
    app = FastAPI(
        title="attnmt", summary=f"Translate with the attnmt model {name}".strip(),
        docs_url="/docs" if docs else None, redoc_url=None,
    )  # fmt: skip
    batcher = Batcher(translator, limits)
    _translate_route(app, translator, batcher, limits)
    page = (resources.files("attnmt.apps") / "web" / "index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        """The translation page (attnmt/apps/web/index.html): it calls /health and /translate."""
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": name,
            "arch": translator.cfg.model.arch,
            "beam": translator.cfg.decode.beam,
            "multilingual": translator.cfg.data.multilingual,
            "target_langs": translator.target_langs,
            "queued": batcher.jobs.qsize(),
            "batches": batcher.batches,
        }

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))  # 404, 405: our shape, not {"detail"}

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}")

    if hosts is not None:
        app.add_middleware(HostCheck, hosts=hosts)
    if access_log:
        app.add_middleware(AccessLog)
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _translate_route(
    app: FastAPI, translator: Translator, batcher: Batcher, limits: Limits
) -> None:
    """POST /translate, its request schema (read by hand, to refuse large bodies before they
    are parsed) documented in the OpenAPI document with its nested models."""
    schema = TranslateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    nested = schema.pop("$defs", {})
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse} for status in (413, 422, 499, 500, 503)
    }

    @app.post(
        "/translate", response_model=TranslateResponse, response_model_exclude_none=True,
        responses=errors, openapi_extra={"requestBody": body},
    )  # fmt: skip
    async def translate(http: Request) -> Any:
        try:
            check_json(http)
            request = parse_request(await read_body(http, limits.max_body))
            http.state.lines = len(request.text)
            check_limits(request, limits)
            options = request_options(translator, request)
            translator.source_prefix(request.target_lang)  # a multilingual model needs it
            translator.constraints_of(request.text, request.constraints, options)  # can it
            check_work(translator, request, options, limits)
        except RequestError as e:
            return _error(e.status, str(e))
        except AttnmtError as e:
            return _error(422, str(e))
        terms = translator.terminology is not None
        if not request.text:
            return answer([], options.n_best, terms)
        try:
            job = batcher.submit(
                request.text, options, request.target_lang, request.prefix, request.constraints,
                request.markup,
            )  # fmt: skip
        except queue.Full:
            return _error(503, f"{limits.max_queue} requests waiting; try again shortly")
        if not await finished(http, job.future):
            job.cancelled = True  # the client left: its remaining lines are not searched
            return _error(499, "client closed the request")
        results = job.future.result()
        found = answer(results, options.n_best, terms)
        if request.alignments:
            found["alignments"] = [align(r[0]) for r in results]
        if request.attention:  # off the event loop: forced decoding is CPU work
            cancel = threading.Event()
            work = in_thread(maps, translator, results, cancel)
            if not await finished(http, work):
                cancel.set()
                return _error(499, "client closed the request")
            found["attention"] = work.result()
        return found

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        document = default_openapi()  # built once, then kept in app.openapi_schema
        document.setdefault("components", {}).setdefault("schemas", {}).update(nested)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


async def finished(http: Request, future: Future) -> bool:
    """Wait for `future`; False as soon as the client has gone instead."""
    waiting = asyncio.wrap_future(future)
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=0.25)
        if not waiting.done() and await http.is_disconnected():
            return False
    return True


def check_json(http: Request) -> None:
    """415 unless the body says it is JSON: a web page may POST a form or text/plain to any
    address without asking (no CORS preflight), but not application/json."""
    kind = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(
            415, f"content-type {kind or 'missing'}: POST /translate takes application/json"
        )


def served_hosts(host: str, allowed: list[str]) -> frozenset[str] | None:
    """The Host header names answered when bound to `host`: the address itself (a loopback
    address: also localhost and the other loopback names) and `allowed`; None (any) when
    bound to every interface and nothing more is named."""
    wildcard = host in ("0.0.0.0", "::", "")
    if wildcard and not allowed:
        return None
    names = {h.lower() for h in allowed} | ({host.lower()} if not wildcard else set())
    if host in ("127.0.0.1", "::1", "localhost"):
        names |= {"127.0.0.1", "::1", "localhost"}
    return frozenset(names)


class HostCheck:
    """ASGI middleware: 400 for a request whose Host header is not one the server answers to,
    so a page on another site that rebinds its DNS name to this address reads nothing."""

    def __init__(self, app: Any, hosts: frozenset[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            name = header[1:].split("]")[0] if header.startswith("[") else header.split(":")[0]
            if name not in self.hosts:
                message = f"Host {header or 'missing'} is not served here (serve --allowed-host)"
                await _error(400, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, before anything is announced: a port in use or an address
    not ours is one line and exit code 2, not uvicorn's log and exit code 3."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AttnmtError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(app: FastAPI, host: str, port: int, name: str) -> None:
    """Serve `app` on host:port until SIGINT (exit code 130, as the other commands) or SIGTERM
    (143), at once, whatever the search threads are doing."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # A search thread may be inside torch for seconds, and a graceful shutdown would
            # wait for it; the interpreter's exit would run destructors under its thread pool
            # (seen: "terminate called without an active exception"). The process ends now.
            print(f"attnmt: {'interrupted' if sig == 2 else 'terminated'}", file=sys.stderr)
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(128 + sig)

    sock = listen(host, port)
    bound = sock.getsockname()[1]
    where = f"{host}:{bound}" if ":" not in host else f"[{host}]:{bound}"
    print(f"attnmt: serving {name} on http://{where}", file=sys.stderr, flush=True)
    Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


class AccessLog:
    """ASGI middleware: one line per HTTP request on stderr (client, method, path, status,
    lines, milliseconds). Plain ASGI, not Starlette's BaseHTTPMiddleware, which would keep the
    endpoint from seeing that its client has gone."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ms = (time.perf_counter() - start) * 1000
            lines = scope.get("state", {}).get("lines", "-")
            client = scope["client"][0] if scope.get("client") else "-"
            print(
                f"attnmt: {client} {scope['method']} {scope['path']} {status} {lines} lines "
                f"{ms:.1f} ms", file=sys.stderr, flush=True,
            )  # fmt: skip
