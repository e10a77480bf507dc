"""How tests/test_architecture.py and tests/test_architecture_files.py read the code: every
server module parsed once with `ast`, and every import statement in it as an edge (importer,
target, line, inside a function or not, under TYPE_CHECKING or not). No Django, no database.
The rules themselves are the tables in those two test modules.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The server's packages: every module in them is placed in a layer and checked.
# (bench/ is an interface: it drives the product, nothing in the product imports it.)
SERVER_PACKAGES = ("approvals", "audit", "console", "engine", "ownership", "notifications", "bench")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a first-party module, or the absolute name of a third-party one
    line: int
    in_function: bool
    type_checking: bool


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module
    source: str

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def server_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in SERVER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            source = path.read_text()
            name = _module_name(path)
            modules[name] = Module(name, path, ast.parse(source, str(path)), source)
    return modules


def _resolve(name: str) -> str:
    """The deepest first-party module that `import name` loads."""
    modules = server_modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if module.path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """The statement lists directly inside a statement (imports are statements, so walking
    only these finds every import without visiting expressions)."""
    blocks = [getattr(node, f, None) for f in ("body", "orelse", "finalbody")]
    blocks += [h.body for h in getattr(node, "handlers", ())]
    blocks += [c.body for c in getattr(node, "cases", ())]
    return [b for b in blocks if isinstance(b, list) and b and isinstance(b[0], ast.stmt)]


def import_nodes(
    tree: ast.Module,
) -> list[tuple[ast.Import | ast.ImportFrom, str | None, bool]]:
    """Every import statement with the function it is in (or None) and whether it sits in
    an `if TYPE_CHECKING:` block."""
    found: list[tuple[ast.Import | ast.ImportFrom, str | None, bool]] = []

    def walk(body: list[ast.stmt], function: str | None, type_checking: bool) -> None:
        for statement in body:
            if isinstance(statement, ast.Import | ast.ImportFrom):
                found.append((statement, function, type_checking))
            elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(statement.body, statement.name, type_checking)
            elif isinstance(statement, ast.If) and _is_type_checking(statement.test):
                walk(statement.body, function, True)
                walk(statement.orelse, function, type_checking)
            else:
                for block in blocks(statement):
                    walk(block, function, type_checking)

    walk(tree.body, None, False)
    return found


@functools.cache
def imports() -> tuple[Import, ...]:
    modules = server_modules()
    edges: list[Import] = []
    for module in modules.values():
        for node, function, type_checking in import_nodes(module.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(module, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            for target in targets:
                if target.split(".")[0] in SERVER_PACKAGES:
                    target = _resolve(target)
                if target and target != module.name:
                    edges.append(
                        Import(
                            module.name, target, node.lineno, function is not None, type_checking
                        )
                    )
    return tuple(dict.fromkeys(edges))


def first_party(edge: Import) -> bool:
    return edge.target in server_modules()


def place(edge: Import) -> str:
    return f"{server_modules()[edge.importer].rel}:{edge.line}"


def report(title: str, offenders: list[str], advice: str) -> str:
    lines = "\n  ".join(sorted(offenders))
    return f"{title} ({len(offenders)}):\n  {lines}\n{advice}"


def first_party_imports() -> list[Import]:
    """The imports of one server module by another (third-party imports left out)."""
    return [edge for edge in imports() if first_party(edge)]
