"""The step-level scheduler: requests' lines join the running search at every decoding step and
leave it, answered, as each is done.

One thread owns the search. It keeps a pool per kind of line (search options, source prefix,
constrained or not: Translator.pool) and loops: take the requests that have arrived, hand
their lines to their pools (oldest request first, one line of each in turn, while the pools
hold fewer than batch_lines lines and batch_chars characters; once enough wait: JOIN_SHARE),
then advance every pool by one step. A line that arrives while others are half-way through
joins them within a few steps instead of waiting for the whole search to end (Orca's
iteration-level scheduling, Yu et al. OSDI 2022, for an encoder-decoder), and a short line
leaves as soon as it is done instead of waiting for the longest. Sampled requests draw per
batch (their seeds follow the lines' places), so each is searched alone, by a thread of its
own (SAMPLING_THREAD): a large one (64 lines x 8 draws) took 38 s, which the other requests'
steps no longer wait for (issue 77; the shortlist and matmul backend are per thread). A pool
that fails is emptied and each of its requests searched again alone, so that a failure
answers only the request it belongs to.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from attnmt.decoding.request import Prepared
from attnmt.decoding.search import Sampling, SearchOptions
from attnmt.decoding.translate import LinePool
from attnmt.decoding.translation import Translation
from attnmt.decoding.translator import Translator
from attnmt.serve.schema import Limits

Kind = tuple[SearchOptions, tuple[int, ...], bool]  # options, source prefix, constrained

# Lines join a running search once JOIN_SHARE of the lines in it wait (1/8), or once the
# oldest has waited JOIN_STEPS steps: joining copies the pool's caches and encodes the
# newcomers, which a handful of lines at a time repeats for little (measured: 0.70x the batch
# path's sentences/s joining at every step, 0.78x this way, 64 lines in flight, beam 5).
JOIN_SHARE = 8
JOIN_STEPS = 4
SAMPLING_THREAD = "attnmt-sampling"


@dataclass(eq=False)
class _Job:
    prepared: Prepared  # the request's lines, checked and ready to search
    future: Future = field(default_factory=Future)
    found: dict[int, list[Translation]] = field(default_factory=dict)  # by line
    added: int = 0  # its first lines handed to a pool
    cancelled: bool = False  # its client left: no more work for it
    since: int = -1  # the scheduler's step count when it was taken from the queue

    @property
    def lines(self) -> list[str]:
        return self.prepared.lines

    def kind(self, i: int) -> Kind:
        """Line i's pool: its request's options and prefix, and whether it has phrases."""
        phrases = self.prepared.phrases
        return (*self.prepared.kind, phrases is not None and bool(phrases[i]))


class Scheduler:
    """The queue of requests and the search thread that steps their lines (module docstring)."""

    def __init__(self, translator: Translator, limits: Limits, thread: bool = True) -> None:
        """thread: search in a thread of its own, started now; False: the caller runs it
        (`attnmt serve` searches in the main thread: see run)."""
        self.translator, self.limits = translator, limits
        self.jobs: queue.Queue[_Job] = queue.Queue(maxsize=limits.max_queue)
        self.steps = 0  # pool steps run (for /health: the search at work)
        self.pools: dict[Kind, LinePool] = {}
        self.owner: dict[tuple[Kind, int], tuple[_Job, int]] = {}  # a pool's line: whose
        self.waiting: list[_Job] = []  # requests with lines not yet in a pool
        self.chars = 0  # characters of the lines in the pools
        # Sampled requests, searched one at a time beside the steps (module docstring), in a
        # daemon thread: a server stopped by a signal does not wait for one.
        self.sampled: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._sample, name=SAMPLING_THREAD, daemon=True).start()
        if thread:
            threading.Thread(target=self.run, name="attnmt-search", daemon=True).start()

    def submit(self, prepared: Prepared) -> _Job:
        """Queue a request's prepared lines (queue.Full when the queue is full)."""
        job = _Job(prepared)
        self.jobs.put_nowait(job)
        return job

    @property
    def queued(self) -> int:
        """Requests not yet all in a pool."""
        return self.jobs.qsize() + len(self.waiting)

    @property
    def searching(self) -> int:
        """Lines in the pools."""
        return sum(len(p) for p in self.pools.values())

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Search until `alive()` is false (checked at least every second). In the process's
        main thread the search is about twice as fast: torch's OpenMP team of the main
        thread is the one whose threads wait spinning; a second thread's team is woken for
        every operation (measured: one beam-5 sentence 42 ms in the main thread, 100 ms in
        another)."""
        while alive():
            if not self._take():
                continue
            self._admit()
            for kind, pool in list(self.pools.items()):
                if len(pool):
                    self._step(kind, pool)
                else:  # kinds come and go with requests' options: keep only those in use
                    del self.pools[kind]

    def _take(self) -> bool:
        """Move the requests that have arrived to `waiting`; when there is nothing to do,
        wait for one (a second at most: False if none came), then batch_wait_ms for others
        to share the first step."""
        deadline = time.monotonic()
        if not self.waiting and not self.searching:
            try:
                self.waiting.append(self.jobs.get(timeout=1.0))
            except queue.Empty:
                return False
            deadline += self.limits.batch_wait_ms / 1000
        while len(self.waiting) < self.limits.max_queue:
            try:
                self.waiting.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        for job in self.waiting:
            job.since = self.steps if job.since < 0 else job.since
        for job in [j for j in self.waiting if isinstance(j.prepared.options.method, Sampling)]:
            if not job.cancelled and job.added == 0:
                job.added = len(job.lines)  # none for the pools
                self.sampled.put(job)
        self.waiting = [
            j for j in self.waiting
            if not j.cancelled and not j.future.done() and j.added < len(j.lines)
        ]  # fmt: skip
        return True

    def _sample(self) -> None:
        """The sampling thread: search each sampled request alone, as they come."""
        while True:
            job = self.sampled.get()
            if not job.cancelled:
                self._alone(job)

    def _admit(self) -> None:
        """Hand waiting lines to their pools: one line of each request in turn, oldest
        first, while the pools hold fewer than batch_lines lines and batch_chars characters
        (at least one line when they are empty)."""
        limits = self.limits
        lines, taken = self.searching, 0
        if not self.waiting:
            return
        waiting = sum(len(j.lines) - j.added for j in self.waiting)
        if (
            lines
            and waiting < lines / JOIN_SHARE
            and self.steps - self.waiting[0].since < JOIN_STEPS
        ):
            return  # too few to be worth a join yet
        parts: dict[Kind, list[tuple[_Job, int]]] = {}
        while True:
            before = taken
            for job in (j for j in self.waiting if j.added < len(j.lines)):
                n = len(job.lines[job.added])
                if (lines or taken) and (
                    lines + taken >= limits.batch_lines or self.chars + n > limits.batch_chars
                ):
                    break
                parts.setdefault(job.kind(job.added), []).append((job, job.added))
                job.added, taken, self.chars = job.added + 1, taken + 1, self.chars + n
            if taken == before:
                break
        self.waiting = [j for j in self.waiting if j.added < len(j.lines)]
        for kind, items in parts.items():
            pool = self.pools.get(kind)
            if pool is None:
                pool = self.pools[kind] = self.translator.pool(kind[0], kind[1], kind[2])
            part = Prepared.join([job.prepared.part(i, i + 1) for job, i in items])
            try:
                keys = pool.add(part.lines, part.target_prefix, part.phrases)
            except Exception:  # the pool is in doubt: its requests again, each alone
                self.chars -= sum(len(job.lines[i]) for job, i in items)
                self._fail(kind, [job for job, _ in items])
                continue
            for key, (job, i) in zip(keys, items, strict=True):
                self.owner[kind, key] = (job, i)

    def _step(self, kind: Kind, pool: LinePool) -> None:
        """One step of a pool; the lines it finishes are their requests'."""
        try:
            done = pool.step()
        except Exception:
            self._fail(kind)
            return
        self.steps += 1
        for key, found in done.items():
            job, i = self.owner.pop((kind, key))
            self.chars -= len(job.lines[i])
            if job.future.done():
                continue  # answered already (searched alone after a failure)
            job.found[i] = found
            if len(job.found) == len(job.lines):
                self._finish(job, [job.found[n] for n in range(len(job.lines))])

    def _fail(self, kind: Kind, also: tuple[_Job, ...] | list[_Job] = ()) -> None:
        """A pool failed: forget it and search each of its requests alone."""
        self.pools.pop(kind, None)
        jobs = list(also)
        for (k, key), (job, i) in list(self.owner.items()):
            if k == kind:
                del self.owner[k, key]
                self.chars -= len(job.lines[i])
                jobs.append(job)
        for job in dict.fromkeys(jobs):
            if not job.future.done():
                self._alone(job)

    def _alone(self, job: _Job) -> None:
        """Search a request by itself, all its lines as one batch (the batch path)."""
        job.added = len(job.lines)
        try:
            found = self.translator.decode(job.prepared)
        except Exception as e:  # the server answers 500 and keeps serving
            job.future.set_exception(e)
            return
        self._finish(job, found)

    @staticmethod
    def _finish(job: _Job, found: list[list[Translation]]) -> None:
        """Answer a request: its lines' results with their terms and tags put back."""
        try:
            job.future.set_result(job.prepared.finish(found))
        except Exception as e:  # its own tags, say: its own failure
            job.future.set_exception(e)
