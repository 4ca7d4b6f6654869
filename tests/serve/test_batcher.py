"""The batcher on its own: requests share a search, and one request's failure answers only
that request, never a batch-mate."""

from __future__ import annotations

import time

from attnmt.decoding.markup import parse
from attnmt.decoding.request import Prepared
from attnmt.decoding.search import SearchOptions
from attnmt.decoding.translate import Translation
from attnmt.serve.batcher import Batcher
from attnmt.serve.schema import Limits


class Shouting:
    """A stand-in for Translator.decode: each line upper-cased; a line holding "boom" fails
    the whole search it is in, as a bug in the search would."""

    def __init__(self) -> None:
        self.searches: list[list[str]] = []

    def decode(self, prepared: Prepared, first_line: int = 0) -> list[list[Translation]]:
        self.searches.append(list(prepared.lines))
        if any("boom" in line for line in prepared.lines):
            raise RuntimeError("boom")
        return [[Translation(line.upper(), 0.0, [], [], None)] for line in prepared.lines]


def _submit_together(batcher: Batcher, requests: list[Prepared]) -> list:
    # Within one batch_wait_ms, so that they share the first search.
    return [batcher.submit(p) for p in requests]


def test_requests_share_a_search_and_each_gets_its_own_lines():
    search = Shouting()
    batcher = Batcher(search, Limits(batch_wait_ms=200))  # type: ignore[arg-type]
    jobs = _submit_together(batcher, [Prepared(SearchOptions(), ["a", "b"]),
                                      Prepared(SearchOptions(), ["c"])])  # fmt: skip
    assert [[r[0].text for r in j.future.result(timeout=10)] for j in jobs] == [["A", "B"], ["C"]]
    assert search.searches == [["a", "b", "c"]]  # one search, each request's lines together


def test_a_failing_request_does_not_fail_its_batch_mates():
    search = Shouting()
    batcher = Batcher(search, Limits(batch_wait_ms=200))  # type: ignore[arg-type]
    good = [Prepared(SearchOptions(), [f"line {i}"]) for i in range(5)]
    jobs = _submit_together(batcher, [*good[:2], Prepared(SearchOptions(), ["boom"]), *good[2:]])
    for job in jobs:
        while not job.future.done():
            time.sleep(0.01)
    failed = [j for j in jobs if j.future.exception() is not None]
    assert [j.lines for j in failed] == [["boom"]]
    answered = [j.future.result()[0][0].text for j in jobs if j not in failed]
    assert answered == [f"LINE {i}" for i in range(5)]


def test_tags_that_cannot_be_put_back_fail_only_their_own_request(monkeypatch):
    import attnmt.decoding.request

    def put_back(found, trees):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(attnmt.decoding.request, "put_back", put_back)
    text, tree = parse("<b>x</b>")
    batcher = Batcher(Shouting(), Limits(batch_wait_ms=200))  # type: ignore[arg-type]
    plain, tagged = _submit_together(
        batcher, [Prepared(SearchOptions(), ["y"]), Prepared(SearchOptions(), [text], trees=[tree])]
    )
    assert plain.future.result(timeout=10)[0][0].text == "Y"
    assert isinstance(tagged.future.exception(timeout=10), RecursionError)
