"""The model directory: atomic saves and safe loads.

A model directory holds everything translate and eval need:
    config.yaml           the resolved config (defaults filled in, absolute data paths)
    spm.model             the joint SentencePiece model (or spm.src.model + spm.tgt.model)
    best.safetensors      weights with the best dev score (train.early_stopping)
    last.safetensors      weights after the last step
    train_log.jsonl       one JSON object per validation (and start/end events)
    train.log             the same, as the lines printed during training
    attnmt.json           format version and vocabulary sizes
    checkpoints/          step-N.safetensors + step-N.state.pt (optimizer, RNG states, counters:
                          everything --resume needs) for the best `train.keep_best` and the last
                          `train.keep_last` checkpoints, and latest.json, the pointer to the
                          newest complete one
Every file is written to a temporary name in the same directory, fsynced, then renamed into
place, so a crash never leaves a half-written file under a real name.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from attnmt import __version__
from attnmt.config import Config, from_dict, read_yaml, to_yaml
from attnmt.data.files import atomic_write, atomic_write_bytes, file_sha256
from attnmt.data.tokenizer import MAX_MODEL_BYTES, Tokenizer
from attnmt.errors import CheckpointError
from attnmt.models.build import build_model
from attnmt.models.lora import attach_adapters, has_adapters, is_adapter_weight, merge_adapters
from attnmt.models.seq2seq import Seq2Seq

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
META_FILE = "attnmt.json"
BEST_FILE = "best.safetensors"
LAST_FILE = "last.safetensors"
AVERAGED_FILE = "averaged.safetensors"
LOG_JSONL = "train_log.jsonl"
LOG_TEXT = "train.log"
CKPT_DIR = "checkpoints"  # step checkpoints: step-N.safetensors + step-N.state.pt
STEP_FILE = re.compile(r"step-(\d+)\.(safetensors|state\.pt)$")


def weights_dict(model: Seq2Seq) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State dict without tied duplicates, and {dropped name: kept name}.

    Names are visited in sorted order and the first name of each shared tensor is kept, so the
    file is byte-for-byte the same for the same weights (safetensors refuses shared tensors).
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owner: dict[tuple[int, tuple[int, ...]], str] = {}
    state = model.state_dict()
    if has_adapters(model):  # an adapter directory keeps the adapters; its base, the rest
        state = {name: t for name, t in state.items() if is_adapter_weight(name)}
    for name in sorted(state):
        t = state[name]
        key = (t.data_ptr(), tuple(t.shape))
        if key in owner:
            aliases[name] = owner[key]
        else:
            owner[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, aliases


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def tokenizer_digest(shas: dict[str, str]) -> str:
    """One checksum for a model's SentencePiece files ({file name: SHA-256}, as attnmt.json
    records them): weights files carry it, so that weights are never used with a tokenizer
    other than the one they were trained with."""
    return hashlib.sha256(json.dumps(shas, sort_keys=True).encode()).hexdigest()


def tokenizer_shas(tokenizer: Tokenizer) -> dict[str, str]:
    return {name: hashlib.sha256(p).hexdigest() for name, p in tokenizer.files().items()}


def save_weights(model: Seq2Seq, path: Path, tokenizer: str | None = None) -> None:
    """Save weights as safetensors with their checksum and their tokenizer's
    (tokenizer_digest); tied tensors are stored once."""
    write_tensors(path, *weights_dict(model), tokenizer)


def write_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    aliases: dict[str, str],
    tokenizer: str | None = None,
) -> None:
    """A weights file: the tensors, their checksum, the tied names and the tokenizer's digest,
    written atomically."""
    # One metadata entry only: the header's metadata map has no fixed key order.
    meta = {"sha256": tensors_sha256(tensors), "tied": aliases}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    metadata = {"attnmt": json.dumps(meta, sort_keys=True)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], str | None]:
    """A weights file's stored tensors, tied names ({dropped name: kept name}) and tokenizer
    digest (None in files written before it was recorded). A file whose checksum does not
    match, or that holds NaN or infinite values, is refused."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        info = json.loads(meta.get("attnmt", "{}"))
        aliases = info.get("tied") or json.loads(meta.get("attnmt.tied", "{}"))  # format 1.0
    except (
        SafetensorError,
        OSError,
        RuntimeError,
        ValueError,
        KeyError,
        AttributeError,
        RecursionError,
    ) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot load weights ({first[:200]})") from None
    if "sha256" in info and tensors_sha256(state) != info["sha256"]:
        raise CheckpointError(
            f"{path}: damaged: its tensors do not match the checksum written with them"
        )
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: damaged: tensor {name} holds NaN or infinite values")
    tokenizer = info.get("tokenizer")
    return state, aliases, tokenizer if isinstance(tokenizer, str) else None


