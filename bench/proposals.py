"""Issue 41's write-proposal figure: `PATCH /api/v1/resources/{kind}/{name}` (a JSON merge
patch with a run token, If-Match and a unique Idempotency-Key, answered 202 with the action
queued) under wrk, ÷ a bare Django view that checks the same bearer token and INSERTs one
row in one transaction (bench.views.bare_insert_view, gunicorn sync), measured in the same
rounds with the same clients, the same Lua script and the same tokens.

No two requests meet on one version: every request writes a resource of its own, seeded at
version 1 just before its wrk run (bench/lua/propose.lua names request n `<tag>l<lane>-<n>`),
so If-Match "1" holds and no queued write stands in front of it; an answer other than 202
is an error. The kind is the bench's own (KIND, class recompute_field: applied per run, so
an auto-approved run's update is queued at once, nobody decides), and its writes are spread
over LANE_TOKENS-sized lanes, each a run of its own, so that no run token meets the
product's default write rate limit (600 a minute). The Procfile's workers drain the queued
writes while wrk runs (as an agent meets the product); each product run's writes are waited
for (applied) before the next wrk run, so that no backlog reaches the bare view's run or
another figure group.
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from django.db import connection
from django.db.models import Count

from approvals.models import Action, Run
from approvals.services.rules import auto_approve_rule_create
from approvals.services.runs import run_finish
from audit.services import Actor
from bench import fixtures
from bench.figures import Bench, rounded_median
from bench.report import figure
from bench.stack import log
from bench.views import BARE_PROPOSALS_DDL
from bench.wrk import WrkResult, run_wrk
from ownership.models import ResourceKind
from ownership.services.catalog import resource_kind_save

KIND = "bench-prop"
CONFLICT_CLASS = "recompute_field"  # per_run, resolver agent: queued without a person
SCRIPT = Path(__file__).resolve().parent / "lua" / "propose.lua"
PRODUCT_PATH = f"/api/v1/resources/{KIND}/"
BARE_PATH = f"/bench/bare/proposals/{KIND}/"
# Resources seeded per second of a product run: ten times what the product proposed on two
# cores when this was written (a request past them would answer 404: an error, and say so).
SEEDED_PER_SECOND = 1000
# A proposal slower than this is an error. Not the poll figures' 2 s: with 128 clients and
# tens of proposals a second, a request waits seconds for its turn (the p99 says how long).
TIMEOUT = "10s"
LANE_TOKENS = 400  # writes a run token may carry in one wrk run: under the 600/minute limit
DRAIN_TIMEOUT = 60.0
QUIET_S = 0.5  # no new action for this long after wrk stopped: the web processes are done
CLIENTS = (8, 32, 128)  # every size's client counts (the tiny size: the first only)
KEYS = [f"proposal_vs_bare_insert_{clients}" for clients in CLIENTS]

_SEED = (
    "INSERT INTO ownership_resource (kind_id, name, document, version, last_fence, deleted, "
    "owner_group, created_at, updated_at) "
    "SELECT %(kind)s, %(tag)s || 'l' || (g %% %(lanes)s) || '-' || g, '{\"n\": 0}'::jsonb, "
    "1, 0, false, %(group)s, now(), now() FROM generate_series(0, %(last)s::bigint) g"
)


@dataclass(frozen=True)
class Block:
    """One product run's resources and the lanes (runs) that write them."""

    tag: str
    runs: list[fixtures.RunHandle]
    tokens_file: Path
    names: int


def _prepare(b: Bench) -> None:
    """The bare view's table, and the bench's own kind with its auto-approve rule."""
    with connection.cursor() as cursor:
        cursor.execute(BARE_PROPOSALS_DDL)
    if ResourceKind.objects.filter(slug=KIND).exists():
        return
    admin = Actor.person(b.world.admin)
    resource_kind_save(
        slug=KIND,
        data={
            "description": "bench: write proposals (bench.proposals)",
            "classes": {"create": "add_unique", "update": CONFLICT_CLASS, "delete": CONFLICT_CLASS},
            "owner_group": fixtures.OWNER_GROUP,
        },
        actor=admin,
    )
    auto_approve_rule_create(
        actor=admin, kind=KIND, operations=["create", "update"], description="bench"
    )


