"""What a run's write set asks of its approval: the classes it touches and their quorum.

A leaf module (models only) so that run creation (`runs`) and deciding
(`decisions`) read the same rule without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ownership.models import ApprovalMode, ConflictClass, ResourceKind

_OPERATIONS = frozenset({"create", "update", "delete"})


def classes_for_write_set(write_set: Iterable[dict[str, Any]]) -> list[ConflictClass]:
    """The conflict classes of every (kind, operation) the write set declares, by slug."""
    operations_by_kind: dict[str, set[str]] = {}
    for entry in write_set:
        slug = str(entry.get("resource", "")).split("/", 1)[0]
        operations_by_kind.setdefault(slug, set()).update(entry.get("operations") or [])
    classes: dict[str, ConflictClass] = {}
    for kind in ResourceKind.objects.filter(slug__in=operations_by_kind).select_related(
        "class_create", "class_update", "class_delete"
    ):
        for operation in sorted(operations_by_kind[kind.slug] & _OPERATIONS):
            klass = kind.class_for(operation)
            classes[klass.slug] = klass
    return [classes[slug] for slug in sorted(classes)]


def run_quorum(classes: Iterable[ConflictClass]) -> int:
    """Distinct approvers a run needs: the highest quorum among its per-run classes.

    Per-call classes keep gating each call with their own quorum, so they do
    not raise the run's; a write set with no per-run class needs one person.
    """
    return max(
        (klass.quorum for klass in classes if klass.approval_mode == ApprovalMode.PER_RUN),
        default=1,
    )
