"""`airlock-audit verify`: re-hash an Airlock audit trail outside the server.

Reads the events from the API (`GET /api/v1/audit`, every page, with a personal token of
an auditor, operator or admin) or from a JSON Lines export (`manage.py audit_export
--jsonl`, or the console's "Export JSON Lines"), recomputes every event's hash by the rules
of docs/audit-chain.md and checks the links from the genesis to the newest event. Nothing
the server says about the chain is trusted: not its `GET /audit/verify`, not its Redis
checkpoint, not even the hashes it serves (each one is recomputed).

    airlock-audit verify --url https://airlock.example --token pt_...   (or AIRLOCK_TOKEN)
    airlock-audit verify --file airlock-audit.jsonl [--anchor anchors.jsonl]

Exit status: 0 the chain is whole (and contains every anchor given); 1 it is not — the
message names the first bad seq, or the anchor it no longer contains; 2 the events could
not be read (a bad file, an HTTP error, a wrong token).

Like the rest of airlock-client, it imports nothing from the server: the hashing rules are
written down again here, from the document, on purpose.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

GENESIS_HASH = "0" * 64

#: The API's keys of the hashed values, and the names the hash gives them.
_HASHED_KEYS = {
    "seq": "seq",
    "created_at": "created_at",
    "actor_type": "actor_type",
    "actor_id": "actor_id",
    "actor_label": "actor_label",
    "request_id": "request_id",
    "event_type": "event_type",
    "resource": "resource",
    "run": "run_id",
    "action": "action_id",
    "details": "details",
}
_PAGE = 200
# Problems at one seq, in the order a walk from the genesis meets them.
_PRIORITY = {"events out of order": 0, "broken link": 1, "hash mismatch": 2}


class Unreadable(Exception):
    """The events could not be read (exit status 2)."""


def canonical_json(value: Any) -> str:
    """Keys sorted, no whitespace, non-ASCII characters as themselves (UTF-8)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def hashed_event(item: dict[str, Any]) -> dict[str, Any]:
    """The hashed fields of one event as the API or the export shows it (`run_id`/`action_id`
    are accepted too). Keys the API may add later are not hashed and are ignored."""
    fields: dict[str, Any] = {}
    for key, name in _HASHED_KEYS.items():
        if key in item:
            fields[name] = item[key]
        elif name in item:
            fields[name] = item[name]
        else:
            raise Unreadable(f"event #{item.get('seq', '?')} has no {key!r}")
    return fields


def event_hash(item: dict[str, Any]) -> str:
    """SHA-256 (hex) of the UTF-8 canonical JSON of {"event": <fields>, "prev_hash": <hash>}."""
    payload = canonical_json({"event": hashed_event(item), "prev_hash": item["prev_hash"]})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Anchor:
    """A head kept outside the server: `{seq, hash, time}` (manage.py audit_anchor)."""

    seq: int
    hash: str
    time: str = ""
    where: str = ""


@dataclass
class Report:
    """`events`: how many were read; `head_seq`/`head_hash`: the newest one."""

    ok: bool = True
    events: int = 0
    first_bad_seq: int | None = None
    problem: str = ""
    head_seq: int = 0
    head_hash: str = GENESIS_HASH
    anchor_problem: str = ""
    anchors: int = 0
    unlinked: int = 0  # events read past the chain's end, not linked yet
    _seen: dict[int, str] = field(default_factory=dict, repr=False)


