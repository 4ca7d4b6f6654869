"""attnmt export --format ctranslate2: CTranslate2's greedy output equals ours."""

from __future__ import annotations

from pathlib import Path

import ctranslate2
import sentencepiece as spm

from attnmt import Translator

from helpers import train_tiny

SENTENCES = 8


def ct2_greedy(out: Path, lines: list[str], src_model: str, tgt_model: str) -> list[str]:
    """Translate each line alone with the exported model, under attnmt's default output limit
    (1.5 × source subwords with EOS, + 10), as a user of CTranslate2 would."""
    src_sp = spm.SentencePieceProcessor(model_file=str(out / src_model))
    tgt_sp = spm.SentencePieceProcessor(model_file=str(out / tgt_model))
    translator = ctranslate2.Translator(str(out), device="cpu")
    found = []
    for line in lines:
        pieces = src_sp.encode(line, out_type=str)
        limit = int(1.5 * (len(pieces) + 1)) + 10
        result = translator.translate_batch([pieces], beam_size=1, max_decoding_length=limit)
        found.append(tgt_sp.decode(result[0].hypotheses[0]))
    return found


def test_ctranslate2_greedy_equals_ours_pre_norm_tied(tmp_path: Path, trained, run_cli):
    model, corpus = trained
    lines = corpus["dev_src"].read_text().splitlines()[:SENTENCES]
    result = run_cli("export", str(model), str(tmp_path / "ct2"))
    assert result.code == 0, result.stderr
    assert {"model.bin", "config.json", "spm.model"} <= {
        p.name for p in (tmp_path / "ct2").iterdir()
    }
    ours = Translator.load(model).translate(lines, beam=1)
    assert ct2_greedy(tmp_path / "ct2", lines, "spm.model", "spm.model") == ours
    # The export checks itself on the dev set: the agreement the user sees at once.
    dev = corpus["dev_src"]
    assert f"agreement with attnmt (greedy, 20 sentences of {dev}): 20/20 identical" in (
        result.stdout
    )


def test_export_reports_a_broken_conversion(tmp_path: Path, trained, run_cli, monkeypatch):
    """A conversion that loses something (here: the output projection's weights zeroed in the
    spec) shows in the agreement line and a warning, on the sentences given with --check."""
    import attnmt.interop.ctranslate2

    model, corpus = trained
    linear, vocab = attnmt.interop.ctranslate2._linear, len(Translator.load(model).tokenizer.tgt)

    def broken(spec, layer):
        linear(spec, layer)
        if layer.weight.shape[0] == vocab:  # the output projection
            spec.weight = spec.weight * 0

    monkeypatch.setattr(attnmt.interop.ctranslate2, "_linear", broken)
    check = corpus["train_src"]
    result = run_cli("export", str(model), str(tmp_path / "ct2"), "--check", str(check))
    assert result.code == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("agreement"))
    assert f"(greedy, 100 sentences of {check})" in line and " 100/100 " not in line
    assert "warning: an fp32 export should agree on nearly every sentence" in result.stderr


def test_ctranslate2_greedy_equals_ours_post_norm_untied(tmp_path: Path, corpus, run_cli):
    model = train_tiny(tmp_path, corpus, joint=False, norm="post", tie_embeddings=False)
    lines = corpus["dev_src"].read_text().splitlines()[:SENTENCES]
    assert run_cli("export", str(model), str(tmp_path / "ct2")).code == 0
    ours = Translator.load(model).translate(lines, beam=1)
    assert ct2_greedy(tmp_path / "ct2", lines, "spm.src.model", "spm.tgt.model") == ours


def test_int8_export_is_smaller_and_translates(tmp_path: Path, trained, run_cli):
    model, corpus = trained
    assert run_cli("export", str(model), str(tmp_path / "fp32")).code == 0
    result = run_cli("export", str(model), str(tmp_path / "int8"), "--quantization", "int8")
    assert result.code == 0, result.stderr
    fp32, int8 = ((tmp_path / d / "model.bin").stat().st_size for d in ("fp32", "int8"))
    assert int8 < fp32
    lines = corpus["dev_src"].read_text().splitlines()[:2]
    assert all(ct2_greedy(tmp_path / "int8", lines, "spm.model", "spm.model"))
    # What the rounding costs, against attnmt's fp32 and the dev set's references.
    assert "cost of int8 (greedy): chrF " in result.stdout
    assert "against the references BLEU " in result.stdout and "(fp32) -> " in result.stdout


def test_a_quantized_export_that_shares_little_with_attnmt_is_called_broken():
    from attnmt.interop.agreement import Agreement, quantization_cost

    ours = ["a man rides a red bicycle down the street", "two dogs play in the snow"]
    close = Agreement(1, 2, "dev", ours=ours, theirs=[ours[0], "two dogs play in snow"])
    line, broken = quantization_cost(close, "int8", ours)
    assert not broken and line.startswith("cost of int8 (greedy): chrF ")
    assert "against the references BLEU 100.00 (fp32) -> " in line
    garbage = Agreement(0, 2, "dev", ours=ours, theirs=["xq zz", "qq"])
    assert quantization_cost(garbage, "int8", [])[1]


def test_refusals_are_one_line(tmp_path: Path, trained, corpus, run_cli):
    model, _ = trained
    (tmp_path / "taken").mkdir()
    result = run_cli("export", str(model), str(tmp_path / "taken"))
    assert result.code == 2 and "exists; pass --force" in result.stderr
    assert not any((tmp_path / "taken").iterdir())
    result = run_cli("export", str(model), str(tmp_path / "x"), "--quantization", "int3")
    assert result.code == 2 and "--quantization 'int3'" in result.stderr
    rnn = train_tiny(tmp_path, corpus, arch="rnn")
    result = run_cli("export", str(rnn), str(tmp_path / "rnn_ct2"))
    assert result.code == 2 and "CTranslate2 has no GRU decoder" in result.stderr
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "rnn_ct2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_unknown_format_is_refused(tmp_path: Path, trained, run_cli):
    result = run_cli("export", str(trained[0]), str(tmp_path / "o"), "--format", "tflite")
    assert result.code == 2 and "expected ctranslate2" in result.stderr


def test_the_export_carries_its_decoding_options_and_a_shareable_mode(tmp_path, trained, run_cli):
    import json
    import os

    model, _ = trained
    old = os.umask(0o022)
    try:
        assert run_cli("export", str(model), str(tmp_path / "ct2")).code == 0
    finally:
        os.umask(old)
    assert (tmp_path / "ct2").stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0o700
    options = json.loads((tmp_path / "ct2" / "generation.json").read_text())
    assert options["beam_size"] == 5 and options["length_penalty"] == 1.0
    assert options["max_decoding_length"] == {"a": 1.5, "b": 10, "max": 1500, "round": "floor"}
