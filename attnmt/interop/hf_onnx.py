"""A MarianMTModel export's ONNX files in the layout Hugging Face Optimum writes and
transformers.js loads (`attnmt export --format huggingface --onnx`):

    onnx/encoder_model.onnx         input_ids, attention_mask (B, S) -> last_hidden_state (B, S, d)
    onnx/decoder_model_merged.onnx  input_ids (B, 1), encoder_attention_mask (B, S),
                                    encoder_hidden_states (B, S, d),
                                    past_key_values.{i}.decoder.{key,value} (B, h, t, d_h)
                                    -> logits (B, 1, V), present.{i}.decoder.{key,value}
    onnx/*_quantized.onnx           the same, int8 (interop.onnx.quantize_int8)
    tokenizer.json, tokenizer_config.json, generation_config.json

The decoder takes the self-attention cache of earlier steps (empty, t = 0, at the first: what
transformers.js feeds a graph whose cache inputs it finds) and the encoder's output, from which
it projects the cross-attention keys and values at each step: Optimum's merged decoder returns
them as a cache of their own behind a branch, which a graph of one path cannot. The position of
the new token is the cache's length. Only one token at a time: a forced decoder prefix of
several tokens is not taken. The graphs are attnmt's model (its encoder and DecoderLayer.step),
not transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from attnmt.interop.onnx import export_graph, quantize_int8
from attnmt.interop.onnx_graphs import MAX_POSITIONS, TransformerDecoderStep
from attnmt.models.attention import additive_mask
from attnmt.models.transformer import TransformerSeq2Seq

SPACE = "\u2581"


class HFEncoder(nn.Module):
    def __init__(self, net: TransformerSeq2Seq) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) ids and 1/0 mask -> the encoder stack's output (B, S, d)."""
        return self.net.encode_hidden(input_ids, attention_mask == 0)[0]


class HFDecoder(TransformerDecoderStep):
    """interop.onnx_graphs' decoder step under Optimum's names, the cross-attention keys and
    values projected from encoder_hidden_states."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """input_ids (B, 1), the cache per layer (key, value) -> logits (B, 1, V), the cache."""
        h = encoder_hidden_states
        src_mask = additive_mask(encoder_attention_mask == 0, None, h.dtype)  # (B, 1, 1, S)
        tokens = input_ids[:, -1]  # (B,)
        position = torch.zeros_like(tokens) + past[0].size(2)  # (B,): positions decoded so far
        cross = [t for layer in self.net.decoder_layers for t in layer.cross_attn.project_kv(h, h)]
        hidden, present = self.hidden(tokens, position, src_mask, (*cross, *past))  # (B, d)
        return (self.net.output(hidden).unsqueeze(1), *present)  # (B, 1, V), ...


def write_hf_onnx(net: TransformerSeq2Seq, tokenizer: Tokenizer, folder: Path, beam: int) -> None:
    """onnx/ (fp32 and int8), tokenizer.json, tokenizer_config.json, generation_config.json."""
    onnx_dir = folder / "onnx"
    onnx_dir.mkdir()
    B, S, t = 2, 5, 3
    # transformers.js sizes the first step's empty cache from these names: batch_size, and 0
    # for any other.
    names = ("batch_size", "encoder_sequence_length", "past_decoder_sequence_length")
    batch, src_len, cache = (torch.export.Dim(n) for n in names)
    ids, mask = torch.full((B, S), 4, dtype=torch.long), torch.ones(B, S, dtype=torch.long)
    export_graph(HFEncoder(net), (ids, mask), ({0: batch, 1: src_len}, {0: batch, 1: src_len}),
            ["input_ids", "attention_mask"], ["last_hidden_state"],
            onnx_dir / "encoder_model.onnx")  # fmt: skip
    with torch.no_grad():
        hidden = HFEncoder(net)(ids, mask)
    heads, d_h = (
        net.decoder_layers[0].cross_attn.num_heads,
        net.decoder_layers[0].cross_attn.head_dim,
    )
    L = len(net.decoder_layers)
    past = [torch.zeros(B, heads, t, d_h) for _ in range(2 * L)]
    names = [f"past_key_values.{i}.decoder.{kv}" for i in range(L) for kv in ("key", "value")]
    shapes = (
        {0: batch}, {0: batch, 1: src_len}, {0: batch, 1: src_len},
        tuple({0: batch, 2: cache} for _ in past),
    )  # fmt: skip
    export_graph(HFDecoder(net), (ids[:, :1], mask, hidden, *past), shapes,
            ["input_ids", "encoder_attention_mask", "encoder_hidden_states", *names],
            ["logits", *(n.replace("past_key_values", "present") for n in names)],
            onnx_dir / "decoder_model_merged.onnx")  # fmt: skip
    for name in ("encoder_model", "decoder_model_merged"):
        (onnx_dir / f"{name}_quantized.onnx").write_bytes((onnx_dir / f"{name}.onnx").read_bytes())
        quantize_int8(onnx_dir / f"{name}_quantized.onnx")
    (folder / "tokenizer.json").write_text(json.dumps(hf_tokenizer(tokenizer), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    generation = {
        "decoder_start_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        # attnmt cuts a line at its limit as it is; a forced EOS would replace its last token.
        "forced_eos_token_id": None, "bad_words_ids": [[PAD_ID], [BOS_ID]],
        "num_beams": beam, "max_length": MAX_POSITIONS,
    }  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


TOKENIZER_CONFIG = {
    "tokenizer_class": "MarianTokenizer", "model_max_length": MAX_POSITIONS,
    "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
}  # fmt: skip


def hf_tokenizer(tokenizer: Tokenizer) -> dict[str, Any]:
    """The SentencePiece model as a Hugging Face tokenizers file: a Unigram model over the same
    pieces, ids and scores, NFKC and SentencePiece's space handling (Metaspace), </s> appended."""
    sp = tokenizer.src.sp
    special = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
    vocab = [
        [sp.id_to_piece(i), 0.0 if i in special else sp.get_score(i)]
        for i in range(len(tokenizer.src))
    ]
    metaspace = {
        "type": "Metaspace",
        "replacement": SPACE,
        "prepend_scheme": "always",
        "split": True,
    }
    added = [
        {"id": i, "content": vocab[i][0], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i in special
    ]  # fmt: skip
    eos = vocab[EOS_ID][0]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFKC"}, {"type": "Strip", "strip_left": True, "strip_right": True},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
        "pre_tokenizer": metaspace,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": eos, "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 0}},
                     {"SpecialToken": {"id": eos, "type_id": 0}}],
            "special_tokens": {eos: {"id": eos, "ids": [EOS_ID], "tokens": [eos]}},
        },
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": UNK_ID, "vocab": vocab, "byte_fallback": False},
    }  # fmt: skip
