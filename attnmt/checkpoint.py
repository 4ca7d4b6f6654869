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

import fcntl
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from attnmt import __version__
from attnmt.config import Config, from_dict, read_yaml, to_yaml
from attnmt.errors import CheckpointError
from attnmt.files import atomic_write, atomic_write_bytes, file_sha256, free_space, read_jsonl
from attnmt.model import build_model
from attnmt.seq2seq import Seq2Seq
from attnmt.tokenizer import MAX_MODEL_BYTES, Tokenizer

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
META_FILE = "attnmt.json"
BEST_FILE = "best.safetensors"
LAST_FILE = "last.safetensors"
AVERAGED_FILE = "averaged.safetensors"
LOG_JSONL = "train_log.jsonl"
LOG_TEXT = "train.log"
CKPT_DIR = "checkpoints"
LATEST = "latest.json"
STATE_FORMAT_VERSION = 2  # 2: sealed (sealed_state); 1 still loads
_STEP_FILE = re.compile(r"step-(\d+)\.(safetensors|state\.pt)$")


def weights_dict(model: Seq2Seq) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State dict without tied duplicates, and {dropped name: kept name}.

    Names are visited in sorted order and the first name of each shared tensor is kept, so the
    file is byte-for-byte the same for the same weights (safetensors refuses shared tensors).
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owner: dict[tuple[int, tuple[int, ...]], str] = {}
    state = model.state_dict()
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
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError) as e:
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
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{path}: does not fit the model in config.yaml ({first})") from None
    model.to(device)


def kept_checkpoints(model_dir: Path) -> dict[int, Path]:
    """{step: weights file} of the checkpoints kept in model_dir/checkpoints."""
    found = {}
    for name in _names(model_dir / CKPT_DIR):
        m = _STEP_FILE.match(name)
        if m and m.group(2) == "safetensors":
            found[int(m.group(1))] = model_dir / CKPT_DIR / name
    return found


def dev_scores(model_dir: Path) -> dict[int, float]:
    """{step: dev score} of the validations in train_log.jsonl, higher is better, of the
    metric each names (BLEU, chrF, or the dev loss negated)."""
    scores = {}
    for number, event in read_jsonl(model_dir / LOG_JSONL):
        if event.get("event") == "validation":
            metric = event.get("metric", "bleu")
            value = event.get("dev_loss" if metric == "loss" else f"dev_{metric}")
            step = event.get("step")
            if not isinstance(step, int) or not isinstance(value, int | float | None):
                raise CheckpointError(
                    f"{model_dir / LOG_JSONL}:{number}: a validation event without a step or score"
                )
            if value is not None and math.isfinite(value):
                scores[step] = -value if metric == "loss" else value
    return scores


def average_checkpoints(
    model_dir: Path, n: int, by: str, min_step: int = 0
) -> tuple[Path, list[int]]:
    """Write model_dir/averaged.safetensors, the element-wise mean of n kept checkpoints (of
    steps from min_step on): the last n by step (by="last") or the n with the best dev score in
    train_log.jsonl (by="best": of the metric train.early_stopping named). Returns the file
    and the steps averaged."""
    kept = {s: p for s, p in kept_checkpoints(model_dir).items() if s >= min_step}
    if by == "best":
        scores = dev_scores(model_dir)
        steps = sorted((s for s in kept if s in scores), key=lambda s: (-scores[s], -s))[:n]
    else:
        steps = sorted(kept)[-n:]
    if len(steps) < n:
        raise CheckpointError(
            f"{model_dir}: {n} checkpoints asked for, {len(steps)} kept"
            + (" with a dev score" if by == "best" else "")
            + f" ({', '.join(f'step-{s}' for s in sorted(kept)) or 'none'}); raise train.keep_{by}"
        )
    first, aliases, tokenizer = read_tensors(kept[steps[0]])
    dtypes = {name: t.dtype for name, t in first.items()}
    total = {name: t.double() for name, t in first.items()}
    for step in steps[1:]:
        tensors, _, other = read_tensors(kept[step])
        if other != tokenizer:
            raise CheckpointError(
                f"{kept[step]}: trained with another tokenizer than {kept[steps[0]]}"
            )
        if tensors.keys() != total.keys():
            raise CheckpointError(f"{kept[step]}: other tensors than {kept[steps[0]]}")
        for name, t in tensors.items():
            total[name] += t.double()
    mean = {name: (t / len(steps)).to(dtypes[name]) for name, t in total.items()}
    path = model_dir / AVERAGED_FILE
    write_tensors(path, mean, aliases, tokenizer)
    return path, sorted(steps)


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

