"""Translate lists of sentences with a trained model, and score translations with sacreBLEU."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any

import sacrebleu
import torch

from attnmt.config import DecodeConfig
from attnmt.data import pad_sequences, sorted_batches
from attnmt.errors import AttnmtError
from attnmt.kernels import PRECISION_DTYPES
from attnmt.processes import die_with_parent
from attnmt.search import Hypothesis, SearchOptions, beam_search, greedy_search, sample
from attnmt.seq2seq import AttentionSpec, Seq2Seq
from attnmt.tokenizer import EOS_ID, PAD_ID, Tokenizer


@dataclass
class Translation:
    text: str
    score: float
    src_pieces: list[str]  # source subwords (EOS included), the attention's columns
    tgt_pieces: list[str]  # output subwords (and EOS if it ended so), the attention's rows
    attention: torch.Tensor | None  # (len(tgt_pieces), len(src_pieces)) when asked for


def translate(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    options: SearchOptions,
    *,
    batch_tokens: int,
    batch_sentences: int | None = None,
    device: torch.device | str = "cpu",
    workers: int = 1,
    first_line: int = 0,
) -> list[list[Translation]]:
    """Translate each line: options.n_best translations per input, in input order.

    Sentences are batched by length (longest first, at most batch_tokens source tokens and
    batch_sentences sentences per batch) and put back in order; an empty or whitespace-only
    line gives empty translations without touching the model. Beam 1 is greedy search.

    workers > 1 searches that many batches at once, sharing the intra-op threads
    (torch.get_num_threads() // workers each, at least 1): a decoding step's small matmuls and
    elementwise ops keep one core busy each better than two cores together (the idea of
    CTranslate2's inter_threads). See _search_batches for threads or processes. The results do
    not depend on it.
    """
    was_training = model.training
    model.eval()
    empty = Translation("", 0.0, [], [], None)
    outputs: list[list[Translation]] = [[empty] * options.n_best for _ in lines]
    todo = [i for i, line in enumerate(lines) if line.strip()]
    src = [[*s, EOS_ID] for s in tokenizer.src.encode([lines[i].strip() for i in todo])]
    for j, ids in enumerate(src):
        if len(ids) > options.max_src_len:  # one very long line must not stall the rest
            print(
                f"attnmt: warning: input line {todo[j] + 1}: {len(ids) - 1:,} subwords, cut to "
                f"the first {options.max_src_len - 1:,} (decode.max_src_len)",
                file=sys.stderr,
            )
            src[j] = [*ids[: options.max_src_len - 1], EOS_ID]
    batches = list(sorted_batches([len(s) for s in src], batch_tokens, batch_sentences))

    job = _SearchJob(model, src, options, device, first_line)
    results = _search_batches(job, batches, workers)
    for batch, found in zip(batches, results, strict=True):
        for j, hyps in zip(batch, found, strict=True):
            src_pieces = tokenizer.src.pieces(src[j])
            outputs[todo[j]] = [
                Translation(
                    tokenizer.tgt.decode(h.tokens),
                    h.score,
                    src_pieces,
                    tokenizer.tgt.pieces(h.tokens) + (["</s>"] if h.ended else []),
                    None if h.attention is None else h.attention[:, : len(src_pieces)].cpu(),
                )
                for h in hyps
            ]
    model.train(was_training)
    return outputs


SEED_MASK = 2**63 - 1  # torch generators take seeds below 2 ** 64


@dataclass(frozen=True)
class _SearchJob:
    """What searching a batch needs besides the batch: a batch is a list of indices into src."""

    model: Seq2Seq
    src: list[list[int]]  # source ids, EOS included
    options: SearchOptions
    device: torch.device | str
    first_line: int = 0  # lines of the input before these (a chunk's offset): sampling seeds

    @torch.inference_mode()  # per thread, like grad mode: set in the thread that searches
    def __call__(self, batch: list[int]) -> list[list[Hypothesis]]:
        tokens = pad_sequences([self.src[j] for j in batch], PAD_ID).to(self.device)  # (B, S)
        pad_mask = tokens == PAD_ID  # (B, S)
        if self.options.sampling:  # a seed per batch, from its first line's place in the input:
            # the draws depend on neither --workers nor how the input was chunked into calls
            seed = hash((self.options.seed, self.first_line + batch[0])) & SEED_MASK
            options = replace(self.options, seed=seed)
            return sample(self.model, tokens, pad_mask, options)
        if self.options.beam == 1:
            return [[h] for h in greedy_search(self.model, tokens, pad_mask, self.options)]
        return beam_search(self.model, tokens, pad_mask, self.options)


def _search_batches(
    job: _SearchJob, batches: list[list[int]], workers: int
) -> list[list[list[Hypothesis]]]:
    """job(batch) for every batch, in order; `workers` batches at a time.

    Workers with one intra-op thread each are forked processes on Linux: as threads of one
    process they take turns at Python's GIL between every op, and a thread that the OS (or a
    hypervisor) pauses while holding it stalls the other too; processes run independently
    (T greedy on 2 cores, fresh process per run: 175-268 against 90-158 sentences/s as
    threads). Forked, a worker may not start OpenMP threads (the parent's pool does not exist
    in the child, and GNU OpenMP hangs), so workers with more than one thread each, and other
    platforms or a GPU, stay threads.
    """
    if workers <= 1 or len(batches) <= 1:
        return [job(batch) for batch in batches]
    threads = max(1, torch.get_num_threads() // workers)
    if threads == 1 and sys.platform == "linux" and torch.device(job.device).type == "cpu":
        return _search_in_processes(job, batches, workers)
    with ThreadPoolExecutor(workers, "attnmt-search", torch.set_num_threads, (threads,)) as pool:
        return list(pool.map(job, batches))


_FORKED_JOB: _SearchJob | None = None  # in a forked search worker: its job


def _start_forked_worker(job: _SearchJob, parent: int) -> None:
    """Initializer of a forked search worker (fork passes job by memory, nothing pickled)."""
    global _FORKED_JOB
    _FORKED_JOB = job
    die_with_parent(parent)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _keep_freed_memory()


def _keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse in this process, not return it to the OS.

    A search step frees and allocates blocks of a few hundred KiB to a few MiB. By default
    glibc hands blocks that large back to the OS (mmap/munmap, heap trimming), and every reuse
    faults its pages in again: R beam 5 in 2 forked workers took about 620k page faults and 1.7 s
    of system time for 1,000 sentences, about 70k and 0.2 s with these settings. Only worker
    processes set it: they end with the translation (it did not speed up training).
    """
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only; musl's mallopt does nothing
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)  # blocks up to 32 MiB from the heap
    libc.mallopt(m_trim_threshold, 1 << 30)  # keep up to 1 GiB free at the heap's top


