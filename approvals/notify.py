"""Wake-ups for long-polling clients: one Redis pub/sub channel per action and per run.

Every service that changes an action (or a run's status) calls, after commit:

    transaction.on_commit(lambda: notify_action_changed(action.id))
    transaction.on_commit(partial(notify_run_changed, run.id))

Redis is only the doorbell: a lost message costs a waiter at most its safety
re-check interval, never correctness (the answer is always read from PostgreSQL).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import redis
import redis.asyncio as aioredis
from django.conf import settings

from console.redis_clients import shared_redis

logger = logging.getLogger("airlock.notify")

CHANNEL_PREFIX = "airlock:action:"
CHANNEL_PATTERN = CHANNEL_PREFIX + "*"
RUN_CHANNEL_PREFIX = "airlock:run:"
RUN_CHANNEL_PATTERN = RUN_CHANNEL_PREFIX + "*"


def action_channel(action_id: uuid.UUID | str) -> str:
    return f"{CHANNEL_PREFIX}{action_id}"


def run_channel(run_id: uuid.UUID | str) -> str:
    return f"{RUN_CHANNEL_PREFIX}{run_id}"


def _redis() -> redis.Redis:
    return shared_redis(settings.REDIS_URL, timeout=2)


def notify_action_changed(action_id: uuid.UUID | str) -> None:
    """Publish a change of `action_id` to its waiters. Never raises."""
    try:
        _redis().publish(action_channel(action_id), b"changed")
    except redis.RedisError:
        logger.warning("could not publish change of action %s", action_id, exc_info=True)


def notify_run_changed(run_id: uuid.UUID | str) -> None:
    """Publish a change of run `run_id` (its status) to its waiters. Never raises."""
    try:
        _redis().publish(run_channel(run_id), b"changed")
    except redis.RedisError:
        logger.warning("could not publish change of run %s", run_id, exc_info=True)


# --- The waiting side (ASGI web processes) -----------------------------------


class ActionWaiters:
    """One process-wide Redis subscription dispatching to per-action (and per-run)
    asyncio events.

    A long-poll registers an event for its action or run *before* reading its
    state, so a change committed between the read and the wait still wakes it.
    One pattern subscription (`airlock:action:*`, `airlock:run:*`) serves every
    waiter of the process: no Redis connection per waiting client.
    """

    def __init__(self) -> None:
        self._events: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        # Waiters past their first read, waiting for a wake-up (the /metrics gauge
        # airlock_longpoll_held: a change made now reaches them through pub/sub).
        self.held = 0

    @property
    def waiting(self) -> int:
        # Read from other threads (/metrics): copy before iterating.
        return sum(len(events) for events in list(self._events.values()))

    async def _ensure_listening(self) -> bool:
        loop = asyncio.get_running_loop()
        if self._task is None or self._loop is not loop or self._task.done():
            self._loop = loop
            self._ready = asyncio.Event()
            self._events = {}
            self._task = loop.create_task(self._listen(self._ready))
        assert self._ready is not None
        try:
            await asyncio.wait_for(self._ready.wait(), timeout=2.0)
        except TimeoutError:
            return False
        return True

    def _wake_all(self) -> None:
        for events in self._events.values():
            for event in events:
                event.set()

    async def _listen(self, ready: asyncio.Event) -> None:
        while True:
            client = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2)
            pubsub = client.pubsub()
            try:
                await pubsub.psubscribe(CHANNEL_PATTERN, RUN_CHANNEL_PATTERN)
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "psubscribe":
                        ready.set()
                        # Anything published while we were (re)connecting is
                        # lost: let every waiter re-read once.
                        self._wake_all()
                    elif kind == "pmessage":
                        channel = message["channel"]
                        if isinstance(channel, bytes):
                            channel = channel.decode()
                        for event in self._events.get(channel, ()):
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("action change subscription lost; reconnecting", exc_info=True)
                ready.clear()
                self._wake_all()
                await asyncio.sleep(0.5)
            finally:
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except Exception:  # noqa: S110 - closing a broken connection
                    pass

    async def register(self, action_id: uuid.UUID | str) -> tuple[asyncio.Event, bool]:
        """An event set on every change of the action; the bool says whether the
        subscription is live (False: Redis unreachable, fall back to re-checks)."""
        return await self._register(action_channel(action_id))

    async def register_run(self, run_id: uuid.UUID | str) -> tuple[asyncio.Event, bool]:
        """The same for a run: set on every change of its status."""
        return await self._register(run_channel(run_id))

    async def _register(self, channel: str) -> tuple[asyncio.Event, bool]:
        live = await self._ensure_listening()
        event = asyncio.Event()
        self._events.setdefault(channel, set()).add(event)
        return event, live

    def unregister(self, action_id: uuid.UUID | str, event: asyncio.Event) -> None:
        self._unregister(action_channel(action_id), event)

    def unregister_run(self, run_id: uuid.UUID | str, event: asyncio.Event) -> None:
        self._unregister(run_channel(run_id), event)

    def _unregister(self, channel: str, event: asyncio.Event) -> None:
        events = self._events.get(channel)
        if events is not None:
            events.discard(event)
            if not events:
                self._events.pop(channel, None)


action_waiters = ActionWaiters()
