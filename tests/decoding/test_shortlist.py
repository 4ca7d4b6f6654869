"""Lexical shortlists: IBM Model 1 finds the lexicon, off = today's output, on = a softmax over
the subset whose outputs lie in it, fp32 and int8, per search thread."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from attnmt import Translator
from attnmt.data.tokenizer import EOS_ID, UNK_ID
from attnmt.decoding.shortlist import (
    SHORTLIST_FILE,
    Shortlist,
    ShortlistOutput,
    build_shortlist,
    restricted,
)
from attnmt.kernels.int8 import Int8Linear
from attnmt.kernels.matmul import Linear

from conftest import LEXICON, make_pairs
from helpers import assert_user_error, cli_lines


def test_ibm_model_1_puts_each_words_translation_first():
    """Toy pairs: target = the source words translated and reversed. Co-occurrence would rank
    frequent words first; IBM 1 ranks each word's translation first."""
    words = sorted(LEXICON)
    src_id = {w: i for i, w in enumerate(words)}
    tgt_id = {LEXICON[w]: 20 + i for i, w in enumerate(words)}
    pairs = [
        ([src_id[w] for w in s.split()], [tgt_id[t] for t in t_.split()])
        for s, t_ in zip(*make_pairs(400, 3), strict=True)
    ]
    short = build_shortlist(pairs, len(words) + 3, 40, k=3, frequent=2)
    for w in words:
        assert int(short.table[src_id[w], 0]) == tgt_id[LEXICON[w]]
    assert (short.table[len(words) :] == -1).all()  # pieces never seen: nothing
    assert short.frequent.numel() == 2 and short.pairs == 400


def test_allowed_is_the_union_of_the_batchs_lists_and_the_frequent_pieces():
    table = torch.tensor([[-1, -1], [5, 6], [6, 7], [9, -1]])
    short = Shortlist(table, torch.tensor([4]), 1)
    src = torch.tensor([[1, 3, 0], [2, 0, 0]])  # 0: padding
    assert short.allowed(src, [11]).tolist() == sorted({EOS_ID, UNK_ID, 4, 5, 6, 7, 9, 11})


@pytest.mark.parametrize("int8", [False, True])
def test_the_output_is_a_softmax_over_the_rows_in_use(int8):
    torch.manual_seed(0)
    full = Linear(8, 30)
    layer = Int8Linear.quantize(full, full_range=True) if int8 else full
    out = ShortlistOutput(layer, 30)
    x = torch.randn(2, 3, 8)
    rows = torch.tensor([2, 5, 11, 29])
    everything = layer(x)
    assert torch.equal(out(x), everything)  # no rows set: the whole projection
    with restricted(nn.Sequential(out), rows):
        got = out(x)
    assert torch.isinf(got).sum() == 2 * 3 * (30 - 4)
    torch.testing.assert_close(got[..., rows], everything[..., rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(out(x), everything)  # the block ended: all rows again


@pytest.fixture
def model_dir(trained, tmp_path):
    """A copy of the shared trained model (this test writes its shortlist into it)."""
    shutil.copytree(trained[0], tmp_path / "m")
    return tmp_path / "m", trained[1]


def test_the_cli_builds_and_uses_a_shortlist(model_dir, run_cli):
    model, _ = model_dir
    sources = make_pairs(30, 5)[0]
    plain = cli_lines(run_cli, model, sources, "--beam", "3")
    assert_user_error(run_cli("translate", "-m", str(model), "--shortlist"), "attnmt shortlist")
    r = run_cli("shortlist", "-m", str(model), "--k", "2", "--frequent", "1")
    assert r.code == 0, r.stderr
    assert (model / SHORTLIST_FILE).is_file() and "from 300 pairs" in r.stderr
    assert cli_lines(run_cli, model, sources, "--beam", "3", "--no-shortlist") == plain
    tr = Translator.load(model, shortlist=True)
    assert tr.translate(sources, beam=3) == cli_lines(
        run_cli, model, sources, "--beam", "3", "--shortlist"
    )
    sp = tr.tokenizer.tgt.sp
    for line in sources:  # every output piece is one the line's shortlist allows
        src = torch.tensor([tr.tokenizer.src.encode([line])[0]])
        allowed = set(tr.shortlist.allowed(src).tolist())
        found = tr.search([line], tr.options(beam=3))[0][0]
        assert {sp.piece_to_id(p) for p in found.tgt_pieces} <= allowed


def test_a_line_pool_outputs_its_lines_shortlists_union_as_lines_come_and_go(model_dir, run_cli):
    model, _ = model_dir
    assert run_cli("shortlist", "-m", str(model), "--k", "2", "--frequent", "1").code == 0
    tr = Translator.load(model, shortlist=True)
    sources = make_pairs(12, 8)[0]
    pool, sp = tr.pool(tr.options(beam=2)), tr.tokenizer.tgt.sp
    keys = dict(zip(pool.add(sources[:6]), sources[:6], strict=True))
    found = {}
    for step in range(200):
        if step == 2:  # more lines join: the union grows; as lines leave it shrinks
            keys |= dict(zip(pool.add(sources[6:]), sources[6:], strict=True))
        found |= pool.step()
        if not len(pool):
            break
    union = set()
    for line in sources:
        union |= set(
            tr.shortlist.allowed(torch.tensor([tr.tokenizer.src.encode([line])[0]])).tolist()
        )
    assert set(found) == set(keys)
    for results in found.values():
        assert {sp.piece_to_id(p) for p in results[0].tgt_pieces} <= union
    assert pool.rows is None or set(pool.rows.tolist()) <= union


def test_a_shortlist_of_every_piece_changes_nothing_and_threads_keep_their_own(model_dir, run_cli):
    model, corpus = model_dir
    r = run_cli("shortlist", "-m", str(model), "--src", str(corpus["train_src"]), "--tgt",
                str(corpus["train_tgt"]), "--k", "100000", "--frequent", "100000")  # fmt: skip
    assert r.code == 0, r.stderr
    sources = make_pairs(40, 6)[0]
    for beam in ("1", "4"):
        plain = cli_lines(run_cli, model, sources, "--beam", beam)
        assert cli_lines(run_cli, model, sources, "--beam", beam, "--shortlist") == plain
    assert run_cli("shortlist", "-m", str(model), "--k", "1", "--frequent", "0").code == 0
    small = Translator.load(model, shortlist=True, workers=1)
    threads = Translator.load(model, shortlist=True, workers=2)
    assert small.translate(sources, beam=2, batch_tokens=20) == threads.translate(
        sources, beam=2, batch_tokens=20
    )


def test_a_shortlist_of_another_vocabulary_is_refused(model_dir, run_cli):
    model, _ = model_dir
    Shortlist(torch.zeros(3, 2, dtype=torch.long), torch.tensor([1]), 1).save(
        model / SHORTLIST_FILE
    )
    assert_user_error(run_cli("translate", "-m", str(model), "--shortlist"), "another vocabulary")
    (model / SHORTLIST_FILE).write_bytes(b"not a shortlist")
    assert_user_error(run_cli("translate", "-m", str(model), "--shortlist"), "not a shortlist")
