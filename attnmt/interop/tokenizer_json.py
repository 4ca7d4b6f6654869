"""A SentencePiece model as JSON, for a runtime without SentencePiece (the browser page's
tokenizer, interop/web/tokenizer.js): its pieces with their scores and kinds, the model type
(unigram: the Viterbi segmentation of highest summed score; bpe: merges by score) and the
normalizer's switches. The page normalizes with Unicode NFKC, which is what SentencePiece's
nmt_nfkc rule is besides a few control characters (tested on the test sets: the same pieces).
"""

from __future__ import annotations

from typing import Any

MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
KINDS = {1: "normal", 2: "unknown", 3: "control", 4: "user", 5: "unused", 6: "byte"}


def tokenizer_json(proto: bytes, reserved: frozenset[int]) -> dict[str, Any]:
    """The JSON form of one SentencePiece model; `reserved` ids (language tags) never come from
    text, so they are marked as such (attnmt spells them in characters)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(proto)
    norm = m.normalizer_spec
    pieces = [
        [p.piece, round(p.score, 6), "reserved" if i in reserved else KINDS.get(p.type, "normal")]
        for i, p in enumerate(m.pieces)
    ]
    return {
        "model_type": MODEL_TYPES.get(m.trainer_spec.model_type, "unigram"),
        "pieces": pieces,
        "unk_id": m.trainer_spec.unk_id,
        "byte_fallback": m.trainer_spec.byte_fallback,
        "normalization": norm.name,
        "add_dummy_prefix": norm.add_dummy_prefix,
        "remove_extra_whitespaces": norm.remove_extra_whitespaces,
        "escape_whitespaces": norm.escape_whitespaces,
    }
