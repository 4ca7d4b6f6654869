"""The workers that search several batches at once (map_batches): threads, or forked processes
kept between calls. Forked once for a model, they take each call's work by pickle, with the
model (and whatever else the caller keeps) sent by reference to the copy the fork gave them.

Forking two workers costs 50-70 ms a call (measured on the 3 + 1 student, whose 500 sentences
take 0.33 s); a translator called again and again (the Python API, a benchmark's runs) paid it
every time, where CTranslate2's worker threads live as long as its translator. The workers are
kept for the objects they were forked with while those live and are not changed in place
(`version`), and forked again otherwise; one set at a time, process-wide.
"""

from __future__ import annotations

import atexit
import io
import pickle
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from attnmt.data.processes import (
    answer,
    end_workers,
    fork_workers,
    hand_out,
    imap_forked,
    worker_setup,
)

T = TypeVar("T")
R = TypeVar("R")

SEARCH_WORKER_DIED = (
    "a search worker process ended unexpectedly (killed, or out of memory?); "
    "translate with --workers 1 or a smaller --batch-tokens"
)


class _Held:
    """The kept workers (one set, process-wide) and the lock of the call using them: one call
    at a time; another meanwhile forks its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: KeptWorkers | None = None


_held = _Held()


def map_batches(
    work: Callable[[T], R],
    items: Sequence[T],
    workers: int,
    device: torch.device | str,
    kept: tuple[Any, ...] = (),
    version: Hashable = None,
) -> list[R]:
    """work(item) for every item, in order; `workers` items at a time, each worker on its share
    of torch's intra-op threads (torch.get_num_threads() // workers, at least 1). `kept`: the
    objects in `work` that worker processes may keep between calls while `version` stays
    (KeptWorkers: the model), instead of being forked for this call alone.

    A decoding step's small matmuls and elementwise ops keep one core busy each better than two
    cores together (the idea of CTranslate2's inter_threads). Workers with one thread each are
    forked processes on Linux: as threads of one process they take turns at Python's GIL
    between every op, and a thread that the OS (or a hypervisor) pauses while holding it stalls
    the other too; processes run independently (T greedy on 2 cores, fresh process per run:
    175-268 against 90-158 sentences/s as threads). Forked, a worker may not start OpenMP
    threads (the parent's pool does not exist in the child, and GNU OpenMP hangs), so workers
    with more than one thread each, and other platforms or a GPU, stay threads.
    """
    if workers <= 1 or len(items) <= 1:
        return [work(item) for item in items]
    threads = max(1, torch.get_num_threads() // workers)
    if threads == 1 and sys.platform == "linux" and torch.device(device).type == "cpu":
        if kept:
            found = kept_map(work, list(items), workers, kept, version, SEARCH_WORKER_DIED)
            if found is not None:
                return found
        return list(imap_forked(work, items, workers, SEARCH_WORKER_DIED))
    with ThreadPoolExecutor(workers, "attnmt-search", torch.set_num_threads, (threads,)) as pool:
        return list(pool.map(work, items))


class KeptWorkers:
    """`workers` forked processes holding `kept` (by memory, from the fork) between calls."""

    def __init__(self, kept: tuple[Any, ...], version: Hashable, workers: int) -> None:
        self.refs = tuple(weakref.ref(o) for o in kept)
        self.version, self.workers = version, workers
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        try:
            fork_workers(_serve, (kept,), workers, self.conns, self.processes)
        except BaseException:
            self.close()
            raise

    def fits(self, kept: tuple[Any, ...], version: Hashable, workers: int) -> bool:
        """Whether these workers are alive, hold these very objects, unchanged, and are as
        many."""
        return (
            all(p.is_alive() for p in self.processes)
            and workers == self.workers
            and len(kept) == len(self.refs)
            and all(r() is o for r, o in zip(self.refs, kept, strict=True))
            and version == self.version
        )

    def imap(self, work: Callable[[T], R], items: Iterable[T], died: str) -> Iterator[R]:
        """work(item) for each item, in order, in the workers: `work` is sent to each once, the
        kept objects in it by reference. Workers left with work half done (an exception, Ctrl-C,
        the iterator closed early) are ended: the next call forks new ones."""
        payload = _dumps(work, self.refs)
        for conn in self.conns:
            conn.send_bytes(payload)
        done = False
        try:
            yield from hand_out(self.conns, items, died)
            for conn in self.conns:
                conn.send(_NextCall())
            done = True
        finally:
            if not done:
                self.close()

    def close(self) -> None:
        end_workers(self.processes)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []


def kept_map(
    work: Callable[[T], R],
    items: list[T],
    workers: int,
    kept: tuple[Any, ...],
    version: Hashable,
    died: str,
) -> list[R] | None:
    """work(item) for each item in the kept workers for `kept` at `version` (forked now if
    there are none, or they hold other objects); None when another call is using them."""
    if not _held.lock.acquire(blocking=False):
        return None
    try:
        if _held.workers is not None and not _held.workers.fits(kept, version, workers):
            _held.workers.close()
            _held.workers = None
        if _held.workers is None:
            _held.workers = KeptWorkers(kept, version, workers)
            weakref.finalize(kept[0], _forget, _held.workers)
        return list(_held.workers.imap(work, items, died))
    finally:
        _held.lock.release()


def release() -> None:
    """End the kept workers, if any (to free their memory; a call using them is waited for)."""
    with _held.lock:
        if _held.workers is not None:
            _held.workers.close()
            _held.workers = None


def _forget(workers: KeptWorkers) -> None:
    """The model `workers` kept is gone: end them now, or (a call is using the kept workers:
    a finalizer may run inside it) when the next call finds their objects gone."""
    if _held.lock.acquire(blocking=False):
        try:
            if _held.workers is workers:
                workers.close()
                _held.workers = None
        finally:
            _held.lock.release()


def _at_exit() -> None:
    """The interpreter exits: end the kept workers without waiting for the lock (a daemon
    thread may be in a call; the kernel would end them with this process anyway)."""
    workers, _held.workers = _held.workers, None
    if workers is not None:
        workers.close()


atexit.register(_at_exit)


def _dumps(work: Any, refs: tuple[weakref.ref, ...]) -> bytes:
    """`work` pickled with the kept objects as references (their places in `refs`)."""
    places = {id(r()): i for i, r in enumerate(refs)}
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda o: places.get(id(o))  # type: ignore[method-assign]
    pickler.dump(work)
    return buffer.getvalue()


def _loads(payload: bytes, kept: tuple[Any, ...]) -> Any:
    unpickler = pickle.Unpickler(io.BytesIO(payload))
    unpickler.persistent_load = lambda i: kept[i]  # type: ignore[method-assign]
    return unpickler.load()


class _NextCall:
    """Sent after a call's last item: the next message is the next call's work."""


def _serve(kept: tuple[Any, ...], conn: Any, parent: int) -> None:
    """A kept worker: each call's work (pickled, kept objects by reference), then its items,
    each answered until the parent kills it."""
    worker_setup(parent)
    while True:
        work = _loads(conn.recv_bytes(), kept)
        while not isinstance(item := conn.recv(), _NextCall):
            conn.send_bytes(answer(work, item))
