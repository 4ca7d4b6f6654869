"""A downloaded model's files read as untrusted input, as a request is: every file's size is
checked before it is read, YAML aliases are bounded before anything expands them, JSON nesting
is bounded, weights are read without unpickling and with their dtypes and shapes checked
before a tensor is made, and what the config describes is compared with what the weights file
can hold before anything of the config's size is allocated (a model is first built on the
`meta` device, which allocates nothing). Every refusal is one line that says what attnmt
refuses and why, never how to get round it.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from pydantic import ValidationError

from attnmt.config import ModelConfig, safe_yaml
from attnmt.errors import CheckpointError
from attnmt.models.build import build_model

MAX_FILE_BYTES = 64 << 20  # a config, a vocabulary or a SentencePiece model (OPUS-MT: ~1 MB)
MAX_INFLATE = 16  # an npz member may inflate to this many times its stored size (zip bombs)
WEIGHT_DTYPES = {"F32", "F16", "BF16", "F64"}  # safetensors' names of the dtypes taken


def check_size(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> None:
    """Refuse a file over `limit` bytes (before anything reads it), or one that is missing."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if size > limit:
        raise CheckpointError(f"{path}: {size:,} bytes; {what} has at most {limit:,}")


def read_bytes(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """A file's bytes, refused unreadable or over `limit` before it is read."""
    check_size(path, what, limit)
    try:
        return path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None


def read_text(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> str:
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason}); not {what}") from None


def json_value(path: Path, what: str) -> Any:
    """A JSON file's value (size and nesting bounded)."""
    try:
        return json.loads(read_text(path, what))
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e}); not {what}") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply; not {what}") from None


def yaml_value(text: str, where: str) -> Any:
    """A YAML text's value: safe tags only, aliases that expand too far refused before anything
    reads them (a "billion laughs" file), nesting bounded."""
    try:
        return safe_yaml(text)
    except RecursionError:
        raise CheckpointError(f"{where}: YAML nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise CheckpointError(
            f"{where}{line}: not valid YAML ({getattr(e, 'problem', e)})"
        ) from None


def vocab_ids(found: Any, path: Path) -> dict[str, int]:
    """A vocabulary's piece -> id map as read from its file, checked: a non-empty mapping,
    ids whole numbers from 0, each piece its own id."""
    if not isinstance(found, dict) or not found:
        raise CheckpointError(f"{path}: expected a map of piece: id")
    for piece, i in found.items():
        if type(i) is not int or i < 0:
            raise CheckpointError(f"{path}: {short(piece)} has id {short(i)}; ids count from 0")
    if len(set(found.values())) < len(found):
        raise CheckpointError(f"{path}: several pieces share an id; each has its own")
    return {str(piece): i for piece, i in found.items()}


def short(value: object, width: int = 60) -> str:
    """A value as a message shows it: its repr, cut."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def validated_model(where: Path, source: str, **fields: Any) -> ModelConfig:
    """The model section an importer reads from a source's config, validated: a value out of
    attnmt's range is one line naming it (`source`: where the values come from)."""
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        name = first["loc"][0] if first["loc"] else "model"
        raise CheckpointError(f"{where}: {name}: {first['msg']} (from {source})") from None


def check_rows(rows: list[int], available: int, where: Path) -> None:
    """Every id a vocabulary or config names must be one of the embeddings' rows."""
    if rows and max(rows) >= available:
        raise CheckpointError(f"{where}: id {max(rows)} is past the embeddings' {available:,} rows")


def expected_state(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint: bool) -> dict:
    """The state dict's shapes of the model the config describes, built on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg, src_vocab, tgt_vocab, joint)
    return {name: t.shape for name, t in model.state_dict().items()}


def check_fits(expected: dict[str, torch.Size], weights: Path, bytes_per_value: int) -> None:
    """Refuse a config that describes more layer weights than the weights file can hold (the
    embeddings aside: their rows depend on the vocabulary)."""
    layers = sum(math.prod(s) for n, s in expected.items() if "_layers." in n)
    size = weights.stat().st_size
    if layers * bytes_per_value > size:
        raise CheckpointError(
            f"{weights}: its config describes {layers:,} layer weights, more than its "
            f"{size:,} bytes can hold; the config and the weights do not belong together"
        )


def check_state(state: dict[str, torch.Tensor], expected: dict, where: Path) -> None:
    """Every tensor of the mapped state as the config's model has it: the same names and
    shapes, finite values."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{where}: no weights for {missing[0]} (and {len(missing) - 1} more)")
    for name, t in state.items():
        if name not in expected:
            raise CheckpointError(f"{where}: {name} has no place in the model its config describes")
        if t.shape != expected[name]:
            raise CheckpointError(
                f"{where}: {name} is {tuple(t.shape)}; the config makes it {tuple(expected[name])}"
            )
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: {name} holds NaN or infinite values; refused")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors: floating point only, at most 2-D, shapes checked against
    the file's size before each tensor is made."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = f.get_slice(name)
                dtype, shape = sliced.get_dtype(), sliced.get_shape()
                if dtype not in WEIGHT_DTYPES or len(shape) > 2 or 0 in shape:
                    raise CheckpointError(
                        f"{path}: {name} is {dtype} {tuple(shape)}; attnmt imports non-empty "
                        f"floating-point matrices and vectors ({', '.join(sorted(WEIGHT_DTYPES))})"
                    )
                out[name] = f.get_tensor(name)
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable weights ({str(e)[:200]})") from None


def read_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors, read with torch's weights-only loader: anything but
    tensors in a mapping is refused (no code of the file's runs)."""
    try:
        found = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's message offers to unpickle: ours does not
        raise CheckpointError(
            f"{path}: refused ({type(e).__name__}): it holds more than tensors, or is damaged; "
            "attnmt reads weights without running the file's code"
        ) from None
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in found.items()
    ):
        raise CheckpointError(f"{path}: not a mapping of names to tensors; refused")
    for name, t in found.items():
        if not t.is_floating_point() or t.dim() > 2 or t.numel() == 0:
            raise CheckpointError(
                f"{path}: {name} is {t.dtype} {tuple(t.shape)}; attnmt imports non-empty "
                "floating-point matrices and vectors"
            )
    return found


def read_npz(path: Path, known: Any) -> dict[str, np.ndarray]:
    """The arrays of a Marian model.npz: every member's name checked by `known(name)` and its
    inflated size bounded before it is read; no object arrays (nothing is unpickled)."""
    arrays = {}
    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            for m in members:
                name = m.filename.removesuffix(".npy")
                if not known(name):
                    raise CheckpointError(
                        f"{path}: {short(name)} is not an array of a Marian model"
                    )
                if m.file_size > MAX_INFLATE * max(m.compress_size, 1 << 20):
                    raise CheckpointError(
                        f"{path}: {short(name)} inflates to {m.file_size:,} bytes from "
                        f"{m.compress_size:,}; refused (not a model's array)"
                    )
            for m in members:
                with z.open(m) as f:
                    arrays[m.filename.removesuffix(".npy")] = np.lib.format.read_array(
                        f, allow_pickle=False
                    )
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise CheckpointError(f"{path}: holds Python objects, not numbers; refused") from None
        raise CheckpointError(f"{path}: not a Marian model.npz ({str(e)[:200]})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{path}: not a Marian model.npz ({str(e)[:200]})") from None
    return arrays
