"""The layout checker behind tests/test_layout.py: which attnmt modules a module imports,
however it spells the import, and which floor each package stands on.

An import counts in every form Python accepts: `import attnmt.x`, `from attnmt import x`
(with a name the root package hands out lazily, `from attnmt import Translator`, counted as
the module it comes from), relative imports (`from ..models import x`, resolved against the
module's package), `import attnmt` followed by attribute access (`attnmt.models.build`), and
the dynamic forms `importlib.import_module("attnmt.x")` (by keyword, relative to a package
given, or under another name), `__import__("attnmt.x")` (its `fromlist` too, and the module it
returns bound to a name, then attribute access), `sys.modules["attnmt.x"]` and
`importlib.resources` lookups of a package by name. A dynamic import whose name is not a
literal cannot be checked, so it is refused outright.
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


def imported_names(
    name: str, path: Path, tree: ast.Module, top: str, lazy: dict[str, str] | None = None
) -> Iterator[str]:
    """Dotted names `name` imports in any form (see the module docstring); a dynamic import
    of a name that is not a literal yields '?'. `lazy`: the names the root package hands out
    from other modules (lazy_names)."""
    bound: set[str] = set()  # local names bound to the package itself (import attnmt [as a])
    dynamic = _dynamic_names(tree)
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
                yield from ((lazy or {}).get(a.name, top) for a in node.names)
        elif isinstance(node, ast.Call):
            yield from _dynamic(node, top, dynamic, name, path)
        elif isinstance(node, ast.Subscript):
            yield from _sys_modules(node, top)
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and top in _dynamic(node.value, top, dynamic, name, path)
        ):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain and chain[0] in bound:
                yield ".".join([top, *chain[1:]] if chain[0] != top else chain)


def _dynamic_names(tree: ast.Module) -> set[str]:
    """DYNAMIC with the other names a module gives the importers: `from importlib import
    import_module as im`, `im = importlib.import_module`, `imp = __import__`."""
    names = set(DYNAMIC)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "importlib":
            names |= {a.asname for a in node.names if a.asname and a.name in DYNAMIC}
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Attribute, ast.Name)):
            value = node.value
            called = value.attr if isinstance(value, ast.Attribute) else value.id
            if called in ("import_module", "__import__"):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _dynamic(
    call: ast.Call, top: str, dynamic: set[str], name: str = "", path: Path | None = None
) -> Iterator[str]:
    """What a call to an importer names: its first argument or `name=` keyword, resolved
    against the `package` given when relative, with __import__'s `fromlist`."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called not in dynamic:
        return
    keywords = {k.arg: k.value for k in call.keywords}
    first = call.args[0] if call.args else keywords.get("name")
    if first is None:
        return
    importer = called not in ("files", "read_text", "open_text", "path")
    target = _literal(first)
    if target is not None and target.startswith(".") and importer:
        anchor = call.args[1] if len(call.args) > 1 else keywords.get("package")
        package = _literal(anchor) if anchor is not None else None
        target = None if package is None else _resolve(target, package)
    if target is None:
        if importer:
            yield "?"
        return
    if target.split(".")[0] == top:
        yield target
        fromlist = call.args[3] if len(call.args) > 3 else keywords.get("fromlist")
        if isinstance(fromlist, (ast.List, ast.Tuple)):
            for item in fromlist.elts:
                if (member := _literal(item)) is not None:
                    yield f"{target}.{member}"
            if not all(_literal(item) is not None for item in fromlist.elts):
                yield "?"
        elif fromlist is not None:
            yield "?"


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _resolve(relative: str, package: str) -> str:
    """importlib's resolution of `.x` (and `..x`) against `package`."""
    level = len(relative) - len(relative.lstrip("."))
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    rest = relative[level:]
    return ".".join([*base, rest] if rest else base)


def _sys_modules(node: ast.Subscript, top: str) -> Iterator[str]:
    """`sys.modules["attnmt.x"]`: a module by name, as an import names it."""
    value = node.value
    if not (isinstance(value, ast.Attribute) and value.attr == "modules"):
        return
    if not (isinstance(value.value, ast.Name) and value.value.id == "sys"):
        return
    key = _literal(node.slice)
    if key is None:
        yield "?"
    elif key.split(".")[0] == top:
        yield key


def lazy_names(root: Path) -> dict[str, str]:
    """The names the root package's __init__ imports from its modules (handed out lazily by
    its __getattr__, as `from attnmt import Translator`): name -> module."""
    tree = ast.parse((root / "__init__.py").read_text())
    return {
        a.asname or a.name: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
        and node.module.split(".")[0] == root.name
        for a in node.names
    }  # fmt: skip


def _attribute_chain(node: ast.Attribute) -> list[str]:
    names: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return []
    return [current.id, *reversed(names)]


def imports(
    name: str,
    path: Path,
    tree: ast.Module,
    known: set[str],
    top: str,
    lazy: dict[str, str] | None = None,
) -> set[str]:
    """The package's modules `name` imports, its own submodules excepted; '?' for a dynamic
    import that cannot be read."""
    found = set()
    for target in imported_names(name, path, tree, top, lazy):
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
    top, lazy = root.name, lazy_names(root)
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
        for other in sorted(imports(name, path, tree, set(found), top, lazy)):
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
    known, lazy = set(found), lazy_names(root)
    return {n: imports(n, p, t, known, root.name, lazy) - {"?"} for n, (p, t) in found.items()}
