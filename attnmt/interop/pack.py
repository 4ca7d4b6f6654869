"""`attnmt pack`: a model directory reduced to what translating needs, to ship to others.

A trained directory holds the run as well as the model: checkpoints (with optimizer states),
the encoded corpus, logs, TensorBoard events; a few hundred MB beside 30 MB of weights. The
packed copy holds config.yaml, attnmt.json, the SentencePiece model(s), the chosen weights as
best.safetensors (an adapter run's merged into its base: the copy needs no base) and the
lexical shortlist where there is one. It loads as any model directory (every command that
takes --model reads it); the weights keep the tokenizer checksum they were saved with.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from attnmt.config import to_yaml
from attnmt.data.files import atomic_write_bytes
from attnmt.decoding.shortlist import SHORTLIST_FILE
from attnmt.errors import AttnmtError
from attnmt.models.directory import (
    BEST_FILE,
    CONFIG_FILE,
    META_FILE,
    load_model_dir,
    read_run_files,
    resolve_weights,
    save_weights,
    tokenizer_digest,
)


@dataclass
class Packed:
    """What pack_model wrote: the files, their bytes, the source directory's bytes."""

    files: list[str]
    size: int
    source_size: int
    weights: Path  # the weights file packed (an adapter run's: merged into its base)


def pack_model(model_dir: Path, out: Path, weights: str = "best", force: bool = False) -> Packed:
    """Write the packed copy of model_dir into out (new, or empty, or replaced with force)."""
    cfg, meta = read_run_files(model_dir)
    source = resolve_weights(model_dir, weights)
    if out.resolve() == model_dir.resolve():
        raise AttnmtError(f"{out}: pack writes a new directory, not the model's own")
    if out.exists() and any(out.iterdir()) and not force:
        raise AttnmtError(f"{out} exists and is not empty; --force replaces it")
    if out.exists() and force:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [*(meta.get("sha256") or {}), SHORTLIST_FILE]
    for name in names:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    if cfg.train.adapters is None:
        shutil.copyfile(source, out / BEST_FILE)
        shutil.copyfile(model_dir / CONFIG_FILE, out / CONFIG_FILE)
        shutil.copyfile(model_dir / META_FILE, out / META_FILE)
    else:  # the adapters merged into their base: a whole model, no base needed
        _, _, model = load_model_dir(model_dir, weights)
        shas = meta.get("sha256") or None
        save_weights(model, out / BEST_FILE, tokenizer_digest(shas) if shas else None)
        train = cfg.train.model_copy(update={"adapters": None, "init_from": None})
        atomic_write_bytes(
            out / CONFIG_FILE, to_yaml(cfg.model_copy(update={"train": train})).encode()
        )
        meta = {**meta, "adapter_base": None}
        atomic_write_bytes(out / META_FILE, json.dumps(meta, indent=2).encode("utf-8"))
    load_model_dir(out)  # the copy loads, or this says why
    files = sorted(p.name for p in out.iterdir())
    return Packed(files, _bytes(out), _bytes(model_dir), source)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
