"""attnmt export --format onnx: onnxruntime's greedy output equals attnmt's, for every
architecture (pre- and post-norm Transformers, rotary positions, an SSRU decoder, the GRU
model); int8 exports report their agreement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnmt import Translator
from attnmt.data.tokenizer import EOS_ID
from attnmt.interop.onnx import MANIFEST
from attnmt.interop.onnx_run import OnnxModel

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


def test_export_force_onto_a_symbolic_link_is_refused_before_any_work(tmp_path, trained, run_cli):
    """Issue 77 (also seen): `export --force` onto a symlinked folder made the whole export,
    then failed to remove the link."""
    model, _ = trained
    target = tmp_path / "real"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(target)
    r = run_cli("export", str(model), str(link), "--format", "onnx", "--force")
    assert r.code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "is a symbolic link; export to the directory it names" in r.stderr
    assert (target / "keep.txt").read_text() == "mine" and link.is_symlink()
    assert not list(tmp_path.glob(".link.*"))  # nothing was built beside it


def test_6_the_gru_graphs_take_any_source_length_without_a_warning(tmp_path, corpus, run_cli):
    """Issue 77, item 6: the GRU model's graphs kept the example's source length (5) in
    enc_out's and proj_keys' shapes; onnxruntime warned on every other length."""
    model = train_tiny(tmp_path, corpus, arch="rnn")
    out = tmp_path / "onnx"
    assert run_cli("export", str(model), str(out), "--format", "onnx").code == 0
    for name in ("encoder.onnx", "decoder.onnx"):
        graph = onnx.load(str(out / name)).graph
        for value in [*graph.value_info, *graph.output]:
            dims = value.type.tensor_type.shape.dim
            assert not [d.dim_value for d in dims if d.dim_value == 5], (name, value.name)
    # onnxruntime's own check, at lengths other than the example's, in a process of its own
    # (its warnings go to the C++ log, not to Python's).
    script = (
        "import onnxruntime as ort, numpy as np\n"
        f"s = ort.InferenceSession({str(out / 'encoder.onnx')!r})\n"
        "for n in (1, 3, 17, 40):\n"
        "    s.run(None, {'src': np.full((2, n), 4, dtype=np.int64)})\n"
    )
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert "VerifyOutputSizes" not in found.stderr, found.stderr
