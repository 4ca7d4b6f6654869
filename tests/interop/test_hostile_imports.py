"""Never lose a run, part 5 (issue 55): a downloaded model is as untrusted as a request. Each
crafted file is built here (nothing large is committed); each test is named after its item.
The memory-hungry refusals run in a child process whose heap is capped at 1.5 GiB and must end
within seconds as one line."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file
from test_huggingface import marian_dir
from test_marian import random_npz, spm_and_vocab

from helpers import one_error_line

HEAP = 1536 << 20  # bytes a refusal may use


def bounded(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """`attnmt ARGS` in a child whose heap is capped at HEAP; its result and seconds."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (HEAP, HEAP))

    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "attnmt", *args], capture_output=True, text=True,
        preexec_fn=cap, timeout=timeout,
    )  # fmt: skip
    return r, time.monotonic() - start


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    return marian_dir(tmp_path_factory.mktemp("hf"), "relu", tied=True, two_spm=False)


@pytest.fixture
def hf(hf_model, tmp_path) -> Path:
    """A copy of the tiny MarianMTModel to tamper with."""
    return Path(shutil.copytree(hf_model, tmp_path / "hf"))


def edit_config(model: Path, **changes: object) -> None:
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is KeyError:
            config.pop(key, None)
        else:
            config[key] = value
    (model / "config.json").write_text(json.dumps(config))


def edit_weights(model: Path, change) -> None:
    weights = load_file(str(model / "model.safetensors"))
    change(weights)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})


def refused(run_cli, source: Path, tmp_path: Path, *fragments: str) -> str:
    r = run_cli("import", str(source), "--out", str(tmp_path / "out"))
    assert r.code == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnmt: error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    return lines[0]


@pytest.fixture
def native(tmp_path) -> Path:
    """A tiny native Marian model folder (model.npz, decoder.yml, vocab.txt, sp.model)."""
    sp_model, _, pieces = spm_and_vocab(tmp_path)
    random_npz(tmp_path, "pre", len(pieces))
    shutil.copy(sp_model, tmp_path / "marian" / "source.spm")
    shutil.copy(sp_model, tmp_path / "marian" / "target.spm")
    return tmp_path / "marian"


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
    for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_1_yaml_billion_laughs_in_a_decoder_yml_is_refused_at_once(native, tmp_path):
    (native / "decoder.yml").write_text(LAUGHS + "max-length-factor: *i\nmodels: [*i]\n")
    r, seconds = bounded("import", str(native), "--out", str(tmp_path / "out"))
    one_error_line(r, "aliases expand to over")
    assert seconds < 30


def test_1_yaml_billion_laughs_in_special_model_yml_is_refused_at_once(native, tmp_path):
    arrays = dict(np.load(native / "model.npz"))
    text = (LAUGHS + "type: *i\n").encode() + b"\x00"
    arrays["special:model.yml"] = np.frombuffer(text, dtype=np.int8)
    np.savez(native / "model.npz", **arrays)
    r, seconds = bounded("import", str(native), "--out", str(tmp_path / "out"))
    one_error_line(r, "special:model.yml", "aliases expand to over")
    assert seconds < 30


def test_2_a_config_bigger_than_its_weights_is_refused_before_anything_is_allocated(hf, tmp_path):
    edit_config(hf, d_model=16384, encoder_layers=64, decoder_layers=64)
    r, seconds = bounded("import", str(hf), "--out", str(tmp_path / "out"))
    one_error_line(r, "more than its", "do not belong together")
    assert seconds < 30


def test_2_a_position_table_of_another_shape_is_refused(hf, tmp_path, run_cli):
    def table(w):
        w["model.encoder.embed_positions.weight"] = torch.zeros(100_000, 16)

    edit_weights(hf, table)
    refused(run_cli, hf, tmp_path, "embed_positions is (100000, 16)")
    edit_weights(
        hf, lambda w: w.update({"model.encoder.embed_positions.weight": torch.zeros(5, 0)})
    )
    refused(run_cli, hf, tmp_path, "non-empty floating-point")


def test_2_huge_sparse_spm_and_vocab_files_are_refused_by_their_size(hf, native, tmp_path):
    with open(hf / "target.spm", "r+b") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    r, seconds = bounded("import", str(hf), "--out", str(tmp_path / "out"))
    one_error_line(r, "target.spm", "bytes; a SentencePiece model has at most")
    with open(native / "vocab.txt", "r+b") as f:
        f.truncate(3 << 30)
    r, seconds = bounded("import", str(native), "--out", str(tmp_path / "out2"))
    one_error_line(r, "vocab.txt", "bytes; a Marian vocabulary has at most")
    assert seconds < 30


