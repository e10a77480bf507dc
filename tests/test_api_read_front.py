"""The read front (approvals/api/fastpoll.py, its route table in fastpoll_routes.py) answers
every route it serves, with every token kind, exactly as Django does — status, every header
but Date, body bytes — on real uvicorn servers (the product's Django application on one, the
front over the same application on the other, its Django answers marked), for every case:
200, 304 (If-None-Match), an object the token may not read, an unknown id, a revoked or
expired token, an ended run, a deactivated agent, a personal token; and the resource list's
pages (filters, limits, cursors, a deleted resource, bad parameters). The answers the front
gives itself are exactly the ones it should (`by_front`): a test of which side answered as
well as of what was answered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from django.utils import timezone

from approvals.models import AgentToken
from approvals.services.runs import run_finish, run_revoke
from approvals.services.tokens import token_revoke
from audit.services import Actor
from tests.fixtures.api import make_active_run, make_agent_with_token, make_person_with_token
from tests.fixtures.core import make_action, make_resource
from tests.test_api_poll_fastpath import (
    REQUEST_ID,
    Server,
    _comparable,
    _pending,
    _writes,
    servers,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["servers"]  # the module's two servers (a fixture)

ROUTES = ("action", "run", "resource", "list")
# The resource list's page of the world's three resources (no ETag: If-None-Match is ignored).
LIST_PATH = "/api/v1/resources?kind=dns-record&prefix=fr-res-"
KINDS = ("run", "agent")


@dataclass
class World:
    tokens: dict[str, str]  # "run" (an active run's), "agent" (the run's agent's), "person"
    objects: dict[str, dict[str, Any]]  # route → which → the object (an Action or a Run)
    agent: Any
    run: Any


@pytest.fixture
def world() -> World:
    robot = make_agent_with_token("front-bot")
    run = make_active_run(robot.agent, _writes("fr"))
    sibling = make_active_run(robot.agent, _writes("fs"))
    other = make_active_run(make_agent_with_token("front-other").agent, _writes("fo"))
    actions = {
        "own": _pending(run.run, "fr-1"),
        "sibling": _pending(sibling.run, "fs-1"),
        "other": _pending(other.run, "fo-1"),
    }
    runs = {"own": run.run, "sibling": sibling.run, "other": other.run}
    # Any live token reads any resource (of a managed kind): three to read.
    resources = {
        which: make_resource(f"dns-record/fr-res-{which}", {"which": which, "n": [1, 2]})
        for which in ("own", "sibling", "other")
    }
    return World(
        tokens={
            "run": run.token,
            "agent": robot.token,
            "person": make_person_with_token("front-reader").token,
        },
        objects={"action": actions, "run": runs, "resource": resources},
        agent=robot.agent,
        run=run.run,
    )


def _path(world: World, route: str, which: str) -> str:
    if route == "list":
        return LIST_PATH  # any live token lists every resource: `which` changes nothing
    if route == "resource":
        if which == "unknown":
            return "/api/v1/resources/dns-record/fr-res-nowhere"
        resource = world.objects[route][which]
        return f"/api/v1/resources/{resource.kind_id}/{resource.name}"
    if which == "unknown":
        return f"/api/v1/{route}s/00000000-0000-4000-8000-000000000000"
    return f"/api/v1/{route}s/{world.objects[route][which].pk}"


def _get(server: Server, path: str, token: str, **headers: str) -> httpx.Response:
    sent = {"Authorization": f"Bearer {token}", "X-Request-Id": REQUEST_ID, **headers}
    return httpx.get(f"{server.url}{path}", headers=sent, timeout=10)


def _learn(servers: dict[str, Server], world: World) -> None:
    """The front replays the headers of Django's own answers, learned per route and token
    kind: let it see a 200 and a 304 of each (an agent token's first use goes to Django
    anyway: it records its use)."""
    for route in ROUTES:
        for kind in KINDS:
            path = _path(world, route, "own")
            etag = _etag(_get(servers["front"], path, world.tokens[kind]))
            _get(servers["front"], path, world.tokens[kind], **{"If-None-Match": etag})


def _etag(response: httpx.Response) -> str:
    """The answer's ETag; a list's answer has none (an If-None-Match then changes nothing)."""
    return response.headers.get("ETag", '"1"')


def _revoke(world: World, kind: str) -> None:
    """A run token dies with its run (revoked); an agent token is revoked itself."""
    if kind == "run":
        run_revoke(run=world.run, actor=Actor.system("tests"), reason="test")
    else:
        token_revoke(token=AgentToken.objects.get(agent=world.agent), actor=Actor.system("tests"))


def _finish(world: World, kind: str) -> None:
    run_finish(run=world.run, actor=Actor.agent(world.agent))


def _expire(world: World, kind: str) -> None:
    expired = timezone.now() - timedelta(seconds=1)
    AgentToken.objects.filter(agent=world.agent).update(expires_at=expired)


def _deactivate(world: World, kind: str) -> None:
    world.agent.is_active = False
    world.agent.save(update_fields=["is_active"])


Change = Callable[[World, str], None]
# (case, what changes first, the object read, If-None-Match?, {(route, kind): (status, by front)})
CASES: list[tuple[str, Change | None, str, bool, dict[tuple[str, str], tuple[int, bool]]]] = [
    ("200", None, "own", False, {(r, k): (200, True) for r in ROUTES for k in KINDS}),
    ("304", None, "own", True, {(r, k): (304, True) for r in ROUTES for k in KINDS}),
    (
        "another run of the agent",
        None,
        "sibling",
        False,
        {
            ("action", "run"): (200, True),  # an active run's token reads its agent's actions
            ("action", "agent"): (200, True),
            ("run", "run"): (404, False),  # ... but only its own run
            ("run", "agent"): (200, True),
            ("resource", "run"): (200, True),  # any live token reads any resource
            ("resource", "agent"): (200, True),
        },
    ),
    (
        "another agent's",
        None,
        "other",
        False,
        {
            **{(r, k): (404, False) for r in ("action", "run") for k in KINDS},
            **{("resource", k): (200, True) for k in KINDS},
        },
    ),
    ("unknown id", None, "unknown", False, {(r, k): (404, False) for r in ROUTES for k in KINDS}),
    (
        "revoked",
        _revoke,
        "own",
        False,
        {
            ("action", "run"): (200, True),  # an ended run's token reads its own run's action
            ("run", "run"): (200, True),
            ("action", "agent"): (401, False),
            ("run", "agent"): (401, False),
            ("resource", "run"): (401, False),  # ... but no resource: a dead credential there
            ("resource", "agent"): (401, False),
        },
    ),
    (
        "ended run",
        _finish,
        "own",
        False,
        {
            **{(r, k): (200, True) for r in ("action", "run") for k in KINDS},
            ("resource", "run"): (401, False),
            ("resource", "agent"): (200, True),
        },
    ),
    (
        "ended run, another run's",
        _finish,
        "sibling",
        False,
        {
            ("action", "run"): (404, False),  # ... and no other run's
            ("action", "agent"): (200, True),
            ("run", "run"): (404, False),
            ("run", "agent"): (200, True),
            ("resource", "run"): (401, False),
            ("resource", "agent"): (200, True),
        },
    ),
    (
        "expired agent token",
        _expire,
        "own",
        False,
        {(r, k): ((200, True) if k == "run" else (401, False)) for r in ROUTES for k in KINDS},
    ),
    (
        "deactivated agent",
        _deactivate,
        "own",
        False,
        {(r, k): (401, False) for r in ROUTES for k in KINDS},
    ),
]


def _listed(expected: dict[tuple[str, str], tuple[int, bool]]) -> None:
    """The list answers as the resource read with the same token (the same Bearer), with a
    page where the read has a 304 (no ETag) or a 404 (`which` changes no list)."""
    for kind in KINDS:
        status, by_front = expected[("resource", kind)]
        expected[("list", kind)] = (200, True) if status in (200, 304, 404) else (status, by_front)


for _case in CASES:
    _listed(_case[4])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("change", "which", "conditional", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_front_answers_every_route_and_token_kind_exactly_as_django_does(
    servers: dict[str, Server],
    world: World,
    route: str,
    kind: str,
    change: Change | None,
    which: str,
    conditional: bool,
    expected: dict[tuple[str, str], tuple[int, bool]],
) -> None:
    _learn(servers, world)
    if change is not None:
        change(world, kind)
    path, token = _path(world, route, which), world.tokens[kind]
    headers: dict[str, str] = {}
    if conditional:
        headers["If-None-Match"] = _etag(_get(servers["django"], path, token))
    django = _get(servers["django"], path, token, **headers)
    front = _get(servers["front"], path, token, **headers)
    status, by_front = expected[(route, kind)]
    assert django.status_code == status, django.text
    assert _comparable(front) == _comparable(django)
    assert ("x-test-served-by" not in front.headers) is by_front


@pytest.mark.parametrize("route", ROUTES)
def test_a_personal_token_is_answered_by_django(
    servers: dict[str, Server], world: World, route: str
) -> None:
    _learn(servers, world)
    path = _path(world, route, "own")
    django = _get(servers["django"], path, world.tokens["person"])
    front = _get(servers["front"], path, world.tokens["person"])
    # A person without a group reads no action or run, and any resource.
    assert django.status_code == (200 if route in ("resource", "list") else 404)
    assert _comparable(front) == _comparable(django)
    assert "x-test-served-by" in front.headers


@pytest.mark.parametrize("route", ROUTES)
def test_an_agent_tokens_use_is_recorded_by_django_once_a_minute_and_read_in_front_between(
    servers: dict[str, Server], world: World, route: str
) -> None:
    """principal_for_token records an agent token's use at most once a minute: a request
    that would record it goes to Django (which writes it), the next ones stay in front."""
    _learn(servers, world)
    tokens = AgentToken.objects.filter(agent=world.agent)
    long_ago = timezone.now() - timedelta(minutes=5)
    tokens.update(last_used_at=long_ago)
    path = _path(world, route, "own")
    first = _get(servers["front"], path, world.tokens["agent"])
    assert first.status_code == 200 and "x-test-served-by" in first.headers
    recorded = tokens.get().last_used_at
    assert recorded is not None and recorded > long_ago
    second = _get(servers["front"], path, world.tokens["agent"])
    assert "x-test-served-by" not in second.headers
    assert _comparable(second) == _comparable(_get(servers["django"], path, world.tokens["agent"]))


def test_a_held_run_poll_is_left_to_django(servers: dict[str, Server], world: World) -> None:
    """The front holds action polls only; a run's held poll (it also wakes at the run's
    expiry) is Django's, answered alike."""
    _learn(servers, world)
    path = _path(world, "run", "own")
    etag = _get(servers["django"], path, world.tokens["run"]).headers["ETag"]
    held = {"Prefer": "wait=1", "If-None-Match": etag}
    django = _get(servers["django"], path, world.tokens["run"], **held)
    front = _get(servers["front"], path, world.tokens["run"], **held)
    assert django.status_code == 304
    assert _comparable(front) == _comparable(django)
    assert "x-test-served-by" in front.headers


