"""The package's shape, as docs/development.md describes it: imports flow one way, no module
state behind `global`, the public API below the trainer, and modules and functions short enough
to read."""

import ast
from pathlib import Path

import attnmt

PACKAGE = Path(attnmt.__file__).parent
LONG_FUNCTION = 80  # lines; a longer one says why in a comment starting with "# Long:"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The attnmt modules `name` imports anywhere in its file (TYPE_CHECKING and function
    bodies included), a package's own submodules excepted."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and not t.startswith(name + ".")}
    return found - {name}


# The floors, lowest first (docs/development.md): a module may import its own floor and those
# below it, never one above. The package's root re-exports Translator lazily and `__main__`
# runs the CLI: both stand outside the floors.
FLOORS = ["ground", "data", "kernels", "models", "decoding", "training", "apps", "cli"]
GROUND = {"attnmt.config", "attnmt.device", "attnmt.errors"}
OUTSIDE = {"attnmt", "attnmt.__main__"}


def floor(name: str) -> int:
    if name in GROUND:
        return 0
    sub = name.split(".")[1]
    assert sub in FLOORS, f"{name}: every module lives in a subpackage or on the ground floor"
    return FLOORS.index(sub)


def test_each_subpackage_imports_only_floors_below_it():
    modules = _modules()
    for name, tree in modules.items():
        if name in OUTSIDE:
            continue
        for other in _imports(name, tree, set(modules)) - OUTSIDE:
            assert floor(other) <= floor(name), f"{name} imports {other}, a floor above it"


def test_every_subpackage_says_what_it_holds():
    for sub in FLOORS[1:]:
        doc = ast.get_docstring(ast.parse((PACKAGE / sub / "__init__.py").read_text()))
        where = f"attnmt/{sub}/__init__.py"
        assert doc and "import" in doc.lower(), f"{where}: say what it holds and may import"


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import circle: " + " -> ".join([*path, name])
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_no_global_statement_and_short_modules():
    for name, tree in _modules().items():
        assert not any(isinstance(n, ast.Global) for n in ast.walk(tree)), name
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines <= 700, f"{path.relative_to(PACKAGE.parent)}: {lines} lines (700 at most)"


def test_long_functions_say_why():
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = lines[node.lineno - 1 : node.end_lineno]
                if len(body) > LONG_FUNCTION:
                    assert any(line.strip().startswith("# Long:") for line in body), (
                        f"{path.name}:{node.lineno}: {node.name} has {len(body)} lines"
                    )
