"""The command line: help, errors as one line with exit code 2, and a tiny end-to-end run."""

import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from attnmt.kernels import matmul

from conftest import tiny_config, write_config, write_lines
from helpers import assert_user_error


def test_version_and_help(run_cli):
    r = run_cli("--version")
    assert r.code == 0 and r.stdout.strip().startswith("attnmt ")
    for cmd in ("train", "translate", "eval"):
        r = run_cli(cmd, "--help")
        assert r.code == 0
        assert "--help" in r.stdout
    r = run_cli("--help")
    assert r.code == 0 and "translate" in r.stdout
    assert "--install-completion" in r.stdout  # shell completion is on
    r = run_cli("train", "--help")
    assert "--resume" in r.stdout and "<bool>" not in r.stdout and "BOOLEAN" not in r.stdout


def test_every_option_has_help():
    import typer.main

    from attnmt.cli.commands import app

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        for param in cmd.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.help, f"{name} --{param.name} has no help"


def test_config_errors(tmp_path: Path, corpus, run_cli):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    out = str(tmp_path / "m")
    assert_user_error(
        run_cli("train", "-c", str(tmp_path / "none.yaml"), "--out", out), "config file not found"
    )
    assert_user_error(
        run_cli("train", "-c", str(cfg), "--out", out, "--set", "train.lr=abc"),
        "'train.lr' = 'abc'",
        "valid number",
    )
    assert_user_error(
        run_cli("train", "-c", str(cfg), "--out", out, "--set", "model.kind=gru"),
        "unknown key 'model.kind'",
        "allowed keys here: arch",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_config_error(tmp_path: Path, corpus, run_cli):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    r = run_cli("train", "-c", str(cfg), "--out", str(tmp_path / "m"), "--set", "train.device=cuda")
    assert_user_error(r, "train.device = 'cuda': no CUDA device is available")


def test_empty_and_too_long_pairs_are_skipped_and_counted(tmp_path: Path, corpus, run_cli):
    src = corpus["train_src"].read_text().splitlines()
    tgt = corpus["train_tgt"].read_text().splitlines()
    src[3], tgt[10] = "", "   "
    src[20] = " ".join(["w1"] * 60)  # far over data.max_len = 20 subwords
    write_lines(corpus["train_src"], src)
    write_lines(corpus["train_tgt"], tgt)
    cfg = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    r = run_cli(
        "train", "-c", str(cfg), "--out", str(tmp_path / "m"), "--set", "train.max_steps=1", "-q"
    )
    assert r.code == 0, r.stderr
    log = (tmp_path / "m" / "train_log.jsonl").read_text().splitlines()
    data = next(e for e in map(json.loads, log) if e["event"] != "prepare")
    assert data["event"] == "data"
    assert data["train_skipped_empty"] == 2
    assert data["train_skipped_too_long"] == 1
    assert data["train_pairs"] == 297
    assert (
        "2 skipped as empty, 1 longer than 20 subwords"
        in (tmp_path / "m" / "train.log").read_text()
    )


def test_data_errors(tmp_path: Path, corpus, run_cli):
    def train_with(**files):
        raw = tiny_config(corpus)
        for key, path in files.items():
            split, side = key.split("_")
            raw["data"][split][side] = str(path)
        cfg = write_config(tmp_path / "c.yaml", raw)
        return run_cli("train", "-c", str(cfg), "--out", str(tmp_path / "m"), "--overwrite", "-q")

    assert_user_error(train_with(train_src=tmp_path / "nope.de"), "file not found", "nope.de")
    short = write_lines(tmp_path / "short.tgt", ["a", "b"])
    assert_user_error(train_with(train_tgt=short), "line counts differ", "300 lines", "has 2")
    bad = tmp_path / "bad.src"
    lines = corpus["dev_src"].read_bytes().split(b"\n")
    lines[6] = b"caf\xe9"
    bad.write_bytes(b"\n".join(lines))
    # A failed run closes its log files (train.log, train_log.jsonl), not the garbage collector.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        assert_user_error(train_with(dev_src=bad), f"{bad}:7: not valid UTF-8")
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_model_dir_errors(tmp_path: Path, run_cli):
    inp = write_lines(tmp_path / "in.txt", ["hallo"])
    assert_user_error(
        run_cli("translate", "--model", str(tmp_path), "--input", str(inp)),
        "not an attnmt model directory",
    )
    assert_user_error(run_cli("eval", "--ref", str(inp)), "give either --hyp FILE, or --model DIR")


def test_eval_scores_hypothesis_file(tmp_path: Path, run_cli):
    ref = write_lines(tmp_path / "ref", ["the cat sat on the mat", "hello world"])
    hyp = write_lines(tmp_path / "hyp", ["the cat sat on the mat", "hello world"])
    r = run_cli("eval", "--hyp", str(hyp), "--ref", str(ref), "--json")
    assert r.code == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["bleu"] == 100.0 and s["chrf"] == 100.0
    assert "tok:13a" in s["bleu_signature"]
    r = run_cli("eval", "--hyp", str(hyp), "--ref", str(ref))
    assert "BLEU signature: nrefs:1|case:mixed" in r.stdout
    short = write_lines(tmp_path / "short", ["x"])
    assert_user_error(run_cli("eval", "--hyp", str(short), "--ref", str(ref)), "line counts differ")


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_train_translate_eval_end_to_end(tmp_path: Path, corpus, run_cli, arch, monkeypatch):
    raw = tiny_config(corpus, arch)
    raw["train"]["teacher_forcing"] = {"schedule": "linear", "start": 1.0, "end": 0.5, "steps": 8}
    raw["data"]["test"] = raw["data"]["dev"]
    cfg = write_config(tmp_path / "c.yaml", raw)
    model = tmp_path / "model"
    r = run_cli("train", "-c", str(cfg), "--out", str(model), "--set", "train.max_steps=9", "-q")
    assert r.code == 0, r.stderr
    names = {p.name for p in model.iterdir()}
    assert {
        "config.yaml",
        "spm.model",
        "best.safetensors",
        "last.safetensors",
        "train_log.jsonl",
        "train.log",
        "attnmt.json",
    } <= names
    saved = yaml.safe_load((model / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 9  # the override, resolved
    assert saved["decode"]["beam"] == 5  # defaults filled in
    events = [json.loads(line) for line in (model / "train_log.jsonl").read_text().splitlines()]
    validations = [e for e in events if e["event"] == "validation"]
    assert [v["step"] for v in validations] == [4, 8, 9]
    assert all({"dev_loss", "dev_ppl", "dev_bleu"} <= set(v) for v in validations)
    assert events[-1]["event"] == "done" and events[-1]["steps"] == 9
    model_event = next(e for e in events if e["event"] == "model")
    assert model_event["matmul"] == ("onednn" if matmul.onednn_is_faster() else "blas")
    assert events[-2]["event"] == "test" and events[-2]["pairs"] == 20
    assert "tok:13a" in events[-2]["bleu_signature"]

    # translate: stdin -> stdout, one line out per line in, empty line stays empty
    r = run_cli("translate", "--model", str(model), stdin=b"w1 w2\n\nw3\n")
    assert r.code == 0, r.stderr
    assert r.stdout.count("\n") == 3 and r.stdout.split("\n")[1] == ""
    # translate: files
    out = tmp_path / "hyp.txt"
    r = run_cli("translate", "-m", str(model), "-i", str(corpus["dev_src"]), "-o", str(out))
    assert r.code == 0, r.stderr
    assert len(out.read_text().splitlines()) == 20
    # two batches searched at once: the same lines
    out2 = tmp_path / "hyp2.txt"
    r = run_cli(
        "translate", "-m", str(model), "-i", str(corpus["dev_src"]), "-o", str(out2),
        "--workers", "2", "--batch-tokens", "40", "--device", "cpu",
    )  # fmt: skip
    assert r.code == 0, r.stderr
    assert out2.read_text() == out.read_text()
    # 16-bit decoding: one line out per line in; an unknown format is a user error
    out3 = tmp_path / "hyp3.txt"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    r = run_cli(
        "translate", "-m", str(model), "-i", str(corpus["dev_src"]), "-o", str(out3),
        "--precision", "bf16", "--device", "cpu",
    )  # fmt: skip
    assert r.code == 0, r.stderr
    assert len(out3.read_text().splitlines()) == 20
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"  # capped, as training does
    # a CPU without 16-bit matmul instructions: it still decodes, and says it may be slow
    import attnmt.device

    with monkeypatch.context() as m:
        m.setattr(attnmt.device, "cpu_matmul_hardware", lambda precision: precision == "fp32")
        r = run_cli(
            "translate", "-m", str(model), "--precision", "fp16", "--device", "cpu",
            stdin=b"w1 w2\n",
        )  # fmt: skip
    assert r.code == 0 and r.stdout.count("\n") == 1, r.stderr
    assert "note: this CPU has no fp16 matmul instructions (AMX-FP16)" in r.stderr
    assert_user_error(
        run_cli("translate", "-m", str(model), "--precision", "int4", stdin=b"x\n"),
        "--precision 'int4': expected fp32, bf16, fp16 or int8",
    )
    # CPU fp32 matmuls in oneDNN (every product, the dims here are tiny), in 2 forked workers
    # too: the same lines; an unknown backend is a user error
    if torch.backends.mkldnn.is_available():
        out4 = tmp_path / "hyp4.txt"
        with monkeypatch.context() as m:
            m.setattr(matmul, "ONEDNN_MIN_WORK", 0)
            for workers in ("1", "2"):
                r = run_cli(
                    "translate", "-m", str(model), "-i", str(corpus["dev_src"]), "-o", str(out4),
                    "--matmul", "onednn", "--workers", workers, "--batch-tokens", "40", "--device",
                    "cpu",
                )  # fmt: skip
                assert r.code == 0, r.stderr
                assert out4.read_text() == out.read_text()
                assert matmul.active_backend() == "blas", "translate must not leave its backend set"
    assert_user_error(
        run_cli("translate", "-m", str(model), "--matmul", "mkl", stdin=b"x\n"),
        "--matmul 'mkl': expected auto, blas, onednn",
    )
    # eval: translate and score
    r = run_cli(
        "eval",
        "-m",
        str(model),
        "--src",
        str(corpus["dev_src"]),
        "--ref",
        str(corpus["dev_tgt"]),
        "--json",
    )
    assert r.code == 0, r.stderr
    assert 0.0 <= json.loads(r.stdout)["bleu"] <= 100.0
    # beam search, n-best list: K lines 'LINE ||| TEXT ||| SCORE' per input, the 1-best first
    r = run_cli(
        "translate", "-m", str(model), "--beam", "3", "--n-best", "2", stdin=b"w1 w2\n\nw3\n"
    )
    assert r.code == 0, r.stderr
    rows = [line.split(" ||| ") for line in r.stdout.splitlines()]
    assert [int(x[0]) for x in rows] == [0, 0, 1, 1, 2, 2]
    one = run_cli("translate", "-m", str(model), "--beam", "3", stdin=b"w1 w2\n\nw3\n").stdout
    assert [x[1] for x in rows[::2]] == one.splitlines()
    assert_user_error(
        run_cli("translate", "-m", str(model), "--beam", "2", "--n-best", "3", stdin=b"x\n"),
        "n_best 3 exceeds the beam size 2",
    )
    # attention maps: JSON (pieces + weights) and a PNG per input line
    maps = tmp_path / "maps"
    r = run_cli("translate", "-m", str(model), "--attention", str(maps), stdin=b"w1 w2\nw3\n")
    assert r.code == 0, r.stderr
    record = json.loads((maps / "000000.json").read_text())
    assert len(record["weights"]) == len(record["target_pieces"])
    assert all(len(row) == len(record["source_pieces"]) for row in record["weights"])
    assert sorted(p.name for p in maps.iterdir()) == [
        "000000.json", "000000.png", "000001.json", "000001.png"
    ]  # fmt: skip
    assert record["line"] == 0  # as n-best lists count
    # invalid UTF-8 on stdin is a user error with the line number
    r = run_cli("translate", "--model", str(model), stdin=b"ok\n\xff\n")
    assert_user_error(r, "<stdin>:2: not valid UTF-8")


def test_real_entry_point_prints_one_line(tmp_path: Path):
    """The installed command itself (not the in-process runner): one line, exit 2."""
    r = subprocess.run(
        [sys.executable, "-m", "attnmt", "translate", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        input="x\n",
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"attnmt: error: model directory not found: {tmp_path / 'none'}"
    ]


def test_help_lists_every_command_with_a_whole_description(run_cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    r = run_cli("--help")
    commands = r.stdout.split("Commands:")[1].strip().splitlines()
    assert len(commands) >= 10
    assert not [c for c in commands if c.rstrip().endswith(("...", "…"))], commands


def test_length_norm_from_the_cli_and_from_the_config(tmp_path: Path, trained, run_cli):
    """`translate --length-norm length` searches with that form (other n-best scores than
    the default gnmt's), as a model whose config says decode.length_norm: length does; any
    other value is one clear error."""
    import shutil

    from attnmt.decoding.search import Beam

    from helpers import cli_lines

    model, _ = trained
    lines = ["w1 w5 w9 w0 w8", "w2 w6 w10", "w0 w1"]
    args = ("--beam", "3", "--n-best", "2", "--length-penalty", "1")
    by_flag = cli_lines(run_cli, model, lines, *args, "--length-norm", "length")
    copy = tmp_path / "m"
    shutil.copytree(model, copy)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg.setdefault("decode", {})["length_norm"] = "length"
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_lines(run_cli, copy, lines, *args) == by_flag
    from attnmt import Translator

    translator = Translator.load(copy, device="cpu")
    method = translator.options(3, 2).method
    assert isinstance(method, Beam) and method.length_norm == "length"
    gnmt = cli_lines(run_cli, model, lines, *args, "--length-norm", "gnmt")
    assert gnmt == cli_lines(run_cli, model, lines, *args) != by_flag  # the default: gnmt
    assert_user_error(
        run_cli("translate", "-m", str(model), "--length-norm", "avg", stdin=b"w1\n"),
        "--length-norm",
        "'gnmt', 'length'",
    )
