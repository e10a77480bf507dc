"""The agent's GETs under wrk, each ÷ the bare token view measured in the same rounds: the
action poll (and its 304), every other agent-facing GET with each token kind, and the
resource list's page (issue 41). bench.run measures these groups first (`--only poll,list`).
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from bench import fixtures
from bench.figures import Bench, rounded_median
from bench.report import figure
from bench.stack import log
from bench.wrk import WrkResult, run_wrk

CLIENTS = (8, 32, 128)  # every size's client counts (the tiny size: the first only)


def _first_answers(targets: dict[str, tuple[str, str, str]]) -> dict[str, str]:
    """Every GET answers 200 before any load; returns each one's ETag (by target name)."""
    etags: dict[str, str] = {}
    for name, (url, token, _) in targets.items():
        answer = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        if answer.status_code != 200:
            raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:300]}")
        etags[name] = str(answer.headers.get("etag", ""))
    return etags


# Every agent-facing GET measured beside the action poll with the run token (`poll`), each
# with both token kinds the contract allows: (figure name, path, which token).
AGENT_GETS = (
    ("action_agent", "action", "agent"),
    ("run_run", "run", "run"),
    ("run_agent", "run", "agent"),
    ("resource_run", "resource", "run"),
    ("resource_agent", "resource", "agent"),
)


def _get_targets(b: Bench) -> dict[str, tuple[str, str, str]]:
    """{name: (url, token, If-None-Match)} of the bare view, the poll, its 304 and each GET."""
    resource = f"read-{uuid.uuid4().hex[:6]}"
    fixtures.create_resources(b.core, "bench-core", [resource], {"n": 0})
    action = b.poll_action.action_id
    paths = {
        "action": f"/api/v1/actions/{action}",
        "run": f"/api/v1/runs/{b.main.run_id}",
        "resource": f"/api/v1/resources/bench-core/{resource}",
    }
    tokens = {"run": b.main.token, "agent": b.world.agent_token}
    bare_url = f"{b.stack.bare_base}/bench/bare/actions/{action}"
    targets = {
        "bare": (bare_url, b.main.token, ""),
        "poll": (f"{b.stack.base}{paths['action']}", b.main.token, ""),
    }
    for name, path, token in AGENT_GETS:
        targets[name] = (f"{b.stack.base}{paths[path]}", tokens[token], "")
    return targets


Targets = dict[str, tuple[str, str, str]]
Rounds = dict[int, list[dict[str, WrkResult]]]


def _wrk_rounds(
    b: Bench, group: str, targets: Targets, *, first_count_only: frozenset[str] = frozenset()
) -> Rounds:
    """Every target under wrk at each client count, interleaved per round (order flipped
    every other round), so drift on a shared machine hits all of them alike. The targets in
    `first_count_only` run at the size's first client count only."""
    rounds: Rounds = {c: [] for c in b.size.clients}
    for number in range(b.size.poll_rounds):
        for clients in b.size.clients:
            names = [
                n for n in targets if clients == b.size.clients[0] or n not in first_count_only
            ]
            order = names if number % 2 == 0 else list(reversed(names))
            results: dict[str, WrkResult] = {}
            for name in order:
                target, token, inm = targets[name]
                results[name] = run_wrk(
                    target, clients=clients, seconds=b.size.poll_seconds, token=token, etag=inm
                )
            rounds[clients].append(results)
            log(f"{group} c={clients}: " + ", ".join(f"{k} {v.rps}/s" for k, v in results.items()))
    return rounds


def _versus_bare(rounds: Rounds, names: list[str], **detail: Any) -> dict[str, Any]:
    """`{name}_vs_bare_{clients}`: the median per-round ratio to the bare view's rate."""
    out: dict[str, Any] = {}
    for clients, runs in rounds.items():
        for name in names:
            out[f"{name}_vs_bare_{clients}"] = figure(
                f"{name}_vs_bare_{clients}",
                rounded_median([r[name].rps / r["bare"].rps for r in runs if r["bare"].rps]),
                errors=sum(r[name].errors + r["bare"].errors for r in runs),
                rounds=[{k: r[k].as_dict() for k in ("bare", name)} for r in runs],
                **detail,
            )
    return out


def _versus_200(name: str, runs: list[dict[str, WrkResult]], ok: str, revalidated: str) -> Any:
    """`name`: the median per-round rate of the If-None-Match GET ÷ the same GET's 200."""
    not_304 = sum(r[revalidated].requests - r[revalidated].statuses.get("304", 0) for r in runs)
    return figure(
        name,
        rounded_median([r[revalidated].rps / r[ok].rps for r in runs if r[ok].rps]),
        errors=sum(r[revalidated].errors for r in runs),
        answers_not_304=not_304,
        note="If-None-Match was not answered 304" if not_304 else "",
    )


