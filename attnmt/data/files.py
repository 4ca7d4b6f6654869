"""Writing files so that they are complete or absent, and every write error is reported.

A file is written to a temporary name in its own directory, fsynced, then renamed into place:
a crash, a kill -9 or a full disk never leaves a half-written file under the real name.
Standard output cannot be renamed; it is written with checked system calls (and fsynced
when it is a regular file, where a full disk may show only then), so that a short write is
an error, never a silent truncation.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from attnmt.errors import AttnmtError


class WriteError(AttnmtError):
    """A file or standard output could not be written (full disk, permissions, ...)."""


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_mode() -> int:
    """The mode a new file gets from open(): 0o666 less the umask (mkstemp's is 0o600, which
    would keep a model directory from being shared with a group)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def dir_mode() -> int:
    """The mode a new directory gets from mkdir(): 0o777 less the umask (mkdtemp's is 0o700)."""
    return file_mode() | (file_mode() & 0o444) >> 2  # x where r: 0o644 -> 0o755


def free_space(path: Path) -> str:
    """How much room is left on path's file system, for error messages."""
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


def reason(e: BaseException) -> str:
    """An exception as a message's short reason: an OSError's strerror, else its first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in blocks (a huge file costs time, never memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call write(tmp_path), fsync the file, rename it to path, fsync the directory.

    Any failure (the writer's, a full disk's) removes the temporary file, leaves a file
    already at path as it was, and raises WriteError naming path and the free space.
    """
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise WriteError(f"{path}: cannot write ({reason(e)})") from None
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, file_mode())  # after write: a writer may have replaced the file
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except Exception as e:  # the writer's own errors too (SafetensorError, torch's)
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, AttnmtError):
            raise
        raise WriteError(f"{path}: cannot write ({reason(e)}; {free_space(path.parent)})") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(out: Path, what: str) -> Iterator[Path]:
    """A temporary directory beside `out`, which replaces `out` (what was there removed) when
    the block succeeds, and is removed when it fails: `out` is whole or as it was. A write that
    fails (a full disk, RLIMIT_FSIZE) is a WriteError naming `out`, `what` and the free space."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))
    except OSError as e:
        raise WriteError(f"{out}: cannot write there ({e.strerror or e})") from None
    try:
        yield tmp
        os.chmod(tmp, dir_mode())
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as e:
        raise WriteError(f"{out}: cannot write {what} ({reason(e)}; {free_space(tmp)})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned(out: Path) -> None:
    """Remove the temporary directories of `out` left by a process that was killed (its pid,
    in the name, no longer runs): nothing else cleans them up."""
    for tmp in out.parent.glob(f".{glob.escape(out.name)}.*.*"):
        pid = tmp.name[len(out.name) + 2 :].split(".")[0]
        if tmp.is_dir() and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def check_output_path(path: Path, option: str) -> None:
    """Fail now, before any work, if `option`'s file could not be created at path (a device
    or FIFO that exists is written directly: see OutputSink)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise WriteError(f"{option} {path}: is a directory")
    if path.exists() and not path.is_file():
        if not os.access(path, os.W_OK):
            raise WriteError(f"{option} {path}: cannot write (permission denied)")
        return
    if not parent.is_dir():
        raise WriteError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WriteError(f"{option} {path}: cannot write in {parent} (permission denied)")


