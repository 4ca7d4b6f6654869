"""A training run's setup: seed, data, tokenizer, model, optimizer, the last checkpoint restored
when resuming, and `Run`, everything the loop's parts work with.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from attnmt.config import Config
from attnmt.data.batches import Batch, BucketSampler, Prefetcher, collate, pad_to_bucket
from attnmt.data.sampling import Resegmenter
from attnmt.data.store import TokenStore
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from attnmt.device import (
    PRECISION_DTYPES,
    ThreadFit,
    limit_onednn_kernel_cache,
    memory_bytes,
    missing_hardware,
    reproducible_blas,
    resolve_precision,
)
from attnmt.errors import CheckpointError, ConfigError
from attnmt.kernels.matmul import active_backend
from attnmt.models.build import build_model
from attnmt.models.directory import (
    LAST_FILE,
    load_base,
    load_model_dir,
    load_weights,
    read_run_files,
    resolve_weights,
    save_weights,
    tokenizer_digest,
    tokenizer_shas,
)
from attnmt.models.lora import attach_adapters, has_adapters
from attnmt.models.seq2seq import Seq2Seq
from attnmt.training import distributed
from attnmt.training.board import Board
from attnmt.training.checkpoints import latest_checkpoint, load_train_state
from attnmt.training.prepare import DevSet, prepare_data
from attnmt.training.resume import Progress, seed_everything, set_rng_state
from attnmt.training.runlog import RunLog, log_corpora
from attnmt.training.scoring import score_dev_sets
from attnmt.training.tm_pairs import write_tm_pairs

# How often a CPU run chooses its threads again: a CPU that other processes let go of is used
# within about two of these, one they take is given back as soon.
THREADS_EVERY_S = 30.0


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
    resegment: Resegmenter | None = None  # tokenizer.sampling: segmentations drawn per epoch
    threads: ThreadFit | None = None  # the CPU threads, chosen as the load changes (fit_threads)

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
    threads = training_threads(t.threads, device)
    tf_generator = seed_everything(t.seed)
    if cfg.data.tm is not None and ranks.is_main:  # before the clock: the lookups are done
        write_tm_pairs(cfg.data, out, log)  # once, not training time (docs/tm.md)
    start_time = time.time()
    checkpoint = latest_checkpoint(out) if resume else None
    tokenizer, train_data, dev_sets = prepare_data(cfg, out, ranks, checkpoint is not None, log)
    fit_threads(threads, log, step=0)
    model = build_checked_model(cfg, tokenizer, device)
    digest = tokenizer_digest(tokenizer_shas(tokenizer))
    adapt(model, cfg, out, device, digest)
    model.to(device).train()
    optimizer = torch.optim.Adam(  # fused: one kernel for all parameters, not a few per tensor
        [p for p in model.parameters() if p.requires_grad], lr=t.lr, betas=t.adam_betas,
        weight_decay=t.weight_decay, fused=True,
    )  # fmt: skip
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
        weights=[c.weight for c in cfg.data.corpora]
        + ([cfg.data.tm.weight] if cfg.data.tm is not None else []),
    )
    if len(sampler.corpus_pairs) > 1:
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
    run.threads = threads
    run.tokenizer_digest = digest
    run.resegment = Resegmenter.of(cfg, tokenizer)
    if checkpoint is not None:
        restore(run, *checkpoint)
    if t.tensorboard and ranks.is_main:
        # When resuming, what the interrupted run logged after its checkpoint is hidden.
        log.board = Board(out, purge_step=run.progress.step + 1 if checkpoint else None)
    if checkpoint is None and t.init_from is not None:
        start_from(run, t.init_from, t.init_weights)  # its step-0 scores reach TensorBoard
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


def training_threads(fixed: int, device: torch.device) -> ThreadFit | None:
    """The CPU threads of a run (train.threads, or 0: chosen), None on a GPU. Chosen again
    every THREADS_EVERY_S where a step's numbers do not depend on the thread count (MKL's
    strict mode, kernels.fixed_order), else once (docs/reliability.md). Called before the
    run's first matmul: MKL reads its mode once."""
    same_on_any_threads = reproducible_blas()
    if device.type != "cpu" and not fixed:
        return None
    every_s = THREADS_EVERY_S if same_on_any_threads else None
    return ThreadFit(fixed or None, torch.get_num_threads(), every_s=every_s)


