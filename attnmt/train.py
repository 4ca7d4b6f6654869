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
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from attnmt import distributed
from attnmt.board import Board
from attnmt.checkpoint import (
    BEST_FILE,
    CONFIG_FILE,
    LAST_FILE,
    LOG_JSONL,
    LOG_TEXT,
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
    write_run_files,
)
from attnmt.config import Config, from_dict, read_yaml
from attnmt.data import BucketSampler, ParallelText, collate, read_split_text
from attnmt.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    TrainingError,
    TrainingInterrupted,
)
from attnmt.evaluate import score, search_options, translate_lines
from attnmt.finetune import inherit
from attnmt.kernels import (
    CPU_MATMUL_INSTRUCTIONS,
    PRECISION_DTYPES,
    cpu_matmul_hardware,
    limit_onednn_kernel_cache,
    matmul_backend,
)
from attnmt.kernels.matmul import active as active_backend
from attnmt.model import build_model
from attnmt.processes import run_in_child
from attnmt.schedules import budget_lr, inverse_sqrt_lr, teacher_forcing_ratio, warmup_lr
from attnmt.seq2seq import Seq2Seq
from attnmt.store import (
    STORE_DIR,
    TokenStore,
    build_store,
    check_fingerprint,
    default_workers,
    open_store,
)
from attnmt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

# Keys that may change between a run and its resumption: they do not change what a step computes
# (device and threads only up to floating-point rounding).
RESUMABLE_KEYS = (
    "train.max_steps",
    "train.max_epochs",
    "train.patience",
    "train.device",
    "train.threads",
    "train.matmul",
    "train.compile",
    "train.log_every",
    "train.keep_best",
    "train.keep_last",
    "train.average_last",
    "train.log_samples",
    "train.tensorboard",
    "train.time_budget",
    "train.max_bad_steps",
    "train.eval_batch_tokens",
    "data.workers",
    "decode.",
)


METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "loss": "loss"}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without one is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda': no CUDA device is available (use auto or cpu)")
    return torch.device(name)


class RunLog:
    """Human-readable lines on stderr and in train.log; the same events as JSON lines."""

    def __init__(self, out: Path, quiet: bool = False, enabled: bool = True) -> None:
        """enabled=False (ranks other than 0 of a multi-process run) logs nothing."""
        self.enabled = enabled
        self.quiet = quiet
        self.board: Board | None = None  # TensorBoard, once setup opened it
        if enabled:
            self.text = open(out / LOG_TEXT, "a", encoding="utf-8")  # noqa: SIM115 (see close)
            self.jsonl = open(out / LOG_JSONL, "a", encoding="utf-8")  # noqa: SIM115

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
            if echo and not self.quiet:
                tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        """Close the log files (closing twice is harmless)."""
        if self.enabled:
            self.text.close()
            self.jsonl.close()
        if self.board is not None:
            self.board.close()


@dataclass
class EncodedSplit:
    """A small split (dev) encoded in memory."""

    src: list[list[int]]
    tgt: list[list[int]]


def encode_split(text: ParallelText, tokenizer: Tokenizer) -> EncodedSplit:
    return EncodedSplit(tokenizer.src.encode(text.src), tokenizer.tgt.encode(text.tgt))


@dataclass
class Progress:
    """Counters that decide what training does next; saved in every checkpoint."""

    step: int = 0
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of `epoch` already consumed (trained on or skipped)
    best_score: float = -math.inf  # of train.early_stopping's metric, higher is better
    bad_validations: int = 0  # validations since the last improvement (early stopping)
    plateau_scale: float = 1.0
    plateau_bad: int = 0
    bad_steps_in_a_row: int = 0
    skipped_steps: int = 0
    last_validated: int = -1
    elapsed_s: float = 0.0
    validation_s: float = 0.0  # the longest validation: what a time budget keeps for the last
    warmup_used: float = 0.0  # lr_schedule budget: the share of the budget spent by warmup's end
    checkpoints: list[list[Any]] = field(default_factory=list)  # [step, dev score or None]

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        """From a checkpoint's saved counters (older ones named best_score best_bleu)."""
        state = dict(state)
        if "best_bleu" in state:
            state["best_score"] = state.pop("best_bleu")
        return cls(**state)


