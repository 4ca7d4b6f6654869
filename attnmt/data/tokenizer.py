"""SentencePiece training, loading, encode/decode, and the special token ids."""

from __future__ import annotations

import io
import itertools
import math
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm

from attnmt.data.files import reason
from attnmt.data.processes import run_in_child
from attnmt.data.text import read_corpora
from attnmt.errors import CheckpointError, ConfigError, DataError

if TYPE_CHECKING:
    from attnmt.config import SplitConfig, TokenizerConfig

# Fixed ids so that the model, the batcher and both vocabularies agree without a lookup.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SAMPLE_SENTENCES = 2_000_000  # SentencePiece trains on at most this many sentences


def language_tag(lang: str) -> str:
    """The piece put before a multilingual model's source to ask for target language `lang`
    (Johnson et al. 2017, https://arxiv.org/abs/1611.04558): <2en>."""
    return f"<2{lang}>"


# The source piece that marks a synthetic (back-translated) source in training (Caswell et
# al. 2019, https://arxiv.org/abs/1906.06442): reserved like the language tags, so no text
# ever becomes it, and never put before a source that is translated.
BT_TAG = "<BT>"
# The source piece between a sentence and the target of its translation memory match (Neural
# Fuzzy Repair, Bulté & Tezcan 2019): a model trained with data.tm reads "SOURCE <FM> MATCH".
# Unlike the tags above it is text: the piece the text <FM> becomes (TmLookup adds it).
FM_TAG = "<FM>"


def train_sentencepiece(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    symbols: Sequence[str] = (),
) -> bytes:
    """Train a SentencePiece model in-process and return the serialized model.

    The vocabulary size is a soft limit (hard_vocab_limit=False) so that a small corpus gets
    the largest vocabulary it supports instead of an error; one thread keeps it deterministic.
    It reads at most SAMPLE_SENTENCES sentences (Tokenizer.train_on_files samples them).
    """
    buf = io.BytesIO()
    try:
        _train(sentences, buf, vocab_size, model_type, character_coverage, symbols)
    except RuntimeError as e:
        message = str(e)
        need = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
        if need:
            raise ConfigError(
                f"tokenizer.vocab_size = {vocab_size} is too small: the training text needs at "
                f"least {need.group(2)} pieces for its characters and special tokens "
                "(raise tokenizer.vocab_size or lower tokenizer.character_coverage)"
            ) from None
        raise DataError(f"SentencePiece training failed: {message.splitlines()[0]}") from None
    return buf.getvalue()


def _train(
    sentences: Iterable[str],
    buf: io.BytesIO,
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    symbols: Sequence[str],
) -> None:
    # `symbols` (language tags) are user-defined pieces: always one piece, never split.
    extra = {"user_defined_symbols": list(symbols)} if symbols else {}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        hard_vocab_limit=False,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        num_threads=1,
        input_sentence_size=SAMPLE_SENTENCES,
        shuffle_input_sentence=False,
        max_sentence_length=1 << 16,
        minloglevel=2,
        **extra,
    )


def reservoir_sample(items: Iterator[str], k: int, rng: random.Random) -> list[str]:
    """A uniform random sample of k items (all of them, in order, when there are at most k),
    reading the iterator to its end once: Li's Algorithm L, which draws random numbers only
    for the items it takes (about k log(n / k)), not one per item."""
    sample = list(itertools.islice(items, k))
    if len(sample) < k:
        return sample
    w = math.exp(math.log(1.0 - rng.random()) / k)
    while True:
        skip = math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - w))
        taken = next(itertools.islice(items, skip, skip + 1), None)
        if taken is None:
            return sample
        sample[rng.randrange(k)] = taken
        w *= math.exp(math.log(1.0 - rng.random()) / k)


def _train_on_sample(
    corpora: list[SplitConfig],
    sides: tuple[int, ...],
    cfg: TokenizerConfig,
    seed: int,
    symbols: Sequence[str] = (),
) -> bytes:
    """A SentencePiece model of the corpora's sides `sides` (0: source, 1: target), trained on
    a random sample of their sentences drawn with `seed`. The whole corpus is read (and
    validated) while sampling, before SentencePiece's C++ trainer starts."""
    sentences = (pair[k] for pair in read_corpora(corpora) for k in sides)
    sample = reservoir_sample(sentences, SAMPLE_SENTENCES, random.Random(seed))
    if not sample:
        raise DataError(f"{corpora[0].name}: no sentence pairs with text on both sides")
    return train_sentencepiece(
        sample, cfg.vocab_size, cfg.model_type, cfg.character_coverage, symbols
    )


