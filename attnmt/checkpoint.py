"""The model directory: atomic saves and safe loads.

A model directory holds everything translate and eval need:
    config.yaml           the resolved config (defaults filled in, absolute data paths)
    spm.model             the joint SentencePiece model (or spm.src.model + spm.tgt.model)
    best.safetensors      weights with the best dev BLEU
    last.safetensors      weights after the last step
    train_log.jsonl       one JSON object per validation (and start/end events)
    train.log             the same, as the lines printed during training
    attnmt.json           format version and vocabulary sizes
Every file is written to a temporary name in the same directory, fsynced, then renamed into
place, so a crash never leaves a half-written file under a real name.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from attnmt import __version__
from attnmt.config import Config, from_dict, to_yaml
from attnmt.errors import CheckpointError
from attnmt.model import Seq2Seq, build_model
from attnmt.tokenizer import Tokenizer

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
META_FILE = "attnmt.json"
BEST_FILE = "best.safetensors"
LAST_FILE = "last.safetensors"
LOG_JSONL = "train_log.jsonl"
LOG_TEXT = "train.log"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Any) -> None:
    """Call write(tmp_path), fsync the file, rename it to path, fsync the directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def save_weights(model: Seq2Seq, path: Path) -> None:
    """Save weights as safetensors (shared/tied tensors stored once)."""
    atomic_write(path, lambda tmp: save_model(model, str(tmp)))


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Create the model directory, refusing to mix a new run into an existing one.

    Fails before training starts if the directory cannot be created or written.
    """
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CheckpointError(
                f"--out {out}: directory is not empty; pass --overwrite to replace its contents"
            )
        for name in (
            CONFIG_FILE,
            META_FILE,
            BEST_FILE,
            LAST_FILE,
            LOG_JSONL,
            LOG_TEXT,
            Tokenizer.JOINT_FILE,
            Tokenizer.SRC_FILE,
            Tokenizer.TGT_FILE,
        ):
            (out / name).unlink(missing_ok=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"--out {out}: cannot write there ({e.strerror})") from None


def write_run_files(out: Path, cfg: Config, tokenizer: Tokenizer) -> None:
    """Config, SentencePiece model(s) and metadata: written once, at the start of training."""
    atomic_write_bytes(out / CONFIG_FILE, to_yaml(cfg).encode("utf-8"))
    for name, proto in tokenizer.files().items():
        atomic_write_bytes(out / name, proto)
    meta = {
        "format_version": FORMAT_VERSION,
        "attnmt_version": __version__,
        "src_vocab_size": len(tokenizer.src),
        "tgt_vocab_size": len(tokenizer.tgt),
        "joint": tokenizer.joint,
    }
    atomic_write_bytes(out / META_FILE, json.dumps(meta, indent=2).encode("utf-8"))


def load_model_dir(
    model_dir: Path, weights: str = BEST_FILE, device: torch.device | str = "cpu"
) -> tuple[Config, Tokenizer, Seq2Seq]:
    """Load config, tokenizer and model (in eval mode) from a model directory."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    meta_path, cfg_path = model_dir / META_FILE, model_dir / CONFIG_FILE
    if not meta_path.is_file() or not cfg_path.is_file():
        raise CheckpointError(
            f"{model_dir} is not an attnmt model directory (no {META_FILE} / {CONFIG_FILE})"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        version = int(meta["format_version"])
        src_vocab, tgt_vocab = int(meta["src_vocab_size"]), int(meta["tgt_vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata ({e})") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{model_dir}: model format version {version} is newer than this attnmt "
            f"({__version__}) reads (version {FORMAT_VERSION}); upgrade attnmt"
        )
    try:
        raw = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: unreadable config ({e})") from None
    cfg = from_dict(raw)
    tokenizer = Tokenizer.load(model_dir, cfg.tokenizer.joint)
    model = build_model(cfg.model, src_vocab, tgt_vocab, cfg.tokenizer.joint)
    weights_path = model_dir / weights
    if not weights_path.is_file():
        raise CheckpointError(f"{model_dir}: no {weights} (training has not saved weights yet)")
    try:
        missing, unexpected = load_model(model, str(weights_path), strict=False)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{weights_path}: cannot load weights ({e})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_path}: weights do not match the config "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    model.to(device).eval()
    return cfg, tokenizer, model
