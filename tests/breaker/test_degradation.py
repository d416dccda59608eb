"""End to end, outages trip breakers, merging pauses first, callers get fast busy answers, and recovery closes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from mergebroker.breaker.circuit import BreakerState
from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.server import SimulatorConfig, answer_for, start_simulator
from tests.conftest import provider_for
from tests.helpers.polling import wait_until

BATCH = {"X-Broker-Tier": "batch"}
BREAKER = {"min_calls": 4, "window_s": 30, "open_s": 10}
BUSY = {"type": "service_unavailable", "code": "upstream_unavailable", "message": "AI service busy, please retry later"}
TIERS = [
    {"name": "standard", "priority": 50, "window_ms": 0, "merge": False},
    {"name": "batch", "priority": 0, "window_ms": 200, "max_batch": 4, "similarity_threshold": 0},
]


def config(*sims: Any, breaker: dict | None = None, tiers: list | None = None, **extra: Any) -> dict:
    """Providers sim0, sim1, ... over the given simulators; retries without backoff; no similarity model."""
    providers = [provider_for(s, name=f"sim{i}", breaker=breaker or BREAKER) for i, s in enumerate(sims)]
    return {"providers": providers, "retry": {"attempts": 3, "backoff_base_s": 0, "backoff_max_s": 0},
            "tiers": tiers or TIERS, "merge": {"embedder": "none"}, **extra}


def sample(broker: Any, name: str, **labels: str) -> float:
    return broker.broker.metrics.registry.get_sample_value(name, labels) or 0.0


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


async def trip(broker: Any, sim: Any, breaker: str = "sim0") -> list[int]:
    """Take the simulator down and send requests until the breaker opens; returns their statuses."""
    sim.set_faults(down=True)
    statuses = []
    for i in range(10):
        status, _, _ = await broker.chat(f"outage question {i}")
        statuses.append(status)
        if broker.broker.breakers[breaker].state is BreakerState.OPEN:
            return statuses
    raise AssertionError(f"breaker never opened: {statuses}")


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `predicate()` holds. What it watches happens behind an HTTP boundary that sends no event
    back to the test (requests arriving in a queue, calls finishing after their client left), so this
    looks every 10 ms, within a bound."""
    await wait_until(predicate, timeout_s, "condition not reached in time")


