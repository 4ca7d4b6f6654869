"""Sentences that join a running search (serve's step-level pool) get what the batch path
gives them: every architecture, greedy and beam (n-best, prefixes, constraints, attention)."""

from __future__ import annotations

import pytest
import torch

from attnmt.data.tokenizer import EOS_ID, PAD_ID
from attnmt.decoding.batch import decode, new_pool
from attnmt.decoding.constraints import Phrases
from attnmt.decoding.ensemble import Ensemble
from attnmt.decoding.precision import for_decoding
from attnmt.decoding.search import Beam, Greedy, SearchOptions, forced_tokens
from attnmt.models import compiled_step
from attnmt.models.seq2seq import AttentionSpec

from helpers import V, tiny_model

MODELS = {
    "transformer": lambda: tiny_model("transformer"),
    "post-norm": lambda: tiny_model("transformer", norm="post"),
    "rope": lambda: tiny_model("transformer", positions="rope"),
    "ssru": lambda: tiny_model("transformer", decoder="ssru"),
    "rnn": lambda: tiny_model("rnn"),
    "ensemble": lambda: Ensemble([tiny_model("transformer"), tiny_model("rnn", seed=1)]),
}


def sources(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    return [[*torch.randint(4, V, (m,), generator=g).tolist(), EOS_ID] for m in lengths]


def padded(src: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(map(len, src))
    tokens = torch.tensor([s + [PAD_ID] * (S - len(s)) for s in src])  # (B, S)
    return tokens, tokens == PAD_ID


def alone(model, src, options, prefix=None, phrases=None):
    """Each sentence searched by itself (the batch path)."""
    out = []
    for i, s in enumerate(src):
        tokens, mask = padded([s])
        wanted = None if phrases is None else Phrases([phrases[i]])
        pre = None if prefix is None else [prefix[i]]
        out.append(decode(model, tokens, mask, options, pre, wanted)[0])
    return out


def pooled(model, src, options, joins, prefix=None, phrases=None):
    """The sentences added to one pool in groups, group g before step joins[g]."""
    pool = new_pool(model, options, constrained=phrases is not None)
    found, ids, step, at = {}, [], 0, 0
    groups = [(j, g) for g, j in enumerate(joins)]
    size = -(-len(src) // len(joins))
    while at < len(src) or len(pool):
        for j, g in groups:
            if j == step and g * size < len(src):
                part = range(g * size, min(len(src), (g + 1) * size))
                tokens, mask = padded([src[i] for i in part])
                forced = None
                if prefix is not None:
                    forced = forced_tokens([prefix[i] for i in part], len(part), tokens.device)
                extra = () if phrases is None else (Phrases([phrases[i] for i in part]),)
                ids += pool.add(tokens, mask, forced, *extra)
                at = max(at, part.stop)
        if len(pool):
            found.update(pool.step())
        step += 1
    return [found[i] if isinstance(found[i], list) else [found[i]] for i in ids]


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert [h.tokens for h in g] == [h.tokens for h in w]
        assert [h.ended for h in g] == [h.ended for h in w]
        torch.testing.assert_close(
            torch.tensor([h.score for h in g]), torch.tensor([h.score for h in w]),
            rtol=1e-4, atol=1e-4, equal_nan=True,
        )  # fmt: skip
        for a, b in zip(g, w, strict=True):
            if b.attention is not None:
                S = b.attention.size(1)
                torch.testing.assert_close(a.attention[:, :S], b.attention, rtol=1e-4, atol=1e-5)
                assert not a.attention[:, S:].any()  # padding gets no attention


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("method", [Greedy(), Beam(4, 1.0, 3)], ids=["greedy", "beam"])
def test_sentences_that_join_later_get_the_batch_paths_output(arch, method):
    model = MODELS[arch]().eval()
    src = sources(9)
    options = SearchOptions(method, max_len_a=1.0, max_len_b=4, attention=AttentionSpec())
    want = alone(model, src, options)
    assert_same(pooled(model, src, options, joins=[0, 2, 3, 7]), want)


@pytest.mark.parametrize("method", [Greedy(), Beam(3)], ids=["greedy", "beam"])
def test_newcomers_of_mixed_lengths_are_packed_and_decode_as_alone(method, monkeypatch):
    """Groups that are mostly padding are encoded packed (attnmt.models.packing)."""
    model = tiny_model("transformer").eval()
    src = [s if i % 3 else s * 4 for i, s in enumerate(sources(12, seed=3))]  # long and short
    packed = []
    encode_packed = model.encode_packed
    monkeypatch.setattr(
        model, "encode_packed", lambda *a: packed.append(a[0].size(0)) or encode_packed(*a)
    )
    options = SearchOptions(method, max_len_a=1.0, max_len_b=4, attention=AttentionSpec())
    want = alone(model, src, options)
    assert not packed  # one sentence at a time: nothing to pack
    assert_same(pooled(model, src, options, joins=[0, 1, 3]), want)
    assert packed


@pytest.mark.parametrize("method", [Greedy(), Beam(3)], ids=["greedy", "beam"])
def test_prefixes_are_forced_from_each_sentences_own_first_step(method):
    model = tiny_model("transformer").eval()
    src = sources(6, seed=1)
    prefix = [[5, 6], [], [7], [8, 9, 10], [], [11]]
    options = SearchOptions(method, max_len_a=1.0, max_len_b=5)
    want = alone(model, src, options, prefix)
    got = pooled(model, src, options, [0, 1, 4], prefix)
    assert_same(got, want)
    assert all(g[0].tokens[: len(p)] == p for g, p in zip(got, prefix, strict=True))


def test_constrained_sentences_join_with_their_own_phrases():
    model = tiny_model("transformer").eval()
    src = sources(6, seed=2)
    phrases = [[[5]], [], [[6, 7]], [[8], [9, 10]], [[11]], []]
    options = SearchOptions(Beam(3), max_len_a=2.0, max_len_b=6)
    want = alone(model, src, options, phrases=phrases)
    got = pooled(model, src, options, [0, 2, 5], phrases=phrases)
    assert_same(got, want)


def test_a_pool_that_empties_starts_again():
    model = tiny_model("rnn").eval()
    src = sources(4, seed=3)
    options = SearchOptions(Greedy(), max_len_a=1.0, max_len_b=2)
    pool = new_pool(model, options)
    first = pool.add(*padded(src[:2]))
    found = {}
    while len(pool):
        found.update(pool.step())
    second = pool.add(*padded(src[2:]))
    while len(pool):
        found.update(pool.step())
    assert sorted(found) == first + second
    assert_same([[found[i]] for i in first + second], alone(model, src, options))


@pytest.mark.skipif(compiled_step._compiler_missing() is not None, reason="no C++ compiler here")
@pytest.mark.parametrize("decoder", ["attention", "ssru"])
@pytest.mark.parametrize("method", [Greedy(), Beam(4, 1.0, 3)], ids=["greedy", "beam"])
def test_a_compiled_steps_pool_gives_the_batch_paths_output(
    decoder, method, compile_cache, monkeypatch
):
    """The compiled step (models.compiled_step) takes a pool's joins as one cohort."""
    monkeypatch.setenv("ATTNMT_CACHE", str(compile_cache))
    plain = for_decoding(tiny_model("transformer", decoder=decoder).eval(), "fp32")
    model = for_decoding(tiny_model("transformer", decoder=decoder).eval(), "fp32", compile=True)
    assert model.lean_step.compiled is not None and model.max_cohorts == 1
    src = sources(9)
    options = SearchOptions(method, max_len_a=1.0, max_len_b=4)
    with torch.no_grad():
        assert_same(pooled(model, src, options, joins=[0, 2, 3, 7]), alone(plain, src, options))
