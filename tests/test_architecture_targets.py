"""Issue 39, enforced: Airlock's own store is one adapter among others. The barrier, the
executor, undo, the drain and the plan engine reach a kind's documents only through its
adapter and choose their path by its capabilities — they never import the store's module nor
ask whether a kind's target is `managed`. Plain `ast`, like tests/test_architecture.py."""

from __future__ import annotations

import ast
import re

from tests.architecture import Module, report, server_modules

MANAGED_STORE = "engine.core.managed_target"

# The one module that turns a kind into its adapter (and so names the store's class).
BUILDS_ADAPTERS = frozenset({"engine.core.kind_targets"})

# The write path: none of these may name the managed target at all.
WRITE_PATH = (
    "engine.core.barrier",
    "engine.core.land",
    "engine.core.batch_write",
    "engine.core.undo",
    "engine.core.write_rows",
    "engine.core.operations",
    "approvals.services.execution",
    "approvals.services.external_writes",
    "approvals.services.undo",
    "approvals.services.external_undo",
    "approvals.services.attempts",
    "approvals.services.plans",
    "approvals.services.plan_engine",
    "approvals.services.plan_compensation",
    "ownership.services.conflicts",
    "ownership.services.resolution",
)

# Elsewhere in the domain, a comparison or a query filter on the managed target is allowed
# only here, for a reason that is not routing a write.
NAMES_THE_MANAGED_TARGET = {
    "ownership.services.catalog": "a kind's settings (a managed kind has none) and the "
    "capabilities a page shows for it",
    "approvals.services.reread": "selects external attempts left unknown to read again: a "
    "write in the caller's transaction is never unknown",
    "approvals.models": "`maybe_reached_target`, the same selection as a filter on Action",
}
DOMAIN = ("approvals", "engine", "ownership")


def _is_managed(node: ast.AST) -> bool:
    """`"managed"` or `TargetType.MANAGED`."""
    if isinstance(node, ast.Constant):
        return node.value == "managed"
    return isinstance(node, ast.Attribute) and node.attr == "MANAGED"


def _names_managed_anywhere(module: Module) -> list[int]:
    return [getattr(node, "lineno", 0) for node in ast.walk(module.tree) if _is_managed(node)]


def _branches_on_managed(module: Module) -> list[int]:
    """Lines comparing something to the managed target, or filtering a query on it."""
    lines = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Compare) and any(
            _is_managed(side) for side in [node.left, *node.comparators]
        ):
            lines.append(node.lineno)
        if (
            isinstance(node, ast.keyword)
            and (node.arg or "").endswith("target")  # target=, kind__target=, …
            and _is_managed(node.value)
        ):
            lines.append(node.value.lineno)
    return lines


def test_only_the_kind_to_adapter_module_imports_airlocks_store() -> None:
    offenders = []
    for name, module in server_modules().items():
        if name in BUILDS_ADAPTERS or name == MANAGED_STORE:
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and node.module == MANAGED_STORE:
                offenders.append(f"{module.rel}:{node.lineno}  {name} imports {MANAGED_STORE}")
            if isinstance(node, ast.Import) and any(a.name == MANAGED_STORE for a in node.names):
                offenders.append(f"{module.rel}:{node.lineno}  {name} imports {MANAGED_STORE}")
    assert not offenders, report(
        "Modules reaching Airlock's store around its adapter",
        offenders,
        "Get the kind's adapter (engine/core/kind_targets.py adapter_for_kind) and call its "
        "methods; what only a store in the caller's transaction can do is "
        "engine.targets.base.InTransactionTarget.",
    )


def test_the_write_path_never_names_the_managed_target() -> None:
    modules = server_modules()
    offenders = [
        f"{modules[name].rel}:{line}  {name}"
        for name in WRITE_PATH
        for line in _names_managed_anywhere(modules[name])
    ]
    assert not offenders, report(
        "The write path choosing by the target's name",
        offenders,
        "Choose by the adapter's capabilities (`in_caller_transaction(kind)`, "
        "`adapter.capabilities`), not by `kind.target`.",
    )


# A statement writing the store's table (not its history, `ownership_resourceversion`).
_STORE_SQL = re.compile(r"\b(UPDATE|INSERT\s+INTO|DELETE\s+FROM)\s+ownership_resource\b", re.I)
_ORM_WRITES = {"create", "bulk_create", "update", "update_or_create", "delete", "save"}


def _writes_the_store(module: Module) -> list[int]:
    """Lines with SQL writing `ownership_resource` (in a string that is not a docstring), or
    an ORM write reached from `Resource`."""
    docstrings = {
        id(node.body[0].value)  # type: ignore[attr-defined]
        for node in ast.walk(module.tree)
        if _has_docstring(node)
    }
    lines = []
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _STORE_SQL.search(node.value)
        ):
            lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _ORM_WRITES
            and _receiver(node.func.value) == "Resource"
        ):
            lines.append(node.lineno)
    return lines


def _has_docstring(node: ast.AST) -> bool:
    body = getattr(node, "body", None)
    return (
        isinstance(body, list)
        and bool(body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )


def _receiver(node: ast.expr) -> str | None:
    """The name a chain like `Resource.objects.filter(…).update` starts from."""
    while isinstance(node, ast.Call | ast.Attribute):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def test_the_write_path_writes_no_statement_of_the_store_itself() -> None:
    modules = server_modules()
    offenders = [
        f"{modules[name].rel}:{line}  {name}"
        for name in WRITE_PATH
        for line in _writes_the_store(modules[name])
    ]
    assert not offenders, report(
        "The write path writing Airlock's store around its adapter",
        offenders,
        "Write through the kind's adapter (`write_carrying`, `write_many`, `restore`, the "
        "interface's verbs); only engine/core/managed_target.py writes `ownership_resource`.",
    )


def test_the_domain_branches_on_the_managed_target_only_where_it_says_why() -> None:
    offenders = []
    for name, module in server_modules().items():
        if not name.startswith(DOMAIN) or name in NAMES_THE_MANAGED_TARGET:
            continue
        offenders += [f"{module.rel}:{line}  {name}" for line in _branches_on_managed(module)]
    assert not offenders, report(
        "Branches on `target == managed` outside the allowed list",
        offenders,
        "Route by the adapter's capabilities; a branch that is display or configuration "
        "only goes in NAMES_THE_MANAGED_TARGET with its reason.",
    )


def test_the_allowed_list_names_modules_that_still_branch() -> None:
    modules = server_modules()
    stale = [name for name in NAMES_THE_MANAGED_TARGET if not _branches_on_managed(modules[name])]
    assert not stale, report(
        "Allowed to branch on the managed target but no longer does", stale, "Remove the entry."
    )
