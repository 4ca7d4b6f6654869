"""Native Marian models in: a `model.npz` as Marian C++ writes it (OPUS-MT's original releases,
Firefox's Bergamot models, any `marian` training run) becomes an attnmt model directory
(`attnmt import --format marian`).

What such a model is: the arrays of model.npz, named `encoder_l1_self_Wq` and so on, stored
(in, out) where torch's Linear is (out, in); its options in the array `special:model.yml`;
vocabularies named by the decoder config (decoder.yml: `models`, `vocabs`) as a YAML map
(piece: id), a text file (id = line), or a SentencePiece model (its own ids); `</s>` and
`<unk>` pieces, no padding id, and a decoder that starts from an all-zero embedding. A
Transformer's blocks are pre-norm (`transformer-preprocess: n`, `postprocess: da`, a final
LayerNorm per stack, `postprocess-top: n`) or post-norm (`postprocess: dan`); positions are
Marian's own sinusoid table (model.positions marian); the output layer has a bias unless
`output-omit-bias`. What attnmt cannot express is refused in one line naming the option.
"""

from __future__ import annotations

import itertools
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnmt.config import Config, ModelConfig, from_dict
from attnmt.data.files import check_export_path
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from attnmt.errors import CheckpointError
from attnmt.interop.huggingface import Imported, model_rows, write_imported
from attnmt.interop.untrusted import (
    check_fits,
    check_rows,
    check_size,
    check_state,
    expected_state,
    read_npz,
    read_text,
    short,
    validated_model,
    vocab_ids,
    yaml_value,
)
from attnmt.models.build import build_model

ACTIVATIONS = ("relu", "swish", "gelu")
# Marian's block names -> attnmt's, per encoder and decoder layer (the norm's name after it).
BLOCKS = {
    "encoder": (("self", "self_attn", "res_attn"), ("ffn", "ff", "res_ff")),
    "decoder": (
        ("self", "self_attn", "res_self"), ("context", "cross_attn", "res_cross"),
        ("ffn", "ff", "res_ff"),
    ),
}  # fmt: skip


# (Marian's weight, its bias, attnmt's projection) of an attention block and a feed-forward one.
PROJECTIONS = {
    "attention": (("Wq", "bq", "q_proj"), ("Wk", "bk", "k_proj"), ("Wv", "bv", "v_proj"),
                  ("Wo", "bo", "out_proj")),
    "ffn": (("W1", "b1", "w_1"), ("W2", "b2", "w_2")),
}  # fmt: skip


@dataclass
class NativeFiles:
    npz: Path
    vocabs: tuple[Path, Path]  # source, target
    spm: tuple[Path, Path]  # the SentencePiece models that make the vocabularies' pieces
    beam: int
    length_factor: float  # Marian's --max-length-factor: outputs up to ceil(factor * source)


def import_marian(source: Path, out: Path, force: bool = False, spm: list[Path] = ()) -> Imported:
    """Write the attnmt model directory `out` from the Marian model `source` (a directory
    with decoder.yml, a decoder.yml, or a model.npz with `<npz>.decoder.yml` beside it).
    Every file is untrusted (attnmt.interop.untrusted): the model's options are read first,
    and every array's name and size checked against them before any array is read."""
    files = native_files(source, list(spm))
    check_export_path(source, out, force)
    options = model_options(files.npz)
    cfg_model = native_config(options, files.npz)
    expected = expected_state(cfg_model, 8, 8, False)
    check_fits(expected, files.npz, 2)
    arrays = read_npz(files.npz, _known_arrays(cfg_model))
    arrays.pop("special:model.yml")
    joint = files.spm[0] == files.spm[1] and bool(options.get("tied-embeddings-all"))
    for path in set(files.spm):
        check_size(path, "a SentencePiece model")  # before SentencePiece reads it
    tokenizer = Tokenizer.from_files([files.spm[0]] if joint else list(files.spm))
    rows = []
    for side, path in zip((tokenizer.src, tokenizer.tgt), files.vocabs, strict=True):
        vocab = read_vocab(path)
        for piece in ("</s>", "<unk>"):
            if piece not in vocab:
                raise CheckpointError(f"{path}: no {piece} (a Marian vocabulary has it)")
        eos = vocab["</s>"]  # padding and the start token take a row; see native_state
        special = {PAD_ID: eos, BOS_ID: eos, EOS_ID: eos, UNK_ID: vocab["<unk>"]}
        rows.append(model_rows(side, vocab, special))
    _check_rows(arrays, rows[0][0] + rows[1][0], files.npz)
    state = native_state(arrays, options, cfg_model, rows[0][0], rows[1][0], files.npz)
    check_state(
        state, expected_state(cfg_model, len(rows[0][0]), len(rows[1][0]), joint), files.npz
    )
    model = build_model(cfg_model, len(tokenizer.src), len(tokenizer.tgt), joint)
    model.load_state_dict(state, strict=True)
    write_imported(out, config(cfg_model, files, out, joint), tokenizer, model, source, "marian")
    return Imported(
        sum(p.numel() for p in model.parameters()), len(tokenizer.src), len(tokenizer.tgt),
        rows[0][1] + rows[1][1], [],
    )  # fmt: skip


