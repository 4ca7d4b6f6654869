"""The README is the front door and docs/ the manual: every config key with its default, every
command and option, every page linked, every link alive."""

import re
from pathlib import Path

import typer.main
from pydantic import BaseModel

from attnmt.cli.commands import app
from attnmt.config import Config

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
MANUAL_PAGES = ["training", "translating", "serving", "exporting", "configuration", "tm"]
MANUAL = "\n".join((ROOT / "docs" / f"{p}.md").read_text(encoding="utf-8") for p in MANUAL_PAGES)
CONFIG_PAGE = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


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
    rows = [line for line in CONFIG_PAGE.splitlines() if line.startswith("| `")]
    for key, default in keys(Config):
        if key.startswith("data.") and key != "data.max_len":
            assert f"`{key}" in CONFIG_PAGE, key
            continue
        row = next((r for r in rows if f"`{key}`" in r.split("|")[1]), None)
        assert row is not None, f"{key} is not in a config table of docs/configuration.md"
        if isinstance(default, (int, float, str)) and not isinstance(default, bool):
            names = [n.strip(" `") for n in row.split("|")[1].split(",")]
            cell = row.split("|")[2].split(",")[names.index(key)].strip()
            assert cell == str(default) or float(cell) == float(default), (key, cell, default)


def test_every_command_and_option_is_in_the_manual():
    for name, cmd in typer.main.get_command(app).commands.items():
        assert f"| `attnmt {name}" in README, f"attnmt {name}: a row of the README's table"
        # a group (attnmt tm): each of its commands has its section and options
        subs = getattr(cmd, "commands", {})
        for full, found in [(f"{name} {s}", c) for s, c in subs.items()] or [(name, cmd)]:
            assert f"## `attnmt {full}" in MANUAL, f"attnmt {full}: a section of the manual"
            for param in found.params:
                if param.param_type_name == "option" and param.name != "help":
                    assert param.opts[0] in MANUAL, f"attnmt {full} {param.opts[0]}"


def test_the_readme_is_a_front_door_linking_every_page():
    lines = README.splitlines()
    assert len(lines) <= 100, f"README.md: {len(lines)} lines (100 at most)"
    in_code = False
    for n, line in enumerate(lines, 1):
        in_code ^= line.startswith("```")
        if not in_code and not line.startswith(("|", "```")):
            assert len(line) <= 120, f"README.md:{n}: {len(line)} characters (120 at most)"
    for page in [*MANUAL_PAGES, "benchmarks"]:
        assert f"](docs/{page}.md" in README, f"docs/{page}.md is not linked from the README"


BENCHMARKS_LINES = 400  # docs/benchmarks.md: current tables, not a diary (docs/log/ is)
SECTION_LINES = 80  # one area's tables and the commands behind them


def test_every_figure_in_the_readme_is_in_the_benchmarks_tables():
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    tables = "\n".join(line for line in benchmarks.splitlines() if line.startswith("|"))
    table = README.split("## How fast, how good")[1].split("\n## ")[0]
    rows = [r for r in table.splitlines() if r.startswith("| [")]
    assert rows, "the README's table of figures"
    for row in rows:
        cells = row.split("|")[2:-1]  # attnmt's figure, the peer's, the ratio
        for figure in re.findall(r"\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+", " ".join(cells)):
            assert figure in tables, f"README figure {figure}: in no table of docs/benchmarks.md"


def test_the_benchmarks_page_is_current_tables_of_bounded_length():
    """docs/benchmarks.md holds the current figures (dated paragraphs go to docs/log/): at
    most BENCHMARKS_LINES lines, no section over SECTION_LINES, a table in every section,
    and every table row dated (its date or its table's command paragraph)."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_LINES, f"docs/benchmarks.md: {len(lines)} lines"
    sections: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("## "):
            sections[line] = []
        elif sections:
            sections[list(sections)[-1]].append(line)
    assert len(sections) >= 8, "one section per area"
    for title, body in sections.items():
        assert len(body) <= SECTION_LINES, f"{title}: {len(body)} lines"
        assert any(line.startswith("|") for line in body), f"{title}: no table"
        assert any(re.search(r"20\d\d-\d\d-\d\d", line) for line in body), f"{title}: no date"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            text = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_relative_links_point_at_files_and_headings_that_exist():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", text):
            path = doc.parent / target if target else doc
            assert path.exists(), f"{doc.name}: a link to {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.name}: a link to {target}#{anchor}"
