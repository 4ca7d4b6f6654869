"""attnmt export --format huggingface --onnx: the layout Optimum writes and transformers.js
loads (onnx/encoder_model.onnx, onnx/decoder_model_merged.onnx, *_quantized.onnx,
tokenizer.json, generation_config.json), for an imported OPUS-MT-shaped model: onnxruntime's
greedy search over it and transformers.js's translation pipeline (in Node) give attnmt's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from attnmt import Translator
from attnmt.data.tokenizer import BOS_ID, EOS_ID
from attnmt.decoding.search import output_limit, search_options

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
tokenizers = pytest.importorskip("tokenizers")

from test_huggingface import SOURCES, marian_dir  # noqa: E402

NODE = shutil.which("node")
# scripts/get_transformers_js.sh installs @huggingface/transformers there (as .ci/run does).
JS_HOME = Path(os.environ.get("ATTNMT_TRANSFORMERS_JS", ".cache/transformers-js")).resolve()
HAS_JS = NODE is not None and (JS_HOME / "node_modules/@huggingface/transformers").is_dir()
NO_JS = "no transformers.js: bash scripts/get_transformers_js.sh (as .ci/run does)"
LINES = SOURCES[:20]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    from typer.testing import CliRunner

    from attnmt.cli.commands import app

    tmp = tmp_path_factory.mktemp("hf_onnx")
    imported, out = tmp / "imported", tmp / "exported"
    marian = marian_dir(tmp, "swish", True, False, seed=3)
    runner = CliRunner()
    assert runner.invoke(app, ["import", str(marian), "--out", str(imported)]).exit_code == 0
    args = ["export", "--format", "huggingface", "--onnx", str(imported), str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return imported, out


def limit(translator: Translator, ids: list[int]) -> int:
    """attnmt's output limit for a source of these ids (EOS included)."""
    return output_limit(len(ids), search_options(translator.cfg.decode))


def ort_greedy(out: Path, ids: list[int], steps: int, quantized: bool = False) -> list[int]:
    """Greedy search over the onnx/ files as transformers.js runs them."""
    q = "_quantized" if quantized else ""
    enc = ort.InferenceSession(str(out / "onnx" / f"encoder_model{q}.onnx"))
    dec = ort.InferenceSession(str(out / "onnx" / f"decoder_model_merged{q}.onnx"))
    src = np.array([ids])
    mask = np.ones_like(src)
    hidden = enc.run(None, {"input_ids": src, "attention_mask": mask})[0]
    past = {
        i.name: np.zeros([1, i.shape[1], 0, i.shape[3]], np.float32)
        for i in dec.get_inputs()
        if i.name.startswith("past")
    }
    names = [o.name.replace("present", "past_key_values") for o in dec.get_outputs()][1:]
    found, prev = [], BOS_ID
    for _ in range(steps):
        feed = {"input_ids": np.array([[prev]]), "encoder_attention_mask": mask}
        logits, *present = dec.run(None, {**feed, "encoder_hidden_states": hidden, **past})
        logits[0, -1, [0, BOS_ID]] = -np.inf
        prev = int(logits[0, -1].argmax())
        if prev == EOS_ID:
            break
        found.append(prev)
        past = dict(zip(names, present, strict=True))
    return found


def test_the_onnx_files_and_tokenizer_give_attnmts_greedy_output(exported):
    imported, out = exported
    onnx_files = {p.name for p in (out / "onnx").iterdir()}
    for name in ("encoder_model", "decoder_model_merged"):
        assert {f"{name}.onnx", f"{name}_quantized.onnx"} <= onnx_files
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == BOS_ID
    ours = Translator.load(imported)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for line, expected in zip(LINES, ours.translate(LINES, beam=1), strict=True):
        ids = tok.encode(line).ids
        assert ids == [*ours.tokenizer.src.encode([line])[0], EOS_ID]
        found = ort_greedy(out, ids, limit(ours, ids))
        assert ours.tokenizer.tgt.decode(found) == expected
        assert tok.decode(found, skip_special_tokens=True) == expected
    ids = tok.encode(LINES[0]).ids
    assert ort_greedy(out, ids, limit(ours, ids), quantized=True)  # int8 runs


@pytest.mark.skipif(not HAS_JS, reason=NO_JS)
def test_transformers_js_translates_as_attnmt(exported):
    imported, out = exported
    script = JS_HOME / f"attnmt-test-{os.getpid()}.mjs"  # ES modules resolve from their folder
    script.write_text(JS)
    ours = Translator.load(imported)
    encoded = ours.tokenizer.src.encode(LINES)
    lines = [[line, limit(ours, [*ids, EOS_ID])] for line, ids in zip(LINES, encoded, strict=True)]
    done = subprocess.run(
        [NODE, str(script), str(out.parent), out.name], input=json.dumps(lines),
        capture_output=True, text=True, cwd=JS_HOME, timeout=300,
    )  # fmt: skip
    script.unlink()
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == ours.translate(LINES, beam=1)


JS = """
import { pipeline, env } from "@huggingface/transformers";
import { readFileSync } from "node:fs";
const [root, name] = process.argv.slice(2);
env.allowRemoteModels = false;
env.localModelPath = root + "/";
const translate = await pipeline("translation", name, { dtype: "fp32" });
const out = [];
for (const [line, limit] of JSON.parse(readFileSync(0, "utf8"))) {
  const [r] = await translate(line, { num_beams: 1, do_sample: false, max_new_tokens: limit });
  out.push(r.translation_text);
}
console.log(JSON.stringify(out));
"""
