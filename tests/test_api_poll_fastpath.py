"""The agent's short poll answered in front of Django (approvals/api/fastpoll.py) answers
exactly as Django does — status, every header, body — for every case of the matrix, on a
real uvicorn: the product's Django application on one server, the front over the same
application (its Django answers marked) on the other. The happy cases are answered by the
front itself; every other one is handed to Django."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.db.models import F
from django.utils import timezone

from approvals.api.fastpoll import PollFront
from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalDecision,
    ApprovalSubject,
    Decision,
)
from approvals.notify import notify_action_changed
from approvals.services.runs import run_finish, run_revoke
from audit.services import Actor
from console import asgi
from tests.conftest import free_port, subprocess_env
from tests.fixtures.api import make_active_run, make_agent_with_token
from tests.fixtures.core import make_action
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REQUEST_ID = "fastpoll-matrix-1"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]


def _start(app: str) -> Server:
    port = free_port()
    process = subprocess.Popen(
        [
            *(str(Path(sys.executable).parent / "uvicorn"), app, "--port", str(port)),
            *("--log-level", "warning", "--no-server-header", "--lifespan", "off"),
        ],
        # django-csp orders the policy's directives by set iteration: one seed for both
        # servers, so that their headers compare byte for byte.
        env=subprocess_env(LOG_LEVEL="WARNING", PYTHONHASHSEED="0"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return Server(url=url, process=process)
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"uvicorn {app} did not start")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(django_db_setup: Any) -> Iterator[dict[str, Server]]:
    """{"django": console.asgi's Django application, "front": the front over it}."""
    started: dict[str, Server] = {}
    try:
        started["django"] = _start("console.asgi:django_application")
        started["front"] = _start("tests.fastpoll_app:application")
        yield started
    finally:
        for server in started.values():
            server.process.terminate()
            server.process.wait(timeout=10)


@dataclass
class World:
    token: str  # an active run's
    agent_token: str
    action: Any  # pending its approval, polled by the run
    voted: Any  # one vote of two: its body names the voter (another read)
    other_agents: Any
    sibling: Any  # another run's action of the same agent


def _writes(prefix: str) -> list[dict[str, Any]]:
    # Active runs may not overlap: each its own names.
    return [{"resource": f"dns-record/{prefix}-*", "operations": ["create"]}]


def _pending(run: Any, name: str) -> Any:
    action = make_action(
        run=run,
        identifier=f"dns-record/{name}",
        operation="create",
        payload={"n": 1},
        status=ActionStatus.PENDING_APPROVAL,
    )
    Approval.objects.create(
        subject=ApprovalSubject.ACTION,
        run=run,
        action=action,
        quorum=2,
        expires_at=timezone.now().replace(year=timezone.now().year + 1),
    )
    return action


@pytest.fixture
def world() -> World:
    robot = make_agent_with_token("fast-bot")
    run = make_active_run(robot.agent, _writes("app"))
    sibling_run = make_active_run(robot.agent, _writes("sib"))
    other = make_active_run(make_agent_with_token("other-bot").agent, _writes("oth"))
    voted = _pending(run.run, "app-voted")
    person = get_user_model().objects.create_user(username="voter")
    ApprovalDecision.objects.create(
        approval=Approval.objects.get(action=voted), person=person, decision=Decision.APPROVE
    )
    return World(
        token=run.token,
        agent_token=robot.token,
        action=_pending(run.run, "app-1"),
        voted=voted,
        other_agents=_pending(other.run, "app-other"),
        sibling=_pending(sibling_run.run, "app-sibling"),
    )


def _get(server: Server, path: str, token: str, **headers: str) -> httpx.Response:
    sent = {"Authorization": f"Bearer {token}", "X-Request-Id": REQUEST_ID, **headers}
    return httpx.get(f"{server.url}{path}", headers=sent, timeout=10)


def _comparable(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    headers = [
        (name, value)
        for name, value in response.headers.multi_items()
        if name not in ("date", "x-test-served-by")
    ]
    return response.status_code, headers, response.content


def _answered_alike(
    servers: dict[str, Server],
    path: str,
    token: str,
    headers: dict[str, str],
    by_front: bool,
    status: int,
) -> None:
    """Both servers answer alike; the front's answer came from itself (or from Django)."""
    django = _get(servers["django"], path, token, **headers)
    front = _get(servers["front"], path, token, **headers)
    assert django.status_code == status, django.text
    assert _comparable(front) == _comparable(django)
    assert ("x-test-served-by" not in front.headers) is by_front


def _learn(servers: dict[str, Server], world: World) -> None:
    """The front replays the headers of Django's own 200 and 304, short and held (a held
    answer adds Preference-Applied and Vary): let it see one of each (`wait=0` is a held
    poll's answer without the wait)."""
    path = f"/api/v1/actions/{world.action.pk}"
    for prefer in ({}, {"Prefer": "wait=0"}):
        etag = _get(servers["front"], path, world.token, **prefer).headers["ETag"]
        _get(servers["front"], path, world.token, **{"If-None-Match": etag, **prefer})


def _token(world: World, which: str) -> str:
    if which == "wrong":  # the run token's prefix with another secret
        return world.token[:-1] + ("A" if world.token[-1] != "A" else "B")
    if which == "unknown":
        return "rt_" + "x" * 40
    return str(getattr(world, which))


def _path(world: World, which: str) -> str:
    if which == "unknown":
        return "/api/v1/actions/00000000-0000-4000-8000-000000000000"
    return f"/api/v1/actions/{getattr(world, which).pk}"


ETAG = '"a1"'  # a new action's (revision 1)
# (case, the action polled, the token, headers, answered by the front itself?, status)
MATRIX: list[tuple[str, str, str, dict[str, str], bool, int]] = [
    ("200", "action", "token", {}, True, 200),
    ("304", "action", "token", {"If-None-Match": ETAG}, True, 304),
    ("other If-None-Match", "action", "token", {"If-None-Match": '"a999"'}, True, 200),
    ("bad If-None-Match", "action", "token", {"If-None-Match": "a1, ,"}, True, 200),
    ("another run of the agent", "sibling", "token", {}, True, 200),
    ("a vote to name", "voted", "token", {}, True, 200),
    ("wrong token", "action", "wrong", {}, False, 401),
    ("unknown token", "action", "unknown", {}, False, 401),
    ("agent token", "action", "agent_token", {}, False, 200),
    ("other agent's action", "other_agents", "token", {}, False, 404),
    ("unknown id", "unknown", "token", {}, False, 404),
    (
        "Prefer wait, unchanged",
        "action",
        "token",
        {"Prefer": "wait=1", "If-None-Match": ETAG},
        True,
        304,
    ),
    (
        "Prefer wait, changed",
        "action",
        "token",
        {"Prefer": "wait=1", "If-None-Match": '"a9"'},
        True,
        200,
    ),
    ("Prefer wait, not final", "action", "token", {"Prefer": "wait=1"}, True, 200),
    ("Prefer wait=0", "action", "token", {"Prefer": "wait=0"}, True, 200),
    ("Prefer, no wait", "action", "token", {"Prefer": "respond-async"}, True, 200),
    ("Prefer wait, a vote to name", "voted", "token", {"Prefer": "wait=1"}, True, 200),
    ("Prefer wait, wrong token", "action", "wrong", {"Prefer": "wait=1"}, False, 401),
    ("bad Prefer", "action", "token", {"Prefer": "wait=soon"}, False, 400),
    ("disallowed Host", "action", "token", {"Host": "evil.example"}, False, 400),
]


@pytest.mark.parametrize(
    ("action", "token", "headers", "by_front", "status"),
    [case[1:] for case in MATRIX],
    ids=[case[0] for case in MATRIX],
)
def test_the_front_answers_a_poll_exactly_as_django_does(
    servers: dict[str, Server],
    world: World,
    action: str,
    token: str,
    headers: dict[str, str],
    by_front: bool,
    status: int,
) -> None:
    _learn(servers, world)
    _answered_alike(servers, _path(world, action), _token(world, token), headers, by_front, status)


@pytest.mark.parametrize("ending", ["revoked", "finished"])
def test_an_ended_runs_token_reads_its_own_action_in_front_and_no_other(
    servers: dict[str, Server], world: World, ending: str
) -> None:
    _learn(servers, world)
    run = world.action.run
    if ending == "revoked":
        run_revoke(run=run, actor=Actor.system("tests"), reason="test")
    else:
        run_finish(run=run, actor=Actor.agent(run.agent))
    world.action.refresh_from_db()
    for action, by_front, status in ((world.action, True, 200), (world.sibling, False, 404)):
        _answered_alike(servers, f"/api/v1/actions/{action.pk}", world.token, {}, by_front, status)


def test_a_poll_without_a_request_id_gets_a_fresh_one_from_the_front(
    servers: dict[str, Server], world: World
) -> None:
    _learn(servers, world)
    url = f"{servers['front'].url}/api/v1/actions/{world.action.pk}"
    answers = [httpx.get(url, headers={"Authorization": f"Bearer {world.token}"}) for _ in "ab"]
    assert all("x-test-served-by" not in answer.headers for answer in answers)
    ids = {answer.headers["X-Request-Id"] for answer in answers}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)


def test_a_web_process_hides_its_loaded_code_from_the_garbage_collector() -> None:
    """console.asgi freezes what it loaded (gc.freeze), so a full collection in a web process
    does not walk Django's modules and the API's schemas while requests wait."""
    probe = "import gc, console.asgi; print(gc.get_freeze_count())"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, check=True
    )
    # A bare interpreter freezes nothing; the loaded product is well over 50,000 objects.
    assert int(result.stdout.decode().split()[-1]) > 50_000, result.stderr.decode()[-800:]


