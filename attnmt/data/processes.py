"""Processes, threads and signals: children that end with their parent, C++ work run in one
so that Ctrl-C is prompt, training's stop signals, and forked workers (search_workers: those
that decode several batches at once)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import connection
from typing import Any, TypeVar, cast

import torch

from attnmt.errors import AttnmtError

T = TypeVar("T")
R = TypeVar("R")


def die_with_parent(parent: int) -> None:
    """Have the kernel send this (child) process SIGKILL when its parent ends, however it ends
    (SIGTERM, kill -9): an orphan would run on and hold its caller's pipes open. Linux only;
    elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <sys/prctl.h>
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before prctl took effect
        os._exit(1)


class StopSignals:
    """SIGINT/SIGTERM/SIGHUP (a closed terminal): the first asks the loop to checkpoint and stop
    after the current step;
    a second one exits at once (every file on disk is already complete, writes are atomic)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_in_child(work: Callable[[], bytes]) -> bytes:
    """work() run in a forked child process; its bytes come back through a pipe.

    For C++ code that keeps Python's signal handlers from running until it returns, such as
    SentencePiece's trainer (Ctrl-C waited 18–27 s for it on a large corpus): the parent only
    waits on the pipe, so KeyboardInterrupt reaches it at once; it then kills the child and
    re-raises. An AttnmtError that work raises is raised again here. Without fork (not POSIX),
    work runs in this process.
    """
    if not hasattr(os, "fork") or sys.platform != "linux":
        return work()
    parent = os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
        die_with_parent(parent)
        try:
            reply = b"\0" + work()
        except AttnmtError as e:
            reply = b"\1" + pickle.dumps(e)
        except BaseException as e:
            reply = b"\2" + f"{type(e).__name__}: {e}".encode()
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(reply)
        os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as pipe:
            reply = pipe.read()
        os.waitpid(pid, 0)
    except BaseException:  # Ctrl-C included: the child's work is not worth waiting for
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    if reply[:1] == b"\0":
        return reply[1:]
    if reply[:1] == b"\1":
        raise pickle.loads(reply[1:])
    raise RuntimeError(f"child process failed: {reply[1:].decode(errors='replace') or 'died'}")


_END = object()


def imap_forked(work: Callable[[T], R], items: Iterable[T], workers: int, died: str) -> Iterator[R]:
    """work(item) for each item, in order, computed in `workers` forked processes (Linux);
    `died`: the error's message if one of them is killed.

    The workers get `work` by memory (a model or a tokenizer is never pickled); items go to
    them one at a time through a pipe each, results come back pickled (hand_out). Any
    exception, Ctrl-C included, or closing the iterator ends the workers at once: they hold
    nothing worth waiting for.
    """
    conns: list[Any] = []
    processes: list[Any] = []
    try:
        fork_workers(_worker, (work,), workers, conns, processes)
        yield from hand_out(conns, items, died)
    finally:
        end_workers(processes)


def fork_workers(
    target: Callable[..., None], args: tuple, workers: int, conns: list, processes: list
) -> None:
    """Fork `workers` processes running target(*args, their end of a pipe, our pid); our ends
    go to `conns` and the processes to `processes` as each starts (if a fork fails, the caller
    ends those started: end_workers)."""
    context, parent = multiprocessing.get_context("fork"), os.getpid()
    for _ in range(workers):
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(*args, theirs, parent))
        process.start()
        theirs.close()
        processes.append(process)
        conns.append(ours)


def end_workers(processes: list[Any]) -> None:
    """Kill forked workers and reap them: they hold nothing worth waiting for."""
    for process in processes:
        process.kill()
        process.join()


def hand_out(conns: list[Any], items: Iterable[T], died: str) -> Iterator[R]:
    """Send the items to the workers at the other ends of `conns`, one at a time each as they
    free up, and yield their results in the items' order. Items are taken from the iterable
    as workers free up, and at most 2 * workers finished results wait for an earlier one, so
    memory stays bounded over a stream."""
    source, idle = iter(items), list(conns)
    busy: dict[Any, int] = {}  # our end of a worker's pipe -> the number of its item
    finished: dict[int, R] = {}  # results that wait for an earlier one
    sent, given, exhausted = 0, 0, False
    while True:
        # Hand back what is in order first: with the buffer full, sending nothing and then
        # emptying it would leave no worker busy before the items ran out.
        while given in finished:
            yield finished.pop(given)
            given += 1
        while idle and not exhausted and len(finished) < 2 * len(conns):
            item = next(source, _END)
            exhausted = item is _END
            if not exhausted:
                conn = idle.pop()
                conn.send(item)
                busy[conn], sent = sent, sent + 1
        if not busy:
            return
        for conn in connection.wait(list(busy)):
            finished[busy.pop(conn)] = _result(cast(connection.Connection, conn), died)
            idle.append(conn)


def _result(conn: connection.Connection, died: str) -> Any:
    """A forked worker's result for the item it was sent: raised again if it raised."""
    try:
        ok, payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        raise AttnmtError(died) from None
    if not ok:
        raise payload
    return payload


def worker_setup(parent: int) -> None:
    """A forked worker's start: it dies with its parent, has one intra-op thread, leaves Ctrl-C
    to the parent and keeps the memory it frees."""
    die_with_parent(parent)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()


def answer(work: Callable[[T], R], item: T) -> bytes:
    """work(item) as a worker sends it back: pickled (True, result), or (False, the error)."""
    try:
        reply = (True, work(item))
    except AttnmtError as e:
        reply = (False, e)
    except Exception as e:
        reply = (False, RuntimeError(f"worker process: {type(e).__name__}: {e}"))
    # Plain pickle, not multiprocessing's: that one would send tensors as shared-memory file
    # descriptors, one per attention map.
    return pickle.dumps(reply)


def _worker(work: Callable[[T], R], conn: Any, parent: int) -> None:
    """A forked worker: works on each item it is sent until the parent kills it."""
    worker_setup(parent)
    while True:
        conn.send_bytes(answer(work, conn.recv()))


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse in this process, not return it to the OS.

    A search step frees and allocates blocks of a few hundred KiB to a few MiB. By default
    glibc hands blocks that large back to the OS (mmap/munmap, heap trimming), and every reuse
    faults its pages in again: R beam 5 in 2 forked workers took about 620k page faults and 1.7 s
    of system time for 1,000 sentences, about 70k and 0.2 s with these settings; the T beam 5 in
    one process, 2 threads, 500 sentences: 134 → 170 sentences/s, 440k page faults a run → 0
    (docs/benchmarks.md). Set by search workers and by a Translator decoding on the CPU (the
    process keeps its peak of freed memory, up to 1 GiB); not by training (no gain there).
    """
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only; musl's mallopt does nothing
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)  # blocks up to 32 MiB from the heap
    libc.mallopt(m_trim_threshold, 1 << 30)  # keep up to 1 GiB free at the heap's top