class Gate:
    """The simulator's latency sleep: holds every call until `release()`, and signals when `expected` arrived."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.arrived = 0
        self.all_arrived = asyncio.Event()
        self._open = asyncio.Event()

    async def sleep(self, _seconds: float) -> None:
        self.arrived += 1
        if self.arrived >= self.expected:
            self.all_arrived.set()
        await self._open.wait()

    def release(self) -> None:
        self._open.set()


@pytest.fixture
async def second_simulator() -> AsyncIterator[Any]:
    sim = await start_simulator()
    try:
        yield sim
    finally:
        await sim.close()


@pytest.fixture
async def gated_simulator() -> AsyncIterator[tuple[Any, Gate]]:
    """A simulator whose every call waits at a gate (opened at teardown so shutdown never waits)."""
    gate = Gate(expected=6)
    sim = await start_simulator(SimulatorConfig(latency_base_ms=1), sleep=gate.sleep)
    try:
        yield sim, gate
    finally:
        gate.release()
        await sim.close()


async def test_an_outage_opens_the_breaker_within_its_window(simulator, start_broker, fake_clock: FakeClock):
    broker = await start_broker(config(simulator), clock=fake_clock)
    started = fake_clock()
    simulator.set_faults(down=True)
    status, body, _ = await broker.chat("first outage question")
    assert status == 502 and body["error"]["type"] == "upstream_error"  # three attempts, all failed
    fake_clock.advance(5)
    status, body, headers = await broker.chat("second outage question")
    assert status == 503 and {k: body["error"][k] for k in BUSY} == BUSY  # the fourth failure tripped it
    assert headers["Retry-After"] == "10"
    assert simulator.stats()["chat_calls"] == BREAKER["min_calls"]
    assert fake_clock() - started < BREAKER["window_s"]
    async with broker.http.get("/readyz") as resp:
        snapshot = (await resp.json())["providers"]["sim0"]
    assert snapshot["state"] == "open" and snapshot["seconds_until_probe"] == 10
    assert sample(broker, "mergebroker_breaker_state", provider="sim0") == 2
    assert sample(broker, "mergebroker_breaker_transitions_total", provider="sim0", to="open") == 1


async def test_with_every_upstream_open_callers_get_a_fast_busy_answer_and_no_call_is_made(
        simulator, second_simulator, start_broker, fake_clock: FakeClock):
    broker = await start_broker(config(simulator, second_simulator), clock=fake_clock)
    second_simulator.set_faults(down=True)
    await trip(broker, simulator)
    assert broker.broker.breakers["sim1"].state is BreakerState.OPEN  # failover took both down together
    calls = simulator.stats()["chat_calls"] + second_simulator.stats()["chat_calls"]
    fast_fails = sample(broker, "mergebroker_fast_fail_total", model="sim-small")
    fake_clock.advance(3)
    for i in range(5):
        # Measured on the broker's clock: every wait in the broker (backoff, pacing, windows) is on it, so
        # an answer that waited for anything would not come back at all (wait_for bounds the real time).
        started = fake_clock()
        status, body, headers = await asyncio.wait_for(broker.chat(f"while everything is down {i}"), 5)
        elapsed = fake_clock() - started
        assert status == 503 and {k: body["error"][k] for k in BUSY} == BUSY
        assert headers["Retry-After"] == "7"  # seconds until the first probe
        assert elapsed < 0.05, elapsed
    status, _, headers = await broker.chat("a stream while everything is down", stream=True)
    assert status == 503 and headers["Retry-After"] == "7"
    crowd = await asyncio.wait_for(asyncio.gather(*(broker.chat(f"crowd {i}") for i in range(20))), 5)
    assert {status for status, _, _ in crowd} == {503}
    assert simulator.stats()["chat_calls"] + second_simulator.stats()["chat_calls"] == calls
    assert sample(broker, "mergebroker_fast_fail_total", model="sim-small") == fast_fails + 26


async def test_requests_already_queued_are_answered_busy_without_an_upstream_call(
        simulator, start_broker, fake_clock: FakeClock):
    tiers = [TIERS[0], {"name": "batch", "priority": 0, "window_ms": 5_000, "max_batch": 8,
                        "similarity_threshold": 0}]
    broker = await start_broker(config(simulator, tiers=tiers), clock=fake_clock)
    simulator.set_faults(down=True)
    queued = [asyncio.create_task(broker.chat(f"queued question {i}", headers=BATCH)) for i in range(4)]
    await eventually(lambda: broker.broker.queue.depth("batch") == 4)
    await trip(broker, simulator)
    calls = simulator.stats()["chat_calls"]
    fast_fails = sample(broker, "mergebroker_fast_fail_total", model="sim-small")
    fake_clock.advance(6)  # past the batch window on the broker's clock, still 4 s before the probe
    results = await asyncio.wait_for(asyncio.gather(*queued), 5)
    for status, body, headers in results:
        assert status == 503 and {k: body["error"][k] for k in BUSY} == BUSY
        assert headers["Retry-After"] == "4"
    assert simulator.stats()["chat_calls"] == calls
    assert sample(broker, "mergebroker_fast_fail_total", model="sim-small") == fast_fails  # not at admission


async def test_after_open_s_a_probe_closes_the_breaker_and_traffic_flows(simulator, start_broker,
                                                                          fake_clock: FakeClock):
    broker = await start_broker(config(simulator), clock=fake_clock)
    breaker = broker.broker.breakers["sim0"]
    await trip(broker, simulator)
    fake_clock.advance(10)
    status, _, headers = await broker.chat("probe while still down")
    assert status == 503 and headers["Retry-After"] == "20"  # the failed probe doubled the open time
    simulator.set_faults(down=False)
    fake_clock.advance(20)
    calls = simulator.stats()["chat_calls"]
    status, body, _ = await broker.chat("probe after recovery")
    assert status == 200 and content(body) == answer_for("probe after recovery")
    assert breaker.state is BreakerState.CLOSED
    for i in range(5):
        status, body, _ = await broker.chat(f"traffic after recovery {i}")
        assert status == 200 and content(body) == answer_for(f"traffic after recovery {i}")
    assert simulator.stats()["chat_calls"] == calls + 6
    assert sample(broker, "mergebroker_breaker_transitions_total", provider="sim0", to="closed") == 1
    assert sample(broker, "mergebroker_breaker_state", provider="sim0") == 0


async def test_merging_pauses_while_errors_pass_the_lower_watermark_and_resumes_after(
        simulator, start_broker, fake_clock: FakeClock):
    breaker_config = {"min_calls": 10, "window_s": 30, "open_s": 10, "error_ratio": 0.5, "degrade_error_ratio": 0.05}
    broker = await start_broker(config(simulator, breaker=breaker_config), clock=fake_clock)
    for i in range(4):
        assert (await broker.chat(f"healthy question {i}"))[0] == 200
    simulator.set_faults(fail_first_n=2)
    assert (await broker.chat("question that needed retries"))[0] == 200  # 2 failures in 7 calls: 29 %
    questions = [f"degraded batch question {i}" for i in range(4)]
    results = await asyncio.gather(*(broker.chat(q, headers=BATCH) for q in questions))
    for q, (status, body, headers) in zip(questions, results):
        assert status == 200 and content(body) == answer_for(q)
        assert headers["X-Broker-Batch-Size"] == "1"
    assert broker.broker.breakers["sim0"].state is BreakerState.CLOSED  # paused well before it would open
    assert sample(broker, "mergebroker_degraded", model="sim-small") == 1
    fake_clock.advance(31)  # the failures leave the window
    questions = [f"recovered batch question {i}" for i in range(4)]
    results = await asyncio.gather(*(broker.chat(q, headers=BATCH) for q in questions))
    for q, (status, body, headers) in zip(questions, results):
        assert status == 200 and content(body) == answer_for(q)
        assert headers["X-Broker-Batch-Size"] == "4"
    assert sample(broker, "mergebroker_degraded", model="sim-small") == 0


async def test_failover_to_a_second_upstream_keeps_answers_correct_while_the_first_is_down(
        simulator, second_simulator, start_broker, fake_clock: FakeClock):
    broker = await start_broker(config(simulator, second_simulator), clock=fake_clock)
    simulator.set_faults(down=True)
    for i in range(8):
        status, body, _ = await broker.chat(f"failover question {i}")
        assert status == 200 and content(body) == answer_for(f"failover question {i}")
    assert broker.broker.breakers["sim0"].state is BreakerState.OPEN
    assert broker.broker.breakers["sim1"].state is BreakerState.CLOSED
    assert simulator.stats()["chat_calls"] == BREAKER["min_calls"]  # skipped once open
    assert second_simulator.stats()["chat_calls"] == 8
    assert sample(broker, "mergebroker_upstream_calls_total", provider="sim0", outcome="5xx") == 4


async def test_caller_errors_are_returned_as_is_and_neither_trip_nor_fail_over(
        simulator, second_simulator, start_broker, fake_clock: FakeClock):
    broker = await start_broker(config(simulator, second_simulator), clock=fake_clock)
    simulator.set_faults(status_override=400)
    for i in range(8):
        status, body, _ = await broker.chat(f"bad question {i}")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
    breaker = broker.broker.breakers["sim0"]
    assert breaker.state is BreakerState.CLOSED and breaker.snapshot()["calls"] == 0
    assert simulator.stats()["chat_calls"] == 8 and second_simulator.stats()["chat_calls"] == 0
    simulator.set_faults(status_override=None)
    status, body, _ = await broker.chat("good question")
    assert status == 200 and content(body) == answer_for("good question")


async def test_cancelled_upstream_calls_do_not_trip_the_breaker(gated_simulator, start_broker,
                                                                 fake_clock: FakeClock):
    sim, gate = gated_simulator
    broker = await start_broker(config(sim), clock=fake_clock)
    pools, breaker = broker.broker.pools, broker.broker.breakers["sim0"]
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 16}
    calls = [asyncio.create_task(pools.chat("sim-small", body, deadline=fake_clock() + 60)) for _ in range(6)]
    await asyncio.wait_for(gate.all_arrived.wait(), 5)
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert breaker.state is BreakerState.CLOSED and breaker.snapshot()["calls"] == 0
    assert sample(broker, "mergebroker_upstream_calls_total", provider="sim0", outcome="cancelled") == 6


async def test_clients_disconnecting_mid_call_do_not_trip_the_breaker(gated_simulator, start_broker,
                                                                      fake_clock: FakeClock):
    sim, gate = gated_simulator
    broker = await start_broker(config(sim), clock=fake_clock)
    breaker = broker.broker.breakers["sim0"]
    clients = [aiohttp.ClientSession(base_url=broker.url) for _ in range(6)]
    try:
        posts = [asyncio.create_task(c.post("/v1/chat/completions", json={
            "model": "sim-small", "messages": [{"role": "user", "content": f"leaving {i}"}]}))
            for i, c in enumerate(clients)]
        await asyncio.wait_for(gate.all_arrived.wait(), 5)
        for post in posts:
            post.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
    gate.release()
    await eventually(lambda: sample(broker, "mergebroker_upstream_calls_total", provider="sim0",
                                    outcome="success") + sample(broker, "mergebroker_upstream_calls_total",
                                                                provider="sim0", outcome="cancelled") == 6)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot()["error_ratio"] == 0
    status, body, _ = await broker.chat("still welcome")
    assert status == 200 and content(body) == answer_for("still welcome")


async def test_two_brokers_sharing_redis_see_one_breaker_state(simulator, redis_server, start_broker,
                                                               fake_clock: FakeClock):
    first = await start_broker(config(simulator, redis={"url": redis_server.url}), clock=fake_clock)
    second = await start_broker(config(simulator, redis={"url": redis_server.url}), clock=fake_clock)
    await trip(first, simulator)
    calls = simulator.stats()["chat_calls"]
    await first.broker.shared_breakers.refresh()  # publish now rather than when its loop wakes
    await second.broker.shared_breakers.refresh()
    assert second.broker.breakers["sim0"].state is BreakerState.OPEN
    status, body, headers = await second.chat("asked of the other replica")
    assert status == 503 and {k: body["error"][k] for k in BUSY} == BUSY
    assert 9 <= int(headers["Retry-After"]) <= 10
    assert simulator.stats()["chat_calls"] == calls


async def test_callers_with_short_deadlines_cannot_open_the_breaker_for_everyone(start_broker):
    slow = await start_simulator(SimulatorConfig(latency_base_ms=300))
    try:
        broker = await start_broker(config(slow))  # the real clock: the deadlines must really pass
        impatient = await asyncio.gather(*(broker.chat(f"impatient {i}", broker={"timeout_s": 0.05})
                                           for i in range(12)))
        assert {status for status, _, _ in impatient} == {504}
        breaker = broker.broker.breakers["sim0"]
        # The upstream calls outlive their callers' answers; each must end as the caller's deadline.
        await eventually(lambda: sample(broker, "mergebroker_upstream_calls_total", provider="sim0",
                                        outcome="deadline") == 12)
        status, body, _ = await broker.chat("a patient caller from another tenant")
        assert status == 200 and content(body) == answer_for("a patient caller from another tenant")
        assert breaker.state is BreakerState.CLOSED and breaker.snapshot()["error_ratio"] == 0
        assert sample(broker, "mergebroker_upstream_calls_total", provider="sim0", outcome="timeout") == 0
    finally:
        await slow.close()


async def test_an_upstream_rejecting_the_brokers_key_fails_over_and_never_blames_the_client(
        simulator, second_simulator, start_broker, fake_clock: FakeClock):
    broker = await start_broker(config(simulator, second_simulator), clock=fake_clock)
    simulator.set_faults(status_override=401)
    status, body, _ = await broker.chat("a question")
    assert status == 200 and content(body) == answer_for("a question")
    second_simulator.set_faults(status_override=401)
    status, body, _ = await broker.chat("another question")
    assert status == 502
    assert body["error"]["type"] == "upstream_error"
    assert body["error"]["message"] == "The upstream rejected the broker's credentials"
    assert broker.broker.breakers["sim0"].state is BreakerState.OPEN  # four rejections: counted as failures


async def test_readyz_says_not_ready_once_the_queue_workers_are_gone(simulator, start_broker):
    broker = await start_broker(config(simulator))
    async with broker.http.get("/readyz") as resp:
        assert resp.status == 200 and (await resp.json())["checks"]["workers"] is True
    await broker.broker.queue.stop()
    async with broker.http.get("/readyz") as resp:
        assert resp.status == 503 and (await resp.json())["checks"]["workers"] is False
