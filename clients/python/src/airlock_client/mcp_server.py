"""`airlock-mcp`: Airlock as MCP tools and resources, on the official `mcp` SDK.

Configured from the environment:

- `AIRLOCK_URL` — the Airlock server, e.g. http://127.0.0.1:8000
- `AIRLOCK_AGENT_TOKEN` (ak_…) — the agent starts its own runs with `start_run`, or
- `AIRLOCK_RUN_TOKEN` (rt_…) — join a run somebody already started (and a person approved).

`airlock-mcp` serves stdio (the default: desktop MCP clients start it as a subprocess);
`airlock-mcp --transport streamable-http --port 8765` serves streamable HTTP at /mcp —
with `AIRLOCK_MCP_TOKEN` (or `--token`) set, only to requests that carry it as a bearer
token; without one, on a loopback address only (`mcp_http`).

Every tool speaks only the public REST API through `AsyncAirlock`; a refused write
becomes a tool error that tells the model what to do next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable
from typing import Any, Literal, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError

from airlock_client.aclient import AsyncAirlock, AsyncRunSession
from airlock_client.errors import (
    AirlockError,
    IdempotencyKeyReused,
    InvalidIdentifier,
    KillSwitchEngaged,
    Leased,
    NotFound,
    OutsideWriteSet,
    ProblemError,
    RateLimited,
    RunNotActive,
    RunNotApproved,
    StaleVersion,
    WriteSetConflict,
)
from airlock_client.mcp_http import serve_http
from airlock_client.mcp_plans import plan_steps_json, plan_view, write_fields
from airlock_client.models import Action, Resource, Run

T = TypeVar("T")

#: MCP clients cap a tool call's duration (often at 120 s): never wait longer per call.
MAX_TOOL_WAIT_SECONDS = 110

Operation = Literal["replace", "merge_patch", "delete", "create"]
_WRITE_SET_OPERATION = {
    "replace": "update",
    "merge_patch": "update",
    "delete": "delete",
    "create": "create",
}

INSTRUCTIONS = """\
Airlock stands between you and production resources. Every change is a proposal that
Airlock checks (your run's write set, the version you read) and that may need a person's
approval before a worker applies it. Work like this:
1. read_resource to get the current document and its version (ETag).
2. propose_write based on what you read. The answer says whether it waits for a person.
3. wait_for_action until it is applied (or rejected / a conflict); call it again while it
   says "still pending".
4. If a write is refused as stale: re-read, re-plan your change on the current document,
   and propose again. Never resend the same write.
Inside the undo window you may undo_action an applied change.
For one change across several resources, propose_plan instead: every step is approved as
one, applied in order, and compensated in reverse if a later step fails; wait_for_plan."""


class AirlockTools:
    """The state of one MCP server process: the Airlock client and the current run."""

    def __init__(self, url: str, agent_token: str | None, run_token: str | None) -> None:
        if not agent_token and not run_token:
            raise SystemExit("airlock-mcp: set AIRLOCK_AGENT_TOKEN or AIRLOCK_RUN_TOKEN")
        self.client = AsyncAirlock(url, agent_token or run_token or "")
        self.agent_token = agent_token
        self.run_token = run_token
        self.session: AsyncRunSession | None = None
        #: The ETag of each resource as this process last read it (the default base of
        #: the next proposal, so a write is always based on something actually read).
        self.read_etags: dict[str, str] = {}

    async def current_run(self) -> AsyncRunSession:
        if self.session is None and self.run_token:
            self.session = await self.client.join_run(self.run_token)
        if self.session is None:
            raise ToolError(
                "No run yet: call start_run with your task and the resources you will "
                "change (the write set). A person may have to approve it."
            )
        return self.session

    async def run_answer(
        self, session: AsyncRunSession, waiting: Awaitable[object]
    ) -> dict[str, Any]:
        """The run after `waiting` (for a person's decision): not approved (yet) is an
        answer, not an error. An active run heartbeats from then on."""
        try:
            await waiting
        except RunNotApproved:
            pass
        except AirlockError as exc:
            raise tool_error(exc) from exc
        if session.run.active:
            session.start_heartbeat()
        return run_view(session.run)


# --- What the model reads ------------------------------------------------------------------


def run_view(run: Run) -> dict[str, Any]:
    view: dict[str, Any] = {"run": run.id, "status": run.status, "task": run.task}
    view.update(write_set=run.write_set, expires_at=run.expires_at)
    if run.status_reason:
        view["status_reason"] = run.status_reason
    view["next"] = {
        "pending_approval": "A person must approve this run (identity and write set) before "
        "you can write. Call show_run with wait_seconds to wait for the decision.",
        "active": "You may read and propose writes to the resources in the write set.",
        "rejected": "A person rejected this run; see status_reason. Do not write.",
        "finished": "This run is finished; start a new run to write again.",
        "expired": "This run expired; start a new run to write again.",
        "revoked": "An operator revoked this run; see status_reason. Stop writing.",
    }.get(run.status, "")
    return view


def resource_view(resource: Resource) -> dict[str, Any]:
    view = {"resource": resource.identifier, "version": resource.version, "etag": resource.etag}
    return {**view, "document": resource.document, "owner_group": resource.owner_group}


def _waiting_for(action: Action) -> str:
    approval = action.approval or {}
    if action.status == "pending_approval":
        so_far, quorum = approval.get("approvals_so_far", 0), approval.get("quorum", 1)
        return (
            f"a person's approval of this call (class {action.conflict_class}, "
            f"{so_far} of {quorum} approvals so far)"
        )
    if action.status == "paused":
        reason = action.raw.get("paused_reason") or "a kill switch is engaged"
        return f"the release of a kill switch ({reason}); it resumes by itself"
    return "a worker to apply the approved write"


def action_view(action: Action) -> dict[str, Any]:
    view: dict[str, Any] = {"action": action.id, **write_fields(action)}
    execution = action.execution or {}
    if action.replayed:
        view["replayed"] = True
    edited = action.edited
    if edited:
        view["edited"] = edited
    if action.status == "superseded":
        view["superseded_by"] = action.superseded_by
        view["next"] = (
            f"Superseded: a person approved an edited version of this write, action "
            f"{action.superseded_by}. Call wait_for_action with that id for its outcome."
        )
    elif action.status == "applied":
        view["result_etag"] = action.result_etag
        view["undo_deadline"] = execution.get("undo_deadline")
        view["next"] = (
            f"Applied: {action.resource} is now at {action.result_etag}. It can be undone "
            f"with undo_action until {execution.get('undo_deadline')}."
        )
    elif action.status == "rejected":
        comment = action.rejection_comment or ""
        by = (action.approval or {}).get("by") or "a person"
        view["comment"] = comment
        view["next"] = (
            f"Rejected by {by}" + (f": {comment!r}" if comment else "") + ". Do not send "
            "the same change again; re-plan it with the comment in mind, or stop."
        )
    elif action.status == "conflict":
        conflict = action.conflict or {}
        view["conflict"] = conflict
        if action.retryable_by_agent:
            view["next"] = (
                f"The resource changed before this write ran (now {conflict.get('current_etag')}). "
                "Re-read it with read_resource, re-plan on the current document and propose again."
            )
        else:
            view["next"] = (
                f"The resource changed before this write ran; {conflict.get('resolver')} decides "
                "(keep current, take yours, or merge). Call wait_for_action to see the outcome."
            )
    elif action.status == "undone":
        view["next"] = "Undone: the previous document is restored."
    elif action.final:
        view["error"] = action.error
        view["next"] = f"The action ended as {action.status}; nothing was written."
    else:
        view["waiting_for"] = _waiting_for(action)
        view["next"] = (
            f"Still pending: waiting for {_waiting_for(action)}. Call wait_for_action "
            "again to keep waiting."
        )
    if edited:
        view["next"] = (
            f"Edited by {edited.get('by') or 'a person'} before approval: your action "
            f"{edited.get('supersedes')} was superseded by this one ({action.id}); see `edited` "
            "for what changed. " + str(view.get("next") or "")
        )
    if action.undo:
        view["undo"] = action.undo
    return view


def tool_error(exc: AirlockError, *, resource: str = "", operation: str = "") -> ToolError:
    """A refused request, told as what to do next."""
    if isinstance(exc, StaleVersion):
        return ToolError(
            f"Stale write refused (412 stale_version): {exc.resource or resource} is now at "
            f"version {exc.current_etag}, but your write was based on {exc.expected_etag}. "
            "Re-read and re-plan: call read_resource, apply your intent to the current "
            "document, and propose again (never resend the same write). Conflicts of class "
            f"{exc.conflict_class} are resolved by {exc.resolver}."
        )
    if isinstance(exc, OutsideWriteSet):
        return ToolError(
            f"Refused (403 not_in_write_set): this run's write set has no entry "
            f"{{'resource': '{exc.resource or resource}', 'operations': "
            f"['{exc.operation or operation}']}}. The run may only change what its write set "
            "declares; start a new run whose write set includes it (a person approves it)."
        )
    if isinstance(exc, Leased):
        return ToolError(
            f"Refused (423 leased): run {exc.lease.get('run')} holds an exclusive lease on "
            f"{resource} until {exc.lease.get('expires_at')}. Wait and try later."
        )
    if isinstance(exc, RunNotActive):
        return ToolError(
            f"Refused (409 run_not_active): the run is {exc.run_status or 'not active'}. "
            "Call show_run to see why; start a new run to write again."
        )
    if isinstance(exc, KillSwitchEngaged):
        return ToolError(f"Refused (503 kill_switch_engaged): {exc.detail} Try again later.")
    if isinstance(exc, RateLimited):
        return ToolError(f"Rate limited: retry after {exc.retry_after} seconds.")
    if isinstance(exc, WriteSetConflict):
        return ToolError(
            f"Refused (409 write_set_conflict): another active run already holds write "
            f"authority over: {json.dumps(exc.overlaps)}. Narrow the write set or wait."
        )
    if isinstance(exc, NotFound):
        return ToolError(f"Not found (404): {exc.detail}")
    if isinstance(exc, IdempotencyKeyReused):
        return ToolError(f"Refused: {exc.detail}")
    if isinstance(exc, ProblemError):
        where = f" (step {exc.step})" if exc.step is not None else ""
        return ToolError(f"Refused ({exc.status} {exc.problem_code}){where}: {exc.detail}")
    if isinstance(exc, RunNotApproved):
        return ToolError(f"The run was not approved: {exc}")
    if isinstance(exc, InvalidIdentifier):
        return ToolError(
            f"Refused before sending: {exc}. Pass the ids Airlock answered (UUIDs) and "
            "resources as 'kind/name'."
        )
    return ToolError(f"Airlock could not be reached: {exc}")


def _clamp(seconds: float) -> float:
    return max(0.0, min(float(seconds), MAX_TOOL_WAIT_SECONDS))


async def _asked(call: Awaitable[T], *, resource: str = "", operation: str = "") -> T:
    """The answer to a call of Airlock; a refusal becomes a tool error saying what next."""
    try:
        return await call
    except AirlockError as exc:
        raise tool_error(exc, resource=resource, operation=operation) from exc


# --- The server -----------------------------------------------------------------------------


def build_server(tools: AirlockTools) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("airlock", instructions=INSTRUCTIONS, log_level="WARNING")

    _add_run_start_tools(server, tools)
    _add_write_tools(server, tools)
    _add_action_tools(server, tools)
    _add_plan_tools(server, tools)
    _add_run_end_tools(server, tools)
    _add_resources(server, tools)
    return server


def _add_run_start_tools(server: MCPServer[Any], tools: AirlockTools) -> None:
    """Starting a run and reading it."""

    @server.tool(
        description="Start a run: declare your task and the write set (the resources you "
        "will change and how: create/update/delete; 'kind/prefix*' covers names with that "
        "prefix). A person usually approves the run first: this waits up to wait_seconds "
        "(at most 110) for that decision and says if it is still pending. Example "
        'write_set: [{"resource": "notification-policy/prod-alerts", "operations": '
        '["update"]}]. Needs AIRLOCK_AGENT_TOKEN.'
    )
    async def start_run(
        task: str, write_set: list[dict[str, Any]], wait_seconds: int = 100
    ) -> dict[str, Any]:
        if not tools.agent_token:
            raise ToolError(
                "This server was started with a run token (AIRLOCK_RUN_TOKEN): it works in "
                "that run only. Call show_run."
            )
        if tools.session is not None and not tools.session.run.ended:
            raise ToolError(
                f"Run {tools.session.id} is still open ({tools.session.run.status}); call "
                "finish_run before starting another."
            )
        session = await _asked(tools.client.start_run(task, write_set, approval_timeout=0))
        tools.session = session
        return await tools.run_answer(session, session.wait_for_approval(_clamp(wait_seconds)))

    @server.tool(
        description="Show the current run: its status, task and write set (what it may "
        "change), and what to do next. With wait_seconds > 0 (at most 110) and the run "
        "still pending approval, waits for a person's decision first."
    )
    async def show_run(wait_seconds: int = 0) -> dict[str, Any]:
        session = await tools.current_run()

        async def refreshed() -> None:
            await session.refresh()
            if session.run.pending and wait_seconds > 0:
                await session.wait_for_approval(_clamp(wait_seconds))

        return await tools.run_answer(session, refreshed())


def _add_write_tools(server: MCPServer[Any], tools: AirlockTools) -> None:
    """Reading a resource and proposing a write."""

    @server.tool(
        description="Read a resource 'kind/name': its JSON document, version and ETag. "
        "Always read before proposing a write: the write is based on this version, and "
        "is refused if someone changed the resource since."
    )
    async def read_resource(resource: str) -> dict[str, Any]:
        try:
            if tools.session is not None or tools.run_token:
                found = await (await tools.current_run()).read(resource)
            else:
                found = await tools.client.read(resource)
        except (AirlockError, ValueError) as exc:
            if isinstance(exc, ValueError):
                raise ToolError(str(exc)) from exc
            raise tool_error(exc, resource=resource) from exc
        tools.read_etags[found.identifier] = found.etag
        return resource_view(found)

    @server.tool(
        description="Propose a change to a resource of your run's write set. operation: "
        "'merge_patch' (document = JSON merge patch: only the fields you change; null "
        "deletes a field), 'replace' (document = the whole new document), 'delete', or "
        "'create' (a new resource; document = its content). The change is based on the "
        "version you last read with read_resource (or base_etag). Returns the action and "
        "its status: it may wait for a person's approval, then a worker applies it; call "
        "wait_for_action. A stale base is refused at once: re-read and re-plan. reason is "
        "shown to the approvers (no secrets)."
    )
    async def propose_write(
        resource: str,
        operation: Operation,
        document: Any = None,
        reason: str = "",
        base_etag: str | None = None,
    ) -> dict[str, Any]:
        session = await tools.current_run()
        etag = base_etag or tools.read_etags.get(resource)
        if operation != "create" and not etag:
            raise ToolError(
                f"Read {resource} with read_resource first: a write must be based on the "
                "version you read."
            )
        if operation in ("replace", "merge_patch", "create") and document is None:
            raise ToolError(f"operation {operation!r} needs a document.")
        if operation == "merge_patch" and not isinstance(document, dict):
            raise ToolError("a merge_patch document must be a JSON object.")
        kind, _, name = resource.partition("/")
        base = Resource(kind, name, 0, etag or "", None, "", {})
        why = reason or None
        if operation == "create":
            proposal = session.create(resource, document, reason=why)
        elif operation == "replace":
            proposal = session.put(base, document, reason=why)
        elif operation == "merge_patch":
            proposal = session.patch(base, document, reason=why)
        else:
            proposal = session.delete(base, reason=why)
        try:
            action = await _asked(
                proposal, resource=resource, operation=_WRITE_SET_OPERATION[operation]
            )
        except ValueError as exc:
            raise ToolError(str(exc)) from exc
        return action_view(action)


def _add_action_tools(server: MCPServer[Any], tools: AirlockTools) -> None:
    """Waiting for a proposed write and undoing it."""

    @server.tool(
        description="Wait for an action's outcome: a person's decision and the worker's "
        "execution. Waits at most wait_seconds (at most 110) and answers 'still pending' "
        "with what it waits for; call it again to keep waiting. When it ends, says what "
        "happened and what to do next (applied, rejected with the comment, conflict: "
        "re-read or a person decides). If a person approved an edited version, your action "
        "is superseded and the answer is the edited action's, with `edited` (who and the diff)."
    )
    async def wait_for_action(action_id: str, wait_seconds: int = 100) -> dict[str, Any]:
        session = await tools.current_run()
        return action_view(await _asked(session.wait(action_id, timeout=_clamp(wait_seconds))))

    @server.tool(
        description="Undo an applied action inside its undo window: the previous document "
        "is restored only if nobody changed the resource since (otherwise a person "
        "decides). Waits up to wait_seconds (at most 110) for the undo to settle."
    )
    async def undo_action(action_id: str, wait_seconds: int = 60) -> dict[str, Any]:
        session = await tools.current_run()
        return action_view(await _asked(session.undo(action_id, wait=_clamp(wait_seconds))))


def _add_plan_tools(server: MCPServer[Any], tools: AirlockTools) -> None:
    """Proposing a plan and waiting for it."""

    @server.tool(
        description="Propose one change across several resources of your run's write set as "
        "a plan: approved as one, applied in the order given, and if a step fails for good "
        "the steps before it are compensated in reverse (by default each step's undo). "
        "steps: a list of {resource, operation, document, base_etag?, compensation?} with "
        "propose_write's operations ('merge_patch', 'replace', 'delete', 'create'); each step "
        "is based on the version you last read with read_resource. compensation (optional): "
        "{operation: 'replace'|'merge_patch'|'delete', document} applied against the version "
        "the step produced. A refused plan records nothing and names its step. Then call "
        "wait_for_plan. reason is shown to the approvers (no secrets)."
    )
    async def propose_plan(steps: list[dict[str, Any]], reason: str = "") -> dict[str, Any]:
        session = await tools.current_run()
        built = plan_steps_json(steps, tools.read_etags)
        try:
            plan = await session.propose_plan(built, reason=reason)
        except AirlockError as exc:
            failed = steps[exc.step - 1] if isinstance(exc, ProblemError) and exc.step else {}
            operation = _WRITE_SET_OPERATION.get(str(failed.get("operation")), "")
            raise tool_error(
                exc, resource=str(failed.get("resource") or ""), operation=operation
            ) from exc
        return plan_view(plan)

    @server.tool(
        description="Wait for a plan's outcome: the approval, then its steps in order (and "
        "compensations if one fails). Waits at most wait_seconds (at most 110) and answers "
        "'still pending' with what it waits for; call it again to keep waiting. When it ends, "
        "says what happened to every step and what to do next."
    )
    async def wait_for_plan(plan_id: str, wait_seconds: int = 100) -> dict[str, Any]:
        session = await tools.current_run()
        return plan_view(await _asked(session.wait_for_plan(plan_id, timeout=_clamp(wait_seconds))))


def _add_run_end_tools(server: MCPServer[Any], tools: AirlockTools) -> None:
    """Listing the run's actions and finishing it."""

    @server.tool(description="List the current run's actions (newest first) with their status.")
    async def list_actions() -> dict[str, Any]:
        session = await tools.current_run()
        actions = await _asked(session.actions())
        return {"run": session.id, "actions": [action_view(a) for a in actions]}

    @server.tool(
        description="Finish the current run: frees its write authority; actions not yet "
        "executing are cancelled. Call it when the task is done."
    )
    async def finish_run() -> dict[str, Any]:
        session = await tools.current_run()
        await session.stop_heartbeat()
        return run_view(await _asked(session.finish()))


def _add_resources(server: MCPServer[Any], tools: AirlockTools) -> None:
    """Resources as MCP resources."""

    @server.resource(
        "airlock://resources/{kind}/{name}",
        description="An Airlock resource: its JSON document with version and ETag.",
        mime_type="application/json",
    )
    async def airlock_resource(kind: str, name: str) -> str:
        try:
            found = await tools.client.read(f"{kind}/{name}")
        except AirlockError as exc:
            raise ResourceError(str(exc)) from exc
        return json.dumps(resource_view(found))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="airlock-mcp", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--transport",
        choices=["stdio", "streamable-http"],
        default=os.environ.get("AIRLOCK_MCP_TRANSPORT", "stdio"),
    )
    parser.add_argument("--host", default=os.environ.get("AIRLOCK_MCP_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("AIRLOCK_MCP_PORT", "8765")))
    parser.add_argument(
        "--token",
        default=os.environ.get("AIRLOCK_MCP_TOKEN") or None,
        help="streamable HTTP: the bearer token every request must carry (prefer the "
        "AIRLOCK_MCP_TOKEN environment variable: a command line is visible to other users)",
    )
    args = parser.parse_args(argv)
    url = os.environ.get("AIRLOCK_URL")
    if not url:
        print("airlock-mcp: set AIRLOCK_URL (e.g. http://127.0.0.1:8000)", file=sys.stderr)
        raise SystemExit(2)
    tools = AirlockTools(
        url, os.environ.get("AIRLOCK_AGENT_TOKEN"), os.environ.get("AIRLOCK_RUN_TOKEN")
    )
    server = build_server(tools)
    if args.transport == "stdio":
        server.run("stdio")
    else:
        app = server.streamable_http_app(host=args.host)
        serve_http(app, host=args.host, port=args.port, token=args.token)


if __name__ == "__main__":
    main()
