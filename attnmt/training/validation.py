"""Validation and what follows it: dev scores, samples, checkpoints (also on an interrupt), and at
the end the test sets and the averaged weights.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from attnmt.errors import TrainingInterrupted
from attnmt.models.directory import BEST_FILE, LAST_FILE, load_weights, save_weights
from attnmt.models.seq2seq import Seq2Seq
from attnmt.training.checkpoints import (
    STATE_FORMAT_VERSION,
    CheckpointRecord,
    average_checkpoints,
    first_averaged_step,
    kept_checkpoints,
    save_checkpoint,
)
from attnmt.training.dev_metric import deciding, dev_score, shown
from attnmt.training.resume import rng_state
from attnmt.training.schedules import step_schedules
from attnmt.training.scoring import score_dev_sets, score_test_sets
from attnmt.training.setup import Run


def all_finite(model: Seq2Seq) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


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
    metric = dev_score(t.early_stopping, dev.bleu, dev.chrf, loss)
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
    by = deciding(t.early_stopping, dev.bleu)
    star = {k: " *" if improved and k == by else "" for k in ("bleu", "chrf", "loss")}
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
        best_shown=shown(t.early_stopping, p.best_score),
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
    into averaged.safetensors, log it, and score the test set with it too; those before
    first_averaged_step are left out."""
    kept = sorted(kept_checkpoints(run.out))
    start = first_averaged_step(kept, run.cfg.train.warmup_steps)
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
