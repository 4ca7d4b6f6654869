"""One training step: the step's batches (made ahead on a GPU), forward and backward per batch with
accumulation, clipping, the optimizer update, skipped non-finite steps, the step's log line.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, cast

import torch

from attnmt.errors import TrainingError
from attnmt.kernels import clip_grad_norm
from attnmt.training import distributed
from attnmt.training.runlog import StepResult, Throughput
from attnmt.training.schedules import budget_warmup, step_schedules
from attnmt.training.setup import Run, host_batches

# --- one step ---


def step_idxs(
    batches: list[list[int]], consumed: int, ranks: distributed.Ranks, accumulate: int
) -> list[list[int]] | None:
    """This rank's train.accumulate batches of the step after `consumed` batches of the
    epoch; None when too few are left for a whole step (the remainder is left)."""
    if consumed + ranks.world * accumulate > len(batches):
        return None
    start = consumed + ranks.rank
    return [batches[start + k * ranks.world] for k in range(accumulate)]


def train_step(
    run: Run, idxs: list[list[int]], signalled: bool, following: list[list[int]] | None = None
) -> StepResult:
    """Train on the batches of pairs `idxs` (train.accumulate of them): forward and backward
    each, their gradients summed, then clip and (if every loss and gradient is finite) one
    optimizer update. The loss is normalised by the target tokens of all batches (of all
    ranks), so one update over N batches is one over their union. `signalled`: this rank
    received a stop signal; `following`: the next step's batches, made while this one runs."""
    t, p, ranks = run.cfg.train, run.progress, run.ranks
    on_host = run.prefetch.get(idxs) if run.prefetch else host_batches(run, idxs)
    # Counted on the host: read from the device, each count would wait for the GPU.
    n_tokens = sum(b.n_tokens for b in on_host)
    positions = sum(b.src.numel() + b.tgt_out.numel() for b in on_host)
    real = n_tokens + sum(b.n_src_tokens for b in on_host)
    batches = [b.to(run.device) for b in on_host]
    step = p.step + 1
    if ranks.world > 1:
        torch.manual_seed(distributed.step_seed(t.seed, ranks.rank, p.step))
        run.tf_generator.manual_seed(distributed.step_seed(t.seed + 1, ranks.rank, p.step))
    # Every rank normalises by the tokens of all ranks; DDP's mean of the ranks' gradients is
    # then the gradient of the loss per token of the whole step. The time budget is rank 0's.
    step_tokens, step_positions, step_real, budget_used = ranks.sum(
        [float(n_tokens), float(positions), float(real), run.budget_used() * ranks.is_main]
    )
    if t.lr_schedule == "budget" and not p.warmup_done:
        p.warmup_used = budget_used  # the decay after warmup starts from the peak here
        p.warmup_done = budget_warmup(step, t.warmup_steps, budget_used, t.warmup_share) >= 1
        if p.warmup_done and step < t.warmup_steps:
            run.log.event(
                "warmup", f"warmup ended at step {step}, {t.warmup_share:.0%} of the time budget"
                f" (train.warmup_share), before warmup_steps {t.warmup_steps}: the budget allows"
                f" about {step / max(budget_used, 1e-9):,.0f} steps", step=step,
            )  # fmt: skip
    lr, tf = step_schedules(step, run.cfg, p.plateau_scale, (budget_used, p.warmup_used))
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=run.device)
    for k, batch in enumerate(batches):
        if t.cuda_graphs:  # each forward starts a new replay of the recorded graphs
            torch.compiler.cudagraph_mark_step_begin()
        # Under DDP only the last batch's backward all-reduces the summed gradients.
        with no_sync(run, last=k == len(batches) - 1):
            with run.autocast():
                loss_sum, _ = run.step_model(batch, tf, t.label_smoothing, run.tf_generator)
            scale = ranks.world / step_tokens
            loss = loss_sum / n_tokens if ranks.world == 1 else loss_sum * scale
            run.scaler.scale(loss).backward()
        total = total + loss_sum.detach()
    run.scaler.unscale_(run.optimizer)
    grad_norm = clip_grad_norm(  # in a fixed order: the same on any number of threads
        run.model.parameters(), t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
    )
    if run.prefetch:  # the host makes the next batches while it waits for the device below
        run.prefetch.ahead(following)
    # The time budget's share spent after the step is rank 0's (every rank stops together).
    step_loss, signals, used = ranks.sum(
        [float(total), float(signalled), run.budget_used() * ranks.is_main]
    )
    loss_finite, grads_finite = math.isfinite(step_loss), bool(torch.isfinite(grad_norm))
    if loss_finite and grads_finite:
        run.scaler.step(run.optimizer)
    # Every step ends the scaler's cycle (a no-op unless fp16): it lowers the scale after
    # non-finite gradients, and the next unscale_ requires it.
    run.scaler.update()
    return StepResult(
        step, step_loss, step_tokens, step_positions, step_real, lr, tf, loss_finite,
        grads_finite, signals > 0, used,
    )  # fmt: skip


