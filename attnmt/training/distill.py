"""Sequence-level knowledge distillation (Kim & Rush 2016, https://arxiv.org/abs/1606.07947):
a teacher (one model or an ensemble) translates the source side of a training corpus with beam
search, and a student trains on the source paired with the teacher's translations. With
sampling, the same translates monolingual target-language text with a target-to-source model
for back-translation (sampled translations: Edunov et al. 2018, https://arxiv.org/abs/1808.09381),
whose pairs train as a synthetic corpus (data.train's `synthetic`, tagged <BT>).

    attnmt distill --teacher runs/teacher --src train.de.gz --output train.distilled.en

The source is translated in chunks of `chunk_lines` lines, fixed from the start of the file.
After each chunk its translations are appended to OUTPUT.partial and synced, then the progress
file OUTPUT.distill.json records the lines and bytes done (written atomically). Whatever kills
the command, re-running it truncates OUTPUT.partial to the recorded bytes and continues at the
recorded line; the chunks are the same, so the output ends byte-identical to an uninterrupted
run. OUTPUT exists only when every line is done (OUTPUT.partial renamed to it), and only with
exactly as many lines as the source.

The progress file is sealed, as the training state is: it records the SHA-256 of
OUTPUT.partial's first `bytes` bytes and a checksum over itself, so an edited or damaged one is
refused in one line instead of resuming at the wrong place. OUTPUT.distill.lock keeps a second
`attnmt distill` off the same output while one runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attnmt.data.files import WriteError, atomic_write_bytes, fsync_dir, reason
from attnmt.data.text import check_input, input_chunks, open_input
from attnmt.decoding.translator import Translator
from attnmt.errors import AttnmtError, DataError
from attnmt.models.directory import resolve_weights

CHUNK_LINES = 2048  # lines translated, then made durable, at a time


@dataclass
class Distilled:
    lines: int  # lines in the output
    translated: int  # lines this call translated (the rest were done by an earlier one)
    seconds: float


def partial_path(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + ".distill.json")


# The teacher's beam where none is given (Kim & Rush 2016 distil with beam search).
DEFAULT_BEAM = 5


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".distill.lock")


def distill(
    translator: Translator,
    teachers: list[Path],
    weights: str,
    src: Path,
    output: Path,
    beam: int | None = None,
    target_lang: str | None = None,
    chunk_lines: int = CHUNK_LINES,
    force: bool = False,
    progress: bool = True,
    sampling: tuple[float, int, int] | None = None,
) -> Distilled:
    """Translate every line of `src` (a file, plain or .gz) with the teacher into `output`, one
    line per source line, continuing an interrupted run of the same job (see the module).
    `sampling`: (temperature, top_k, seed) to draw each translation instead of a beam search
    (back-translation: Edunov et al. 2018); the draws follow the lines' places, so a resumed
    run draws what an uninterrupted one does; a beam with it is refused, as translate does.
    The beam: DEFAULT_BEAM unless given."""
    translator.options(beam=beam, sampling=sampling)  # a beam with sampling: one line
    beam = DEFAULT_BEAM if beam is None else beam  # (a sampling job records it too: resumable)
    check_input(src)
    if not src.is_file():
        raise DataError(f"--src {src}: a regular file is needed to resume (not a pipe)")
    job = _job(translator, teachers, weights, src, beam, target_lang, chunk_lines)
    job["sampling"] = list(sampling) if sampling is not None else None
    with _locked(output):
        return _distill(translator, src, output, job, force, progress)


def _distill(
    translator: Translator,
    src: Path,
    output: Path,
    job: dict[str, Any],
    force: bool,
    progress: bool,
) -> Distilled:
    """distill's work, under the output's lock."""
    chunk_lines, target_lang = job["chunk_lines"], job["target_lang"]
    state, digest = _resume_state(output, job, force)
    draws = job["sampling"]
    if draws is None:
        options = translator.options(beam=job["beam"])
    else:
        options = translator.options(sampling=(draws[0], draws[1], draws[2]))
    start, translated = time.time(), 0
    bar = tqdm(
        total=state["total"], initial=state["lines"], unit=" lines", desc="distill",
        disable=not progress or None, file=sys.stderr, dynamic_ncols=True,
    )  # fmt: skip
    partial = partial_path(output)
    with bar, open(partial, "r+b" if partial.exists() else "wb") as out:
        out.truncate(state["bytes"])  # drop what was written after the last recorded chunk
        out.seek(state["bytes"])
        for number, chunk in enumerate(input_chunks(src, chunk_lines)):
            if number < state["lines"] // chunk_lines:
                continue  # done by an earlier run
            first = number * chunk_lines  # sampling's seeds: the lines' places
            found = translator.search(chunk, options, target_lang=target_lang, first_line=first)
            # A translation is one line: a newline inside one would shift every later line.
            data = "".join(r[0].text.replace("\n", " ") + "\n" for r in found).encode("utf-8")
            _append(out, data, partial)
            digest.update(data)
            state["lines"] += len(chunk)
            state["bytes"] += len(data)
            state["sha256"] = digest.hexdigest()
            save_progress(progress_path(output), state)
            translated += len(chunk)
            bar.update(len(chunk))
    if state["lines"] != state["total"]:
        raise DataError(
            f"{partial}: {state['lines']:,} lines for {state['total']:,} source lines ({src} "
            "changed while it was read?); kept unfinished"
        )
    os.replace(partial, output)
    fsync_dir(output.parent if str(output.parent) else Path("."))
    progress_path(output).unlink(missing_ok=True)
    return Distilled(state["lines"], translated, time.time() - start)


def corpus_entry(src: Path, output: Path, synthetic: bool) -> str:
    """The data.train entry (YAML) that trains on a finished output: for distillation the
    source with its translations; for back-translation (a target-to-source teacher, sampled)
    the translations as synthetic sources of the monolingual text."""
    if synthetic:
        return f"  - {{src: {output}, tgt: {src}, synthetic: true}}"
    return f"  - {{src: {src}, tgt: {output}}}"


def _job(
    translator: Translator,
    teachers: list[Path],
    weights: str,
    src: Path,
    beam: int,
    target_lang: str | None,
    chunk_lines: int,
) -> dict[str, Any]:
    """What decides the output: a run continues another only if all of it is the same (files
    by path, size and modification time)."""
    files = [src, *(resolve_weights(t, weights) for t in teachers)]
    return {
        "src": str(src.resolve()),
        "teachers": [str(t.resolve()) for t in teachers],
        "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "beam": beam,
        "target_lang": target_lang,
        "chunk_lines": chunk_lines,
        "precision": translator.precision,
    }


def _resume_state(output: Path, job: dict[str, Any], force: bool) -> tuple[dict[str, Any], Any]:
    """The progress of an earlier run of this job (its lines and bytes done) and the running
    SHA-256 of the partial output, or a fresh start; a finished output, an interrupted run of
    another job, or a progress file that does not match itself and the partial output is
    refused unless `force`."""
    progress, partial = progress_path(output), partial_path(output)
    if output.exists() and not force:
        raise WriteError(f"--output {output}: exists (a finished distillation?); --force redoes it")
    if progress.exists() and not force:
        state = _read_state(progress)
        changed = sorted(k for k in job if state["job"].get(k) != job[k])
        if changed:
            raise AttnmtError(
                f"{progress}: an interrupted distillation with other settings ({', '.join(changed)}"
                " differ); run it with its settings, or --force to start over"
            )
        return state, _check_partial(partial, state, progress)
    progress.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    digest = hashlib.sha256()
    total = _count_lines(Path(job["src"]))
    state = {"job": job, "lines": 0, "bytes": 0, "total": total, "sha256": digest.hexdigest()}
    save_progress(progress, state)
    return state, digest


def _seal(state: dict[str, Any]) -> str:
    body = {k: v for k, v in state.items() if k != "seal"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_progress(path: Path, state: dict[str, Any]) -> None:
    state["seal"] = _seal(state)
    atomic_write_bytes(path, json.dumps(state).encode())


def _read_state(progress: Path) -> dict[str, Any]:
    """The progress file, its fields checked and its seal verified; DataError otherwise."""
    fix = "remove it, or pass --force, to start over"
    try:
        state = json.loads(progress.read_text(encoding="utf-8"))
        fields = [state[k] for k in ("lines", "bytes", "total")]
        ok = isinstance(state["job"], dict) and isinstance(state["sha256"], str)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise DataError(f"{progress}: unreadable ({reason(e)}); {fix}") from None
    if not ok or not all(type(v) is int and v >= 0 for v in fields):
        raise DataError(f"{progress}: lines, bytes and total must be counts; {fix}")
    if state.get("seal") != _seal(state) or state["lines"] > state["total"]:
        raise DataError(f"{progress}: does not match its own checksum (edited or damaged); {fix}")
    return state


def _check_partial(partial: Path, state: dict[str, Any], progress: Path) -> Any:
    """The running SHA-256 of partial's first state["bytes"] bytes, which must be what the
    progress file records and hold state["lines"] lines; DataError otherwise."""
    digest, lines, left = hashlib.sha256(), 0, state["bytes"]
    try:
        with open(partial, "rb") as f:
            while left and (block := f.read(min(left, 1 << 20))):
                digest.update(block)
                lines += block.count(b"\n")
                left -= len(block)
    except OSError as e:
        raise DataError(f"{partial}: unreadable ({reason(e)})") from None
    if left or digest.hexdigest() != state["sha256"] or lines != state["lines"]:
        raise DataError(
            f"{partial}: not what {progress.name} records (changed or cut since); remove both, "
            "or pass --force, to start over"
        )
    return digest


class _locked:
    """OUTPUT.distill.lock, held while a distillation writes OUTPUT: a second one is refused
    in one line (the OS releases the lock when the holder ends, however it ends)."""

    def __init__(self, output: Path) -> None:
        self.path = lock_path(output)

    def __enter__(self) -> None:
        try:
            self.file = open(self.path, "a+")
        except OSError as e:
            raise WriteError(f"{self.path}: cannot write ({reason(e)})") from None
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise AttnmtError(
                f"--output {self.path.name.removesuffix('.distill.lock')}: another attnmt distill "
                "is writing it; wait for it to end or stop it first"
            ) from None

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)  # still held: no other run can have taken it
        self.file.close()


def _count_lines(src: Path) -> int:
    """The lines of src (a last line without a newline counts), for the progress bar."""
    count, last = 0, b"\n"
    with open_input(src) as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def _append(out: Any, data: bytes, path: Path) -> None:
    """Write data at the file's position and make it durable, or raise WriteError."""
    try:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    except OSError as e:
        raise WriteError(f"{path}: cannot write ({reason(e)})") from None
