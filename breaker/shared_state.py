"""Breaker state shared by broker replicas through Redis, so one replica's discovery protects all.

Each replica publishes its breakers' own transitions to OPEN (with the open-until time as wall-clock
epoch seconds, since monotonic clocks differ between hosts) and to CLOSED, one key per provider:
`{prefix}{provider}` holding JSON `{"state", "until", "origin", "at"}`. A background loop pulls the
keys every `refresh_s` and forces a local breaker open while another replica's record says open.
Opens learnt this way are not published again, so replicas do not echo each other.

Keys carry no hash tag: records are independent, so in a Redis Cluster the pull is one MGET per slot.

Sharing is best effort: while Redis is unreachable every replica keeps its local state, one warning
`breaker_shared_state_unavailable` is logged, and unpublished transitions wait for the next refresh.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
from redis.exceptions import RedisError

from mergebroker.breaker.circuit import CircuitBreaker
from mergebroker.clock import Clock, Sleep, monotonic, sleep_or_event
from mergebroker.redis_connect import RedisClient, get_many

log = structlog.get_logger(__name__)

SHARED_CAUSE = "shared"
CLOSED_RECORD_TTL_S = 300


class SharedBreakerState:
    """Publishes local breaker transitions to Redis and applies other replicas' opens locally.

    Call `attach(breaker)` for each breaker, then `start()` the refresh loop (or call `refresh()`).
    `clock` must be the breakers' clock; `wall_clock` gives epoch seconds comparable across hosts.
    """

    def __init__(self, client: RedisClient, *, prefix: str = "mb:breaker:", clock: Clock = monotonic,
                 wall_clock: Callable[[], float] = time.time, sleep: Sleep = asyncio.sleep,
                 refresh_s: float = 0.5, op_timeout_s: float = 1.0, replica_id: str | None = None) -> None:
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._wall = wall_clock
        self._sleep = sleep
        self._refresh_s = refresh_s
        self._op_timeout_s = op_timeout_s
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self._breakers: dict[str, CircuitBreaker] = {}
        # Latest unpublished record per provider: only the newest transition matters.
        self._outbox: dict[str, dict[str, Any]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unavailable = False

    def attach(self, breaker: CircuitBreaker) -> None:
        """Share `breaker`'s state under its provider name."""
        self._breakers[breaker.name] = breaker
        breaker.add_transition_listener(self._on_transition)

    async def start(self) -> None:
        """Start the background refresh loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="breaker-shared-state")
            self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        """Stop the refresh loop; the Redis client stays open (its owner closes it)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Bounded: a Redis call stuck past its cancellation must not hold up shutdown.
            await asyncio.wait({task}, timeout=self._op_timeout_s)

    async def refresh(self) -> None:
        """Publish pending local transitions, then apply other replicas' opens. Never raises for Redis trouble."""
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._publish()
                records = await self._pull()
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._unavailable:
                self._unavailable = True
                log.warning("breaker_shared_state_unavailable", error=type(exc).__name__)
            return
        if self._unavailable:
            self._unavailable = False
            log.info("breaker_shared_state_restored")
        self._apply(records)

    def _on_transition(self, provider: str, _from: str, to: str, reason: dict[str, Any]) -> None:
        if reason.get("cause") == SHARED_CAUSE:
            return
        record = record_for(to, self._breakers[provider].seconds_until_probe(), self._wall(), self.replica_id)
        if record is not None:
            self._outbox[provider] = record
            self._wake.set()

    async def _publish(self) -> None:
        while self._outbox:
            provider, record = next(iter(self._outbox.items()))
            ttl_s = max(1, int(record["until"] - record["at"]) + 1) if record["state"] == "open" \
                else CLOSED_RECORD_TTL_S
            await self._client.set(self._prefix + provider, json.dumps(record), ex=ttl_s)
            # A newer transition recorded while we awaited replaces this one and stays queued.
            if self._outbox.get(provider) is record:
                del self._outbox[provider]

    async def _pull(self) -> dict[str, bytes | str | None]:
        names = list(self._breakers)
        if not names:
            return {}
        values = await get_many(self._client, [self._prefix + name for name in names])
        return dict(zip(names, values))

    def _apply(self, records: dict[str, bytes | str | None]) -> None:
        wall_now, now = self._wall(), self._clock()
        for provider, raw in records.items():
            record = parse_record(raw)
            if record is None or record["origin"] == self.replica_id or record["state"] != "open":
                continue
            remaining = record["until"] - wall_now
            if remaining > 0:
                self._breakers[provider].force_open(now + remaining,
                                                    {"cause": SHARED_CAUSE, "origin": record["origin"]})

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:
                log.exception("breaker_shared_state_refresh_failed")
            await self._wait()

    async def _wait(self) -> None:
        """Until `refresh_s` passed or a local transition wants publishing, whichever comes first."""
        await sleep_or_event(self._sleep, self._refresh_s, self._wake)


def record_for(to_state: str, open_remaining_s: float, wall_now: float, origin: str) -> dict[str, Any] | None:
    """The record a local transition publishes: OPEN with its wall-clock until time, CLOSED, or None."""
    if to_state == "open":
        return {"state": "open", "until": wall_now + open_remaining_s, "origin": origin, "at": wall_now}
    if to_state == "closed":
        return {"state": "closed", "until": wall_now, "origin": origin, "at": wall_now}
    return None


def parse_record(raw: bytes | str | None) -> dict[str, Any] | None:
    """A published record, or None when absent or malformed (another version may write other shapes)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        return {"state": str(record["state"]), "until": float(record["until"]), "origin": str(record["origin"])}
    except (ValueError, TypeError, KeyError):
        return None


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("breaker_shared_state_loop_died", error=repr(task.exception()))
