"""Sequence-level knowledge distillation (Kim & Rush 2016, https://arxiv.org/abs/1606.07947):
a teacher (one model or an ensemble) translates the source side of a training corpus with beam
search, and a student trains on the source paired with the teacher's translations.

    attnmt distill --teacher runs/teacher --src train.de.gz --output train.distilled.en

The source is translated in chunks of `chunk_lines` lines, fixed from the start of the file.
After each chunk its translations are appended to OUTPUT.partial and synced, then the progress
file OUTPUT.distill.json records the lines and bytes done (written atomically). Whatever kills
the command, re-running it truncates OUTPUT.partial to the recorded bytes and continues at the
recorded line; the chunks are the same, so the output ends byte-identical to an uninterrupted
run. OUTPUT exists only when every line is done (OUTPUT.partial renamed to it).
"""

from __future__ import annotations

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


def distill(
    translator: Translator,
    teachers: list[Path],
    weights: str,
    src: Path,
    output: Path,
    beam: int = 5,
    target_lang: str | None = None,
    chunk_lines: int = CHUNK_LINES,
    force: bool = False,
    progress: bool = True,
) -> Distilled:
    """Translate every line of `src` (a file, plain or .gz) with the teacher into `output`, one
    line per source line, continuing an interrupted run of the same job (see the module)."""
    check_input(src)
    if not src.is_file():
        raise DataError(f"--src {src}: a regular file is needed to resume (not a pipe)")
    job = _job(translator, teachers, weights, src, beam, target_lang, chunk_lines)
    state = _resume_state(output, job, force)
    options = translator.options(beam=beam)
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
            found = translator.search(chunk, options, target_lang=target_lang)
            data = "".join(r[0].text + "\n" for r in found).encode("utf-8")
            _append(out, data, partial)
            state["lines"] += len(chunk)
            state["bytes"] += len(data)
            atomic_write_bytes(progress_path(output), json.dumps(state).encode())
            translated += len(chunk)
            bar.update(len(chunk))
    os.replace(partial, output)
    fsync_dir(output.parent if str(output.parent) else Path("."))
    progress_path(output).unlink(missing_ok=True)
    return Distilled(state["lines"], translated, time.time() - start)


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


def _resume_state(output: Path, job: dict[str, Any], force: bool) -> dict[str, Any]:
    """The progress of an earlier run of this job (its lines and bytes done), or a fresh one;
    a finished output, or an interrupted run of another job, is refused unless `force`."""
    progress, partial = progress_path(output), partial_path(output)
    if output.exists() and not force:
        raise WriteError(f"--output {output}: exists (a finished distillation?); --force redoes it")
    if progress.exists() and not force:
        try:
            state = json.loads(progress.read_text(encoding="utf-8"))
            recorded = dict(state["job"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{progress}: unreadable ({reason(e)}); remove it to start over"
            ) from None
        changed = sorted(k for k in job if recorded.get(k) != job[k])
        if changed:
            raise AttnmtError(
                f"{progress}: an interrupted distillation with other settings ({', '.join(changed)}"
                " differ); run it with its settings, or --force to start over"
            )
        if not partial.exists() or partial.stat().st_size < state["bytes"]:
            raise DataError(f"{partial}: missing or shorter than {progress.name} records")
        return state
    progress.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    state = {"job": job, "lines": 0, "bytes": 0, "total": _count_lines(Path(job["src"]))}
    atomic_write_bytes(progress, json.dumps(state).encode())
    return state


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
