"""Export a trained Transformer to CTranslate2 (https://opennmt.net/CTranslate2/), a C++
inference engine with int8 and fp16 kernels.

Our Transformer is one CTranslate2's TransformerSpec describes: pre- or post-norm residual
blocks, sinusoidal positions added to embeddings scaled by sqrt(d), a ReLU, GELU or swish
feed-forward, an output bias or none, LayerNorm with torch's epsilon. Each of our modules is
copied into the spec's slot for it; the positional table is ours (model.positions: sin and cos
interleaved, or Marian's halves), written out rather than left to CTranslate2's default. The
source gets EOS appended as ours does (`add_source_eos`), so the exported model takes plain
SentencePiece pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attnmt.config import Config
from attnmt.data.files import WriteError, atomic_directory, check_export_path, free_space, reason
from attnmt.data.tokenizer import BOS_ID, PAD_ID, Tokenizer, language_tag
from attnmt.decoding.search import output_limit, search_options
from attnmt.decoding.translator import Translator
from attnmt.errors import AttnmtError
from attnmt.interop import agreement
from attnmt.interop.agreement import Agreement
from attnmt.models.directory import load_model_dir
from attnmt.models.transformer import (
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    TransformerSeq2Seq,
    sinusoid_table,
)

GENERATION_FILE = "generation.json"  # the decoding options that give attnmt's output
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")  # fmt: skip


def export_ctranslate2(
    model_dir: Path,
    out: Path,
    weights: str = "best",
    quantization: str | None = None,
    force: bool = False,
) -> list[str]:
    """Write model_dir's Transformer (its `weights`) as a CTranslate2 model directory `out`,
    with the SentencePiece model(s) beside it; returns the files written. `out` appears
    whole or not at all."""
    ct2 = _import_ctranslate2()
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise AttnmtError(f"--quantization {quantization!r}: expected {', '.join(QUANTIZATIONS)}")
    check_export_path(model_dir, out, force)
    cfg, tokenizer, net = load_model_dir(model_dir, weights, "cpu")
    if not isinstance(net, TransformerSeq2Seq):
        raise AttnmtError(
            f"{model_dir} is a GRU model (model.arch: {cfg.model.arch}); CTranslate2 has no GRU "
            "decoder, so only Transformer models can be exported"
        )
    if cfg.model.positions == "rope":
        raise AttnmtError(
            f"{model_dir} has rotary positions (model.positions: rope); CTranslate2's "
            "encoder-decoder Transformer adds a position table, so it cannot express them"
        )
    if cfg.model.decoder != "attention":
        raise AttnmtError(
            f"{model_dir} has an SSRU decoder (model.decoder: {cfg.model.decoder}); CTranslate2's "
            "Transformer decoder has self-attention only"
        )
    positions = max(cfg.decode.max_output_len, cfg.decode.max_src_len) + 1
    spec = transformer_spec(ct2, net, cfg.model.heads, positions)
    src_pieces = tokenizer.src.pieces(range(len(tokenizer.src)))
    tgt_pieces = tokenizer.tgt.pieces(range(len(tokenizer.tgt)))
    spec.register_source_vocabulary(src_pieces)
    spec.register_target_vocabulary(tgt_pieces)
    # Our special ids are fixed (tokenizer.conform); their pieces name them for CTranslate2.
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = tgt_pieces[1:4]
    spec.config.decoder_start_token = tgt_pieces[2]
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = net.encoder_layers[0].res_attn.norm.eps  # all are torch's
    spec.validate()
    spec.optimize(quantization=quantization)
    with atomic_directory(out, "the export") as tmp:
        try:
            spec.save(str(tmp))
        except RuntimeError as e:  # CTranslate2's own write failing: a full disk, RLIMIT_FSIZE
            raise WriteError(
                f"{out}: cannot write the export ({reason(e)}; {free_space(tmp)})"
            ) from None
        for name, data in tokenizer.files().items():
            (tmp / name).write_bytes(data)
        (tmp / GENERATION_FILE).write_text(json.dumps(generation(cfg, tokenizer), indent=2) + "\n")
    return sorted(p.name for p in out.iterdir())


def never_output(tokenizer: Tokenizer) -> list[list[str]]:
    """CTranslate2's suppress_sequences for the pieces attnmt's search never outputs: padding
    and the start token (decoding.search.pick_output)."""
    return [[piece] for piece in tokenizer.tgt.pieces([PAD_ID, BOS_ID])]


def generation(cfg: Config, tokenizer: Tokenizer) -> dict[str, Any]:
    """The model's decoding options for CTranslate2's translate_batch, written beside the export
    (CTranslate2's own default output limit is 256 pieces, whatever the source length)."""
    d = cfg.decode
    tags = (
        {lang: language_tag(lang) for lang in cfg.data.target_langs}
        if cfg.data.multilingual
        else {}
    )
    return {
        **({"source_prefix": tags} if tags else {}),
        "suppress_sequences": never_output(tokenizer),
        "beam_size": d.beam,
        "length_penalty": d.length_penalty,
        "max_input_length": d.max_src_len,
        "max_decoding_length": {
            "a": d.max_len_a,
            "b": d.max_len_b,
            "max": d.max_output_len,
            "round": d.max_len_round,
        },
        "notes": [
            "per sentence, max_decoding_length = min(max, round(a * (source pieces + 1)) + b), "
            "rounded down (floor) or up (ceil), as attnmt stops; with a batch, use the largest",
            "greedy output equals attnmt's; beam output may differ on some lines: CTranslate2 "
            "ranks finished hypotheses by score / length^length_penalty, attnmt by score / "
            "((5 + length) / 6)^length_penalty",
            "suppress_sequences: attnmt never outputs padding or the start token",
            *(
                ["a multilingual model: put source_prefix[target language] (one piece) before "
                 "the source's pieces, or it translates into no language in particular"]
                if tags else []
            ),
        ],
    }  # fmt: skip


def check_agreement(
    out: Path, model_dir: Path, weights: str, lines: list[str], source: str
) -> list[Agreement]:
    """Translate lines greedily with the export in `out` and with attnmt (`weights` of
    model_dir), each sentence under attnmt's output limit (max_len_a × source subwords with EOS
    + max_len_b), and count the identical ones: a broken conversion shows at once. A
    multilingual model is checked into each of its target languages (its tag before the
    source, as generation.json says)."""
    ct2 = _import_ctranslate2()
    ours = Translator.load(model_dir, "cpu", weights, "fp32", workers=1, compile=False)
    langs: list[str | None] = list(ours.target_langs) if ours.cfg.data.multilingual else [None]
    options = search_options(ours.cfg.decode)
    theirs = ct2.Translator(str(out), device="cpu", inter_threads=1)
    found: list[Agreement] = []
    for lang in langs:
        want = ours.translate(lines, beam=1, target_lang=lang)
        prefix = ours.tokenizer.src.pieces(ours.source_prefix(lang))
        got = []
        for line in lines:
            pieces = prefix + ours.tokenizer.src.sp.encode(line, out_type=str)
            limit = output_limit(len(pieces) + 1, options)
            out_ = theirs.translate_batch(
                [pieces], beam_size=1, max_decoding_length=limit,
                suppress_sequences=never_output(ours.tokenizer),
            )  # fmt: skip
            got.append(ours.tokenizer.tgt.sp.decode(out_[0].hypotheses[0]))
        same = sum(g == w for g, w in zip(got, want, strict=True))
        into = f"into {lang}" if lang else ""
        found.append(Agreement(same, len(lines), source, into, ours=want, theirs=got))
    return found


def report_agreement(
    out: Path, model_dir: Path, weights: str, given: Path | None, quantization: str | None
) -> None:
    """Print the export's agreement with attnmt (check_agreement on check_lines)."""

    def check(lines: list[str], source: str) -> list[Agreement]:
        return check_agreement(out, model_dir, weights, lines, source)

    agreement.report_agreement(check, model_dir, given, quantization)


def _import_ctranslate2() -> Any:
    try:
        import ctranslate2
        import ctranslate2.specs.transformer_spec
    except ImportError:
        raise AttnmtError(
            "export needs CTranslate2: pip install torch==2.13.0 'attnmt[export]' (or ctranslate2)"
        ) from None
    return ctranslate2


def transformer_spec(ct2: Any, net: TransformerSeq2Seq, heads: int, positions: int) -> Any:
    """CTranslate2's TransformerSpec holding net's weights; `positions` rows of positional
    table (the longest input or output CTranslate2 can then handle)."""
    ts = ct2.specs.transformer_spec
    activation = net.encoder_layers[0].ff.activation  # model.activation
    spec = ts.TransformerSpec.from_config(
        (len(net.encoder_layers), len(net.decoder_layers)), heads, pre_norm=net.pre_norm,
        activation=getattr(ct2.specs.common_spec.Activation, activation.upper()),
    )  # fmt: skip
    enc, dec = spec.encoder, spec.decoder
    dim, layout = net.src_embed.embed.embedding_dim, net.src_embed.layout  # model.positions
    table = _array(sinusoid_table(positions, dim, layout=layout))
    enc.embeddings[0].weight = _array(net.src_embed.embed.weight)
    enc.position_encodings.encodings = table
    for layer_spec, layer in zip(enc.layer, net.encoder_layers, strict=True):
        _encoder_layer(layer_spec, layer)
    dec.embeddings.weight = _array(net.tgt_embed.embed.weight)
    dec.position_encodings.encodings = table
    for layer_spec, layer in zip(dec.layer, net.decoder_layers, strict=True):
        _decoder_layer(layer_spec, layer)
    if net.pre_norm:  # post-norm stacks have no final LayerNorm (and the spec no slot)
        _layer_norm(enc.layer_norm, net.enc_norm)
        _layer_norm(dec.layer_norm, net.dec_norm)
    _linear(dec.projection, net.output)
    return spec


def _encoder_layer(spec: Any, layer: EncoderLayer) -> None:
    att = layer.self_attn
    _layer_norm(spec.self_attention.layer_norm, layer.res_attn.norm)
    _fused(spec.self_attention.linear[0], [att.q_proj, att.k_proj, att.v_proj])
    _linear(spec.self_attention.linear[1], att.out_proj)
    _feed_forward(spec.ffn, layer.ff, layer.res_ff.norm)


def _decoder_layer(spec: Any, layer: DecoderLayer) -> None:
    att, cross = layer.self_attn, layer.cross_attn
    _layer_norm(spec.self_attention.layer_norm, layer.res_self.norm)
    _fused(spec.self_attention.linear[0], [att.q_proj, att.k_proj, att.v_proj])
    _linear(spec.self_attention.linear[1], att.out_proj)
    _layer_norm(spec.attention.layer_norm, layer.res_cross.norm)
    _linear(spec.attention.linear[0], cross.q_proj)
    _fused(spec.attention.linear[1], [cross.k_proj, cross.v_proj])
    _linear(spec.attention.linear[2], cross.out_proj)
    _feed_forward(spec.ffn, layer.ff, layer.res_ff.norm)


def _feed_forward(spec: Any, ff: FeedForward, norm: nn.LayerNorm) -> None:
    _layer_norm(spec.layer_norm, norm)
    _linear(spec.linear_0, ff.w_1)
    _linear(spec.linear_1, ff.w_2)


def _layer_norm(spec: Any, norm: nn.Module) -> None:
    assert isinstance(norm, nn.LayerNorm)
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _linear(spec: Any, linear: nn.Linear) -> None:
    spec.weight = _array(linear.weight)  # (out, in), as CTranslate2 stores it
    if linear.bias is not None:
        spec.bias = _array(linear.bias)


def _fused(spec: Any, linears: list[nn.Linear]) -> None:
    """Projections CTranslate2 runs as one matmul: weights stacked along the output axis."""
    spec.weight = np.concatenate([_array(lin.weight) for lin in linears])
    if linears[0].bias is not None:  # our attention projections all have a bias or none do
        spec.bias = np.concatenate([_array(lin.bias) for lin in linears])


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()
