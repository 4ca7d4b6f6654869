"""What a training run shows and records: its log (train.log for people, train_log.jsonl for
programs, TensorBoard), the progress bar, and the throughput of its steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attnmt.config import Config
from attnmt.data.batches import BucketSampler
from attnmt.data.store import TokenStore
from attnmt.data.text import ParallelText
from attnmt.data.tokenizer import Tokenizer
from attnmt.errors import DataError
from attnmt.models.directory import LOG_JSONL, LOG_TEXT
from attnmt.training.board import Board


def end_torn_lines(text: Path, jsonl: Path) -> int:
    """Before a run appends to its logs: a last line cut short by a kill is dropped from the
    JSON lines (a fragment would glue onto the next event) and ended in the text log. Returns
    the bytes dropped."""
    if text.is_file() and text.stat().st_size:
        with open(text, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    if not jsonl.is_file() or not jsonl.stat().st_size:
        return 0
    data = jsonl.read_bytes()
    if data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(jsonl, "rb+") as f:
        f.truncate(keep)
    return len(data) - keep


class RunLog:
    """Human-readable lines on stderr and in train.log; the same events as JSON lines."""

    def __init__(self, out: Path, quiet: bool = False, enabled: bool = True) -> None:
        """enabled=False (ranks other than 0 of a multi-process run) logs nothing."""
        self.enabled = enabled
        self.quiet = quiet
        self.board: Board | None = None  # TensorBoard, once setup opened it
        self.last_line = time.monotonic()  # when a line last went to train.log
        torn = 0
        if enabled:
            torn = end_torn_lines(out / LOG_TEXT, out / LOG_JSONL)
            self.text = open(out / LOG_TEXT, "a", encoding="utf-8")  # noqa: SIM115 (see close)
            self.jsonl = open(out / LOG_JSONL, "a", encoding="utf-8")  # noqa: SIM115
        if torn:
            self.event(
                "log_repaired", f"warning: {LOG_JSONL} ended in a torn line ({torn:,} bytes, "
                "from an interrupted write): dropped before appending", dropped_bytes=torn,
            )  # fmt: skip

    def event(self, kind: str, line: str | None = None, echo: bool = True, **fields: Any) -> None:
        """Log one event; `line` also goes to train.log and (echo, unless quiet) stderr."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"event": kind, **fields}) + "\n")
        self.jsonl.flush()
        if self.board is not None:
            self.board.event(kind, fields)
        if line is not None:
            self.text.write(line + "\n")
            self.text.flush()
            self.last_line = time.monotonic()
            if echo and not self.quiet:
                tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        """Close the log files (closing twice is harmless)."""
        if self.enabled:
            self.text.close()
            self.jsonl.close()
        if self.board is not None:
            self.board.close()


@dataclass(frozen=True)
class StepResult:
    """What one training step did, summed over the ranks."""

    step: int  # the step's number, counting from 1 (the next one if it was skipped)
    loss_sum: float  # summed token loss (label-smoothed)
    tokens: float  # real target tokens
    positions: float  # source + target positions, padding included
    real: float  # source + target positions that are not padding
    lr: float
    teacher_forcing: float
    loss_finite: bool
    grads_finite: bool
    signalled: bool  # some rank received SIGINT/SIGTERM
    budget_used: float = 0.0  # the share of train.time_budget spent after the step (0: none)

    @property
    def updated(self) -> bool:
        """Whether the optimizer applied the step (loss and gradients finite)."""
        return self.loss_finite and self.grads_finite

    @property
    def loss(self) -> float:
        """Loss per target token."""
        return self.loss_sum / max(self.tokens, 1.0)


@dataclass
class Throughput:
    tokens_per_s: float
    tokens: int
    seconds: float
    padding: float  # share of padded source + target positions
    src_tokens: int  # real source tokens (EOS included)
    loss: float  # the steps' mean token loss: comparable from one window to the next
    steps: int


