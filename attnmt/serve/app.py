"""`attnmt serve`: translation over HTTP (FastAPI + uvicorn), concurrent requests batched at
every decoding step.

Requests wait in one queue; a single search thread hands their lines to the running search,
where they join the lines already being decoded at the next step and leave, answered, as each
is done (step-level batching: Scheduler). Limits give JSON errors, never a crash: too many
lines or characters, or a body too large (refused before it is read whole) 413, a malformed
request (NaN, Infinity, lone surrogates, unknown fields) 422, a full queue 503; every
error is {"error": message}. GET / is the translation page (web/index.html).

A request's work is bounded before it starts: lines × beam (or draws) at most max_search, and
the attention maps it asks for at most max_attention weights, counted at the longest output the
search may write. Attention maps are computed in a thread of their own that stops when the
client leaves. Only a JSON body is read (a form or text/plain POST, which any web page may send
cross-origin, is refused), and only Host names the server answers to (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from attnmt.decoding.alignment import align
from attnmt.decoding.terminology import Terminology
from attnmt.decoding.translator import Translator
from attnmt.errors import AttnmtError, TooMuchWork
from attnmt.serve.http import AccessLog, HostCheck, error_response
from attnmt.serve.requests import (
    RequestError,
    answer,
    check_json,
    check_limits,
    check_work,
    maps,
    parse_request,
    read_body,
    request_options,
)
from attnmt.serve.scheduler import Scheduler
from attnmt.serve.schema import ErrorResponse, Limits, TranslateRequest, TranslateResponse


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
    scheduler: Scheduler | None = None,
) -> FastAPI:
    """The FastAPI application: POST /translate, GET / (the page), GET /health, the OpenAPI
    document at /openapi.json (and with docs, Swagger UI at /docs, which loads its scripts from
    a CDN); every error is {"error": message}; with access_log, one line per request on stderr;
    with hosts, a request whose Host header names another host is refused (400); `scheduler`:
    the one whose run() the caller calls (else one searching in a thread of its own)."""
    app = FastAPI(
        title="attnmt", summary=f"Translate with the attnmt model {name}".strip(),
        docs_url="/docs" if docs else None, redoc_url=None,
    )  # fmt: skip
    scheduler = scheduler or Scheduler(translator, limits)  # none given: searching in a thread
    _translate_route(app, translator, scheduler, limits)
    page = (resources.files("attnmt.serve") / "web" / "index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        """The translation page (attnmt/serve/web/index.html): it calls /health and /translate."""
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
            "queued": scheduler.jobs.qsize(),
            "searching": scheduler.searching,
            "steps": scheduler.steps,
        }

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # 404, 405: our shape, not {"detail"}
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"{type(exc).__name__}: {exc}")

    if hosts is not None:
        app.add_middleware(HostCheck, hosts=hosts)
    if access_log:
        app.add_middleware(AccessLog)
    return app


def _translate_route(
    app: FastAPI, translator: Translator, scheduler: Scheduler, limits: Limits
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
            check_work(translator, request, options, limits)
            prepared = translator.prepare(
                request.text, options, request.target_lang, request.prefix,
                request.constraints, request.markup, glossary=glossary(translator, request),
            )  # fmt: skip
        except RequestError as e:
            return error_response(e.status, str(e))
        except TooMuchWork as e:
            return error_response(413, str(e))
        except AttnmtError as e:
            return error_response(422, str(e))
        terms = translator.terminology is not None or request.terminology is not None
        if not request.text:
            return answer([], options.n_best, terms)
        try:
            job = scheduler.submit(prepared)
        except queue.Full:
            return error_response(503, f"{limits.max_queue} requests waiting; try again shortly")
        if not await finished(http, job.future):
            job.cancelled = True  # the client left: its remaining lines are not searched
            return error_response(499, "client closed the request")
        results = job.future.result()
        found = answer(results, options.n_best, terms)
        if request.alignments:
            found["alignments"] = [align(r[0]) for r in results]
        if request.attention:  # off the event loop: forced decoding is CPU work
            cancel = threading.Event()
            work = in_thread(maps, translator, results, cancel)
            if not await finished(http, work):
                cancel.set()
                return error_response(499, "client closed the request")
            found["attention"] = work.result()
        return found

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        document = default_openapi()  # built once, then kept in app.openapi_schema
        document.setdefault("components", {}).setdefault("schemas", {}).update(nested)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def glossary(translator: Translator, request: TranslateRequest) -> Terminology | None:
    """A request's own glossary, matched as the server's terminology is (case, prefixes)."""
    if request.terminology is None:
        return None
    served = translator.terminology
    ignore_case, prefix = (served.ignore_case, served.prefix) if served else (False, False)
    return Terminology.of_pairs([(s, t) for s, t in request.terminology], ignore_case, prefix)


async def finished(http: Request, future: Future) -> bool:
    """Wait for `future`; False as soon as the client has gone instead."""
    waiting = asyncio.wrap_future(future)
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=0.25)
        if not waiting.done() and await http.is_disconnected():
            return False
    return True