@pytest.mark.parametrize("kind", KINDS)
def test_a_resource_with_a_write_queued_over_it_is_answered_alike_with_the_queued_action(
    servers: dict[str, Server], world: World, kind: str
) -> None:
    """Airlock-Queued-Action, present on some answers only: the front learns Django's headers
    of such an answer once (its first is Django's) and fills in the action's id."""
    _learn(servers, world)
    resource = world.objects["resource"]["own"]
    queued = make_action(
        run=world.run,
        identifier=f"dns-record/{resource.name}",
        operation="update",
        payload={"n": 3},
        observed_version=resource.version,
        status="queued",
        resource=resource,
    )
    path, token = _path(world, "resource", "own"), world.tokens[kind]
    etag = _get(servers["front"], path, token).headers["ETag"]
    _get(servers["front"], path, token, **{"If-None-Match": etag})
    for headers, status in (({}, 200), ({"If-None-Match": etag}, 304)):
        django = _get(servers["django"], path, token, **headers)
        front = _get(servers["front"], path, token, **headers)
        assert django.status_code == status
        assert django.headers["Airlock-Queued-Action"] == str(queued.pk)
        assert _comparable(front) == _comparable(django)
        assert "x-test-served-by" not in front.headers


@pytest.mark.parametrize(
    ("name", "headers"),
    [
        ("a.b:c@d+e=f,g-h_i", {}),  # every punctuation a name may have
        ("x" * 255, {}),  # the longest name
        ("fr-res-own", {"If-None-Match": 'W/"1", "2", , garbage'}),
        ("fr-res-own", {"If-None-Match": "*"}),
        ("fr-res-own", {"Prefer": "wait=1"}),  # a resource read does not wait: Django's
    ],
    ids=["punctuation", "longest", "odd If-None-Match", "star", "Prefer"],
)
def test_odd_but_valid_resource_reads_are_answered_alike(
    servers: dict[str, Server], world: World, name: str, headers: dict[str, str]
) -> None:
    if name != "fr-res-own":
        make_resource(f"dns-record/{name}", {"odd": True})
    _learn(servers, world)
    path, token = f"/api/v1/resources/dns-record/{name}", world.tokens["agent"]
    django = _get(servers["django"], path, token, **headers)
    front = _get(servers["front"], path, token, **headers)
    assert django.status_code in (200, 304), django.text
    assert _comparable(front) == _comparable(django)