def native_files(source: Path, spm: list[Path]) -> NativeFiles:
    """The model, vocabularies and SentencePiece models of a Marian model, from its decoder
    config; relative paths are taken from the config's folder, then the current one."""
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or directory")
    if source.is_dir():
        found = sorted(source.glob("decoder.yml")) or sorted(source.glob("*.decoder.yml"))
        if not found:
            raise CheckpointError(f"{source}: no decoder.yml (a Marian model directory has it)")
        decoder = found[0]
    elif source.suffix == ".npz":
        decoder = source.with_name(source.name + ".decoder.yml")
    else:
        decoder = source
    if not decoder.is_file():
        raise CheckpointError(f"{source}: no decoder config {decoder}")
    conf = yaml_value(read_text(decoder, "a Marian decoder config", 1 << 20), str(decoder)) or {}
    if not isinstance(conf, dict):
        raise CheckpointError(f"{decoder}: expected a mapping (Marian's decoder.yml)")
    for key, least in (("models", 1), ("vocabs", 2)):
        given = conf.get(key)
        if (
            not isinstance(given, list)
            or len(given) < least
            or not all(isinstance(x, str) for x in given)
        ):
            raise CheckpointError(
                f"{decoder}: {key}: {short(given)}; expected a list of {least} or more file names"
            )
    if len(conf["models"]) > 1:
        raise CheckpointError(f"{decoder}: {len(conf['models'])} models (an ensemble): import each")

    def where(name: str) -> Path:
        for base in (decoder.parent, Path.cwd()):
            if (base / name).is_file():
                return base / name
        raise CheckpointError(f"{decoder}: {short(name)} not found beside it")

    npz = source if source.suffix == ".npz" else where(conf["models"][0])
    vocabs = (where(conf["vocabs"][0]), where(conf["vocabs"][-1]))
    factor, beam = conf.get("max-length-factor", 3), conf.get("beam-size", 5)  # Marian's defaults
    if type(factor) not in (int, float) or not 0 < factor <= 10:
        raise CheckpointError(f"{decoder}: max-length-factor {short(factor)} is not in (0, 10]")
    if type(beam) is not int or not 1 <= beam <= 100:
        raise CheckpointError(f"{decoder}: beam-size {short(beam)} is not a beam from 1 to 100")
    return NativeFiles(npz, vocabs, spm_models(vocabs, decoder.parent, spm), beam, float(factor))


def spm_models(vocabs: tuple[Path, Path], folder: Path, given: list[Path]) -> tuple[Path, Path]:
    """The SentencePiece models: --spm (once: both sides), the vocabularies themselves when
    they are SentencePiece models, or source.spm and target.spm beside the config."""
    if given:
        if len(given) > 2:
            raise CheckpointError(f"--spm given {len(given)} times: once, or source then target")
        return given[0], given[-1]
    if all(v.suffix == ".spm" for v in vocabs):
        return vocabs
    beside = folder / "source.spm", folder / "target.spm"
    if all(p.is_file() for p in beside):
        return beside
    raise CheckpointError(
        f"{vocabs[0]}: not a SentencePiece model, and no source.spm and target.spm beside the "
        "decoder config: give the SentencePiece model(s) of its pieces with --spm"
    )


def model_options(npz: Path) -> dict[str, Any]:
    """The options Marian stores in the model (special:model.yml, a NUL-terminated YAML
    text), read alone before any array."""
    try:
        with zipfile.ZipFile(npz) as z:
            info = z.getinfo("special:model.yml.npy")
            if info.file_size > 1 << 20:
                raise CheckpointError(
                    f"{npz}: special:model.yml of {info.file_size:,} bytes; refused"
                )
            with z.open(info) as f:
                stored = np.lib.format.read_array(f, allow_pickle=False)
    except KeyError:
        raise CheckpointError(f"{npz}: no special:model.yml (not a Marian model)") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{npz}: not a Marian model.npz ({str(e)[:200]})") from None
    try:
        text = stored.tobytes().decode("utf-8").rstrip("\x00")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{npz}: special:model.yml is not text ({e.reason})") from None
    found = yaml_value(text, f"{npz}: special:model.yml")
    if not isinstance(found, dict):
        raise CheckpointError(f"{npz}: special:model.yml holds no options")
    return found


