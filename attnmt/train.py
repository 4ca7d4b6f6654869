"""The training loop and its named parts: setup, one step, validation, checkpoints, signals.

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
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from attnmt import distributed
from attnmt.board import Board
from attnmt.checkpoint import (
    BEST_FILE,
    LAST_FILE,
    STATE_FORMAT_VERSION,
    CheckpointRecord,
    average_checkpoints,
    kept_checkpoints,
    latest_checkpoint,
    load_train_state,
    load_weights,
    prepare_output_dir,
    resolve_weights,
    save_checkpoint,
    save_weights,
    tokenizer_digest,
    tokenizer_shas,
)
from attnmt.config import Config
from attnmt.data import Batch, BucketSampler, Prefetcher, collate, pad_to_bucket
from attnmt.device import (
    PRECISION_DTYPES,
    limit_onednn_kernel_cache,
    memory_bytes,
    missing_hardware,
    resolve_device,
    resolve_precision,
)
from attnmt.errors import CheckpointError, ConfigError, TrainingError, TrainingInterrupted
from attnmt.finetune import inherit
from attnmt.kernels import mask_threads, matmul_backend
from attnmt.kernels.matmul import active as active_backend
from attnmt.model import build_model
from attnmt.prepare import DevSet, prepare_data
from attnmt.processes import StopSignals
from attnmt.resume import Progress, rng_state, seed_everything, set_rng_state
from attnmt.runlog import (
    METRIC_NAMES,
    ProgressBar,
    RunLog,
    StepResult,
    Throughput,
    ThroughputMeter,
    log_corpora,
)
from attnmt.schedules import budget_warmup, step_schedules
from attnmt.scoring import score_dev_sets, score_test_sets
from attnmt.seq2seq import Seq2Seq
from attnmt.store import TokenStore
from attnmt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def all_finite(model: Seq2Seq) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@dataclass
class Run:
    """Everything a training run works with; built by `setup`, used by the loop's parts."""

    cfg: Config
    out: Path
    ranks: distributed.Ranks
    device: torch.device
    log: RunLog
    tokenizer: Tokenizer
    train_data: TokenStore
    dev_sets: list[DevSet]  # one per direction
    model: Seq2Seq
    step_model: nn.Module  # what runs a step: the model, or its DDP / compiled wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: str  # the number format trained in: train.precision with `auto` resolved
    sampler: BucketSampler
    tf_generator: torch.Generator  # scheduled sampling's coin flips
    progress: Progress
    start_time: float = field(default_factory=time.time)
    tokenizer_digest: str | None = None  # what weights files record (checkpoint.tokenizer_digest)
    prefetch: Prefetcher | None = None  # makes each step's batches on the host (setup sets it)

    def elapsed(self) -> float:
        """Training seconds, over every resumption of the run."""
        return self.progress.elapsed_s + time.time() - self.start_time

    def budget_used(self) -> float:
        """The share of train.time_budget spent, counting the longest validation so far as
        already spent (the last validation must fit); 0 without a budget."""
        budget = self.cfg.train.time_budget
        if budget is None:
            return 0.0
        return min((self.elapsed() + self.progress.validation_s) / budget, 1.0)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISION_DTYPES[self.precision])


