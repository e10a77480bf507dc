"""`manage.py doctor`: check a deployment and say what to fix.

One line per problem, each with its fix; exit 1 when anything is wrong (0 with `--warn-only`,
which `make run` uses to print what it finds without stopping). Two kinds of finding:
- problems: this deployment does not work as it should right now (a service down, migrations
  not applied, no worker or cron process, the fence source behind the rows, the audit chain
  broken or not verified lately);
- production settings: what `check --deploy` warns about (airlock.W0xx: SECRET_KEY, METRICS_TOKEN,
  connections against max_connections, …), reported here too so one command says it all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import run_checks
from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from audit.services import audit_chain_status
from console.health import live_workers, readiness, redis_client
from engine.core.fence import current_fence, fence_floor
from notifications.outbox import QUEUE_NAME as NOTIFY_QUEUE

# The whole walk runs hourly (approvals/cron.py); one older than this means the job stopped.
AUDIT_WALK_FRESH = timedelta(hours=3)

FIXES = {
    "database": "check DATABASE_URL and that PostgreSQL accepts connections from this host",
    "redis": "check REDIS_URL and that Redis is running",
    "migrations": "run `python manage.py migrate` (start-up of every process needs it done)",
    "workers": "start the Procfile's `worker` line (at least one process)",
    "cron": "start the Procfile's `cron` line (exactly one process)",
    "notify": "start the Procfile's `notify` line (at least one process)",
}


@dataclass(frozen=True)
class Finding:
    kind: str  # "problem" or "setting"
    text: str
    fix: str

    def line(self) -> str:
        label = "problem" if self.kind == "problem" else "production setting"
        return f"{label}: {self.text} — fix: {self.fix}"


def service_findings() -> list[Finding]:
    state = readiness()
    findings = [
        Finding("problem", f"{part}: {value}", FIXES[part])
        for part, value in state.parts.items()
        if value != "ok"
    ]
    if state.pending_migrations:
        shown = ", ".join(state.pending_migrations[:5])
        findings.append(Finding("problem", f"migrations not applied: {shown}", FIXES["migrations"]))
    return findings


def notification_findings() -> list[Finding]:
    """Deliveries have a queue of their own (`notifications`) that the engine's workers never
    serve: without a `notify` worker nothing is sent and reminders are not made. (Not part
    of /readyz: the engine works without it.)"""
    try:
        client = redis_client()
        try:
            workers = live_workers(client, NOTIFY_QUEUE)
        finally:
            client.close()
    except Exception as exc:  # Redis is down: service_findings said so
        return [
            Finding("problem", f"notify workers not checked ({type(exc).__name__})", FIXES["redis"])
        ]
    if workers:
        return []
    return [
        Finding(
            "problem",
            f"notify workers: no worker listens on the {NOTIFY_QUEUE!r} queue "
            "(no notification is delivered)",
            FIXES["notify"],
        )
    ]


def engine_findings() -> list[Finding]:
    findings: list[Finding] = []
    try:
        floor, source = fence_floor(), current_fence()
    except Exception as exc:  # the database is down: service_findings said so
        return [Finding("problem", f"fence not checked ({type(exc).__name__})", FIXES["database"])]
    if source < floor:
        findings.append(
            Finding(
                "problem",
                f"the fence source ({source}) is below the highest stored fence ({floor}): "
                "the next writes would be refused as stale_fence",
                "run `python manage.py migrate` (it lifts the fence floor), e.g. after a restore",
            )
        )
    ttl_seconds = settings.AIRLOCK_LOCK_TTL_MS / 1000
    if ttl_seconds < settings.AIRLOCK_TARGET_TIMEOUT_SECONDS:  # settings refuse it; belt
        findings.append(
            Finding(
                "problem",
                f"the target timeout ({settings.AIRLOCK_TARGET_TIMEOUT_SECONDS} s) outlives the "
                f"resource lock ({ttl_seconds} s)",
                "raise AIRLOCK_LOCK_TTL_MS or lower AIRLOCK_TARGET_TIMEOUT_SECONDS",
            )
        )
    return findings


def audit_findings() -> list[Finding]:
    try:
        status = audit_chain_status()
    except Exception as exc:
        return [Finding("problem", f"audit chain not checked ({type(exc).__name__})", "see above")]
    if not status.ok:
        return [
            Finding(
                "problem",
                f"the audit chain is broken at seq {status.first_bad_seq} ({status.problem})",
                "run `python manage.py audit_verify` and investigate; restore from a backup "
                "and compare with your anchors (docs/audit-chain.md)",
            )
        ]
    walked = status.full_walk_at
    if walked is not None and timezone.now() - walked > AUDIT_WALK_FRESH:
        return [
            Finding(
                "problem",
                f"the audit chain's last whole walk was at {walked:%Y-%m-%d %H:%M} UTC",
                "check that the cron process runs (it walks the chain hourly)",
            )
        ]
    return []


def setting_findings() -> list[Finding]:
    messages = run_checks(include_deployment_checks=True)
    return [
        Finding("setting", f"{m.msg} ({m.id})", m.hint or "see the README's Configuration")
        for m in messages
        if (m.id or "").startswith("airlock.")
    ]


def diagnose() -> list[Finding]:
    findings = service_findings()
    services_down = any(f.text.startswith(("database", "redis")) for f in findings)
    if not services_down:
        findings += engine_findings() + notification_findings() + audit_findings()
    return findings + setting_findings()


class Command(BaseCommand):
    help = "Check this deployment: one line per problem with its fix; exit 1 if any."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--warn-only", action="store_true", help="print the findings but exit 0"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        findings = diagnose()
        for finding in findings:
            self.stdout.write(finding.line())
        problems = sum(1 for f in findings if f.kind == "problem")
        settings_left = len(findings) - problems
        self.stdout.write(
            f"doctor: {problems} problem(s), {settings_left} production setting(s) to review"
            if findings
            else "doctor: all checks passed"
        )
        if findings and not options["warn_only"]:
            raise SystemExit(1)