def test_the_product_application_is_the_front_over_django() -> None:
    assert isinstance(asgi.application, PollFront)
    assert asgi.application.app is asgi.django_application


def test_a_deactivated_agents_run_token_is_refused_alike_and_by_django(
    servers: dict[str, Server], world: World
) -> None:
    # principal_for_token: a run token identifies its run only while its agent is active.
    _learn(servers, world)
    agent = world.action.run.agent
    agent.is_active = False
    agent.save(update_fields=["is_active"])
    path = f"/api/v1/actions/{world.action.pk}"
    _answered_alike(servers, path, world.token, {}, False, 401)


def test_a_poll_held_in_front_is_answered_by_the_front_when_the_action_changes(
    servers: dict[str, Server], world: World
) -> None:
    """The held poll waits on the action's pub/sub channel and reads again in front: the
    change reaches the agent without Django (the wait is 20 s; the wake-up ends it)."""
    _learn(servers, world)
    path = f"/api/v1/actions/{world.action.pk}"
    held: dict[str, httpx.Response] = {}

    def poll() -> None:
        headers = {"Prefer": "wait=20", "If-None-Match": ETAG}
        held["answer"] = _get(servers["front"], path, world.token, **headers)

    waiter = threading.Thread(target=poll)
    started = time.monotonic()
    waiter.start()
    time.sleep(0.5)  # held by now; a change before its first read is answered at once too
    Action.objects.filter(pk=world.action.pk).update(
        status=ActionStatus.CANCELLED, revision=F("revision") + 1
    )
    notify_action_changed(world.action.pk)
    waiter.join(timeout=30)
    answer = held["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.headers["ETag"] == '"a2"' and answer.json()["status"] == "cancelled"
    assert answer.headers["Preference-Applied"] == "wait=20"
    assert "x-test-served-by" not in answer.headers
    assert time.monotonic() - started < 15  # woken, not the end of the 20 s wait


def test_a_fresh_front_holds_its_first_held_poll_and_learns_the_answer_from_django(
    servers: dict[str, Server], world: World
) -> None:
    """Before the front has seen a held answer, it still waits in front; Django then gives
    the answer without a wait (wait=0) and the front keeps its headers for the next one."""
    fresh = _start("tests.fastpoll_app:application")
    try:
        path = f"/api/v1/actions/{world.action.pk}"
        held = {"Prefer": "wait=1", "If-None-Match": ETAG}
        for by_front in (False, True):
            started = time.monotonic()
            django = _get(servers["django"], path, world.token, **held)
            front = _get(fresh, path, world.token, **held)
            assert time.monotonic() - started >= 2  # each server held its poll for 1 s
            assert front.status_code == 304
            assert _comparable(front) == _comparable(django)
            assert ("x-test-served-by" not in front.headers) is by_front
    finally:
        fresh.process.terminate()
        fresh.process.wait(timeout=10)


def test_a_fresh_front_learns_the_woken_answer_while_its_polls_wait(
    servers: dict[str, Server], world: World
) -> None:
    """Held polls of a fresh front, woken at the same moment: the front learned the woken
    answer's headers from Django while they waited (a stand-in of the first held poll), so
    every one is answered in front, as Django answers it — none waits, at its wake-up, for
    Django to answer behind whatever woke it."""
    robot = make_agent_with_token("burst-bot")
    run = make_active_run(robot.agent, _writes("burst"))
    actions = [_pending(run.run, f"burst-{number}") for number in range(6)]
    fresh = _start("tests.fastpoll_app:application")
    try:
        answers: dict[int, httpx.Response] = {}

        def poll(number: int) -> None:
            path = f"/api/v1/actions/{actions[number].pk}"
            held = {"Prefer": "wait=20", "If-None-Match": ETAG}
            answers[number] = _get(fresh, path, run.token, **held)

        waiters = [threading.Thread(target=poll, args=(n,)) for n in range(len(actions))]
        for waiter in waiters:
            waiter.start()
        time.sleep(2.0)  # all held by now (a wake-up during the stand-in waits for it)
        Action.objects.filter(pk__in=[a.pk for a in actions]).update(
            status=ActionStatus.CANCELLED, revision=F("revision") + 1
        )
        for action in actions:
            notify_action_changed(action.pk)
        for waiter in waiters:
            waiter.join(timeout=30)
        assert sorted(answers) == list(range(len(actions)))
        assert {a.status_code for a in answers.values()} == {200}
        assert {a.json()["status"] for a in answers.values()} == {"cancelled"}
        by_django = [n for n, a in answers.items() if "x-test-served-by" in a.headers]
        assert by_django == []
        # Each answer in front is the one Django gives for the same poll.
        for number, front in answers.items():
            path = f"/api/v1/actions/{actions[number].pk}"
            held = {"Prefer": "wait=20", "If-None-Match": ETAG}
            assert _comparable(front) == _comparable(
                _get(servers["django"], path, run.token, **held)
            )
    finally:
        fresh.process.terminate()
        fresh.process.wait(timeout=10)


def _held_now(server: Server) -> int:
    """The server's airlock_longpoll_held gauge (polls past their first read, waiting)."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    found = re.search(r"^airlock_longpoll_held (\d+)$", metrics, re.M)
    assert found is not None, metrics[:500]
    return int(found.group(1))


def test_a_held_poll_whose_client_leaves_is_let_go_at_once(world: World) -> None:
    """A client that closes its connection while its poll is held in front: the front stops
    holding it, as Django's handler stops a view whose client left, instead of keeping a
    waiter (and its re-reads) to the end of the 30-s wait."""
    fresh = _start("tests.fastpoll_app:application")
    try:
        host, port = fresh.url.removeprefix("http://").split(":")
        request = (
            f"GET /api/v1/actions/{world.action.pk} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {world.token}\r\nPrefer: wait=30\r\n"
            f"If-None-Match: {ETAG}\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port))) as client:
            client.sendall(request)
            wait_for(lambda: _held_now(fresh) == 1, timeout=10)
        wait_for(lambda: _held_now(fresh) == 0, timeout=5)
    finally:
        fresh.process.terminate()
        fresh.process.wait(timeout=10)