def load_weights(
    model: Seq2Seq, path: Path, device: torch.device | str = "cpu", tokenizer: str | None = None
) -> None:
    """Load weights saved by save_weights into model (strict: every name must match); refused
    if they record another tokenizer than `tokenizer` (a tokenizer_digest)."""
    state, aliases, trained_with = read_tensors(path)
    if tokenizer is not None and trained_with is not None and trained_with != tokenizer:
        raise CheckpointError(
            f"{path}: trained with another SentencePiece model than this model directory's "
            "(the tokenizer checksum it records differs); use weights of this run"
        )
    for name, kept in aliases.items():
        state[name] = state[kept]
    adapted = has_adapters(model)  # adapters' weights only: the base is loaded already
    try:
        result = model.load_state_dict(state, strict=not adapted)
        if adapted and (result.unexpected_keys or any(map(is_adapter_weight, result.missing_keys))):
            raise RuntimeError(f"not this model's adapters: {result}")
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{path}: does not fit the model in config.yaml ({first})") from None
    model.to(device)


RUN_FILES = (
    CONFIG_FILE,
    META_FILE,
    BEST_FILE,
    LAST_FILE,
    LOG_JSONL,
    LOG_TEXT,
    Tokenizer.JOINT_FILE,
    Tokenizer.SRC_FILE,
    Tokenizer.TGT_FILE,
)


MAX_META_BYTES = 1 << 20  # attnmt.json: a larger one is refused before it is read


def adapter_base(cfg: Config) -> dict[str, str] | None:
    """What an adapter run (train.adapters) records of its base: the weights file it adapts
    (train.init_from's, train.init_weights) and that file's tensors' SHA-256; None without
    adapters."""
    if cfg.train.adapters is None or cfg.train.init_from is None:
        return None
    path = resolve_weights(cfg.train.init_from, cfg.train.init_weights).resolve()
    return {"path": str(path), "sha256": tensors_sha256(read_tensors(path)[0])}


def load_base(model_dir: Path, meta: dict[str, Any], model: Seq2Seq, device: torch.device | str,
              tokenizer: str | None) -> None:  # fmt: skip
    """Load an adapter directory's base weights into `model` (before its adapters), refused
    in one line if the base is gone or is no longer the file the adapters were trained on."""
    base = meta.get("adapter_base") or {}
    path = Path(str(base.get("path", "")))
    if not base or not path.is_file():
        raise CheckpointError(
            f"{model_dir}: holds adapters of the model {path or '(none recorded)'}, which is "
            "missing; put it back there (or fine-tune without train.adapters)"
        )
    state, _, _ = read_tensors(path)
    if tensors_sha256(state) != base.get("sha256"):
        raise CheckpointError(
            f"{model_dir}: holds adapters of {path}, which has changed since they were trained "
            "(its weights' SHA-256 differs); adapters only fit the weights they were trained on"
        )
    load_weights(model, path, device, tokenizer)


def check_same_base(out: Path, cfg: Config) -> None:
    """--resume of an adapter run: its base is still the weights its adapters started on."""
    recorded = read_run_files(out)[1].get("adapter_base")
    if recorded is not None and adapter_base(cfg) != recorded:
        raise CheckpointError(
            f"{out}: its adapters were trained on {recorded['path']} (SHA-256 "
            f"{recorded['sha256'][:12]}…), which train.init_from no longer gives; put it back"
        )


def write_run_files(out: Path, cfg: Config, tokenizer: Tokenizer) -> None:
    """Config, SentencePiece model(s) and metadata: written once, at the start of training.
    The metadata records the model section and the tokenizer files' checksums, which loading
    checks: an edited config.yaml or a swapped spm.model is refused, not translated with."""
    atomic_write_bytes(out / CONFIG_FILE, to_yaml(cfg).encode("utf-8"))
    for name, proto in tokenizer.files().items():
        atomic_write_bytes(out / name, proto)
    meta = {
        "format_version": FORMAT_VERSION,
        "attnmt_version": __version__,
        "src_vocab_size": len(tokenizer.src),
        "tgt_vocab_size": len(tokenizer.tgt),
        "joint": tokenizer.joint,
        "model": cfg.model.model_dump(mode="json"),
        "sha256": tokenizer_shas(tokenizer),
        # [source, target] language of each training corpus (null where not given), and
        # whether each source starts with a target-language tag (a multilingual model).
        "directions": [[c.src_lang, c.tgt_lang] for c in cfg.data.corpora],
        "multilingual": cfg.data.multilingual,
        "adapter_base": adapter_base(cfg),  # null: the weights files hold the whole model
    }
    atomic_write_bytes(out / META_FILE, json.dumps(meta, indent=2).encode("utf-8"))


