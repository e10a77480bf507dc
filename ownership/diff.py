"""JSON documents: RFC 7396 merge patch, the document a write proposes, the
field-level two-way diff the pages show, the three-way diff and per-field merge.

The one copy of each rule. A pure leaf: it imports no model and no service, so
engine/core (the barrier), the services and the pages all import it.

Fields are addressed by JSON pointer (RFC 6901). Objects are compared member by
member; arrays and scalars are leaves (a list is one field: merging two edits of
one list is a person's decision, not a guess). An absent member is reported as
`None` together with the `*_present` flags so a page can tell "absent" from
"null". For display only, `element_diff` aligns two arrays element by element and
`side_by_side` aligns two whole documents line by line (neither changes what a
merge or the API sees).
"""

from __future__ import annotations

import copy
import difflib
import json
from typing import Any, Literal, Protocol

Change = Literal["agent_only", "other_only", "both"]
Side = Literal["current", "proposed"]

# approvals.models.PayloadFormat / WriteOperation values (TextChoices compare equal
# to their values; named here so this module needs no model).
MERGE_PATCH = "merge_patch"
DELETE = "delete"

_ABSENT = object()


def _escape_pointer_token(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape_pointer_token(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _pointer_tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError(f"not a JSON pointer: {pointer!r}")
    return [_unescape_pointer_token(token) for token in pointer[1:].split("/")]


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: a null member deletes, an object merges recursively, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


class ProposedWrite(Protocol):
    """What `proposed_document` reads of an action."""

    @property
    def operation(self) -> str: ...

    @property
    def payload_format(self) -> str: ...

    @property
    def payload(self) -> Any: ...


def proposed_document(action: ProposedWrite, current: Any) -> dict[str, Any]:
    """What the resource would hold if `action` were applied over `current`.

    A merge patch applies to `current` (RFC 7396); a delete proposes the empty
    document `{}` (what a reader sees afterwards; the barrier stores the tombstone
    with its last document, a separate concern); a full document (PUT, a
    resolution) replaces `current`.
    """
    if action.payload_format == MERGE_PATCH:
        result = apply_merge_patch(current if isinstance(current, dict) else {}, action.payload)
        return result if isinstance(result, dict) else {}
    if action.payload_format == DELETE or action.operation == DELETE:
        return {}
    return copy.deepcopy(action.payload) if isinstance(action.payload, dict) else {}


def _leaves(document: Any, prefix: str, into: dict[str, Any]) -> None:
    if isinstance(document, dict) and document:
        for key, value in document.items():
            _leaves(value, f"{prefix}/{_escape_pointer_token(str(key))}", into)
    else:
        into[prefix] = document


def _value_at(document: Any, tokens: list[str]) -> Any:
    node = document
    for token in tokens:
        if not isinstance(node, dict) or token not in node:
            return _ABSENT
        node = node[token]
    return node


def _aligned_paths(*documents: Any) -> list[str]:
    """Pointers at which to compare the documents: the deepest object members any
    of them has, but never below a point where one side is a non-object."""
    flat: dict[str, Any] = {}
    for document in documents:
        if isinstance(document, dict):
            _leaves(document, "", flat)
    paths = set(flat)
    # Collapse a path to its nearest ancestor where some document holds a
    # non-object value (e.g. base {"a": {"b": 1}} vs current {"a": 5}).
    collapsed: set[str] = set()
    for path in paths:
        tokens = _pointer_tokens(path)
        chosen = path
        for depth in range(1, len(tokens)):
            ancestor = tokens[:depth]
            if any(
                (value := _value_at(document, ancestor)) is not _ABSENT
                and not isinstance(value, dict)
                for document in documents
                if isinstance(document, dict)
            ):
                chosen = "".join(f"/{_escape_pointer_token(t)}" for t in ancestor)
                break
        collapsed.add(chosen)
    return sorted(collapsed)


def three_way_diff(base: Any, current: Any, proposed: Any) -> list[dict[str, Any]]:
    """Fields that differ between base and current and/or base and proposed.

    change: `agent_only` (only the proposal changed it), `other_only` (someone
    else changed it since the agent read it), `both` (both changed it, to
    different values — or to the same value, which is still reported so a
    person sees it).
    """
    documents = [d if isinstance(d, dict) else {} for d in (base, current, proposed)]
    rows: list[dict[str, Any]] = []
    for path in _aligned_paths(*documents):
        tokens = _pointer_tokens(path)
        b, c, p = (_value_at(d, tokens) for d in documents)
        agent_changed = p != b
        other_changed = c != b
        if not agent_changed and not other_changed:
            continue
        change: Change = (
            "both"
            if agent_changed and other_changed
            else "agent_only"
            if agent_changed
            else "other_only"
        )
        rows.append(
            {
                "path": path,
                "base": None if b is _ABSENT else b,
                "current": None if c is _ABSENT else c,
                "proposed": None if p is _ABSENT else p,
                "base_present": b is not _ABSENT,
                "current_present": c is not _ABSENT,
                "proposed_present": p is not _ABSENT,
                "change": change,
            }
        )
    return rows


def _set_at(document: dict[str, Any], tokens: list[str], value: Any) -> None:
    node = document
    for token in tokens[:-1]:
        child = node.get(token)
        if not isinstance(child, dict):
            child = {}
            node[token] = child
        node = child
    if value is _ABSENT:
        node.pop(tokens[-1], None)
    else:
        node[tokens[-1]] = copy.deepcopy(value)


def default_choice(change: str) -> Side:
    """What a merge takes for a field the person did not choose explicitly."""
    return "proposed" if change == "agent_only" else "current"


def merge_documents(
    *, current: Any, proposed: Any, fields: list[dict[str, Any]], choices: dict[str, Side]
) -> dict[str, Any]:
    """The current document with the chosen fields taken from the proposal.

    `fields` is a three_way_diff result; fields not in `choices` take
    default_choice(change).
    """
    result: dict[str, Any] = copy.deepcopy(current) if isinstance(current, dict) else {}
    proposed_doc = proposed if isinstance(proposed, dict) else {}
    for row in fields:
        side = choices.get(row["path"], default_choice(row["change"]))
        if side != "proposed":
            continue
        tokens = _pointer_tokens(row["path"])
        if not tokens:
            return copy.deepcopy(proposed_doc)
        _set_at(result, tokens, _value_at(proposed_doc, tokens))
    return result


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _fields(document: Any) -> dict[str, Any]:
    """JSON pointer -> leaf value; a missing or empty document has no fields."""
    if document is None or document == {}:
        return {}
    if not isinstance(document, dict):
        return {"/": document}
    flat: dict[str, Any] = {}
    _leaves(document, "", flat)
    return flat


def document_diff(before: Any, after: Any) -> list[dict[str, Any]]:
    """Field-level changes from `before` to `after` (path, old, new, kind), for the
    pages. Arrays are leaves; a deleted resource (`{}` or None) has no fields, so
    a delete lists every field as removed."""
    left, right = _fields(before), _fields(after)
    rows = []
    for path in sorted(set(left) | set(right)):
        old, new = left.get(path, _ABSENT), right.get(path, _ABSENT)
        if old == new:
            continue
        kind = "added" if old is _ABSENT else "removed" if new is _ABSENT else "changed"
        rows.append(
            {
                "path": path,
                "old": None if old is _ABSENT else _compact(old),
                "new": None if new is _ABSENT else _compact(new),
                "kind": kind,
            }
        )
    return rows


# --- for the pages: per-element array diffs and whole-document side by side -------------

ElementOp = Literal["same", "removed", "added", "changed"]


def _element_rows(old: list[Any], new: list[Any]) -> list[dict[str, Any]]:
    """Align two arrays element by element (difflib on each element's canonical JSON, so
    one added address is one added row, not the whole array against the whole array).

    Each row: `op` (same | removed | added | changed), `old` / `new` (compact JSON or
    None) and, for a changed object, `fields` (its document_diff). A replaced run pairs
    elements in order: two objects are one changed element, anything else is a removal
    and an addition.
    """
    left = [_compact(value) for value in old]
    right = [_compact(value) for value in new]
    rows: list[dict[str, Any]] = []
    matcher = difflib.SequenceMatcher(a=left, b=right, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            rows.extend(
                {"op": "same", "old": text, "new": text, "fields": []} for text in left[i1:i2]
            )
            continue
        olds, news = list(range(i1, i2)), list(range(j1, j2))
        for index in range(max(len(olds), len(news))):
            o = olds[index] if index < len(olds) else None
            n = news[index] if index < len(news) else None
            if (
                o is not None
                and n is not None
                and isinstance(old[o], dict)
                and isinstance(new[n], dict)
            ):
                rows.append(
                    {
                        "op": "changed",
                        "old": left[o],
                        "new": right[n],
                        "fields": document_diff(old[o], new[n]),
                    }
                )
                continue
            if o is not None:
                rows.append({"op": "removed", "old": left[o], "new": None, "fields": []})
            if n is not None:
                rows.append({"op": "added", "old": None, "new": right[n], "fields": []})
    return rows


# Beyond these sizes the pages fall back to whole values (difflib's alignment grows
# with the product of the lengths; a page must not stall on a huge document).
MAX_ALIGNED_ELEMENTS = 1000
MAX_ALIGNED_LINES = 2000


def element_diff(old: Any, new: Any) -> list[dict[str, Any]] | None:
    """`_element_rows` when both values are arrays, else None (not a per-element case,
    or arrays too long to align on a page)."""
    if isinstance(old, list) and isinstance(new, list):
        if len(old) + len(new) > MAX_ALIGNED_ELEMENTS:
            return None
        return _element_rows(old, new)
    return None


def element_diff_text(old: str | None, new: str | None) -> list[dict[str, Any]] | None:
    """element_diff of two document_diff values (compact JSON text, None when absent)."""
    if old is None or new is None:
        return None
    try:
        return element_diff(json.loads(old), json.loads(new))
    except ValueError:
        return None


LineKind = Literal["same", "removed", "added", "blank"]


def side_by_side(before: Any, after: Any) -> list[dict[str, Any]]:
    """Both whole documents, pretty-printed and aligned line by line: rows of
    `{left, left_kind, right, right_kind}` (kind same | removed | added | blank)."""
    left = _pretty_lines(before)
    right = _pretty_lines(after)
    if len(left) + len(right) > MAX_ALIGNED_LINES:
        return []  # too long to align on a page: the toggle is not offered
    rows: list[dict[str, Any]] = []
    matcher = difflib.SequenceMatcher(a=left, b=right, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            rows.extend(
                {"left": line, "left_kind": "same", "right": line, "right_kind": "same"}
                for line in left[i1:i2]
            )
            continue
        olds, news = left[i1:i2], right[j1:j2]
        for index in range(max(len(olds), len(news))):
            has_old, has_new = index < len(olds), index < len(news)
            rows.append(
                {
                    "left": olds[index] if has_old else "",
                    "left_kind": "removed" if has_old else "blank",
                    "right": news[index] if has_new else "",
                    "right_kind": "added" if has_new else "blank",
                }
            )
    return rows


def _pretty_lines(document: Any) -> list[str]:
    if document is None or document == {}:
        return []
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False).splitlines()


class DocumentDiff(list[dict[str, Any]]):
    """document_diff's rows with both documents, for the pages' toggle between the field
    list and the whole documents side by side. A list, so every page that iterates a
    diff keeps working; the API and the stored diffs stay plain lists."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        *,
        before: Any,
        after: Any,
        before_label: str = "Before",
        after_label: str = "After",
    ) -> None:
        super().__init__(rows)
        self.before = before
        self.after = after
        self.before_label = before_label
        self.after_label = after_label

    @property
    def side_by_side(self) -> list[dict[str, Any]]:
        return side_by_side(self.before, self.after)


def document_diff_view(
    before: Any, after: Any, *, before_label: str = "Before", after_label: str = "After"
) -> DocumentDiff:
    """document_diff(before, after) that also carries both documents (DocumentDiff)."""
    return DocumentDiff(
        document_diff(before, after),
        before=before,
        after=after,
        before_label=before_label,
        after_label=after_label,
    )
