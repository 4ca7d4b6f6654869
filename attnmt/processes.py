"""Child processes that end with their parent, and C++ work run in one so that Ctrl-C is prompt."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from collections.abc import Callable

from attnmt.errors import AttnmtError


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
