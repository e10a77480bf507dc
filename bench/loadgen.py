"""Agents and people as a separate asyncio process: what waits or loops like a client does.
HTTP throughput is never measured here (that is wrk's job); these modes hold connections,
decide approvals and loop read → write, and time what the product answers.

    python -m bench.loadgen @spec.json   → prints one JSON result on stdout

Modes:
- `longpoll`: hold N `Prefer: wait` polls (one connection each), count how many the server
  holds, then decide a sample of the actions' approvals and time how long each of those held
  polls takes to answer after its decision was acknowledged.
- `roundtrip`: hold `waiting` polls, then decide `samples` of them one at a time; each sample
  runs from the moment the decision request is sent to the moment the agent's poll answers
  with the new status. Each decision is sent once the previous sample's write is applied
  (its agent waits for the result, as airlock-client does); `back_to_back` more samples are
  then decided each as soon as the trip before it ends, for comparison.
- `hot`: K writers on one resource (GET → PATCH with If-Match → long-poll the action),
  each the well-behaved agent of airlock-client's `RunSession.update` (see the section).
- `approve`: decide a list of approvals with C concurrent clients (the drain's set-up).

A minimal HTTP/1.1 client of its own (no httpx) so the waiters cost little CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class HttpError(Exception):
    pass


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    @staticmethod
    def build(
        method: str,
        path: str,
        host: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return raw + (body or b"")

    async def send_raw(self, raw: bytes) -> Response:
        if self.writer is None:
            await self.open()
        assert self.writer is not None and self.reader is not None
        self.writer.write(raw)
        return await self.read()

    async def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: Any = None,
    ) -> Response:
        data = None
        hdrs = dict(headers or {})
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        raw = self.build(method, path, f"{self.host}:{self.port}", hdrs, data)
        try:
            return await self.send_raw(raw)
        except (ConnectionError, asyncio.IncompleteReadError):
            # The server closed an idle keep-alive connection: one fresh try.
            await self.close()
            return await self.send_raw(raw)

    async def read(self) -> Response:
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2:
            raise HttpError(f"bad status line {lines[0]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = b""
        if status in (204, 304) or 100 <= status < 200:
            pass
        elif "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size_line = await self.reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                chunks.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            body = b"".join(chunks)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return Response(status, headers, body)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, needed), hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def _count(counter: dict[str, int], key: object) -> None:
    counter[str(key)] = counter.get(str(key), 0) + 1


# --- held long-polls -----------------------------------------------------------


class Waiters:
    """One held `Prefer: wait` poll per action, each on its own connection."""

    def __init__(self, spec: dict[str, Any], items: list[dict[str, str]]) -> None:
        self.host, self.port = str(spec["host"]), int(spec["port"])
        self.wait = int(spec.get("wait", 60))
        self.token = str(spec["token"])
        self.sent = 0
        self.answered_at: dict[str, float] = {}
        self.answer_status: dict[str, str] = {}
        self.answer_etag: dict[str, str] = {}
        self.http_statuses: dict[str, int] = {}
        self.errors: list[str] = []
        self.events = {item["id"]: asyncio.Event() for item in items}
        self.gate = asyncio.Semaphore(int(spec.get("connect_concurrency", 64)))
        self.tasks = [asyncio.create_task(self._hold(item)) for item in items]

    async def _hold(self, item: dict[str, str]) -> None:
        conn = Connection(self.host, self.port)
        try:
            async with self.gate:
                await conn.open()
            headers = {
                "Authorization": f"Bearer {self.token}",
                "Prefer": f"wait={self.wait}",
                "If-None-Match": item["etag"],
            }
            path = f"/api/v1/actions/{item['id']}"
            assert conn.writer is not None
            conn.writer.write(Connection.build("GET", path, f"{self.host}:{self.port}", headers))
            self.sent += 1
            response = await conn.read()
            self.answered_at[item["id"]] = time.perf_counter()
            _count(self.http_statuses, response.status)
            if response.status == 200:
                self.answer_status[item["id"]] = str(response.json().get("status", ""))
                self.answer_etag[item["id"]] = response.headers.get("etag", "")
        except Exception as exc:  # a refused or reset connection counts as not held
            self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            self.events[item["id"]].set()
            await conn.close()

    async def settle(self, open_timeout: float, settle_seconds: float) -> int:
        """Wait until every poll is on the wire, let the server settle; returns how many wait."""
        deadline = time.perf_counter() + open_timeout
        while self.sent + len(self.errors) < len(self.tasks) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle_seconds)
        return sum(1 for event in self.events.values() if not event.is_set())

    async def finish(self, timeout: float) -> None:
        await asyncio.wait(self.tasks, timeout=timeout)
        for task in self.tasks:
            task.cancel()

    def summary(self) -> dict[str, Any]:
        return {
            "connect_errors": len(self.errors),
            "error_sample": self.errors[:3],
            "answer_statuses": self.http_statuses,
        }


async def decide(conn: Connection, item: dict[str, str], decision: str) -> int:
    response = await conn.request(
        "POST",
        f"/api/v1/approvals/{item['approval']}/decision",
        {"Authorization": f"Bearer {item['decider']}"},
        body={"decision": decision, "comment": "bench"},
    )
    return response.status


async def run_longpoll(spec: dict[str, Any]) -> dict[str, Any]:
    items: list[dict[str, str]] = spec["items"]  # [{id, etag, approval, decider}]
    raise_fd_limit(len(items) + 256)
    waiters = Waiters(spec, items)
    held = await waiters.settle(float(spec.get("open_timeout", 60)), float(spec["settle"]))
    # Wake a sample (the rest stay held, as waiting agents do): decide their approvals.
    queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    for item in [i for i in items if not waiters.events[i["id"]].is_set()][: int(spec["wakes"])]:
        queue.put_nowait(item)
    changed_at: dict[str, float] = {}
    change_statuses: dict[str, int] = {}

    async def changer() -> None:
        conn = Connection(waiters.host, waiters.port)
        try:
            while not queue.empty():
                item = queue.get_nowait()
                _count(change_statuses, await decide(conn, item, "reject"))
                changed_at[item["id"]] = time.perf_counter()
        finally:
            await conn.close()

    t_change = time.perf_counter()
    await asyncio.gather(*(changer() for _ in range(int(spec.get("change_concurrency", 8)))))
    change_seconds = time.perf_counter() - t_change
    woken = [asyncio.create_task(waiters.events[i].wait()) for i in changed_at]
    if woken:
        await asyncio.wait(woken, timeout=float(spec.get("answer_timeout", 30)))
    await waiters.finish(0.1)
    answered = waiters.answered_at
    wakes = [
        max(0.0, answered[i] - changed_at[i])
        for i in changed_at
        if i in answered and answered[i] >= t_change
    ]
    return {
        "requested": len(items),
        "held": held,
        "woken": len(wakes),
        "wake_p50_ms": _ms(percentile(wakes, 0.50)),
        "wake_p99_ms": _ms(percentile(wakes, 0.99)),
        "change_seconds": round(change_seconds, 3),
        # Where the tail comes from: [wake-up ms, decided at ms into the change phase].
        "slowest_wakes": sorted(
            (
                [_ms(answered[i] - changed_at[i]), _ms(changed_at[i] - t_change)]
                for i in changed_at
                if i in answered and answered[i] >= t_change
            ),
            reverse=True,
        )[:8],
        "change_statuses": change_statuses,
        **waiters.summary(),
    }


@dataclass
class Trips:
    """One pass of round trips: (round trip, its decision request) per answered trip."""

    pairs: list[tuple[float, float]] = field(default_factory=list)
    decisions: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    missed: int = 0

    def summary(self) -> dict[str, Any]:
        trips = [trip for trip, _ in self.pairs]
        return {
            "samples": len(trips),
            "missed": self.missed,
            "p50_ms": _ms(percentile(trips, 0.50)),
            "p99_ms": _ms(percentile(trips, 0.99)),
            "decision_request_p50_ms": _ms(percentile(self.decisions, 0.50)),
            "decision_request_p99_ms": _ms(percentile(self.decisions, 0.99)),
            "decision_statuses": self.statuses,
        }


async def _trip(conn: Connection, waiters: Waiters, item: dict[str, str], trips: Trips) -> None:
    """Approve `item` and wait for its held poll to answer with the new status."""
    t_sent = time.perf_counter()
    _count(trips.statuses, await decide(conn, item, "approve"))
    trips.decisions.append(time.perf_counter() - t_sent)
    try:
        await asyncio.wait_for(waiters.events[item["id"]].wait(), timeout=10)
    except TimeoutError:
        trips.missed += 1
        return
    status = waiters.answer_status.get(item["id"], "")
    if status and status != "pending_approval":
        trips.pairs.append((waiters.answered_at[item["id"]] - t_sent, trips.decisions[-1]))
    else:
        trips.missed += 1


async def _bare_p50(host: str, bare: dict[str, Any], samples: int) -> float | None:
    """The bare token view's p50, asked as the decisions were (this client, one request at a
    time, kept alive), while the same agents wait: the decision request's baseline."""
    conn = Connection(host, int(bare["port"]))
    auth = {"Authorization": f"Bearer {bare['token']}"}
    times: list[float] = []
    try:
        for _ in range(samples):
            started = time.perf_counter()
            if (await conn.request("GET", str(bare["path"]), auth)).status == 200:
                times.append(time.perf_counter() - started)
    finally:
        await conn.close()
    return _ms(percentile(times, 0.50))