class ThroughputMeter:
    """Target tokens per second and padding over the steps since the last `take`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self.start, self.tokens, self.positions, self.real = now, 0, 0.0, 0.0
        self.loss_sum, self.steps = 0.0, 0

    def add(self, result: StepResult) -> None:
        self.loss_sum += result.loss_sum
        self.steps += 1
        self.tokens += int(result.tokens)
        self.positions += result.positions
        self.real += result.real

    def take(self) -> Throughput:
        """The window's figures; starts a new window."""
        now = self.clock()
        seconds = now - self.start
        out = Throughput(
            self.tokens / max(seconds, 1e-9),
            self.tokens,
            seconds,
            1.0 - self.real / max(self.positions, 1.0),
            round(self.real) - self.tokens,
            self.loss_sum / max(self.tokens, 1),
            self.steps,
        )
        self._reset(now)
        return out


class ProgressBar:
    """tqdm's bar on stderr, its loss, lr, tokens/s and teacher forcing refreshed at most once
    a second (and at the first step), from the steps since the last refresh."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = tqdm(
            total=total, initial=initial, desc="train", unit="step", disable=not enabled or None,
            file=sys.stderr,
        )  # fmt: skip
        self.meter = ThroughputMeter(time.monotonic)
        self.fresh = True

    def update(self, result: StepResult) -> None:
        self.bar.update(1)
        self.meter.add(result)
        if self.fresh or time.monotonic() - self.meter.start >= 1.0:
            self.fresh = False
            self.bar.set_postfix(
                loss=f"{result.loss:.3f}",
                lr=f"{result.lr:.1e}",
                tok_s=f"{self.meter.take().tokens_per_s:.0f}",
                tf=f"{result.teacher_forcing:.2f}",
            )

    def close(self) -> None:
        self.bar.close()


def log_corpora(log: RunLog, cfg: Config, sampler: BucketSampler) -> None:
    """The `corpora` event: each training corpus's pairs, weight and share of an epoch."""
    shares = sampler.shares()
    total = max(1, sum(shares))
    named = [(str(c.name), c.direction, c.weight) for c in cfg.data.corpora]
    if cfg.data.tm is not None:  # the pairs with their TM matches (training.tm_pairs)
        named.append(("tm_pairs.tsv", "with TM matches", cfg.data.tm.weight))
    rows = [
        {"corpus": name, "direction": direction, "pairs": n, "weight": weight,
         "per_epoch": k, "share": k / total}
        for (name, direction, weight), n, k in zip(named, sampler.corpus_pairs, shares,
                                                    strict=True)
    ]  # fmt: skip
    log.event(
        "corpora",
        "corpora: " + "; ".join(
            f"{r['direction']}: {r['pairs']:,} pairs, weight {r['weight']:g}, "
            f"{100 * r['share']:.1f} % of an epoch" for r in rows
        ),
        corpora=rows,
    )  # fmt: skip


def log_data(
    log: RunLog, store: TokenStore, dev_texts: list[ParallelText], tokenizer: Tokenizer
) -> None:
    """The `data` event: pair counts of both splits (every dev set together), what was
    skipped, the vocabularies."""
    meta, joint = store.meta, " (joint)" if tokenizer.joint else ""
    dev_pairs = sum(len(t.src) for t in dev_texts)
    dev_empty = sum(t.skipped_empty for t in dev_texts)
    if not len(store):
        raise DataError(
            f"every training pair is longer than data.max_len = {meta['max_len']} subwords"
        )
    log.event(
        "data",
        f"train: {len(store)} pairs ({meta['skipped_empty']} skipped as empty, "
        f"{meta['skipped_too_long']} longer than {meta['max_len']} subwords) | dev: "
        f"{dev_pairs} pairs ({dev_empty} skipped as empty) | vocab: "
        f"{len(tokenizer.src)} src, {len(tokenizer.tgt)} tgt{joint}",
        train_pairs=len(store),
        train_skipped_empty=meta["skipped_empty"],
        train_skipped_too_long=meta["skipped_too_long"],
        dev_pairs=dev_pairs,
        dev_skipped_empty=dev_empty,
        src_vocab=len(tokenizer.src),
        tgt_vocab=len(tokenizer.tgt),
    )
