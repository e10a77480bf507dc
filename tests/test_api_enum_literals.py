"""The API's closed vocabularies (the `Literal[...]` types of its schemas and query
parameters) restate model choices by hand; this pins every one to its model's values, so
a status added to a model cannot go missing from the documented contract (or the reverse)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import Any, get_args

from django.db import models

import approvals.models
import approvals.models.choices
import approvals.models.plans
import audit.models
import notifications.models
import ownership.models
from console.api import api
from ownership import diff

# A vocabulary that is deliberately a part of a model's (where: why).
NARROWER = {
    ("PingOut", "principal"): "a token names an agent, a run or a person; never the system",
}
# A vocabulary that is deliberately its model's plus verbs the model never records.
WIDER = {
    ("DecisionIn", "decision"): (
        frozenset({"approve_with_edits"}),
        "a verb (approvals/services/edits.py): the editor's vote is recorded as `approve` "
        "on the edited action's approval",
    ),
}


def _model_vocabularies() -> dict[str, frozenset[str]]:
    modules: list[ModuleType] = [
        approvals.models,
        approvals.models.choices,
        approvals.models.plans,
        ownership.models,
        audit.models,
        notifications.models,
    ]
    found = {
        name: frozenset(choices.values)
        for module in modules
        for name, choices in inspect.getmembers(module, inspect.isclass)
        if issubclass(choices, models.TextChoices) and choices is not models.TextChoices
    }
    found.update({"diff.Change": frozenset(get_args(diff.Change))})
    found.update({"diff.Side": frozenset(get_args(diff.Side))})
    return found


def _enums(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], list[Any]]]:
    if isinstance(node, dict):
        if isinstance(node.get("enum"), list):
            yield path, node["enum"]
        for key, value in node.items():
            yield from _enums(value, (*path, str(key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _enums(value, (*path, str(index)))


def _owner(path: tuple[str, ...]) -> tuple[str, str]:
    """(schema, property) of a schema's enum; (path, parameter index) of a parameter's."""
    if "properties" in path:
        at = path.index("properties")
        return path[at - 1], path[at + 1]
    return "/".join(path[:3]), "/".join(path[3:])


def test_every_api_vocabulary_is_its_models_choices() -> None:
    vocabularies = _model_vocabularies()
    drifted, checked = [], 0
    for path, values in _enums(api.get_openapi_schema()):
        documented = frozenset(value for value in values if isinstance(value, str))
        kin = {name: known for name, known in vocabularies.items() if len(known & documented) >= 2}
        if not kin:
            continue  # a vocabulary of the API's own (HTTP methods, approve/reject)
        checked += 1
        if documented in kin.values():
            continue
        owner = _owner(path)
        if owner in NARROWER and any(documented < known for known in kin.values()):
            continue
        if owner in WIDER and documented - WIDER[owner][0] in kin.values():
            continue
        drifted.append(f"{'/'.join(path)}: {sorted(documented)} vs {sorted(kin)}")
    assert checked >= 20, "the walk found too few vocabularies: is the document shaped as before?"
    assert not drifted, "API vocabularies that differ from their model's choices:\n" + "\n".join(
        drifted
    )
