"""The layout checker behind tests/test_layout.py: which attnmt modules a module imports,
however it spells the import, and which floor each package stands on.

An import counts in every form Python accepts: `import attnmt.x`, `from attnmt import x`,
relative imports (`from ..models import x`, resolved against the module's package),
`import attnmt` followed by attribute access (`attnmt.models.build`), and the dynamic forms
`importlib.import_module("attnmt.x")`, `__import__("attnmt.x")` and `importlib.resources`
lookups of a package by name. A dynamic import whose name is not a literal cannot be checked,
so it is refused outright.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The floors, lowest first (docs/development.md): a module may import its own package and
# the packages on floors below, never one above, nor another package on its own floor (the
# rooms of a floor share no concern). The ground floor is three modules, not a package.
FLOORS: list[set[str]] = [
    {"config", "device", "errors"},
    {"data"},
    {"kernels"},
    {"models"},
    {"decoding"},
    {"training"},
    {"serve", "interop"},
    {"cli"},
]
GROUND = FLOORS[0]
OUTSIDE = {"__init__", "__main__"}  # the root re-exports Translator lazily; __main__ runs the CLI
DYNAMIC = {"import_module", "__import__", "files", "read_text", "open_text", "path"}


@dataclass(frozen=True)
class Problem:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def modules(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    """Every module under the package folder `root`, by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _relative(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from .x import y` names (level dots up from the package)."""
    parts = _package_of(name, path).split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_names(name: str, path: Path, tree: ast.Module, top: str) -> Iterator[str]:
    """Dotted names `name` imports in any form (see the module docstring); a dynamic import
    of a name that is not a literal yields '?'."""
    bound: set[str] = set()  # local names bound to the package itself (import attnmt [as a])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
                if alias.name.split(".")[0] == top:
                    bound.add(alias.asname or top)
        elif isinstance(node, ast.ImportFrom):
            module = _relative(name, path, node) if node.level else node.module or ""
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)
            if module == top:
                bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Call):
            yield from _dynamic(node, top)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain and chain[0] in bound:
                yield ".".join([top, *chain[1:]] if chain[0] != top else chain)


def _dynamic(call: ast.Call, top: str) -> Iterator[str]:
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called not in DYNAMIC or not call.args:
        return
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        if first.value.split(".")[0] == top:
            yield first.value
    elif called in ("import_module", "__import__"):
        yield "?"


def _attribute_chain(node: ast.Attribute) -> list[str]:
    names: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return []
    return [current.id, *reversed(names)]


def imports(name: str, path: Path, tree: ast.Module, known: set[str], top: str) -> set[str]:
    """The package's modules `name` imports, its own submodules excepted; '?' for a dynamic
    import that cannot be read."""
    found = set()
    for target in imported_names(name, path, tree, top):
        if target == "?":
            found.add("?")
            continue
        parts = target.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()  # attnmt.models.build.build_model -> attnmt.models.build
        if parts:
            found.add(".".join(parts))
    return {t for t in found if not t.startswith(name + ".")} - {name}


def room(module: str) -> str | None:
    """The package (or ground-floor module) a dotted module name belongs to; None: outside."""
    parts = module.split(".")
    return None if len(parts) == 1 or parts[1] in OUTSIDE else parts[1]


def floor(room_name: str) -> int | None:
    return next((i for i, rooms in enumerate(FLOORS) if room_name in rooms), None)


def check(root: Path) -> list[Problem]:
    """Everything in the package at `root` that breaks the floors: a folder or module on no
    floor, an import of a floor above or of another room on the same floor, a dynamic import
    that cannot be checked."""
    found = modules(root)
    top = root.name
    problems = [
        Problem(str(p.relative_to(root.parent)), "a folder of Python modules on no floor")
        for p in sorted(root.iterdir())
        if p.is_dir() and any(p.rglob("*.py")) and floor(p.name) in (None, 0)
    ]
    for name, (path, tree) in found.items():
        mine = room(name)
        if mine is None:
            continue
        if floor(mine) is None:
            problems.append(Problem(name, "a module on no floor"))
            continue
        for other in sorted(imports(name, path, tree, set(found), top)):
            theirs = "?" if other == "?" else room(other)
            if theirs is None or theirs == mine:
                continue
            if theirs == "?":
                problems.append(Problem(name, "a dynamic import whose name is not a literal"))
            elif floor(theirs) is None or floor(theirs) > floor(mine):  # type: ignore[operator]
                problems.append(Problem(name, f"imports {other}, a floor above it"))
            elif floor(theirs) == floor(mine) and mine not in GROUND:
                problems.append(Problem(name, f"imports {other}, another room on its floor"))
    return problems


def graph(root: Path) -> dict[str, set[str]]:
    found = modules(root)
    known = set(found)
    return {n: imports(n, p, t, known, root.name) - {"?"} for n, (p, t) in found.items()}