_CONTROL, _UNKNOWN, _USER_DEFINED = 3, 2, 4  # ModelProto.SentencePiece.Type


def _user_defined_ids(proto: bytes) -> frozenset[int]:
    """The ids of a SentencePiece model's user-defined pieces."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(proto)
    return frozenset(
        i for i, p in enumerate(m.pieces) if p.type == _USER_DEFINED and p.piece != FM_TAG
    )


def conform(proto: bytes, path: Path) -> bytes:
    """A SentencePiece model made elsewhere, its special pieces moved to our ids (pad 0, unk 1,
    bos 2, eos 3, the order of the other pieces kept, each with its score): the pieces are
    reordered in the model itself, so ids need no mapping afterwards. A missing pad, bos or eos
    piece is added (spm_train's default has no pad). ConfigError naming `path` when it cannot
    be one of ours."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    try:
        m.ParseFromString(proto)
    except DecodeError:
        m.Clear()
    unknown = [i for i, p in enumerate(m.pieces) if p.type == _UNKNOWN]
    if len(unknown) != 1:
        raise ConfigError(f"{path}: not a SentencePiece model (no unknown-word piece)")
    spec = m.trainer_spec
    special = [None, unknown[0], None, None]
    for our_id, name in (
        (PAD_ID, spec.pad_piece),
        (BOS_ID, spec.bos_piece),
        (EOS_ID, spec.eos_piece),
    ):
        found = [i for i, p in enumerate(m.pieces) if p.piece == name]
        if found and m.pieces[found[0]].type != _CONTROL:
            raise ConfigError(
                f"{path}: its piece {name!r} is an ordinary piece, but attnmt needs it as the "
                "control symbol it is in SentencePiece's defaults"
            )
        special[our_id] = found[0] if found else None
    pieces = []
    for i, name in zip(
        special, (spec.pad_piece, None, spec.bos_piece, spec.eos_piece), strict=True
    ):
        piece = pb.ModelProto.SentencePiece()
        if i is None:
            piece.piece, piece.score, piece.type = name, 0.0, _CONTROL
        else:
            piece.CopyFrom(m.pieces[i])
        pieces.append(piece)
    pieces += [p for i, p in enumerate(m.pieces) if i not in special]
    del m.pieces[:]
    m.pieces.extend(pieces)
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    out = m.SerializeToString()
    sp = spm.SentencePieceProcessor(model_proto=out)
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise ConfigError(f"{path}: its special pieces cannot be given attnmt's ids")
    return out


class SubwordVocab:
    """One SentencePiece model: text <-> ids."""

    def __init__(self, model_proto: bytes) -> None:
        self.proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        # Language tags and <BT>: set by ids, never by text (FM_TAG is text).
        self.reserved = _user_defined_ids(model_proto)

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, lines: Sequence[str]) -> list[list[int]]:
        """Each line's ids. Text never becomes a reserved piece: SentencePiece matches a
        user-defined piece (a language tag such as <2en>) wherever its text occurs, so such a
        piece is spelled out in its characters' pieces instead (control pieces, <s> </s>
        <pad>, never match text)."""
        # Threads only for many lines: starting them costs more than a few lines take (and
        # they contend with a search's threads when a server encodes lines as they come).
        threads = -1 if len(lines) >= 256 else 1
        found = self.sp.encode(list(lines), out_type=int, num_threads=threads)
        if not self.reserved:
            return found
        return [ids if self.reserved.isdisjoint(ids) else self.spelled(ids) for ids in found]

    def spelled(self, ids: list[int]) -> list[int]:
        """ids with each reserved piece spelled in its characters' pieces."""
        out: list[int] = []
        for i in ids:
            if i in self.reserved:  # a character with no piece of its own becomes unk
                out += [self.sp.piece_to_id(c) for c in self.sp.id_to_piece(i)]
            else:
                out.append(i)
        return out

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.sp.id_to_piece(int(i)) for i in ids]

    @cached_property
    def word_inner(self) -> list[bool]:
        """Per id: whether the piece that continue the word before them (a letter or digit
        without SentencePiece's word-start mark ▁); not punctuation, nor special pieces."""
        sp = self.sp
        return [
            not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i)[:1].isalnum()
            for i in range(len(self))
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


