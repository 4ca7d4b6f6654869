"""Learning-rate and teacher-forcing schedules as pure functions of the step."""

from __future__ import annotations

import math

from attnmt.config import Config, TeacherForcingConfig


def inverse_sqrt_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warmup to peak_lr at warmup_steps, then decay with 1/sqrt(step) (Vaswani et al.
    2017, sec. 5.3, with the peak given directly instead of through d_model). Steps count from 1."""
    step = max(step, 1)
    if warmup_steps <= 0:
        return peak_lr
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    return peak_lr * math.sqrt(warmup_steps / step)


def warmup_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warmup to peak_lr, then constant (used by the constant and plateau schedules)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return peak_lr
    return peak_lr * max(step, 1) / warmup_steps


def budget_warmup(step: int, warmup_steps: int, used: float, warmup_share: float) -> float:
    """How far warmup has come (1: done) under a time budget: by steps (step / warmup_steps) or
    by time (used / warmup_share, `used` the share of the budget spent), whichever is ahead. A
    slow machine that would spend most of its budget on warmup_steps ends warmup by time."""
    by_steps = step / warmup_steps if warmup_steps > 0 else 1.0
    return min(max(by_steps, used / warmup_share), 1.0)


def budget_lr(
    step: int,
    peak_lr: float,
    warmup_steps: int,
    used: float,
    warmup_used: float,
    warmup_share: float = 1.0,
) -> float:
    """Linear warmup (budget_warmup), then linear decay in time from peak_lr to zero when the
    time budget is spent: peak_lr * (1 - used) / (1 - warmup_used), `used` the share of
    train.time_budget spent, `warmup_used` the share spent when warmup ended (the budget-aware
    linear schedule of Li et al., "Budgeted Training", ICLR 2020, after a warmup)."""
    ramp = budget_warmup(step, warmup_steps, used, warmup_share)
    if ramp < 1.0:
        return peak_lr * max(ramp, 1.0 / max(warmup_steps, 1))
    return peak_lr * max(1.0 - used, 0.0) / max(1.0 - warmup_used, 1e-9)


def _inverse_sigmoid_shape(p: float) -> float:
    """1 at p=0, 0 at p=1, an inverse sigmoid centred at p=0.5 in between."""

    def s(x: float) -> float:
        return 1.0 / (1.0 + math.exp(10.0 * (x - 0.5)))

    return (s(p) - s(1.0)) / (s(0.0) - s(1.0))


def teacher_forcing_ratio(step: int, cfg: TeacherForcingConfig) -> float:
    """Probability of feeding the gold previous token at training step `step`, counting from 1
    as the learning-rate schedules do.

    The ratio moves from cfg.start (step 1) to cfg.end (step cfg.steps + 1 and after):
      constant:        start throughout
      linear:          start + (end - start) * p,        p = min((step - 1) / steps, 1)
      exponential:     start * (end / start) ** p        (geometric; start, end > 0)
      inverse_sigmoid: end + (start - end) * f(p), f an inverse sigmoid with f(0)=1, f(1)=0
                       (the shape of Bengio et al. 2015, https://arxiv.org/abs/1506.03099)
    """
    p = min(max(step - 1, 0) / cfg.steps, 1.0)
    if cfg.schedule == "constant":
        return cfg.start
    if cfg.schedule == "linear":
        return cfg.start + (cfg.end - cfg.start) * p
    if cfg.schedule == "exponential":
        return cfg.start * (cfg.end / cfg.start) ** p
    return cfg.end + (cfg.start - cfg.end) * _inverse_sigmoid_shape(p)


def learning_rate(
    step: int, cfg: Config, plateau_scale: float, budget: tuple[float, float] = (0.0, 0.0)
) -> float:
    """The lr of training step `step`; `budget`: the shares of train.time_budget spent, now
    and when warmup ended (lr_schedule budget)."""
    t = cfg.train
    if t.lr_schedule == "budget":
        return budget_lr(step, t.lr, t.warmup_steps, *budget, t.warmup_share)
    if t.lr_schedule == "inverse_sqrt":
        return max(inverse_sqrt_lr(step, t.lr, t.warmup_steps), t.min_lr)
    return max(warmup_lr(step, t.lr, t.warmup_steps) * plateau_scale, t.min_lr)


def step_schedules(
    step: int, cfg: Config, plateau_scale: float, budget: tuple[float, float] = (0.0, 0.0)
) -> tuple[float, float]:
    """Learning rate and teacher-forcing ratio of training step `step` (counting from 1)."""
    return learning_rate(step, cfg, plateau_scale, budget), teacher_forcing_ratio(
        step, cfg.train.teacher_forcing
    )
