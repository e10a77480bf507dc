"""The shape of the code, enforced (ARCHITECTURE.md draws it; issue 10).

Plain `ast` over the files: no Django, no database, well under two seconds. The rules are
the tables below; a failure lists every offender with what to do about it. Change a table
only with the architecture (and ARCHITECTURE.md) — never to make an offender pass.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The server's packages: every module in them is placed in a layer and checked.
# (bench/ is an interface: it drives the product, nothing in the product imports it.)
SERVER_PACKAGES = ("approvals", "audit", "console", "ownership", "bench")

# Layers from the bottom. A module may import its own layer or a lower one, never a higher
# one. Each module gets the layer of the FIRST row whose pattern matches its dotted name
# (fnmatch; `*` also crosses dots), so specific rows come before general ones.
BASE, FLOOR, CORE, LEAF, SERVICE, WEB, INTERFACE, WIRING = range(8)
LAYER_NAMES = ("base", "floor", "core", "leaf", "service", "web", "interface", "wiring")
LAYERS: tuple[tuple[str, int], ...] = (
    # base — models and pure helpers with no I/O of their own; every layer may use them.
    ("approvals", BASE),  # the packages' empty __init__ modules
    ("audit", BASE),
    ("console", BASE),
    ("ownership", BASE),
    ("*.models", BASE),
    ("*.models.*", BASE),  # a models package split by sub-domain (approvals.models.plans)
    ("console.core.errors", BASE),  # the one DomainError hierarchy: every layer raises it
    ("console.core.jsonsafe", BASE),
    ("console.requestctx", BASE),
    ("audit.chain", BASE),
    ("audit.serialize", BASE),  # the one JSON shape of an event (API items, export)
    ("ownership.seed_data", BASE),
    # floor — what console.core itself calls: the audit append (the barrier writes its
    # event in the same transaction) and the document rules (merge patch, diff,
    # proposed_document) the barrier applies.
    ("audit.services", FLOOR),
    ("audit.services.*", FLOOR),
    ("audit.verify", FLOOR),  # the chain walk under the checkpoint in audit.services
    ("ownership.diff", FLOOR),
    # core — lock, fence, barrier, undo, targets, the kill-switch check. No web, no service.
    ("console.core", CORE),
    ("console.core.*", CORE),
    # leaves — shared by services, import no service: delivery after commit, wake-ups,
    # the conflict reopen, the reference rows every database must have.
    ("approvals.outbox", LEAF),
    ("approvals.notify", LEAF),
    ("ownership.reopen", LEAF),
    ("console.reference", LEAF),
    ("console.permissions", LEAF),  # role predicates over a user's groups and an Actor
    # services push, selectors pull: each business verb once, authorisation inside it.
    ("*.services", SERVICE),
    ("*.services.*", SERVICE),
    ("*.selectors", SERVICE),
    ("*.selectors.*", SERVICE),
    ("console.people", SERVICE),
    # web — request plumbing shared by API modules and pages.
    ("console.problems", WEB),  # problem+json rendering of a DomainError (the status table)
    ("console.pages", WEB),
    ("console.api_support", WEB),
    ("console.auth", WEB),
    ("console.middleware", WEB),
    ("console.context_processors", WEB),
    ("console.client_ip", WEB),
    ("console.templatetags", WEB),
    ("console.templatetags.*", WEB),
    # wiring — settings, URL confs, app configs, process entry points: import anything.
    ("*.settings", WIRING),
    ("console.urls", WIRING),
    ("console.urls_*", WIRING),
    ("bench.urls", WIRING),
    ("console.asgi", WIRING),
    ("console.wsgi", WIRING),
    ("console.checks", WIRING),
    ("console.embedded_redis", WIRING),
    ("*.apps", WIRING),
    # interfaces — parse, call one service or selector, render.
    ("*.api", INTERFACE),
    ("*.api.*", INTERFACE),
    ("*.views", INTERFACE),
    ("*.views.*", INTERFACE),
    ("console.people_views", INTERFACE),
    ("console.ops", INTERFACE),  # /healthz and /metrics
    ("*.forms", INTERFACE),
    ("*.admin", INTERFACE),
    ("*.jobs", INTERFACE),
    ("*.cron", INTERFACE),
    ("*.management", INTERFACE),
    ("*.management.commands", INTERFACE),
    ("*.management.commands.*", INTERFACE),
    ("bench", INTERFACE),
    ("bench.*", INTERFACE),
)

# Third-party modules a layer may not import (prefix match): the web and the job queue
# stay out of the domain. The outbox leaf is the one place that talks to RQ.
_WEB_LIBRARIES = (
    "django.http",
    "django.shortcuts",
    "django.template",
    "django.urls",
    "django.views",
    "ninja",
    "django_htmx",
    "template_partials",
)
_QUEUE_LIBRARIES = ("rq", "django_rq")
FORBIDDEN_LIBRARIES: dict[int, tuple[str, ...]] = {
    BASE: _WEB_LIBRARIES + _QUEUE_LIBRARIES,
    FLOOR: _WEB_LIBRARIES + _QUEUE_LIBRARIES,
    CORE: _WEB_LIBRARIES + _QUEUE_LIBRARIES,
    LEAF: _WEB_LIBRARIES,
    SERVICE: _WEB_LIBRARIES + _QUEUE_LIBRARIES,
}

# Packages that may not import other first-party packages at all: (importer pattern,
# forbidden imported patterns, why).
ISOLATION: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "audit*",
        ("approvals*", "ownership*", "bench*"),
        "audit is the ground floor of the domain: it imports no other app",
    ),
    (
        "[!b]*",  # every server package but bench
        ("bench*",),
        "the product never imports the bench",
    ),
)

# Imports inside functions that need no reason comment. Django documents AppConfig.ready
# as the place for imports that need the app registry (signals, checks).
FUNCTION_IMPORT_ALLOWED: tuple[tuple[str, str], ...] = (("*.apps", "ready"),)

MAX_MODULE_LINES = 600
# Everything first-party is measured, except these directories (anywhere in the path).
NOT_MEASURED_DIRS = frozenset(
    {".venv", ".git", "data", "tests", "migrations", "node_modules", "__pycache__", "build"}
)

# A public name of a service/selector module used only by tests is alive when one of these
# documents names it (as `name`): a verb kept for operators or the test suite on purpose.
VERB_DOCUMENTS = ("ARCHITECTURE.md", "README.md")

# The agent's client is its own package and speaks only HTTP.
CLIENT_DIRS = ("clients", "examples")


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


def layer_of(name: str) -> int | None:
    for pattern, layer in LAYERS:
        if fnmatch.fnmatchcase(name, pattern):
            return layer
    return None


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


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """The statement lists directly inside a statement (imports are statements, so walking
    only these finds every import without visiting expressions)."""
    blocks = [getattr(node, f, None) for f in ("body", "orelse", "finalbody")]
    blocks += [h.body for h in getattr(node, "handlers", ())]
    blocks += [c.body for c in getattr(node, "cases", ())]
    return [b for b in blocks if isinstance(b, list) and b and isinstance(b[0], ast.stmt)]


def _import_nodes(
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
                for block in _blocks(statement):
                    walk(block, function, type_checking)

    walk(tree.body, None, False)
    return found


@functools.cache
def imports() -> tuple[Import, ...]:
    modules = server_modules()
    edges: list[Import] = []
    for module in modules.values():
        for node, function, type_checking in _import_nodes(module.tree):
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


def _first_party(edge: Import) -> bool:
    return edge.target in server_modules()


def _where(edge: Import) -> str:
    return f"{server_modules()[edge.importer].rel}:{edge.line}"


def _report(title: str, offenders: list[str], advice: str) -> str:
    lines = "\n  ".join(sorted(offenders))
    return f"{title} ({len(offenders)}):\n  {lines}\n{advice}"


# -- layers -----------------------------------------------------------------------------


def test_it_places_every_server_module_in_a_layer() -> None:
    unplaced = [name for name in server_modules() if layer_of(name) is None]
    assert not unplaced, _report(
        "Modules in no layer",
        unplaced,
        "Add a row to LAYERS at the top of tests/test_architecture.py (and to ARCHITECTURE.md).",
    )


def test_no_module_imports_a_higher_layer() -> None:
    offenders = []
    for edge in imports():
        if not _first_party(edge):
            continue
        low, high = layer_of(edge.importer), layer_of(edge.target)
        if low is not None and high is not None and high > low:
            offenders.append(
                f"{_where(edge)}  {edge.importer} ({LAYER_NAMES[low]}) imports "
                f"{edge.target} ({LAYER_NAMES[high]})"
            )
    assert not offenders, _report(
        "Imports from a lower layer to a higher one",
        offenders,
        "Move the code down to the lowest layer that needs it (a leaf, console/core, the "
        "models), pass the value in as an argument, or enqueue by dotted path.",
    )


def test_the_domain_layers_import_no_web_framework_and_services_no_job_queue() -> None:
    offenders = []
    for edge in imports():
        layer = layer_of(edge.importer)
        forbidden = FORBIDDEN_LIBRARIES.get(layer) if layer is not None else None
        if not forbidden or _first_party(edge):
            continue
        if any(edge.target == lib or edge.target.startswith(lib + ".") for lib in forbidden):
            offenders.append(
                f"{_where(edge)}  {edge.importer} ({LAYER_NAMES[layer]}) imports {edge.target}"
            )
    assert not offenders, _report(
        "Domain modules importing the web layer or the job queue",
        offenders,
        "Requests, responses, schemas and templates belong to interfaces; services enqueue "
        "through approvals.outbox.",
    )


def test_isolated_packages_import_no_other_app() -> None:
    offenders = []
    for edge in imports():
        if not _first_party(edge):
            continue
        for importer, forbidden, why in ISOLATION:
            if fnmatch.fnmatchcase(edge.importer, importer) and any(
                fnmatch.fnmatchcase(edge.target, pattern) for pattern in forbidden
            ):
                offenders.append(f"{_where(edge)}  {edge.importer} imports {edge.target}: {why}")
    assert not offenders, _report(
        "Imports across an isolation line",
        offenders,
        "Invert the dependency: the other app calls audit (or bench calls the product).",
    )


def _client_files() -> list[Path]:
    files: list[Path] = []
    for directory in CLIENT_DIRS:
        files += [p for p in sorted((ROOT / directory).rglob("*.py")) if "tests" not in p.parts]
    return files


def test_the_client_and_the_examples_import_nothing_from_the_server() -> None:
    offenders = []
    for path in _client_files():
        for node, _, _ in _import_nodes(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] * (node.level == 0)
            )
            for name in names:
                if name.split(".")[0] in SERVER_PACKAGES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}  imports {name}")
    assert not offenders, _report(
        "Client code importing the server",
        offenders,
        "airlock-client speaks only the public REST API; copy the constant, do not import it.",
    )


# -- cycles -----------------------------------------------------------------------------


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_there_is_no_import_cycle_among_first_party_modules() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for edge in imports():
        # Inside functions counts; TYPE_CHECKING imports never run.
        if _first_party(edge) and not edge.type_checking:
            graph[edge.importer].add(edge.target)
            where.setdefault((edge.importer, edge.target), _where(edge))
    offenders = []
    for component in _cycles(graph):
        members = set(component)
        links = [f"{where[(a, b)]} {a} -> {b}" for a in component for b in graph[a] if b in members]
        offenders.append(f"cycle of {len(component)}: " + "; ".join(sorted(links)))
    assert not offenders, _report(
        "Import cycles",
        offenders,
        "Break each with a small leaf module both sides can import (as approvals/outbox.py "
        "did), or by moving the shared code down a layer.",
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
            for block in _blocks(statement):
                visit(block, name)

    visit(module.tree.body, None)
    return offenders


def test_every_import_inside_a_function_says_why() -> None:
    offenders = [o for m in server_modules().values() for o in _unexplained_function_imports(m)]
    assert not offenders, _report(
        "Imports inside functions without a reason",
        offenders,
        "Move the import to the top of the file. If it must stay (a cycle you cannot break, "
        "a heavy optional module, code that runs before django.setup()), say why in a "
        "one-line `# reason` comment on the line above or at the end of the line.",
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
    assert not offenders, _report(
        f"Modules over {MAX_MODULE_LINES} lines",
        offenders,
        "Split by sub-domain into a package (approvals/api/ -> runs.py, actions.py, ...).",
    )


# -- every public service and selector is used ------------------------------------------


def _public_names(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(name, line, is_function) for the functions, classes and UPPER_CASE constants a
    module defines at its top level and does not mark `_private`."""
    names: list[tuple[str, int, bool]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.append((node.name, node.lineno, True))
        elif isinstance(node, ast.ClassDef):
            names.append((node.name, node.lineno, False))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [
                (t.id, node.lineno, False)
                for t in targets
                if isinstance(t, ast.Name) and t.id.isupper()
            ]
    return [entry for entry in names if not entry[0].startswith("_")]


_DOTTED = re.compile(r"^[A-Za-z_][\w.]*$")


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name a file uses (not defines): loads, attributes, imported names, and the last
    part of dotted-path strings (jobs and settings name code by its path)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rpartition(".")[2])
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _DOTTED.match(node.value)
        ):
            found.add(node.value.rpartition(".")[2])
    return found


