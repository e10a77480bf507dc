"""Diffs a person reads (issue 43): removed and added told apart by a text marker as well
as colour, arrays diffed element by element, a whole-document side-by-side toggle that
needs no JavaScript, and a resolved conflict showing what was kept and the result."""

from __future__ import annotations

import pytest

from ownership.diff import document_diff, element_diff, side_by_side
from tests.fixtures.console import People, World, client_for

ADDED = '<span class="visually-hidden">added: </span><span class="mark" aria-hidden="true">+</span>'


def test_one_added_address_is_one_added_element() -> None:
    rows = element_diff(["a@x", "b@x", "c@x"], ["a@x", "b@x", "new@x", "c@x"])
    assert rows is not None
    assert [(r["op"], r["new"] if r["op"] != "removed" else r["old"]) for r in rows] == [
        ("same", '"a@x"'),
        ("same", '"b@x"'),
        ("added", '"new@x"'),
        ("same", '"c@x"'),
    ]
    removed = element_diff(["a", "b", "c"], ["a", "c"])
    assert removed is not None and [r["op"] for r in removed] == ["same", "removed", "same"]
    assert element_diff(["a"], "a") is None  # not two arrays: no per-element view


def test_huge_arrays_and_documents_fall_back_to_whole_values() -> None:
    big = list(range(600))
    assert element_diff(big, [*big, 600]) is None
    assert side_by_side({"l": big * 3}, {"l": big * 3 + [1]}) == []


def test_a_changed_object_in_a_list_is_diffed_field_by_field() -> None:
    rows = element_diff(
        [{"to": "a", "on": True}, {"to": "b", "on": True}],
        [{"to": "a", "on": True}, {"to": "b", "on": False}, {"to": "c", "on": True}],
    )
    assert rows is not None
    assert [r["op"] for r in rows] == ["same", "changed", "added"]
    assert rows[1]["fields"] == [{"path": "/on", "old": "true", "new": "false", "kind": "changed"}]


def test_side_by_side_aligns_lines_and_marks_each_side() -> None:
    rows = side_by_side({"a": 1, "b": [1, 2]}, {"a": 1, "b": [1, 2, 3]})
    kinds = [(r["left_kind"], r["right_kind"]) for r in rows]
    assert ("same", "same") in kinds and ("blank", "added") in kinds
    assert all(r["left"] == r["right"] for r in rows if r["left_kind"] == "same")
    assert side_by_side({}, {}) == []
    # The stored/API diff keeps its shape: arrays stay one field.
    assert document_diff({"l": [1]}, {"l": [1, 2]}) == [
        {"path": "/l", "old": "[1]", "new": "[1, 2]", "kind": "changed"}
    ]


@pytest.mark.django_db
def test_the_inbox_card_diffs_the_list_per_element_with_text_markers(
    people: People, world: World
) -> None:
    html = client_for(people.operator).get("/approvals/").content.decode()
    card = html.split(f'id="approval-{world.approval.id}"')[1].split("</article>")[0]
    # channels ["email"] -> ["email", "pager"]: only "pager" is marked, as added.
    elements = card.split('<ol class="diff-elements"')[1].split("</ol>")[0]
    assert f"<ins>{ADDED}&quot;pager&quot;</ins>" in elements
    assert 'class="el-same"' in elements and "&quot;email&quot;" in elements
    assert "removed: " not in elements
    # The toggle: a details element (no JavaScript), both whole documents side by side.
    toggle = card.split('<details class="diff-toggle">')[1].split("</details>")[0]
    assert "Whole document, side by side" in toggle and '<th scope="col">Current</th>' in toggle
    assert 'class="line-added"' in toggle and "&quot;pager&quot;" in toggle


@pytest.mark.django_db
def test_the_conflict_page_marks_each_side_against_the_base(people: People, world: World) -> None:
    html = client_for(people.release_owner).get(f"/conflicts/{world.conflict.id}/").content.decode()
    channels = html.split("<code>/channels</code>")[1].split("</tr>")[0]
    proposed = channels.split('data-side="proposed"')[1]
    assert "list, per element since base" in proposed
    assert f"<ins>{ADDED}&quot;sms&quot;</ins>" in proposed
    assert "<pre>[\n  &quot;email&quot;\n]</pre>" in channels.split('data-side="proposed"')[0]
    oncall = html.split("<code>/oncall</code>")[1].split("</tr>")[0]
    assert "changed since base" in oncall.split('data-side="proposed"')[0]  # current moved
    assert 'id="whole-documents"' in html and "Whole documents, side by side" in html


@pytest.mark.django_db
def test_a_resolved_merge_shows_the_side_kept_per_field_and_the_result(
    people: People, world: World
) -> None:
    client = client_for(people.release_owner)
    response = client.post(
        f"/conflicts/{world.conflict.id}/resolution/",
        {"choice": "merge", "field:/channels": "proposed", "field:/oncall": "current"},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 200
    html = client.get(f"/conflicts/{world.conflict.id}/").content.decode()
    assert '<th scope="col">Kept</th>' in html
    assert 'data-kept="proposed">proposed</td>' in html.split("<code>/channels</code>")[1]
    assert 'data-kept="current">current</td>' in html.split("<code>/oncall</code>")[1]
    kept = html.split('<ul class="kept-fields" data-resolution="merge">')[1].split("</ul>")[0]
    assert "<code>/channels</code>: the <strong>proposed</strong> value (the agent\u2019s)" in kept
    assert "<code>/oncall</code>: the <strong>current</strong> value" in kept
    result = html.split('<pre id="result-document">')[1].split("</pre>")[0]
    assert "&quot;sms&quot;" in result and "team-b" in result and "team-a" not in result


@pytest.mark.django_db
def test_keep_current_shows_every_field_kept_current(people: People, world: World) -> None:
    client = client_for(people.release_owner)
    client.post(
        f"/conflicts/{world.conflict.id}/resolution/",
        {"choice": "keep_current", "comment": "not now"},
        HTTP_HX_REQUEST="true",
    )
    html = client.get(f"/conflicts/{world.conflict.id}/").content.decode()
    kept = html.split('data-resolution="keep_current">')[1].split("</ul>")[0]
    assert "proposed" not in kept and kept.count("<strong>current</strong>") == 2
    result = html.split('<pre id="result-document">')[1].split("</pre>")[0]
    assert "sms" not in result and "team-b" in result
