"""POST /translate as a plain ASGI app in front of FastAPI.

The search shares the machine with the HTTP side: every microsecond of CPU a request costs
there is taken from the search's threads (and stalls both of its OpenMP threads when it takes
a core from one). FastAPI's path for a request (its middleware, dependency handling, request
and response models) cost about twice our own work, so the one hot route is answered here,
with the same checks, limits and answers; FastAPI keeps the page, /health, the errors of
other paths and the OpenAPI document (which describes this route: openapi_operation).
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from attnmt.decoding.alignment import align
from attnmt.decoding.terminology import Term, Terminology
from attnmt.decoding.translator import Translator
from attnmt.errors import AttnmtError, TooMuchWork
from attnmt.serve.http import error_response
from attnmt.serve.requests import (
    RequestError,
    answer,
    check_constrained_work,
    check_json,
    check_limits,
    check_work,
    finished,
    in_thread,
    maps,
    parse_request,
    read_body,
    request_options,
)
from attnmt.serve.scheduler import Scheduler
from attnmt.serve.schema import ErrorResponse, Limits, TranslateRequest, TranslateResponse
from attnmt.serve.workers import ForkedScheduler

PATH = "/translate"


class TranslateRoute:
    """ASGI: POST /translate answered here (another method: 405), every other path passed on
    to `app`."""

    def __init__(
        self,
        app: ASGIApp,
        translator: Translator,
        scheduler: Scheduler | ForkedScheduler,
        limits: Limits,
    ) -> None:
        self.app, self.translator, self.scheduler, self.limits = app, translator, scheduler, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            refused = error_response(405, "Method Not Allowed")
            refused.headers["allow"] = "POST"
            await refused(scope, receive, send)
            return
        try:
            response = await self.translate(Request(scope, receive))
        except Exception as e:  # as FastAPI's handler of the others: one JSON line
            response = error_response(500, f"{type(e).__name__}: {e}")
        await response(scope, receive, send)

    async def translate(self, http: Request) -> Response:
        """The request's lines searched by the scheduler; its answer or its error."""
        translator, limits = self.translator, self.limits
        try:
            check_json(http)
            request = parse_request(await read_body(http, limits.max_body))
            http.scope.setdefault("state", {})["lines"] = len(request.text)  # the access log's
            check_limits(request, limits)
            options = request_options(translator, request)
            check_work(translator, request, options, limits)
            prepare = functools.partial(
                translator.prepare, request.text, options, request.target_lang, request.prefix,
                request.constraints, request.markup, glossary=glossary(translator, request),
            )  # fmt: skip
            # With a TM, each line's lookup (SQLite, edit distances) runs off the event loop.
            prepared = await run_in_threadpool(prepare) if translator.tm is not None else prepare()
            check_constrained_work(prepared, limits)
        except RequestError as e:
            return error_response(e.status, str(e))
        except TooMuchWork as e:
            return error_response(413, str(e))
        except AttnmtError as e:
            return error_response(422, str(e))
        terms = translator.terminology is not None or request.terminology is not None
        tm = translator.tm is not None
        if not request.text:
            return _json(answer([], options.n_best, terms, tm))
        try:
            job = self.scheduler.submit(prepared)
        except queue.Full:
            return error_response(503, f"{limits.max_queue} requests waiting; try again shortly")
        if not await finished(http, job.future):
            job.cancelled = True  # the client left: its remaining lines are not searched
            return error_response(499, "client closed the request")
        results = job.future.result()
        found = answer(results, options.n_best, terms, tm)
        if request.alignments:
            found["alignments"] = [align(r[0]) for r in results]
        if request.attention:  # off the event loop: forced decoding is CPU work
            cancel = threading.Event()
            work = in_thread(maps, translator, results, cancel)
            if not await finished(http, work):
                cancel.set()
                return error_response(499, "client closed the request")
            found["attention"] = work.result()
        return _json(found)


def _json(found: dict[str, Any]) -> Response:
    """The answer as TranslateResponse writes it (fields left out where None)."""
    body = TranslateResponse.model_validate(found).model_dump_json(exclude_none=True)
    return Response(body, media_type="application/json")


def glossary(translator: Translator, request: TranslateRequest) -> Terminology | None:
    """A request's own glossary, matched as the server's terminology is (case, prefixes) or
    whatever its case where the request says terms_ignore_case; then the server's terms too
    are in it, matched so (the server's own matches stay: a request adds, never removes)."""
    served = translator.terminology
    ignore_case, prefix = (served.ignore_case, served.prefix) if served else (False, False)
    if request.terms_ignore_case is not None:
        ignore_case = request.terms_ignore_case
    terms = [Term(s.strip(), t.strip()) for s, t in request.terminology or []]
    if served is not None and ignore_case and not served.ignore_case:
        terms += served.all_terms()
    return Terminology(terms, ignore_case, prefix) if terms else None


def openapi_operation() -> tuple[dict[str, Any], dict[str, Any]]:
    """POST /translate's OpenAPI operation (request body, answer, errors) and the schemas it
    refers to (components/schemas)."""
    ref = "#/components/schemas/{model}"
    schemas: dict[str, Any] = {}

    def schema(model: type[TranslateRequest | TranslateResponse | ErrorResponse]) -> dict:
        s = model.model_json_schema(ref_template=ref)
        schemas.update(s.pop("$defs", {}))
        return s

    def content(s: dict[str, Any]) -> dict[str, Any]:
        return {"application/json": {"schema": s}}

    schemas["TranslateResponse"] = schema(TranslateResponse)
    schemas["ErrorResponse"] = schema(ErrorResponse)
    error = content({"$ref": ref.format(model="ErrorResponse")})
    errors = {
        str(status): {"description": text, "content": error}
        for status, text in (
            (413, "Too many lines, characters or hypotheses"), (415, "Not JSON"),
            (422, "A malformed request"), (499, "The client left"), (500, "A server error"),
            (503, "The queue is full"),
        )
    }  # fmt: skip
    operation = {
        "summary": "Translate",
        "operationId": "translate_translate_post",
        "requestBody": {"required": True, "content": content(schema(TranslateRequest))},
        "responses": {
            "200": {
                "description": "Successful Response",
                "content": content({"$ref": ref.format(model="TranslateResponse")}),
            },
            **errors,
        },
    }
    return operation, schemas
