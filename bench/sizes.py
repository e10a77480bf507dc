"""How much each bench size measures. `small` < 3 minutes, `default` < 15 minutes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Size:
    name: str
    clients: tuple[int, ...]  # concurrent poll connections
    poll_rounds: int  # interleaved bare / product rounds; the figure is the median ratio
    poll_seconds: int  # per wrk run
    proposal_seconds: int  # per wrk run of the proposal figure (bench.proposals)
    proposal_rounds: int  # its interleaved bare / product rounds (order flipped each round)
    longpoll: int  # polls held at once
    longpoll_wakes: int  # of which this many are woken (and timed); the rest stay held
    roundtrip_waiting: int  # agents still waiting while each decision is timed
    roundtrip_samples: int
    noop_jobs: int
    approved: int  # approved writes drained
    core_n: int
    audit_writers: tuple[int, ...]
    audit_seconds: float
    hot_writers: int
    hot_seconds: float  # per window
    hot_rounds: int  # solo / contended windows interleaved; the figure is the median ratio
    worker_kills: int  # workers SIGKILLed mid-write, one after the other (bench.recovery)
    scale_small: tuple[int, int]  # (audit events, actions) at the reference point
    scale_big: tuple[int, int]
    scale_note: str = ""


# One row a field, one column a size, so that the sizes read side by side.
_NAMES = ("tiny", "small", "default")
_TABLE: dict[str, tuple[Any, Any, Any]] = {
    "clients": ((8,), (8, 128), (8, 32, 128)),
    # Seventeen GETs (bench/gets.py: the bare view, the action poll and its 304, five more agent
    # GETs and their 304s — those at the first client count only —, the list's page twice, its
    # Django page) and the proposals' two sides at each client count each round: the counts,
    # rounds and seconds that keep `small` under 3 minutes (the middle client count, 32, is
    # measured at the default size only) and `default` under 15.
    "poll_rounds": (1, 2, 3),
    "poll_seconds": (1, 1, 2),
    "proposal_seconds": (1, 2, 3),
    "proposal_rounds": (1, 1, 3),
    "longpoll": (20, 500, 2000),
    "longpoll_wakes": (10, 100, 300),
    "roundtrip_waiting": (10, 200, 200),
    "roundtrip_samples": (5, 30, 500),
    "noop_jobs": (50, 300, 1000),
    "approved": (10, 100, 1000),
    "core_n": (10, 30, 300),
    "audit_writers": ((1, 2), (1, 8), (1, 8)),
    "audit_seconds": (0.5, 0.5, 3.0),
    "hot_writers": (4, 32, 32),
    "hot_seconds": (1.0, 3.0, 15.0),
    "hot_rounds": (1, 1, 3),
    "worker_kills": (1, 1, 3),
    "scale_small": ((200, 200), (1_000, 1_000), (1_000, 1_000)),
    "scale_big": ((400, 400), (10_000, 5_000), (10_000_000, 1_000_000)),
    "scale_note": (
        "tiny: 4·10² vs 2·10², a smoke test only",
        "small: 10⁴ audit events / 5·10³ actions vs 10³ (goal asks 10⁷ / 10⁶)",
        "default: 10⁷ audit events / 10⁶ actions (and 10⁶ resources) vs 10³, as the goal asks",
    ),
}
SIZES = {
    name: Size(name=name, **{field: row[column] for field, row in _TABLE.items()})
    for column, name in enumerate(_NAMES)
}
