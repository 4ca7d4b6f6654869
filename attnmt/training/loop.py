"""The training loop; its named parts are in setup.py, step.py and validation.py.

`train` prepares the model directory and calls `setup` (read and validate the data, train or,
when resuming, load the SentencePiece model, build the model and optimizer, restore the last
checkpoint if asked), then `train_loop`: one flat loop over epochs and batches, a `train_step`
per batch and a `validate` (with a checkpoint) every `train.eval_every` steps.

Everything that decides what happens next lives in `Progress` and the RNG states, and all of it
is saved with each checkpoint, so a resumed run takes exactly the steps the uninterrupted run
would have taken (on CPU its weights are byte-identical).
"""

from __future__ import annotations

import contextlib
import gc
import signal
import time
from pathlib import Path
from typing import Any

import torch

from attnmt.config import Config
from attnmt.data.processes import StopSignals
from attnmt.device import resolve_device
from attnmt.errors import AttnmtError, ConfigError
from attnmt.kernels import mask_threads, matmul_backend
from attnmt.models.directory import BEST_FILE, resolve_weights
from attnmt.training import distributed
from attnmt.training.checkpoints import discard_run, prepare_output_dir
from attnmt.training.dev_metric import shown
from attnmt.training.finetune import inherit
from attnmt.training.runlog import ProgressBar, RunLog, ThroughputMeter
from attnmt.training.setup import Run, fit_threads, setup
from attnmt.training.step import (
    BUDGET_PROBE_STEPS,
    QUIET_S,
    log_budget,
    log_train,
    skip_step,
    step_idxs,
    train_step,
)
from attnmt.training.validation import average_at_end, interrupt, test_with, validate


def training_matmul(cfg: Config, device: torch.device) -> str:
    """The fp32 matmul library a run trains with: train.matmul on a CPU, the BLAS elsewhere
    (oneDNN's linear is a CPU path). Profilers and benchmarks open the same one."""
    return cfg.train.matmul if device.type == "cpu" else "blas"