# --- the resource list (GET /api/v1/resources) -----------------------------------------------

# Names whose order in the database's collation is not their bytes' order, one with `_` (a
# LIKE wildcard unless escaped), digits, every punctuation a name may have.
LISTED = (
    "fr-list-a",
    "fr-list-A",
    "fr-list-a.b",
    "fr-list-a-c",
    "fr-list-a_b",
    "fr-list-ab",
    "fr-list-aXb",
    "fr-list-a:1@x+y=z,w",
    "fr-list-10",
    "fr-list-9",
    "fr-list-Z",
)


@pytest.fixture
def listed(world: World) -> list[str]:
    """LISTED as dns-record resources (one a mirror with its target's version, documents of
    every JSON type), a deleted one and another kind's with the same prefix."""
    for at, name in enumerate(LISTED):
        document = {"at": at, "f": 1.5, "u": "é€", "n": None, "l": [True, {"x": []}]}
        resource = make_resource(f"dns-record/{name}", document, version=at + 1)
        if at == 3:
            resource.external_version = "etag-from-a-target"
            resource.save(update_fields=["external_version"])
    gone = make_resource("dns-record/fr-list-deleted", {"gone": True})
    gone.deleted = True
    gone.save(update_fields=["deleted"])
    make_resource("notification-policy/fr-list-a", {"other": "kind"})
    return list(LISTED)


