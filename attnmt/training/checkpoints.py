"""Training checkpoints: the output directory's lock and start-up checks, step checkpoints (weights
+ sealed resume state) saved atomically and found again, the best/last N kept, and averaging.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from attnmt import __version__
from attnmt.data.files import atomic_write, atomic_write_bytes, free_space, read_jsonl
from attnmt.errors import CheckpointError
from attnmt.models.directory import (
    AVERAGED_FILE,
    CKPT_DIR,
    LOG_JSONL,
    RUN_FILES,
    STEP_FILE,
    read_tensors,
    save_weights,
    write_tensors,
)
from attnmt.models.seq2seq import Seq2Seq
from attnmt.training.dev_metric import dev_score

LATEST = "latest.json"
STATE_FORMAT_VERSION = 2  # 2: sealed (sealed_state); 1 still loads


def kept_checkpoints(model_dir: Path) -> dict[int, Path]:
    """{step: weights file} of the checkpoints kept in model_dir/checkpoints."""
    found = {}
    for name in _names(model_dir / CKPT_DIR):
        m = STEP_FILE.match(name)
        if m and m.group(2) == "safetensors":
            found[int(m.group(1))] = model_dir / CKPT_DIR / name
    return found


def dev_scores(model_dir: Path) -> dict[int, float]:
    """{step: dev score} of the validations in train_log.jsonl, higher is better, of the
    metric each names (dev_metric.dev_score)."""
    scores = {}
    for number, event in read_jsonl(model_dir / LOG_JSONL):
        if event.get("event") == "validation":
            metric = event.get("metric", "bleu")
            values = [event.get(k) for k in ("dev_bleu", "dev_chrf", "dev_loss")]
            step = event.get("step")
            if not isinstance(step, int) or not all(
                isinstance(v, int | float | None) for v in values
            ):
                raise CheckpointError(
                    f"{model_dir / LOG_JSONL}:{number}: a validation event without a step or score"
                )
            if all(v is not None and math.isfinite(v) for v in values):
                scores[step] = dev_score(metric, *values)
    return scores


def first_averaged_step(kept: list[int], warmup_steps: int) -> int:
    """The first step that averaging takes (train.average_last and `attnmt average` alike):
    none from before the learning rate's peak (warmup) or from the run's first half, weights so
    far from the end that they cost BLEU (a short budget run lost 8.6 BLEU averaging them)."""
    return max(warmup_steps + 1, (max(kept) + 1) // 2 if kept else 0)


def average_checkpoints(
    model_dir: Path, n: int, by: str, min_step: int = 0
) -> tuple[Path, list[int]]:
    """Write model_dir/averaged.safetensors, the element-wise mean of n kept checkpoints (of
    steps from min_step on): the last n by step (by="last") or the n with the best dev score in
    train_log.jsonl (by="best": of the metric train.early_stopping named). Returns the file
    and the steps averaged."""
    kept = {s: p for s, p in kept_checkpoints(model_dir).items() if s >= min_step}
    if by == "best":
        scores = dev_scores(model_dir)
        steps = sorted((s for s in kept if s in scores), key=lambda s: (-scores[s], -s))[:n]
    else:
        steps = sorted(kept)[-n:]
    if len(steps) < n:
        raise CheckpointError(
            f"{model_dir}: {n} checkpoints asked for, {len(steps)} kept"
            + (" with a dev score" if by == "best" else "")
            + f" ({', '.join(f'step-{s}' for s in sorted(kept)) or 'none'}); raise train.keep_{by}"
        )
    first, aliases, tokenizer = read_tensors(kept[steps[0]])
    dtypes = {name: t.dtype for name, t in first.items()}
    total = {name: t.double() for name, t in first.items()}
    for step in steps[1:]:
        tensors, _, other = read_tensors(kept[step])
        if other != tokenizer:
            raise CheckpointError(
                f"{kept[step]}: trained with another tokenizer than {kept[steps[0]]}"
            )
        if tensors.keys() != total.keys():
            raise CheckpointError(f"{kept[step]}: other tensors than {kept[steps[0]]}")
        for name, t in tensors.items():
            total[name] += t.double()
    mean = {name: (t / len(steps)).to(dtypes[name]) for name, t in total.items()}
    path = model_dir / AVERAGED_FILE
    write_tensors(path, mean, aliases, tokenizer)
    return path, sorted(steps)


LOCK_FILE = ".lock"
_PROBE_BYTES = 4 << 20  # the start-up write check: a nearly full disk shows before any work


class DirLock:
    """The exclusive lock of a model directory: flock on the directory itself, which a run
    cannot lose (a lock on a file inside could be deleted, and a second trainer would lock a
    new file of the same name), and out/.lock, which names the holder's pid for messages."""

    def __init__(self, dir_fd: int, info: IO[str]) -> None:
        self.dir_fd, self.info = dir_fd, info

    def close(self) -> None:
        """Release the lock (closing twice is harmless); the OS also releases it when the
        process ends, however it ends (kill -9 included), so a lock is never stale."""
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1
        self.info.close()

    def __del__(self) -> None:  # as a file object does: a lock no one holds is released
        self.close()


