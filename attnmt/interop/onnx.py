"""Export any attnmt model to ONNX (https://onnx.ai), and run the export with onnxruntime.

The folder holds `encoder.onnx` and `decoder.onnx` (interop.onnx_graphs: one decoder step,
its state explicit input and output, batch and lengths dynamic), `attnmt-onnx.json` (what a
runtime needs to search: input and output names, how each state tensor starts, the special
ids, the output limit, the length penalty, language tags) and the tokenizer: the
SentencePiece model(s) and `tokenizer.json` (their pieces and scores, for a runtime without
SentencePiece: the browser page, interop.web), and the page's search and tokenizer as a
JavaScript module for Node (search.js, tokenizer.js, package.json; onnxruntime-node). int8
(`--quantization int8`): onnxruntime's dynamic quantization, int8 weights of every MatMul with
per-row scales, activations quantized at run time (MatMulInteger), the same scheme as
attnmt's own int8.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnmt.config import Config
from attnmt.data.files import atomic_directory, check_export_path
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, language_tag
from attnmt.decoding.beam import LOOKAHEAD
from attnmt.decoding.options import exported, not_exported
from attnmt.decoding.search import never_output, search_options
from attnmt.decoding.shortlist import SHORTLIST_FILE, load_shortlist
from attnmt.errors import AttnmtError
from attnmt.interop.onnx_graphs import MAX_POSITIONS, Graphs, model_graphs
from attnmt.interop.tokenizer_json import tokenizer_json
from attnmt.models.directory import load_model_dir
from attnmt.models.seq2seq import Seq2Seq
from attnmt.models.transformer import TransformerSeq2Seq

MANIFEST = "attnmt-onnx.json"
SHORTLIST_BIN = "shortlist.bin"  # int32 (source vocabulary, k), -1 padding: decoding.shortlist
QUANTIZATIONS = ("int8",)
OPSET = 18
# The page's search and tokenizer (interop/web/), which Node loads as a CommonJS module too.
JS_FOLDER = Path(__file__).parent / "web"
JS_MODULE = ("search.js", "tokenizer.js", "constraints.js")
NODE_RUNTIME = "onnxruntime-node"
NODE_RUNTIME_VERSION = "1.30.0"  # tested (scripts/get_onnxruntime_node.sh)


def export_onnx(
    model_dir: Path,
    out: Path,
    weights: str = "best",
    quantization: str | None = None,
    force: bool = False,
) -> list[str]:
    """Write model_dir's model (its `weights`) as ONNX graphs with their manifest and
    tokenizer into `out` (whole or not at all); returns the files written."""
    check_onnx_export(model_dir, out, quantization, force)
    with atomic_directory(out, "the export") as tmp:
        write_onnx(model_dir, tmp, weights, quantization)
        write_js_module(tmp)
    return sorted(p.name for p in out.iterdir())


def write_js_module(folder: Path) -> None:
    """search.js and tokenizer.js, with a package.json that makes the folder a CommonJS
    package: `require("./FOLDER").load("FOLDER")` in Node, with onnxruntime-node installed."""
    for name in JS_MODULE:
        shutil.copyfile(JS_FOLDER / name, folder / name)
    package = {
        "name": "attnmt-onnx-model",
        "private": True,
        "description": "An attnmt model exported to ONNX, with its search (greedy, beam)",
        "type": "commonjs",
        "main": "search.js",
        "dependencies": {NODE_RUNTIME: f"^{NODE_RUNTIME_VERSION}"},
    }
    (folder / "package.json").write_text(json.dumps(package, indent=2) + "\n")


def check_onnx_export(model_dir: Path, out: Path, quantization: str | None, force: bool) -> None:
    """Refuse, before any work, what the export cannot do."""
    import_onnx()
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise AttnmtError(f"--quantization {quantization!r}: expected int8 for --format onnx")
    check_export_path(model_dir, out, force)


def write_onnx(
    model_dir: Path, folder: Path, weights: str, quantization: str | None, spm: bool = True
) -> None:
    """The graphs, the tokenizer files (`spm`: the SentencePiece models too, beside their
    JSON form) and the manifest, into `folder`."""
    cfg, tokenizer, net = load_model_dir(model_dir, weights, "cpu")
    shortlist = None
    if (model_dir / SHORTLIST_FILE).is_file() and isinstance(net, TransformerSeq2Seq):
        shortlist = load_shortlist(model_dir, tokenizer)
        (folder / SHORTLIST_BIN).write_bytes(shortlist.table.to(torch.int32).numpy().tobytes())
    graphs = model_graphs(net, shortlist is not None)
    write_graphs(graphs, folder, quantization)
    for name, data in tokenizer.files().items() if spm else ():
        (folder / name).write_bytes(data)
    pieces = tokenizer_json(tokenizer.src.proto, tokenizer.src.reserved)
    (folder / "tokenizer.json").write_text(json.dumps(pieces, ensure_ascii=False))
    if not cfg.tokenizer.joint:
        tgt = tokenizer_json(tokenizer.tgt.proto, tokenizer.tgt.reserved)
        (folder / "tokenizer.tgt.json").write_text(json.dumps(tgt, ensure_ascii=False))
    info = manifest(cfg, tokenizer, net, graphs, quantization)
    if shortlist is not None:
        info["shortlist"] = {
            "file": SHORTLIST_BIN, "k": shortlist.table.size(1),
            "frequent": shortlist.frequent.tolist(), "always": [EOS_ID, UNK_ID],
        }  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")


def manifest(
    cfg: Config, tokenizer: Tokenizer, net: Seq2Seq, graphs: Graphs, quantization: str | None
) -> dict[str, Any]:
    """What a runtime needs besides the graphs to search as attnmt does (greedy, or beam with
    the model's length penalty and stopping rule)."""
    options = search_options(cfg.decode)
    tags = {}
    if cfg.data.multilingual:
        tags = {
            lang: tokenizer.src.sp.piece_to_id(language_tag(lang)) for lang in cfg.data.target_langs
        }
    return {
        "format_version": 1,
        "arch": cfg.model.arch,
        "languages": dict(zip(("source", "target"), cfg.data.languages, strict=True)),
        "quantization": quantization or "float32",
        "encoder": {"inputs": ["src"], "outputs": encoder_outputs(graphs)},
        "decoder": {"inputs": decoder_inputs(graphs), "outputs": decoder_outputs(graphs)},
        "memory": graphs.memory,
        "state": [{"name": s.name, "init": s.init, "shape": list(s.shape)} for s in graphs.state],
        "max_positions": MAX_POSITIONS if graphs.position else None,
        "shortlist": None,
        "ids": {
            "pad": PAD_ID,
            "bos": BOS_ID,
            "eos": EOS_ID,
            "never_output": never_output(net, options),
        },
        "output_limit": {
            "a": options.max_len_a,
            "b": options.max_len_b,
            "round": options.max_len_round,
            "max": min(options.max_output_len, MAX_POSITIONS)
            if graphs.position
            else options.max_output_len,
        },
        "max_src_len": min(options.max_src_len, MAX_POSITIONS)
        if graphs.position
        else options.max_src_len,
        "beam_size": cfg.decode.beam,
        "length_penalty": cfg.decode.length_penalty,
        "length_norm": cfg.decode.length_norm,  # "gnmt" or "length" (search.length_penalty)
        "lookahead": LOOKAHEAD,  # "length": where a beam search stops (BeamPool)
        "options": manifest_options(cfg),
        "not_supported": not_exported(),
        "target_tags": tags,
        "tokenizer": {
            "source": "tokenizer.json",
            "target": "tokenizer.json" if cfg.tokenizer.joint else "tokenizer.tgt.json",
        },
    }


def manifest_options(cfg: Config) -> dict[str, dict[str, Any]]:
    """The decoding options an export's search honours (attnmt.decoding.options): each
    with the model's value as its default, and its bounds or choices."""
    found = {}
    for name, option in exported().items():
        default = getattr(cfg.decode, name) if option.default is None else option.default
        bounds = {"choices": list(option.choices)} if option.choices else {
            "min": option.low, "max": option.high}  # fmt: skip
        found[name] = {"default": default, **bounds}
    return found


def encoder_outputs(graphs: Graphs) -> list[str]:
    return graphs.memory + [s.name for s in graphs.state if s.init == "encoder"]


def decoder_inputs(graphs: Graphs) -> list[str]:
    position = ["position"] if graphs.position else []
    rows = ["rows"] if graphs.shortlist else []
    return ["tokens", *position, *rows, *graphs.memory, *(s.name for s in graphs.state)]


def decoder_outputs(graphs: Graphs) -> list[str]:
    return ["log_probs", *(f"new_{s.name}" for s in graphs.state)]


def write_graphs(graphs: Graphs, folder: Path, quantization: str | None) -> None:
    """encoder.onnx and decoder.onnx traced on a small example with batch, source length,
    decoded positions (and shortlist size) dynamic (int8: quantized after the export)."""
    B, S, t = 2, 5, 3  # not 0 or 1: torch.export would fix such sizes as constants
    src = torch.full((B, S), 4, dtype=torch.long)
    dims = {n: torch.export.Dim(n) for n in ("batch", "src_len", "cache", "outputs")}
    outputs = encoder_outputs(graphs)
    with torch.no_grad():
        encoded = dict(zip(outputs, graphs.encoder(src), strict=True))
    shape = ({0: dims["batch"], 1: dims["src_len"]},)
    export_graph(graphs.encoder, (src,), shape, ["src"], outputs, folder / "encoder.onnx")
    inputs, shapes = decoder_examples(graphs, encoded, B, t, dims)
    names = decoder_inputs(graphs)
    args = tuple(inputs[n] for n in names)
    # tokens, position, (rows,) src_mask, then *tensors
    fixed = (4 if graphs.shortlist else 3) if graphs.position else 0
    dyn: tuple[Any, ...] = tuple(shapes[n] for n in names)
    if fixed:
        dyn = (*dyn[:fixed], dyn[fixed:])
    export_graph(graphs.decoder, args, dyn, names, decoder_outputs(graphs), folder / "decoder.onnx")
    if quantization == "int8":
        for name in ("encoder.onnx", "decoder.onnx"):
            quantize_int8(folder / name)


def decoder_examples(
    graphs: Graphs, encoded: dict[str, torch.Tensor], B: int, t: int, dims: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, Any]]]:
    """The decoder's example inputs (t positions decoded) and their dynamic axes, by name."""
    batch, src_len, cache = dims["batch"], dims["src_len"], dims["cache"]
    inputs = {
        "tokens": torch.full((B,), 4),
        "position": torch.full((B,), t),
        "rows": torch.arange(7),
    }
    shapes = {"tokens": {0: batch}, "position": {0: batch}, "rows": {0: dims["outputs"]}}
    for name in graphs.memory:
        inputs[name] = encoded[name]
        axis = {"src_mask": 3, "pad_mask": 1}.get(name, encoded[name].dim() - 2)
        shapes[name] = {0: batch, axis: src_len}
    for s in graphs.state:
        if s.init == "encoder":
            inputs[s.name], shapes[s.name] = encoded[s.name], {0: batch}
        else:
            inputs[s.name] = torch.zeros(B, *(d or t for d in s.shape))
            shapes[s.name] = {0: batch, **({1 + s.shape.index(0): cache} if 0 in s.shape else {})}
    return inputs, shapes