class _Walk:
    """Checks every event's own hash and every link between neighbours, in whichever order
    the events come (the API gives newest first, an export oldest first), and keeps the
    lowest seq where something is wrong: what a walk from the genesis would stop at."""

    def __init__(self, anchored: set[int]) -> None:
        self.report = Report()
        self.anchored = anchored
        self.previous: dict[str, Any] | None = None
        self.lowest: dict[str, Any] | None = None
        self.lowest_unlinked: int | None = None
        self._worst: tuple[int, int] | None = None

    def _bad(self, seq: int, problem: str) -> None:
        rank = (seq, _PRIORITY[problem])
        if self._worst is None or rank < self._worst:
            self._worst = rank
            self.report.ok, self.report.first_bad_seq, self.report.problem = False, seq, problem

    def add(self, item: dict[str, Any]) -> None:
        seq, digest = _seq_of(item), str(item.get("hash", ""))
        if "prev_hash" not in item:
            raise Unreadable(f"event #{seq} has no 'prev_hash'")
        if digest == "":
            # Committed and not linked yet (the server links events in seq order within a
            # moment of their commit): past the chain's end, not part of it yet.
            self.report.unlinked += 1
            self.lowest_unlinked = min(seq, self.lowest_unlinked or seq)
            return
        if event_hash(item) != digest:
            self._bad(seq, "hash mismatch")
        if seq in self.anchored:
            self.report._seen[seq] = digest
        if self.previous is not None:
            older, newer = sorted((self.previous, item), key=_seq_of)
            self._link(older, newer)
        if self.report.events == 0 or seq > self.report.head_seq:
            self.report.head_seq, self.report.head_hash = seq, digest
        if self.lowest is None or seq < _seq_of(self.lowest):
            self.lowest = item
        self.previous = item
        self.report.events += 1

    def _link(self, older: dict[str, Any], newer: dict[str, Any]) -> None:
        # Neighbours in the stream are neighbours in the chain. The numbers may have holes
        # (an append that rolled back drew a seq no event keeps): the link, not the
        # numbers, shows that nothing between them is missing.
        low, high = _seq_of(older), _seq_of(newer)
        if low == high:
            self._bad(high, "events out of order")
        elif newer["prev_hash"] != older.get("hash"):
            self._bad(high, "broken link")

    def end(self) -> Report:
        if self.lowest is not None and self.lowest["prev_hash"] != GENESIS_HASH:
            self._bad(_seq_of(self.lowest), "broken link")
        if self.lowest_unlinked is not None and self.lowest_unlinked < self.report.head_seq:
            self._bad(self.lowest_unlinked, "broken link")  # an unlinked event inside the chain
        return self.report


def _seq_of(item: dict[str, Any]) -> int:
    seq = item.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise Unreadable(f"an event without an integer seq: {str(item)[:200]}")
    return seq


def verify_events(events: Iterable[dict[str, Any]], anchors: Iterable[Anchor] = ()) -> Report:
    """Walk the events (oldest first or newest first, not mixed) from the genesis; then
    check that the chain holds every anchored head."""
    anchors = list(anchors)
    walk = _Walk({anchor.seq for anchor in anchors})
    for item in events:
        walk.add(item)
    report = walk.end()
    report.anchors = len(anchors)
    for anchor in anchors:
        problem = _anchor_problem(anchor, report)
        if problem:
            report.ok, report.anchor_problem = False, problem
            break
    return report


def _anchor_problem(anchor: Anchor, report: Report) -> str:
    if anchor.seq == 0 and anchor.hash == GENESIS_HASH:
        return ""
    named = f"anchor #{anchor.seq} {anchor.hash}" + (f" of {anchor.time}" if anchor.time else "")
    if anchor.where:
        named += f" ({anchor.where})"
    found = report._seen.get(anchor.seq)
    if found is None:
        return f"{named}: the chain has no event #{anchor.seq} (it ends at #{report.head_seq})"
    if found != anchor.hash:
        return f"{named}: event #{anchor.seq} now has hash {found}"
    return ""


def read_anchors(path: str) -> list[Anchor]:
    """The anchor file: one JSON object `{seq, hash, time}` a line (blank lines skipped)."""
    anchors = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                anchors.append(_anchor(line, f"{path} line {number}"))
    except OSError as exc:
        raise Unreadable(f"cannot read the anchor file: {exc}") from exc
    return anchors


def _anchor(line: str, where: str) -> Anchor:
    try:
        data = json.loads(line)
        seq, digest = data["seq"], data["hash"]
    except (ValueError, KeyError, TypeError) as exc:
        raise Unreadable(f"{where}: not an anchor {{seq, hash, time}}") from exc
    if not isinstance(seq, int) or not isinstance(digest, str):
        raise Unreadable(f"{where}: not an anchor {{seq, hash, time}}")
    return Anchor(seq=seq, hash=digest, time=str(data.get("time", "")), where=where)


