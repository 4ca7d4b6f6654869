"""The config schema: typed and closed (unknown keys are errors), YAML loading, `--set` overrides.

Every key has a default except the data paths; docs/configuration.md documents each one.
Relative data paths are resolved against the current working directory when the config is
loaded, and the resolved config (absolute paths, defaults filled in) is what the model
directory stores.
"""

from __future__ import annotations

import difflib
import re
import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from attnmt.errors import ConfigError

# The choices of where and in what number format to compute; attnmt.device derives its lists
# (and the CLI's messages) from these, so each set of choices is written once.
DeviceChoice = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp16"]
DecodePrecision = Literal["fp32", "bf16", "fp16", "int8"]  # int8: CPU only
TrainPrecision = Literal["auto", "fp32", "bf16", "fp16"]  # auto: bf16 where the hardware has it
MatmulChoice = Literal["auto", "blas", "onednn"]  # the library of CPU fp32 matmuls
LengthNorm = Literal["gnmt", "length"]  # beam search's length penalty form (DecodeConfig)


class _Section(BaseModel):
    # extra="forbid" makes the schema closed: a typo in a key is an error, not a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


LANGUAGE = r"^[A-Za-z][A-Za-z0-9_-]{0,15}$"  # a language code: en, pt-BR, zh_Hant
_LANG_SUFFIX = re.compile(r"\.([a-z]{2})(?:\.gz)?$")  # train.de.gz: de


class SplitConfig(_Section):
    """A parallel corpus: two aligned files (src, tgt), or one TSV file whose 1-based fields
    src_field and tgt_field hold the two sides (as `cut -f` counts)."""

    src: Path | None = None
    tgt: Path | None = None
    tsv: Path | None = None
    src_field: int = Field(1, ge=1, le=1000)
    tgt_field: int = Field(2, ge=1, le=1000)
    src_lang: str | None = Field(None, pattern=LANGUAGE)  # e.g. de: its direction's name
    tgt_lang: str | None = Field(None, pattern=LANGUAGE)  # several in a run: multilingual

    @model_validator(mode="after")
    def _one_source(self) -> SplitConfig:
        two_files = self.src is not None and self.tgt is not None
        if self.tsv is not None and (self.src is not None or self.tgt is not None):
            raise ValueError("give either src and tgt (two files) or tsv (one file), not both")
        if self.tsv is None and not two_files:
            raise ValueError("give src and tgt (two files) or tsv (one file)")
        if self.tsv is not None and self.src_field == self.tgt_field:
            raise ValueError(f"src_field and tgt_field are both {self.src_field}")
        return self

    @property
    def files(self) -> list[Path]:
        """The files this corpus is read from."""
        return [self.tsv] if self.tsv is not None else [self.src, self.tgt]  # type: ignore[list-item]

    @property
    def name(self) -> Path:
        """The file to name in messages about the corpus as a whole (its source side)."""
        return self.files[0]

    @property
    def direction(self) -> str:
        """'de-en' from its languages (where not given: '?'), or the source file's name."""
        if self.src_lang is None and self.tgt_lang is None:
            return self.name.name
        return f"{self.src_lang or '?'}-{self.tgt_lang or '?'}"


class TrainCorpus(SplitConfig):
    """A training corpus; in a list of several, `weight` sets its share of the pairs seen;
    `synthetic`: its sources are machine translations (back-translation), each marked by the
    reserved source piece <BT> (tagged back-translation, Caswell et al. 2019)."""

    weight: float = Field(1.0, gt=0.0, le=1e6)
    synthetic: bool = False


class TmConfig(_Section):
    """Training with translation memory matches (Neural Fuzzy Repair, Bulté & Tezcan 2019):
    each training pair whose source has a match scoring `threshold` or more in the TM
    (`path`, a TM file from attnmt tm import, or "self": the training corpora themselves,
    each pair's own entry left out) is added once more, its source followed by <FM> and the
    match's target (the best `k`, each behind its <FM>); the plain pairs are kept, and the
    added ones are a corpus of their own of weight `weight`."""

    path: Path | Literal["self"] = "self"
    pair: str | None = None  # the TM's language pair, e.g. de-en (default: its only one)
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    k: int = Field(1, ge=1, le=3)
    weight: float = Field(1.0, gt=0.0, le=1e6)