def _pages(
    servers: dict[str, Server], token: str, query: str, **headers: str
) -> list[dict[str, Any]]:
    """Every page of `query`, following `next`: each answered alike and by the front."""
    pages: list[dict[str, Any]] = []
    cursor = ""
    while True:
        path = f"/api/v1/resources?{query}{cursor}"
        django = _get(servers["django"], path, token, **headers)
        front = _get(servers["front"], path, token, **headers)
        assert django.status_code == 200, django.text
        assert _comparable(front) == _comparable(django), path
        assert "x-test-served-by" not in front.headers, path
        pages.append(front.json())
        if pages[-1]["next"] is None:
            return pages
        cursor = f"&cursor={quote(pages[-1]['next'], safe='')}"  # `+` would be a space
        assert len(pages) < 50


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "query",
    [
        "kind=dns-record&prefix=fr-list-",
        "prefix=fr-list-",  # every kind's
        "kind=dns-record&prefix=fr-list-a_",  # `_` is itself, not any one character
        "kind=dns-record",
        "",  # every live resource there is
    ],
    ids=["kind and prefix", "prefix", "underscore", "kind", "everything"],
)
def test_the_front_pages_through_the_resource_list_exactly_as_django_does(
    servers: dict[str, Server], world: World, listed: list[str], kind: str, query: str
) -> None:
    _learn(servers, world)
    token = world.tokens[kind]
    by_three = _pages(servers, token, f"{query}&limit=3" if query else "limit=3")
    whole = _pages(servers, token, query)  # the default limit, 50
    largest = _pages(servers, token, f"{query}&limit=200" if query else "limit=200")
    items = [item for page in by_three for item in page["items"]]
    assert items == [item for page in whole for item in page["items"]]
    assert items == [item for page in largest for item in page["items"]]
    assert all(len(page["items"]) == 3 for page in by_three[:-1])
    names = [(item["kind"], item["name"]) for item in items]
    assert ("dns-record", "fr-list-deleted") not in names  # deleted: not listed
    if query.startswith("kind=dns-record&prefix=fr-list-a_"):
        assert names == [("dns-record", "fr-list-a_b")]
    elif query.startswith("kind=dns-record&prefix="):
        assert sorted(name for _, name in names) == sorted(listed)
    elif query.startswith("prefix="):
        assert ("notification-policy", "fr-list-a") in names and len(names) == len(listed) + 1


