"""The training data of a run: its tokenizer (trained, given, inherited or the run's own), the
encoded training store, and the dev set in memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from attnmt.config import Config, DataConfig, SplitConfig, TrainCorpus, from_dict, read_yaml
from attnmt.data.processes import run_in_child
from attnmt.data.store import (
    STORE_DIR,
    TokenStore,
    build_store,
    check_fingerprint,
    damage,
    default_workers,
    open_store,
)
from attnmt.data.text import ParallelText, read_split_text
from attnmt.data.tokenizer import BT_TAG, FM_TAG, Tokenizer, language_tag
from attnmt.errors import ConfigError, DataError
from attnmt.models.directory import CONFIG_FILE, check_same_base, write_run_files
from attnmt.training import distributed
from attnmt.training.resume import check_resumable
from attnmt.training.runlog import RunLog, log_data
from attnmt.training.tm_pairs import TM_PAIRS


@dataclass
class EncodedSplit:
    """A small split (dev) encoded in memory."""

    src: list[list[int]]
    tgt: list[list[int]]


def encode_split(text: ParallelText, tokenizer: Tokenizer, prefix: list[int] = []) -> EncodedSplit:  # noqa: B006 (read only)
    """A split's pairs as ids; `prefix` before every source (a target-language tag)."""
    src = [[*prefix, *s] for s in tokenizer.src.encode(text.src)]
    return EncodedSplit(src, tokenizer.tgt.encode(text.tgt))


@dataclass
class DevSet:
    """A dev set of one direction: its name (de-en), text, ids, and the source prefix (the
    target-language tag of a multilingual model, else empty)."""

    name: str
    text: ParallelText
    encoded: EncodedSplit
    prefix: list[int]


def source_prefix(data: DataConfig, tokenizer: Tokenizer, lang: str | None) -> list[int]:
    """What goes before a source translated into `lang`: its tag in a multilingual run."""
    if not data.multilingual:
        return []
    tag = tokenizer.tag_id(str(lang))
    assert tag is not None, "make_tokenizer checked the tags"
    return [tag]


def set_names(splits: list[SplitConfig]) -> list[str]:
    """Each set's direction (de-en), numbered where two share one."""
    names = [s.direction for s in splits]
    return [n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names)]


def prepare_data(
    cfg: Config, out: Path, ranks: distributed.Ranks, resuming: bool, log: RunLog
) -> tuple[Tokenizer, TokenStore, list[DevSet]]:
    """Train the tokenizer on the training files read as a stream (rank 0; loaded when
    resuming), write the run files, encode the training pairs into the memory-mapped store
    (rank 0; reused by --resume after checking that the files did not change; the other ranks
    map it), and read and encode the dev sets."""
    data = cfg.data
    files = [f for split in (*data.corpora, *data.dev_sets) for f in split.files]
    texts = [read_split_text(split) for split in data.dev_sets]
    for split, text in zip(data.dev_sets, texts, strict=True):
        if not text.src:
            raise DataError(f"{split.name}: no sentence pairs with text on both sides")
    if data.tm is not None:  # the store is made from it too (setup wrote it before the clock)
        files.append(out / TM_PAIRS)
    if resuming:
        check_resumable(from_dict(read_yaml(out / CONFIG_FILE)), cfg)
        check_same_base(out, cfg)
    if ranks.is_main:
        anew = not resuming and cfg.train.init_from is None and cfg.tokenizer.given is None
        doing = (
            f"training the tokenizer ({cfg.tokenizer.vocab_size:,} SentencePiece pieces) on a "
            "sample of the training data"
        )
        with said(log if anew else None, doing, "tokenizer trained"):
            tokenizer = make_tokenizer(cfg, out, resuming)
        write_run_files(out, cfg, tokenizer)  # on resume: the config's resumable changes
        ensure_store(cfg, out, tokenizer, resuming, files, log)
    ranks.barrier()  # the tokenizer and the store are complete before the others read them
    if not ranks.is_main:
        tokenizer = Tokenizer.load(out, cfg.tokenizer.joint)
    store = open_store(out)
    assert store is not None
    log_data(log, store, texts, tokenizer)
    dev_sets = []
    for split, name, text in zip(data.dev_sets, set_names(data.dev_sets), texts, strict=True):
        prefix = source_prefix(data, tokenizer, split.tgt_lang)
        dev_sets.append(DevSet(name, text, encode_split(text, tokenizer, prefix), prefix))
    return tokenizer, store, dev_sets