def test_2_an_npz_member_that_inflates_is_refused_before_it_is_read(native, tmp_path):
    original = (native / "model.npz").read_bytes()
    with (
        zipfile.ZipFile(tmp_path / "clean.npz", "w") as out,
        zipfile.ZipFile(native / "model.npz") as z,
    ):
        for m in z.infolist():
            if m.filename != "encoder_l1_self_Wq.npy":
                out.writestr(m, z.read(m))
        bomb = zipfile.ZipInfo("encoder_l1_self_Wq.npy")
        bomb.compress_type = zipfile.ZIP_DEFLATED
        with out.open(bomb, "w", force_zip64=True) as f:
            header = {"descr": "<f4", "fortran_order": False, "shape": (64 << 20,)}
            np.lib.format.write_array_header_1_0(f, header)
            for _ in range(256):  # 256 MiB of zeros, about 256 KiB stored
                f.write(bytes(1 << 20))
    shutil.move(tmp_path / "clean.npz", native / "model.npz")
    r, seconds = bounded("import", str(native), "--out", str(tmp_path / "out"))
    one_error_line(r, "inflates to")
    assert seconds < 60
    (native / "model.npz").write_bytes(original)
    with zipfile.ZipFile(native / "model.npz", "a") as z:
        z.writestr("unknown_array.npy", b"")
    r, _ = bounded("import", str(native), "--out", str(tmp_path / "out"))
    one_error_line(r, "'unknown_array' is not an array of a Marian model")


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"d_model": "abc"}, "d_model = 'abc': expected a whole number"),
        ({"d_model": [32]}, "d_model = [32]"),
        ({"d_model": KeyError}, "d_model = None"),
        ({"d_model": 32.7}, "d_model = 32.7"),
        ({"pad_token_id": KeyError}, "pad_token_id = None"),
        ({"pad_token_id": None}, "pad_token_id = None"),
        ({"pad_token_id": "x"}, "pad_token_id = 'x'"),
        ({"eos_token_id": -5}, "eos_token_id = -5"),
        ({"decoder_start_token_id": 5.5}, "decoder_start_token_id = 5.5"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false': expected true or false"),
        ({"d_model": 100_000}, "emb_size"),
        ({"encoder_layers": 0}, "enc_layers"),
        ({"dropout": float("nan")}, "dropout"),
    ],
)
def test_7_and_10_config_values_of_the_wrong_type_or_range_are_one_line(
    hf, tmp_path, run_cli, changes, fragment
):
    edit_config(hf, **changes)
    refused(run_cli, hf, tmp_path, fragment)


@pytest.mark.parametrize("text", ["[1, 2]", "null", "[" * 100_000 + "]" * 100_000])
def test_7_a_config_json_that_is_not_an_object_is_one_line(hf, tmp_path, run_cli, text):
    (hf / "config.json").write_text(text)
    refused(run_cli, hf, tmp_path, "config.json")


def test_7_shapes_dtypes_and_ids_that_do_not_fit_are_one_line(hf, tmp_path, run_cli):
    original = (hf / "model.safetensors").read_bytes()
    name = "model.encoder.layers.0.fc1.weight"
    edit_weights(hf, lambda w: w.update({name: torch.zeros(3, 4)}))
    refused(run_cli, hf, tmp_path, "ff.w_1.weight is (3, 4); the config makes it (32, 16)")
    (hf / "model.safetensors").write_bytes(original)
    edit_weights(hf, lambda w: w.update({"model.shared.weight": torch.zeros(2, 3, 4)}))
    refused(run_cli, hf, tmp_path, "model.shared.weight", "(2, 3, 4)")
    (hf / "model.safetensors").write_bytes(original)
    edit_weights(hf, lambda w: w.update({name: w[name].to(torch.float8_e4m3fn)}))
    refused(run_cli, hf, tmp_path, "F8_E4M3")
    (hf / "model.safetensors").write_bytes(original)
    vocab = json.loads((hf / "vocab.json").read_text())
    (hf / "vocab.json").write_text(json.dumps({**vocab, "<unk>": 1_000_005}))
    refused(run_cli, hf, tmp_path, "id 1000005 is past the embeddings'")


def test_7_a_bin_holding_a_list_is_one_line(hf, tmp_path, run_cli):
    (hf / "model.safetensors").unlink()
    torch.save([torch.zeros(20_000)], hf / "pytorch_model.bin")  # the size of its config's
    refused(run_cli, hf, tmp_path, "pytorch_model.bin: not a mapping of names to tensors")


class Payload:
    def __reduce__(self):
        return (print, ("ran",))


