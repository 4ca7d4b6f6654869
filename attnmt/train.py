"""The training loop: data and tokenizer setup, steps, validation, early stopping.

Reads top to bottom: prepare the model directory, read and validate the data, train the
SentencePiece model, build the model, then one flat loop over epochs and batches with a
validation every `train.eval_every` steps.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from tqdm import tqdm

from attnmt.checkpoint import (
    BEST_FILE,
    LAST_FILE,
    LOG_JSONL,
    LOG_TEXT,
    prepare_output_dir,
    save_weights,
    write_run_files,
)
from attnmt.config import Config
from attnmt.data import BucketSampler, ParallelText, collate, read_parallel
from attnmt.errors import ConfigError, DataError
from attnmt.evaluate import score, translate_lines
from attnmt.model import Seq2Seq, build_model
from attnmt.schedules import inverse_sqrt_lr, teacher_forcing_ratio, warmup_lr
from attnmt.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without one is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda': no CUDA device is available (use auto or cpu)")
    return torch.device(name)


class RunLog:
    """Human-readable lines on stderr and in train.log; the same events as JSON lines."""

    def __init__(self, out: Path, quiet: bool = False) -> None:
        self.text = open(out / LOG_TEXT, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self.jsonl = open(out / LOG_JSONL, "a", encoding="utf-8")  # noqa: SIM115
        self.quiet = quiet

    def event(self, kind: str, line: str | None = None, **fields: Any) -> None:
        self.jsonl.write(json.dumps({"event": kind, **fields}) + "\n")
        self.jsonl.flush()
        if line is not None:
            self.text.write(line + "\n")
            self.text.flush()
            if not self.quiet:
                tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
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


def learning_rate(step: int, cfg: Config, plateau_scale: float) -> float:
    t = cfg.train
    if t.lr_schedule == "inverse_sqrt":
        return max(inverse_sqrt_lr(step, t.lr, t.warmup_steps), t.min_lr)
    return max(warmup_lr(step, t.lr, t.warmup_steps) * plateau_scale, t.min_lr)


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
    load_model(model, str(out / BEST_FILE), device=str(device))
    hyps = translate_lines(
        model,
        tokenizer,
        test_text.src,
        cfg.train.eval_batch_tokens,
        cfg.decode.max_len_a,
        cfg.decode.max_len_b,
        device,
    )
    s = score(hyps, test_text.tgt)
    log.event(
        "test",
        f"test ({cfg.data.test.src.name}, best weights): BLEU {s.bleu:.2f} | chrF {s.chrf:.2f} | "
        f"{s.bleu_signature}",
        pairs=len(test_text.src),
        skipped_empty=test_text.skipped_empty,
        **s.as_dict(),
    )


def train(cfg: Config, out: Path, overwrite: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Train a model from cfg into the model directory `out`; returns a summary."""
    t = cfg.train
    prepare_output_dir(out, overwrite)
    device = resolve_device(t.device)
    if t.threads:
        torch.set_num_threads(t.threads)
    random.seed(t.seed)
    torch.manual_seed(t.seed)
    # Scheduled sampling draws from its own generator so its coin flips are reproducible.
    tf_generator = torch.Generator().manual_seed(t.seed + 1)

    log = RunLog(out, quiet)
    start_time = time.time()
    train_text = read_parallel(cfg.data.train.src, cfg.data.train.tgt)
    dev_text = read_parallel(cfg.data.dev.src, cfg.data.dev.tgt)
    if not train_text.src:
        raise DataError(f"{cfg.data.train.src}: no sentence pairs with text on both sides")
    if not dev_text.src:
        raise DataError(f"{cfg.data.dev.src}: no sentence pairs with text on both sides")
    tokenizer = Tokenizer.train(
        train_text.src,
        train_text.tgt,
        cfg.tokenizer.vocab_size,
        cfg.tokenizer.joint,
        cfg.tokenizer.model_type,
        cfg.tokenizer.character_coverage,
    )
    write_run_files(out, cfg, tokenizer)
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

    model = build_model(cfg.model, len(tokenizer.src), len(tokenizer.tgt), tokenizer.joint)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    log.event(
        "model",
        f"model: {cfg.model.arch}, {n_params:,} parameters, device {device}",
        arch=cfg.model.arch,
        parameters=n_params,
        device=str(device),
    )
    optimizer = torch.optim.Adam(
        model.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay
    )
    sampler = BucketSampler(
        [len(s) + 1 for s in train_data.src],
        [len(x) + 1 for x in train_data.tgt],
        t.batch_tokens,
        t.seed,
    )

    step = 0
    best_bleu = -math.inf
    bad_validations = 0
    plateau_scale, plateau_bad = 1.0, 0
    bad_steps = 0
    stop_reason = "max_epochs"
    last_validated = -1
    window_tokens, window_start = 0, time.time()
    bar = tqdm(total=t.max_steps, desc="train", unit="step", disable=quiet or None, file=sys.stderr)

    def validate(epoch: int) -> bool:
        """Dev loss, perplexity and greedy BLEU; saves best/last. Returns True to stop early."""
        nonlocal best_bleu, bad_validations, plateau_scale, plateau_bad, last_validated
        last_validated = step
        loss = dev_loss(model, dev_data, t.eval_batch_tokens, device)
        hyps = translate_lines(
            model,
            tokenizer,
            dev_text.src,
            t.eval_batch_tokens,
            cfg.decode.max_len_a,
            cfg.decode.max_len_b,
            device,
        )
        bleu = score(hyps, dev_text.tgt).bleu
        save_weights(model, out / LAST_FILE)
        improved = math.isfinite(bleu) and math.isfinite(loss) and bleu > best_bleu
        if improved:
            best_bleu, bad_validations, plateau_bad = bleu, 0, 0
            save_weights(model, out / BEST_FILE)
        else:
            bad_validations += 1
            plateau_bad += 1
            if t.lr_schedule == "plateau" and plateau_bad > t.plateau_patience:
                plateau_scale *= t.plateau_factor
                plateau_bad = 0
        ppl = math.exp(min(loss, 50.0))
        lr = learning_rate(step, cfg, plateau_scale)
        tf = teacher_forcing_ratio(step, t.teacher_forcing)
        elapsed = time.time() - start_time
        log.event(
            "validation",
            f"step {step} | epoch {epoch} | dev loss {loss:.3f} | ppl {ppl:.2f} | "
            f"BLEU {bleu:.2f}{' *' if improved else ''} | lr {lr:.2e} | tf {tf:.2f} | "
            f"{elapsed:.0f} s",
            step=step,
            epoch=epoch,
            dev_loss=loss,
            dev_ppl=ppl,
            dev_bleu=bleu,
            best_bleu=best_bleu,
            improved=improved,
            lr=lr,
            teacher_forcing=tf,
            elapsed_s=round(elapsed, 1),
        )
        return bad_validations >= t.patience

    epoch = 0
    done = False
    for epoch in range(1, t.max_epochs + 1):
        for idx in sampler.epoch(epoch):
            batch = collate(
                [train_data.src[i] for i in idx],
                [train_data.tgt[i] for i in idx],
                idx,
                PAD_ID,
                BOS_ID,
                EOS_ID,
            ).to(device)
            tf = teacher_forcing_ratio(step, t.teacher_forcing)
            lr = learning_rate(step + 1, cfg, plateau_scale)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, n_tokens = model.loss(batch, tf, t.label_smoothing, tf_generator)
            loss = loss_sum / n_tokens
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
            )
            if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
                bad_steps += 1  # skip the update: one bad batch must not poison the weights
                log.event("nonfinite", None, step=step + 1, bad_steps=bad_steps)
                continue
            optimizer.step()
            step += 1
            window_tokens += n_tokens
            bar.update(1)
            if step % t.log_every == 0 or step == 1:
                now = time.time()
                tok_s = window_tokens / max(now - window_start, 1e-9)
                window_tokens, window_start = 0, now
                bar.set_postfix(
                    loss=f"{loss.item():.3f}", lr=f"{lr:.1e}", tok_s=f"{tok_s:.0f}", tf=f"{tf:.2f}"
                )
                log.event(
                    "train",
                    None,
                    step=step,
                    epoch=epoch,
                    loss=loss.item(),
                    lr=lr,
                    tokens_per_s=round(tok_s, 1),
                    teacher_forcing=tf,
                )
            if step % t.eval_every == 0 and validate(epoch):
                stop_reason, done = "early_stopping", True
                break
            if step >= t.max_steps:
                stop_reason, done = "max_steps", True
                break
        if done:
            break
    bar.close()
    if last_validated != step:
        validate(epoch)
    if cfg.data.test is not None:
        test_with_best(model, tokenizer, cfg, out, device, log)
    elapsed = time.time() - start_time
    summary = {
        "steps": step,
        "epochs": epoch,
        "best_dev_bleu": round(best_bleu, 2),
        "stop_reason": stop_reason,
        "skipped_nonfinite_steps": bad_steps,
        "elapsed_s": round(elapsed, 1),
    }
    log.event(
        "done",
        f"done: {step} steps, {epoch} epochs, stopped by {stop_reason}, best dev BLEU "
        f"{best_bleu:.2f}, {elapsed / 60:.1f} min",
        **summary,
    )
    log.close()
    return summary