def make_tokenizer(cfg: Config, out: Path, resuming: bool) -> Tokenizer:
    """The run's own (resuming), the fine-tuned model's (train.init_from), the given one
    (tokenizer.model), or a new one trained on a sample of the training data; in a
    multilingual run with a tag for each target language (language_tag)."""
    joint, langs = cfg.tokenizer.joint, cfg.data.target_langs
    tags = [language_tag(lang) for lang in langs] if cfg.data.multilingual else []
    bt = [BT_TAG] if cfg.data.synthetic else []
    fm = [FM_TAG] if cfg.data.tm is not None else []
    if resuming:
        tokenizer, source = Tokenizer.load(out, joint), f"--out {out}"
    elif cfg.train.init_from is not None:
        tokenizer = Tokenizer.load(cfg.train.init_from, joint)
        source = f"train.init_from {cfg.train.init_from}"
    elif cfg.tokenizer.given is not None:
        tokenizer, source = Tokenizer.from_files(cfg.tokenizer.given), "tokenizer.model"
    else:
        symbols = tags + bt + fm
        return Tokenizer.train_on_files(cfg.data.corpora, cfg.tokenizer, cfg.train.seed, symbols)
    missing = [tag for tag, lang in zip(tags, langs, strict=True) if tokenizer.tag_id(lang) is None]
    if cfg.data.tm is not None and tokenizer.fm_id() is None:
        missing.append(FM_TAG)
    if bt and tokenizer.bt_id() is None:
        raise ConfigError(
            f"data.train: a corpus is synthetic, but {source} has no {BT_TAG} piece to mark its "
            f"sources with; a model trained with a synthetic corpus has one (fine-tune from "
            f"it), or train the tokenizer anew"
        )
    if missing:
        raise ConfigError(
            f"{source}: its source SentencePiece model has no {', '.join(missing)} piece(s), "
            "which a multilingual run puts before each source; train a tokenizer with them "
            "(user_defined_symbols) or leave tokenizer.model out"
        )
    return tokenizer


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
    bt = tokenizer.bt_id()
    corpora = list(data.corpora)
    prefixes = [
        [*source_prefix(data, tokenizer, c.tgt_lang), *([bt] if c.synthetic else [])]
        for c in corpora
    ]
    if data.tm is not None:  # the pairs with their TM matches: a corpus of their own
        corpora.append(TrainCorpus(tsv=out / TM_PAIRS, tgt_lang=corpora[0].tgt_lang))
        prefixes.append(prefixes[0])

    def encode() -> bytes:
        build_store(out, corpora, protos, data.max_len, workers, files, prefixes)
        return b""

    processes = f"{workers} process{'es' if workers > 1 else ''}"
    doing = f"encoding the training pairs into {out / STORE_DIR} ({processes})"
    with said(log, doing, "training pairs encoded"):
        run_in_child(encode)


@contextmanager
def said(log: RunLog | None, doing: str, done: str) -> Iterator[None]:
    """A `prepare` event before a step of preparation and one with its seconds after (a
    minute on a large corpus: said, not silent); nothing with log None."""
    started = time.monotonic()
    if log is not None:
        log.event("prepare", f"{doing}…")
    yield
    if log is not None:
        log.event("prepare", f"{done} in {time.monotonic() - started:.0f} s")
