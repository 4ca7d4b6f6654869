#!/usr/bin/env python
"""Issue 80's measure: a model trained with TM matches against one trained without, on the
test sentences that have a fuzzy match of --threshold or more among the training pairs and on
those that have none (Bulté & Tezcan's split). The plain model translates every sentence as
it is; the one trained with data.tm translates with the TM (`Translator.use_tm`: each line's
match given after it, as in training). Prints one JSON line per model and subset: BLEU, chrF,
their signatures, sentences, and the matched share.

    python scripts/tm_split_eval.py --tm runs/tatoeba_train.tm --test data/tatoeba/test.tsv \\
        --plain runs/tatoeba_plain --nfr runs/tatoeba_tm [--threshold 0.6] [--beam 5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnmt import Translator
from attnmt.data.fuzzy import best_matches
from attnmt.data.text import read_lines
from attnmt.data.tm import TranslationMemory
from attnmt.decoding.scores import score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tm", type=Path, required=True, help="the training pairs as a TM")
    ap.add_argument("--test", type=Path, required=True, help="source TAB reference")
    ap.add_argument("--plain", type=Path, required=True, help="a model trained without matches")
    ap.add_argument("--nfr", type=Path, required=True, help="the same trained with data.tm")
    ap.add_argument("--threshold", type=float, default=0.6)
    ap.add_argument("--beam", type=int, default=5)
    args = ap.parse_args()
    pairs = [line.split("\t")[:2] for line in read_lines(args.test) if "\t" in line]
    sources, refs = [s for s, _ in pairs], [r for _, r in pairs]
    with TranslationMemory(args.tm) as tm:
        pair = tm.pair(None)
        best = [best_matches(tm, s, pair, 1, 0.0) for s in sources]
    matched = [bool(b) and b[0].score >= args.threshold for b in best]
    plain = Translator.load(args.plain).translate(sources, beam=args.beam)
    nfr = Translator.load(args.nfr)
    nfr.use_tm(args.tm, threshold=nfr.cfg.data.tm.threshold if nfr.cfg.data.tm else 0.5)
    fed = nfr.translate(sources, beam=args.beam)
    for name, hyps in (("plain", plain), ("with matches", fed)):
        for subset, want in (("matched", True), ("unmatched", False)):
            idx = [i for i, m in enumerate(matched) if m == want]
            s = score([hyps[i] for i in idx], [refs[i] for i in idx])
            print(json.dumps({
                "model": name, "subset": subset, "sentences": len(idx),
                "matched_share": round(sum(matched) / len(matched), 3),
                "bleu": round(s.bleu, 2), "chrf": round(s.chrf, 2),
                "bleu_signature": s.bleu_signature, "chrf_signature": s.chrf_signature,
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
