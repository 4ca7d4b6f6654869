"""The queue of translation jobs and the search thread that empties it in batches."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from attnmt.decoding.request import Prepared
from attnmt.decoding.search import Sampling
from attnmt.decoding.translate import Translation
from attnmt.decoding.translator import Translator
from attnmt.serve.schema import Limits


@dataclass(eq=False)
class _Job:
    prepared: Prepared  # the request's lines, checked and ready to search
    future: Future = field(default_factory=Future)
    done: list[list[Translation]] = field(default_factory=list)  # results of lines[: len(done)]
    cancelled: bool = False  # its client left: no more work for it

    @property
    def kind(self) -> object:
        """Jobs of one kind may share a batch. Sampled lines are seeded by their place in
        the input, so a sampled job is searched alone (its output then equals the CLI's)."""
        if isinstance(self.prepared.options.method, Sampling):
            return self
        return self.prepared.kind

    @property
    def lines(self) -> list[str]:
        return self.prepared.lines


class Batcher:
    """The queue and the search thread that empties it in batches.

    A batch takes the lines of the waiting requests with the oldest one's beam, one line of
    each in turn, up to batch_lines lines and batch_chars characters: a long request is
    searched over several batches, and one that arrives meanwhile joins the next batch
    instead of waiting for the long one to finish. A batch that fails is searched again
    request by request, so that a failure answers only the request it belongs to.
    """

    def __init__(self, translator: Translator, limits: Limits) -> None:
        self.translator, self.limits = translator, limits
        self.jobs: queue.Queue[_Job] = queue.Queue(maxsize=limits.max_queue)
        self.batches = 0  # searches run (for /health: batching at work)
        threading.Thread(target=self._run, name="attnmt-search", daemon=True).start()

    def submit(self, prepared: Prepared) -> _Job:
        """Queue a request's prepared lines (queue.Full when the queue is full)."""
        job = _Job(prepared)
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
        parts = [
            (job, job.prepared.part(len(job.done), len(job.done) + n)) for job, n in batch.items()
        ]
        first_line = len(parts[0][0].done)  # a sampled job is alone: seeds from its start
        try:
            out = self.translator.decode(
                Prepared.join([p for _, p in parts]), first_line=first_line
            )
        except Exception as e:  # the server answers 500 and keeps serving
            if len(parts) > 1:  # whose failure it is: each request alone
                for job, n in batch.items():
                    self._search({job: n})
                return
            parts[0][0].future.set_exception(e)
            return
        self.batches += 1
        at = 0
        for job, part in parts:
            try:
                job.done.extend(part.finish(out[at : at + len(part)]))
            except Exception as e:  # its own tags, say: its own failure
                job.future.set_exception(e)
            at += len(part)
            if len(job.done) == len(job.lines) and not job.future.done():
                job.future.set_result(job.done)
