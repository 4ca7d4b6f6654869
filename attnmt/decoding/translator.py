"""The Python API: a trained model directory loaded once, translating lists and streams.

    from attnmt import Translator
    translator = Translator.load("runs/m30k_transformer")
    translator.translate(["Ein Mann fährt Fahrrad."], beam=5)   # -> ["A man rides a bike."]

It is what `attnmt translate`, `attnmt eval` and `attnmt serve` run: the same loading checks
(safetensors with checksums, no unpickling), the same search and the same worker policy, so it
gives exactly the CLI's lines.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar, cast

import torch

from attnmt.config import Config, LengthNorm
from attnmt.data.fuzzy import TmLookup
from attnmt.data.processes import keep_freed_memory
from attnmt.data.text import CHUNK_LINES, input_chunks
from attnmt.data.tokenizer import UNK_ID, Tokenizer
from attnmt.decoding.alignment import DEFAULT_LAYER, align
from attnmt.decoding.ensemble import Ensemble
from attnmt.decoding.forced import ForcedScore, attention_maps, score_pairs
from attnmt.decoding.markup import parse
from attnmt.decoding.memory import open_tm, tm_matches
from attnmt.decoding.options import OPTIONS, SAMPLING_NAMES
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.request import Prepared
from attnmt.decoding.scores import Scores, score, score_translations
from attnmt.decoding.search import Beam, Sampling, SearchOptions, search_options
from attnmt.decoding.shortlist import Shortlist, attach, load_shortlist
from attnmt.decoding.terminology import Term, Terminology
from attnmt.decoding.translate import LinePool, search_lines
from attnmt.decoding.translation import Translation
from attnmt.device import (
    DECODE_PRECISIONS,
    DEVICES,
    MATMUL_BACKENDS,
    CpuShare,
    ThreadFit,
    choices,
    limit_onednn_kernel_cache,
    missing_hardware,
    resolve_device,
)
from attnmt.errors import AttnmtError, TooMuchWork
from attnmt.kernels import matmul_backend
from attnmt.kernels.matmul import resolve
from attnmt.models.directory import BEST_FILE, LAST_FILE, load_model_dir
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq

T = TypeVar("T")
MAX_CONSTRAINTS = 32  # phrases a line must contain, its own and its terms


@dataclass
class Translator:
    """A model ready to translate with, the CPU matmul backend it runs under, and how many
    batches it searches at once."""

    cfg: Config
    tokenizer: Tokenizer
    model: Seq2Seq
    device: torch.device
    matmul: str  # blas or onednn
    workers: int = 1  # batches searched at once (CPU only)
    members: tuple[Config, ...] = ()  # an ensemble's configs, the first being cfg
    precision: str = "fp32"  # what the model computes in: fp32, bf16, fp16 or int8
    # Terms found in a line become its constraints (beam search); set it, or load's argument.
    terminology: Terminology | None = None
    shortlist: Shortlist | None = None  # each batch outputs only its shortlist's pieces
    # CPU threads: fixed, or as many as other processes leave free (chosen per search).
    threads: ThreadFit = field(default_factory=lambda: ThreadFit(None, torch.get_num_threads()))
    # A translation memory consulted for every line (use_tm): a 100 % match is returned as
    # the translation, a fuzzy one shown beside it (Translation.tm).
    tm: TmLookup | None = None

    @classmethod
    def load(
        cls,
        model_dir: str | Path | Sequence[str | Path],
        device: str = "auto",
        weights: str = "best",
        precision: str | None = None,
        matmul: str | None = None,
        workers: int | None = None,
        terminology: str | Path | None = None,
        shortlist: bool | None = None,
        threads: int | None = None,
        terms_ignore_case: bool = False,
        terms_prefix: bool = False,
        compile: bool | None = None,
    ) -> Translator:
        """Load a model directory, or several as an ensemble (the mean of their log-
        probabilities at each step; they must share their SentencePiece models; the first
        one's decode section applies): `weights` best, last, averaged, step-N or a path;
        device auto, cpu or cuda; precision fp32, bf16, fp16 or int8 (CPU) (default
        decode.precision);
        matmul auto, blas or onednn (default decode.matmul); workers: batches searched at once
        (default decode.workers; CPU only); terminology: a TSV file of source term TAB
        target term (Terminology.load; its forms matched whatever their case with
        terms_ignore_case, and where they start a longer word with terms_prefix); shortlist:
        output only each batch's lexical shortlist (the first model directory's, from
        `attnmt shortlist`; default decode.shortlist);
        threads: CPU threads (default: as many as other processes leave free, chosen again
        at most every second); compile: decode with the decoder's step compiled ahead of
        time (models.compiled_step), compiled once per model and machine; None: where it
        applies, unless the environment says ATTNMT_COMPILE=0. Notes go to stderr."""
        start = CpuShare.now()
        dirs = (
            [Path(model_dir)] if isinstance(model_dir, str | Path) else list(map(Path, model_dir))
        )
        if not dirs:
            raise AttnmtError("no model directory given")
        _check_choices(device, precision, matmul)
        dev = resolve_device(device)
        _check_int8(precision, dev)
        if workers is not None and workers > 1 and dev.type != "cpu":
            raise AttnmtError(f"--workers {workers}: parallel batches are for CPU decoding only")
        loaded = [load_model_dir(d, weights, dev) for d in dirs]
        for d in dirs:
            if weights == "best" and not (d / BEST_FILE).is_file():
                _note(f"{d} has no {BEST_FILE} yet; using {LAST_FILE}")
        cfg, tokenizer, net = loaded[0]
        for d, (other_cfg, other, _) in zip(dirs[1:], loaded[1:], strict=True):
            _check_same_tokenizer(dirs[0], tokenizer, d, other)
            if other_cfg.data.target_langs != cfg.data.target_langs:
                raise AttnmtError(
                    f"an ensemble translates into one set of languages: {dirs[0]} into "
                    f"{cfg.data.target_langs}, {d} into {other_cfg.data.target_langs}"
                )
        if len(loaded) > 1:
            net = Ensemble([m for _, _, m in loaded])
        precision = precision or cfg.decode.precision
        _check_int8(precision, dev)  # the config's choice, too
        backend = resolve(matmul or cfg.decode.matmul)
        limit_onednn_kernel_cache(dev, precision, backend)  # as training does
        if (lacking := missing_hardware(dev, precision)) is not None:
            _note(f"{lacking}; {precision} decoding is emulated and may be slower than fp32")
        # More than one worker only on the CPU: threads share a GPU's stream for nothing.
        n_workers = (workers or cfg.decode.workers) if dev.type == "cpu" else 1
        if dev.type == "cpu":  # a search's MiB-sized blocks reused, not faulted in anew
            keep_freed_memory()
        members = tuple(c for c, _, _ in loaded)
        net = for_decoding(net, precision, compile)  # None: compiled_step.by_default()
        terms = None
        if terminology is not None:
            terms = Terminology.load(Path(terminology), terms_ignore_case, terms_prefix)
        short = None
        if cfg.decode.shortlist if shortlist is None else shortlist:
            short = load_shortlist(dirs[0], tokenizer)
            attach(net, len(tokenizer.tgt))
        if threads is not None:
            _check_int("threads", threads, 1, 1024)
        fit = ThreadFit(threads, torch.get_num_threads(), reading=start)  # the load: ours
        return cls(
            cfg, tokenizer, net, dev, backend, n_workers, members, precision, terms, short, fit
        )

    def translate(
        self,
        lines: Sequence[str],
        beam: int | None = None,
        length_penalty: float | None = None,
        batch_tokens: int | None = None,
        workers: int | None = None,
        target_lang: str | None = None,
        prefix: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
    ) -> list[str]:
        """The best translation of each line, in order (beam: default decode.beam; 1 is
        greedy), into target_lang (a multilingual model needs it); with `prefix` (a text per
        line), each translation starts with its line's prefix; with `constraints` (per line,
        phrases), it contains them. An empty line gives an empty translation."""
        found = self.hypotheses(
            lines, beam, 1, length_penalty, batch_tokens, workers, target_lang=target_lang,
            prefix=prefix, constraints=constraints,
        )  # fmt: skip
        return [h[0].text for h in found]

    def hypotheses(
        self,
        lines: Sequence[str],
        beam: int | None = None,
        n_best: int = 1,
        length_penalty: float | None = None,
        batch_tokens: int | None = None,
        workers: int | None = None,
        sampling: tuple[float, int, int] | None = None,
        target_lang: str | None = None,
        prefix: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
    ) -> list[list[Translation]]:
        """The n_best translations of each line with their scores (Translation.text, .score);
        `sampling` = (temperature, top_k, seed) draws n_best instead of searching; `prefix`
        and `constraints` as translate takes them."""
        options = self.options(beam, n_best, length_penalty, sampling=sampling)
        return self.search(
            lines, options, batch_tokens, workers, target_lang=target_lang, prefix=prefix,
            constraints=constraints,
        )  # fmt: skip

    def options(
        self,
        beam: int | None = None,
        n_best: int = 1,
        length_penalty: float | None = None,
        attention: AttentionSpec | None = None,
        sampling: tuple[float, int, int] | None = None,
        length_norm: str | None = None,
    ) -> SearchOptions:
        """SearchOptions from the model's decode section and these overrides (length_norm:
        "gnmt" or "length", decode.length_norm); n_best above the beam is refused (sampling
        draws any number), as is a beam with sampling."""
        if sampling is not None and beam is not None:
            raise AttnmtError("sampling draws instead of searching: drop the beam (--beam)")
        beam = self.cfg.decode.beam if beam is None else beam
        asked = {"beam": beam, "n_best": n_best, "length_penalty": length_penalty}
        asked |= {"length_norm": length_norm}
        if sampling is not None:
            asked |= dict(zip(SAMPLING_NAMES, sampling, strict=True))
        for name, value in asked.items():
            OPTIONS[name].check(value)
        if n_best > beam and sampling is None:
            raise AttnmtError(f"n_best {n_best} exceeds the beam size {beam}; raise the beam")
        return search_options(
            self.cfg.decode, beam=beam, length_penalty=length_penalty, n_best=n_best,
            attention=attention, sampling=sampling, length_norm=cast(LengthNorm, length_norm),
        )  # fmt: skip

    def attention_spec(self, layer: int = -1, head: int | None = None) -> AttentionSpec:
        """Which attention to return with each hypothesis, checked against the model: a
        Transformer's decoder layer (-1: the top) and head (None: the mean of heads); the rnn
        model has one attention, whatever they say."""
        for m in (c.model for c in self.members or (self.cfg,)):  # an ensemble: every model
            if m.arch != "transformer":
                continue
            if not -m.dec_layers <= layer < m.dec_layers:
                raise AttnmtError(
                    f"--attention-layer {layer}: the decoder has {m.dec_layers} layers"
                )
            if head is not None and not 0 <= head < m.heads:
                raise AttnmtError(f"--attention-head {head}: the model has {m.heads} heads")
        return AttentionSpec(layer, head)

    def alignment_spec(self, layer: int | None = None) -> AttentionSpec:
        """The attention word alignments are read from: a Transformer's decoder layer
        `layer` (default alignment.DEFAULT_LAYER, or the top of a shallower decoder), the
        mean of its heads; the rnn model's one attention."""
        if layer is None:
            shallowest = min(c.model.dec_layers for c in self.members or (self.cfg,))
            layer = max(DEFAULT_LAYER, -shallowest)
        return self.attention_spec(layer)

    def aligned(
        self, lines: Sequence[str], beam: int | None = None, layer: int | None = None
    ) -> list[tuple[str, list[tuple[int, int]]]]:
        """Each line's best translation and its word alignment: (source word, target word)
        pairs, whitespace words from 0 (attnmt.decoding.alignment)."""
        options = self.options(beam, attention=self.alignment_spec(layer))
        found = self.search(lines, options)
        return [(r[0].text, align(r[0])) for r in found]

    @property
    def target_langs(self) -> list[str]:
        """The languages the model translates into, as its training corpora name them (none
        named: empty); a multilingual model has several."""
        return self.cfg.data.target_langs

    def source_prefix(self, target_lang: str | None) -> list[int]:
        """The ids before every source: a multilingual model's tag of `target_lang`, which it
        needs; nothing for a bilingual model (which takes its own target language, or none)."""
        langs = self.target_langs
        if target_lang is not None and not langs:
            raise AttnmtError(
                f"--target-lang {target_lang!r}: this model names no target language (it "
                "translates into the one it was trained on); drop --target-lang"
            )
        if target_lang is not None and target_lang not in langs:
            raise AttnmtError(
                f"--target-lang {target_lang!r}: this model translates into {', '.join(langs)}"
            )
        if not self.cfg.data.multilingual:
            return []
        if target_lang is None:
            raise AttnmtError(
                f"a multilingual model: give --target-lang ({', '.join(langs)}; in the API "
                'target_lang=, over HTTP "target_lang")'
            )
        tag = self.tokenizer.tag_id(target_lang)
        assert tag is not None, "training put every target language's tag in the tokenizer"
        return [tag]

    def search(
        self,
        lines: Sequence[str],
        options: SearchOptions,
        batch_tokens: int | None = None,
        workers: int | None = None,
        first_line: int = 0,
        target_lang: str | None = None,
        prefix: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        markup: bool = False,
    ) -> list[list[Translation]]:
        """Search (or sample) with `options` over lines: what the other methods call, and
        prepare, then decode. `first_line`: the number of lines before these in a longer input
        (sampling seeds); the rest as prepare takes them."""
        prepared = self.prepare(
            lines, options, target_lang, prefix, constraints, markup, first_line
        )
        return prepared.finish(self.decode(prepared, batch_tokens, workers, first_line))

    def prepare(
        self,
        lines: Sequence[str],
        options: SearchOptions,
        target_lang: str | None = None,
        prefix: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        markup: bool = False,
        first_line: int = 0,
        glossary: Terminology | None = None,
    ) -> Prepared:
        """Check lines and their per-line options and make them ready to search: the one
        check of a request, whoever sends it. `target_lang`: the language to translate into (a
        multilingual model needs it); `prefix`: per line, the text its translations start with
        (prefix-constrained search: the pieces of the prefix, then the search goes on; "" for
        none); `constraints`: per line, phrases its translations must contain (lexically
        constrained beam search), joined by the terminology's terms found in the line
        (Translation.terms); `markup`: the lines hold inline tags, translated around
        (attnmt.decoding.markup); `first_line`: lines before these, for the errors' line
        numbers; `glossary`: terms of this request's own, found as the terminology's are and
        joined to them."""
        if isinstance(lines, str) or not isinstance(lines, Sequence):
            raise AttnmtError("lines: expected a list of sentences (one str: wrap it in a list)")
        for i, line in enumerate(lines):
            if not isinstance(line, str):
                raise AttnmtError(f"lines[{i}]: expected a str, not {type(line).__name__}")
        source_prefix = tuple(self.source_prefix(target_lang))
        target_prefix = None
        if prefix is not None:
            _check_strs("prefix", prefix)
            if len(prefix) != len(lines):
                raise AttnmtError(f"prefix: {len(prefix)} prefixes for {len(lines)} lines")
            target_prefix = self.tokenizer.tgt.encode([p.strip() for p in prefix])
        trees, originals = None, list(lines)
        if markup:  # the text without its tags is translated, with alignments
            parsed = [parse(line) for line in lines]
            lines, trees = [text for text, _ in parsed], [tree for _, tree in parsed]
            options = replace(options, attention=options.attention or self.alignment_spec())
        terms, phrases = self._constraints(lines, constraints, options, first_line, glossary)
        lines, matches = tm_matches(
            self.tm, self.cfg.data.tm is not None, originals, list(lines), target_prefix, phrases
        )
        return Prepared(
            options, lines, source_prefix, target_prefix, terms, phrases, trees, matches
        )

    def use_tm(self, path: Path, pair: str | None = None, threshold: float = 0.5) -> None:
        """Consult the translation memory at `path` (of language pair `pair`, "de-en";
        default: its only one) for every line from now on: a 100 % match is the translation
        (not decoded), a match scoring `threshold` or more is reported beside it (and given
        to a model trained with data.tm after its line)."""
        self.tm = open_tm(path, pair, threshold, self.cfg)

    def decode(
        self,
        prepared: Prepared,
        batch_tokens: int | None = None,
        workers: int | None = None,
        first_line: int = 0,
    ) -> list[list[Translation]]:
        """Search prepared lines (without finishing them: Prepared.finish)."""
        if batch_tokens is not None:
            _check_int("batch_tokens", batch_tokens, 1, 1 << 40)
        if workers is not None:
            _check_int("workers", workers, 1, 64)
        if self.device.type == "cpu":
            self.threads.apply()  # in the thread that searches
        return search_lines(
            self.model, self.tokenizer, prepared.lines, prepared.options,
            batch_tokens=batch_tokens or self.cfg.decode.batch_tokens, device=self.device,
            workers=workers or self.workers, first_line=first_line, matmul=self.matmul,
            source_prefix=prepared.source_prefix, target_prefix=prepared.target_prefix,
            constraints=prepared.phrases, shortlist=self.shortlist,
        )  # fmt: skip

    def pool(
        self, options: SearchOptions, source_prefix: Sequence[int] = (), constrained: bool = False
    ) -> LinePool:
        """An empty LinePool of this model: lines searched with `options` (greedy or beam),
        after `source_prefix` (a language tag), constrained by phrases or not; lines join it
        at any step (what `attnmt serve` runs)."""
        if isinstance(options.method, Sampling):
            raise AttnmtError("sampling draws per batch: it has no pool (Translator.decode)")
        fit = self.threads.apply if self.device.type == "cpu" else lambda: None
        return LinePool(
            self.model, self.tokenizer, options, device=self.device, matmul=self.matmul,
            source_prefix=source_prefix, constrained=constrained, shortlist=self.shortlist,
            before_step=fit,
        )  # fmt: skip

    def _constraints(
        self,
        lines: Sequence[str],
        constraints: Sequence[Sequence[str]] | None,
        options: SearchOptions,
        first_line: int = 0,
        glossary: Terminology | None = None,
    ) -> tuple[list[list[Term]], list[list[list[int]]] | None]:
        """Per line, the terminology's terms found in it, and the target ids of every phrase
        it must contain (the given ones, then the terms'); None: no line has any."""
        if constraints is not None:
            _check_list("constraints", constraints)
            if len(constraints) != len(lines):
                raise AttnmtError(f"constraints: expected a list of phrases per line, "
                                  f"{len(constraints)} for {len(lines)} lines")  # fmt: skip
            for i, c in enumerate(constraints):
                _check_strs(f"constraints[{i}]", c)
                if any(not p.strip() for p in c):
                    raise AttnmtError(f"constraints[{i}]: an empty phrase")
        glossaries = [g for g in (self.terminology, glossary) if g is not None]
        terms = [list(dict.fromkeys(t for g in glossaries for t in g.find(x))) for x in lines]
        given = constraints or [[] for _ in lines]
        texts = [[*c, *(t.target for t in found)] for c, found in zip(given, terms, strict=True)]
        if not any(texts):
            return terms, None
        if not isinstance(options.method, Beam):
            raise AttnmtError(
                "constraints and terminology need beam search: a beam of 2 or more, no sampling"
            )
        return terms, [
            self._phrases(first_line + i, list(dict.fromkeys(t)), options)
            for i, t in enumerate(texts)
        ]

    def _phrases(self, line: int, texts: list[str], options: SearchOptions) -> list[list[int]]:
        """One line's phrases as target ids, refused where no output could hold them: more
        than MAX_CONSTRAINTS (a line's own and its terms), longer in all than the longest
        output, or spelled with pieces the model cannot write (<unk>)."""
        if len(texts) > MAX_CONSTRAINTS:
            raise TooMuchWork(
                f"line {line + 1}: {len(texts)} constraints and terms; at most "
                f"{MAX_CONSTRAINTS} a line (each one multiplies the search's work)"
            )
        found = self.tokenizer.tgt.encode([p.strip() for p in texts]) if texts else []
        if sum(map(len, found)) > options.max_output_len:
            raise TooMuchWork(
                f"line {line + 1}: constraints of {sum(map(len, found)):,} pieces; no output is "
                f"longer than {options.max_output_len:,} (decode.max_output_len)"
            )
        for text, ids in zip(texts, found, strict=True):
            if UNK_ID in ids:
                raise AttnmtError(
                    f"line {line + 1}: the constraint {text[:60]!r} has characters the model "
                    "cannot write (its vocabulary spells them <unk>)"
                )
        return found

    def stream(
        self,
        source: Path | Iterable[str] | None,
        options: SearchOptions,
        batch_tokens: int | None = None,
        workers: int | None = None,
        target_lang: str | None = None,
        prefixes: Iterator[str] | None = None,
        constraints: Iterator[list[str]] | None = None,
        markup: bool = False,
    ) -> Iterator[tuple[list[str], list[list[Translation]]]]:
        """Translate a stream chunk by chunk, yielding each chunk's lines and their results as
        soon as they are done: memory stays bounded whatever the input's length.

        `source`: a file (plain or .gz), a pipe or FIFO, or None for standard input (from a
        pipe or a terminal, a chunk ends when no more input is waiting, so a line sent alone
        is answered at once: data.input_chunks); or any iterable of lines, taken CHUNK_LINES
        at a time. `prefixes`: a target prefix per line, `constraints` a list of phrases per
        line, in step with the lines (a file with another line count is an error)."""
        if source is None or isinstance(source, (str, Path)):
            chunks: Iterable[list[str]] = input_chunks(None if source is None else Path(source))
        else:
            lines = iter(source)
            chunks = iter(lambda: list(itertools.islice(lines, CHUNK_LINES)), [])
        self.source_prefix(target_lang)  # a missing or unknown language fails before reading
        done = 0  # lines translated so far
        for chunk in chunks:
            prefix = _in_step(prefixes, chunk, done, "--prefix")
            required = _in_step(constraints, chunk, done, "--constraints")
            found = self.search(
                chunk, options, batch_tokens, workers, done, target_lang, prefix, required, markup
            )
            yield chunk, found
            done += len(chunk)
        for given, flag in ((prefixes, "--prefix"), (constraints, "--constraints")):
            if given is not None and next(given, None) is not None:
                raise AttnmtError(f"{flag}: more lines than the input's {done:,}")

    def score_pairs(
        self,
        sources: Sequence[str],
        targets: Sequence[str],
        batch_tokens: int | None = None,
        target_lang: str | None = None,
    ) -> list[ForcedScore]:
        """How likely the model finds each target as the translation of its source (forced
        decoding): ForcedScore.log_prob (natural log, EOS included), .pieces, .per_piece."""
        _check_strs("sources", sources)
        _check_strs("targets", targets)
        with matmul_backend(self.matmul):
            return score_pairs(
                self.model, self.tokenizer, sources, targets, device=self.device,
                batch_tokens=batch_tokens or self.cfg.decode.batch_tokens,
                source_prefix=self.source_prefix(target_lang),
                max_src_len=self.cfg.decode.max_src_len,
                max_tgt_len=self.cfg.decode.max_output_len,
            )  # fmt: skip

    def attention_shape(self) -> tuple[int, int]:
        """(layers, heads) of the maps attention_maps gives."""
        m = self.cfg.model
        if m.arch == "transformer" and len(self.members) <= 1:
            return m.dec_layers, m.heads
        return 1, 1

    def attention_maps(self, found: Translation) -> torch.Tensor:
        """The source attention of a translation `found` (from search), for every
        decoder layer and head of a Transformer, or the GRU model's (an ensemble: the mean of
        its models' top-layer, head-averaged): (layers, heads, target pieces, source pieces),
        EOS included on both sides, each row summing to 1."""
        m = self.cfg.model
        specs = [AttentionSpec()]
        if m.arch == "transformer" and len(self.members) <= 1:
            specs = [AttentionSpec(layer, None, all_heads=True) for layer in range(m.dec_layers)]
        if not found.tgt_pieces:  # an empty line: nothing was decoded
            return torch.zeros(len(specs), 1, 0, len(found.src_pieces))
        # The pieces the search read and wrote (tag and EOS included), back to their ids.
        src = [self.tokenizer.src.sp.piece_to_id(p) for p in found.src_pieces]
        tgt = [self.tokenizer.tgt.sp.piece_to_id(p) for p in found.tgt_pieces]
        with matmul_backend(self.matmul):
            return attention_maps(self.model, src, tgt, specs, self.device)

    def score_test_set(
        self,
        sources: list[str],
        references: list[str],
        beam: int | None = None,
        target_lang: str | None = None,
    ) -> tuple[Scores, list[str]]:
        """Translate a test set (data.read_test_set) and score it with sacreBLEU (BLEU, chrF):
        every line counts, as in the `test` event at the end of training. Returns the scores
        and the translations."""
        return score_translations(
            lambda s: self.translate(s, beam=beam, target_lang=target_lang), sources, references
        )

    @staticmethod
    def score(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
        """Corpus BLEU and chrF with sacreBLEU (.bleu, .chrf, .bleu_signature, .as_dict())."""
        _check_strs("hypotheses", hypotheses)
        _check_strs("references", references)
        if len(hypotheses) != len(references):
            raise AttnmtError(f"{len(hypotheses)} hypotheses but {len(references)} references")
        return score(hypotheses, references)


def _in_step(given: Iterator[T] | None, chunk: list[str], done: int, flag: str) -> list[T] | None:
    """The next len(chunk) items of a per-line input given with `flag` (None: not given)."""
    if given is None:
        return None
    items = list(itertools.islice(given, len(chunk)))
    if len(items) < len(chunk):
        raise AttnmtError(f"{flag}: {done + len(items):,} lines, fewer than the input's")
    return items


def _check_same_tokenizer(dir_a: Path, a: Tokenizer, dir_b: Path, b: Tokenizer) -> None:
    """An ensemble's models read and write the same pieces: the same SentencePiece files."""
    files_a, files_b = a.files(), b.files()
    for name in sorted(set(files_a) | set(files_b)):
        if files_a.get(name) != files_b.get(name):
            other = name if name in files_b else next(iter(files_b))
            raise AttnmtError(
                f"an ensemble needs one vocabulary: {dir_a / name} and {dir_b / other} are "
                "different SentencePiece models"
            )


def _check_list(name: str, given: object) -> None:
    """A list (or tuple) given to the API, not a str, a dict, a generator or None."""
    if not isinstance(given, list | tuple):
        raise AttnmtError(f"{name}: expected a list, not {type(given).__name__}")


def _check_strs(name: str, given: object) -> None:
    if not isinstance(given, list | tuple) or not all(isinstance(x, str) for x in given):
        raise AttnmtError(f"{name}: expected a list of str, not {type(given).__name__}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    """The API's arguments are checked as the CLI's options are: one clear error."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise AttnmtError(f"{name} {value!r}: expected an integer from {low} to {high}")


def _check_choices(device: str, precision: str | None, matmul: str | None) -> None:
    """--device, --precision and --matmul among their choices (one line naming them)."""
    for flag, value, allowed, expected in (
        ("--device", device, DEVICES, choices(DEVICES)),
        ("--precision", precision, DECODE_PRECISIONS, choices(DECODE_PRECISIONS)),
        ("--matmul", matmul, MATMUL_BACKENDS, ", ".join(MATMUL_BACKENDS)),
    ):
        if value is not None and value not in allowed:
            raise AttnmtError(f"{flag} {value!r}: expected {expected}")


def _check_int8(precision: str | None, device: torch.device) -> None:
    """Refuse int8 off the CPU: the quantized kernels are CPU ones."""
    if precision == "int8" and device.type != "cpu":
        raise AttnmtError("--precision int8: int8 decoding is for the CPU (use bf16 or fp16)")


def _note(text: str) -> None:
    print(f"attnmt: note: {text}", file=sys.stderr)
