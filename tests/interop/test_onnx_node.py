"""The ONNX export's JavaScript module (search.js, tokenizer.js: the web page's search and
tokenizer) in Node with onnxruntime-node: greedy and beam search give attnmt's translations,
and with a glossary (constraints.js) those of `attnmt translate --terminology`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from attnmt import Translator

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

NODE = shutil.which("node")
# scripts/get_onnxruntime_node.sh installs onnxruntime-node there (as .ci/run does).
HOME = Path(os.environ.get("ATTNMT_ONNXRUNTIME_NODE", ".cache/onnxruntime-node")).resolve()
HAS_RUNTIME = NODE is not None and (HOME / "node_modules/onnxruntime-node").is_dir()

# What docs/exporting.md shows a Node user, reading the lines from stdin.
SCRIPT = """
const attnmt = require(process.argv[2]);
(async () => {
  const model = await attnmt.load(process.argv[2]);
  const { lines, glossary } = JSON.parse(require("node:fs").readFileSync(0, "utf8"));
  const greedy = await model.translate(lines);
  const beam = await model.translate(lines, 3);
  const terms = await model.translate(lines, 3, null, { glossary });
  console.log(JSON.stringify({ greedy, beam, terms }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.mark.skipif(
    not HAS_RUNTIME, reason="no onnxruntime-node: bash scripts/get_onnxruntime_node.sh"
)
def test_the_export_translates_in_node_as_attnmt_does(tmp_path: Path, trained, run_cli):
    model, corpus = trained
    out = tmp_path / "onnx"
    assert run_cli("export", str(model), str(out), "--format", "onnx").code == 0
    package = json.loads((out / "package.json").read_text())
    assert package["main"] == "search.js" and "onnxruntime-node" in package["dependencies"]
    lines = corpus["dev_src"].read_text().splitlines()[:20]
    assert len(lines) == 20
    script = tmp_path / "translate.js"
    script.write_text(SCRIPT)
    glossary = "w2\tt9 t9\nw5|w7\tt3\n# a comment\n"
    (tmp_path / "terms.tsv").write_text(glossary)
    given = json.dumps({"lines": lines, "glossary": glossary})
    done = subprocess.run(
        [NODE, str(script), str(out)], input=given, capture_output=True, text=True,
        env={**os.environ, "NODE_PATH": str(HOME / "node_modules")}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ours = Translator.load(model)
    assert got["greedy"] == ours.translate(lines, beam=1)
    assert got["beam"] == [ours.translate([line], beam=3)[0] for line in lines]
    termed = Translator.load(model, terminology=tmp_path / "terms.tsv")
    want = [termed.translate([line], beam=3)[0] for line in lines]
    assert sum("w2" in line.split() or "w5" in line.split() for line in lines) >= 5
    assert got["terms"] == want and got["terms"] != got["beam"]  # the terms changed lines
    for line, text in zip(lines, got["terms"], strict=True):
        if "w2" in line.split():
            assert "t9 t9" in text