async def run_roundtrip(spec: dict[str, Any]) -> dict[str, Any]:
    """Decision sent → the waiting agent's poll answered with the new status, one at a time
    while the others keep waiting. A trip times one decision: the next is sent once the
    agent has seen this one's write applied, not while the worker is still applying it
    (the back-to-back pass, reported beside, times decisions that share the machine with
    the previous one's write)."""
    items: list[dict[str, str]] = spec["items"]
    samples, back_to_back = int(spec["samples"]), int(spec.get("back_to_back", 0))
    raise_fd_limit(len(items) + 256)
    waiters = Waiters(spec, items)
    held = await waiters.settle(float(spec.get("open_timeout", 60)), float(spec["settle"]))
    person = Connection(waiters.host, waiters.port)
    agent = Connection(waiters.host, waiters.port)
    auth = {"Authorization": f"Bearer {spec['token']}"}
    paced, rushed = Trips(), Trips()
    finals: dict[str, int] = {}  # what each paced sample's write ended as ("" if not final)
    try:
        for item in items[:samples]:
            await _trip(person, waiters, item, paced)
            etag = waiters.answer_etag.get(item["id"], "")
            final = await _await_final(agent, auth, item["id"], etag, time.perf_counter() + 10)
            _count(finals, final)
        for item in items[samples : samples + back_to_back]:
            await _trip(person, waiters, item, rushed)
        bare = spec.get("bare")
        bare_p50 = await _bare_p50(waiters.host, bare, max(samples, 50)) if bare else None
    finally:
        await person.close()
        await agent.close()
    await waiters.finish(0.1)
    return {
        "waiting": len(items),
        "held": held,
        **paced.summary(),
        "bare_request_p50_ms": bare_p50,
        "paced_on": finals,
        # Where the tail comes from: [round trip ms, its decision request's ms]. A trip much
        # longer than its request waited on the waiter's side (wake-up, its process busy).
        "slowest_trips": [
            [_ms(trip), _ms(sent)] for trip, sent in sorted(paced.pairs, reverse=True)[:8]
        ],
        "back_to_back": rushed.summary(),
        **waiters.summary(),
    }