class Tokenizer:
    """Source and target vocabularies; the same object twice when the vocabulary is joint."""

    JOINT_FILE = "spm.model"
    SRC_FILE = "spm.src.model"
    TGT_FILE = "spm.tgt.model"

    def __init__(self, src: SubwordVocab, tgt: SubwordVocab) -> None:
        self.src = src
        self.tgt = tgt

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @classmethod
    def train(
        cls,
        src_lines: Sequence[str],
        tgt_lines: Sequence[str],
        vocab_size: int,
        joint: bool,
        model_type: str = "unigram",
        character_coverage: float = 1.0,
    ) -> Tokenizer:
        """Train the SentencePiece model(s), each in a child process (processes.run_in_child:
        Ctrl-C does not wait for the C++ trainer)."""

        def trained(lines: Sequence[str]) -> SubwordVocab:
            return SubwordVocab(
                run_in_child(
                    lambda: train_sentencepiece(lines, vocab_size, model_type, character_coverage)
                )
            )

        if joint:
            vocab = trained([*src_lines, *tgt_lines])
            return cls(vocab, vocab)
        return cls(trained(src_lines), trained(tgt_lines))

    @classmethod
    def train_on_files(
        cls, corpora: list[SplitConfig], cfg: TokenizerConfig, seed: int, tags: Sequence[str] = ()
    ) -> Tokenizer:
        """Train on a parallel corpus read as a stream (never held whole; pairs validated as
        attnmt.data.text.read_pairs does), sampled with `seed`, each model in a child process;
        `tags` (language tags) are pieces of the source (or joint) model."""

        def trained(sides: tuple[int, ...], symbols: Sequence[str]) -> SubwordVocab:
            work = partial(_train_on_sample, corpora, sides, cfg, seed, symbols)
            return SubwordVocab(run_in_child(work))

        if cfg.joint:
            vocab = trained((0, 1), tags)
            return cls(vocab, vocab)
        return cls(trained((0,), tags), trained((1,), ()))

    def bt_id(self) -> int | None:
        """The source id of the back-translation tag (BT_TAG), None if it has none."""
        i = self.src.sp.piece_to_id(BT_TAG)
        return i if i in self.src.reserved else None

    def fm_id(self) -> int | None:
        """The source id of the fuzzy-match separator (FM_TAG), None if it has none."""
        i = self.src.sp.piece_to_id(FM_TAG)
        return None if i == UNK_ID or self.src.sp.id_to_piece(i) != FM_TAG else i

    def tag_id(self, lang: str) -> int | None:
        """The source id of language `lang`'s tag (language_tag), None if it has none."""
        i = self.src.sp.piece_to_id(language_tag(lang))
        return None if i == UNK_ID else int(i)

    @classmethod
    def from_files(cls, paths: list[Path]) -> Tokenizer:
        """Given SentencePiece model file(s) (one: joint; two: source and target), their
        special pieces moved to our ids (`conform`)."""
        vocabs = []
        for path in paths:
            try:
                proto = read_model_file(path)
                vocabs.append(SubwordVocab(conform(proto, path)))
            except (OSError, RuntimeError, ValueError) as e:
                raise ConfigError(
                    f"{path}: not a usable SentencePiece model ({reason(e)})"
                ) from None
        return cls(vocabs[0], vocabs[-1])

    def files(self) -> dict[str, bytes]:
        """File name -> content, for the model directory."""
        if self.joint:
            return {self.JOINT_FILE: self.src.proto}
        return {self.SRC_FILE: self.src.proto, self.TGT_FILE: self.tgt.proto}

    @classmethod
    def load(cls, model_dir: Path, joint: bool) -> Tokenizer:
        names = [cls.JOINT_FILE] if joint else [cls.SRC_FILE, cls.TGT_FILE]
        vocabs = []
        for name in names:
            path = model_dir / name
            if not path.is_file():
                raise CheckpointError(f"{model_dir}: missing SentencePiece model {name}")
            try:
                vocabs.append(SubwordVocab(read_model_file(path)))
            except (OSError, RuntimeError, ValueError) as e:
                raise CheckpointError(f"{path}: not a SentencePiece model ({reason(e)})") from None
        return cls(vocabs[0], vocabs[-1])  # joint: the same object twice


MAX_MODEL_BYTES = 256 << 20  # a SentencePiece model of a million pieces is under 100 MiB


def read_model_file(path: Path) -> bytes:
    """A SentencePiece model file's bytes; one larger than MAX_MODEL_BYTES is refused before it
    is read (ValueError), not loaded until memory runs out."""
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise ValueError(f"{size:,} bytes, more than a SentencePiece model holds")
    return path.read_bytes()