def learning_rate(
    step: int, cfg: Config, plateau_scale: float, budget: tuple[float, float] = (0.0, 0.0)
) -> float:
    """The lr of training step `step`; `budget`: the shares of train.time_budget spent, now
    and when warmup ended (lr_schedule budget)."""
    t = cfg.train
    if t.lr_schedule == "budget":
        return budget_lr(step, t.lr, t.warmup_steps, *budget)
    if t.lr_schedule == "inverse_sqrt":
        return max(inverse_sqrt_lr(step, t.lr, t.warmup_steps), t.min_lr)
    return max(warmup_lr(step, t.lr, t.warmup_steps) * plateau_scale, t.min_lr)


def rng_state(tf_generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a step can draw from, as plain tensors and numbers."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "teacher_forcing": tf_generator.get_state(),
    }


def set_rng_state(state: dict[str, Any], tf_generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
         n["cached_gaussian"])
    )  # fmt: skip
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tf_generator.set_state(state["teacher_forcing"])


def check_resumable(saved: Config, new: Config) -> None:
    """Refuse to resume with a config that would compute different steps."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(saved.model_dump(mode="json")), flat(new.model_dump(mode="json"))
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key) and not key.startswith(RESUMABLE_KEYS):
            raise ConfigError(
                f"--resume: '{key}' = {b.get(key)!r} differs from the run's {a.get(key)!r}; "
                f"only {', '.join(k.rstrip('.') for k in RESUMABLE_KEYS)} may change on resume"
            )


def all_finite(model: Seq2Seq) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@torch.no_grad()
def dev_loss(model: Seq2Seq, split: EncodedSplit, batch_tokens: int, device: torch.device) -> float:
    """Mean per-token cross-entropy (no label smoothing) over the dev set."""
    model.eval()
    sampler = BucketSampler(
        [len(s) + 1 for s in split.src], [len(t) + 1 for t in split.tgt], batch_tokens, seed=0
    )
    total, tokens = 0.0, 0
    for idx in sampler.epoch(0):
        batch = collate(
            [split.src[i] for i in idx], [split.tgt[i] for i in idx], idx, PAD_ID, BOS_ID, EOS_ID
        ).to(device)
        loss, n = model.loss(batch)
        total += float(loss)
        tokens += n
    model.train()
    return total / max(tokens, 1)


class StopSignals:
    """SIGINT/SIGTERM/SIGHUP (a closed terminal): the first asks the loop to checkpoint and stop
    after the current step;
    a second one exits at once (every file on disk is already complete, writes are atomic)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    dev_data: EncodedSplit
    dev_text: ParallelText
    model: Seq2Seq
    step_model: nn.Module  # what runs a step: the model, or its DDP / compiled wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: str  # the number format trained in: train.precision with `auto` resolved
    sampler: BucketSampler
    tf_generator: torch.Generator  # scheduled sampling's coin flips
    progress: Progress
    start_time: float = field(default_factory=time.time)

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
                return train_loop(setup(cfg, out, resume, ranks, device, log))
        finally:
            log.close()  # also when training fails: no log file is left open
            ranks.shutdown()


def train_loop(run: Run) -> dict[str, Any]:
    """Epochs of batches; a step per batch, a validation every train.eval_every steps."""
    t, p, ranks = run.cfg.train, run.progress, run.ranks
    meter = ThroughputMeter()
    bar = ProgressBar(t.max_steps, p.step, enabled=not run.log.quiet and ranks.is_main)
    stop_reason = "max_steps" if p.step >= t.max_steps else None
    with StopSignals() as signals:
        while stop_reason is None and p.epoch <= t.max_epochs:
            batches = run.sampler.epoch(p.epoch)
            # One step takes one batch per rank; a remainder too small for every rank is left.
            while stop_reason is None and p.batch_in_epoch + ranks.world <= len(batches):
                idx = batches[p.batch_in_epoch + ranks.rank]
                p.batch_in_epoch += ranks.world
                result = train_step(run, idx, signals.signum is not None)
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
    if ranks.is_main and run.cfg.data.test is not None and (run.out / BEST_FILE).is_file():
        test_with(run, run.out / BEST_FILE, "best")
    if ranks.is_main and t.average_last:
        average_at_end(run)
    return finish(run, stop_reason or "max_epochs")


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
    tokenizer, train_data, dev_data, dev_text = prepare_data(
        cfg, out, ranks, checkpoint is not None, log
    )
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
        cfg, out, ranks, device, log, tokenizer, train_data, dev_data, dev_text, model, model,
        optimizer,
        # fp16 needs loss scaling to keep small gradients from underflowing; bf16, fp32 do not.
        torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        precision,
        sampler, tf_generator, Progress(), start_time,
    )  # fmt: skip
    if checkpoint is not None:
        restore(run, *checkpoint)
    elif t.init_from is not None:
        start_from(run, t.init_from)
    if t.tensorboard and ranks.is_main:
        # When resuming, what the interrupted run logged after its checkpoint is hidden.
        log.board = Board(out, purge_step=run.progress.step + 1 if checkpoint else None)
    # DDP averages the gradients over the ranks during backward; it hooks into forward, which
    # is the model's training loss. torch.compile wraps what runs the step.
    if ranks.world > 1:
        ids = [device.index] if device.type == "cuda" else None
        run.step_model = DistributedDataParallel(model, device_ids=ids)
    if t.compile:
        run.step_model = cast(nn.Module, torch.compile(run.step_model))
    log_model(run, resumed=checkpoint is not None)
    if resume and checkpoint is None:
        log.event("resume", "--resume: no checkpoint in this directory yet; starting at step 0")
    return run