def _block(b: Bench, tag: str, names: int) -> Block:
    """`names` resources at version 1 (one INSERT … SELECT: they are the background of the
    writes measured, as bench.seed's) and one auto-approved run a lane of LANE_TOKENS."""
    lanes = max(1, math.ceil(names / LANE_TOKENS))
    runs = [
        fixtures.run_for(b.world, [f"{KIND}/{tag}l{lane}-*"], task=f"bench: proposals {tag}")
        for lane in range(lanes)
    ]
    with connection.cursor() as cursor:
        params: dict[str, Any] = {"kind": KIND, "tag": tag, "lanes": lanes, "last": names - 1}
        cursor.execute(_SEED, {**params, "group": fixtures.OWNER_GROUP})
    tokens_file = b.stack.workdir / f"proposal-tokens-{tag}.txt"
    tokens_file.write_text("".join(f"{run.token}\n" for run in runs))
    return Block(tag=tag, runs=runs, tokens_file=tokens_file, names=names)


def _wrk(b: Bench, side: str, block: Block, clients: int, seconds: int) -> WrkResult:
    base, path = (
        (b.stack.base, PRODUCT_PATH) if side == "proposal" else (b.stack.bare_base, BARE_PATH)
    )
    return run_wrk(
        f"{base}{path}",
        clients=clients,
        seconds=seconds,
        script=SCRIPT,
        script_args=[path, block.tag, str(block.tokens_file)],
        ok=("202",),
        timeout=TIMEOUT,
    )


def _statuses(tag: str) -> dict[str, int]:
    rows = (
        Action.objects.filter(kind_id=KIND, name__startswith=f"{tag}l")
        .values("status")
        .annotate(n=Count("id"))
    )
    return {row["status"]: row["n"] for row in rows}


def _drained(b: Block) -> dict[str, Any]:
    """How far the workers got while wrk ran, then wait until the block is quiet: every write
    final and no new one for QUIET_S (the web processes go on with the requests wrk left in
    flight when it stopped). The next wrk run starts without a backlog; the lanes' runs end."""
    when_stopped = _statuses(b.tag)
    t0 = changed = time.monotonic()
    now = when_stopped
    while time.monotonic() - t0 < DRAIN_TIMEOUT:
        time.sleep(0.05)
        latest = _statuses(b.tag)
        if sum(latest.values()) != sum(now.values()):
            changed = time.monotonic()
        now = latest
        if not set(now) - fixtures.FINAL and time.monotonic() - changed >= QUIET_S:
            break
    waited = round(time.monotonic() - t0, 2)
    for handle in b.runs:
        run = Run.objects.select_related("agent").get(pk=handle.run_id)
        run_finish(run=run, actor=Actor.agent(run.agent))
    return {
        "actions": sum(now.values()),
        "actions_when_wrk_stopped": sum(when_stopped.values()),
        "applied_when_wrk_stopped": when_stopped.get("applied", 0),
        "quiet_after_s": waited,
        "statuses": now,
        "not_applied": sum(n for status, n in now.items() if status != "applied"),
    }


def _probe(b: Bench) -> dict[str, Any]:
    """One proposal and one bare INSERT by hand before any load: both 202, the action queued
    (or already past it) in the expected class."""
    block = _block(b, f"probe{uuid.uuid4().hex[:4]}", 1)
    token = block.runs[0].token
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/merge-patch+json",
        "If-Match": '"1"',
        "Idempotency-Key": f"bench-{block.tag}-0",
    }
    answers = {}
    for side, base, path in (
        ("proposal", b.stack.base, PRODUCT_PATH),
        ("bare", b.stack.bare_base, BARE_PATH),
    ):
        url = f"{base}{path}{block.tag}l0-0"
        answer = httpx.patch(url, headers=headers, content=b'{"n": 0}', timeout=30)
        if answer.status_code != 202:
            raise RuntimeError(f"{side}: {answer.status_code} {answer.text[:300]}")
        answers[side] = answer.json()
    action = answers["proposal"]
    if action.get("conflict_class") != CONFLICT_CLASS or action.get("status") not in (
        "queued",
        "executing",
        "applied",
    ):
        raise RuntimeError(f"the proposal was not queued as {CONFLICT_CLASS}: {action}")
    _drained(block)
    return {"status": action["status"], "conflict_class": action["conflict_class"]}


Rounds = dict[int, list[dict[str, Any]]]