def export_graph(
    module: torch.nn.Module,
    args: tuple,
    shapes: tuple,
    inputs: list[str],
    outputs: list[str],
    path: Path,
) -> None:
    """module traced on args with dynamic axes `shapes` into the ONNX file `path`, its inputs
    and outputs named."""
    import onnx

    with torch.no_grad(), _quiet():
        torch.onnx.export(
            module, args, str(path), input_names=inputs, output_names=outputs,
            dynamic_shapes=shapes, dynamo=True, opset_version=OPSET, verbose=False,
            external_data=False,
        )  # fmt: skip
    model = onnx.load(str(path))
    # The exporter can fix a length that is dynamic (a GRU's: the example's source length in
    # its outputs and the values between its nodes, which onnxruntime then warned about at
    # every other length): leave the outputs open, and the values to onnxruntime's inference.
    for value in model.graph.output:
        value.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    onnx.save(model, str(path))


def quantize_int8(path: Path) -> None:
    """path's MatMul weights as int8, per output row (onnxruntime's dynamic quantization)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp, _quiet():
        done = Path(tmp) / path.name
        quantize_dynamic(str(path), str(done), weight_type=QuantType.QInt8, per_channel=True)
        os.replace(done, path)


class _quiet:
    """torch.onnx's progress lines and warnings out of the user's terminal."""

    def __enter__(self) -> None:
        import logging
        import warnings

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._levels = [(log, log.level) for log in map(logging.getLogger, ("torch", None))]
        for log, _ in self._levels:  # onnxruntime's quantizer warns on the root logger
            log.setLevel(logging.ERROR)
        self._stdout = os.dup(1)
        self._null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(self._null, 1)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._stdout, 1)
        os.close(self._stdout)
        os.close(self._null)
        for log, level in self._levels:
            log.setLevel(level)
        self._warnings.__exit__(*exc)


def import_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        raise AttnmtError(
            "--format onnx needs onnx, onnxscript and onnxruntime: "
            "pip install torch==2.13.0 'attnmt[onnx]'"
        ) from None