def no_sync(run: Run, last: bool) -> contextlib.AbstractContextManager[Any]:
    """DDP's no_sync (gradients summed locally, not all-reduced) for all but the last batch of
    an accumulated step; nothing with one process."""
    if last or run.ranks.world == 1:
        return contextlib.nullcontext()
    return cast(Any, run.step_model).no_sync()


def skip_step(run: Run, result: StepResult) -> None:
    """Account for a step whose update was skipped: an fp16 overflow (the scaler lowered its
    scale; not a bad step), or a non-finite loss or gradient, which ends training after
    train.max_bad_steps in a row so that one bad batch cannot poison the weights."""
    p, t = run.progress, run.cfg.train
    p.skipped_steps += 1
    if result.loss_finite and run.scaler.is_enabled():
        run.log.event("fp16_overflow", None, step=result.step, scale=run.scaler.get_scale())
        return
    p.bad_steps_in_a_row += 1
    run.log.event(
        "nonfinite",
        None,
        step=result.step,
        in_a_row=p.bad_steps_in_a_row,
        skipped_total=p.skipped_steps,
    )
    if p.bad_steps_in_a_row >= t.max_bad_steps:
        raise TrainingError(
            f"{p.bad_steps_in_a_row} steps in a row had a non-finite loss or gradient "
            f"(train.max_bad_steps = {t.max_bad_steps}) at step {result.step}; try a lower "
            "train.lr or train.clip_grad_norm"
        )


# --- watching: throughput, progress bar, log ---


def log_train(run: Run, result: StepResult, window: Throughput) -> None:
    """The `train` event: the step's loss and schedules, the window's throughput; without a
    terminal (nohup, CI), where no progress bar shows, also a line in train.log and stderr."""
    line = None
    if sys.stderr is None or not sys.stderr.isatty():
        line = (
            f"step {result.step} | epoch {run.progress.epoch} | train loss {window.loss:.3f} "
            f"(mean of {window.steps} steps) | lr {result.lr:.2e} | "
            f"{window.tokens_per_s:,.0f} tokens/s | {run.elapsed():.0f} s"
        )
    run.log.event(
        "train",
        line,
        step=result.step,
        epoch=run.progress.epoch,
        loss=result.loss,
        mean_loss=round(window.loss, 5),
        lr=result.lr,
        tokens_per_s=round(window.tokens_per_s, 1),
        tokens=window.tokens,
        src_tokens=window.src_tokens,
        seconds=round(window.seconds, 4),
        padding=round(window.padding, 4),
        teacher_forcing=result.teacher_forcing,
        elapsed_s=round(run.elapsed(), 1),
    )


# A budgeted run says after this many steps how many its budget allows at their speed.
BUDGET_PROBE_STEPS = 20
# Fewer steps than this and the model will not translate yet: the manual's smallest results
# are Tatoeba en-fr from 500 steps (BLEU 19.6; docs/tatoeba.md) and a user's own de-en corpus
# from 616 (BLEU 23). A budget that gives less than one epoch is no reason to warn.
FEW_STEPS = 300
# Without a progress bar (output not a terminal), a train line at least this often.
QUIET_S = 30.0


def log_budget(run: Run, budget_used: float, steps_per_epoch: int) -> None:
    """The `budget` event: the steps (and epochs) train.time_budget allows at the speed of the
    steps so far (setup and validations counted), and a warning when that is too few to give a
    model that translates."""
    p = run.progress
    steps = int(p.step / max(budget_used, 1e-9))
    epochs = steps / max(steps_per_epoch, 1)
    few = steps < FEW_STEPS
    line = (
        f"time budget: about {steps:,} steps ({epochs:.2f} epochs) at the speed of the first "
        f"{p.step} steps"
        + (
            "; warning: expect a model that cannot translate yet (the manual's smallest "
            "results took 500 steps or more): give it more time (train.time_budget), or a "
            "smaller model: configs/own_data_small.yaml, or --set model.enc_layers=2 --set "
            "model.dec_layers=2 --set tokenizer.vocab_size=4000 --set train.batch_tokens=2048"
            if few else ""
        )
    )  # fmt: skip
    run.log.event("budget", line, step=p.step, steps=steps, epochs=round(epochs, 3), few=few)
