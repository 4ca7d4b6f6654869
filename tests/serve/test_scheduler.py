"""The scheduler on its own: requests' lines share the running search, join it while it runs,
leave it as each is done, and one request's failure answers only that request."""

from __future__ import annotations

import time

from attnmt.decoding.markup import parse
from attnmt.decoding.request import Prepared
from attnmt.decoding.search import SearchOptions
from attnmt.decoding.translation import Translation
from attnmt.serve.scheduler import Scheduler
from attnmt.serve.schema import Limits


class Shouting:
    """A stand-in for Translator: each line upper-cased, after as many steps as it has
    characters; a line holding "boom" fails the search it is in, as a bug in the search would."""

    def __init__(self) -> None:
        self.searches: list[list[str]] = []  # the lines of each batch searched alone
        self.steps: list[list[str]] = []  # the lines in the pools at each step

    def decode(self, prepared: Prepared, first_line: int = 0) -> list[list[Translation]]:
        self.searches.append(list(prepared.lines))
        if any("boom" in line for line in prepared.lines):
            raise RuntimeError("boom")
        return [[Translation(line.upper(), 0.0, [], [], None)] for line in prepared.lines]

    def pool(self, options, source_prefix=(), constrained=False) -> ShoutingPool:
        return ShoutingPool(self)


class ShoutingPool:
    def __init__(self, owner: Shouting) -> None:
        self.owner, self.left, self.next = owner, {}, 0

    def __len__(self) -> int:
        return len(self.left)

    def add(self, lines, target_prefix=None, phrases=None) -> list[int]:
        keys = list(range(self.next, self.next + len(lines)))
        self.next += len(lines)
        self.left.update({k: [line, len(line)] for k, line in zip(keys, lines, strict=True)})
        return keys

    def step(self) -> dict[int, list[Translation]]:
        time.sleep(0.002)  # a step takes time: a request can arrive during a search
        self.owner.steps.append(sorted(line for line, _ in self.left.values()))
        if any("boom" in line for line, _ in self.left.values()):
            raise RuntimeError("boom")
        for entry in self.left.values():
            entry[1] -= 1
        done = {k: [Translation(line.upper(), 0.0, [], [], None)]
                for k, (line, n) in self.left.items() if n == 0}  # fmt: skip
        for k in done:
            del self.left[k]
        return done


def _submit_together(scheduler: Scheduler, requests: list[Prepared]) -> list:
    # Within one batch_wait_ms, so that they share the first search.
    return [scheduler.submit(p) for p in requests]


def test_requests_share_a_search_and_each_gets_its_own_lines():
    search = Shouting()
    scheduler = Scheduler(search, Limits(batch_wait_ms=200))  # type: ignore[arg-type]
    jobs = _submit_together(scheduler, [Prepared(SearchOptions(), ["aaa", "b"]),
                                      Prepared(SearchOptions(), ["cc"])])  # fmt: skip
    assert [[r[0].text for r in j.future.result(timeout=10)] for j in jobs] == [
        ["AAA", "B"],
        ["CC"],
    ]
    # One search: all three lines at the first step; each left as it was done.
    assert search.steps == [["aaa", "b", "cc"], ["aaa", "cc"], ["aaa"]]


def test_a_request_joins_the_running_search_and_a_short_line_leaves_first():
    search = Shouting()
    scheduler = Scheduler(search, Limits(batch_wait_ms=0))  # type: ignore[arg-type]
    long = scheduler.submit(Prepared(SearchOptions(), ["x" * 400]))
    while not search.steps:
        time.sleep(0.001)
    short = scheduler.submit(Prepared(SearchOptions(), ["yy"]))
    assert short.future.result(timeout=10)[0][0].text == "YY"
    assert not long.future.done()  # answered while the long one is still searching
    assert long.future.result(timeout=10)[0][0].text == "X" * 400
    joined = [i for i, lines in enumerate(search.steps) if "yy" in lines]
    assert len(joined) == 2 and joined[0] > 0  # it joined a running search, for its 2 steps
    assert all("x" * 400 in search.steps[i] for i in joined)


def test_the_running_search_holds_at_most_batch_lines_lines():
    search = Shouting()
    limits = Limits(batch_wait_ms=200, batch_lines=3)
    scheduler = Scheduler(search, limits)  # type: ignore[arg-type]
    job = scheduler.submit(Prepared(SearchOptions(), [str(i) * 3 for i in range(7)]))
    assert [r[0].text for r in job.future.result(timeout=10)] == [str(i) * 3 for i in range(7)]
    assert max(map(len, search.steps)) == 3


def test_a_failing_request_does_not_fail_its_batch_mates():
    search = Shouting()
    scheduler = Scheduler(search, Limits(batch_wait_ms=200))  # type: ignore[arg-type]
    good = [Prepared(SearchOptions(), [f"line {i}"]) for i in range(5)]
    jobs = _submit_together(scheduler, [*good[:2], Prepared(SearchOptions(), ["boom"]), *good[2:]])
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
    scheduler = Scheduler(Shouting(), Limits(batch_wait_ms=200))  # type: ignore[arg-type]
    plain, tagged = _submit_together(
        scheduler,
        [Prepared(SearchOptions(), ["y"]), Prepared(SearchOptions(), [text], trees=[tree])],
    )
    assert plain.future.result(timeout=10)[0][0].text == "Y"
    assert isinstance(tagged.future.exception(timeout=10), RecursionError)
