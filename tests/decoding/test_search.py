"""Greedy and beam search: exact equivalences on tiny trained models."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

from attnmt.config import from_dict
from attnmt.data.tokenizer import PAD_ID
from attnmt.decoding import greedy
from attnmt.decoding.beam import LOOKAHEAD, BeamPool, beam_search
from attnmt.decoding.greedy import greedy_search
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.search import (
    Beam,
    Greedy,
    SearchOptions,
    length_penalty,
    max_output_lengths,
    output_limit,
)
from attnmt.decoding.translate import search_lines
from attnmt.device import PRECISION_DTYPES
from attnmt.errors import AttnmtError
from attnmt.kernels import argmax_rows, topk_rows
from attnmt.models.directory import load_model_dir
from attnmt.models.seq2seq import AttentionSpec, Seq2Seq
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config, write_lines


def beam_or_greedy(beam: int, **kwargs) -> Beam | Greedy:
    """Beam search's options, or greedy search's for beam 1 (as
    attnmt.decoding.search.search_options builds them)."""
    return Greedy() if beam == 1 else Beam(beam, **kwargs)


@pytest.fixture(scope="module", params=["transformer", "rnn"])
def trained(request, tmp_path_factory):
    """A tiny model trained for 300 steps on the toy corpus: it has learned to stop."""
    d = tmp_path_factory.mktemp(request.param)
    files = {}
    for split, n, seed in (("train", 300, 1), ("dev", 20, 2)):
        src, tgt = make_pairs(n, seed)
        files[f"{split}_src"] = write_lines(d / f"{split}.src", src)
        files[f"{split}_tgt"] = write_lines(d / f"{split}.tgt", tgt)
    raw = tiny_config(files, request.param)
    raw["model"].update(hidden_size=32, emb_size=32, ff_size=64)
    raw["train"].update(max_steps=300, eval_every=300, lr=0.01, warmup_steps=10)
    train(from_dict(raw), d / "m", quiet=True)
    _, tok, model = load_model_dir(d / "m")
    src, _ = make_pairs(12, 9)
    ids = tok.src.encode(src)
    batch = torch.full((len(ids), max(map(len, ids)) + 1), 0, dtype=torch.long)
    for i, s in enumerate(ids):
        batch[i, : len(s) + 1] = torch.tensor([*s, 3])
    return model, tok, batch, batch == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_decoding_runs_in_that_format(trained, precision):
    """for_decoding casts a copy's weights and buffers; every step then computes in that
    format, the scores stay fp32 sums, and the outputs mostly agree with fp32 decoding."""
    model, _, src, pad = trained
    dtype = PRECISION_DTYPES[precision]
    low = for_decoding(copy.deepcopy(model), precision)
    assert all(
        t.dtype == dtype for t in [*low.parameters(), *low.buffers()] if t.is_floating_point()
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original is left alone
    seen: list[torch.dtype] = []
    step = low.decode_step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out[0].dtype)  # the logits
        return out

    low.decode_step = recording_step
    for beam in (1, 3):
        ref = beam_search(
            model,
            src,
            pad,
            SearchOptions(Beam(beam, length_penalty=1.0), max_len_a=1.5, max_len_b=5),
        )
        got = beam_search(
            low, src, pad, SearchOptions(Beam(beam, length_penalty=1.0), max_len_a=1.5, max_len_b=5)
        )
        same = sum(r[0].tokens == g[0].tokens for r, g in zip(ref, got, strict=True))
        assert same >= 0.75 * len(ref), (beam, same)
        assert all(g[0].score == g[0].score and g[0].score <= 0 for g in got)  # finite, a log-prob
    # (Not beam 1 == greedy: 16-bit logits tie often, and the two break ties differently.)
    greedy = greedy_search(low, src, pad, SearchOptions(max_len_a=1.5, max_len_b=5))
    ref = greedy_search(model, src, pad, SearchOptions(max_len_a=1.5, max_len_b=5))
    assert sum(g.tokens == r.tokens for g, r in zip(greedy, ref, strict=True)) >= 0.75 * len(ref)
    assert seen and set(seen) == {dtype}


def test_max_output_lengths_and_length_penalty():
    pad = torch.tensor([[False, False, False, True], [False, True, True, True]])
    options = SearchOptions(max_len_a=1.5, max_len_b=2)
    assert max_output_lengths(pad, options).tolist() == [6, 3]
    capped = SearchOptions(max_len_a=1.5, max_len_b=2, max_output_len=4)
    assert max_output_lengths(pad, capped).tolist() == [4, 3]
    # Marian's rule: ceil(factor * (source pieces + EOS)), no b; 1.1 * 10 stays 11
    marian = SearchOptions(max_len_a=1.5, max_len_b=0, max_len_round="ceil")
    assert max_output_lengths(pad, marian).tolist() == [5, 2]
    assert output_limit(10, SearchOptions(max_len_a=1.1, max_len_b=0, max_len_round="ceil")) == 11
    assert output_limit(3, SearchOptions(max_len_a=0.0, max_len_b=0)) == 1  # never below 1
    assert length_penalty(1, 1.0) == 1.0
    assert length_penalty(7, 1.0) == 2.0
    assert length_penalty(7, 0.0) == 1.0


def test_beam_1_is_greedy(trained):
    model, _, src, pad = trained
    greedy = greedy_search(model, src, pad, SearchOptions(max_len_a=1.5, max_len_b=5))
    beam1 = beam_search(
        model, src, pad, SearchOptions(Beam(1, length_penalty=0.0), max_len_a=1.5, max_len_b=5)
    )
    assert [h.tokens for h in greedy] == [b[0].tokens for b in beam1]
    for g, b in zip(greedy, beam1, strict=True):
        assert b[0].score == pytest.approx(g.score, abs=1e-4)


@pytest.mark.parametrize("share", [1, 4, 1000])
def test_greedy_drops_finished_rows_late_without_changing_them(trained, share, monkeypatch):
    """Finished sentences stay in the batch until 1/share of its rows has finished (1: all,
    so never before the end; 1000: one, so right away); what they decode is ignored."""

    model, _, src, pad = trained
    src, pad = src.repeat(3, 1), pad.repeat(3, 1)  # 36 rows, so 1/4 is more than one
    monkeypatch.setattr(greedy, "COMPACT_SHARE", 1_000_000)
    alone = [
        greedy_search(
            model, src[i : i + 1], pad[i : i + 1], SearchOptions(max_len_a=1.5, max_len_b=5)
        )[0]
        for i in range(12)
    ]
    monkeypatch.setattr(greedy, "COMPACT_SHARE", share)
    dropped: list[int] = []
    keep = model.keep_rows
    monkeypatch.setattr(
        model, "keep_rows", lambda m, s, idx: dropped.append(len(idx)) or keep(m, s, idx)
    )
    batch = greedy_search(model, src, pad, SearchOptions(attention=AttentionSpec(), max_len_b=5))
    assert [h.tokens for h in batch] == [h.tokens for h in alone] * 3
    assert [h.ended for h in batch] == [h.ended for h in alone] * 3
    for h, a in zip(batch, alone * 3, strict=True):
        assert h.score == pytest.approx(a.score, abs=1e-5)
        assert h.attention is not None and h.attention.shape[0] == len(h.tokens) + int(h.ended)
    assert dropped == sorted(dropped, reverse=True)
    if share == 1:
        assert not dropped  # everything decoded to the end of the longest
    else:
        assert dropped and 36 - dropped[0] >= max(1, 36 // share)
    unscored = greedy_search(model, src, pad, SearchOptions(max_len_b=5, scores=False))
    assert [h.tokens for h in unscored] == [h.tokens for h in batch]
    assert all(h.score != h.score for h in unscored)  # NaN: not computed


@torch.no_grad()
def uncached_next_logprobs(model: Seq2Seq, src, pad, prefix: list[int]) -> torch.Tensor:
    """log p(. | prefix) recomputed from scratch: the whole prefix, no state carried over."""
    memory = model.encode(src, pad)
    state = model.init_state(memory)
    logits = None
    for tok in [model.bos_id, *prefix]:
        logits, state, _ = model.decode_step(memory, state, torch.tensor([tok]))
    return torch.log_softmax(logits[0].float(), -1)


def reference_beam(
    model, src, pad, K: int, alpha: float, limit: int, n_best: int, norm: str = "gnmt"
) -> list[tuple[list[int], float]]:
    """One sentence, plain lists: the same rules as the batched search, written simply. With
    norm "length" the search stops where the best live beam, normalised LOOKAHEAD tokens
    later, no longer outscores the best finished hypothesis, instead of where the best
    candidate is EOS."""
    lp = lambda n: length_penalty(n, alpha, norm)  # noqa: E731
    live = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    first = None  # where a 1-best search stops, its best: the n-best list's head
    for t in range(limit):
        cands = []
        for tokens, score in live:
            logp = uncached_next_logprobs(model, src, pad, tokens)
            # Padding and the start token are never an output (search.never_output).
            cands += [
                (score + float(lp), tokens, v)
                for v, lp in enumerate(logp)
                if v not in (PAD_ID, model.bos_id)
            ]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * K]
        for score, tokens, v in cands[:K]:
            if v == model.eos_id:
                finished.append((tokens, score / lp(t + 1)))
        live = [([*tokens, v], score) for score, tokens, v in cands if v != model.eos_id][:K]
        if t + 1 >= limit:
            finished += [(tokens, score / lp(t + 1)) for tokens, score in live]
        stop = cands[0][2] == model.eos_id
        if norm == "length":
            best = max((f[1] for f in finished), default=-float("inf"))
            stop = best >= live[0][1] / lp(t + 1 + LOOKAHEAD)
        if first is None and (t + 1 >= limit or (stop and finished)):
            first = max(finished, key=lambda f: f[1])
        if t + 1 >= limit or (stop and len(finished) >= n_best):
            break
    rest = sorted((f for f in finished if f is not first), key=lambda f: -f[1])
    return [first, *rest][:n_best]


@pytest.mark.parametrize(
    ("K", "alpha", "norm"),
    [(3, 1.0, "gnmt"), (4, 0.0, "gnmt"), (3, 1.0, "length"), (2, 0.6, "length")],
)
def test_batched_beam_equals_reference(trained, K, alpha, norm):
    """The batched search finds the simple one's n-best lists (with the length^alpha form
    its 1-best: searching on past the best candidate's end, the tiny model's later
    candidates come close enough for float32 and float64 sums to rank them otherwise)."""
    model, _, src, pad = trained
    n_best = K if norm == "gnmt" else 1
    method = Beam(K, length_penalty=alpha, n_best=n_best, length_norm=norm)
    batched = beam_search(model, src, pad, SearchOptions(method, max_len_a=1.5, max_len_b=5))
    limits = max_output_lengths(pad, SearchOptions(max_len_a=1.5, max_len_b=5))
    for i in range(0, src.size(0), 3):
        n = int((~pad[i]).sum())
        ref = reference_beam(
            model, src[i : i + 1, :n], pad[i : i + 1, :n], K, alpha, int(limits[i]), n_best, norm
        )
        assert [h.tokens for h in batched[i]] == [r[0] for r in ref]
        for h, r in zip(batched[i], ref, strict=True):
            assert h.score == pytest.approx(r[1], abs=1e-4)


def test_cached_and_uncached_greedy_agree(trained):
    model, _, src, pad = trained
    cached = greedy_search(model, src, pad, SearchOptions(max_len_a=1.5, max_len_b=5))
    limits = max_output_lengths(pad, SearchOptions(max_len_a=1.5, max_len_b=5))
    for i in range(0, src.size(0), 2):
        n = int((~pad[i]).sum())
        tokens: list[int] = []
        while len(tokens) < int(limits[i]):
            nxt = int(
                uncached_next_logprobs(
                    model, src[i : i + 1, :n], pad[i : i + 1, :n], tokens
                ).argmax()
            )
            if nxt == model.eos_id:
                break
            tokens.append(nxt)
        assert cached[i].tokens == tokens


def test_beam_pool_first_step_decodes_one_row_per_sentence(trained, monkeypatch):
    """Before its first step a sentence's K beams are one row (K copies of it would cost K
    times the step); sentences added before that step, or after it, find the same."""
    model, _, src, pad = trained
    K = 3
    opts = SearchOptions(Beam(K, n_best=2), max_len_a=1.5, max_len_b=5)
    whole = beam_search(model, src, pad, opts)
    rows: list[int] = []
    step = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda m, s, prev, a=None: (
        rows.append(prev.numel()) or step(m, s, prev, a)))  # fmt: skip
    pool = BeamPool(model, opts)
    first = pool.add(src[:5], pad[:5])
    second = pool.add(src[5:9], pad[5:9])  # before the first step: its rows join as one each
    found = pool.step()
    third = pool.add(src[9:], pad[9:])  # a running pool: K rows each
    while len(pool):
        found.update(pool.step())
    assert rows[0] == 9 and all(r % K == 0 for r in rows[1:])
    for i, key in enumerate(first + second + third):
        assert [h.tokens for h in found[key]] == [h.tokens for h in whole[i]]
        assert [h.score for h in found[key]] == pytest.approx([h.score for h in whole[i]], abs=1e-5)


@pytest.mark.parametrize("cohorts", [8, 2])
def test_beam_pool_keeps_each_join_as_a_cohort(trained, cohorts, monkeypatch):
    """Sentences that join a running pool at a step of their own are a cohort of their own
    (a Transformer's lean step shares the products among cohorts): its caches are as long
    as its own steps, not the oldest sentence's, and its first step decodes one row per
    sentence. Past the model's cohorts, newcomers join the youngest. Every sentence finds
    what the batch search finds."""
    import attnmt.models.transformer as transformer

    model, _, src, pad = trained
    model = for_decoding(copy.deepcopy(model), "fp32")
    monkeypatch.setattr(transformer, "COHORTS", cohorts)
    K = 3
    opts = SearchOptions(Beam(K, n_best=2), max_len_a=1.5, max_len_b=5)
    whole = beam_search(model, src, pad, opts)
    sizes: list[list[int]] = []
    decode = model.decode_cohorts
    monkeypatch.setattr(model, "decode_cohorts", lambda m, s, prev, n, a=None: (
        sizes.append(list(n)) or decode(m, s, prev, n, a)))  # fmt: skip
    pool, found, keys = BeamPool(model, opts), {}, []
    for start, end in ((0, 4), (4, 7), (7, 9), (9, 12)):
        keys += pool.add(src[start:end], pad[start:end])
        found.update(pool.step())
        if start == 7:  # three joins so far, each at a step of its own
            assert len(pool.cohorts) == (min(3, cohorts) if model.max_cohorts > 1 else 1)
            at, lengths = 0, []
            for c in pool.cohorts:  # each cohort's sentences are consecutive in the pool
                steps = int(pool.steps[at : at + c.n].max())
                at += c.n
                if hasattr(c.state, "caches"):  # a Transformer: caches of its own steps
                    lengths.append(c.state.caches[0].self_k.size(2))
                    assert lengths[-1] == steps
            assert lengths == sorted(lengths, reverse=True)
    while len(pool):
        found.update(pool.step())
    if model.max_cohorts > 1:
        assert sizes[1] == [4 * K, 3]  # the newcomers' first step: one row each
    for i, key in enumerate(keys):
        assert [h.tokens for h in found[key]] == [h.tokens for h in whole[i]]
        assert [h.score for h in found[key]] == pytest.approx([h.score for h in whole[i]], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_same_output_whatever_batch_size_and_order(trained, beam):
    model, tok, _, _ = trained
    lines, _ = make_pairs(15, 11)
    lines[3] = ""
    lines[7] = " ".join(["w1", "w2"] * 40)  # a long line: translated up to the limit
    opts = SearchOptions(beam_or_greedy(beam, n_best=beam))
    one = search_lines(model, tok, lines, opts, batch_tokens=1)
    many = search_lines(model, tok, lines, opts, batch_tokens=10_000, batch_sentences=4)
    rev = search_lines(model, tok, lines[::-1], opts, batch_tokens=50)[::-1]
    texts = [[t.text for t in r] for r in one]
    assert texts == [[t.text for t in r] for r in many] == [[t.text for t in r] for r in rev]
    assert len(one) == 15 and all(len(r) == beam for r in one)
    assert one[3][0].text == ""
    assert len(one[7][0].tgt_pieces) - 1 <= 1.5 * len(one[7][0].src_pieces) + 10


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize(
    ("workers", "kind"),
    [(3, "process"), (2, "thread")],  # of 4 intra-op threads: 1 each (forked), 2 each
)
def test_parallel_workers_give_the_same_translations(
    trained, beam, workers, kind, monkeypatch, tmp_path
):
    model, tok, _, _ = trained
    lines, _ = make_pairs(13, 21)
    opts = SearchOptions(beam_or_greedy(beam, n_best=beam), attention=AttentionSpec())
    serial = search_lines(model, tok, lines, opts, batch_tokens=10_000, batch_sentences=2)
    import attnmt.decoding.batch as search_module

    # Per batch searched: process id, thread name, its intra-op threads (a file, so that
    # forked workers can write it too).
    log = tmp_path / "searches.txt"
    name = "greedy_search" if beam == 1 else "beam_search"
    search = getattr(search_module, name)

    def recording(*args, **kwargs):
        with log.open("a") as f:
            thread = threading.current_thread().name
            f.write(f"{os.getpid()} {thread} {torch.get_num_threads()}\n")
        return search(*args, **kwargs)

    monkeypatch.setattr(search_module, name, recording)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        parallel = search_lines(
            model, tok, lines, opts, batch_tokens=10_000, batch_sentences=2, workers=workers
        )
        assert torch.get_num_threads() == 4  # the caller's setting is left alone
    finally:
        torch.set_num_threads(threads)
    seen = [line.split() for line in log.read_text().splitlines()]
    assert len(seen) == 7
    assert {int(n) for _, _, n in seen} == {4 // workers}
    if kind == "process":
        pids = {int(pid) for pid, _, _ in seen}
        assert os.getpid() not in pids and len(pids) <= workers
    else:
        assert all(pid == str(os.getpid()) for pid, _, _ in seen)
        assert all(thread.startswith("attnmt-search") for _, thread, _ in seen)
    for a, b in zip(serial, parallel, strict=True):
        assert [t.text for t in a] == [t.text for t in b]
        assert [t.tgt_pieces for t in a] == [t.tgt_pieces for t in b]
        for x, y in zip(a, b, strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-5)
            assert isinstance(y.attention, torch.Tensor) and x.attention is not None
            torch.testing.assert_close(x.attention, y.attention)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forked workers need fork")
def test_a_worker_process_that_dies_ends_with_one_clear_error(trained, monkeypatch):
    model, tok, _, _ = trained
    lines, _ = make_pairs(6, 22)
    import attnmt.decoding.translate

    def dying(job, batch):  # as a worker killed by the OS (out of memory) would end
        os._exit(9)

    monkeypatch.setattr(attnmt.decoding.translate._SearchJob, "__call__", dying)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(AttnmtError, match="search worker process ended unexpectedly"):
            search_lines(
                model, tok, lines, SearchOptions(beam_or_greedy(1)), batch_tokens=10_000,
                batch_sentences=2, workers=2,
            )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def test_attention_weights_follow_the_hypothesis(trained):
    model, tok, _, _ = trained
    lines, _ = make_pairs(4, 12)
    for beam in (1, 3):
        out = search_lines(
            model,
            tok,
            lines,
            SearchOptions(beam_or_greedy(beam), attention=AttentionSpec()),
            batch_tokens=100,
        )
        for r in out:
            t = r[0]
            assert t.attention is not None
            assert t.attention.shape == (len(t.tgt_pieces), len(t.src_pieces))
            torch.testing.assert_close(t.attention.sum(-1), torch.ones(len(t.tgt_pieces)))


class ScriptedModel(Seq2Seq):
    """A very confident model: at position t it gives its script's token log-prob -0.01 and
    every other token (EOS included) about -7, the shape label smoothing leaves behind."""

    def __init__(self, script: list[int], vocab: int = 12) -> None:
        super().__init__()
        self.script, self.vocab = [*script, self.eos_id], vocab

    def encode(self, src, src_pad_mask):
        return src.new_zeros(src.size(0))  # (B,) nothing to remember

    def init_state(self, memory):
        return torch.zeros_like(memory)  # (B,) position

    def decode_step(self, memory, state, prev_tokens, attention=None):
        logits = torch.full((state.size(0), self.vocab), -7.0)  # (B, V)
        for i, pos in enumerate(state.tolist()):
            logits[i, self.script[min(pos, len(self.script) - 1)]] = 0.0
        return logits, state + 1, None

    def select_memory(self, memory, index):
        return memory[index]

    def select_state(self, state, index):
        return state[index]


@pytest.mark.parametrize("K", [2, 5])
def test_beam_keeps_the_best_hypothesis_on_a_confident_model(K):
    """Regression: stopping once K hypotheses have finished let the EOS extensions of poor
    beams end the search while the best beam was in mid-sentence (beam 5 scored 79 BLEU
    where greedy scored 99 on the quickstart)."""
    model = ScriptedModel([5, 6, 7, 8, 9, 10, 11, 5]).eval()
    src = torch.tensor([[4, 4, 4, 3]])
    pad = src == 0
    greedy = greedy_search(model, src, pad, SearchOptions(max_len_a=3.0, max_len_b=5))[0]
    best = beam_search(
        model, src, pad, SearchOptions(Beam(K, length_penalty=1.0), max_len_a=3.0, max_len_b=5)
    )[0][0]
    assert greedy.tokens == [5, 6, 7, 8, 9, 10, 11, 5]
    assert best.tokens == greedy.tokens and best.ended


@pytest.mark.parametrize("L", [8000, 40000, 8001 * 5, 23, 101])
def test_topk_rows_and_argmax_rows_equal_torch(L):
    g = torch.Generator().manual_seed(L)
    x = torch.randn(7, L, generator=g)
    x[0, : L // 2] = float("-inf")  # a row with many equal (-inf) values
    x[1, 5] = x[1, L - 3] = x[1].max() + 1  # a tied maximum: the first one counts
    values, idx = topk_rows(x, 10)
    ref_values, ref_idx = x.topk(10, dim=1)
    assert torch.equal(values, ref_values)
    assert torch.equal(idx[2:], ref_idx[2:])  # rows without ties among their top 10
    assert torch.equal(x.gather(1, idx), values)
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))
    assert int(argmax_rows(x)[1]) == 5


@pytest.mark.parametrize("n_best", [2, 4])
def test_n_best_lists_start_with_the_1_best(trained, n_best):
    """A longer search for more hypotheses may find one scoring higher; the 1-best answer
    still heads the list, and the others follow by score."""
    model, _, src, pad = trained
    options = SearchOptions(Beam(4), max_len_b=5)
    one = beam_search(model, src, pad, options)
    many = beam_search(model, src, pad, SearchOptions(Beam(4, n_best=n_best), max_len_b=5))
    for a, b in zip(one, many, strict=True):
        assert len(a) == 1 and len(b) == n_best
        assert b[0].tokens == a[0].tokens and b[0].score == pytest.approx(a[0].score, abs=1e-5)
        assert [h.score for h in b[1:]] == sorted((h.score for h in b[1:]), reverse=True)
