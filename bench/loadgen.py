"""The load generator: a separate process speaking HTTP/1.1 over loopback with asyncio.

    python -m bench.loadgen '<json spec>'   → prints one JSON result on stdout

Modes:
- `http`: N keep-alive clients send the same request in a loop, bounded by a request count and
  a duration, after a warm-up; reports rps, p50/p99 and status counts.
- `longpoll`: open N `Prefer: wait=…` requests (each on its own connection), count how many the
  server holds, then change every action through the API (`POST …/cancel`) and measure how long
  each held request takes to answer after its change was acknowledged.
- `hot`: K writers on one resource with re-read-and-retry through the API (GET → PATCH with
  If-Match → long-poll the action → retry on 412 / conflict), for a bounded time; reports each
  writer's accepted tally.
- `approve`: decide a list of approvals through the API with C concurrent clients.

A minimal client of its own (no httpx) so the generator costs little CPU on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
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
        return await self._read()

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

    async def _read(self) -> Response:
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


# --- http ---------------------------------------------------------------------


@dataclass
class HttpStats:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    count: int = 0


async def _http_client(
    spec: dict[str, Any], raw: bytes, stats: HttpStats, start_at: float, deadline: float
) -> None:
    conn = Connection(spec["host"], spec["port"])
    max_requests = int(spec.get("max_requests", 10**9))
    try:
        while time.perf_counter() < deadline and stats.count < max_requests:
            t0 = time.perf_counter()
            try:
                response = await conn.send_raw(raw)
            except (ConnectionError, asyncio.IncompleteReadError, HttpError):
                await conn.close()
                if t0 >= start_at:
                    stats.errors += 1
                continue
            elapsed = time.perf_counter() - t0
            if t0 >= start_at:  # past the warm-up
                stats.count += 1
                stats.latencies.append(elapsed)
                stats.statuses[response.status] = stats.statuses.get(response.status, 0) + 1
    finally:
        await conn.close()


async def run_http(spec: dict[str, Any]) -> dict[str, Any]:
    concurrency = int(spec["concurrency"])
    raise_fd_limit(concurrency + 64)
    raw = Connection.build(
        spec.get("method", "GET"),
        spec["path"],
        f"{spec['host']}:{spec['port']}",
        spec.get("headers", {}),
    )
    stats = HttpStats()
    now = time.perf_counter()
    start_at = now + float(spec.get("warmup", 1.0))
    deadline = start_at + float(spec["duration"])
    await asyncio.gather(
        *(_http_client(spec, raw, stats, start_at, deadline) for _ in range(concurrency))
    )
    measured = max(1e-9, min(time.perf_counter(), deadline) - start_at)
    return {
        "concurrency": concurrency,
        "requests": stats.count,
        "seconds": round(measured, 3),
        "rps": round(stats.count / measured, 1),
        "p50_ms": _ms(percentile(stats.latencies, 0.50)),
        "p99_ms": _ms(percentile(stats.latencies, 0.99)),
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "errors": stats.errors,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


# --- longpoll ------------------------------------------------------------------


async def run_longpoll(spec: dict[str, Any]) -> dict[str, Any]:
    host, port = spec["host"], spec["port"]
    items: list[dict[str, str]] = spec["actions"]  # [{id, etag}]
    wait = int(spec.get("wait", 60))
    raise_fd_limit(len(items) + 256)
    auth = {"Authorization": f"Bearer {spec['token']}"}
    answered_at: dict[str, float] = {}
    early: dict[str, int] = {}
    statuses: dict[int, int] = {}
    errors: list[str] = []
    connect_gate = asyncio.Semaphore(int(spec.get("connect_concurrency", 64)))
    sent = 0

    async def hold(item: dict[str, str]) -> None:
        nonlocal sent
        conn = Connection(host, port)
        try:
            async with connect_gate:
                await conn.open()
            headers = {**auth, "Prefer": f"wait={wait}", "If-None-Match": item["etag"]}
            raw = Connection.build(
                "GET", f"/api/v1/actions/{item['id']}", f"{host}:{port}", headers
            )
            assert conn.writer is not None
            conn.writer.write(raw)
            sent += 1
            response = await conn._read()
            answered_at[item["id"]] = time.perf_counter()
            statuses[response.status] = statuses.get(response.status, 0) + 1
            if not triggered.is_set():
                early[item["id"]] = response.status
        except Exception as exc:  # a refused connection counts as not held
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            await conn.close()

    triggered = asyncio.Event()
    tasks = [asyncio.create_task(hold(item)) for item in items]
    # Wait until every request is on the wire, then let the server settle.
    deadline = time.perf_counter() + float(spec.get("open_timeout", 60))
    while sent + len(errors) < len(items) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(float(spec.get("settle", 2.0)))
    held_now = len([i for i in items if i["id"] not in answered_at])
    triggered.set()

    # Change every action through the API; time each change from its acknowledgement.
    changed_at: dict[str, float] = {}
    change_statuses: dict[int, int] = {}
    queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    for item in items:
        if item["id"] not in answered_at:
            queue.put_nowait(item)

    async def changer() -> None:
        conn = Connection(host, port)
        try:
            while True:
                try:
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                response = await conn.request(
                    "POST",
                    f"/api/v1/actions/{item['id']}/cancel",
                    {**auth, "Idempotency-Key": f"bench-cancel-{item['id']}"},
                    body={},
                )
                changed_at[item["id"]] = time.perf_counter()
                change_statuses[response.status] = change_statuses.get(response.status, 0) + 1
        finally:
            await conn.close()

    t_change = time.perf_counter()
    await asyncio.gather(*(changer() for _ in range(int(spec.get("change_concurrency", 8)))))
    change_seconds = time.perf_counter() - t_change
    await asyncio.wait(tasks, timeout=float(spec.get("answer_timeout", 30)))
    for task in tasks:
        task.cancel()
    wakes = [
        max(0.0, answered_at[i] - changed_at[i])
        for i in changed_at
        if i in answered_at and answered_at[i] >= t_change
    ]
    return {
        "requested": len(items),
        "held": held_now,
        "answered_early": len(early),
        "connect_errors": len(errors),
        "error_sample": errors[:3],
        "woken": len(wakes),
        "wake_p50_ms": _ms(percentile(wakes, 0.50)),
        "wake_p99_ms": _ms(percentile(wakes, 0.99)),
        "change_seconds": round(change_seconds, 3),
        "change_statuses": {str(k): v for k, v in change_statuses.items()},
        "answer_statuses": {str(k): v for k, v in statuses.items()},
    }


# --- hot resource ------------------------------------------------------------------


async def _hot_writer(spec: dict[str, Any], deadline: float, tally: list[int], idx: int) -> None:
    conn = Connection(spec["host"], spec["port"])
    auth = {"Authorization": f"Bearer {spec['token']}"}
    path = f"/api/v1/resources/{spec['resource']}"
    try:
        while time.perf_counter() < deadline:
            got = await conn.request("GET", path, auth)
            if got.status != 200:
                tally[idx * 4 + 3] += 1
                await asyncio.sleep(0.05)
                continue
            doc = got.json()
            counter = int(doc["document"].get("counter", 0))
            etag = got.headers.get("etag", f'"{doc["version"]}"')
            sent = await conn.request(
                "PATCH",
                path,
                {
                    **auth,
                    "If-Match": etag,
                    "Idempotency-Key": f"hot-{uuid.uuid4().hex}",
                    "Content-Type": "application/merge-patch+json",
                },
                body={"counter": counter + 1},
            )
            if sent.status == 412:
                tally[idx * 4 + 1] += 1
                continue
            if sent.status != 202:
                tally[idx * 4 + 3] += 1
                await asyncio.sleep(0.05)
                continue
            action = sent.json()
            status = action.get("status")
            etag_a = sent.headers.get("etag", "")
            wait = int(spec.get("poll_wait", 5))
            while status not in {"applied", "conflict", "failed", "rejected", "cancelled"}:
                if time.perf_counter() > deadline + wait:
                    break
                polled = await conn.request(
                    "GET",
                    f"/api/v1/actions/{action['id']}",
                    {
                        **auth,
                        "Prefer": f"wait={wait}",
                        **({"If-None-Match": etag_a} if etag_a else {}),
                    },
                )
                if polled.status == 200:
                    status = polled.json().get("status")
                    etag_a = polled.headers.get("etag", "")
            if status == "applied":
                tally[idx * 4 + 0] += 1
            elif status == "conflict":
                tally[idx * 4 + 2] += 1
            else:
                tally[idx * 4 + 3] += 1
    finally:
        await conn.close()


async def run_hot(spec: dict[str, Any]) -> dict[str, Any]:
    writers = int(spec["writers"])
    tally = [0] * (writers * 4)  # applied, stale_412, conflict, other
    start = time.perf_counter()
    deadline = start + float(spec["duration"])
    await asyncio.gather(*(_hot_writer(spec, deadline, tally, i) for i in range(writers)))
    elapsed = time.perf_counter() - start
    applied = [tally[i * 4] for i in range(writers)]
    return {
        "writers": writers,
        "seconds": round(elapsed, 3),
        "accepted": sum(applied),
        "accepted_by_writer": applied,
        "refused_412": sum(tally[i * 4 + 1] for i in range(writers)),
        "conflicts": sum(tally[i * 4 + 2] for i in range(writers)),
        "other": sum(tally[i * 4 + 3] for i in range(writers)),
    }


# --- approve ---------------------------------------------------------------------------


async def run_approve(spec: dict[str, Any]) -> dict[str, Any]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for approval_id in spec["approvals"]:
        queue.put_nowait(approval_id)
    statuses: dict[int, int] = {}
    auth = {"Authorization": f"Bearer {spec['token']}"}

    async def client() -> None:
        conn = Connection(spec["host"], spec["port"])
        try:
            while True:
                try:
                    approval_id = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                response = await conn.request(
                    "POST",
                    f"/api/v1/approvals/{approval_id}/decision",
                    auth,
                    body={"decision": "approve", "comment": "bench"},
                )
                statuses[response.status] = statuses.get(response.status, 0) + 1
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(int(spec.get("concurrency", 8)))))
    elapsed = time.perf_counter() - start
    return {
        "decided": len(spec["approvals"]),
        "seconds": round(elapsed, 3),
        "statuses": {str(k): v for k, v in statuses.items()},
    }


MODES = {"http": run_http, "longpoll": run_longpoll, "hot": run_hot, "approve": run_approve}


def _load_spec(argv: list[str]) -> dict[str, Any]:
    """The spec: JSON in argv[0], `@path` to a JSON file, or `-` for stdin."""
    raw = argv[0] if argv else "-"
    if raw == "-":
        return dict(json.loads(sys.stdin.read()))
    if raw.startswith("@"):
        with open(raw[1:]) as handle:
            return dict(json.load(handle))
    return dict(json.loads(raw))


def main(argv: list[str]) -> int:
    spec = _load_spec(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    result = asyncio.run(MODES[spec["mode"]](spec))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