def fit_threads(threads: ThreadFit | None, log: RunLog, step: int) -> None:
    """Choose the CPU threads (train.threads, or those other processes leave free) when due;
    a count below the CPUs at the start, and every change after, is a line in the log and a
    `threads` event."""
    if threads is None:
        return
    before = threads.threads
    now = threads.apply()
    if now == before or threads.fixed or (not before and now == threads.most):
        return
    if now < threads.most:
        line = f"other processes hold CPUs: training on {now} of {threads.most} threads"
    else:
        line = f"CPUs let go by other processes: training on {now} of {threads.most} threads"
    log.event("threads", f"{line} (train.threads fixes the count)", threads=now, step=step)


def adapt(model: Seq2Seq, cfg: Config, out: Path, device: torch.device, digest: str) -> None:
    """train.adapters: the base model's weights first (the adapters start from them,
    frozen), then the LoRA adapters, the only parameters that train; without: nothing."""
    if cfg.train.adapters is None:
        return
    load_base(out, read_run_files(out)[1], model, device, digest)
    if attach_adapters(model, cfg.train.adapters) == 0:
        raise ConfigError(
            "train.adapters: LoRA adapts attention projections, which a model.arch "
            f"{cfg.model.arch} model has none of"
        )


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


def start_from(run: Run, source_dir: Path, which: str = "best") -> None:
    """Fine-tuning: load the source model's weights (`which`: best, last, averaged, step-N);
    log them with their dev scores (the step-0 point of the curves: what fine-tuning starts
    from)."""
    weights = resolve_weights(source_dir, which)
    if read_run_files(source_dir)[0].train.adapters is not None:
        # Its weights files hold its adapters: the model they compute, merged, is the start.
        merged = load_model_dir(source_dir, which, run.device)[2]
        run.model.load_state_dict(merged.state_dict())
    elif not has_adapters(run.model):  # with adapters, setup loaded it under them
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
    n_trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    mm_backend = active_backend() if device.type == "cpu" else "blas"
    precision = run.precision
    fp32_cpu = device.type == "cpu" and precision == "fp32"
    # Only where the config leaves the precision to its default: a chosen fp32 is a choice.
    chosen = "precision" in t.model_fields_set
    faster = fp32_cpu and not chosen and resolve_precision("auto", device) == "bf16"
    batches = t.accumulate * run.ranks.world  # per update: accumulated x processes
    unit = f"{t.batch_sentences:,} sentences" if t.batch_sentences else f"{t.batch_tokens:,} tokens"
    run.log.event(
        "model",
        f"model: {run.cfg.model.arch}, {n_params:,} parameters"
        + (f" ({n_trained:,} trained: the LoRA adapters)" if n_trained < n_params else "")
        + f", device {device}, {precision}"
        + (" (train.precision auto)" if t.precision == "auto" else "")
        + (" (bf16 is native on this CPU: train.precision auto trains faster)" if faster else "")
        + (f", {mm_backend} matmuls" if fp32_cpu else "")
        + (f", {run.ranks.world} processes" if run.ranks.world > 1 else "")
        + (f" | an update: {batches} batches of up to {unit}" if batches > 1 else "")
        + (f" | resumed at step {run.progress.step}" if resumed else ""),
        batches_per_update=batches,
        arch=run.cfg.model.arch,
        parameters=n_params,
        trained_parameters=n_trained,
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


def _pairs(run: Run, idx: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """A batch's pairs as its epoch segments them (the store's, or drawn: tokenizer.sampling).
    The epoch is the loop's: the prefetcher makes a step's batches only within an epoch."""
    src, tgt = run.train_data.pairs(idx)
    if run.resegment is None:
        return src, tgt
    return run.resegment.pairs(src, tgt, idx, run.progress.epoch)


def host_batches(run: Run, idxs: list[list[int]]) -> list[Batch]:
    """The step's batches on the host, ready to copy: collated, grown to a bucketed shape
    under CUDA graphs (which are recorded per shape), pinned for a GPU."""
    made = [collate(*_pairs(run, idx), idx, PAD_ID, BOS_ID, EOS_ID) for idx in idxs]
    if run.cfg.train.cuda_graphs:
        made = [pad_to_bucket(b, BOS_ID, EOS_ID) for b in made]
    return [b.pinned() for b in made] if run.device.type == "cuda" else made