def lock_model_dir(out: Path) -> DirLock:
    """Take the model directory's exclusive lock (creating the directory if needed)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise CheckpointError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        try:
            holder = (out / LOCK_FILE).read_text(encoding="utf-8").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise CheckpointError(
            f"--out {out}: in use by another attnmt train (pid {holder}); wait for it to end "
            "or stop it first"
        ) from None
    try:
        info = open(out / LOCK_FILE, "w", encoding="utf-8")  # noqa: SIM115 (held open)
        info.write(f"{os.getpid()}\n")
        info.flush()
    except OSError as e:
        os.close(dir_fd)
        raise CheckpointError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return DirLock(dir_fd, info)


def prepare_output_dir(out: Path, overwrite: bool, resume: bool) -> DirLock:
    """Lock the model directory (creating it), then reuse it with resume, or clear it with
    overwrite; refuse to mix two runs. Returns the lock file: keep it open while training.

    Fails before any data is read if the directory cannot be created or written, or is in
    use by another trainer (nothing in it is touched then).
    """
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a directory")
    lock = lock_model_dir(out)
    try:
        _clear_or_reuse(out, overwrite, resume)
        probe = out / CKPT_DIR / ".write-test"
        try:
            (out / CKPT_DIR).mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(bytes(_PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise CheckpointError(
                f"--out {out}: cannot write there ({e.strerror or e}; {free_space(out)})"
            ) from None
        finally:
            probe.unlink(missing_ok=True)
    except BaseException:
        lock.close()
        raise
    return lock


def discard_run(out: Path, existed: bool) -> None:
    """Remove what a new run wrote before it failed to start (SentencePiece, the encoded
    corpus, logs, the lock), and the directory itself when the run made it: the corrected
    command then starts clean instead of finding "already holds a run"."""
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in (*RUN_FILES, LOCK_FILE):
        (out / name).unlink(missing_ok=True)
    for name in (CKPT_DIR, "encoded", "tensorboard"):  # data.store's and training.board's
        shutil.rmtree(out / name, ignore_errors=True)


def _clear_or_reuse(out: Path, overwrite: bool, resume: bool) -> None:
    if any(f.name != LOCK_FILE for f in out.iterdir()) and not resume:
        if not overwrite:
            raise CheckpointError(
                f"--out {out}: already holds a run (or other files); pass --resume to continue "
                "it or --overwrite to start over"
            )
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        if (out / CKPT_DIR).is_dir():
            for f in (out / CKPT_DIR).iterdir():
                f.unlink()
        shutil.rmtree(out / "encoded", ignore_errors=True)  # attnmt.data.store's STORE_DIR
    # Temporary files of saves that a crash interrupted (the real files were never touched),
    # and a store that was being built (.encoded.tmp/: a directory): setup builds it anew.
    for d in (out, out / CKPT_DIR):
        for f in d.glob(".*.tmp") if d.is_dir() else []:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


@dataclass
class CheckpointRecord:
    step: int
    score: float | None  # dev score (train.early_stopping's, higher is better) at a validation


def save_checkpoint(
    out: Path,
    model: Seq2Seq,
    state: dict[str, Any],
    records: list[CheckpointRecord],
    keep_last: int,
    keep_best: int,
    tokenizer: str | None = None,
) -> None:
    """Write step-N weights and state, move the latest pointer to them, prune old ones.

    The pointer moves only after both files are complete, and pruning happens only after the
    pointer moved, so at every instant latest.json names a complete checkpoint.
    """
    step = records[-1].step
    ckpt = out / CKPT_DIR
    weights = ckpt / f"step-{step:08d}.safetensors"
    state_file = ckpt / f"step-{step:08d}.state.pt"
    save_weights(model, weights, tokenizer)
    atomic_write(state_file, lambda tmp: torch.save(sealed_state(state), tmp))
    pointer = {"step": step, "weights": weights.name, "state": state_file.name}
    atomic_write_bytes(ckpt / LATEST, json.dumps(pointer).encode("utf-8"))
    keep = {r.step for r in records[-keep_last:]}
    scored = sorted((r for r in records if r.score is not None), key=lambda r: -(r.score or 0.0))
    keep |= {r.step for r in scored[:keep_best]}
    for f in ckpt.iterdir():
        m = STEP_FILE.match(f.name)
        if m and int(m.group(1)) not in keep:
            f.unlink(missing_ok=True)
    records[:] = [r for r in records if r.step in keep]


def latest_checkpoint(out: Path) -> tuple[Path, Path] | None:
    """(weights, state) of the newest complete checkpoint, or None if there is none yet: the
    one latest.json names, or, when the pointer is missing, unreadable or names a missing
    file, the newest step whose two files are both there (found by scanning)."""
    ckpt = out / CKPT_DIR
    pointer = ckpt / LATEST
    try:
        p = json.loads(pointer.read_text(encoding="utf-8"))
        weights, state = ckpt / str(p["weights"]), ckpt / str(p["state"])
        if weights.is_file() and state.is_file():
            return weights, state
    except (OSError, ValueError, KeyError, TypeError):
        pass
    steps = sorted({int(m.group(1)) for m in map(STEP_FILE.match, _names(ckpt)) if m}, reverse=True)
    for step in steps:
        weights = ckpt / f"step-{step:08d}.safetensors"
        state = ckpt / f"step-{step:08d}.state.pt"
        if weights.is_file() and state.is_file():
            return weights, state
    return None


def _names(directory: Path) -> list[str]:
    return [f.name for f in directory.iterdir()] if directory.is_dir() else []


def sealed_state(state: dict[str, Any]) -> dict[str, Any]:
    """A training state as it is written (format 2): the state serialized by torch.save, as
    bytes, beside their SHA-256; load_train_state refuses a file whose bytes do not match
    (one flipped byte would otherwise resume silently into a different run)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return {
        "format_version": STATE_FORMAT_VERSION,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8),
    }