def events_from_jsonl(stream: TextIO, *, name: str = "the export") -> Iterator[dict[str, Any]]:
    """The events of a JSON Lines export, in its order (oldest first)."""
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise Unreadable(f"{name} line {number}: not JSON ({exc})") from exc
        if not isinstance(item, dict):
            raise Unreadable(f"{name} line {number}: not an event")
        yield item


def events_from_api(
    url: str,
    token: str,
    *,
    client: httpx.Client | None = None,
    timeout: float = 30,
    page_size: int = _PAGE,
) -> Iterator[dict[str, Any]]:
    """Every event of `GET /api/v1/audit`, page after page (newest first, following `next`).
    Events appended meanwhile are not read: the first page fixes the newest event."""
    own = client is None
    http = client or httpx.Client(timeout=timeout)
    endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/api/v1") else "/api/v1")
    params: dict[str, str | int] = {"limit": page_size}
    try:
        while True:
            page = _get_page(http, f"{endpoint}/audit", token, params)
            yield from page["items"]
            if not page.get("next"):
                return
            params = {"limit": page_size, "cursor": str(page["next"])}
    finally:
        if own:
            http.close()


def _get_page(
    http: httpx.Client, url: str, token: str, params: dict[str, str | int]
) -> dict[str, Any]:
    try:
        response = http.get(url, params=params, headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise Unreadable(f"GET {url}: {exc}") from exc
    if response.status_code != 200:
        raise Unreadable(f"GET {url} answered {response.status_code}: {response.text[:300]}")
    try:
        page = response.json()
    except ValueError as exc:
        raise Unreadable(f"GET {url}: the answer is not JSON") from exc
    if not isinstance(page, dict) or not isinstance(page.get("items"), list):
        raise Unreadable(f"GET {url}: not a page of audit events")
    return page


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="airlock-audit", description="Check an Airlock audit trail outside the server."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser(
        "verify", help="re-hash every event and check the chain from the genesis"
    )
    source = verify.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the Airlock server: read every page of GET /api/v1/audit")
    source.add_argument("--file", help="a JSON Lines export ('-': standard input)")
    verify.add_argument(
        "--token",
        default=os.environ.get("AIRLOCK_TOKEN", ""),
        help="a personal token (pt_...) that may read the trail; default $AIRLOCK_TOKEN",
    )
    verify.add_argument(
        "--anchor",
        action="append",
        default=[],
        metavar="FILE",
        help="anchors {seq, hash, time} a line (manage.py audit_anchor --append): fail unless "
        "the chain still holds each one (may be given more than once)",
    )
    verify.add_argument("--timeout", type=float, default=30, help="seconds per HTTP request")
    return parser


def _events(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.url:
        if not args.token:
            raise Unreadable("--url needs --token or AIRLOCK_TOKEN")
        yield from events_from_api(args.url, args.token, timeout=args.timeout)
    elif args.file == "-":
        stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8")  # whatever the locale
        yield from events_from_jsonl(stdin, name="standard input")
    else:
        try:
            with open(args.file, encoding="utf-8") as stream:
                yield from events_from_jsonl(stream, name=args.file)
        except OSError as exc:
            raise Unreadable(f"cannot read {args.file}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        anchors = [anchor for path in args.anchor for anchor in read_anchors(path)]
        report = verify_events(_events(args), anchors)
    except Unreadable as exc:
        print(f"airlock-audit: {exc}", file=sys.stderr)
        return 2
    if report.first_bad_seq is not None:
        print(
            f"audit chain broken: first bad seq {report.first_bad_seq} ({report.problem}); "
            f"{report.events} events read",
            file=sys.stderr,
        )
        return 1
    if report.anchor_problem:
        print(f"audit chain rewritten: {report.anchor_problem}", file=sys.stderr)
        return 1
    print(f"ok: {report.events} events, head #{report.head_seq} {report.head_hash}")
    if anchors:
        print(f"ok: every one of {len(anchors)} anchors is in the chain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