LOCK_FILE = ".lock"
_PROBE_BYTES = 4 << 20  # the start-up write check: a nearly full disk shows before any work


class DirLock:
    """The exclusive lock of a model directory: flock on the directory itself, which a run
    cannot lose (a lock on a file inside could be deleted, and a second trainer would lock a
    new file of the same name), and out/.lock, which names the holder's pid for messages."""

    def __init__(self, dir_fd: int, info: IO[str]) -> None:
        self.dir_fd, self.info = dir_fd, info

    def close(self) -> None:
        """Release the lock (closing twice is harmless); the OS also releases it when the
        process ends, however it ends (kill -9 included), so a lock is never stale."""
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1
        self.info.close()

    def __del__(self) -> None:  # as a file object does: a lock no one holds is released
        self.close()


def lock_model_dir(out: Path) -> DirLock:
    """Take the model directory's exclusive lock (creating the directory if needed)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise CheckpointError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        try:
            holder = (out / LOCK_FILE).read_text(encoding="utf-8").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise CheckpointError(
            f"--out {out}: in use by another attnmt train (pid {holder}); wait for it to end "
            "or stop it first"
        ) from None
    try:
        info = open(out / LOCK_FILE, "w", encoding="utf-8")  # noqa: SIM115 (held open)
        info.write(f"{os.getpid()}\n")
        info.flush()
    except OSError as e:
        os.close(dir_fd)
        raise CheckpointError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return DirLock(dir_fd, info)


def prepare_output_dir(out: Path, overwrite: bool, resume: bool) -> DirLock:
    """Lock the model directory (creating it), then reuse it with resume, or clear it with
    overwrite; refuse to mix two runs. Returns the lock file: keep it open while training.

    Fails before any data is read if the directory cannot be created or written, or is in
    use by another trainer (nothing in it is touched then).
    """
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a directory")
    lock = lock_model_dir(out)
    try:
        _clear_or_reuse(out, overwrite, resume)
        probe = out / CKPT_DIR / ".write-test"
        try:
            (out / CKPT_DIR).mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(bytes(_PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise CheckpointError(
                f"--out {out}: cannot write there ({e.strerror or e}; {free_space(out)})"
            ) from None
        finally:
            probe.unlink(missing_ok=True)
    except BaseException:
        lock.close()
        raise
    return lock


def _clear_or_reuse(out: Path, overwrite: bool, resume: bool) -> None:
    if any(f.name != LOCK_FILE for f in out.iterdir()) and not resume:
        if not overwrite:
            raise CheckpointError(
                f"--out {out}: already holds a run (or other files); pass --resume to continue "
                "it or --overwrite to start over"
            )
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        if (out / CKPT_DIR).is_dir():
            for f in (out / CKPT_DIR).iterdir():
                f.unlink()
        shutil.rmtree(out / "encoded", ignore_errors=True)  # attnmt.store's STORE_DIR
    # Temporary files of saves that a crash interrupted (the real files were never touched),
    # and a store that was being built (.encoded.tmp/: a directory): setup builds it anew.
    for d in (out, out / CKPT_DIR):
        for f in d.glob(".*.tmp") if d.is_dir() else []:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


@dataclass
class CheckpointRecord:
    step: int
    score: float | None  # dev score (train.early_stopping's, higher is better) at a validation


def save_checkpoint(
    out: Path,
    model: Seq2Seq,
    state: dict[str, Any],
    records: list[CheckpointRecord],
    keep_last: int,
    keep_best: int,
    tokenizer: str | None = None,
) -> None:
    """Write step-N weights and state, move the latest pointer to them, prune old ones.

    The pointer moves only after both files are complete, and pruning happens only after the
    pointer moved, so at every instant latest.json names a complete checkpoint.
    """
    step = records[-1].step
    ckpt = out / CKPT_DIR
    weights = ckpt / f"step-{step:08d}.safetensors"
    state_file = ckpt / f"step-{step:08d}.state.pt"
    save_weights(model, weights, tokenizer)
    atomic_write(state_file, lambda tmp: torch.save(sealed_state(state), tmp))
    pointer = {"step": step, "weights": weights.name, "state": state_file.name}
    atomic_write_bytes(ckpt / LATEST, json.dumps(pointer).encode("utf-8"))
    keep = {r.step for r in records[-keep_last:]}
    scored = sorted((r for r in records if r.score is not None), key=lambda r: -(r.score or 0.0))
    keep |= {r.step for r in scored[:keep_best]}
    for f in ckpt.iterdir():
        m = _STEP_FILE.match(f.name)
        if m and int(m.group(1)) not in keep:
            f.unlink(missing_ok=True)
    records[:] = [r for r in records if r.step in keep]


def latest_checkpoint(out: Path) -> tuple[Path, Path] | None:
    """(weights, state) of the newest complete checkpoint, or None if there is none yet: the
    one latest.json names, or, when the pointer is missing, unreadable or names a missing
    file, the newest step whose two files are both there (found by scanning)."""
    ckpt = out / CKPT_DIR
    pointer = ckpt / LATEST
    try:
        p = json.loads(pointer.read_text(encoding="utf-8"))
        weights, state = ckpt / str(p["weights"]), ckpt / str(p["state"])
        if weights.is_file() and state.is_file():
            return weights, state
    except (OSError, ValueError, KeyError, TypeError):
        pass
    steps = sorted(
        {int(m.group(1)) for m in map(_STEP_FILE.match, _names(ckpt)) if m}, reverse=True
    )
    for step in steps:
        weights = ckpt / f"step-{step:08d}.safetensors"
        state = ckpt / f"step-{step:08d}.state.pt"
        if weights.is_file() and state.is_file():
            return weights, state
    return None


def _names(directory: Path) -> list[str]:
    return [f.name for f in directory.iterdir()] if directory.is_dir() else []


def sealed_state(state: dict[str, Any]) -> dict[str, Any]:
    """A training state as it is written (format 2): the state serialized by torch.save, as
    bytes, beside their SHA-256; load_train_state refuses a file whose bytes do not match
    (one flipped byte would otherwise resume silently into a different run)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return {
        "format_version": STATE_FORMAT_VERSION,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8),
    }