def _known_arrays(cfg: ModelConfig) -> Any:
    """Whether a name is one of the arrays a Marian model of this config may hold."""
    names = {"special:model.yml", "Wemb", "encoder_Wemb", "decoder_Wemb",
             "decoder_ff_logit_out_W", "decoder_ff_logit_out_b"}  # fmt: skip
    names |= {f"{s}_top_ln_{k}" for s in ("encoder", "decoder") for k in ("scale", "bias")}

    def take(name: str) -> torch.Tensor:
        names.add(name)
        return torch.zeros(1, 1)

    layer_state(take, cfg)
    return names.__contains__


def _check_rows(arrays: dict[str, np.ndarray], rows: list[int], where: Path) -> None:
    """Every id the vocabularies name must be a row of the embeddings."""
    embeddings = [arrays[n] for n in ("Wemb", "encoder_Wemb", "decoder_Wemb") if n in arrays]
    if not embeddings:
        raise CheckpointError(f"{where}: no embeddings (Wemb, or encoder_Wemb and decoder_Wemb)")
    check_rows(rows, min(e.shape[0] if e.ndim else 0 for e in embeddings), where)


def read_vocab(path: Path) -> dict[str, int]:
    """piece -> id of a Marian vocabulary: .yml/.yaml (a map), .spm (SentencePiece's own
    ids) or text (one piece per line; the line's first field)."""
    if path.suffix == ".spm":
        import sentencepiece as spm

        check_size(path, "a SentencePiece vocabulary")  # before SentencePiece reads it
        sp = spm.SentencePieceProcessor(model_file=str(path))
        return {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    text = read_text(path, "a Marian vocabulary")
    if path.suffix in (".yml", ".yaml", ".json"):
        return vocab_ids(yaml_value(text, str(path)), path)
    return {
        line.split()[0] if line.split() else line: i for i, line in enumerate(text.splitlines())
    }


def native_config(o: dict[str, Any], where: Path) -> ModelConfig:
    """The attnmt model section of a Marian model's options, or CheckpointError naming the
    option attnmt's Transformer cannot express."""

    def refuse(option: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {option} = {o.get(option)!r}: {why}")

    if o.get("type") != "transformer":
        raise refuse("type", "attnmt imports Marian Transformers only")
    if o.get("transformer-decoder-autoreg", "self-attention") != "self-attention":
        raise refuse("transformer-decoder-autoreg", "attnmt's decoder has self-attention only")
    for option, expected in (
        ("transformer-ffn-depth", 2), ("transformer-postprocess-emb", "d"),
        ("transformer-tied-layers", []), ("transformer-no-bias", False),
        ("transformer-train-position-embeddings", False), ("transformer-alibi-shift", False),
        ("transformer-disable-position-embeddings", False), ("factors-dim-emb", 0),
    ):  # fmt: skip
        if o.get(option, expected) not in (expected, None):
            raise refuse(option, f"attnmt expresses {expected!r} only")
    for option in ("transformer-decoder-dim-ffn", "transformer-decoder-ffn-depth"):
        if o.get(option, 0) not in (0, o.get(option.replace("decoder-", ""))):
            raise refuse(option, "attnmt has one feed-forward layer shape for both stacks")
    if o.get("transformer-ffn-activation", "swish") not in ACTIVATIONS:
        raise refuse("transformer-ffn-activation", f"attnmt has {', '.join(ACTIVATIONS)}")
    blocks = (o.get("transformer-preprocess", ""), o.get("transformer-postprocess", "dan"),
              o.get("transformer-postprocess-top", ""))  # fmt: skip
    norms = {("n", "da", "n"): "pre", ("", "dan", ""): "post"}
    if blocks not in norms:
        raise refuse("transformer-preprocess", f"pre/post/top {blocks}: attnmt has pre-norm "
                      "(n, da, n) and post-norm ('', dan, '')")  # fmt: skip

    def whole(option: str) -> int:
        if type(o.get(option)) is not int:
            raise refuse(option, "expected a whole number")
        return o[option]

    d = whole("dim-emb")
    return validated_model(
        where, "the model's options", arch="transformer", emb_size=d, hidden_size=d,
        heads=whole("transformer-heads"), ff_size=whole("transformer-dim-ffn"),
        enc_layers=whole("enc-depth"), dec_layers=whole("dec-depth"), dropout=0.1,
        attention_dropout=0.1, norm=norms[blocks],
        activation=o.get("transformer-ffn-activation", "swish"), positions="marian",
        output_bias=not o.get("output-omit-bias", False),
        tie_embeddings=bool(o.get("tied-embeddings") or o.get("tied-embeddings-all")),
    )  # fmt: skip


def native_state(
    arrays: dict[str, np.ndarray],
    o: dict[str, Any],
    cfg: ModelConfig,
    src_rows: list[int],
    tgt_rows: list[int],
    where: Path,
) -> dict[str, torch.Tensor]:
    """attnmt's state dict from Marian's arrays (names mapped, matrices transposed,
    vocabulary rows reordered). Marian's decoder starts from a zero embedding: attnmt's start
    token (BOS) gets a zero row; it and padding get an output bias of -100, so that neither
    takes probability mass (search never picks them)."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in arrays:
            raise CheckpointError(f"{where}: no array {name}")
        used.add(name)
        return torch.from_numpy(np.ascontiguousarray(arrays[name])).float()

    shared = "Wemb" if "Wemb" in arrays else None
    src_emb = take(shared or "encoder_Wemb")[src_rows]
    tgt_emb = take(shared or "decoder_Wemb")[tgt_rows].clone()
    tgt_emb[BOS_ID] = 0.0
    out_w = tgt_emb if cfg.tie_embeddings else take("decoder_ff_logit_out_W").t()[tgt_rows]
    state = {"src_embed.embed.weight": src_emb, "tgt_embed.embed.weight": tgt_emb,
             "output.weight": out_w}  # fmt: skip
    if cfg.output_bias:
        bias = take("decoder_ff_logit_out_b").reshape(-1)[tgt_rows].clone()
        bias[BOS_ID] = bias[PAD_ID] = -100.0
        state["output.bias"] = bias
    state |= layer_state(take, cfg)
    if cfg.norm == "pre":
        for stack, ours in (("encoder", "enc_norm"), ("decoder", "dec_norm")):
            state[f"{ours}.weight"] = take(f"{stack}_top_ln_scale").reshape(-1)
            state[f"{ours}.bias"] = take(f"{stack}_top_ln_bias").reshape(-1)
    extra = sorted(set(arrays) - used)
    if extra:
        raise CheckpointError(
            f"{where}: {extra[0]} (and {len(extra) - 1} more) has no place in attnmt's "
            "Transformer; refused rather than dropped"
        )
    return {k: v.contiguous() for k, v in state.items()}


def layer_state(take: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every encoder and decoder layer's tensors, `take(marian_name)` reading each once."""
    state = {}
    pre = "_pre" if cfg.norm == "pre" else ""
    for stack, n in (("encoder", cfg.enc_layers), ("decoder", cfg.dec_layers)):
        for i, (theirs, ours, norm) in itertools.product(range(n), BLOCKS[stack]):
            at, to = f"{stack}_l{i + 1}_{theirs}", f"{stack}_layers.{i}"
            for w, b, name in PROJECTIONS["ffn" if theirs == "ffn" else "attention"]:
                state[f"{to}.{ours}.{name}.weight"] = take(f"{at}_{w}").t()
                state[f"{to}.{ours}.{name}.bias"] = take(f"{at}_{b}").reshape(-1)
            ln = f"{at}_ffn_ln" if theirs == "ffn" else f"{at}_Wo_ln"
            state[f"{to}.{norm}.norm.weight"] = take(f"{ln}_scale{pre}").reshape(-1)
            state[f"{to}.{norm}.norm.bias"] = take(f"{ln}_bias{pre}").reshape(-1)
    return state


def config(cfg_model: ModelConfig, files: NativeFiles, out: Path, joint: bool) -> Config:
    """The model directory's config: the imported model, its tokenizer files (the directory's
    own, conformed), the beam and Marian's output limit (ceil(max-length-factor x source
    pieces with EOS)) from the decoder config; no data paths (the
    source's corpora are not part of it)."""
    target = out.resolve()
    names = [Tokenizer.JOINT_FILE] if joint else [Tokenizer.SRC_FILE, Tokenizer.TGT_FILE]
    keys = ["model"] if joint else ["src_model", "tgt_model"]
    raw: dict[str, Any] = {
        "data": {},  # no corpus: its training data is not part of the model
        "tokenizer": {
            "joint": joint,
            **{k: str(target / n) for k, n in zip(keys, names, strict=True)},
        },
        "model": cfg_model.model_dump(mode="json"),
        "decode": {
            "beam": files.beam,
            "max_len_a": files.length_factor,
            "max_len_b": 0,
            "max_len_round": "ceil",
            "allow_unk": False,  # marian-decoder's default (--allow-unk off)
        },
    }
    return from_dict(raw)
