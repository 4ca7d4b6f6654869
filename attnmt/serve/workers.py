"""`attnmt serve --workers N` on a CPU: N forked search processes, each with one intra-op
thread and a step-level scheduler of its own (attnmt.serve.scheduler), fed by the HTTP
process.

Why: a decoding step's small products keep one core busy each better than two cores
together (translate --workers, CTranslate2's inter_threads), and a server's HTTP thread that
takes a core from one of a search's two OpenMP threads stalls both at the next barrier; a
worker with one thread only waits for its own core. The HTTP process prepares each request
(checks, pieces, terms) and hands it whole to the worker with the fewest lines in its hands;
the worker's pool takes its lines at the next step and sends the request's results back as
soon as its last line is done. A client that leaves cancels its request in the worker too.

The workers are forked from the process that loaded the model (its weights shared, not
copied), before the HTTP thread starts; they die with it. A worker that dies (killed, out of
memory) fails the requests it held (500) and the others serve on; with none left the server
ends.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing.connection
import os
import pickle
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from attnmt.data.processes import end_workers, fork_workers, worker_setup
from attnmt.decoding.request import Prepared
from attnmt.decoding.translator import Translator
from attnmt.device import ThreadFit
from attnmt.errors import AttnmtError
from attnmt.serve.scheduler import Scheduler
from attnmt.serve.schema import Limits

WORKER_DIED = "the search worker process ended unexpectedly (killed, or out of memory?)"


class _Remote:
    """A request in a worker's hands, as the HTTP side sees it (Scheduler's _Job: a future,
    and `cancelled`, which here tells the worker)."""

    def __init__(self, owner: ForkedScheduler, worker: int, key: int, lines: int) -> None:
        self.owner, self.worker, self.key, self.lines = owner, worker, key, lines
        self.future: Future = Future()
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        if value and not self._cancelled and not self.future.done():
            self.owner.cancel(self)
        self._cancelled = value


class ForkedScheduler:
    """Scheduler's interface (submit, run, queued, searching, steps) over forked workers."""

    def __init__(self, translator: Translator, limits: Limits, workers: int) -> None:
        self.limits = limits
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        try:
            fork_workers(_serve, (translator, limits), workers, self.conns, self.processes)
        except BaseException:
            end_workers(self.processes)
            raise
        self.sending = [threading.Lock() for _ in self.conns]  # one writer per pipe at a time
        self.lock = threading.Lock()  # the tables below: the HTTP thread and run's
        self.held: dict[int, _Remote] = {}  # requests in the workers' hands, by key
        self.lines = [0] * workers  # lines each worker holds
        self.alive = [True] * workers
        self.reported = [(0, 0, 0)] * workers  # each worker's last (queued, searching, steps)
        self.keys = itertools.count()

    @property
    def queued(self) -> int:
        """Requests waiting in the workers, as of their last answers."""
        return sum(r[0] for r in self.reported)

    @property
    def searching(self) -> int:
        """Lines in the workers' pools, as of their last answers."""
        return sum(r[1] for r in self.reported)

    @property
    def steps(self) -> int:
        """Pool steps the workers have run, as of their last answers."""
        return sum(r[2] for r in self.reported)

    def submit(self, prepared: Prepared) -> _Remote:
        """Hand a request to the live worker with the fewest lines (queue.Full when the
        workers hold max_queue requests)."""
        with self.lock:
            live = [w for w, up in enumerate(self.alive) if up]
            if len(self.held) >= self.limits.max_queue or not live:
                raise queue.Full
            worker = min(live, key=self.lines.__getitem__)
            job = _Remote(self, worker, next(self.keys), len(prepared))
            self.held[job.key] = job
            self.lines[worker] += job.lines
        self.send(worker, ("job", job.key, prepared))
        return job

    def cancel(self, job: _Remote) -> None:
        """The client has gone: the worker drops what is left of its request, which no
        longer counts here (an answer already on its way is ignored)."""
        with self.lock:
            if self.held.pop(job.key, None) is not None:
                self.lines[job.worker] -= job.lines
        self.send(job.worker, ("cancel", job.key, None))

    def send(self, worker: int, message: tuple) -> None:
        """A message to a worker (one pickle; a dead worker's pipe: ignored, run fails its
        requests)."""
        data = pickle.dumps(message)
        with self.sending[worker], contextlib.suppress(OSError):
            self.conns[worker].send_bytes(data)

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Answer the requests as their workers send results, until `alive()` is false
        (checked at least every second) or no worker is left."""
        while alive() and any(self.alive):
            conns = [c for c, up in zip(self.conns, self.alive, strict=True) if up]
            for conn in multiprocessing.connection.wait(conns, timeout=1.0):
                worker = self.conns.index(conn)
                try:
                    key, ok, value, reported = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._died(worker)
                    continue
                with self.lock:
                    self.reported[worker] = reported
                    job = self.held.pop(key, None)
                    if job is not None:
                        self.lines[worker] -= job.lines
                if job is not None:
                    (job.future.set_result if ok else job.future.set_exception)(value)
        if not any(self.alive):
            print("attnmt: every search worker has ended", file=sys.stderr, flush=True)

    def _died(self, worker: int) -> None:
        """A worker ended: its requests fail, the others go on."""
        with self.lock:
            self.alive[worker] = False
            lost = [job for job in self.held.values() if job.worker == worker]
            for job in lost:
                del self.held[job.key]
            self.lines[worker], self.reported[worker] = 0, (0, 0, self.reported[worker][2])
        for job in lost:
            job.future.set_exception(RuntimeError(WORKER_DIED))


def _serve(translator: Translator, limits: Limits, conn: Any, parent: int) -> None:
    """A worker: a Scheduler searching in this process's main thread, one intra-op thread,
    fed by a thread reading the HTTP process's messages (the HTTP side counts the queue)."""
    worker_setup(parent)
    # One thread (a forked process may not start OpenMP's), its batches searched here.
    translator.workers, translator.threads = 1, ThreadFit(1, 1)
    scheduler = Scheduler(translator, replace(limits, max_queue=1 << 20), thread=False)
    sending, jobs = threading.Lock(), {}

    def reply(key: int, future: Future) -> None:
        jobs.pop(key, None)
        state = (scheduler.queued, scheduler.searching, scheduler.steps)
        try:
            data = pickle.dumps((key, True, future.result(), state))
        except AttnmtError as e:
            data = pickle.dumps((key, False, e, state))
        except Exception as e:  # an exception (or a result) may not pickle: its text does
            data = pickle.dumps((key, False, RuntimeError(f"{type(e).__name__}: {e}"), state))
        with sending:
            conn.send_bytes(data)

    def read() -> None:
        while True:
            try:
                kind, key, prepared = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the HTTP process has gone
                os._exit(0)
            if kind == "cancel":
                if (job := jobs.pop(key, None)) is not None:
                    job.cancelled = True
                continue
            jobs[key] = job = scheduler.submit(prepared)
            job.future.add_done_callback(lambda future, key=key: reply(key, future))

    threading.Thread(target=read, name="attnmt-requests", daemon=True).start()
    scheduler.run()