def load_train_state(path: Path) -> dict[str, Any]:
    """Load a training state with torch.load(weights_only=True): plain tensors and numbers only.

    A file that would run code or build arbitrary objects when unpickled is refused before any
    of its code runs; a sealed one (format 2) whose checksum does not match is refused.
    """
    state = _load_state(path, path)
    if state.get("payload") is not None:
        payload = state["payload"].numpy().tobytes()
        if hashlib.sha256(payload).hexdigest() != state.get("sha256"):
            raise CheckpointError(
                f"{path}: damaged: the training state does not match the checksum written "
                "with it; resume from another checkpoint (--weights step-N keeps them)"
            )
        state = _load_state(path, io.BytesIO(payload))
    return state


def _load_state(path: Path, source: Path | io.BytesIO) -> dict[str, Any]:
    """One torch.load(weights_only=True) of a state (the file, or its sealed payload),
    checked to be attnmt's."""
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unpickling refused"
        raise CheckpointError(
            f"{path}: refused to load: the file holds objects other than tensors and numbers "
            f"(it could run code when unpickled): {first}"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable training state ({e})") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path}: not an attnmt training state")
    if int(state["format_version"]) > STATE_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: training-state format version {state['format_version']} is newer than "
            f"this attnmt ({__version__}) reads (version {STATE_FORMAT_VERSION}); upgrade attnmt"
        )
    return state


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
        kept = sorted(int(m.group(1)) for m in map(_STEP_FILE.match, names) if m)
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
    except (ValueError, KeyError, TypeError, AttributeError) as e:
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
    load_weights(model, resolve_weights(model_dir, weights), device, digest)
    model.to(device).eval()
    return cfg, tokenizer, model