class DataConfig(_Section):
    # Every training config names both (load_config); an imported model's config names none.
    train: TrainCorpus | list[TrainCorpus] | None = None
    dev: SplitConfig | list[SplitConfig] | None = None  # a list: one per direction (multilingual)
    test: SplitConfig | list[SplitConfig] | None = None
    max_len: int = Field(100, ge=1, le=100_000)
    workers: int = Field(0, ge=0, le=256)  # encoding processes; 0: the cores available
    tm: TmConfig | None = None  # train with translation memory matches (TmConfig)

    @model_validator(mode="after")
    def _some_corpus(self) -> DataConfig:
        for key in ("train", "dev", "test"):
            if getattr(self, key) == []:
                raise ValueError(f"data.{key}: the list of corpora is empty")
        if self.multilingual:  # every corpus and set says which language it translates into
            for key, splits in (("train", self.train), ("dev", self.dev), ("test", self.test)):
                for i, split in enumerate(splits if isinstance(splits, list) else [splits]):
                    where = f"data.{key}[{i}]" if isinstance(splits, list) else f"data.{key}"
                    if split is not None and split.tgt_lang not in self.target_langs:
                        raise ValueError(
                            f"{where}.tgt_lang = {split.tgt_lang!r}: a multilingual run's sets "
                            f"each name a target language of its training corpora "
                            f"({', '.join(self.target_langs)})"
                        )
        return self

    @property
    def synthetic(self) -> bool:
        """Whether a training corpus is marked synthetic (its sources then carry <BT>)."""
        return any(c.synthetic for c in self.corpora)

    @property
    def corpora(self) -> list[TrainCorpus]:
        """The training corpora, one or several (none: an imported model)."""
        if self.train is None:
            return []
        return self.train if isinstance(self.train, list) else [self.train]

    @property
    def dev_sets(self) -> list[SplitConfig]:
        """The dev sets, one or several (one per direction; none: an imported model)."""
        if self.dev is None:
            return []
        return self.dev if isinstance(self.dev, list) else [self.dev]

    @property
    def test_sets(self) -> list[SplitConfig]:
        """The test sets: none, one or several."""
        return (
            [] if self.test is None else self.test if isinstance(self.test, list) else [self.test]
        )

    @property
    def target_langs(self) -> list[str]:
        """The target languages the training corpora name, sorted."""
        return sorted({c.tgt_lang for c in self.corpora if c.tgt_lang is not None})

    @property
    def languages(self) -> tuple[list[str], list[str]]:
        """The source and target languages (codes: de, en) of the training corpora, as they
        name them (src_lang, tgt_lang), else as two-file corpora's names end (train.de.gz:
        de); none where neither says. What the pages show as their direction."""
        sides: tuple[set[str], set[str]] = (set(), set())
        for c in self.corpora:
            for side, lang, path in zip(
                sides, (c.src_lang, c.tgt_lang), (c.src, c.tgt), strict=True
            ):
                if lang is None and path is not None and (m := _LANG_SUFFIX.search(path.name)):
                    lang = m.group(1)
                if lang is not None:
                    side.add(lang)
        return sorted(sides[0]), sorted(sides[1])

    @property
    def multilingual(self) -> bool:
        """More than one target language: every source gets a target-language token."""
        return len(self.target_langs) > 1


class SubwordSampling(_Section):
    """tokenizer.sampling: subword regularization (Kudo 2018). Each epoch, every training
    sentence is segmented anew: one of its `nbest` best segmentations under the unigram
    model, drawn with probability proportional to P(segmentation)^alpha (alpha near 0: all
    alike; large: the best one). Validation, the dev loss and decoding never sample."""

    alpha: float = Field(0.1, gt=0.0, le=10.0)
    nbest: int = Field(16, ge=2, le=256)
    side: Literal["both", "src", "tgt"] = "both"


