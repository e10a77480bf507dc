"""The shape of the code, enforced (ARCHITECTURE.md draws it; issue 10).

Plain `ast` over the files (read by tests/architecture.py): no Django, no database, well under
two seconds. The rules are the tables below — the layers, the libraries and isolation lines,
the verbs' documents — and in tests/test_architecture_files.py (imports inside functions,
module size); a failure lists every offender with what to do about it. Change a table only
with the architecture (and ARCHITECTURE.md) — never to make an offender pass.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
from collections import defaultdict
from pathlib import Path

from tests.architecture import (
    ROOT,
    SERVER_PACKAGES,
    Module,
    first_party,
    first_party_imports,
    import_nodes,
    imports,
    place,
    report,
    server_modules,
)

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
    ("engine", BASE),
    ("ownership", BASE),
    ("notifications", BASE),
    ("*.models", BASE),
    ("*.models.*", BASE),  # a models package split by sub-domain (approvals.models.plans)
    ("engine.core.errors", BASE),  # the one DomainError hierarchy: every layer raises it
    ("engine.core.jsonsafe", BASE),
    ("console.requestctx", BASE),
    ("console.advisory_locks", BASE),  # the advisory-lock namespaces, one place
    ("console.stale_plans", BASE),  # what a stale prepared plan's error looks like
    # the process's pooled Redis clients (one per URL), and the spans every layer opens
    # (OpenTelemetry, off unless configured): both below the core, which uses them
    ("console.redis_clients", BASE),
    ("console.tracing", BASE),
    ("audit.chain", BASE),
    ("audit.details", BASE),  # what may enter an event's details (redaction, jsonb-safe)
    ("audit.serialize", BASE),  # the one JSON shape of an event (API items, export)
    ("ownership.seed_data", BASE),
    # floor — what engine.core itself calls: the audit append (the barrier writes its
    # event in the same transaction) and the document rules (merge patch, diff,
    # proposed_document) the barrier applies.
    ("audit.services", FLOOR),
    ("audit.services.*", FLOOR),
    ("audit.verify", FLOOR),  # the chain walk under the checkpoint in audit.services
    ("audit.linker", FLOOR),  # events commit unlinked; the linker chains them in seq order
    ("console.compiled_query", FLOOR),  # ORM querysets compiled once, run with new values
    ("ownership.diff", FLOOR),
    ("ownership.history", FLOOR),  # a resource's documents by version token (issue 39)
    # core — lock, fence, barrier, undo, targets, the kill-switch check. No web, no service.
    ("engine.core", CORE),
    ("engine.core.*", CORE),  # managed_target: the managed adapter (needs the ORM: not in targets)
    ("engine.*", CORE),  # the target adapters (issue 39)
    # leaves — shared by services, import no service: delivery after commit, wake-ups,
    # the conflict reopen, the reference rows every database must have.
    ("approvals.outbox", LEAF),
    ("approvals.notify", LEAF),
    ("notifications.outbox", LEAF),  # delivery jobs enqueued after commit (their own queue)
    ("ownership.reopen", LEAF),
    ("ownership.targets", LEAF),  # a kind's adapter (managed or engine.targets), its mirrors
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
    ("console.login_throttle", WEB),  # sign-in throttling beside django-axes' pair lock
    ("console.templatetags", WEB),
    ("console.templatetags.*", WEB),
    # wiring — settings, URL confs, app configs, process entry points: import anything.
    ("*.settings", WIRING),
    ("console.urls", WIRING),
    ("console.urls_*", WIRING),
    ("bench.urls", WIRING),
    ("notifications.urls", WIRING),
    ("console.asgi", WIRING),
    ("console.serve", WIRING),  # the web processes' launcher (the Procfile's `web` line)
    ("console.wsgi", WIRING),
    ("console.checks", WIRING),
    ("console.embedded_redis", WIRING),
    ("console.logging_filters", WIRING),  # the filters LOGGING names (settings read them)
    ("console.pgbackend", WIRING),  # the DATABASES ENGINE: Django's, with a quiet pool check
    ("console.pgbackend.*", WIRING),
    ("*.apps", WIRING),
    # interfaces — parse, call one service or selector, render.
    ("*.api", INTERFACE),
    ("*.api.*", INTERFACE),
    ("*.views", INTERFACE),
    ("*.views.*", INTERFACE),
    ("ownership.catalog_views", INTERFACE),
    # an app's template tags render its pages' parts (the claim box, the diff views)
    ("*.templatetags", INTERFACE),
    ("*.templatetags.*", INTERFACE),
    ("console.people_views", INTERFACE),
    ("console.ops", INTERFACE),  # /healthz and /metrics
    ("console.health", INTERFACE),  # readiness (RQ's workers and cron): /readyz and doctor
    ("console.ops_gauges", INTERFACE),  # /metrics' operational gauges (dashboards, alerts)
    ("*.forms", INTERFACE),
    ("*.admin", INTERFACE),
    ("*.jobs", INTERFACE),
    ("approvals.worker", INTERFACE),  # the Procfile's worker class (loads the jobs up front)
    ("notifications.worker", INTERFACE),  # the Procfile's notify worker class (its jobs up front)
    ("notifications.delivery_pool", INTERFACE),  # the notify worker's threads (deliveries)
    ("notifications.dispatcher", INTERFACE),  # the notify worker's reader of the audit chain
    ("*.cron", INTERFACE),
    ("*.management", INTERFACE),
    ("*.management.commands", INTERFACE),
    ("*.management.commands.*", INTERFACE),
    ("console.management.demo_target", INTERFACE),  # the demo's git repository and kind
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
        "engine.targets*",
        ("approvals*", "audit*", "console*", "ownership*", "bench*"),
        "the target adapters are framework-light: they import no app (the caller records)",
    ),
    (
        "[!b]*",  # every server package but bench
        ("bench*",),
        "the product never imports the bench",
    ),
)

# A public name of a service/selector module used only by tests is alive when one of these
# documents names it (as `name`): a verb kept for operators or the test suite on purpose.
VERB_DOCUMENTS = ("ARCHITECTURE.md", "README.md")

# The agent's client is its own package and speaks only HTTP.
CLIENT_DIRS = ("clients", "examples")

# This check's own files name modules and verbs as data: their names keep nothing alive.
ARCHITECTURE_CHECKS = frozenset(
    ROOT / "tests" / name
    for name in ("architecture.py", "test_architecture.py", "test_architecture_files.py")
)


def layer_of(name: str) -> int | None:
    for pattern, layer in LAYERS:
        if fnmatch.fnmatchcase(name, pattern):
            return layer
    return None


# -- layers -----------------------------------------------------------------------------


def test_it_places_every_server_module_in_a_layer() -> None:
    unplaced = [name for name in server_modules() if layer_of(name) is None]
    assert not unplaced, report(
        "Modules in no layer",
        unplaced,
        "Add a row to LAYERS at the top of tests/test_architecture.py (and to ARCHITECTURE.md).",
    )


def test_no_module_imports_a_higher_layer() -> None:
    offenders = []
    for edge in first_party_imports():
        low, high = layer_of(edge.importer), layer_of(edge.target)
        if low is not None and high is not None and high > low:
            offenders.append(
                f"{place(edge)}  {edge.importer} ({LAYER_NAMES[low]}) imports "
                f"{edge.target} ({LAYER_NAMES[high]})"
            )
    assert not offenders, report(
        "Imports from a lower layer to a higher one",
        offenders,
        "Move the code down to the lowest layer that needs it (a leaf, engine/core, the "
        "models), pass the value in as an argument, or enqueue by dotted path.",
    )


def test_the_domain_layers_import_no_web_framework_and_services_no_job_queue() -> None:
    offenders = []
    for edge in imports():
        layer = layer_of(edge.importer)
        forbidden = FORBIDDEN_LIBRARIES.get(layer) if layer is not None else None
        if not forbidden or first_party(edge):
            continue
        if any(edge.target == lib or edge.target.startswith(lib + ".") for lib in forbidden):
            offenders.append(
                f"{place(edge)}  {edge.importer} ({LAYER_NAMES[layer]}) imports {edge.target}"
            )
    assert not offenders, report(
        "Domain modules importing the web layer or the job queue",
        offenders,
        "Requests, responses, schemas and templates belong to interfaces; services enqueue "
        "through approvals.outbox.",
    )


def test_isolated_packages_import_no_other_app() -> None:
    offenders = []
    for edge in first_party_imports():
        for importer, forbidden, why in ISOLATION:
            if fnmatch.fnmatchcase(edge.importer, importer) and any(
                fnmatch.fnmatchcase(edge.target, pattern) for pattern in forbidden
            ):
                offenders.append(f"{place(edge)}  {edge.importer} imports {edge.target}: {why}")
    assert not offenders, report(
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
        for node, _, _ in import_nodes(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] * (node.level == 0)
            )
            for name in names:
                if name.split(".")[0] in SERVER_PACKAGES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}  imports {name}")
    assert not offenders, report(
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
    for edge in first_party_imports():
        # Inside functions counts; TYPE_CHECKING imports never run.
        if not edge.type_checking:
            graph[edge.importer].add(edge.target)
            where.setdefault((edge.importer, edge.target), place(edge))
    offenders = []
    for component in _cycles(graph):
        members = set(component)
        links = [f"{where[(a, b)]} {a} -> {b}" for a in component for b in graph[a] if b in members]
        offenders.append(f"cycle of {len(component)}: " + "; ".join(sorted(links)))
    assert not offenders, report(
        "Import cycles",
        offenders,
        "Break each with a small leaf module both sides can import (as approvals/outbox.py "
        "did), or by moving the shared code down a layer.",
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
        if path not in ARCHITECTURE_CHECKS:
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
    assert not offenders, report(
        "Public service/selector names that are dead or needlessly public",
        offenders,
        "Each service verb and selector exists because an interface, a job, a command or "
        "another service calls it (issue 10: delete unused functions).",
    )