def resolve_precision(precision: str, device: torch.device) -> str:
    """train.precision as trained: `auto` is bf16 where the device multiplies bf16 natively (a
    CUDA GPU that supports it; a CPU with AMX or AVX512-BF16), fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and cpu_matmul_hardware("bf16") else "fp32"


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python's, NumPy's and torch's generators; returns scheduled sampling's own
    generator, so that its coin flips are reproducible apart from dropout's draws."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


def prepare_data(
    cfg: Config, out: Path, ranks: distributed.Ranks, resuming: bool, log: RunLog
) -> tuple[Tokenizer, TokenStore, EncodedSplit, ParallelText]:
    """Train the tokenizer on the training files read as a stream (rank 0; loaded when
    resuming), write the run files, encode the training pairs into the memory-mapped store
    (rank 0; reused by --resume after checking that the files did not change; the other ranks
    map it), and read and encode the dev set."""
    data = cfg.data
    files = [f for split in (*data.corpora, data.dev) for f in split.files]
    dev_text = read_split_text(data.dev)
    if not dev_text.src:
        raise DataError(f"{data.dev.name}: no sentence pairs with text on both sides")
    if resuming:
        check_resumable(from_dict(read_yaml(out / CONFIG_FILE)), cfg)
    if ranks.is_main:
        tokenizer = make_tokenizer(cfg, out, resuming)
        write_run_files(out, cfg, tokenizer)  # on resume: the config's resumable changes
        ensure_store(cfg, out, tokenizer, resuming, files)
    ranks.barrier()  # the tokenizer and the store are complete before the others read them
    if not ranks.is_main:
        tokenizer = Tokenizer.load(out, cfg.tokenizer.joint)
    store = open_store(out)
    assert store is not None
    log_data(log, store, dev_text, tokenizer)
    return tokenizer, store, encode_split(dev_text, tokenizer), dev_text


def make_tokenizer(cfg: Config, out: Path, resuming: bool) -> Tokenizer:
    """The run's own (resuming), the fine-tuned model's (train.init_from), the given one
    (tokenizer.model), or a new one trained on a sample of the training data."""
    joint = cfg.tokenizer.joint
    if resuming:
        return Tokenizer.load(out, joint)
    if cfg.train.init_from is not None:
        return Tokenizer.load(cfg.train.init_from, joint)
    if cfg.tokenizer.given is not None:
        return Tokenizer.from_files(cfg.tokenizer.given)
    return Tokenizer.train_on_files(cfg.data.corpora, cfg.tokenizer, cfg.train.seed)


def ensure_store(
    cfg: Config, out: Path, tokenizer: Tokenizer, resuming: bool, files: list[Path]
) -> None:
    """Reuse the encoded store when resuming (refused if a file in `files` changed), else
    build it, in a child process: what streaming the corpus leaves in Python's allocator goes
    with it, and Ctrl-C does not wait for the encoding workers."""
    if resuming and open_store(out) is not None:
        check_fingerprint(out / STORE_DIR, files)
        return
    data = cfg.data
    protos = (tokenizer.src.proto, tokenizer.tgt.proto)
    workers = data.workers or default_workers()

    def encode() -> bytes:
        build_store(out, list(data.corpora), protos, data.max_len, workers, files)
        return b""

    run_in_child(encode)


def log_corpora(log: RunLog, cfg: Config, sampler: BucketSampler) -> None:
    """The `corpora` event: each training corpus's pairs, weight and share of an epoch."""
    shares = sampler.shares()
    total = max(1, sum(shares))
    rows = [
        {"corpus": str(c.name), "pairs": n, "weight": c.weight, "per_epoch": k, "share": k / total}
        for c, n, k in zip(cfg.data.corpora, sampler.corpus_pairs, shares, strict=True)
    ]
    log.event(
        "corpora",
        "corpora: " + "; ".join(
            f"{Path(r['corpus']).name}: {r['pairs']:,} pairs, weight {r['weight']:g}, "
            f"{100 * r['share']:.1f} % of an epoch" for r in rows
        ),
        corpora=rows,
    )  # fmt: skip