def poll(b: Bench) -> dict[str, Any]:
    """Bare, product and 304 runs interleaved per round (order flipped every other round),
    so drift on a shared machine hits all of them; each figure is the median per-round ratio.
    Beside the action poll with the run token: every agent-facing GET with each token kind,
    and each of them revalidated (If-None-Match with its ETag → 304) at the first client
    count (the action poll's own 304 at every count, as before)."""
    targets = _get_targets(b)
    etags = _first_answers(targets)
    for name in ("poll", *(get for get, _, _ in AGENT_GETS)):
        url, token, _ = targets[name]
        targets[f"{name}_304"] = (url, token, etags[name])
    later = frozenset(f"{get}_304" for get, _, _ in AGENT_GETS)
    rounds = _wrk_rounds(b, "poll", targets, first_count_only=later)
    out = _versus_bare(rounds, ["poll", *(get for get, _, _ in AGENT_GETS)])
    all_runs = [r for runs in rounds.values() for r in runs]
    out["poll_304_vs_200"] = _versus_200("poll_304_vs_200", all_runs, "poll", "poll_304")
    first = rounds[b.size.clients[0]]
    for get, _, _ in AGENT_GETS:
        name = f"{get}_304_vs_200"
        out[name] = _versus_200(name, first, get, f"{get}_304")
        out[name]["clients"] = b.size.clients[0]
    return out


# The resource list's page measured: the first of a kind's names under one prefix, at the
# default limit (50) with one resource more, so that the page is full and names the next.
LIST_PAGE = 50
LIST_GETS = (("list_run", "run"), ("list_agent", "agent"))


def _full_page(name: str, answer: httpx.Response) -> None:
    if answer.status_code != 200:
        raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:300]}")
    page = answer.json()
    if len(page["items"]) != LIST_PAGE or page["next"] is None:
        raise RuntimeError(f"{name}: not a full page with a next one: {answer.text[:300]}")


def list_page(b: Bench) -> dict[str, Any]:
    """`GET /api/v1/resources?kind=…&prefix=…` (a full page of LIST_PAGE) with each token
    kind, interleaved per round with the same bare view as the poll figures; beside them the
    same page through Django (an extra query parameter the front leaves to Django, which
    ignores it), at the first client count and in the detail only: what the front saves on
    this page."""
    prefix = f"list-{uuid.uuid4().hex[:6]}-"
    names = [f"{prefix}{i:03d}" for i in range(LIST_PAGE + 1)]
    fixtures.create_resources(b.core, "bench-core", names, {"n": 0})
    path = f"/api/v1/resources?kind=bench-core&prefix={prefix}"
    tokens = {"run": b.main.token, "agent": b.world.agent_token}
    bare = f"{b.stack.bare_base}/bench/bare/actions/{b.poll_action.action_id}"
    targets: Targets = {"bare": (bare, b.main.token, "")}
    for name, token in LIST_GETS:
        targets[name] = (f"{b.stack.base}{path}", tokens[token], "")
    targets["list_django"] = (f"{b.stack.base}{path}&through=django", b.main.token, "")
    for name, (url, token, _) in targets.items():
        answer = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        if name == "bare" and answer.status_code != 200:
            raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:300]}")
        if name != "bare":
            _full_page(name, answer)
    # Django's page at the first client count only: at 128 clients it answers a few dozen a
    # second, and the requests still queued when wrk stops were served into the next wrk
    # run (a round's first run after it errored on every connection, and the list's own
    # figures read the backlog).
    rounds = _wrk_rounds(b, "list", targets, first_count_only=frozenset({"list_django"}))
    out = _versus_bare(rounds, [name for name, _ in LIST_GETS], page_items=LIST_PAGE)
    first = b.size.clients[0]
    runs = rounds[first]
    for name, _ in LIST_GETS:
        fig = out[f"{name}_vs_bare_{first}"]
        fig["front_vs_django"] = rounded_median(
            [r[name].rps / r["list_django"].rps for r in runs if r["list_django"].rps]
        )
        fig["django_rounds"] = [r["list_django"].as_dict() for r in runs]
    return out


GET_FIGURES = [
    f"{name}_vs_bare_{clients}"
    for name in ("poll", *(get for get, _, _ in AGENT_GETS))
    for clients in CLIENTS
]
LIST_FIGURES = [f"{name}_vs_bare_{clients}" for name, _ in LIST_GETS for clients in CLIENTS]
REVALIDATED_FIGURES = ["poll_304_vs_200", *(f"{get}_304_vs_200" for get, _, _ in AGENT_GETS)]
GROUPS = {
    "poll": (poll, [*GET_FIGURES, *REVALIDATED_FIGURES]),
    "list": (list_page, LIST_FIGURES),
}