@pytest.mark.parametrize(
    ("query", "headers", "status", "by_front"),
    [
        # Valid, the front's: written otherwise, or a page past the end, or no such kind.
        ("kind=dns%2Drecord&prefix=fr%2Dlist%2D&limit=%32", {}, 200, True),
        ("kind=dns-record&limit=2&cursor=dns-record%2Ffr-list-a", {}, 200, True),
        ("limit=2&cursor=zzz/zzz", {}, 200, True),
        ("kind=no-such-kind", {}, 200, True),
        ("limit=1", {}, 200, True),
        ("prefix=fr-list-", {"If-None-Match": "*"}, 200, True),  # no ETag: ignored
        # Refused by the view: Django's problem+json.
        ("limit=0", {}, 422, False),
        ("limit=201", {}, 422, False),
        ("limit=9999999999999999999999", {}, 422, False),
        ("limit=two", {}, 422, False),
        ("kind=DNS", {}, 422, False),
        ("cursor=no-slash", {}, 422, False),
        ("prefix=fr-list-%C3%A9", {}, 422, False),
        ("prefix=fr+list", {}, 422, False),  # `+` is a space
        # What the front leaves to Django (a limit written otherwise, an empty, repeated or
        # unknown parameter, a held read, a byte that is not UTF-8), answered alike.
        ("limit=050", {}, 200, False),
        ("limit=", {}, 422, False),
        ("kind=", {}, 422, False),
        ("prefix=", {}, 200, False),
        ("cursor=", {}, 422, False),
        ("kind=dns-record&kind=dns-record", {}, 200, False),
        ("prefix=fr-list-&other=1", {}, 200, False),
        ("prefix=fr-list-", {"Prefer": "wait=1"}, 200, False),
        ("prefix=fr-list-%FF", {}, 422, False),
    ],
)
def test_odd_and_bad_resource_list_queries_are_answered_alike(
    servers: dict[str, Server],
    world: World,
    listed: list[str],
    query: str,
    headers: dict[str, str],
    status: int,
    by_front: bool,
) -> None:
    _learn(servers, world)
    path, token = f"/api/v1/resources?{query}", world.tokens["agent"]
    django = _get(servers["django"], path, token, **headers)
    front = _get(servers["front"], path, token, **headers)
    assert django.status_code == status, django.text
    assert _comparable(front) == _comparable(django)
    assert ("x-test-served-by" not in front.headers) is by_front
    if status == 422:
        assert django.headers["Content-Type"] == "application/problem+json"
