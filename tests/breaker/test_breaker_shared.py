"""Breaker state shared through Redis: one replica's open breaker opens the others, and a dead Redis changes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as redis
from structlog.testing import capture_logs

from mergebroker.breaker.circuit import BreakerSettings, BreakerState, CircuitBreaker
from mergebroker.breaker.shared_state import SharedBreakerState
from mergebroker.clock import FakeClock
from mergebroker.errors import UpstreamHTTPError

SETTINGS = BreakerSettings()
PREFIX = "mb:test:breaker:"


class Replica:
    """One broker replica: its own monotonic clock, a breaker for provider "alpha", and its shared state."""

    def __init__(self, client: redis.Redis, wall: FakeClock, start: float, **kwargs: float) -> None:
        self.clock = FakeClock(start)
        self.transitions: list[tuple[str, str, dict]] = []
        self.changed = asyncio.Event()
        self.breaker = CircuitBreaker("alpha", SETTINGS, clock=self.clock, on_transition=self._seen)
        self.shared = SharedBreakerState(client, prefix=PREFIX, clock=self.clock, wall_clock=wall, **kwargs)
        self.shared.attach(self.breaker)

    def _seen(self, _provider: str, old: str, new: str, reason: dict) -> None:
        self.transitions.append((old, new, reason))
        self.changed.set()

    async def trip(self) -> None:
        for _ in range(SETTINGS.min_calls):
            with pytest.raises(UpstreamHTTPError):
                async with self.breaker.guard():
                    raise UpstreamHTTPError(503, "down")
        assert self.breaker.state is BreakerState.OPEN


class Hosts:
    """Time on every host: wall-clock epoch seconds, plus each replica's unrelated monotonic clock."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.wall = FakeClock(1_700_000_000.0)
        self.replicas: list[Replica] = []

    def replica(self, start: float, **kwargs: float) -> Replica:
        replica = Replica(self.client, self.wall, start, **kwargs)
        self.replicas.append(replica)
        return replica

    def advance(self, seconds: float) -> None:
        self.wall.advance(seconds)
        for replica in self.replicas:
            replica.clock.advance(seconds)


@pytest.fixture
async def client(redis_server) -> AsyncIterator[redis.Redis]:
    client = redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    yield client
    await client.aclose()


@pytest.fixture
def hosts(client: redis.Redis) -> Iterator[Hosts]:
    yield Hosts(client)


async def test_opening_on_one_replica_opens_the_other_after_refresh(hosts: Hosts, client: redis.Redis) -> None:
    a, b = hosts.replica(start=100.0), hosts.replica(start=90_000.0)
    await a.trip()
    hosts.advance(3)
    await b.shared.refresh()
    assert b.breaker.state is BreakerState.CLOSED  # a has not published yet
    await a.shared.refresh()
    await b.shared.refresh()
    assert b.breaker.state is BreakerState.OPEN
    assert b.breaker.seconds_until_probe() == pytest.approx(SETTINGS.open_s - 3)
    assert b.transitions[-1][2] == {"cause": "shared", "origin": a.shared.replica_id, "open_s": 7.0}
    await b.shared.refresh()  # the forced open is not echoed back to Redis
    record = json.loads(await client.get(PREFIX + "alpha"))
    assert (record["state"], record["origin"]) == ("open", a.shared.replica_id)
    hosts.advance(7)
    assert b.breaker.state is BreakerState.HALF_OPEN


async def test_expired_and_closed_records_do_not_open_anyone(hosts: Hosts) -> None:
    a = hosts.replica(start=100.0)
    await a.trip()
    await a.shared.refresh()
    hosts.advance(SETTINGS.open_s + 1)
    late = hosts.replica(start=5.0)
    await late.shared.refresh()
    assert late.breaker.state is BreakerState.CLOSED  # the open record's until time has passed
    async with a.breaker.guard():  # a's probe succeeds and it publishes "closed"
        pass
    await a.shared.refresh()
    hosts.advance(-SETTINGS.open_s)  # even with until in the future again, a closed record opens nothing
    await late.shared.refresh()
    assert late.breaker.state is BreakerState.CLOSED


async def test_redis_down_keeps_local_state_and_warns_once_then_recovers(hosts: Hosts, redis_server) -> None:
    a, b = hosts.replica(start=100.0), hosts.replica(start=200.0)
    redis_server.stop()
    await a.trip()
    with capture_logs() as logs:
        await a.shared.refresh()
        await a.shared.refresh()
        await b.shared.refresh()
    assert a.breaker.state is BreakerState.OPEN
    assert b.breaker.state is BreakerState.CLOSED
    warnings = [e for e in logs if e["event"] == "breaker_shared_state_unavailable"]
    assert len(warnings) == 2  # one per replica, not one per refresh
    assert all(e["log_level"] == "warning" for e in warnings)
    redis_server.start()
    await a.shared.refresh()  # the transition kept waiting is published now
    await b.shared.refresh()
    assert b.breaker.state is BreakerState.OPEN


async def test_background_loop_spreads_an_open_without_manual_refresh(hosts: Hosts) -> None:
    a, b = hosts.replica(start=100.0, refresh_s=0.02), hosts.replica(start=200.0, refresh_s=0.02)
    await a.shared.start()
    await b.shared.start()
    try:
        await a.trip()
        await asyncio.wait_for(b.changed.wait(), timeout=5)
        assert b.breaker.state is BreakerState.OPEN
    finally:
        await a.shared.stop()
        await b.shared.stop()