def check_run_files(model_dir: Path, meta: dict[str, Any], cfg: Config) -> None:
    """config.yaml's model section and the tokenizer files are those training wrote
    (attnmt.json records them; directories written before it did are not checked)."""
    trained = meta.get("model") or {}
    for key, value in cfg.model.model_dump(mode="json").items():
        if key in trained and trained[key] != value:
            raise CheckpointError(
                f"{model_dir / CONFIG_FILE}: model.{key} is {value!r}, but the model was "
                f"trained with {trained[key]!r} ({META_FILE}); restore it"
            )
    for name, digest in (meta.get("sha256") or {}).items():
        path = model_dir / name
        if path.is_file() and path.stat().st_size > MAX_MODEL_BYTES:
            raise CheckpointError(
                f"{path}: {path.stat().st_size:,} bytes: not a SentencePiece model"
            )
        if path.is_file() and file_sha256(path) != digest:
            raise CheckpointError(
                f"{path}: not the SentencePiece model this model was trained with "
                f"(its checksum differs from {META_FILE}'s)"
            )


def resolve_weights(model_dir: Path, weights: str) -> Path:
    """The weights file that `weights` names in model_dir: best (or last while there is no best
    yet, as after an interrupt before the first validation), last, averaged (attnmt average),
    step-N (a kept checkpoint),
    a file name inside model_dir, or a path."""
    step = re.fullmatch(r"step-(\d+)", weights)
    if weights == "best":
        path = model_dir / BEST_FILE
        if not path.is_file() and (model_dir / LAST_FILE).is_file():
            path = model_dir / LAST_FILE
    elif weights == "last":
        path = model_dir / LAST_FILE
    elif weights == "averaged":
        path = model_dir / AVERAGED_FILE
    elif step:
        path = model_dir / CKPT_DIR / f"step-{int(step.group(1)):08d}.safetensors"
    elif (model_dir / weights).is_file():
        path = model_dir / weights
    else:
        path = Path(weights)
    if not path.is_file():
        names = (f.name for f in (model_dir / CKPT_DIR).glob("step-*.safetensors"))
        kept = sorted(int(m.group(1)) for m in map(STEP_FILE.match, names) if m)
        raise CheckpointError(
            f"{model_dir}: no weights {weights!r} ({path.name} not found); kept checkpoints: "
            + (", ".join(f"step-{k}" for k in kept) or "none")
        )
    return path


def read_run_files(model_dir: Path) -> tuple[Config, dict[str, Any]]:
    """A model directory's config and metadata, checked against each other (check_run_files)."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    meta_path, cfg_path = model_dir / META_FILE, model_dir / CONFIG_FILE
    if not meta_path.is_file() or not cfg_path.is_file():
        raise CheckpointError(
            f"{model_dir} is not an attnmt model directory (no {META_FILE} / {CONFIG_FILE})"
        )
    try:
        if meta_path.stat().st_size > MAX_META_BYTES:
            raise ValueError(f"{meta_path.stat().st_size:,} bytes; attnmt writes a few hundred")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        version = int(meta["format_version"])
        int(meta["src_vocab_size"]), int(meta["tgt_vocab_size"])  # checked here, read later
        if not isinstance(meta.get("model", {}), dict):
            raise ValueError("'model' is not a mapping")
        shas = meta.get("sha256", {})
        if not isinstance(shas, dict) or not all(isinstance(v, str) for v in shas.values()):
            raise ValueError("'sha256' is not a mapping of file names to checksums")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata ({e})") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{model_dir}: model format version {version} is newer than this attnmt "
            f"({__version__}) reads (version {FORMAT_VERSION}); upgrade attnmt"
        )
    cfg = from_dict(read_yaml(cfg_path))
    check_run_files(model_dir, meta, cfg)
    return cfg, meta


def load_model_dir(
    model_dir: Path, weights: str = "best", device: torch.device | str = "cpu"
) -> tuple[Config, Tokenizer, Seq2Seq]:
    """Load config, tokenizer and model (in eval mode) from a model directory; `weights` as
    resolve_weights takes it."""
    cfg, meta = read_run_files(model_dir)
    src_vocab, tgt_vocab = int(meta["src_vocab_size"]), int(meta["tgt_vocab_size"])
    tokenizer = Tokenizer.load(model_dir, cfg.tokenizer.joint)
    for side, vocab, size in (
        ("source", tokenizer.src, src_vocab),
        ("target", tokenizer.tgt, tgt_vocab),
    ):
        if len(vocab) != size:
            raise CheckpointError(
                f"{model_dir}: the {side} SentencePiece model has {len(vocab)} pieces, the "
                f"weights {size} ({META_FILE}): not this model's tokenizer"
            )
    model = build_model(cfg.model, src_vocab, tgt_vocab, cfg.tokenizer.joint)
    shas = meta.get("sha256") or None
    digest = tokenizer_digest(shas) if shas else None
    if cfg.train.adapters is not None:  # base + adapters, merged: the base model's speed
        load_base(model_dir, meta, model, device, digest)
        attach_adapters(model, cfg.train.adapters)
    load_weights(model, resolve_weights(model_dir, weights), device, digest)
    merge_adapters(model)
    model.to(device).eval()
    return cfg, tokenizer, model
