"""Fine-tuning (train.init_from): a new run that starts from a trained model directory.

The new run takes the source directory's architecture (the model section) and tokenizer, and
its best weights (a model trained with LoRA adapters: with them merged); the data, optimizer,
schedules and step count are the new config's. Keys the new config sets itself must agree with
the source (dropout and subword sampling may differ: they change no weight).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from attnmt.config import Config, quote
from attnmt.errors import ConfigError
from attnmt.models.directory import read_run_files

# Model keys a fine-tuning run may change: they shape no weight.
FREE_MODEL_KEYS = ("dropout", "attention_dropout")
# Tokenizer keys it may change: subword sampling draws segmentations from the same
# SentencePiece model while training (the model translates with its best segmentation).
FREE_TOKENIZER_KEYS = ("sampling",)


def inherit(cfg: Config) -> Config:
    """cfg with the model and tokenizer sections of the model directory train.init_from names.
    A model or tokenizer key that cfg sets to another value than the source's is refused with
    one line naming the key and both values."""
    source_dir = cfg.train.init_from
    assert source_dir is not None
    source, _ = read_run_files(source_dir)
    if source.train.adapters is not None and cfg.train.adapters is not None:
        raise ConfigError(
            f"train.adapters: train.init_from's model ({source_dir}) was trained with adapters;"
            " fine-tune it without train.adapters (its adapters are merged into the weights"
            " first), or adapt the model it adapted"
        )
    model = _agree(cfg.model, source.model, "model", source_dir, FREE_MODEL_KEYS)
    tokenizer = _agree(
        cfg.tokenizer, source.tokenizer, "tokenizer", source_dir, FREE_TOKENIZER_KEYS
    )
    return cfg.model_copy(update={"model": model, "tokenizer": tokenizer})


def _agree(
    mine: BaseModel, theirs: BaseModel, section: str, source_dir: Path, free: tuple[str, ...]
) -> Any:
    """The source's section, with the `free` keys that `mine` sets taken from `mine`."""
    update = {}
    for key in sorted(mine.model_fields_set):
        value, source_value = getattr(mine, key), getattr(theirs, key)
        if key in free:
            update[key] = value
        elif value != source_value:
            raise ConfigError(
                f"{section}.{key} is {quote(_plain(value))}, but train.init_from's model "
                f"({source_dir}) has {quote(_plain(source_value))}; a fine-tuned model keeps its "
                f"source's {'architecture' if section == 'model' else 'tokenizer'} (remove the key)"
            )
    return theirs.model_copy(update=update)


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value
