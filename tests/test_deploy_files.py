"""deploy/grafana/airlock.json and deploy/prometheus/alerts.yml name only metrics that
/metrics serves: every `airlock_*` name in their expressions is looked up in a real scrape."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from django.test import Client

from audit.services import audit_chain_verify
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db

DASHBOARD = ROOT / "deploy" / "grafana" / "airlock.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\bairlock_[a-z_]+\b")
SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in board["panels"] for t in panel["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def served_metric_names(engine_redis: Any) -> set[str]:
    audit_chain_verify()  # a recorded check, as the hourly walk leaves
    text = Client().get("/metrics").content.decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_the_dashboard_and_the_alerts_name_only_metrics_that_exist(engine_redis: Any) -> None:
    served = served_metric_names(engine_redis)
    named = {
        name
        for expr in dashboard_expressions() + [rule["expr"] for rule in alert_rules()]
        for name in METRIC.findall(expr)
    }
    assert len(named) >= 15
    missing = sorted(
        name
        for name in named
        if name not in served and not (name.endswith(SUFFIXES) and name.rsplit("_", 1)[0] in served)
    )
    assert not missing, f"named in deploy/ but not served by /metrics: {missing}"


def test_every_alert_the_issue_asks_for_is_there_with_a_summary() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for name in (
        "AirlockApprovalsExpiringUnattended",
        "AirlockOperationsUnknown",
        "AirlockReconcilerRepairsSpiking",
        "AirlockAuditChainBroken",
        "AirlockKillSwitchEngagedLong",
    ):
        assert rules[name]["annotations"]["summary"], name
        assert "for" in rules[name] and rules[name]["labels"]["severity"] in {"warning", "critical"}
    titles = {panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]}
    for wanted in ("Approvals waiting", "Queue depth", "Audit chain", "Open conflicts, by class"):
        assert any(title.startswith(wanted) for title in titles), wanted
