"""The bare baseline's settings: the product's settings, with only the baseline URL routed.
Also what a worker the kill figure dooms runs with (bench.recovery): the same, plus the
queue of its own it reads (BENCH_WORKER_QUEUE), which django-rq must know by name."""

from __future__ import annotations

import os

from console.settings import *  # noqa: F403
from console.settings import REDIS_URL, RQ_QUEUES

ROOT_URLCONF = "bench.urls"

if os.environ.get("BENCH_WORKER_QUEUE"):
    RQ_QUEUES = {
        **RQ_QUEUES,
        os.environ["BENCH_WORKER_QUEUE"]: {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 120},
    }
