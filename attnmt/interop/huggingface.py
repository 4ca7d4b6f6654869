"""Pretrained Marian models in: a Hugging Face `MarianMTModel` directory (OPUS-MT's published
form) becomes an ordinary attnmt model directory (`attnmt import`).

What such a model is (transformers' models/marian): a post-norm Transformer (no final stack
norm, no embedding norm), FFN activation swish or relu, embeddings scaled by sqrt(d), a static
sinusoidal table with all sines before all cosines, an output bias (final_logits_bias), source
and target SentencePiece models (source.spm, target.spm) whose pieces map to the model's ids
through one vocab.json (`</s>` = 0, `<pad>` the last), and a decoder that starts from the pad
id. Each of these is an attnmt config key (model.norm post, model.activation, model.positions
halves, model.output_bias); the ids are matched by reordering the embedding and output rows to
attnmt's tokenizer ids (pad 0, unk 1, bos 2, eos 3), the start token taking the pad row. What
attnmt cannot express is refused in one line naming the setting.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnmt.config import Config, ModelConfig, from_dict
from attnmt.data.files import atomic_directory, atomic_write_bytes, check_export_path
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SubwordVocab, Tokenizer
from attnmt.errors import CheckpointError
from attnmt.interop.untrusted import (
    check_fits,
    check_rows,
    check_state,
    expected_state,
    json_value,
    read_bytes,
    read_pickled_weights,
    read_safetensors,
    short,
    validated_model,
    vocab_ids,
)
from attnmt.models.build import build_model
from attnmt.models.directory import (
    BEST_FILE,
    LAST_FILE,
    META_FILE,
    save_weights,
    tokenizer_digest,
    tokenizer_shas,
    write_run_files,
)
from attnmt.models.transformer import sinusoid_table

MAX_POSITIONS = 1 << 16  # rows of a stored position table (OPUS-MT: 512)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}
# transformers' layer names -> attnmt's, per encoder and decoder layer.
ENCODER_NAMES = {
    "self_attn": "self_attn", "self_attn_layer_norm": "res_attn.norm", "fc1": "ff.w_1",
    "fc2": "ff.w_2", "final_layer_norm": "res_ff.norm",
}  # fmt: skip
DECODER_NAMES = {
    "self_attn": "self_attn", "self_attn_layer_norm": "res_self.norm",
    "encoder_attn": "cross_attn", "encoder_attn_layer_norm": "res_cross.norm",
    "fc1": "ff.w_1", "fc2": "ff.w_2", "final_layer_norm": "res_ff.norm",
}  # fmt: skip


@dataclass
class Imported:
    parameters: int
    src_pieces: int
    tgt_pieces: int
    unknown_pieces: int  # SentencePiece pieces vocab.json lacks: they take <unk>'s row
    notes: list[str]


def import_huggingface(source: Path, out: Path, force: bool = False) -> Imported:
    """Write the attnmt model directory `out` from the MarianMTModel directory `source`.
    Every file is untrusted (attnmt.interop.untrusted): sizes, types, shapes and values are
    checked before the model is built."""
    files = _source_files(source)
    check_export_path(source, out, force)  # before any work; never onto what it is made from
    hf = json_value(files["config"], "a MarianMTModel's config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(f"{files['config']}: not a JSON object; not a model's config")
    cfg_model, notes = model_config(hf, files["config"])
    vocab = read_vocab_json(files["vocab"])
    spm = [read_bytes(files[k], "a SentencePiece model") for k in ("source_spm", "target_spm")]
    pad, eos = _id(hf, "pad_token_id", files["config"]), _id(hf, "eos_token_id", files["config"])
    start = _id(hf, "decoder_start_token_id", files["config"], pad)
    expected = expected_state(cfg_model, 8, 8, False)
    check_fits(expected, files["weights"], 2)  # before the weights are read
    weights = _read_weights(files["weights"])
    shared = _embeddings_shared(hf, weights)
    joint = spm[0] == spm[1] and shared
    paths = [files["source_spm"]] if joint else [files["source_spm"], files["target_spm"]]
    tokenizer = Tokenizer.from_files(paths)
    special = {  # the decoder starts from decoder_start_token_id: attnmt's BOS takes its row
        PAD_ID: pad, BOS_ID: start, EOS_ID: eos, UNK_ID: vocab.get("<unk>", pad),
    }  # fmt: skip
    src_rows, missing_src = model_rows(tokenizer.src, vocab, special)
    tgt_rows, missing_tgt = model_rows(tokenizer.tgt, vocab, special)
    _check_rows(weights, src_rows + tgt_rows, files["weights"])
    state = attnmt_state(hf, weights, src_rows, tgt_rows, cfg_model, files["weights"])
    check_state(
        state, expected_state(cfg_model, len(src_rows), len(tgt_rows), joint), files["weights"]
    )
    model = build_model(cfg_model, len(tokenizer.src), len(tokenizer.tgt), joint)
    model.load_state_dict(state, strict=True)
    cfg = _config(cfg_model, hf, source, out, joint)
    write_imported(out, cfg, tokenizer, model, source, "huggingface")
    return Imported(
        sum(p.numel() for p in model.parameters()), len(tokenizer.src), len(tokenizer.tgt),
        missing_src + missing_tgt, notes,
    )  # fmt: skip


def _source_files(source: Path) -> dict[str, Path]:
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or directory")
    if not source.is_dir():
        raise CheckpointError(f"{source}: not a directory (a Hugging Face MarianMT model)")
    files = {
        "config": source / "config.json", "vocab": source / "vocab.json",
        "source_spm": source / "source.spm", "target_spm": source / "target.spm",
    }  # fmt: skip
    for path in files.values():
        if not path.is_file():
            raise CheckpointError(f"{source}: no {path.name} (a MarianMT model directory has it)")
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (source / name).is_file():
            return {**files, "weights": source / name}
    raise CheckpointError(f"{source}: no model.safetensors or pytorch_model.bin")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict, read without unpickling code (safetensors, or weights_only)."""
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    return read_pickled_weights(path)


