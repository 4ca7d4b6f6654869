"""Search workers kept between calls: forked once for a model, they take each call's work by
pickle, with the model (and whatever else the caller keeps) sent by reference to the copy the
fork gave them.

Forking two workers costs 50-70 ms a call (measured on the 3 + 1 student, whose 500 sentences
take 0.33 s); a translator called again and again (the Python API, a benchmark's runs) paid it
every time, where CTranslate2's worker threads live as long as its translator. The workers are
kept for the objects they were forked with while those live and are not changed in place
(`version`), and forked again otherwise; one set at a time, process-wide.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, TypeVar

from attnmt.data.processes import answer, hand_out, worker_setup

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()  # one call at a time uses the kept workers; others fork their own
_kept: KeptWorkers | None = None


class KeptWorkers:
    """`workers` forked processes holding `kept` (by memory, from the fork) between calls."""

    def __init__(self, kept: tuple[Any, ...], version: Hashable, workers: int) -> None:
        self.refs = tuple(weakref.ref(o) for o in kept)
        self.version, self.workers = version, workers
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        context, parent = multiprocessing.get_context("fork"), os.getpid()
        for _ in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(kept, theirs, parent))
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)

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
                conn.send(_NEXT_CALL)
            done = True
        finally:
            if not done:
                self.close()

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()
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
    global _kept
    if not _lock.acquire(blocking=False):
        return None
    try:
        if _kept is not None and not _kept.fits(kept, version, workers):
            _kept.close()
            _kept = None
        if _kept is None:
            _kept = KeptWorkers(kept, version, workers)
            weakref.finalize(kept[0], _forget, _kept)
        return list(_kept.imap(work, items, died))
    finally:
        _lock.release()


def release() -> None:
    """End the kept workers, if any (the interpreter exits; or to free their memory)."""
    global _kept
    with _lock:
        if _kept is not None:
            _kept.close()
            _kept = None


def _forget(workers: KeptWorkers) -> None:
    """The model `workers` kept is gone: end them now, or (a call is using the kept workers:
    a finalizer may run inside it) when the next call finds their objects gone."""
    global _kept
    if _lock.acquire(blocking=False):
        try:
            if _kept is workers:
                _kept.close()
                _kept = None
        finally:
            _lock.release()


atexit.register(release)


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


_NEXT_CALL = None  # sent after a call's last item: the next message is the next call's work


def _serve(kept: tuple[Any, ...], conn: Any, parent: int) -> None:
    """A kept worker: each call's work (pickled, kept objects by reference), then its items,
    each answered until the parent kills it."""
    worker_setup(parent)
    while True:
        work = _loads(conn.recv_bytes(), kept)
        while (item := conn.recv()) is not _NEXT_CALL:
            conn.send_bytes(answer(work, item))
