"""The dev score that picks the best weights (train.early_stopping), higher is better: BLEU,
chrF, the dev loss negated, or `auto` (the default): BLEU where it says something, chrF below.

Why auto: a model that cannot translate yet scores BLEU 0.1 give or take 0.05 (a handful of
matching 4-grams), so best.safetensors would be chosen by noise; chrF, on character n-grams,
still rises with the model (a 15-minute run on a busy machine: BLEU 0.12 then 0.11 while chrF
went 5.35 to 7.29 and the dev loss 4.75 to 4.42). Under AUTO_BLEU dev BLEU, chrF decides; any
validation at or above it beats every one below; above it BLEU decides, as before.
"""

from __future__ import annotations

AUTO_BLEU = 5.0
METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "loss": "loss", "auto": "BLEU/chrF"}


def dev_score(metric: str, bleu: float, chrf: float, loss: float) -> float:
    """The score `metric` ranks a validation by, higher is better (auto: BLEU from AUTO_BLEU
    on, else chrF - 100, below every BLEU score)."""
    if metric == "loss":
        return -loss
    if metric == "chrf":
        return chrf
    if metric == "auto" and bleu < AUTO_BLEU:
        return chrf - 100.0
    return bleu


def deciding(metric: str, bleu: float) -> str:
    """Which metric ranked a validation: auto's BLEU or chrF, else `metric` itself."""
    if metric != "auto":
        return metric
    return "bleu" if bleu >= AUTO_BLEU else "chrf"


def shown(metric: str, score: float) -> str:
    """A dev_score as words: 'BLEU 12.30', 'chrF 7.29', 'loss 4.415'."""
    if metric == "loss":
        return f"loss {-score:.3f}"
    if metric == "auto" and score < 0:
        return f"chrF {score + 100.0:.2f}"
    return f"{METRIC_NAMES['bleu' if metric == 'auto' else metric]} {score:.2f}"
