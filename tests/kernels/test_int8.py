"""int8 decoding (attnmt.kernels.int8) on both architectures, through Translator and the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from attnmt import Translator
from attnmt.config import from_dict
from attnmt.kernels import int8
from attnmt.kernels.int8 import MIN_OUT_FEATURES, Int8GRU, Int8Linear, int8_hardware
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config

# 200 lines: on 40, one line's near-tie moved the agreement by 2.5 points (a change of the
# training's summation order alone took one model from 39/40 to 35/40; on these 200 lines
# 93.5 % and 95 %).
LINES = make_pairs(200, 21)[0]


@pytest.fixture(scope="module")
def models(trained, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both architectures, trained long enough (500 steps) to say different things per line and
    to be decisive: at 60 steps near-ties flipped up to 22 % of lines on some CPUs."""
    _, corpus = trained
    out = {}
    for arch in ("transformer", "rnn"):
        raw = tiny_config(corpus, arch)
        raw["model"].update(emb_size=32, hidden_size=32, ff_size=64)
        raw["train"].update(max_steps=500, eval_every=500, lr=0.01, warmup_steps=5)
        out[arch] = tmp_path_factory.mktemp(arch) / "m"
        train(from_dict(raw), out[arch], quiet=True)
    return out


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_int8_swaps_the_matmuls_and_mostly_agrees_with_fp32(models, arch):
    fp32 = Translator.load(models[arch], device="cpu")
    int8 = Translator.load(models[arch], device="cpu", precision="int8")
    modules = list(int8.model.modules())
    assert not any(
        type(m) is not nn.Linear and isinstance(m, nn.Linear) and m.out_features >= MIN_OUT_FEATURES
        for m in modules
    ), "a linear layer was left in fp32"
    assert any(isinstance(m, Int8Linear) for m in modules)
    assert (arch == "rnn") == any(isinstance(m, Int8GRU) for m in modules)
    assert not any(type(m) is nn.GRU for m in modules)

    for beam in (1, 3):
        want, got = fp32.translate(LINES, beam=beam), int8.translate(LINES, beam=beam)
        assert len(got) == len(LINES)
        if beam == 1:  # (beam search's short outputs are alike on so small a model)
            assert len(set(want)) > 5, "the model should not say the same thing to every line"
        same = sum(a == b for a, b in zip(want, got, strict=True)) / len(LINES)
        # Without VNNI the inputs are quantized to 7 bits (kernels/int8.py): less exact.
        least = 0.9 if int8_hardware() else 0.8
        assert same >= least, f"beam {beam}: {same:.0%} of lines equal to fp32"
    found = int8.hypotheses(LINES[:8], beam=3, n_best=3)
    assert all(len(h) == 3 and all(math.isfinite(x.score) for x in h) for h in found)


def test_int8_from_the_cli_and_the_config(models, run_cli, tmp_path: Path, monkeypatch):
    model = models["rnn"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES[:6]) + "\n")
    args = ("translate", "-m", str(model), "-i", str(src), "--beam", "1", "--device", "cpu")
    fp32 = run_cli(*args)
    r = run_cli(*args, "--precision", "int8")
    assert r.code == 0, r.stderr
    assert fp32.code == 0 and len(r.stdout.splitlines()) == 6
    r = run_cli("translate", "-m", str(model), "-i", str(src), "--precision", "int4")
    assert r.code == 2 and "--precision 'int4': expected fp32, bf16, fp16 or int8" in r.stderr
    # A CPU without VNNI gets the hardware note, as bf16 without its instructions does.
    monkeypatch.setattr("attnmt.device.cpu_matmul_hardware", lambda precision: precision == "fp32")
    r = run_cli(*args, "--precision", "int8")
    assert r.code == 0 and "no int8 matmul instructions (AVX512-VNNI or AVX-VNNI)" in r.stderr


def test_int8_is_refused_off_the_cpu(models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        "attnmt.decoding.translator.load_model_dir", lambda *a: pytest.fail("loaded")
    )
    with pytest.raises(Exception, match="int8 decoding is for the CPU"):
        Translator.load(models["rnn"], device="cuda", precision="int8")


