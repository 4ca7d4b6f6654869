"""`attnmt serve`: translation over HTTP (FastAPI + uvicorn), concurrent requests batched at
every decoding step.

Requests wait in one queue; a single search thread hands their lines to the running search,
where they join the lines already being decoded at the next step and leave, answered, as each
is done (step-level batching: Scheduler). Limits give JSON errors, never a crash: too many
lines or characters, or a body too large (refused before it is read whole) 413, a malformed
request (NaN, Infinity, lone surrogates, unknown fields) 422, a full queue 503; every
error is {"error": message}. GET / is the translation page (web/index.html).
POST /translate is answered in front of FastAPI (attnmt.serve.route: the hot path).

A request's work is bounded before it starts: lines × beam (or draws) at most max_search, and
the attention maps it asks for at most max_attention weights, counted at the longest output the
search may write. Attention maps are computed in a thread of their own that stops when the
client leaves. Only a JSON body is read (a form or text/plain POST, which any web page may send
cross-origin, is refused), and only Host names the server answers to (DNS rebinding).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from attnmt.decoding.translator import Translator
from attnmt.errors import AttnmtError
from attnmt.serve.http import AccessLog, HostCheck, error_response
from attnmt.serve.requests import RequestError, check_json, read_body
from attnmt.serve.route import PATH, TranslateRoute, openapi_operation
from attnmt.serve.scheduler import Scheduler
from attnmt.serve.schema import MAX_SEGMENT_CHARS, ErrorResponse, Limits, TmEntry
from attnmt.serve.workers import ForkedScheduler

TM_BODY = 2 * 12 * MAX_SEGMENT_CHARS + 1024  # POST /tm's bytes at most (JSON-escaped text)


def create_app(
    translator: Translator,
    limits: Limits,
    name: str = "",
    access_log: bool = True,
    hosts: frozenset[str] | None = None,
    docs: bool = False,
    scheduler: Scheduler | ForkedScheduler | None = None,
    tm_write: bool = False,
) -> ASGIApp:
    """The application: POST /translate (TranslateRoute), and in FastAPI GET / (the page),
    GET /health, the OpenAPI document at /openapi.json (and with docs, Swagger UI at /docs,
    which loads its scripts from a CDN); every error is {"error": message}; with access_log,
    one line per request on stderr;
    with hosts, a request whose Host header names another host is refused (400); `scheduler`:
    the one whose run() the caller calls (else one searching in a thread of its own);
    `tm_write`: POST /tm stores approved pairs in the translator's TM (else 403)."""
    app = FastAPI(
        title="attnmt", summary=f"Translate with the attnmt model {name}".strip(),
        docs_url="/docs" if docs else None, redoc_url=None,
    )  # fmt: skip
    scheduler = scheduler or Scheduler(translator, limits)  # none given: searching in a thread
    _document(app)
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
            "languages": dict(
                zip(("source", "target"), translator.cfg.data.languages, strict=True)
            ),
            "target_langs": translator.target_langs,
            "queued": scheduler.queued,
            "searching": scheduler.searching,
            "steps": scheduler.steps,
        }

    _tm_route(app, translator, tm_write)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # 404, 405: our shape, not {"detail"}
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"{type(exc).__name__}: {exc}")

    served: ASGIApp = TranslateRoute(app, translator, scheduler, limits)
    if hosts is not None:
        served = HostCheck(served, hosts)
    return AccessLog(served) if access_log else served


def _tm_route(app: FastAPI, translator: Translator, tm_write: bool) -> None:
    """POST /tm: an approved pair stored in the translator's TM (serve --tm --tm-write)."""

    @app.post(
        "/tm", responses={403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": TmEntry.model_json_schema()}}}},
    )  # fmt: skip
    async def tm_add(http: Request) -> JSONResponse:
        """Store an approved pair (a post-edit), {"source", "target"}, in the TM (serve --tm
        TM --tm-write): {"segment": its id}. Bounded, closed and strict as /translate."""
        if translator.tm is None:
            return error_response(404, "this server has no translation memory (serve --tm TM)")
        if not tm_write:
            return error_response(403, "the translation memory is read-only (serve --tm-write)")
        try:
            check_json(http)
            entry = TmEntry.model_validate_json(await read_body(http, TM_BODY))
            found = await run_in_threadpool(translator.tm.add, entry.source, entry.target, "http")
        except RequestError as e:
            return error_response(e.status, str(e))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            return error_response(422, f"{where}: {first['msg']}" if where else first["msg"])
        except AttnmtError as e:
            return error_response(422, str(e))
        return JSONResponse({"segment": found})


def _document(app: FastAPI) -> None:
    """The OpenAPI document FastAPI writes for its routes, with POST /translate's."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = default_openapi()  # built once, then kept in app.openapi_schema
            operation, schemas = openapi_operation()
            document["paths"] = {PATH: {"post": operation}, **document["paths"]}
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
