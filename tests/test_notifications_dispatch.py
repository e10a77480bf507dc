"""The audit chain's reader under collision: two passes at once, and a pass killed with
SIGKILL halfway through its batch. The invariant: every event that can be told is told
exactly once (one notification, one delivery per subscription), none lost, none doubled."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
from django.db import close_old_connections

from audit.services import Actor, audit_append
from notifications.models import Delivery, DispatchCursor, Notification
from notifications.services.dispatch import dispatch_lag, notifications_dispatch_all
from notifications.services.subscriptions import subscription_create

pytestmark = pytest.mark.django_db(transaction=True)

EVENTS = 40


def _events(count: int) -> None:
    for n in range(count):
        audit_append(
            event_type="kill_switch.engaged" if n % 2 == 0 else "kill_switch.released",
            actor=Actor.system("tests"),
            resource="*",
            details={"scope": "*", "reason": f"drill {n}"},
        )


def _subscribe_twice(engine_world: Any) -> None:
    admin = Actor.person(engine_world.person("adele", "admins"))
    for name in ("one", "two"):
        subscription_create(actor=admin, name=name, target="operators", channel="email")


def _told_once_each() -> None:
    seqs = list(Notification.objects.values_list("audit_seq", flat=True))
    assert len(seqs) == EVENTS and len(set(seqs)) == EVENTS
    assert Delivery.objects.count() == 2 * EVENTS  # two subscriptions hear each
    assert dispatch_lag() == 0


def test_two_passes_at_once_tell_each_event_once(engine_world: Any) -> None:
    _subscribe_twice(engine_world)
    _events(EVENTS)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            start.wait()
            for _ in range(20):  # small batches, so the two really interleave
                notifications_dispatch_all(limit=3)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    notifications_dispatch_all()  # whatever a skipped pass left
    _told_once_each()


# A pass in another process that writes two events' notifications, says so, and hangs
# holding the cursor's lock and its uncommitted rows until it is killed.
_HANGING_PASS = """
import sys, time, django
django.setup()
from notifications.services import events
from notifications.services.dispatch import notifications_dispatch

real = events.notification_record
written = []

def record_then_hang(*args, **kwargs):
    result = real(*args, **kwargs)
    written.append(result)
    if len(written) == 2:
        print("halfway", flush=True)
        time.sleep(120)
    return result

events.notification_record = record_then_hang
notifications_dispatch()
"""


def test_a_pass_killed_halfway_loses_nothing_and_doubles_nothing(engine_world: Any) -> None:
    from tests.conftest import ROOT, subprocess_env

    _subscribe_twice(engine_world)
    _events(EVENTS)
    hanging = subprocess.Popen(
        [sys.executable, "-c", _HANGING_PASS],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert hanging.stdout is not None
        assert hanging.stdout.readline().strip() == "halfway", hanging.stderr
        # While it holds the cursor another pass skips instead of waiting or doubling.
        assert notifications_dispatch_all() == 0
        hanging.send_signal(signal.SIGKILL)
        hanging.wait(timeout=10)
    finally:
        if hanging.poll() is None:
            hanging.kill()
    assert not Notification.objects.exists()  # its two were never committed
    assert not DispatchCursor.objects.filter(audit_seq__gt=0).exists()  # nor its cursor
    assert notifications_dispatch_all() > 0  # the lock went with the process
    _told_once_each()