def load_train_state(path: Path) -> dict[str, Any]:
    """Load a training state with torch.load(weights_only=True): plain tensors and numbers only.

    A file that would run code or build arbitrary objects when unpickled is refused before any
    of its code runs; a sealed one (format 2) whose checksum does not match is refused.
    """
    state = _load_state(path, path)
    if state.get("payload") is not None:
        payload = state["payload"].numpy().tobytes()
        if hashlib.sha256(payload).hexdigest() != state.get("sha256"):
            raise CheckpointError(
                f"{path}: damaged: the training state does not match the checksum written "
                "with it; resume from another checkpoint (--weights step-N keeps them)"
            )
        state = _load_state(path, io.BytesIO(payload))
    return state


def _load_state(path: Path, source: Path | io.BytesIO) -> dict[str, Any]:
    """One torch.load(weights_only=True) of a state (the file, or its sealed payload),
    checked to be attnmt's."""
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message says how to unpickle it: ours does not
        raise CheckpointError(
            f"{path}: refused to load: the file holds objects other than tensors and numbers "
            "(it could run code when unpickled); attnmt never unpickles them"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable training state ({e})") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path}: not an attnmt training state")
    if int(state["format_version"]) > STATE_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: training-state format version {state['format_version']} is newer than "
            f"this attnmt ({__version__}) reads (version {STATE_FORMAT_VERSION}); upgrade attnmt"
        )
    return state
