"""Issue 78: the decoding options are declared once (attnmt.decoding.options) and every
surface is made from the declaration. This test walks it: each option reaches the CLI
commands it names, the Python API, the HTTP schema and the ONNX/web manifest with its bounds,
default and help, or is refused there by name; a surface that misses one fails it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
import typer

from attnmt import Translator
from attnmt.cli.commands import app
from attnmt.config import DecodeConfig
from attnmt.decoding.options import OPTIONS, SAMPLING, api_arguments, exports_note
from attnmt.errors import AttnmtError
from attnmt.serve.schema import TranslateRequest

COMMANDS = {"translate", "eval", "distill"}  # the commands that search with a model


def cli_params(command: str) -> dict[str, Any]:
    """The command's options (typer's click parameters) by each of their flags."""
    found = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {flag: p for p in found.params for flag in p.opts}


def outside(option) -> list[Any]:
    """Values the option must refuse: just past each bound, a wrong type, a wrong choice."""
    if option.choices:
        return ["nope", 1]
    wrong_type = "5" if option.kind is int else "0.5"
    step = 1 if option.kind is int else 0.001
    return [option.low - step, option.high + step, wrong_type, True]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_cli_command_takes_the_option_as_declared(name: str):
    option = OPTIONS[name]
    assert set(option.commands) <= COMMANDS
    for command in COMMANDS:
        params = cli_params(command)
        if command not in option.commands:
            assert option.flag not in params
            continue
        param = params[option.flag]
        assert param.help == option.help and param.default == option.default
        if option.short:
            assert option.short in param.opts
        if option.choices:
            assert get_args(param.type_descriptor.annotation) == option.choices
        else:
            assert (param.min, param.max) == (option.low, option.high)


def test_cli_refuses_an_option_out_of_bounds_in_one_line(trained, run_cli):
    model, _ = trained
    for name, option in OPTIONS.items():
        value = "nope" if option.choices else str(option.high + 1)
        result = run_cli("translate", "-m", str(model), option.flag, value, stdin=b"w1\n")
        assert result.code == 2, (name, result)
        assert option.flag in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_api_refuses_by_name_what_the_declaration_refuses(trained, name: str):
    model, _ = trained
    translator = Translator.load(model, device="cpu")
    option = OPTIONS[name]
    sampling = option.group == SAMPLING
    for value in outside(option):
        with pytest.raises(AttnmtError, match=f"^{name} .*expected {re.escape(option.bounds())}$"):
            asked = {name: value} | ({} if sampling or name == "beam" else {"beam": 100})
            translator.options(**api_arguments(asked, sampling))
    # Inside the bounds: taken, and it reaches the search's options.
    inside = option.choices[-1] if option.choices else option.high if name == "beam" else option.low
    asked = {name: inside} | ({} if sampling or name == "beam" else {"beam": 100})
    method = translator.options(**api_arguments(asked, sampling)).method
    held = {"beam": "size"}.get(name, name)
    assert getattr(method, held) == inside


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_http_schema_is_the_declaration(name: str):
    option = OPTIONS[name]
    schema = TranslateRequest.model_json_schema()
    where = schema["$defs"]["SamplingRequest"] if option.group else schema
    field = where["properties"][name]
    assert field["description"] == option.help and field.get("default") == option.default
    kinds = field.get("anyOf", [field])
    if option.choices:
        assert kinds[0]["enum"] == list(option.choices)
    else:
        assert (kinds[0]["minimum"], kinds[0]["maximum"]) == (option.low, option.high)
    for value in outside(option):  # refused by the schema, the field named (422)
        body = {"text": ["a"]}
        body |= {"sampling": {name: value}} if option.group else {name: value}
        with pytest.raises(ValueError, match=name):
            TranslateRequest.model_validate(body)


@pytest.mark.parametrize("name", [n for n, o in OPTIONS.items() if o.default is None])
def test_the_models_decode_section_bounds_agree(name: str):
    """An option whose default is the model's: the config's field takes the same values."""
    option = OPTIONS[name]
    field = DecodeConfig.model_json_schema()["properties"][name]
    if option.choices:
        assert tuple(field["enum"]) == option.choices
    else:
        assert (field["minimum"], field["maximum"]) == (option.low, option.high)


def test_the_export_carries_each_option_or_says_it_cannot(tmp_path: Path, trained, run_cli):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from attnmt.interop.onnx import MANIFEST

    model, corpus = trained
    out = tmp_path / "onnx"
    result = run_cli("export", str(model), str(out), "--format", "onnx")
    assert result.code == 0, result.stderr
    info = json.loads((out / MANIFEST).read_text())
    assert set(info["options"]) | set(info["not_supported"]) == set(OPTIONS)
    assert not set(info["options"]) & set(info["not_supported"])
    decode = DecodeConfig()
    for name, given in info["options"].items():
        option = OPTIONS[name]
        default = getattr(decode, name) if option.default is None else option.default
        assert given["default"] == default
        bounds = {"choices": list(option.choices)} if option.choices else {
            "min": option.low, "max": option.high}  # fmt: skip
        assert {k: v for k, v in given.items() if k != "default"} == bounds
    for name, why in info["not_supported"].items():
        assert why == OPTIONS[name].not_exported and name in exports_note()
    assert f"note: {exports_note()}" in result.stdout
    # The agreement check searches as the manifest says: greedy and the model's beam.
    dev = corpus["dev_src"]
    K = info["beam_size"]
    assert f"(greedy, 20 sentences of {dev}): 20/20 identical" in result.stdout
    assert f"(beam {K}, 20 sentences of {dev}): 20/20 identical" in result.stdout


def test_every_option_reaches_the_server(trained):
    """A real HTTP client on a loopback port: each option the schema takes gives what the
    API gives with it (length_norm was missing from HTTP before issue 78)."""
    import httpx

    from helpers import serve

    model, corpus = trained
    lines = corpus["dev_src"].read_text().splitlines()[:6]
    ours = Translator.load(model, device="cpu")
    asked = {"beam": 4, "n_best": 2, "length_penalty": 0.3, "length_norm": "length"}
    draws = {"temperature": 0.7, "top_k": 5, "seed": 11}
    assert set(asked) | set(draws) == set(OPTIONS)
    proc, url = serve(model)
    try:
        for body, sampling in ((asked, False), ({"n_best": 2, "sampling": draws}, True)):
            got = httpx.post(f"{url}/translate", json={"text": lines, **body}, timeout=60)
            assert got.status_code == 200, got.text
            named = {k: v for k, v in body.items() if k != "sampling"} | (draws if sampling else {})
            want = ours.search(lines, ours.options(**api_arguments(named, sampling)))
            texts = [[h["text"] for h in found] for found in got.json()["n_best"]]
            assert texts == [[h.text for h in found] for found in want]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
