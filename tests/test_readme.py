"""The README documents every config key with its default, and every CLI option."""

from pathlib import Path

import typer.main
from pydantic import BaseModel

from attnmt.cli import app
from attnmt.config import Config

README = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")


def keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = next(
            (
                a
                for a in getattr(ann, "__args__", (ann,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
        if sub is not None and name != "teacher_forcing":
            out += keys(sub, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", field.default))
    return out


def test_every_config_key_is_documented_with_its_default():
    rows = [line for line in README.splitlines() if line.startswith("| `")]
    for key, default in keys(Config):
        if key.startswith("data.") and key != "data.max_len":
            assert f"`{key}" in README, key
            continue
        row = next((r for r in rows if f"`{key}`" in r.split("|")[1]), None)
        assert row is not None, f"{key} is not in a README config table"
        if isinstance(default, (int, float, str)) and not isinstance(default, bool):
            names = [n.strip(" `") for n in row.split("|")[1].split(",")]
            cell = row.split("|")[2].split(",")[names.index(key)].strip()
            assert cell == str(default) or float(cell) == float(default), (key, cell, default)


def test_every_cli_option_is_documented():
    for name, cmd in typer.main.get_command(app).commands.items():
        for param in cmd.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.opts[0] in README, f"attnmt {name} {param.opts[0]}"