class TokenizerConfig(_Section):
    vocab_size: int = Field(8000, ge=8, le=1_000_000)
    joint: bool = True
    model_type: Literal["unigram", "bpe"] = "unigram"
    character_coverage: float = Field(1.0, gt=0.0, le=1.0)
    # An existing SentencePiece model instead of training one: `model` when joint, else
    # `src_model` and `tgt_model`. vocab_size, model_type and character_coverage then describe
    # nothing: set to other than their defaults, they are refused.
    model: Path | None = None
    src_model: Path | None = None
    tgt_model: Path | None = None
    sampling: SubwordSampling | None = None  # subword regularization in training; None: off

    @model_validator(mode="after")
    def _given_models(self) -> TokenizerConfig:
        given = [k for k in ("model", "src_model", "tgt_model") if getattr(self, k) is not None]
        if not given:
            return self
        need = ["model"] if self.joint else ["src_model", "tgt_model"]
        if sorted(given) != sorted(need):
            raise ValueError(
                f"tokenizer.joint = {str(self.joint).lower()} takes "
                f"{' and '.join('tokenizer.' + k for k in need)} (got "
                f"{', '.join('tokenizer.' + k for k in given)})"
            )
        # Keys for training one, when not at their defaults (a saved config has every key).
        defaults = TokenizerConfig.model_fields
        trained = [
            k for k in ("vocab_size", "model_type", "character_coverage")
            if getattr(self, k) != defaults[k].default
        ]  # fmt: skip
        if trained:
            raise ValueError(
                f"tokenizer.{sorted(trained)[0]} is for training a SentencePiece model; "
                f"tokenizer.{need[0]} gives one already"
            )
        return self

    @model_validator(mode="after")
    def _sampling_needs_unigram(self) -> TokenizerConfig:
        if self.sampling is not None and self.given is None and self.model_type != "unigram":
            raise ValueError(
                "tokenizer.sampling draws from a unigram model's n-best segmentations; "
                "tokenizer.model_type bpe has none (use unigram)"
            )
        return self

    @property
    def given(self) -> list[Path] | None:
        """The SentencePiece model files the config gives (joint: one), or None."""
        if self.model is not None:
            return [self.model]
        if self.src_model is not None and self.tgt_model is not None:
            return [self.src_model, self.tgt_model]
        return None


class ModelConfig(_Section):
    arch: Literal["rnn", "transformer"] = "transformer"
    emb_size: int = Field(256, ge=1, le=65_536)
    hidden_size: int = Field(256, ge=1, le=65_536)
    enc_layers: int = Field(3, ge=1, le=64)
    dec_layers: int = Field(3, ge=1, le=64)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    # rnn only
    attention: Literal["bahdanau", "dot"] = "bahdanau"
    # transformer only
    heads: int = Field(4, ge=1, le=1024)
    ff_size: int = Field(1024, ge=1, le=1_000_000)
    norm: Literal["pre", "post"] = "pre"
    attention_dropout: float = Field(0.1, ge=0.0, lt=1.0)
    # The feed-forward layer's nonlinearity (Marian's transformer-ffn-activation: swish or relu).
    activation: Literal["relu", "gelu", "swish"] = "relu"
    # The sinusoidal table's layout: sin and cos interleaved (Vaswani et al.), all sines then
    # all cosines (as transformers' MarianMTModel computes it), or Marian C++'s (halves with
    # tensor2tensor's frequencies); or rope: no table, rotary positions in self-attention.
    positions: Literal["interleaved", "halves", "marian", "rope"] = "interleaved"
    output_bias: bool = False  # a bias on the output projection (Marian's final_logits_bias)
    # The decoder's look at earlier target positions: masked self-attention, or an SSRU
    # recurrence (Kim et al. 2019; Firefox's students), a vector per layer when decoding.
    decoder: Literal["attention", "ssru"] = "attention"
    # both: share the target embedding with the output projection (and with the source
    # embedding when the vocabulary is joint)
    tie_embeddings: bool = True

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.arch == "transformer" and self.hidden_size % self.heads != 0:
            raise ValueError(
                f"model.hidden_size = {self.hidden_size} must be divisible by "
                f"model.heads = {self.heads}"
            )
        if self.positions == "rope" and (self.hidden_size // self.heads) % 2:
            raise ValueError(
                f"model.positions rope turns pairs of a head's {self.hidden_size // self.heads} "
                "values: model.hidden_size / model.heads must be even"
            )
        if self.arch == "rnn" and self.decoder != "attention":
            raise ValueError(
                "model.decoder ssru is a Transformer decoder's (model.arch: transformer)"
            )
        return self


class TeacherForcingConfig(_Section):
    schedule: Literal["constant", "linear", "exponential", "inverse_sigmoid"] = "constant"
    start: float = Field(1.0, ge=0.0, le=1.0)
    end: float = Field(1.0, ge=0.0, le=1.0)
    steps: int = Field(10_000, ge=1)

    @model_validator(mode="after")
    def _exponential_needs_positive(self) -> TeacherForcingConfig:
        if self.schedule == "exponential" and (self.start <= 0.0 or self.end <= 0.0):
            raise ValueError(
                "train.teacher_forcing: the exponential schedule interpolates geometrically, "
                f"so start and end must be > 0 (got start={self.start}, end={self.end})"
            )
        return self


class AdapterConfig(_Section):
    """train.adapters: fine-tune (train.init_from) LoRA adapters of rank `rank` on the
    layers `targets` names (q, k, v, o: the projections of every self- and cross-attention;
    ff1, ff2: every feed-forward block's two layers), scaled by alpha / rank; the base
    model's weights stay as they are (attnmt.models.lora)."""

    rank: int = Field(8, ge=1, le=4096)
    alpha: float = Field(16.0, gt=0.0, le=1e6)
    targets: list[Literal["q", "k", "v", "o", "ff1", "ff2"]] = Field(
        default_factory=lambda: ["q", "k", "v", "o"], min_length=1
    )

    @field_validator("targets")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"train.adapters.targets names a projection twice: {value}")
        return value


