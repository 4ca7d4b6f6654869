import sacrebleu

from attnmt.data.tokenizer import Tokenizer
from attnmt.decoding.scores import score
from attnmt.decoding.search import SearchOptions
from attnmt.decoding.translate import translate_lines

from conftest import make_pairs
from helpers import tiny_model


def test_score_matches_sacrebleu_and_reports_signatures():
    hyps = ["the cat sat on the mat", "a dog"]
    refs = ["the cat sat on a mat", "a dog barks"]
    s = score(hyps, refs)
    assert s.bleu == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert s.chrf == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert s.bleu_signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert s.chrf_signature.startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")
    assert round(score(refs, refs).bleu, 6) == 100.0


def test_translate_lines_one_out_per_line_in_order_whatever_the_batch():
    src, tgt = make_pairs(100, 0)
    tok = Tokenizer.train(src, tgt, vocab_size=23, joint=True)
    model = tiny_model("transformer", seed=1).eval()
    lines = [src[0], "", src[1], "   ", src[2], src[3] * 5, src[4]]
    opts = SearchOptions(max_len_a=1.0, max_len_b=4)
    small = translate_lines(model, tok, lines, opts, batch_tokens=1)
    big = translate_lines(model, tok, lines, opts, batch_tokens=10_000)
    assert len(small) == len(lines)
    assert small == big
    assert small[1] == "" and small[3] == ""
    reversed_ = translate_lines(model, tok, lines[::-1], opts, batch_tokens=10_000)
    assert reversed_[::-1] == big