def train(
    cfg: Config, out: Path, overwrite: bool = False, resume: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Train a model from cfg into the model directory `out`; returns a summary."""
    if cfg.train.init_from is not None:
        if cfg.train.init_from.resolve() == out.resolve():
            raise ConfigError(f"train.init_from is the model directory --out {out} itself")
        cfg = inherit(cfg)
    ranks = distributed.ranks_from_env()
    # Rank 0 holds the directory's lock for the whole run: a second trainer is refused.
    lock = prepare_output_dir(out, overwrite, resume) if ranks.is_main else None
    with contextlib.closing(lock) if lock else contextlib.nullcontext():
        device = resolve_device(cfg.train.device)
        if ranks.world > 1:
            device = distributed.init(ranks, device)
            ranks.barrier()  # the model directory exists before any rank reads or writes it
        log = RunLog(out, quiet, enabled=ranks.is_main)
        backend = cfg.train.matmul if device.type == "cpu" else "blas"
        try:
            with matmul_backend(backend):
                run = setup(cfg, out, resume, ranks, device, log)
                try:
                    return train_loop(run)
                finally:
                    if run.prefetch:
                        run.prefetch.close()
        finally:
            log.close()  # also when training fails: no log file is left open
            ranks.shutdown()


def train_loop(run: Run) -> dict[str, Any]:
    """Epochs of batches; a step per batch, a validation every train.eval_every steps."""
    t, p, ranks = run.cfg.train, run.progress, run.ranks
    meter = ThroughputMeter()
    bar = ProgressBar(t.max_steps, p.step, enabled=not run.log.quiet and ranks.is_main)
    stop_reason = "max_steps" if p.step >= t.max_steps else None
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
                if not result.updated:
                    skip_step(run, result)
                else:
                    p.step += 1
                    p.bad_steps_in_a_row = 0
                    meter.add(result)
                    bar.update(result)
                    if p.step % t.log_every == 0 or p.step == 1:
                        log_train(run, result, meter.take())
                    if p.step % t.eval_every == 0 and validate(run):
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


# --- setup ---


def setup(
    cfg: Config,
    out: Path,
    resume: bool,
    ranks: distributed.Ranks,
    device: torch.device,
    log: RunLog,
) -> Run:
    """Seed, read the data, train or load the tokenizer, build the model and its optimizer,
    and restore the last checkpoint when resuming."""
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    tf_generator = seed_everything(t.seed)
    start_time = time.time()
    checkpoint = latest_checkpoint(out) if resume else None
    tokenizer, train_data, dev_sets = prepare_data(cfg, out, ranks, checkpoint is not None, log)
    model = build_checked_model(cfg, tokenizer, device)
    model.to(device).train()
    optimizer = torch.optim.Adam(  # fused: one kernel for all parameters, not a few per tensor
        model.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay, fused=True
    )
    src_lengths, tgt_lengths = train_data.lengths()
    src_lengths += 1  # EOS; in place: at 10 M pairs each copy is 40 MB
    tgt_lengths += 1
    sampler = BucketSampler(
        src_lengths,
        tgt_lengths,
        t.batch_tokens,
        t.seed,
        max_sentences=t.batch_sentences,
        corpus_pairs=train_data.meta.get("corpus_pairs") or [len(train_data)],
        weights=[c.weight for c in cfg.data.corpora],
    )
    if len(cfg.data.corpora) > 1:
        log_corpora(log, cfg, sampler)
    precision = resolve_precision(t.precision, device)
    run = Run(
        cfg, out, ranks, device, log, tokenizer, train_data, dev_sets, model, model,
        optimizer,
        # fp16 needs loss scaling to keep small gradients from underflowing; bf16, fp32 do not.
        torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        precision,
        sampler, tf_generator, Progress(), start_time,
    )  # fmt: skip
    run.tokenizer_digest = tokenizer_digest(tokenizer_shas(tokenizer))
    if checkpoint is not None:
        restore(run, *checkpoint)
    if t.tensorboard and ranks.is_main:
        # When resuming, what the interrupted run logged after its checkpoint is hidden.
        log.board = Board(out, purge_step=run.progress.step + 1 if checkpoint else None)
    if checkpoint is None and t.init_from is not None:
        start_from(run, t.init_from)  # its step-0 scores reach TensorBoard too
    # DDP averages the gradients over the ranks during backward; it hooks into forward, which
    # is the model's training loss. torch.compile wraps what runs the step.
    if ranks.world > 1:
        ids = [device.index] if device.type == "cuda" else None
        run.step_model = DistributedDataParallel(model, device_ids=ids)
    if t.cuda_graphs and (device.type != "cuda" or cfg.model.arch != "transformer"):
        raise ConfigError(
            f"train.cuda_graphs: CUDA graphs need a CUDA device and model.arch transformer"
            f" (this run: {device.type}, {cfg.model.arch})"
        )
    if t.compile or t.cuda_graphs:
        mode = "reduce-overhead" if t.cuda_graphs else None  # reduce-overhead: CUDA graphs
        run.step_model = cast(nn.Module, torch.compile(run.step_model, mode=mode))
    prefetch = device.type == "cuda" if t.prefetch == "auto" else t.prefetch
    run.prefetch = Prefetcher(lambda idxs: host_batches(run, idxs), enabled=prefetch)
    log_model(run, resumed=checkpoint is not None)
    if resume and checkpoint is None:
        log.event("resume", "--resume: no checkpoint in this directory yet; starting at step 0")
    return run


def restore(run: Run, weights_path: Path, state_path: Path) -> None:
    """Load a checkpoint's weights, optimizer, scaler, counters and RNG states into run."""
    state = load_train_state(state_path)
    load_weights(run.model, weights_path, run.device, run.tokenizer_digest)
    try:
        run.optimizer.load_state_dict(state["optimizer"])
        run.progress = Progress.from_state(state["progress"])
        set_rng_state(state["rng"], run.tf_generator)
        if "scaler" in state:
            run.scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(
            f"{state_path}: cannot restore the training state ({type(e).__name__}: {e})"
        ) from None
    if run.ranks.is_main:
        save_weights(run.model, run.out / LAST_FILE, run.tokenizer_digest)


def start_from(run: Run, source_dir: Path) -> None:
    """Fine-tuning: load the source model's best weights; log them with their dev scores (the
    step-0 point of the curves: what fine-tuning starts from)."""
    weights = resolve_weights(source_dir, "best")
    load_weights(run.model, weights, run.device, run.tokenizer_digest)
    dev = score_dev_sets(run.model, run.tokenizer, run.dev_sets, run.cfg, run.device)
    run.log.event(
        "init_from",
        f"fine-tuning from {weights} | step-0 dev loss {dev.loss:.3f} | BLEU {dev.bleu:.2f} | "
        f"chrF {dev.chrf:.2f}",
        weights=str(weights), step=0, dev_loss=dev.loss, dev_ppl=math.exp(min(dev.loss, 50.0)),
        dev_bleu=dev.bleu, dev_chrf=dev.chrf,
    )  # fmt: skip


def log_model(run: Run, resumed: bool) -> None:
    """The `model` event (architecture, size, device, number formats), and the CPU notes."""
    t, device = run.cfg.train, run.device
    n_params = sum(p.numel() for p in run.model.parameters())
    mm_backend = active_backend() if device.type == "cpu" else "blas"
    precision = run.precision
    fp32_cpu = device.type == "cpu" and precision == "fp32"
    batches = t.accumulate * run.ranks.world  # per update: accumulated x processes
    unit = f"{t.batch_sentences:,} sentences" if t.batch_sentences else f"{t.batch_tokens:,} tokens"
    run.log.event(
        "model",
        f"model: {run.cfg.model.arch}, {n_params:,} parameters, device {device}, {precision}"
        + (" (train.precision auto)" if t.precision == "auto" else "")
        + (f", {mm_backend} matmuls" if fp32_cpu else "")
        + (f", {run.ranks.world} processes" if run.ranks.world > 1 else "")
        + (f" | an update: {batches} batches of up to {unit}" if batches > 1 else "")
        + (f" | resumed at step {run.progress.step}" if resumed else ""),
        batches_per_update=batches,
        arch=run.cfg.model.arch,
        parameters=n_params,
        device=str(device),
        precision=precision,
        resumed_step=run.progress.step if resumed else None,
        matmul=mm_backend,
    )
    limit_onednn_kernel_cache(device, precision, mm_backend)  # before the first step
    if not fp32_cpu and (lacking := missing_hardware(device, precision)) is not None:
        run.log.event(
            "precision",
            f"train.precision={precision}: {lacking}; expect it slower than fp32",
            precision=precision,
            hardware=False,
        )


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


def host_batches(run: Run, idxs: list[list[int]]) -> list[Batch]:
    """The step's batches on the host, ready to copy: collated, grown to a bucketed shape
    under CUDA graphs (which are recorded per shape), pinned for a GPU."""
    made = [collate(*run.train_data.pairs(idx), idx, PAD_ID, BOS_ID, EOS_ID) for idx in idxs]
    if run.cfg.train.cuda_graphs:
        made = [pad_to_bucket(b, BOS_ID, EOS_ID) for b in made]
    return [b.pinned() for b in made] if run.device.type == "cuda" else made


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
    grad_norm = torch.nn.utils.clip_grad_norm_(
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
            f"step {result.step} | epoch {run.progress.epoch} | loss {result.loss:.3f} | "
            f"lr {result.lr:.2e} | {window.tokens_per_s:,.0f} tokens/s | {run.elapsed():.0f} s"
        )
    run.log.event(
        "train",
        line,
        step=result.step,
        epoch=run.progress.epoch,
        loss=result.loss,
        lr=result.lr,
        tokens_per_s=round(window.tokens_per_s, 1),
        tokens=window.tokens,
        src_tokens=window.src_tokens,
        seconds=round(window.seconds, 4),
        padding=round(window.padding, 4),
        teacher_forcing=result.teacher_forcing,
        elapsed_s=round(run.elapsed(), 1),
    )


# --- validation, checkpoints, the end ---


def validate(run: Run) -> bool:
    """Validate on rank 0 (the others wait); returns True when early stopping says stop.
    Rank 0 passes its decisions on: stop, and the plateau lr scale."""
    p, ranks = run.progress, run.ranks
    p.last_validated = p.step
    if ranks.world > 1:
        same = ranks.weights_identical(run.model)
        run.log.event(
            "ranks",
            None if same else f"step {p.step}: the ranks' weights differ",
            step=p.step,
            world=ranks.world,
            weights_identical=same,
        )
    stop = validate_main(run) if ranks.is_main else False
    if ranks.world > 1:
        scale = p.plateau_scale if ranks.is_main else 0.0
        stop_sum, p.plateau_scale = ranks.sum([float(stop), scale])
        stop = stop_sum > 0
    return stop


def validate_main(run: Run) -> bool:
    """Dev loss, perplexity, BLEU and chrF (train.eval_beam); saves weights and a checkpoint,
    and updates early stopping (on train.early_stopping's metric) and the plateau schedule.
    Returns True when patience ran out."""
    p, t, model = run.progress, run.cfg.train, run.model
    started = time.time()
    dev = score_dev_sets(run.model, run.tokenizer, run.dev_sets, run.cfg, run.device)
    loss = dev.loss
    metric = {"bleu": dev.bleu, "chrf": dev.chrf, "loss": -loss}[t.early_stopping]
    finite = math.isfinite(loss) and all_finite(model)
    improved = finite and metric > p.best_score
    if improved:
        p.best_score, p.bad_validations, p.plateau_bad = metric, 0, 0
        save_weights(model, run.out / BEST_FILE, run.tokenizer_digest)
    else:
        p.bad_validations += 1
        p.plateau_bad += 1
        if t.lr_schedule == "plateau" and p.plateau_bad > t.plateau_patience:
            p.plateau_scale *= t.plateau_factor
            p.plateau_bad = 0
    save_weights(model, run.out / LAST_FILE, run.tokenizer_digest)
    p.validation_s = max(p.validation_s, time.time() - started)
    checkpoint(run, metric if finite else None)
    ppl = math.exp(min(loss, 50.0))
    # The schedules of the step just trained (the next step may take a new plateau scale).
    budget = (run.budget_used(), p.warmup_used)
    lr, tf = step_schedules(max(p.step, 1), run.cfg, p.plateau_scale, budget)
    star = {k: " *" if improved and k == t.early_stopping else "" for k in ("bleu", "chrf", "loss")}
    run.log.event(
        "validation",
        f"step {p.step} | epoch {p.epoch} | dev loss {loss:.3f}{star['loss']} | ppl {ppl:.2f} | "
        f"BLEU {dev.bleu:.2f}{star['bleu']} | chrF {dev.chrf:.2f}{star['chrf']} | "
        f"lr {lr:.2e} | tf {tf:.2f} | {run.elapsed():.0f} s"
        + "".join(f" | {n} BLEU {r['dev_bleu']:.2f}" for n, r in dev.directions.items()),
        step=p.step,
        epoch=p.epoch,
        dev_loss=loss,
        dev_ppl=ppl,
        dev_bleu=dev.bleu,
        dev_chrf=dev.chrf,
        metric=t.early_stopping,
        best=p.best_score if t.early_stopping != "loss" else -p.best_score,
        improved=improved,
        lr=lr,
        teacher_forcing=tf,
        elapsed_s=round(run.elapsed(), 1),
        **({"directions": dev.directions} if dev.directions else {}),
    )
    log_samples(run, dev.hyps)
    return p.bad_validations >= t.patience


def log_samples(run: Run, hyps: list[str]) -> None:
    """The first train.log_samples dev sentences with reference and translation, as JoeyNMT
    shows them: a `samples` event, and a line per example in train.log and on stderr."""
    n = min(run.cfg.train.log_samples, len(hyps))
    if n == 0:
        return
    text = run.dev_sets[0].text
    rows = [{"src": text.src[i], "ref": text.tgt[i], "hyp": hyps[i]} for i in range(n)]
    lines = [
        f"  example {i + 1} | src: {r['src']} | ref: {r['ref']} | hyp: {r['hyp']}"
        for i, r in enumerate(rows)
    ]
    run.log.event("samples", "\n".join(lines), step=run.progress.step, examples=rows)


def checkpoint(run: Run, bleu: float | None) -> None:
    """Save weights and the whole training state as checkpoint step-N (rank 0)."""
    p, t = run.progress, run.cfg.train
    p.checkpoints.append([p.step, bleu])
    records = [CheckpointRecord(s, b) for s, b in p.checkpoints]
    state = {
        "format_version": STATE_FORMAT_VERSION,
        "progress": {**asdict(p), "elapsed_s": run.elapsed()},
        "optimizer": run.optimizer.state_dict(),
        "rng": rng_state(run.tf_generator),
    }
    if run.scaler.is_enabled():
        state["scaler"] = run.scaler.state_dict()
    save_checkpoint(
        run.out, run.model, state, records, t.keep_last, t.keep_best, run.tokenizer_digest
    )
    p.checkpoints = [[r.step, r.score] for r in records]


def interrupt(run: Run, signum: int) -> None:
    """Stop on a signal: checkpoint (unless this step was just validated, which saved one),
    make the weights last.safetensors so the directory translates, and raise."""
    p = run.progress
    if p.last_validated != p.step and run.ranks.is_main:
        save_weights(run.model, run.out / LAST_FILE, run.tokenizer_digest)
        checkpoint(run, None)
    name = signal.Signals(signum).name
    # The CLI prints this line on stderr; here it goes to the log files only.
    run.log.event(
        "interrupted",
        f"{name} at step {p.step}: checkpoint saved; continue with --resume",
        echo=False,
        step=p.step,
        signal=name,
    )
    raise TrainingInterrupted(signum, p.step)


def average_at_end(run: Run) -> None:
    """train.average_last: average the last kept checkpoints (as many as there are, up to it)
    into averaged.safetensors, log it, and score the test set with it too. Checkpoints from
    before the learning rate's peak (warmup) or from the run's first half are left out: weights
    that far from the end cost BLEU (a short budget run lost 8.6 BLEU averaging them)."""
    kept = sorted(kept_checkpoints(run.out))
    start = max(run.cfg.train.warmup_steps + 1, (kept[-1] + 1) // 2 if kept else 0)
    skipped = ", ".join(str(s) for s in kept if s < start)
    why = f" (left out {skipped}: before the lr peak or in the run's first half)" if skipped else ""
    n = min(run.cfg.train.average_last, sum(s >= start for s in kept))
    if n == 0:
        run.log.event("average", f"no checkpoint to average{why}", steps=[], skipped=skipped)
        return
    path, steps = average_checkpoints(run.out, n, "last", start)
    run.log.event(
        "average", f"averaged steps {', '.join(map(str, steps))} -> {path.name}{why}",
        steps=steps, skipped=skipped,
    )  # fmt: skip
    if run.cfg.data.test_sets:
        test_with(run, path, "averaged")


def test_with(run: Run, weights: Path, which: str) -> None:
    """Translate each data.test set with the weights in `weights` (`which`: best or averaged)
    and log its BLEU and chrF, scored as `attnmt eval` scores it (every line counts); with
    several sets (directions), their mean too."""
    cfg = run.cfg
    load_weights(run.model, weights, run.device, run.tokenizer_digest)
    results = score_test_sets(run.model, run.tokenizer, cfg, run.device)
    several = len(results) > 1
    for r in results:
        run.log.event(
            "test",
            f"test ({r.split.name.name}{f', {r.name}' if several else ''}, {which} weights, "
            f"beam {cfg.decode.beam}): BLEU {r.scores.bleu:.2f} | chrF {r.scores.chrf:.2f} | "
            f"{r.scores.bleu_signature}",
            pairs=r.pairs,
            weights=which,
            beam=cfg.decode.beam,
            empty_sources=r.empty_sources,
            **({"direction": r.name} if several else {}),
            **r.scores.as_dict(),
        )
    if several:
        bleu = sum(r.scores.bleu for r in results) / len(results)
        chrf = sum(r.scores.chrf for r in results) / len(results)
        run.log.event(
            "test",
            f"test (mean of {len(results)} directions, {which} weights): BLEU {bleu:.2f} | "
            f"chrF {chrf:.2f}",
            weights=which,
            direction="mean",
            bleu=round(bleu, 2),
            chrf=round(chrf, 2),
        )


def finish(run: Run, stop_reason: str, trained_s: float) -> dict[str, Any]:
    """The `done` event; returns the run's summary. `trained_s`: the time until the last
    validation (a time budget's span); averaging and test scoring follow it."""
    p, t = run.progress, run.cfg.train
    summary = {
        "steps": p.step,
        "epochs": min(p.epoch, t.max_epochs),
        "early_stopping": t.early_stopping,
        "best_dev": round(p.best_score if t.early_stopping != "loss" else -p.best_score, 4),
        "stop_reason": stop_reason,
        "skipped_nonfinite_steps": p.skipped_steps,
        "elapsed_s": round(run.elapsed(), 1),
        "trained_s": round(trained_s, 1),
    }
    after = run.elapsed() - trained_s
    run.log.event(
        "done",
        f"done: {p.step} steps, {summary['epochs']} epochs, stopped by {stop_reason}, best dev "
        f"{METRIC_NAMES[t.early_stopping]} {summary['best_dev']:.2f}, {trained_s / 60:.1f} min"
        + (f" training + {after / 60:.1f} min test scoring and averaging (after the time "
           "budget)" if after >= 1 else ""),
        **summary,
    )  # fmt: skip
    return summary


def build_checked_model(cfg: Config, tokenizer: Tokenizer, device: torch.device) -> Seq2Seq:
    """Build the model after checking, on the meta device (no memory), that training it fits.

    Training needs about 16 bytes per parameter (weights, gradients, two Adam moments); a
    config asking for more than the device has fails here with one line, not an OOM kill.
    """
    sizes = (len(tokenizer.src), len(tokenizer.tgt), tokenizer.joint)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(cfg.model, *sizes).parameters())
    need, have = 16 * n_params, memory_bytes(device)
    if need > have:
        raise ConfigError(
            f"model: {cfg.model.arch} with hidden_size={cfg.model.hidden_size}, "
            f"ff_size={cfg.model.ff_size}, layers={cfg.model.enc_layers}+{cfg.model.dec_layers} "
            f"has {n_params:,} parameters, needing ~{need / 2**30:.1f} GiB to train; "
            f"{device.type} memory is {have / 2**30:.1f} GiB"
        )
    return build_model(cfg.model, *sizes)
