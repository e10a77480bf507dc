"""The shape of the code file by file (issue 10; tests/test_architecture.py holds the import
graph's rules): every import inside a function says why, no first-party module is over
600 lines, and every knob is read in settings.py. Change a table only with the architecture
(and ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

from tests.architecture import ROOT, Module, blocks, report, server_modules

# Imports inside functions that need no reason comment. Django documents AppConfig.ready
# as the place for imports that need the app registry (signals, checks).
FUNCTION_IMPORT_ALLOWED: tuple[tuple[str, str], ...] = (("*.apps", "ready"),)

MAX_MODULE_LINES = 600
# Everything first-party is measured, except these directories (anywhere in the path).
NOT_MEASURED_DIRS = frozenset(
    {".venv", ".git", "data", "tests", "migrations", "node_modules", "__pycache__", "build"}
)


# -- imports inside functions -------------------------------------------------------------

_NOT_A_REASON = re.compile(r"noqa(:\s*[A-Z0-9, ]+)?|type:\s*ignore(\[[^\]]*\])?|pragma:[^#]*")


def _is_reason(comment: str) -> bool:
    text = _NOT_A_REASON.sub("", comment.lstrip("#"))
    return len(re.findall(r"[A-Za-z]{2,}", text)) >= 2


def _comment(line: str) -> str:
    """The comment on a line of an import statement (imports hold no string literals, so
    every `#` starts a comment)."""
    return line[line.index("#") :] if "#" in line else ""


def _unexplained_function_imports(module: Module) -> list[str]:
    lines = module.source.splitlines()
    offenders: list[str] = []

    def comment_above(line: int) -> bool:
        above = line - 1
        return (
            above >= 1
            and lines[above - 1].lstrip().startswith("#")
            and _is_reason(lines[above - 1])
        )

    def trailing(node: ast.stmt) -> bool:
        end = node.end_lineno or node.lineno
        return any(_is_reason(_comment(lines[n - 1])) for n in range(node.lineno, end + 1))

    def check_body(body: list[ast.stmt], function: str) -> None:
        # One reason above a run of consecutive imports covers the run.
        group_explained = False
        for statement in body:
            if isinstance(statement, ast.Import | ast.ImportFrom):
                explained = comment_above(statement.lineno) or trailing(statement)
                group_explained = explained or group_explained
                if not group_explained:
                    offenders.append(
                        f"{module.rel}:{statement.lineno}  in {function}(): "
                        f"{lines[statement.lineno - 1].strip()}"
                    )
            else:
                group_explained = False

    def visit(body: list[ast.stmt], function: str | None) -> None:
        if function is not None:
            check_body(body, function)
        for statement in body:
            name = function
            if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
                name = statement.name
                if any(
                    fnmatch.fnmatchcase(module.name, m) and name == f
                    for m, f in FUNCTION_IMPORT_ALLOWED
                ):
                    continue
            for block in blocks(statement):
                visit(block, name)

    visit(module.tree.body, None)
    return offenders


def test_every_import_inside_a_function_says_why() -> None:
    offenders = [o for m in server_modules().values() for o in _unexplained_function_imports(m)]
    assert not offenders, report(
        "Imports inside functions without a reason",
        offenders,
        "Move the import to the top of the file. If it must stay (a cycle you cannot break, "
        "a heavy optional module, code that runs before django.setup()), say why in a "
        "one-line `# reason` comment on the line above or at the end of the line.",
    )


# -- knobs ---------------------------------------------------------------------------------

# The product's modules that may read the environment themselves: settings.py (where every
# knob is read, once, with its default), the ASGI/WSGI entry points (they name the settings
# module), and the embedded Redis CLI (`make run` starts it before Django is set up).
ENVIRONMENT_READERS = frozenset(
    {
        "console.settings",
        "console.asgi",
        "console.wsgi",
        "console.embedded_redis",
        # The credentials variable a kind names, read by the worker at each call (issue 39):
        # a secret that must never be kept, not a knob.
        "engine.targets.base",
    }
)
# bench/ is not the product: its own knobs (BENCH_DATABASE_URL, ...) are the harness's.
PRODUCT_PACKAGES = ("approvals", "audit", "console", "engine", "ownership")


def _knob_reads(module: Module) -> list[str]:
    """`getattr(settings, ...)` (a second default beside settings.py's) and reads of
    os.environ / os.getenv outside the modules allowed to."""
    found = []
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr"}
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "settings"
        ):
            found.append(f"{module.rel}:{node.lineno}  {node.func.id}(settings, ...)")
        elif (
            module.name not in ENVIRONMENT_READERS
            and isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr in {"environ", "getenv"}
        ):
            found.append(f"{module.rel}:{node.lineno}  os.{node.attr}")
    return found


def test_every_knob_is_read_in_settings() -> None:
    offenders = [
        o
        for m in server_modules().values()
        if m.name.split(".")[0] in PRODUCT_PACKAGES
        for o in _knob_reads(m)
    ]
    assert not offenders, report(
        "Knobs read outside console/settings.py",
        offenders,
        "Read the environment variable once in console/settings.py (with its default and a "
        "comment) and use settings.NAME; never a second default through getattr (issue 10).",
    )


# -- module size --------------------------------------------------------------------------


def _measured_files() -> list[Path]:
    files: list[Path] = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = [
            d for d in subdirs if d not in NOT_MEASURED_DIRS and not d.endswith(".egg-info")
        ]
        files += [Path(directory, n) for n in names if n.endswith(".py")]
    return sorted(files)


def test_no_first_party_module_is_over_600_lines() -> None:
    offenders = []
    for path in _measured_files():
        count = len(path.read_text().splitlines())
        if count > MAX_MODULE_LINES:
            offenders.append(f"{path.relative_to(ROOT)}: {count} lines")
    assert not offenders, report(
        f"Modules over {MAX_MODULE_LINES} lines",
        offenders,
        "Split by sub-domain into a package (approvals/api/ -> runs.py, actions.py, ...).",
    )