def train(
    cfg: Config, out: Path, overwrite: bool = False, resume: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Train a model from cfg into the model directory `out`; returns a summary."""
    if cfg.train.init_from is not None:
        if cfg.train.init_from.resolve() == out.resolve():
            raise ConfigError(f"train.init_from is the model directory --out {out} itself")
        cfg = inherit(cfg)
        # Missing weights are refused before the directory is made.
        resolve_weights(cfg.train.init_from, cfg.train.init_weights)
    ranks = distributed.ranks_from_env()
    # A new run that fails to start leaves nothing behind (the corrected command starts clean);
    # a directory it did not make is not touched until it holds the lock and was cleared.
    fresh, existed = not resume and ranks.is_main, out.exists()
    # Rank 0 holds the directory's lock for the whole run: a second trainer is refused.
    with DiscardedOnError(out, existed, fresh and not existed):
        lock = prepare_output_dir(out, overwrite, resume) if ranks.is_main else None
    with contextlib.closing(lock) if lock else contextlib.nullcontext():
        device = resolve_device(cfg.train.device)
        if ranks.world > 1:
            device = distributed.init(ranks, device)
            ranks.barrier()  # the model directory exists before any rank reads or writes it
        log = RunLog(out, quiet, enabled=ranks.is_main)
        backend = training_matmul(cfg, device)
        summary = None
        try:
            with matmul_backend(backend):
                with DiscardedOnError(out, existed, fresh):
                    run = setup(cfg, out, resume, ranks, device, log)
                try:
                    summary = train_loop(run)
                finally:
                    if run.prefetch:
                        run.prefetch.close()
                    # DDP's reducer holds the process group: released now, not at the
                    # interpreter's exit, where tearing gloo's threads down may abort.
                    del run
                    gc.collect()
        finally:
            log.close()  # also when training fails: no log file is left open
            ranks.shutdown(finished=summary is not None)
        return summary


class DiscardedOnError:
    """A user error inside the block (a bad file, config or --init-from, a full disk) removes
    what the new run wrote so far (checkpoints.discard_run); a bug is left to be looked at."""

    def __init__(self, out: Path, existed: bool, enabled: bool) -> None:
        self.out, self.existed, self.enabled = out, existed, enabled

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, trace: Any) -> bool:
        if self.enabled and isinstance(error, AttnmtError):
            discard_run(self.out, self.existed)
        return False


def train_loop(run: Run) -> dict[str, Any]:
    """Epochs of batches; a step per batch, a validation every train.eval_every steps."""
    t, p, ranks = run.cfg.train, run.progress, run.ranks
    meter = ThroughputMeter()
    bar = ProgressBar(t.max_steps, p.step, enabled=not run.log.quiet and ranks.is_main)
    stop_reason = None
    if p.step >= t.max_steps:
        stop_reason = "max_steps"
    elif p.step > 0 and p.bad_validations >= t.patience:  # resumed where patience ran out
        stop_reason = "early_stopping"
    with StopSignals() as signals, mask_threads(torch.get_num_threads()):
        while stop_reason is None and p.epoch <= t.max_epochs:
            batches = run.sampler.epoch(p.epoch)
            # One step takes train.accumulate batches per rank; a remainder too small for a
            # whole step is left.
            per_step = ranks.world * t.accumulate
            while stop_reason is None and p.batch_in_epoch + per_step <= len(batches):
                idxs = step_idxs(batches, p.batch_in_epoch, ranks, t.accumulate)
                p.batch_in_epoch += per_step
                following = step_idxs(batches, p.batch_in_epoch, ranks, t.accumulate)
                result = train_step(run, idxs, signals.signum is not None, following)
                fit_threads(run.threads, run.log, p.step)
                if not result.updated:
                    skip_step(run, result)
                else:
                    p.step += 1
                    p.bad_steps_in_a_row = 0
                    meter.add(result)
                    bar.update(result)
                    quiet_s = time.monotonic() - run.log.last_line  # no bar: a line now and then
                    if p.step % t.log_every == 0 or p.step == 1 or quiet_s >= QUIET_S:
                        log_train(run, result, meter.take())
                    if p.step == BUDGET_PROBE_STEPS and t.time_budget is not None:
                        log_budget(run, result.budget_used, len(batches) // per_step)
                    # Under a time budget, a first validation at half of it measures what the
                    # last one will cost, which the budget then keeps free: it holds.
                    halfway = p.last_validated < 0 and result.budget_used >= 0.5
                    due = p.step % t.eval_every == 0 or (t.time_budget is not None and halfway)
                    if due and validate(run):
                        stop_reason = "early_stopping"
                    elif p.step >= t.max_steps:
                        stop_reason = "max_steps"
                    elif result.budget_used >= 1.0:
                        stop_reason = "time_budget"
                if result.signalled:
                    bar.close()
                    interrupt(run, signals.signum or signal.SIGTERM)  # raises
            if stop_reason is None:
                p.epoch += 1
                p.batch_in_epoch = 0
    bar.close()
    if p.last_validated != p.step:
        validate(run)
    trained_s = run.elapsed()  # what a time budget covers; test scoring comes after it
    if ranks.is_main and run.cfg.data.test_sets and (run.out / BEST_FILE).is_file():
        test_with(run, run.out / BEST_FILE, "best")
    if ranks.is_main and t.average_last:
        average_at_end(run)
    return finish(run, stop_reason or "max_epochs", trained_s)


def finish(run: Run, stop_reason: str, trained_s: float) -> dict[str, Any]:
    """The `done` event; returns the run's summary. `trained_s`: the time until the last
    validation (a time budget's span); averaging and test scoring follow it."""
    p, t = run.progress, run.cfg.train
    summary = {
        "steps": p.step,
        "epochs": min(p.epoch, t.max_epochs),
        "early_stopping": t.early_stopping,
        "best_dev": round(p.best_score if t.early_stopping != "loss" else -p.best_score, 4),
        "best_shown": shown(t.early_stopping, p.best_score),
        "stop_reason": stop_reason,
        "skipped_nonfinite_steps": p.skipped_steps,
        "elapsed_s": round(run.elapsed(), 1),
        "trained_s": round(trained_s, 1),
    }
    after = run.elapsed() - trained_s
    run.log.event(
        "done",
        f"done: {p.step} steps, {summary['epochs']} epochs, stopped by {stop_reason}, best dev "
        f"{shown(t.early_stopping, p.best_score)}, {trained_s / 60:.1f} min"
        + (f" training + {after / 60:.1f} min test scoring and averaging (after the time "
           "budget)" if after >= 1 else ""),
        **summary,
    )  # fmt: skip
    return summary
