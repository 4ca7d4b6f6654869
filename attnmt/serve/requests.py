"""One request, from its bytes to its answer: the body read within its limit, parsed and
checked against the server's limits (RequestError: its status and message), the work it
asks for bounded before it starts, and the JSON answer."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from attnmt.decoding.options import OPTIONS, api_arguments
from attnmt.decoding.request import Prepared
from attnmt.decoding.search import Beam, SearchOptions, output_limit
from attnmt.decoding.translation import Translation
from attnmt.decoding.translator import Translator
from attnmt.serve.schema import (
    MAX_TERM_CHARS,
    MAX_TERMS,
    Limits,
    TranslateRequest,
)


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


def check_json(http: Request) -> None:
    """415 unless the body says it is JSON: a web page may POST a form or text/plain to any
    address without asking (no CORS preflight), but not application/json."""
    kind = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(
            415, f"content-type {kind or 'missing'}: POST {http.url.path} takes application/json"
        )


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
    except RecursionError:
        raise RequestError(422, "not a request: JSON nested too deeply") from None
    phrases = [(f"constraints[{i}]", c) for i, c in enumerate(request.constraints or [])]
    phrases += [(f"terminology[{i}]", p) for i, p in enumerate(request.terminology or [])]
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
    """413 for more lines, or a longer line, prefix or list of phrases, than the server's
    limits allow (what decoding checks itself, such as a prefix per line, it checks once)."""
    if len(request.text) > limits.max_lines:
        raise RequestError(413, f"{len(request.text)} lines; at most {limits.max_lines} a request")
    for i, line in enumerate(request.text):
        if len(line) > limits.max_chars:
            raise RequestError(
                413, f"text[{i}]: {len(line)} characters; at most {limits.max_chars}"
            )
    for i, p in enumerate(request.prefix or []):
        if len(p) > limits.max_chars:
            raise RequestError(413, f"prefix[{i}]: {len(p)} characters; at most {limits.max_chars}")
    check_glossary(request.terminology)
    for i, c in enumerate(request.constraints or []):  # how many: decoding's to bound
        if sum(map(len, c)) > limits.max_chars:
            raise RequestError(413, f"constraints[{i}]: {len(c)} phrases of "
                                    f"{sum(map(len, c))} characters; at most "
                                    f"{limits.max_chars} in all")  # fmt: skip


def check_glossary(pairs: list[list[str]] | None) -> None:
    """413 for a glossary over MAX_TERMS pairs or MAX_TERM_CHARS characters a side; 422 for
    an item that is not a [source, target] pair of text."""
    if pairs is None:
        return
    if len(pairs) > MAX_TERMS:
        raise RequestError(413, f"terminology: {len(pairs)} pairs; at most {MAX_TERMS}")
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(side.strip() for side in pair):
            raise RequestError(422, f"terminology[{i}]: expected [source, target], both text")
        if any(len(side) > MAX_TERM_CHARS for side in pair):
            raise RequestError(413, f"terminology[{i}]: a side over {MAX_TERM_CHARS} characters")
        if any(not form.strip() for form in pair[0].split("|")):
            raise RequestError(422, f"terminology[{i}]: an empty form in {pair[0]!r} (a|b)")


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


def check_constrained_work(prepared: Prepared, limits: Limits) -> None:
    """413 for a constrained request (constraints, terms found in its lines) whose search
    would pass serve --max-search once each line's hypotheses count once for the line and
    once for each of its phrases: a beam's step works on each phrase of each hypothesis, and
    64 lines x 32 phrases that cannot be met slowed every other request's steps 100-fold."""
    phrases = prepared.phrases
    if phrases is None:
        return
    method = prepared.options.method
    width = method.size if isinstance(method, Beam) else prepared.options.n_best
    work = sum(width * (1 + len(line)) for line in phrases)
    if work > limits.max_search:
        total = sum(map(len, phrases))
        raise RequestError(
            413, f"{len(phrases)} lines x {width} hypotheses x (1 + their {total:,} constraints"
            f" and terms) = {work:,}; at most {limits.max_search:,} a request (serve "
            "--max-search): send fewer lines or constraints",
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
    asked = {n: getattr(request, n) for n, o in OPTIONS.items() if not o.group}
    if request.sampling is not None:
        asked |= request.sampling.model_dump()
    spec = translator.alignment_spec() if request.alignments or request.markup else None
    return translator.options(**api_arguments(asked, request.sampling is not None), attention=spec)


def answer(
    results: list[list[Translation]], n_best: int, terms: bool = False, tm: bool = False
) -> dict[str, Any]:
    """The JSON answer: each line's best translation, with n_best above 1 its list, with
    `terms` the terminology's terms each line's search applied, with `tm` each line's
    translation memory match (or null), and where a line's search left something out, each
    line's warnings."""
    out: dict[str, Any] = {"translations": [r[0].text for r in results]}
    if tm:
        out["tm"] = [None if r[0].tm is None else asdict(r[0].tm) for r in results]
    if terms:
        out["terms"] = [[t.__dict__ for t in r[0].terms] for r in results]
    if n_best > 1:
        out["n_best"] = [[{"text": t.text, "score": round(t.score, 4)} for t in r] for r in results]
    if any(r[0].warnings for r in results):
        out["warnings"] = [r[0].warnings for r in results]
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


async def finished(http: Request, future: Future) -> bool:
    """Wait for `future`; False as soon as the client has gone instead."""
    waiting = asyncio.wrap_future(future)
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=0.25)
        if not waiting.done() and await http.is_disconnected():
            return False
    return True
