"""Which decoder layer's cross-attention aligns words best (translate --alignments' default).

No gold de-en word alignment can be had here, so the reference is a statistical aligner:
IBM Model 1 (Brown et al. 1993) trained by EM on the training corpus in both directions,
its Viterbi links intersected (high precision, the usual "sure" links). Each layer's (and the
GRU's) attention alignments of the model's own translations of the test set are scored against
it: precision, recall and AER = 1 - 2|A∩S| / (|A| + |S|) (S = sure links only). A proxy, said
as such in docs/benchmarks.md.

    python scripts/alignment_layers.py --model runs/t30 --train-src data/multi30k/train.de.gz \
        --train-tgt data/multi30k/train.en.gz --src data/multi30k/test_2016_flickr.de.gz
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from attnmt import Translator
from attnmt.data.text import read_lines
from attnmt.decoding.alignment import word_alignment
from attnmt.models.seq2seq import AttentionSpec


def ibm1(src: list[list[str]], tgt: list[list[str]], iterations: int) -> dict:
    """p(t | s) by EM, with a NULL source word."""
    prob: dict = defaultdict(lambda: 1.0)
    for _ in range(iterations):
        count: dict = defaultdict(float)
        total: dict = defaultdict(float)
        for s, t in zip(src, tgt, strict=True):
            s = ["<null>", *s]
            for w in t:
                z = sum(prob[(w, v)] for v in s)
                for v in s:
                    c = prob[(w, v)] / z
                    count[(w, v)] += c
                    total[v] += c
        prob = defaultdict(float, {k: c / total[k[1]] for k, c in count.items()})
    return prob


def viterbi(prob: dict, s: list[str], t: list[str]) -> set[tuple[int, int]]:
    """(source i, target j) for each target word's likeliest source word (NULL: none)."""
    links = set()
    for j, w in enumerate(t):
        scores = [prob[(w, "<null>")]] + [prob[(w, v)] for v in s]
        best = max(range(len(scores)), key=scores.__getitem__)
        if best > 0:
            links.add((best - 1, j))
    return links


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--train-src", type=Path, required=True)
    ap.add_argument("--train-tgt", type=Path, required=True)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--lines", type=int, default=500)
    ap.add_argument("--iterations", type=int, default=5)
    args = ap.parse_args()
    tr = Translator.load(args.model, device="cpu")
    src = read_lines(args.src)[: args.lines]
    hyps = tr.translate(src, beam=5)
    words = [line.lower().split() for line in src]
    hyp_words = [h.lower().split() for h in hyps]
    train_s = [x.lower().split() for x in read_lines(args.train_src)]
    train_t = [x.lower().split() for x in read_lines(args.train_tgt)]
    forward = ibm1(train_s + words, train_t + hyp_words, args.iterations)  # p(en | de)
    backward = ibm1(train_t + hyp_words, train_s + words, args.iterations)  # p(de | en)
    sure = [
        viterbi(forward, s, t) & {(i, j) for j, i in viterbi(backward, t, s)}
        for s, t in zip(words, hyp_words, strict=True)
    ]
    layers = tr.cfg.model.dec_layers if tr.cfg.model.arch == "transformer" else 1
    print(
        f"{'layer':>6} {'precision':>9} {'recall':>7} {'AER':>6}",
        f"({sum(map(len, sure))} sure links)",
    )
    for layer in range(layers):
        opts = tr.options(5, attention=AttentionSpec(layer))
        found = [r[0] for r in tr.search(src, opts)]
        a_n = s_n = both = 0
        for t, s in zip(found, sure, strict=True):
            links = set(word_alignment(t.src_pieces, t.tgt_pieces, t.attention))
            a_n, s_n, both = a_n + len(links), s_n + len(s), both + len(links & s)
        p, r = both / max(a_n, 1), both / max(s_n, 1)
        print(f"{layer:>6} {p:9.3f} {r:7.3f} {1 - 2 * both / max(a_n + s_n, 1):6.3f}")


if __name__ == "__main__":
    main()