def test_8_refusals_say_what_is_refused_never_how_to_bypass_it(hf, native, tmp_path, run_cli):
    (hf / "model.safetensors").unlink()
    torch.save({"w": Payload(), "size": torch.zeros(20_000)}, hf / "pytorch_model.bin")
    line = refused(run_cli, hf, tmp_path, "refused", "without running the file's code")
    assert "weights_only" not in line and "False" not in line
    arrays = dict(np.load(native / "model.npz"))
    arrays["encoder_Wemb"] = np.array([{"a": 1}], dtype=object)
    np.savez(native / "model.npz", **arrays)
    line = refused(run_cli, native, tmp_path, "holds Python objects, not numbers; refused")
    assert "allow_pickle" not in line and "unsafe" not in line


def test_9_misleading_lines_say_what_is_wrong(native, tmp_path, run_cli):
    decoder = yaml.safe_load((native / "decoder.yml").read_text())
    (native / "decoder.yml").write_text(yaml.safe_dump({**decoder, "models": "model.npz"}))
    refused(run_cli, native, tmp_path, "models: 'model.npz'; expected a list of 1 or more")
    (native / "decoder.yml").write_text(yaml.safe_dump({**decoder, "vocabs": "vocab.txt"}))
    refused(run_cli, native, tmp_path, "vocabs: 'vocab.txt'; expected a list of 2 or more")
    refused(run_cli, tmp_path / "nonexistent", tmp_path, "nonexistent: no such file or directory")


def test_10_nan_or_infinite_weights_are_refused_at_import(hf, tmp_path, run_cli):
    name = "model.decoder.layers.1.fc2.bias"

    def poison(w):
        w[name] = w[name].clone()
        w[name][0] = float("nan")

    edit_weights(hf, poison)
    refused(run_cli, hf, tmp_path, "w_2.bias holds NaN or infinite values")


@pytest.mark.parametrize(
    ("vocab", "fragment"),
    [
        ({}, "expected a map of piece: id"),
        ({"</s>": -1, "<unk>": 1}, "'</s>' has id -1"),
        ({"</s>": 0, "<unk>": 0}, "several pieces share an id"),
        ({"</s>": 0, "<unk>": 5.5}, "'<unk>' has id 5.5"),
    ],
)
def test_10_vocabulary_ids_that_cannot_be_rows_are_refused(hf, tmp_path, run_cli, vocab, fragment):
    (hf / "vocab.json").write_text(json.dumps(vocab))
    refused(run_cli, hf, tmp_path, fragment)


def test_10_an_untied_model_without_its_output_layer_is_refused(hf, tmp_path, run_cli):
    edit_config(hf, tie_word_embeddings=False)
    edit_weights(hf, lambda w: w.pop("lm_head.weight", None))
    refused(run_cli, hf, tmp_path, "tie_word_embeddings is false but there is no lm_head.weight")


def test_14_an_interrupted_import_leaves_no_folder_behind(hf, tmp_path, run_cli):
    abandoned = tmp_path / ".out.999999999.abcd"  # a killed import's: no such process
    abandoned.mkdir()
    (abandoned / "weights").write_bytes(b"half")
    r = run_cli("import", str(hf), "--out", str(tmp_path / "out"))
    assert r.code == 0, r.stderr
    assert not abandoned.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


def test_14_the_hugging_face_export_says_when_it_uses_last(hf, tmp_path, run_cli):
    assert run_cli("import", str(hf), "--out", str(tmp_path / "m")).code == 0
    (tmp_path / "m" / "best.safetensors").rename(tmp_path / "m" / "last.safetensors")
    r = run_cli("export", str(tmp_path / "m"), str(tmp_path / "e"), "--format", "huggingface")
    assert r.code == 0, r.stderr
    assert "has no best.safetensors yet; exporting last.safetensors" in r.stderr


def test_59_a_native_marian_import_never_outputs_unk(native, tmp_path, run_cli):
    r = run_cli("import", str(native), "--out", str(tmp_path / "m"))
    assert r.code == 0, r.stderr
    assert (
        yaml.safe_load((tmp_path / "m" / "config.yaml").read_text())["decode"]["allow_unk"] is False
    )


def test_59_an_import_writes_no_data_paths(hf, tmp_path, run_cli):
    assert run_cli("import", str(hf), "--out", str(tmp_path / "m")).code == 0
    data = yaml.safe_load((tmp_path / "m" / "config.yaml").read_text())["data"]
    assert "train" not in data or data["train"] is None, data
    assert "dev" not in data or data["dev"] is None, data
    r = run_cli("translate", "-m", str(tmp_path / "m"), stdin=b"w1 w2\n")
    assert r.code == 0, r.stderr
    config = tmp_path / "c.yaml"  # a training config must still name its corpora
    config.write_text("data: {}\ntrain: {init_from: " + str(tmp_path / "m") + "}\n")
    r = run_cli("train", "--config", str(config), "--out", str(tmp_path / "ft"))
    assert r.code == 2 and "data.train is missing" in r.stderr, r.stderr