class TrainConfig(_Section):
    max_steps: int = Field(100_000, ge=1)
    max_epochs: int = Field(100, ge=1)
    batch_tokens: int = Field(4096, ge=1)
    batch_sentences: int | None = Field(None, ge=1)
    accumulate: int = Field(1, ge=1, le=1024)  # batches per update (gradient accumulation)
    lr: float = Field(5e-4, gt=0.0, le=10.0)
    lr_schedule: Literal["inverse_sqrt", "plateau", "constant", "budget"] = "inverse_sqrt"
    warmup_steps: int = Field(4000, ge=0)
    warmup_share: float = Field(0.1, gt=0.0, le=0.5)  # budget: warmup ends by this time share
    plateau_factor: float = Field(0.5, gt=0.0, lt=1.0)
    plateau_patience: int = Field(2, ge=0)
    min_lr: float = Field(1e-6, ge=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = Field(0.0, ge=0.0)
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    clip_grad_norm: float = Field(1.0, ge=0.0)
    seed: int = Field(1234, ge=0, le=2**32 - 1)
    device: DeviceChoice = "auto"
    precision: TrainPrecision = "fp32"  # auto: bf16 where native
    matmul: MatmulChoice = "auto"
    compile: bool = False
    # CUDA graphs over the compiled step (torch.compile's reduce-overhead mode; implies
    # compile), each batch padded up to one of a few shapes so that the graphs are reused.
    cuda_graphs: bool = False
    # The next step's batches collated (and pinned) on the host while the device computes this
    # step's; auto: on a GPU, where the host would otherwise wait idle meanwhile.
    prefetch: bool | Literal["auto"] = "auto"
    threads: int = Field(0, ge=0, le=1024)
    eval_every: int = Field(1000, ge=1)
    eval_batch_tokens: int = Field(8000, ge=1)
    eval_beam: int = Field(1, ge=1, le=100)
    patience: int = Field(10, ge=1)
    early_stopping: Literal["auto", "bleu", "chrf", "loss"] = "auto"  # dev metric: best
    time_budget: float | None = Field(None, gt=0.0)  # seconds; YAML may say 30m, 2h, 1h30m, 90s
    init_from: Path | None = None  # fine-tune: start from this model directory's weights
    init_weights: str = Field("best", pattern=r"^(best|last|averaged|step-\d+)$")  # init_from's
    adapters: AdapterConfig | None = None  # fine-tune LoRA adapters only (needs init_from)
    tensorboard: bool = True  # scalars and dev examples in DIR/tensorboard/
    log_every: int = Field(100, ge=1)
    keep_best: int = Field(1, ge=1, le=1000)
    keep_last: int = Field(1, ge=1, le=1000)
    average_last: int = Field(0, ge=0, le=1000)  # 0: off
    log_samples: int = Field(3, ge=0, le=1000)  # dev examples shown at each validation
    max_bad_steps: int = Field(10, ge=1)
    teacher_forcing: TeacherForcingConfig = TeacherForcingConfig()

    @field_validator("time_budget", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainConfig:
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"train.adam_betas = {list(self.adam_betas)}: each must be in [0, 1)")
        if self.adapters is not None and self.init_from is None:
            raise ValueError(
                "train.adapters adapt a trained model: set train.init_from to its directory"
            )
        if self.average_last > self.keep_last:
            raise ValueError(
                f"train.average_last = {self.average_last} needs train.keep_last >= "
                f"{self.average_last} (only kept checkpoints can be averaged)"
            )
        if self.cuda_graphs and self.accumulate > 1:
            # Measured on an H100 (docs/gpu.md): the second replay overwrites the memory that
            # the first batch's gradient still reads from ("accessing tensor output of
            # CUDAGraphs that has been overwritten by a subsequent run").
            raise ValueError(
                f"train.cuda_graphs with train.accumulate = {self.accumulate}: CUDA graphs "
                "take one batch per step (use a larger train.batch_tokens instead)"
            )
        if self.lr_schedule == "budget" and self.time_budget is None:
            raise ValueError("train.lr_schedule = 'budget' decays to train.time_budget: set it")
        return self


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '30m', '2h', '1h30m' or '1.5h'."""
    compact = re.sub(r"\s+", "", text.lower())
    if not re.fullmatch(r"(\d+(\.\d+)?[hms]?)+", compact):
        raise ValueError(f"{quote(text)} is not a duration (say 90s, 30m, 2h or 1h30m)")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}
    return sum(float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms]?)", compact))


class DecodeConfig(_Section):
    beam: int = Field(5, ge=1, le=100)
    length_penalty: float = Field(1.0, ge=0.0, le=10.0)
    # How beam search normalises a finished hypothesis's log-probability by its length:
    # "gnmt" ((5 + length) / 6)^alpha, stopping once the best candidate ends (OpenNMT-py);
    # "length" length^alpha (CTranslate2, Marian, fairseq), going on while a live beam could
    # still win (decoding.beam.LOOKAHEAD).
    length_norm: LengthNorm = "gnmt"
    max_len_a: float = Field(1.5, ge=0.0, le=10.0)
    max_len_b: int = Field(10, ge=0, le=1000)
    max_len_round: Literal["floor", "ceil"] = "floor"
    allow_unk: bool = True  # False: <unk> is never an output (marian-decoder's default)
    shortlist: bool = False
    max_output_len: int = Field(1500, ge=1, le=100_000)
    max_src_len: int = Field(1000, ge=2, le=100_000)
    batch_tokens: int = Field(8000, ge=1)
    workers: int = Field(1, ge=1, le=64)
    precision: DecodePrecision = "fp32"
    matmul: MatmulChoice = "auto"


class Config(_Section):
    data: DataConfig
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    decode: DecodeConfig = DecodeConfig()


def _format_error(err: ValidationError) -> str:
    """One line per problem: key path, bad value, what is allowed. Where a key takes one of
    several shapes (a corpus or a list of corpora) the most specific error is shown: the one
    deepest in the config, which belongs to the shape the value has."""
    first = max(err.errors(), key=lambda e: len(_key_path(e["loc"])))
    first = {**first, "loc": _key_path(first["loc"])}
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    value = first.get("input")
    kind = first["type"]
    if kind == "extra_forbidden":
        parent = _section_at(first["loc"][:-1])
        names = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(first["loc"][-1]), names, n=1, cutoff=0.6)
        hint = f" did you mean '{close[0]}'?" if close else ""
        return (
            f"config: unknown key '{loc}' (value {quote(value)});{hint} allowed keys here: "
            f"{', '.join(names) or 'none'}"
        )
    if kind == "missing":
        return f"config: missing required key '{loc}'"
    msg = first["msg"].removeprefix("Value error, ")
    if loc and msg.startswith(loc):  # a section's check that names the key itself
        return f"config: {msg}"
    where = f"'{loc}' = {quote(value)}: " if loc else ""
    return f"config: {where}{msg}"


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist = 3, 8, 8
_SHORT.maxstring = _SHORT.maxother = 160


def quote(value: Any, limit: int = 200) -> str:
    """A short repr of value (nested and long values elided), at most `limit` characters:
    error messages stay one short line, however large the value."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _key_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location as config keys: the names pydantic gives the members of a
    union ('list[TrainCorpus]', 'function-after[...]') dropped, list indices kept."""
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in p and "(" not in p))


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in (p for p in loc if not isinstance(p, int)):
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = list(getattr(ann, "__args__", (ann,)))
        for c in list(candidates):  # list[X] inside a union: X
            candidates += list(getattr(c, "__args__", ()))
        nxt = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if nxt is None:
            return None
        model = nxt
    return model


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `key.path=value` override to a raw config dict; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"--set {quote(assignment)}: expected KEY=VALUE, e.g. train.lr=0.001")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {quote(assignment)}: empty part in key path {quote(key)}")
    try:
        value = yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {quote(key)}: value {quote(text)} is not valid YAML ({e.problem})"
        ) from None
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            path = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {key}: '{path}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def from_dict(raw: Any) -> Config:
    """Validate a raw mapping into a Config, turning pydantic errors into one clear line."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: the top level must be a mapping, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; a larger file is not one


MAX_CONFIG_VALUES = 100_000  # values in a config with its aliases expanded


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases (*name) expand to more than
    MAX_CONFIG_VALUES values: nested aliases grow exponentially (a 600-byte "billion laughs"
    file expands to gigabytes when validated or printed)."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        if _expanded_size(node, {}) > MAX_CONFIG_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand to over {MAX_CONFIG_VALUES:,} values",
                node.start_mark,
            )  # fmt: skip
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values node holds with every alias expanded (each shared node counted once
    per use, computed once)."""
    if id(node) not in sizes:
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        sizes[id(node)] = 1 + sum(_expanded_size(c, sizes) for c in children)
    return sizes[id(node)]


def safe_yaml(text: str) -> Any:
    """A YAML text's value: safe tags only, aliases that expand to over MAX_CONFIG_VALUES
    values refused (yaml.YAMLError) before anything reads them."""
    return yaml.load(text, Loader=_BoundedLoader)


def read_yaml(path: Path) -> Any:
    """A YAML file's content, or a ConfigError of one line with file:line. Files over 1 MiB,
    nesting too deep to parse and aliases that expand too far are refused."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size:,} bytes; a config has at most 1 MiB")
        text = path.read_text(encoding="utf-8")
        return yaml.load(text, Loader=_BoundedLoader)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 ({e.reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None


def load_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply `--set` overrides, validate, and make data paths absolute."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = read_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for assignment in overrides:
        apply_override(raw, assignment)
    cfg = from_dict(raw)
    for key in ("train", "dev"):
        if getattr(cfg.data, key) is None:
            raise ConfigError(f"{path}: data.{key} is missing: a training config names its "
                              "training corpora (data.train) and dev set (data.dev)")  # fmt: skip
    return resolve_paths(cfg, Path.cwd())


def resolve_paths(cfg: Config, base: Path) -> Config:
    """Return a copy of cfg with every data path made absolute against base."""
    data = cfg.data.model_copy(deep=True)
    for split in (*data.corpora, *data.dev_sets, *data.test_sets):
        for key in ("src", "tgt", "tsv"):
            if getattr(split, key) is not None:
                setattr(split, key, (base / getattr(split, key)).absolute())
    if data.tm is not None and data.tm.path != "self":
        data.tm.path = (base / data.tm.path).absolute()
    tok = cfg.tokenizer.model_copy(deep=True)
    for key in ("model", "src_model", "tgt_model"):
        if getattr(tok, key) is not None:
            setattr(tok, key, (base / getattr(tok, key)).absolute())
    train = cfg.train.model_copy()
    if train.init_from is not None:
        train.init_from = (base / train.init_from).absolute()
    return cfg.model_copy(update={"data": data, "tokenizer": tok, "train": train})


def to_yaml(cfg: Config) -> str:
    """The config as YAML, every key present (what the model directory stores)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