def _warm_up(b: Bench, tag: str) -> None:
    """One short run of each side first, not counted: every web process and worker has
    served a proposal (imports, connections, caches) before the first timed round."""
    block = _block(b, f"{tag}w", SEEDED_PER_SECOND)
    for side in ("proposal", "bare"):
        _wrk(b, side, block, b.size.clients[0], 1)
    _drained(block)


def _rounds(b: Bench) -> Rounds:
    """Bare and product runs interleaved per round and client count (order flipped every
    other round); a fresh block of resources and lanes for each product run."""
    rounds: Rounds = {c: [] for c in b.size.clients}
    tag = f"p{uuid.uuid4().hex[:4]}"
    seconds = b.size.proposal_seconds
    _warm_up(b, tag)
    for number in range(b.size.proposal_rounds):
        for clients in b.size.clients:
            block = _block(b, f"{tag}r{number}c{clients}", SEEDED_PER_SECOND * seconds)
            order = ["bare", "proposal"] if number % 2 == 0 else ["proposal", "bare"]
            result: dict[str, Any] = {}
            for side in order:
                result[side] = _wrk(b, side, block, clients, seconds)
                if side == "proposal":  # its writes applied before anything else runs
                    result["drain"] = _drained(block)
            rounds[clients].append(result)
            log(
                f"proposals c={clients}: bare {result['bare'].rps}/s, proposal "
                f"{result['proposal'].rps}/s, {result['drain']['applied_when_wrk_stopped']} of "
                f"{result['drain']['actions_when_wrk_stopped']} applied when wrk stopped, all "
                f"{result['drain']['actions']} in {result['drain']['quiet_after_s']} s"
            )
    return rounds


def _summed(results: list[WrkResult]) -> dict[str, int]:
    total: dict[str, int] = {}
    for result in results:
        for code, n in result.statuses.items():
            total[code] = total.get(code, 0) + n
    return total


def _figure(clients: int, runs: list[dict[str, Any]], detail: dict[str, Any]) -> dict[str, Any]:
    key = f"proposal_vs_bare_insert_{clients}"
    bare = [r["bare"] for r in runs]
    product = [r["proposal"] for r in runs]
    not_applied = sum(r["drain"]["not_applied"] for r in runs)
    applied_meanwhile = sum(r["drain"]["applied_when_wrk_stopped"] for r in runs)
    at_stop = sum(r["drain"]["actions_when_wrk_stopped"] for r in runs)
    actions = sum(r["drain"]["actions"] for r in runs)
    drain_max = max(r["drain"]["quiet_after_s"] for r in runs)
    return figure(
        key,
        rounded_median([p.rps / w.rps for p, w in zip(product, bare, strict=True) if w.rps]),
        errors=sum(p.errors + w.errors for p, w in zip(product, bare, strict=True)) + not_applied,
        proposal_rps=statistics.median(p.rps for p in product),
        bare_rps=statistics.median(w.rps for w in bare),
        proposal_statuses=_summed(product),
        bare_statuses=_summed(bare),
        actions_recorded=actions,
        actions_not_applied=not_applied,
        **detail,
        rounds=[
            {"bare": r["bare"].as_dict(), "proposal": r["proposal"].as_dict(), "drain": r["drain"]}
            for r in runs
        ],
        note=(
            f"proposal {statistics.median(p.rps for p in product):,.0f}/s vs bare "
            f"{statistics.median(w.rps for w in bare):,.0f}/s; when wrk stopped the workers "
            f"had applied {applied_meanwhile} of {at_stop} queued writes; all {actions} "
            f"(with those left in flight) applied within {drain_max} s"
        ),
    )


def proposals(b: Bench) -> dict[str, Any]:
    _prepare(b)
    detail = {
        "probe": _probe(b),
        "wrk_seconds": b.size.proposal_seconds,
        "wrk_timeout": TIMEOUT,
        "conflict_class": CONFLICT_CLASS,
        "workers": "the Procfile's worker line, draining while wrk runs",
    }
    rounds = _rounds(b)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM bench_bare_proposal")
        row = cursor.fetchone()
    log(f"proposals: the bare view inserted {row[0] if row else '?'} rows")
    return {f"proposal_vs_bare_insert_{c}": _figure(c, runs, detail) for c, runs in rounds.items()}


GROUPS = {"proposals": (proposals, KEYS)}