# --- hot resource ------------------------------------------------------------------
#
# The writers model a well-behaved agent, the way airlock-client's `RunSession.update`
# behaves: a read that names a write already queued over its version
# (`Airlock-Queued-Action`), or a 412 that does (`queued_action`), is not answered with a
# proposal but by waiting for that write to be final; before reading again the writer
# backs off with full jitter that grows with its consecutive losses, so the losers of
# one round do not all propose at the moment the winner's write lands.

FINAL = {"applied", "conflict", "failed", "rejected", "cancelled", "expired"}
# The client's defaults (airlock_client._protocol.Contention).
BACKOFF_BASE = 0.5
BACKOFF_CAP = 4.0


@dataclass
class Tally:
    applied: int = 0
    refused_412: int = 0
    waited_on_read: int = 0
    conflicts: int = 0
    rate_limited: int = 0
    other: int = 0
    losses: int = 0  # consecutive, reset by an accepted write


async def _await_final(
    conn: Connection, auth: dict[str, str], action_id: str, etag: str, until: float
) -> str:
    """Long-poll the action until it is final (or the writer's time is up)."""
    status = ""
    while status not in FINAL and time.perf_counter() < until:
        polled = await conn.request(
            "GET",
            f"/api/v1/actions/{action_id}",
            {**auth, "Prefer": "wait=5", **({"If-None-Match": etag} if etag else {})},
        )
        if polled.status == 200:
            status = str(polled.json().get("status"))
            etag = polled.headers.get("etag", "")
        elif polled.status != 304:
            break  # not readable by this token: the back-off alone paces the next read
    return status


