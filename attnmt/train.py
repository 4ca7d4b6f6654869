"""The training loop: data and tokenizer setup, steps, validation, early stopping, resume.

Reads top to bottom: prepare the model directory, read and validate the data, train (or, when
resuming, load) the SentencePiece model, build the model, restore the last checkpoint if asked,
then one flat loop over epochs and batches with a validation and checkpoint every
`train.eval_every` steps.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from attnmt import distributed, matmul
from attnmt.checkpoint import (
    BEST_FILE,
    CONFIG_FILE,
    LAST_FILE,
    LOG_JSONL,
    LOG_TEXT,
    STATE_FORMAT_VERSION,
    CheckpointRecord,
    latest_checkpoint,
    load_train_state,
    load_weights,
    prepare_output_dir,
    save_checkpoint,
    save_weights,
    write_run_files,
)
from attnmt.config import Config, from_dict
from attnmt.data import BucketSampler, ParallelText, collate, read_parallel
from attnmt.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    TrainingError,
    TrainingInterrupted,
)
from attnmt.evaluate import score, search_options, translate_lines
from attnmt.model import Seq2Seq, build_model
from attnmt.ops import CPU_MATMUL_INSTRUCTIONS, PRECISION_DTYPES, cpu_matmul_hardware
from attnmt.schedules import inverse_sqrt_lr, teacher_forcing_ratio, warmup_lr
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
    "train.max_bad_steps",
    "train.eval_batch_tokens",
    "decode.",
)


# oneDNN kernels kept for low-precision CPU matmuls (see _train).
ONEDNN_CACHE_CAPACITY = 64


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
        if enabled:
            self.text = open(out / LOG_TEXT, "a", encoding="utf-8")  # noqa: SIM115 (see close)
            self.jsonl = open(out / LOG_JSONL, "a", encoding="utf-8")  # noqa: SIM115

    def event(self, kind: str, line: str | None = None, **fields: Any) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"event": kind, **fields}) + "\n")
        self.jsonl.flush()
        if line is not None:
            self.text.write(line + "\n")
            self.text.flush()
            if not self.quiet:
                tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        """Close the log files (closing twice is harmless)."""
        if self.enabled:
            self.text.close()
            self.jsonl.close()


@dataclass
class EncodedSplit:
    src: list[list[int]]
    tgt: list[list[int]]


def encode_and_filter(
    text: ParallelText, tokenizer: Tokenizer, max_len: int
) -> tuple[EncodedSplit, int]:
    """Encode a split and drop pairs with either side longer than max_len subwords."""
    src = tokenizer.src.encode(text.src)
    tgt = tokenizer.tgt.encode(text.tgt)
    keep = [i for i in range(len(src)) if len(src[i]) <= max_len and len(tgt[i]) <= max_len]
    return EncodedSplit([src[i] for i in keep], [tgt[i] for i in keep]), len(src) - len(keep)


@dataclass
class Progress:
    """Counters that decide what training does next; saved in every checkpoint."""

    step: int = 0
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of `epoch` already consumed (trained on or skipped)
    best_bleu: float = -math.inf
    bad_validations: int = 0  # validations since the last improvement (early stopping)
    plateau_scale: float = 1.0
    plateau_bad: int = 0
    bad_steps_in_a_row: int = 0
    skipped_steps: int = 0
    last_validated: int = -1
    elapsed_s: float = 0.0
    checkpoints: list[list[Any]] = field(default_factory=list)  # [step, dev BLEU or None]


def learning_rate(step: int, cfg: Config, plateau_scale: float) -> float:
    t = cfg.train
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


def test_with_best(
    model: Seq2Seq, tokenizer: Tokenizer, cfg: Config, out: Path, device: torch.device, log: RunLog
) -> None:
    """Translate data.test with the best weights and log its BLEU and chrF."""
    assert cfg.data.test is not None
    test_text = read_parallel(cfg.data.test.src, cfg.data.test.tgt)
    load_weights(model, out / BEST_FILE, device)
    hyps = translate_lines(
        model, tokenizer, test_text.src, search_options(cfg.decode), cfg.train.eval_batch_tokens,
        device,
    )  # fmt: skip
    s = score(hyps, test_text.tgt)
    log.event(
        "test",
        f"test ({cfg.data.test.src.name}, best weights, beam {cfg.decode.beam}): "
        f"BLEU {s.bleu:.2f} | chrF {s.chrf:.2f} | {s.bleu_signature}",
        pairs=len(test_text.src),
        beam=cfg.decode.beam,
        skipped_empty=test_text.skipped_empty,
        **s.as_dict(),
    )


class StopSignals:
    """SIGINT/SIGTERM: the first asks the loop to checkpoint and stop after the current step;
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
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(
    cfg: Config, out: Path, overwrite: bool = False, resume: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Train a model from cfg into the model directory `out`; returns a summary."""
    t = cfg.train
    ranks = distributed.ranks_from_env()
    if ranks.is_main:
        prepare_output_dir(out, overwrite, resume)
    device = resolve_device(t.device)
    if ranks.world > 1:
        device = distributed.init(ranks, device)
        ranks.barrier()  # the model directory exists before any rank reads or writes it
    log = RunLog(out, quiet, enabled=ranks.is_main)
    try:
        return _train(cfg, out, resume, ranks, device, log)
    finally:
        log.close()  # also when training fails: no log file is left open
        ranks.shutdown()


def _train(
    cfg: Config,
    out: Path,
    resume: bool,
    ranks: distributed.Ranks,
    device: torch.device,
    log: RunLog,
) -> dict[str, Any]:
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    # Scheduled sampling draws from its own generator so its coin flips are reproducible.
    tf_generator = torch.Generator().manual_seed(t.seed + 1)
    checkpoint = latest_checkpoint(out) if resume else None

    start_time = time.time()
    train_text = read_parallel(cfg.data.train.src, cfg.data.train.tgt)
    dev_text = read_parallel(cfg.data.dev.src, cfg.data.dev.tgt)
    if not train_text.src:
        raise DataError(f"{cfg.data.train.src}: no sentence pairs with text on both sides")
    if not dev_text.src:
        raise DataError(f"{cfg.data.dev.src}: no sentence pairs with text on both sides")
    if checkpoint is not None:
        saved = yaml.safe_load((out / CONFIG_FILE).read_text(encoding="utf-8"))
        check_resumable(from_dict(saved), cfg)
        tokenizer = Tokenizer.load(out, cfg.tokenizer.joint)
        if ranks.is_main:
            write_run_files(out, cfg, tokenizer)  # the config may carry resumable changes
    elif not ranks.is_main:
        ranks.barrier()  # rank 0 trains SentencePiece and writes it; the others load it
        tokenizer = Tokenizer.load(out, cfg.tokenizer.joint)
    else:
        tokenizer = Tokenizer.train(
            train_text.src,
            train_text.tgt,
            cfg.tokenizer.vocab_size,
            cfg.tokenizer.joint,
            cfg.tokenizer.model_type,
            cfg.tokenizer.character_coverage,
        )
        write_run_files(out, cfg, tokenizer)
        ranks.barrier()
    train_data, too_long = encode_and_filter(train_text, tokenizer, cfg.data.max_len)
    dev_data, _ = encode_and_filter(dev_text, tokenizer, 1 << 30)
    if not train_data.src:
        raise DataError(
            f"every training pair is longer than data.max_len = {cfg.data.max_len} subwords"
        )
    log.event(
        "data",
        f"train: {len(train_data.src)} pairs ({train_text.skipped_empty} skipped as empty, "
        f"{too_long} longer than {cfg.data.max_len} subwords) | dev: {len(dev_data.src)} pairs "
        f"({dev_text.skipped_empty} skipped as empty) | vocab: {len(tokenizer.src)} src, "
        f"{len(tokenizer.tgt)} tgt{' (joint)' if tokenizer.joint else ''}",
        train_pairs=len(train_data.src),
        train_skipped_empty=train_text.skipped_empty,
        train_skipped_too_long=too_long,
        dev_pairs=len(dev_data.src),
        dev_skipped_empty=dev_text.skipped_empty,
        src_vocab=len(tokenizer.src),
        tgt_vocab=len(tokenizer.tgt),
    )

    model = build_checked_model(cfg, tokenizer, device)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    # fused: one kernel for all parameters instead of a handful of ops per tensor.
    optimizer = torch.optim.Adam(
        model.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay, fused=True
    )
    # fp16 needs loss scaling to keep small gradients from underflowing; bf16 and fp32 do not.
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    autocast_dtype = None if t.precision == "fp32" else PRECISION_DTYPES[t.precision]
    sampler = BucketSampler(
        [len(s) + 1 for s in train_data.src],
        [len(x) + 1 for x in train_data.tgt],
        t.batch_tokens,
        t.seed,
        max_sentences=t.batch_sentences,
    )
    progress = Progress()
    if checkpoint is not None:
        weights_path, state_path = checkpoint
        state = load_train_state(state_path)
        load_weights(model, weights_path, device)
        try:
            optimizer.load_state_dict(state["optimizer"])
            progress = Progress(**state["progress"])
            set_rng_state(state["rng"], tf_generator)
            if "scaler" in state:
                scaler.load_state_dict(state["scaler"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(
                f"{state_path}: cannot restore the training state ({type(e).__name__}: {e})"
            ) from None
        if ranks.is_main:
            save_weights(model, out / LAST_FILE)
    # DDP averages the gradients over the ranks during backward; it hooks into forward, which
    # is the model's training loss. torch.compile wraps what runs the step.
    step_model: nn.Module = model
    if ranks.world > 1:
        step_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if t.compile:
        step_model = cast(nn.Module, torch.compile(step_model))
    # The library for fp32 CPU matmuls (attnmt.matmul).
    mm_backend = matmul.set_backend(t.matmul) if device.type == "cpu" else "blas"
    fp32_cpu = device.type == "cpu" and autocast_dtype is None
    log.event(
        "model",
        f"model: {cfg.model.arch}, {n_params:,} parameters, device {device}, {t.precision}"
        + (f", {mm_backend} matmuls" if fp32_cpu else "")
        + (f", {ranks.world} processes" if ranks.world > 1 else "")
        + (f" | resumed at step {progress.step}" if checkpoint else ""),
        arch=cfg.model.arch,
        parameters=n_params,
        device=str(device),
        resumed_step=progress.step if checkpoint else None,
        matmul=mm_backend,
    )
    if resume and checkpoint is None:
        log.event("resume", "--resume: no checkpoint in this directory yet; starting at step 0")
    if device.type == "cpu" and (autocast_dtype is not None or mm_backend == "onednn"):
        # oneDNN runs low-precision matmuls on CPU (and fp32 ones with train.matmul onednn) and
        # caches a compiled kernel per shape, by default up to 1,024; token batches come in
        # hundreds of shapes, and the cache took the bench's bf16 T run from 1.7 to 5.6 GiB. A
        # small cache ran as fast. It is read when oneDNN first runs, so this must come before
        # the first step (a user's own setting wins).
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    if device.type == "cpu" and autocast_dtype is not None and not cpu_matmul_hardware(t.precision):
        log.event(
            "precision",
            f"train.precision={t.precision}: this CPU has no {t.precision} matmul "
            f"instructions ({CPU_MATMUL_INSTRUCTIONS[t.precision]})"
            "; expect it slower than fp32",
            precision=t.precision,
            hardware=False,
        )

    def elapsed() -> float:
        return progress.elapsed_s + time.time() - start_time

    def checkpoint_now(bleu: float | None) -> None:
        progress.checkpoints.append([progress.step, bleu])
        records = [CheckpointRecord(s, b) for s, b in progress.checkpoints]
        state = {
            "format_version": STATE_FORMAT_VERSION,
            "progress": {**asdict(progress), "elapsed_s": elapsed()},
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(tf_generator),
        }
        if scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        save_checkpoint(out, model, state, records, t.keep_last, t.keep_best)
        progress.checkpoints = [[r.step, r.bleu] for r in records]

    def validate() -> bool:
        """Validate on rank 0 (the others wait); returns True when early stopping says stop.
        Rank 0 passes its decisions on: stop, and the plateau lr scale."""
        progress.last_validated = progress.step
        if ranks.world > 1:
            same = ranks.weights_identical(model)
            log.event(
                "ranks",
                None if same else f"step {progress.step}: the ranks' weights differ",
                step=progress.step,
                world=ranks.world,
                weights_identical=same,
            )
        stop = validate_main() if ranks.is_main else False
        if ranks.world > 1:
            scale = progress.plateau_scale if ranks.is_main else 0.0
            stop_sum, progress.plateau_scale = ranks.sum([float(stop), scale])
            stop = stop_sum > 0
        return stop

    def validate_main() -> bool:
        """Dev loss, perplexity and greedy BLEU; saves weights and a checkpoint."""
        p = progress
        loss = dev_loss(model, dev_data, t.eval_batch_tokens, device)
        hyps = translate_lines(
            model, tokenizer, dev_text.src, search_options(cfg.decode, t.eval_beam),
            t.eval_batch_tokens, device,
        )  # fmt: skip
        bleu = score(hyps, dev_text.tgt).bleu
        finite = math.isfinite(loss) and all_finite(model)
        improved = finite and bleu > p.best_bleu
        if improved:
            p.best_bleu, p.bad_validations, p.plateau_bad = bleu, 0, 0
            save_weights(model, out / BEST_FILE)
        else:
            p.bad_validations += 1
            p.plateau_bad += 1
            if t.lr_schedule == "plateau" and p.plateau_bad > t.plateau_patience:
                p.plateau_scale *= t.plateau_factor
                p.plateau_bad = 0
        save_weights(model, out / LAST_FILE)
        checkpoint_now(bleu if finite else None)
        ppl = math.exp(min(loss, 50.0))
        lr = learning_rate(p.step, cfg, p.plateau_scale)
        tf = teacher_forcing_ratio(p.step, t.teacher_forcing)
        log.event(
            "validation",
            f"step {p.step} | epoch {p.epoch} | dev loss {loss:.3f} | ppl {ppl:.2f} | "
            f"BLEU {bleu:.2f}{' *' if improved else ''} | lr {lr:.2e} | tf {tf:.2f} | "
            f"{elapsed():.0f} s",
            step=p.step,
            epoch=p.epoch,
            dev_loss=loss,
            dev_ppl=ppl,
            dev_bleu=bleu,
            best_bleu=p.best_bleu,
            improved=improved,
            lr=lr,
            teacher_forcing=tf,
            elapsed_s=round(elapsed(), 1),
        )
        return p.bad_validations >= t.patience

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    stop_reason = "max_epochs"
    window_tokens, window_start = 0, time.time()
    window_positions, window_real = 0.0, 0.0
    bar = tqdm(
        total=t.max_steps,
        initial=progress.step,
        desc="train",
        unit="step",
        disable=log.quiet or not ranks.is_main or None,
        file=sys.stderr,
    )
    p = progress
    done = p.step >= t.max_steps
    if done:
        stop_reason = "max_steps"
    with StopSignals() as signals:
        while not done and p.epoch <= t.max_epochs:
            batches = sampler.epoch(p.epoch)
            # One step takes one batch per rank; a remainder too small for every rank is left.
            while p.batch_in_epoch + ranks.world <= len(batches):
                idx = batches[p.batch_in_epoch + ranks.rank]
                p.batch_in_epoch += ranks.world
                batch = collate(
                    [train_data.src[i] for i in idx],
                    [train_data.tgt[i] for i in idx],
                    idx,
                    PAD_ID,
                    BOS_ID,
                    EOS_ID,
                ).to(device)
                tf = teacher_forcing_ratio(p.step, t.teacher_forcing)
                lr = learning_rate(p.step + 1, cfg, p.plateau_scale)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                if ranks.world > 1:
                    torch.manual_seed(distributed.step_seed(t.seed, ranks.rank, p.step))
                    tf_generator.manual_seed(distributed.step_seed(t.seed + 1, ranks.rank, p.step))
                n_tokens = batch.n_tokens
                positions = batch.src.numel() + batch.tgt_out.numel()
                real = n_tokens + int((~batch.src_pad_mask).sum())
                # Every rank normalises by the tokens of all ranks; DDP's mean of the ranks'
                # gradients is then the gradient of the loss per token of the whole step.
                step_tokens, step_positions, step_real = ranks.sum(
                    [float(n_tokens), float(positions), float(real)]
                )
                with autocast():
                    loss_sum, _ = step_model(batch, tf, t.label_smoothing, tf_generator)
                if ranks.world == 1:
                    loss = loss_sum / n_tokens
                else:
                    loss = loss_sum * (ranks.world / step_tokens)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
                )
                step_loss, signalled = ranks.sum(
                    [float(loss_sum.detach()), float(signals.signum is not None)]
                )
                loss_finite = math.isfinite(step_loss)
                grads_finite = bool(torch.isfinite(grad_norm))
                if loss_finite and grads_finite:
                    scaler.step(optimizer)
                # Every step ends the scaler's cycle (a no-op unless fp16): it lowers the scale
                # after non-finite gradients, and the next unscale_ requires it.
                scaler.update()
                if loss_finite and not grads_finite and scaler.is_enabled():
                    # fp16 overflow: the update was skipped and the scale lowered; not a bad step.
                    p.skipped_steps += 1
                    log.event("fp16_overflow", None, step=p.step + 1, scale=scaler.get_scale())
                elif not (loss_finite and grads_finite):
                    # Skip the update: one bad batch must not poison the weights.
                    p.bad_steps_in_a_row += 1
                    p.skipped_steps += 1
                    log.event(
                        "nonfinite",
                        None,
                        step=p.step + 1,
                        in_a_row=p.bad_steps_in_a_row,
                        skipped_total=p.skipped_steps,
                    )
                    if p.bad_steps_in_a_row >= t.max_bad_steps:
                        raise TrainingError(
                            f"{p.bad_steps_in_a_row} steps in a row had a non-finite loss or "
                            f"gradient (train.max_bad_steps = {t.max_bad_steps}) at step "
                            f"{p.step + 1}; try a lower train.lr or train.clip_grad_norm"
                        )
                else:
                    p.step += 1
                    p.bad_steps_in_a_row = 0
                    window_tokens += int(step_tokens)
                    window_positions += step_positions
                    window_real += step_real
                    bar.update(1)
                    if p.step % t.log_every == 0 or p.step == 1:
                        now = time.time()
                        seconds = now - window_start
                        tok_s = window_tokens / max(seconds, 1e-9)
                        padding = 1.0 - window_real / max(window_positions, 1.0)
                        log_tokens = window_tokens
                        window_tokens, window_start = 0, now
                        window_positions, window_real = 0.0, 0.0
                        bar.set_postfix(
                            loss=f"{step_loss / step_tokens:.3f}",
                            lr=f"{lr:.1e}",
                            tok_s=f"{tok_s:.0f}",
                            tf=f"{tf:.2f}",
                        )
                        log.event(
                            "train",
                            None,
                            step=p.step,
                            epoch=p.epoch,
                            loss=step_loss / step_tokens,
                            lr=lr,
                            tokens_per_s=round(tok_s, 1),
                            tokens=log_tokens,
                            seconds=round(seconds, 4),
                            padding=round(padding, 4),
                            teacher_forcing=tf,
                        )
                    if p.step % t.eval_every == 0 and validate():
                        stop_reason, done = "early_stopping", True
                    elif p.step >= t.max_steps:
                        stop_reason, done = "max_steps", True
                if signalled:
                    if p.last_validated != p.step and ranks.is_main:
                        checkpoint_now(None)
                    bar.close()
                    signum = signals.signum or signal.SIGTERM  # another rank was signalled
                    name = signal.Signals(signum).name
                    log.event(
                        "interrupted",
                        f"{name} at step {p.step}: checkpoint saved; continue with --resume",
                        step=p.step,
                        signal=name,
                    )
                    raise TrainingInterrupted(signum, p.step)
                if done:
                    break
            if not done:
                p.epoch += 1
                p.batch_in_epoch = 0
    bar.close()
    if p.last_validated != p.step:
        validate()
    if ranks.is_main and cfg.data.test is not None and (out / BEST_FILE).is_file():
        test_with_best(model, tokenizer, cfg, out, device, log)
    summary = {
        "steps": p.step,
        "epochs": min(p.epoch, t.max_epochs),
        "best_dev_bleu": round(p.best_bleu, 2),
        "stop_reason": stop_reason,
        "skipped_nonfinite_steps": p.skipped_steps,
        "elapsed_s": round(elapsed(), 1),
    }
    log.event(
        "done",
        f"done: {p.step} steps, {summary['epochs']} epochs, stopped by {stop_reason}, best dev "
        f"BLEU {p.best_bleu:.2f}, {elapsed() / 60:.1f} min",
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
