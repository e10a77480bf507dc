"""Claims on approvals and conflicts (issue 43): the service's rules, audited, the
collision forced, the timeout on the product's clock, and the console endpoints."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from approvals.models import Claim
from approvals.services import claims
from approvals.services.claims import ClaimHeld, claim_release, claim_take
from audit.models import AuditEvent
from tests.fixtures.console import People, World, client_for, make_person

pytestmark = pytest.mark.django_db


def _events(kind: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=kind).order_by("seq"))


def test_a_claim_is_seen_and_never_taken_silently(people: People, world: World) -> None:
    ana = make_person("ana", "operators")
    claim_take(subject="approval", subject_id=world.approval.id, person=ana)
    assert _events("claim.taken")[-1].details["subject_id"] == str(world.approval.id)
    with pytest.raises(ClaimHeld, match="ana is on it"):
        claim_take(subject="approval", subject_id=world.approval.id, person=people.operator)
    # Naming someone other than the holder is not a deliberate takeover of ana's claim.
    with pytest.raises(ClaimHeld):
        claim_take(
            subject="approval",
            subject_id=world.approval.id,
            person=people.operator,
            take_over_from="rui",
        )
    claim_take(
        subject="approval",
        subject_id=world.approval.id,
        person=people.operator,
        take_over_from="ana",
    )
    held = Claim.objects.get(subject_id=world.approval.id)
    assert held.holder == people.operator
    assert _events("claim.taken_over")[-1].details["previous_holder"] == "ana"
    with pytest.raises(ClaimHeld):
        claim_release(subject="approval", subject_id=world.approval.id, person=ana)
    assert claim_release(subject="approval", subject_id=world.approval.id, person=people.operator)
    assert not Claim.objects.exists()
    assert _events("claim.released")[-1].details["reason"] == "released"


def test_only_people_who_may_decide_claim(people: People, world: World) -> None:
    with pytest.raises(Exception) as outsider:
        claim_take(subject="approval", subject_id=world.approval.id, person=people.outsider)
    assert getattr(outsider.value, "code", "") == "not_found"
    with pytest.raises(Exception) as operator_on_conflict:
        claim_take(subject="conflict", subject_id=world.conflict.id, person=people.operator)
    assert getattr(operator_on_conflict.value, "code", "") in ("forbidden", "not_found")
    claim_take(subject="conflict", subject_id=world.conflict.id, person=people.release_owner)
    assert Claim.objects.get(subject="conflict").holder == people.release_owner


def test_a_claim_times_out_on_the_products_clock(
    people: People, world: World, monkeypatch: Any, settings: Any
) -> None:
    settings.AIRLOCK_CLAIM_TTL_SECONDS = 900
    ana = make_person("ana", "operators")
    claim_take(subject="approval", subject_id=world.approval.id, person=ana)
    later = timezone.now() + timedelta(seconds=901)
    monkeypatch.setattr(claims, "clock", lambda: later)
    assert claims.active_claims("approval", [world.approval.id]) == {}
    claim_take(subject="approval", subject_id=world.approval.id, person=people.operator)
    released = _events("claim.released")[-1]
    assert released.details["reason"] == "timeout" and released.details["holder"] == "ana"
    assert _events("claim.taken")[-1].actor_label == people.operator.username


@pytest.mark.django_db(transaction=True)
def test_two_people_claiming_at_once_one_wins(people: People, world: World) -> None:
    ana = make_person("ana", "operators")
    start = threading.Barrier(2)
    results: list[str] = []

    def claim(person: Any) -> None:
        try:
            start.wait()
            claim_take(subject="approval", subject_id=world.approval.id, person=person)
            results.append("won")
        except ClaimHeld:
            results.append("held")
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(p,)) for p in (ana, people.operator)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["held", "won"]
    assert Claim.objects.count() == 1
    assert len(_events("claim.taken")) == 1


def test_console_claim_endpoints_and_deciding_needs_a_takeover(
    people: People, world: World
) -> None:
    ana = make_person("ana", "operators")
    url = f"/claims/approval/{world.approval.id}/take/"
    response = client_for(ana).post(url, HTTP_HX_REQUEST="true")
    assert response.status_code == 200 and b"You are on it" in response.content
    olivia = client_for(people.operator)
    page = olivia.get("/approvals/")
    assert b"ana is on it" in page.content and b"Take over from ana" in page.content
    # Olivia may not decide while ana holds it…
    decide = f"/approvals/{world.approval.id}/decision/"
    refused = olivia.post(decide, {"decision": "approve"}, HTTP_HX_REQUEST="true")
    assert refused.status_code == 409 and b"take it over from ana" in refused.content
    world.approval.refresh_from_db()
    assert world.approval.status == "pending"
    # …until she takes it over deliberately; deciding then ends her claim.
    taken = olivia.post(url, {"take_over_from": "ana"}, HTTP_HX_REQUEST="true")
    assert taken.status_code == 200 and b"You are on it" in taken.content
    assert olivia.post(decide, {"decision": "approve"}, HTTP_HX_REQUEST="true").status_code == 200
    assert not Claim.objects.exists()
    assert _events("claim.released")[-1].details["reason"] == "decided"
    # An outsider cannot claim, nor read the claim line.
    oscar = client_for(people.outsider)
    assert oscar.post(url).status_code == 404
    assert oscar.get(f"/claims/approval/{world.approval.id}/").status_code == 404
    assert oscar.post("/claims/nonsense/" + str(world.approval.id) + "/take/").status_code == 404


def test_the_inbox_poll_sends_changed_claims_and_departed_cards(
    people: People, world: World
) -> None:
    olivia = client_for(people.operator)
    since = timezone.now().isoformat()
    base = {"since": since, "seen": f"{world.approval.id},{world.run_approval.id}"}
    nothing = olivia.get("/approvals/poll/", {**base, "shown": f"{world.approval.id}~-"})
    assert nothing.status_code == 204
    ana = make_person("ana", "operators")
    claim_take(subject="approval", subject_id=world.approval.id, person=ana)
    changed = olivia.get("/approvals/poll/", {**base, "shown": f"{world.approval.id}~-"})
    assert changed.status_code == 200
    assert b'hx-swap-oob="true"' in changed.content and b"ana is on it" in changed.content
    fingerprint = claims.claim_fingerprint(Claim.objects.get())
    same = olivia.get("/approvals/poll/", {**base, "shown": f"{world.approval.id}~{fingerprint}"})
    assert same.status_code == 204
    world.approval.status = "rejected"
    world.approval.save(update_fields=["status"])
    gone = olivia.get("/approvals/poll/", {**base, "shown": f"{world.approval.id}~{fingerprint}"})
    assert gone.status_code == 200 and b'data-status="rejected"' in gone.content


def test_the_conflict_page_shows_the_claim_live(people: People, world: World) -> None:
    rita = client_for(people.release_owner)
    page = rita.get(f"/conflicts/{world.conflict.id}/")
    assert b"Nobody has claimed this." in page.content
    box = f"/claims/conflict/{world.conflict.id}/"
    assert rita.get(box, {"fp": "-"}).status_code == 204
    other = make_person("ria", "release-owners")
    claim_take(subject="conflict", subject_id=world.conflict.id, person=other)
    live = rita.get(box, {"fp": "-"})
    assert live.status_code == 200 and b"ria is on it" in live.content