def _with_attention(
    found: list[list[Hypothesis]], convert: Callable[[Any], Any]
) -> list[list[Hypothesis]]:
    """found with convert applied to every hypothesis's attention map (where there is one)."""
    return [
        [h if h.attention is None else replace(h, attention=convert(h.attention)) for h in hyps]
        for hyps in found
    ]


def _search_forked(batch: list[int]) -> list[list[Hypothesis]]:
    assert _FORKED_JOB is not None
    # Attention maps go back as NumPy arrays: torch would send tensors as shared-memory
    # file descriptors, one per map.
    return _with_attention(_FORKED_JOB(batch), lambda a: a.float().numpy())


def _search_in_processes(
    job: _SearchJob, batches: list[list[int]], workers: int
) -> list[list[list[Hypothesis]]]:
    others = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(
        workers, multiprocessing.get_context("fork"), _start_forked_worker, (job, os.getpid())
    )
    try:
        results = list(pool.map(_search_forked, batches))
    except BaseException as e:  # Ctrl-C included
        # Stop the workers at once: they hold nothing worth waiting for, and a worker left
        # waiting for work would keep the interpreter from exiting.
        for worker in set(multiprocessing.active_children()) - others:
            worker.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, BrokenProcessPool):
            raise AttnmtError(
                "a search worker process ended unexpectedly (killed, or out of memory?); "
                "translate with --workers 1 or a smaller --batch-tokens"
            ) from e
        raise
    pool.shutdown()
    return [_with_attention(found, torch.from_numpy) for found in results]


def translate_lines(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    options: SearchOptions,
    *,
    batch_tokens: int,
    device: torch.device | str = "cpu",
    workers: int = 1,
) -> list[str]:
    """The best translation of each line as text; exactly one output per input, in order."""
    n1 = replace(options, n_best=1, attention=None, scores=False)
    found = translate(
        model, tokenizer, lines, n1, batch_tokens=batch_tokens, device=device, workers=workers
    )
    return [t[0].text for t in found]


def for_decoding(model: Seq2Seq, precision: str) -> Seq2Seq:
    """The model, in place, with its weights and buffers in `precision` for translation: the
    16-bit formats halve the weights' memory traffic and run on the hardware's 16-bit matmuls
    (GPU tensor cores, AMX), at the cost of outputs that may differ from fp32 here and there.
    Search sums its scores in fp32 whatever the model computes in."""
    return model.to(PRECISION_DTYPES[precision])


def search_options(
    cfg: DecodeConfig,
    *,
    beam: int | None = None,
    length_penalty: float | None = None,
    n_best: int = 1,
    attention: AttentionSpec | None = None,
    sampling: tuple[float, int, int] | None = None,
) -> SearchOptions:
    """The one place SearchOptions are built: a config's decode section, with beam and length
    penalty overridable (flags, train.eval_beam). Scores are computed only for n-best lists,
    the one output that shows them. `sampling`: (temperature, top_k, seed) to sample."""
    temperature, top_k, seed = sampling or (1.0, 0, 0)
    return SearchOptions(
        beam=cfg.beam if beam is None else beam,
        length_penalty=cfg.length_penalty if length_penalty is None else length_penalty,
        max_len_a=cfg.max_len_a,
        max_len_b=cfg.max_len_b,
        max_output_len=cfg.max_output_len,
        max_src_len=cfg.max_src_len,
        n_best=n_best,
        attention=attention,
        scores=n_best > 1,
        sampling=sampling is not None,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_detail: str

    def as_dict(self) -> dict[str, object]:
        return {
            "bleu": round(self.bleu, 2),
            "chrf": round(self.chrf, 2),
            "bleu_signature": self.bleu_signature,
            "chrf_signature": self.chrf_signature,
            "bleu_detail": self.bleu_detail,
        }


def score(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
    """Corpus BLEU and chrF (sacreBLEU defaults: 13a tokenization, mixed case)."""
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()), str(b))