def read_vocab_json(path: Path) -> dict[str, int]:
    """vocab.json: piece -> id, ids whole numbers from 0, one piece an id."""
    return vocab_ids(json_value(path, "a MarianMT vocab.json"), path)


def _id(hf: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = hf.get(key, default)
    if type(value) is not int or value < 0:
        raise CheckpointError(
            f"{where}: {key} = {short(value)}: expected an id (a whole number from 0)"
        )
    return value


def _check_rows(weights: dict[str, torch.Tensor], rows: list[int], where: Path) -> None:
    """Every id the vocabulary and the config name must be a row of the embeddings."""
    n = min(_embedding(weights, s).size(0) for s in ("encoder", "decoder"))
    check_rows(rows, n, where)


def model_config(hf: dict[str, Any], where: Path) -> tuple[ModelConfig, list[str]]:
    """The attnmt model section of a MarianConfig, or CheckpointError naming the setting that
    attnmt's Transformer cannot express (or a value of the wrong type)."""

    def refuse(setting: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {setting} = {short(hf.get(setting))}: {why}")

    def whole(key: str) -> int:
        if type(hf.get(key)) is not int:
            raise refuse(key, "expected a whole number")
        return hf[key]

    def flag(key: str, default: bool) -> bool:
        if type(hf.get(key, default)) is not bool:
            raise refuse(key, "expected true or false")
        return hf.get(key, default)

    def number(key: str, default: float) -> float:
        value = hf.get(key, default)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise refuse(key, "expected a number")
        return float(value)

    if hf.get("model_type") != "marian":
        raise refuse("model_type", "attnmt imports MarianMT models only")
    if hf.get("encoder_attention_heads") != hf.get("decoder_attention_heads"):
        raise refuse("decoder_attention_heads", "attnmt has one head count for both stacks")
    if hf.get("encoder_ffn_dim") != hf.get("decoder_ffn_dim"):
        raise refuse("decoder_ffn_dim", "attnmt has one feed-forward width for both stacks")
    if (
        not isinstance(hf.get("activation_function"), str)
        or hf["activation_function"] not in ACTIVATIONS
    ):
        raise refuse("activation_function", f"attnmt has {', '.join(sorted(ACTIVATIONS))}")
    if not flag("scale_embedding", False):
        raise refuse("scale_embedding", "attnmt scales embeddings by sqrt(d)")
    for key in ("normalize_before", "add_final_layer_norm", "normalize_embedding"):
        if flag(key, False):
            raise refuse(key, "attnmt imports post-norm models without extra norms")
    if hf.get("decoder_vocab_size") not in (None, hf.get("vocab_size")):
        raise refuse("decoder_vocab_size", "attnmt imports one vocabulary for both sides")
    notes = []
    if number("dropout", 0.1) != number("attention_dropout", 0.0):
        notes.append("dropout and attention_dropout kept as the source has them")
    d = whole("d_model")
    cfg = validated_model(
        where, "the source's config", arch="transformer", emb_size=d, hidden_size=d,
        heads=whole("encoder_attention_heads"), ff_size=whole("encoder_ffn_dim"),
        enc_layers=whole("encoder_layers"), dec_layers=whole("decoder_layers"),
        dropout=number("dropout", 0.1), attention_dropout=number("attention_dropout", 0.0),
        norm="post", activation=ACTIVATIONS[hf["activation_function"]], positions="halves",
        output_bias=True, tie_embeddings=flag("tie_word_embeddings", True),
    )  # fmt: skip
    return cfg, notes


def _embeddings_shared(hf: dict[str, Any], weights: dict[str, torch.Tensor]) -> bool:
    """Whether the encoder and decoder embeddings are one matrix (and tied to the output)."""
    if not hf.get("share_encoder_decoder_embeddings", True):
        return False
    enc, dec = weights.get("model.encoder.embed_tokens.weight"), _embedding(weights, "decoder")
    return bool(hf.get("tie_word_embeddings", True)) and (enc is None or torch.equal(enc, dec))


def _embedding(weights: dict[str, torch.Tensor], stack: str) -> torch.Tensor:
    found = weights.get(f"model.{stack}.embed_tokens.weight", weights.get("model.shared.weight"))
    if found is None:
        raise CheckpointError(f"no {stack} embedding (model.{stack}.embed_tokens.weight)")
    return found


def model_rows(
    side: SubwordVocab, vocab: dict[str, int], special: dict[int, int]
) -> tuple[list[int], int]:
    """For each attnmt id of a SentencePiece model, the model id (vocab.json) of its piece; the
    special ids as `special` maps them; a piece vocab.json lacks takes <unk>'s. Returns the
    rows and how many pieces were missing."""
    rows, missing = [], 0
    for i in range(len(side)):
        if i in special:
            rows.append(special[i])
            continue
        piece = side.sp.id_to_piece(i)
        missing += piece not in vocab
        rows.append(vocab.get(piece, special[UNK_ID]))
    return rows, missing


def attnmt_state(
    hf: dict[str, Any],
    weights: dict[str, torch.Tensor],
    src_rows: list[int],
    tgt_rows: list[int],
    cfg: ModelConfig,
    where: Path,
) -> dict[str, torch.Tensor]:
    """attnmt's state dict from transformers' (names mapped, vocabulary rows reordered)."""
    used = {"final_logits_bias", "lm_head.weight", "model.shared.weight"}
    if not cfg.tie_embeddings and "lm_head.weight" not in weights:
        raise CheckpointError(
            f"{where}: tie_word_embeddings is false but there is no lm_head.weight (the output "
            "layer of an untied model)"
        )
    bias = weights.get("final_logits_bias")  # (1, V)
    state = {
        "src_embed.embed.weight": _embedding(weights, "encoder")[src_rows],
        "tgt_embed.embed.weight": _embedding(weights, "decoder")[tgt_rows],
        "output.weight": weights.get("lm_head.weight", _embedding(weights, "decoder"))[tgt_rows],
        "output.bias": torch.zeros(len(tgt_rows)) if bias is None else bias.reshape(-1)[tgt_rows],
    }
    used |= {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    for theirs, ours in layer_names(cfg):
        if theirs not in weights:
            raise CheckpointError(f"{where.parent}: the weights lack {theirs}")
        state[ours] = weights[theirs]
        used.add(theirs)
    # attnmt's start token (BOS) takes the pad row as input; as an output it must not count
    # twice in the softmax (transformers normalises over the pad id once): a bias of -100
    # leaves it e^-100 of the mass, which no float adds.
    state["output.bias"] = state["output.bias"].clone()
    state["output.bias"][BOS_ID] = -100.0
    _check_positions(weights, cfg, where)
    extra = sorted(k for k in weights if k not in used and ".embed_positions." not in k)
    if extra:
        raise CheckpointError(
            f"{where}: {extra[0]} (and {len(extra) - 1} more) has no place in attnmt's "
            "Transformer; refused rather than dropped"
        )
    return {k: v.float().contiguous() for k, v in state.items()}


def layer_names(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """(transformers' name, attnmt's name) of every tensor of every encoder and decoder layer."""
    for stack, names, n in (
        ("encoder", ENCODER_NAMES, cfg.enc_layers),
        ("decoder", DECODER_NAMES, cfg.dec_layers),
    ):
        for i, (theirs, ours) in itertools.product(range(n), names.items()):
            for kind in _kinds(theirs):
                yield (
                    f"model.{stack}.layers.{i}.{theirs}.{kind}",
                    f"{stack}_layers.{i}.{ours}.{kind}",
                )


def _kinds(name: str) -> list[str]:
    """The tensors of a transformers submodule: projections' weight and bias each."""
    if name in ("self_attn", "encoder_attn"):
        return [f"{p}_proj.{t}" for p in ("q", "k", "v", "out") for t in ("weight", "bias")]
    return ["weight", "bias"]


def _check_positions(weights: dict[str, torch.Tensor], cfg: ModelConfig, where: Path) -> None:
    """A stored position table must be the one attnmt computes (model.positions halves)."""
    for stack in ("encoder", "decoder"):
        table = weights.get(f"model.{stack}.embed_positions.weight")
        if table is None:
            continue
        if table.dim() != 2 or table.size(1) != cfg.emb_size or table.size(0) > MAX_POSITIONS:
            raise CheckpointError(
                f"{where}: model.{stack}.embed_positions is {tuple(table.shape)}; expected (at "
                f"most {MAX_POSITIONS:,}, {cfg.emb_size}), the sinusoid table of d_model"
            )
        ours = sinusoid_table(table.size(0), table.size(1), layout=cfg.positions)
        if not torch.allclose(table.float(), ours, atol=1e-4):
            raise CheckpointError(
                f"{where}: model.{stack}.embed_positions is not the sinusoid table attnmt "
                "computes (model.positions halves)"
            )


def _config(
    cfg_model: ModelConfig, hf: dict[str, Any], source: Path, out: Path, joint: bool
) -> Config:
    """The model directory's config: the imported model, its tokenizer files (the directory's
    own, conformed), decoding defaults from the source; no data paths (the
    source's corpora are not part of it)."""
    target = out.resolve()
    files = [Tokenizer.JOINT_FILE] if joint else [Tokenizer.SRC_FILE, Tokenizer.TGT_FILE]
    keys = ["model"] if joint else ["src_model", "tgt_model"]
    spm = {k: str(target / name) for k, name in zip(keys, files, strict=True)}
    raw: dict[str, Any] = {
        "data": {"max_len": int(hf.get("max_position_embeddings", 512))},  # no corpus
        "tokenizer": {"joint": joint, **spm},
        "model": cfg_model.model_dump(mode="json"),
        "decode": {"beam": int(hf.get("num_beams") or 5)},
    }
    return from_dict(raw)


def write_imported(
    out: Path, cfg: Config, tokenizer: Tokenizer, model: Any, source: Path, fmt: str
) -> None:
    """The model directory, built beside `out` and renamed into place: never half-written;
    its attnmt.json says where it came from (`fmt`: huggingface or marian)."""
    with atomic_directory(out, "the imported model") as tmp:
        write_run_files(tmp, cfg, tokenizer)
        meta = json.loads((tmp / META_FILE).read_text(encoding="utf-8"))
        meta["imported_from"] = {"format": fmt, "path": str(source.resolve())}
        atomic_write_bytes(tmp / META_FILE, json.dumps(meta, indent=2).encode("utf-8"))
        save_weights(model, tmp / BEST_FILE, tokenizer_digest(tokenizer_shas(tokenizer)))


# --- out: an attnmt model as a MarianMTModel directory (`attnmt export --format huggingface`) ---


def export_huggingface(
    model_dir: Path, out: Path, weights: str = "best", force: bool = False, onnx: bool = False
) -> int:
    """Write the MarianMTModel directory `out` (config.json, model.safetensors, source.spm,
    target.spm, vocab.json) for the attnmt model in `model_dir`, which must be a post-norm
    Transformer with Marian's position table and one SentencePiece model (what MarianMTModel
    expresses); returns the parameter count. The ids stay attnmt's: vocab.json maps each piece
    to its attnmt id, pad 0, the decoder starting from BOS (2), </s> 3. `onnx`: also the ONNX
    files, tokenizer.json and generation_config.json that Optimum and transformers.js load
    (interop.hf_onnx)."""
    from safetensors.torch import save_file

    from attnmt.models.directory import load_model_dir

    check_export_path(model_dir, out, force)  # before any work; never onto the model itself
    if weights == "best" and not (model_dir / BEST_FILE).is_file():
        print(
            f"attnmt: note: {model_dir} has no {BEST_FILE} yet; exporting {LAST_FILE}",
            file=sys.stderr,
        )
    cfg, tokenizer, model = load_model_dir(model_dir, weights)
    m = cfg.model
    why = (
        "a GRU model" if m.arch != "transformer" else
        "an SSRU decoder (model.decoder ssru; MarianMTModel has self-attention)"
        if m.decoder != "attention" else
        "pre-norm (MarianMTModel is post-norm)" if m.norm != "post" else
        f"model.positions {m.positions} (MarianMTModel computes the halves table)"
        if m.positions != "halves" else
        "two SentencePiece models (MarianMTModel here takes one vocabulary)" if not tokenizer.joint
        else None
    )  # fmt: skip
    if why is not None:
        raise CheckpointError(f"{model_dir}: cannot be a MarianMTModel: {why}")
    V, positions = len(tokenizer.tgt), max(cfg.decode.max_output_len, cfg.decode.max_src_len) + 2
    state = hf_state(model, m, positions)
    hf_config = {
        "model_type": "marian", "architectures": ["MarianMTModel"], "vocab_size": V,
        "d_model": m.hidden_size, "encoder_layers": m.enc_layers, "decoder_layers": m.dec_layers,
        "encoder_attention_heads": m.heads, "decoder_attention_heads": m.heads,
        "encoder_ffn_dim": m.ff_size, "decoder_ffn_dim": m.ff_size,
        "activation_function": m.activation, "max_position_embeddings": positions,
        "scale_embedding": True, "pad_token_id": PAD_ID, "eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID, "forced_eos_token_id": EOS_ID,
        "bad_words_ids": [[PAD_ID], [BOS_ID]], "num_beams": cfg.decode.beam,
        "max_length": positions - 2, "dropout": m.dropout, "attention_dropout": m.attention_dropout,
        "share_encoder_decoder_embeddings": m.tie_embeddings, "is_encoder_decoder": True,
        "tie_word_embeddings": m.tie_embeddings,
    }  # fmt: skip
    vocab = {tokenizer.tgt.sp.id_to_piece(i): i for i in range(V)}
    with atomic_directory(out, "the export") as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        for name in ("source.spm", "target.spm"):
            (tmp / name).write_bytes(tokenizer.src.proto)
        if onnx:
            from attnmt.interop.hf_onnx import write_hf_onnx

            write_hf_onnx(model, tokenizer, tmp, cfg.decode.beam)
    return sum(p.numel() for p in model.parameters())


def hf_state(model: Any, m: ModelConfig, positions: int) -> dict[str, torch.Tensor]:
    """transformers' state dict of an attnmt Transformer (attnmt_state's inverse, ids kept)."""
    sd = model.state_dict()
    table = sinusoid_table(positions, m.hidden_size, layout="halves")
    bias = sd.get("output.bias", torch.zeros(sd["output.weight"].size(0)))
    state = {
        "model.shared.weight": sd["tgt_embed.embed.weight"],
        "model.encoder.embed_tokens.weight": sd["src_embed.embed.weight"],
        "model.decoder.embed_tokens.weight": sd["tgt_embed.embed.weight"],
        "lm_head.weight": sd["output.weight"], "final_logits_bias": bias.reshape(1, -1),
        "model.encoder.embed_positions.weight": table,
        "model.decoder.embed_positions.weight": table,
    }  # fmt: skip
    state |= {theirs: sd[ours] for theirs, ours in layer_names(m)}
    # safetensors stores each tensor once: tied ones become copies (transformers ties them).
    return {k: v.detach().float().clone().contiguous() for k, v in state.items()}