def test_the_source_side_runs_on_onednn_where_the_cpu_has_amx_tiles(models, monkeypatch):
    """With AMX tiles (forced here: oneDNN's int8 kernels run on any x86 CPU), the encoder's and
    the cross-attention keys' and values' int8 layers are packed for oneDNN, the decoder step's
    stay with fbgemm; the translations agree with fbgemm's everywhere."""
    fbgemm = Translator.load(models["transformer"], device="cpu", precision="int8")
    monkeypatch.setattr(int8, "int8_tiles", lambda: True)
    onednn = Translator.load(models["transformer"], device="cpu", precision="int8")
    source = {id(m) for part in onednn.model.source_side() for m in part.modules()}
    layers = [(n, m) for n, m in onednn.model.named_modules() if isinstance(m, Int8Linear)]
    assert all(m.engine == ("onednn" if id(m) in source else "x86") for _, m in layers)
    assert {n for n, m in layers if m.engine == "onednn"} >= {
        "encoder_layers.0.ff.w_1", "decoder_layers.0.cross_attn.k_proj",
        "decoder_layers.0.cross_attn.v_proj"}  # fmt: skip
    assert onednn.model.decoder_layers[0].cross_attn.q_proj.engine == "x86"
    want, got = fbgemm.translate(LINES), onednn.translate(LINES)
    same = sum(a == b for a, b in zip(want, got, strict=True)) / len(LINES)
    assert same >= 0.9, f"{same:.0%} of lines equal to fbgemm's"


def test_stacked_layers_give_each_layers_outputs():
    """Int8Linear.stacked: q, k and v in one product, each part equal to its own layer's."""
    torch.manual_seed(0)
    layers = [Int8Linear.quantize(nn.Linear(32, n), full_range=True) for n in (32, 32, 48)]
    both = Int8Linear.stacked(layers)
    x = torch.randn(5, 32)
    torch.testing.assert_close(both(x), torch.cat([layer(x) for layer in layers], dim=1))
    assert both.out_features == 112 and both.in_features == 32


@pytest.mark.parametrize("bf16", [True, False])
def test_int8_keeps_attentions_keys_and_values_in_bf16_where_the_cpu_has_amx(monkeypatch, bf16):
    """for_decoding's int8: the memory's keys and values and the caches in bf16 on a CPU with
    AMX tiles (half the bytes attention reads), in fp32 elsewhere (AVX512-BF16 alone attends
    slower in bf16); fp32 decoding never."""
    from attnmt.decoding import precision

    from helpers import tiny_model

    monkeypatch.setattr(precision, "cpu_has_amx", lambda: bf16)
    model = precision.for_decoding(tiny_model("transformer").eval(), "int8")
    assert model.cache_dtype == (torch.bfloat16 if bf16 else None)
    assert precision.for_decoding(tiny_model("transformer").eval(), "fp32").cache_dtype is None


@pytest.mark.parametrize("amx", [True, False])
def test_a_decoder_layer_packed_both_ways_takes_onednn_for_many_rows(monkeypatch, amx: bool):
    """pack_both_ways: a call with few rows keeps fbgemm's packing, one with many takes
    oneDNN's (where the CPU has AMX tiles, or VNNI alone, from more outputs on); both give the
    layer's product. Without either, nothing is packed twice."""
    torch.manual_seed(0)
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch built without oneDNN's quantized engine")
    layer = Int8Linear.quantize(nn.Linear(64, 1024), full_range=True)
    monkeypatch.setattr(int8, "int8_tiles", lambda: False)
    monkeypatch.setattr(int8, "int8_hardware", lambda: False)
    int8.pack_both_ways([layer])
    assert layer.wide is None
    monkeypatch.setattr(int8, "int8_tiles", lambda: amx)
    monkeypatch.setattr(int8, "int8_hardware", lambda: True)
    int8.pack_both_ways([layer])
    assert layer.wide is not None
    assert layer.wide_outputs == (int8.WIDE_OUTPUTS if amx else int8.WIDE_OUTPUTS_VNNI)
    used = []
    real = torch.ops.quantized.linear_dynamic

    def spy(x, packed, reduce_range):
        used.append("wide" if packed is layer.wide else "packed")
        return real(x, packed, reduce_range)

    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic", spy)
    rows = max(int8.WIDE_ROWS, -(-layer.wide_outputs // layer.out_features))  # the first wide
    few, many = torch.randn(rows - 1, 64), torch.randn(rows, 64)
    for x in (few, many):
        expected = torch.nn.functional.linear(x, layer.q_weight.dequantize(), layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=0.05, atol=0.05)
    assert used == ["packed", "wide"]