def check_export_path(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse, before any work, an output that would overwrite what it is made from (the
    model directory, a directory holding it, or one inside it: --force deletes `out`), or
    that is a file, or that exists without --force."""
    model, target = model_dir.resolve(), out.resolve()
    if target == model or model in target.parents or target in model.parents:
        raise AttnmtError(
            f"{out}: is, holds or is inside the model directory {model_dir}; export elsewhere"
        )
    if out.exists() and not out.is_dir():
        raise AttnmtError(f"{out}: exists and is not a directory")
    if out.is_symlink():  # --force would make the whole export, then fail to replace a link
        raise AttnmtError(
            f"{out}: is a symbolic link; export to the directory it names, "
            f"{os.path.realpath(out)}, or to a new path"
        )
    if out.exists() and not force:
        raise AttnmtError(f"{out} exists; pass --force to replace it")
    if any(p.exists() and not p.is_dir() for p in target.parents):
        raise AttnmtError(f"{out}: a parent of it is a file, not a directory")


def write_stdout(text: str) -> None:
    """Write text to standard output in full, or raise WriteError. A closed pipe (`| head`)
    ends the program quietly with status 141, as a shell tool killed by SIGPIPE does."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # replaced, as in tests
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    sys.stdout.flush()
    write_fd(fd, text, "standard output")


def write_fd(fd: int, text: str, name: str) -> None:
    """Write text to an open file descriptor in full (see write_stdout), or raise WriteError."""
    try:
        view = memoryview(text.encode("utf-8"))
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fsync(fd)  # a full disk may show only here
    except OSError as e:
        if e.errno == errno.EPIPE:
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)  # no second error at exit
            raise SystemExit(141) from None
        raise WriteError(f"cannot write to {name} ({reason(e)})") from None


class OutputSink:
    """Where translations go as they are ready: standard output (write_stdout), or a temporary
    file beside `path` that becomes `path` only when complete (deleted on a failure, so a
    reader never sees a partial file under the real name; after kill -9 only the hidden
    temporary file remains). A path that is not a regular file (a device, a FIFO, a link to
    either, such as /dev/stdout) is written directly, as standard output is; a link to a
    regular file is followed (the link stays)."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.tmp, self.file, self.direct = path, None, None, None
        if path is not None and path.exists() and not path.is_file():
            try:
                self.direct = os.open(path, os.O_WRONLY)
            except OSError as e:
                raise WriteError(f"{path}: cannot write ({reason(e)})") from None
            return
        if path is not None and path.is_symlink():
            self.path = path = path.resolve()
        if path is not None:
            try:
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            except OSError as e:
                raise WriteError(f"{path}: cannot write ({reason(e)})") from None
            self.tmp, self.file = Path(tmp), os.fdopen(fd, "wb")

    def write(self, text: str) -> None:
        if self.direct is not None:
            write_fd(self.direct, text, str(self.path))
            return
        if self.file is None:
            write_stdout(text)
            return
        try:
            self.file.write(text.encode("utf-8"))
        except OSError as e:
            raise WriteError(
                f"{self.path}: cannot write ({reason(e)}; {free_space(self.tmp.parent)})"
            ) from None

    def __enter__(self) -> OutputSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if self.direct is not None:
            os.close(self.direct)
        if self.file is None or self.tmp is None or self.path is None:
            return
        tmp, path = self.tmp, self.path
        try:
            if kind is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if kind is None:
                os.chmod(tmp, file_mode())
                os.replace(tmp, path)
                fsync_dir(path.parent)
        except OSError as e:
            raise WriteError(
                f"{path}: cannot write ({reason(e)}; {free_space(path.parent)})"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """The JSON objects of a JSON-lines file (a run's train_log.jsonl), with their line numbers.

    A last line cut short (a full disk or a kill while it was written: no newline at its end)
    is skipped with a warning on stderr; any other line that is not a JSON object, and a file
    that is not UTF-8, is an error naming file:line.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise AttnmtError(f"{path}: cannot read ({reason(e)})") from None
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # after the last newline: empty, or a cut line
    events = []
    for number, raw in enumerate([*lines, torn], 1):
        if not raw.strip():
            continue
        try:
            event = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            event = None
        if not isinstance(event, dict):
            if number == len(lines) + 1:
                print(
                    f"attnmt: warning: {path}:{number}: skipped a cut-off last line",
                    file=sys.stderr,
                )
                continue
            raise AttnmtError(f"{path}:{number}: not a JSON object (a log line of attnmt?)")
        events.append((number, event))
    return events