@functools.cache
def _references() -> tuple[dict[Path, set[str]], set[str]]:
    """(names used per product/bench/scripts file, names used by any test file)."""
    code = {m.path: _identifiers(m.tree) for m in server_modules().values()}
    for extra in [ROOT / "manage.py", *sorted((ROOT / "scripts").glob("*.py"))]:
        if extra.exists():
            code[extra] = _identifiers(ast.parse(extra.read_text(), str(extra)))
    tests: set[str] = set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path != Path(__file__).resolve():
            tests |= _identifiers(ast.parse(path.read_text(), str(path)))
    return code, tests


def _documented_verbs() -> set[str]:
    verbs: set[str] = set()
    for document in VERB_DOCUMENTS:
        path = ROOT / document
        if path.exists():
            verbs |= set(re.findall(r"`([A-Za-z_]\w*)(?:\(\))?`", path.read_text()))
    return verbs


def _unused_reason(name: str, is_function: bool, module: Module) -> str | None:
    """Why a public name of a service/selector module is not alive, or None when it is.

    Alive: product code (app, interfaces, bench, scripts) in another module uses it; or its
    own module uses it (a class, a constant, or a function the tests also call directly);
    or only tests use it and ARCHITECTURE.md/README.md names it as a verb kept on purpose.
    """
    code, tests = _references()
    if any(name in used for path, used in code.items() if path != module.path):
        return None
    in_module, in_tests = name in code[module.path], name in tests
    if in_module and (not is_function or in_tests):
        return None
    if in_module:
        return "is called only inside its module: make it `_private`"
    if in_tests and name in _documented_verbs():
        return None
    if in_tests:
        return (
            "is used only by tests: call it from an interface, name it in ARCHITECTURE.md, "
            "or delete it"
        )
    return "is used by nothing: delete it"


def test_every_public_name_of_a_service_or_selector_is_used() -> None:
    offenders = []
    for module in server_modules().values():
        if layer_of(module.name) != SERVICE:
            continue
        for name, line, is_function in _public_names(module.tree):
            reason = _unused_reason(name, is_function, module)
            if reason is not None:
                offenders.append(f"{module.rel}:{line}  {module.name}.{name} {reason}")
    assert not offenders, _report(
        "Public service/selector names that are dead or needlessly public",
        offenders,
        "Each service verb and selector exists because an interface, a job, a command or "
        "another service calls it (issue 10: delete unused functions).",
    )