async def _lose(
    conn: Connection, auth: dict[str, str], tally: Tally, queued: str | None, until: float
) -> None:
    """After a lost race: wait for the write that won it, then back off."""
    if queued:
        await _await_final(conn, auth, queued, "", until)
    cap = min(BACKOFF_CAP, BACKOFF_BASE * 2**tally.losses)
    tally.losses += 1
    await asyncio.sleep(max(0.0, min(random.uniform(0, cap), until - time.perf_counter())))


async def _hot_writer(spec: dict[str, Any], deadline: float, tally: Tally) -> None:
    conn = Connection(spec["host"], spec["port"])
    auth = {"Authorization": f"Bearer {spec['token']}"}
    path = f"/api/v1/resources/{spec['resource']}"
    until = deadline + 10
    try:
        while time.perf_counter() < deadline:
            got = await conn.request("GET", path, auth)
            if got.status != 200:
                tally.other += 1
                await asyncio.sleep(0.05)
                continue
            queued = got.headers.get("airlock-queued-action")
            if queued:
                tally.waited_on_read += 1
                await _lose(conn, auth, tally, queued, deadline)
                continue
            counter = int(got.json()["document"].get("counter", 0))
            headers = {
                **auth,
                "If-Match": got.headers.get("etag", ""),
                "Idempotency-Key": f"hot-{uuid.uuid4().hex}",
                "Content-Type": "application/merge-patch+json",
            }
            sent = await conn.request("PATCH", path, headers, body={"counter": counter + 1})
            if sent.status == 412:
                tally.refused_412 += 1
                queued_action = (sent.json() or {}).get("queued_action") or {}
                await _lose(conn, auth, tally, queued_action.get("id"), deadline)
            elif sent.status == 429:
                tally.rate_limited += 1
                await asyncio.sleep(0.5)
            elif sent.status != 202:
                tally.other += 1
                await asyncio.sleep(0.05)
            else:
                tally.losses = 0
                action = sent.json()
                status = await _await_final(conn, auth, action["id"], sent.headers["etag"], until)
                if status == "applied":
                    tally.applied += 1
                elif status == "conflict":
                    tally.conflicts += 1
                else:
                    tally.other += 1
    finally:
        await conn.close()


async def run_hot(spec: dict[str, Any]) -> dict[str, Any]:
    writers = int(spec["writers"])
    tallies = [Tally() for _ in range(writers)]
    start = time.perf_counter()
    deadline = start + float(spec["duration"])
    await asyncio.gather(*(_hot_writer(spec, deadline, t) for t in tallies))
    return {
        "writers": writers,
        "seconds": round(time.perf_counter() - start, 3),
        "accepted": sum(t.applied for t in tallies),
        "accepted_by_writer": [t.applied for t in tallies],
        "refused_412": sum(t.refused_412 for t in tallies),
        "waited_on_read": sum(t.waited_on_read for t in tallies),
        "conflicts": sum(t.conflicts for t in tallies),
        "rate_limited_429": sum(t.rate_limited for t in tallies),
        "other": sum(t.other for t in tallies),
    }


# --- approve ---------------------------------------------------------------------------


async def run_approve(spec: dict[str, Any]) -> dict[str, Any]:
    queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    for item in spec["items"]:
        queue.put_nowait(item)
    statuses: dict[str, int] = {}

    async def client() -> None:
        conn = Connection(spec["host"], spec["port"])
        try:
            while not queue.empty():
                _count(statuses, await decide(conn, queue.get_nowait(), "approve"))
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(int(spec.get("concurrency", 4)))))
    return {"seconds": round(time.perf_counter() - start, 3), "statuses": statuses}


MODES = {
    "longpoll": run_longpoll,
    "roundtrip": run_roundtrip,
    "hot": run_hot,
    "approve": run_approve,
}


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(Path(argv[0].removeprefix("@")).read_text())
    with contextlib.suppress(ImportError):
        # optional: uvicorn[standard] brings uvloop except on Windows and PyPy
        import uvloop

        uvloop.install()
    print(json.dumps(asyncio.run(MODES[spec["mode"]](spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