def log_data(log: RunLog, store: TokenStore, dev_text: ParallelText, tokenizer: Tokenizer) -> None:
    """The `data` event: pair counts of both splits, what was skipped, the vocabularies."""
    meta, joint = store.meta, " (joint)" if tokenizer.joint else ""
    if not len(store):
        raise DataError(
            f"every training pair is longer than data.max_len = {meta['max_len']} subwords"
        )
    log.event(
        "data",
        f"train: {len(store)} pairs ({meta['skipped_empty']} skipped as empty, "
        f"{meta['skipped_too_long']} longer than {meta['max_len']} subwords) | dev: "
        f"{len(dev_text.src)} pairs ({dev_text.skipped_empty} skipped as empty) | vocab: "
        f"{len(tokenizer.src)} src, {len(tokenizer.tgt)} tgt{joint}",
        train_pairs=len(store),
        train_skipped_empty=meta["skipped_empty"],
        train_skipped_too_long=meta["skipped_too_long"],
        dev_pairs=len(dev_text.src),
        dev_skipped_empty=dev_text.skipped_empty,
        src_vocab=len(tokenizer.src),
        tgt_vocab=len(tokenizer.tgt),
    )


def restore(run: Run, weights_path: Path, state_path: Path) -> None:
    """Load a checkpoint's weights, optimizer, scaler, counters and RNG states into run."""
    state = load_train_state(state_path)
    load_weights(run.model, weights_path, run.device)
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
        save_weights(run.model, run.out / LAST_FILE)


def start_from(run: Run, source_dir: Path) -> None:
    """Fine-tuning: load the source model's best weights; log them with their dev loss."""
    weights = resolve_weights(source_dir, "best")
    load_weights(run.model, weights, run.device)
    loss = dev_loss(run.model, run.dev_data, run.cfg.train.eval_batch_tokens, run.device)
    run.log.event(
        "init_from",
        f"fine-tuning from {weights} | step-0 dev loss {loss:.3f}",
        weights=str(weights),
        dev_loss=loss,
    )


def log_model(run: Run, resumed: bool) -> None:
    """The `model` event (architecture, size, device, number formats), and the CPU notes."""
    t, device = run.cfg.train, run.device
    n_params = sum(p.numel() for p in run.model.parameters())
    mm_backend = active_backend() if device.type == "cpu" else "blas"
    precision = run.precision
    fp32_cpu = device.type == "cpu" and precision == "fp32"
    run.log.event(
        "model",
        f"model: {run.cfg.model.arch}, {n_params:,} parameters, device {device}, {precision}"
        + (" (train.precision auto)" if t.precision == "auto" else "")
        + (f", {mm_backend} matmuls" if fp32_cpu else "")
        + (f", {run.ranks.world} processes" if run.ranks.world > 1 else "")
        + (f" | resumed at step {run.progress.step}" if resumed else ""),
        arch=run.cfg.model.arch,
        parameters=n_params,
        device=str(device),
        precision=precision,
        resumed_step=run.progress.step if resumed else None,
        matmul=mm_backend,
    )
    if device.type == "cpu" and (not fp32_cpu or mm_backend == "onednn"):
        limit_onednn_kernel_cache()  # before the first step: oneDNN reads it once
    if device.type == "cpu" and not fp32_cpu and not cpu_matmul_hardware(precision):
        run.log.event(
            "precision",
            f"train.precision={precision}: this CPU has no {precision} matmul "
            f"instructions ({CPU_MATMUL_INSTRUCTIONS[precision]}); expect it slower than fp32",
            precision=precision,
            hardware=False,
        )


# --- one step ---


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


