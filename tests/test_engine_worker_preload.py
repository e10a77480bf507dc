"""The Procfile's worker loads the engine's jobs before its first job (approvals/worker.py):
the first approved write after a worker starts does not wait for the engine's import. A real
`rqworker` subprocess started with the Procfile's own arguments (the `rq_worker` fixture reads
them there) on a private Redis runs a probe job that imports nothing of the product
and reports what the worker had loaded before it."""

from __future__ import annotations

import time
from typing import Any

import redis
from rq import Queue
from rq.job import Job, JobStatus

ENGINE_MODULES = ["approvals.jobs", "approvals.services.execution", "engine.core.barrier"]


def test_a_started_worker_has_the_engine_loaded_before_its_first_job(
    engine_redis: Any, rq_worker: Any
) -> None:
    queue = Queue("default", connection=redis.Redis.from_url(engine_redis.url))
    probe = queue.enqueue("tests.probe_jobs.modules_loaded", ENGINE_MODULES, result_ttl=300)
    worker = rq_worker()
    deadline = time.monotonic() + 60
    job = Job.fetch(probe.id, connection=queue.connection)
    while job.get_status(refresh=True) not in (JobStatus.FINISHED, JobStatus.FAILED):
        assert worker.alive(), worker.output()
        assert time.monotonic() < deadline, worker.output()
        time.sleep(0.05)
    assert job.get_status() == JobStatus.FINISHED, worker.output()
    assert job.return_value() == dict.fromkeys(ENGINE_MODULES, True)
