"""attnmt export --format onnx: onnxruntime's greedy output equals attnmt's, for every
architecture (pre- and post-norm Transformers, rotary positions, an SSRU decoder, the GRU
model); int8 exports report their agreement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnmt import Translator
from attnmt.data.tokenizer import EOS_ID
from attnmt.interop.onnx import MANIFEST, OnnxModel

from helpers import train_tiny

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
onnx = pytest.importorskip("onnx")

ARCHS = {
    "post-norm, untied, two vocabularies": dict(norm="post", tie_embeddings=False, joint=False),
    "rotary positions": dict(positions="rope"),
    "ssru decoder": dict(decoder="ssru"),
    "gru": dict(arch="rnn"),
}


def onnx_greedy(folder: Path, ours: Translator, lines: list[str]) -> list[str]:
    """The export's greedy output for the lines in one batch (rows leave as they finish)."""
    src = [[*ids, EOS_ID] for ids in ours.tokenizer.src.encode(lines)]
    return [ours.tokenizer.tgt.decode(ids) for ids in OnnxModel(folder).greedy(src)]


def test_onnx_greedy_equals_ours_pre_norm(tmp_path: Path, trained, run_cli):
    model, corpus = trained
    result = run_cli("export", str(model), str(tmp_path / "onnx"), "--format", "onnx")
    assert result.code == 0, result.stderr
    out = tmp_path / "onnx"
    assert {"encoder.onnx", "decoder.onnx", MANIFEST, "spm.model", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    dev = corpus["dev_src"]
    assert f"(greedy, 20 sentences of {dev}): 20/20 identical" in result.stdout
    lines = dev.read_text().splitlines()
    ours = Translator.load(model)
    assert onnx_greedy(out, ours, lines) == ours.translate(lines, beam=1)


@pytest.mark.parametrize("name", list(ARCHS))
def test_onnx_greedy_equals_ours(tmp_path: Path, corpus, run_cli, name: str):
    model = train_tiny(tmp_path, corpus, **ARCHS[name])
    out = tmp_path / "onnx"
    result = run_cli("export", str(model), str(out), "--format", "onnx")
    assert result.code == 0, result.stderr
    assert "20/20 identical" in result.stdout
    lines = corpus["dev_src"].read_text().splitlines()
    ours = Translator.load(model)
    assert onnx_greedy(out, ours, lines) == ours.translate(lines, beam=1)
    state = json.loads((out / MANIFEST).read_text())["state"]
    assert state and all(s["name"] for s in state)


def test_onnx_int8_multiplies_in_int8_and_reports_agreement(tmp_path: Path, trained, run_cli):
    model, _ = trained
    plain, int8 = tmp_path / "fp32", tmp_path / "int8"
    assert run_cli("export", str(model), str(plain), "--format", "onnx").code == 0
    result = run_cli("export", str(model), str(int8), "--format", "onnx", "--quantization", "int8")
    assert result.code == 0, result.stderr
    assert "agreement with attnmt" in result.stdout
    assert json.loads((int8 / MANIFEST).read_text())["quantization"] == "int8"
    ops = {node.op_type for node in onnx.load(str(int8 / "decoder.onnx")).graph.node}
    assert "MatMulInteger" in ops  # int8 weights, activations quantized as they come
    assert "MatMulInteger" not in {
        n.op_type for n in onnx.load(str(plain / "decoder.onnx")).graph.node
    }


def test_onnx_refuses_other_quantizations(tmp_path: Path, trained, run_cli):
    model, _ = trained
    result = run_cli(
        "export", str(model), str(tmp_path / "o"), "--format", "onnx", "--quantization", "int16"
    )
    assert result.code == 2
    assert "expected int8" in result.stderr
    assert not (tmp_path / "o").exists()