def train_step(run: Run, idx: list[int], signalled: bool) -> StepResult:
    """Train on the batch of pairs `idx`: forward, backward, clip, and (if every loss and
    gradient is finite) an optimizer update. `signalled`: this rank received a stop signal."""
    t, p, ranks = run.cfg.train, run.progress, run.ranks
    src, tgt = run.train_data.pairs(idx)
    batch = collate(src, tgt, idx, PAD_ID, BOS_ID, EOS_ID).to(run.device)
    step = p.step + 1
    if ranks.world > 1:
        torch.manual_seed(distributed.step_seed(t.seed, ranks.rank, p.step))
        run.tf_generator.manual_seed(distributed.step_seed(t.seed + 1, ranks.rank, p.step))
    n_tokens = batch.n_tokens
    positions = batch.src.numel() + batch.tgt_out.numel()
    real = n_tokens + int((~batch.src_pad_mask).sum())
    # Every rank normalises by the tokens of all ranks; DDP's mean of the ranks' gradients is
    # then the gradient of the loss per token of the whole step. The time budget is rank 0's.
    step_tokens, step_positions, step_real, budget_used = ranks.sum(
        [float(n_tokens), float(positions), float(real), run.budget_used() * ranks.is_main]
    )
    if step <= t.warmup_steps:
        p.warmup_used = budget_used
    lr, tf = step_schedules(step, run.cfg, p.plateau_scale, (budget_used, p.warmup_used))
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with run.autocast():
        loss_sum, _ = run.step_model(batch, tf, t.label_smoothing, run.tf_generator)
    loss = loss_sum / n_tokens if ranks.world == 1 else loss_sum * (ranks.world / step_tokens)
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        run.model.parameters(), t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
    )
    # The time budget's share spent after the step is rank 0's (every rank stops together).
    step_loss, signals, used = ranks.sum(
        [float(loss_sum.detach()), float(signalled), run.budget_used() * ranks.is_main]
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


def step_schedules(
    step: int, cfg: Config, plateau_scale: float, budget: tuple[float, float] = (0.0, 0.0)
) -> tuple[float, float]:
    """Learning rate and teacher-forcing ratio of training step `step` (counting from 1)."""
    return learning_rate(step, cfg, plateau_scale, budget), teacher_forcing_ratio(
        step, cfg.train.teacher_forcing
    )


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


@dataclass
class Throughput:
    tokens_per_s: float
    tokens: int
    seconds: float
    padding: float  # share of padded source + target positions


class ThroughputMeter:
    """Target tokens per second and padding over the steps since the last `take`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self.start, self.tokens, self.positions, self.real = now, 0, 0.0, 0.0

    def add(self, result: StepResult) -> None:
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


def log_train(run: Run, result: StepResult, window: Throughput) -> None:
    """The `train` event: the step's loss and schedules, the window's throughput."""
    run.log.event(
        "train",
        None,
        step=result.step,
        epoch=run.progress.epoch,
        loss=result.loss,
        lr=result.lr,
        tokens_per_s=round(window.tokens_per_s, 1),
        tokens=window.tokens,
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
    loss = dev_loss(model, run.dev_data, t.eval_batch_tokens, run.device)
    hyps = translate_lines(
        model, run.tokenizer, run.dev_text.src, search_options(run.cfg.decode, beam=t.eval_beam),
        batch_tokens=t.eval_batch_tokens, device=run.device,
    )  # fmt: skip
    scores = score(hyps, run.dev_text.tgt)
    metric = {"bleu": scores.bleu, "chrf": scores.chrf, "loss": -loss}[t.early_stopping]
    finite = math.isfinite(loss) and all_finite(model)
    improved = finite and metric > p.best_score
    if improved:
        p.best_score, p.bad_validations, p.plateau_bad = metric, 0, 0
        save_weights(model, run.out / BEST_FILE)
    else:
        p.bad_validations += 1
        p.plateau_bad += 1
        if t.lr_schedule == "plateau" and p.plateau_bad > t.plateau_patience:
            p.plateau_scale *= t.plateau_factor
            p.plateau_bad = 0
    save_weights(model, run.out / LAST_FILE)
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
        f"BLEU {scores.bleu:.2f}{star['bleu']} | chrF {scores.chrf:.2f}{star['chrf']} | "
        f"lr {lr:.2e} | tf {tf:.2f} | {run.elapsed():.0f} s",
        step=p.step,
        epoch=p.epoch,
        dev_loss=loss,
        dev_ppl=ppl,
        dev_bleu=scores.bleu,
        dev_chrf=scores.chrf,
        metric=t.early_stopping,
        best=p.best_score if t.early_stopping != "loss" else -p.best_score,
        improved=improved,
        lr=lr,
        teacher_forcing=tf,
        elapsed_s=round(run.elapsed(), 1),
    )
    log_samples(run, hyps)
    return p.bad_validations >= t.patience


def log_samples(run: Run, hyps: list[str]) -> None:
    """The first train.log_samples dev sentences with reference and translation, as JoeyNMT
    shows them: a `samples` event, and a line per example in train.log and on stderr."""
    n = min(run.cfg.train.log_samples, len(hyps))
    if n == 0:
        return
    text = run.dev_text
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
    save_checkpoint(run.out, run.model, state, records, t.keep_last, t.keep_best)
    p.checkpoints = [[r.step, r.score] for r in records]


def interrupt(run: Run, signum: int) -> None:
    """Stop on a signal: checkpoint (unless this step was just validated, which saved one),
    make the weights last.safetensors so the directory translates, and raise."""
    p = run.progress
    if p.last_validated != p.step and run.ranks.is_main:
        save_weights(run.model, run.out / LAST_FILE)
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
    into averaged.safetensors, log it, and score the test set with it too."""
    n = min(run.cfg.train.average_last, len(kept_checkpoints(run.out)))
    if n == 0:
        return
    path, steps = average_checkpoints(run.out, n, "last")
    run.log.event(
        "average", f"averaged steps {', '.join(map(str, steps))} -> {path.name}", steps=steps
    )
    if run.cfg.data.test is not None:
        test_with(run, path, "averaged")


def test_with(run: Run, weights: Path, which: str) -> None:
    """Translate data.test with the weights in `weights` (`which`: best or averaged) and log
    its BLEU and chrF."""
    cfg = run.cfg
    assert cfg.data.test is not None
    test_text = read_split_text(cfg.data.test)
    load_weights(run.model, weights, run.device)
    hyps = translate_lines(
        run.model, run.tokenizer, test_text.src, search_options(cfg.decode),
        batch_tokens=cfg.train.eval_batch_tokens, device=run.device,
    )  # fmt: skip
    s = score(hyps, test_text.tgt)
    run.log.event(
        "test",
        f"test ({cfg.data.test.name.name}, {which} weights, beam {cfg.decode.beam}): "
        f"BLEU {s.bleu:.2f} | chrF {s.chrf:.2f} | {s.bleu_signature}",
        pairs=len(test_text.src),
        weights=which,
        beam=cfg.decode.beam,
        skipped_empty=test_text.skipped_empty,
        **s.as_dict(),
    )


def finish(run: Run, stop_reason: str) -> dict[str, Any]:
    """The `done` event; returns the run's summary."""
    p, t = run.progress, run.cfg.train
    summary = {
        "steps": p.step,
        "epochs": min(p.epoch, t.max_epochs),
        "early_stopping": t.early_stopping,
        "best_dev": round(p.best_score if t.early_stopping != "loss" else -p.best_score, 4),
        "stop_reason": stop_reason,
        "skipped_nonfinite_steps": p.skipped_steps,
        "elapsed_s": round(run.elapsed(), 1),
    }
    run.log.event(
        "done",
        f"done: {p.step} steps, {summary['epochs']} epochs, stopped by {stop_reason}, best dev "
        f"{METRIC_NAMES[t.early_stopping]} {summary['best_dev']:.2f}, "
        f"{run.elapsed() / 60:.1f} min",
        **summary,
    )
    return summary


def build_checked_model(cfg: Config, tokenizer: Tokenizer, device: torch.device) -> Seq2Seq:
    """Build the model after checking, on the meta device (no memory), that training it fits.

    Training needs about 16 bytes per parameter (weights, gradients, two Adam moments); a
    config asking for more than the device has fails here with one line, not an OOM kill.
    """
    sizes = (len(tokenizer.src), len(tokenizer.tgt), tokenizer.joint)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(cfg.model, *sizes).parameters())
    need = 16 * n_params
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[1]
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            f"model: {cfg.model.arch} with hidden_size={cfg.model.hidden_size}, "
            f"ff_size={cfg.model.ff_size}, layers={cfg.model.enc_layers}+{cfg.model.dec_layers} "
            f"has {n_params:,} parameters, needing ~{need / 2**30:.1f} GiB to train; "
            f"{device.type} memory is {have / 2**30:.1f} GiB"
        )
    return build_model(cfg.model, *sizes)
