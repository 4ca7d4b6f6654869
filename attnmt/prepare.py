"""The training data of a run: its tokenizer (trained, given, inherited or the run's own), the
encoded training store, and the dev set in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnmt import distributed
from attnmt.checkpoint import CONFIG_FILE, write_run_files
from attnmt.config import Config, from_dict, read_yaml
from attnmt.data import ParallelText, read_split_text
from attnmt.errors import DataError
from attnmt.processes import run_in_child
from attnmt.resume import check_resumable
from attnmt.runlog import RunLog, log_data
from attnmt.store import (
    STORE_DIR,
    TokenStore,
    build_store,
    check_fingerprint,
    damage,
    default_workers,
    open_store,
)
from attnmt.tokenizer import Tokenizer


@dataclass
class EncodedSplit:
    """A small split (dev) encoded in memory."""

    src: list[list[int]]
    tgt: list[list[int]]


def encode_split(text: ParallelText, tokenizer: Tokenizer) -> EncodedSplit:
    return EncodedSplit(tokenizer.src.encode(text.src), tokenizer.tgt.encode(text.tgt))


def prepare_data(
    cfg: Config, out: Path, ranks: distributed.Ranks, resuming: bool, log: RunLog
) -> tuple[Tokenizer, TokenStore, EncodedSplit, ParallelText]:
    """Train the tokenizer on the training files read as a stream (rank 0; loaded when
    resuming), write the run files, encode the training pairs into the memory-mapped store
    (rank 0; reused by --resume after checking that the files did not change; the other ranks
    map it), and read and encode the dev set."""
    data = cfg.data
    files = [f for split in (*data.corpora, data.dev) for f in split.files]
    dev_text = read_split_text(data.dev)
    if not dev_text.src:
        raise DataError(f"{data.dev.name}: no sentence pairs with text on both sides")
    if resuming:
        check_resumable(from_dict(read_yaml(out / CONFIG_FILE)), cfg)
    if ranks.is_main:
        tokenizer = make_tokenizer(cfg, out, resuming)
        write_run_files(out, cfg, tokenizer)  # on resume: the config's resumable changes
        ensure_store(cfg, out, tokenizer, resuming, files, log)
    ranks.barrier()  # the tokenizer and the store are complete before the others read them
    if not ranks.is_main:
        tokenizer = Tokenizer.load(out, cfg.tokenizer.joint)
    store = open_store(out)
    assert store is not None
    log_data(log, store, dev_text, tokenizer)
    return tokenizer, store, encode_split(dev_text, tokenizer), dev_text


def make_tokenizer(cfg: Config, out: Path, resuming: bool) -> Tokenizer:
    """The run's own (resuming), the fine-tuned model's (train.init_from), the given one
    (tokenizer.model), or a new one trained on a sample of the training data."""
    joint = cfg.tokenizer.joint
    if resuming:
        return Tokenizer.load(out, joint)
    if cfg.train.init_from is not None:
        return Tokenizer.load(cfg.train.init_from, joint)
    if cfg.tokenizer.given is not None:
        return Tokenizer.from_files(cfg.tokenizer.given)
    return Tokenizer.train_on_files(cfg.data.corpora, cfg.tokenizer, cfg.train.seed)


def ensure_store(
    cfg: Config, out: Path, tokenizer: Tokenizer, resuming: bool, files: list[Path], log: RunLog
) -> None:
    """Reuse the encoded store when resuming (refused if a file in `files` changed; rebuilt,
    with a warning, if the store itself is damaged: it is made from those files alone), else
    build it, in a child process: what streaming the corpus leaves in Python's allocator goes
    with it, and Ctrl-C does not wait for the encoding workers."""
    store = open_store(out) if resuming else None
    if store is not None:
        check_fingerprint(out / STORE_DIR, files)
        problem = damage(store, (len(tokenizer.src), len(tokenizer.tgt)))
        if problem is None:
            return
        log.event(
            "store",
            f"warning: the encoded corpus is damaged ({problem}); rebuilding it",
            problem=problem,
        )
    data = cfg.data
    protos = (tokenizer.src.proto, tokenizer.tgt.proto)
    workers = data.workers or default_workers()

    def encode() -> bytes:
        build_store(out, list(data.corpora), protos, data.max_len, workers, files)
        return b""

    run_in_child(encode)
