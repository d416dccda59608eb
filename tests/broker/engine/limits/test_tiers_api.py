"""Over HTTP, tiers authenticate, rate-limit, queue and time out requests, alone or shared through Redis."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from structlog.testing import capture_logs

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.server import answer_for
from tests.conftest import BrokerUnderTest, provider_for

LIMITED = {"name": "limited", "priority": 50, "window_ms": 0, "rpm": 2}
OPEN_TIER = {"name": "free", "priority": 50, "window_ms": 0}


def config(sim, tiers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A broker on `sim` with the given tiers (the first is the default) and no similarity model."""
    return {"providers": [provider_for(sim)], "merge": {"embedder": "none"}, "tiers": tiers,
            "default_tier": tiers[0]["name"], **extra}


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def rejected(broker: BrokerUnderTest, tier: str, reason: str) -> float:
    value = broker.broker.metrics.registry.get_sample_value("mergebroker_rejected_total",
                                                            {"tier": tier, "reason": reason})
    return value or 0.0


def assert_envelope(body: dict[str, Any], code: str) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]


class SubmitSpy:
    """Counts jobs handed to the broker's queue (queued, or run at once by their caller: `run_now`) and lets a
    test await the n-th, instead of guessing with sleeps. `queued` holds only those that were queued."""

    def __init__(self, broker: BrokerUnderTest) -> None:
        self.jobs: list[Any] = []
        self.queued: list[Any] = []
        self._queue = broker.broker.queue
        self._submit, self._run_now = self._queue.submit, self._queue.run_now
        self._changed = asyncio.Event()
        self._queue.submit = self._record  # type: ignore[method-assign]
        self._queue.run_now = self._record_run  # type: ignore[method-assign]

    def _record(self, job: Any) -> Any:
        future = self._submit(job)
        self.queued.append(job)
        self._note(job)
        return future

    def _record_run(self, job: Any) -> Any:
        run = self._run_now(job)
        if run is not None:
            self._note(job)
        return run

    def _note(self, job: Any) -> None:
        if job not in self.jobs:  # a job handed over by a caller that left is queued after it ran
            self.jobs.append(job)
        self._changed.set()

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[Any]:
        while len(self.jobs) < count:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                raise AssertionError(f"only {len(self.jobs)} of {count} requests reached the queue") from None
        return self.jobs


async def test_missing_and_unknown_keys_are_401_in_the_openai_envelope(simulator, start_broker):
    auth = {"mode": "keys", "keys": [{"sha256": sha("good-key"), "tenant": "a", "tiers": ["free"]}]}
    broker = await start_broker(config(simulator, [OPEN_TIER], auth=auth))
    for headers in ({}, bearer("bad-key")):
        status, body, _ = await broker.chat("hello", headers=headers)
        assert status == 401
        assert_envelope(body, "invalid_api_key")
    assert rejected(broker, "unknown", "unauthorized") == 2
    status, _, _ = await broker.chat("hello", headers=bearer("good-key"))
    assert status == 200
    assert simulator.stats()["chat_calls"] == 1


async def test_a_tier_the_key_may_not_use_or_that_does_not_exist_is_403(simulator, start_broker):
    auth = {"mode": "keys", "keys": [{"sha256": sha("k"), "tenant": "a", "tiers": ["free"]}]}
    broker = await start_broker(config(simulator, [OPEN_TIER, LIMITED], auth=auth))
    status, body, _ = await broker.chat("hi", headers=bearer("k", **{"X-Broker-Tier": "limited"}))
    assert status == 403
    assert_envelope(body, "tier_not_allowed")
    status, body, _ = await broker.chat("hi", headers=bearer("k", **{"X-Broker-Tier": "gold"}))
    assert status == 403
    assert_envelope(body, "unknown_tier")
    assert simulator.stats()["chat_calls"] == 0


async def test_refusals_label_only_configured_tiers_so_junk_headers_add_no_metric_series(simulator, start_broker):
    auth = {"mode": "keys", "keys": [{"sha256": sha("k"), "tenant": "a", "tiers": ["free"]}]}
    broker = await start_broker(config(simulator, [OPEN_TIER, LIMITED], auth=auth))
    for i in range(3):
        status, _, _ = await broker.chat("hi", headers=bearer("k", **{"X-Broker-Tier": f"junk-{i}"}))
        assert status == 403
    status, _, _ = await broker.chat("hi", headers={"X-Broker-Tier": "limited"})
    assert status == 401
    assert rejected(broker, "unknown", "forbidden") == 3 and rejected(broker, "limited", "unauthorized") == 1
    assert "junk" not in broker.broker.metrics.render().decode()


async def test_gateway_mode_needs_the_shared_secret_over_http(simulator, start_broker):
    settings = config(simulator, [OPEN_TIER], auth={"mode": "gateway", "gateway_secret_env": "GW"})
    # The secret comes from the environment only, as with the CLI.
    broker = await start_broker(settings, environ={"GW": "s3cret"})
    status, body, _ = await broker.chat("hi", headers={"X-Broker-Tenant": "acme"})
    assert status == 401 and body["error"]["code"] == "invalid_gateway_secret"
    status, _, _ = await broker.chat("hi", headers={"X-Broker-Tenant": "acme", "X-Broker-Gateway-Secret": "s3cret"})
    assert status == 200


async def test_third_request_in_a_two_rpm_tier_is_429_with_retry_after_and_limit_headers(simulator, start_broker):
    broker = await start_broker(config(simulator, [LIMITED]), clock=FakeClock())
    remaining = []
    for i in range(2):
        status, _, headers = await broker.chat(f"question {i}")
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "2"
        remaining.append(headers["x-ratelimit-remaining-requests"])
        assert "x-ratelimit-reset-requests" in headers
    assert remaining == ["1", "0"]
    status, body, headers = await broker.chat("question 3")
    assert status == 429
    assert_envelope(body, "rate_limit_exceeded")
    assert body["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in headers and int(headers["retry-after-ms"]) > 0
    assert rejected(broker, "limited", "rate_limited") == 1
    assert simulator.stats()["chat_calls"] == 2


async def test_an_unlimited_tier_sends_no_ratelimit_headers(simulator, start_broker):
    broker = await start_broker(config(simulator, [OPEN_TIER]))
    status, _, headers = await broker.chat("anything")
    assert status == 200
    assert not [name for name in headers if name.lower().startswith("x-ratelimit-")]


async def test_key_limits_apply_in_addition_to_the_tier_limit(simulator, start_broker):
    auth = {"mode": "keys", "keys": [{"sha256": sha("slow"), "tenant": "a", "tiers": ["shared"], "rpm": 1},
                                     {"sha256": sha("fast"), "tenant": "b", "tiers": ["shared"]}]}
    tier = {"name": "shared", "window_ms": 0, "rpm": 3}
    broker = await start_broker(config(simulator, [tier], auth=auth), clock=FakeClock())
    statuses = []
    for i, key in enumerate(["slow", "slow", "fast", "fast", "fast"]):
        status, body, headers = await broker.chat(f"q{i}", headers=bearer(key))
        statuses.append(status)
        if i == 1:  # refused by its own key, while the tier still had room
            assert "requests per minute on key" in body["error"]["message"]
            assert headers["x-ratelimit-limit-requests"] == "1"
    assert statuses == [200, 429, 200, 200, 429]  # the last: the tier's 3 are spent (1 slow + 2 fast)
    assert rejected(broker, "shared", "rate_limited") == 2


async def test_tokens_reserved_for_the_answer_are_given_back_once_it_is_short(simulator, start_broker):
    tier = {"name": "tpm", "window_ms": 0, "tpm": 100_000}
    broker = await start_broker(config(simulator, [tier]), clock=FakeClock())
    status, first, h1 = await broker.chat("How tall is the tower?", max_tokens=2000)
    assert status == 200
    used = first["usage"]["total_tokens"]
    reserved = 100_000 - int(h1["x-ratelimit-remaining-tokens"])
    assert reserved >= 2000 > used  # the reservation covered the whole output budget
    status, _, h2 = await broker.chat("How tall is the tower?", max_tokens=2000)
    assert status == 200
    # Settling the first request took back only what it used: the bucket fell by `used`, not by `reserved`.
    assert int(h1["x-ratelimit-remaining-tokens"]) - int(h2["x-ratelimit-remaining-tokens"]) == used


async def test_full_tier_queue_is_503_queue_full(simulator, start_broker):
    clock = FakeClock()
    tier = {"name": "tight", "window_ms": 5000, "max_batch": 8, "max_queue": 10, "hard_cap": 2,
            "similarity_threshold": 0}
    broker = await start_broker(config(simulator, [tier]), clock=clock)
    spy = SubmitSpy(broker)
    waiting = [asyncio.create_task(broker.chat(f"queued {i}")) for i in range(2)]
    await spy.wait_for(2)
    status, body, headers = await broker.chat("one too many")
    assert status == 503 and headers["Retry-After"] == "1"
    assert_envelope(body, "queue_full")
    assert rejected(broker, "tight", "queue_full") == 1
    clock.advance(5)
    answers = await asyncio.gather(*waiting)
    assert [s for s, _, _ in answers] == [200, 200]


async def test_a_request_whose_deadline_passes_in_the_queue_is_504_and_never_sent(simulator, start_broker):
    clock = FakeClock()
    tier = {"name": "slow", "window_ms": 5000, "max_batch": 8, "similarity_threshold": 0}
    broker = await start_broker(config(simulator, [tier]), clock=clock)
    spy = SubmitSpy(broker)
    impatient = asyncio.create_task(broker.chat("too impatient", broker={"timeout_s": 0.2}))
    await spy.wait_for(1)
    clock.advance(0.2)  # its deadline passes while its window (5 s) is still open
    status, body, _ = await impatient
    assert status == 504
    assert_envelope(body, "deadline_exceeded")
    assert rejected(broker, "slow", "deadline") == 1
    # A patient request joins the same window; when it is released the expired one must not go along.
    patient = asyncio.create_task(broker.chat("patient question"))
    await spy.wait_for(2)
    clock.advance(5)
    status, body, headers = await patient
    assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("patient question")
    assert headers["X-Broker-Batch-Size"] == "1"
    assert (simulator.stats()["chat_calls"], simulator.stats()["merged_calls"]) == (1, 0)
    assert broker.broker.queue.depth("slow") == 0


async def test_a_client_that_leaves_is_removed_before_dispatch_and_its_group_is_answered(simulator, start_broker):
    clock = FakeClock()
    # A long window released by the fake clock: the real timer cannot race the disconnect.
    tier = {"name": "batch", "priority": 0, "window_ms": 5000, "max_batch": 8, "similarity_threshold": 0}
    broker = await start_broker(config(simulator, [tier]), clock=clock)
    spy = SubmitSpy(broker)
    questions = ["Who wrote Hamlet?", "What is the boiling point of water?", "Name a prime number."]
    tasks = [asyncio.create_task(broker.chat(q)) for q in questions]
    jobs = await spy.wait_for(3)
    leaver = next(j for j in jobs if j.body["messages"][-1]["content"] == questions[0])
    left = asyncio.Event()
    leaver.future.add_done_callback(lambda _: left.set())
    tasks[0].cancel()
    await asyncio.wait_for(left.wait(), timeout=10)  # the broker noticed the disconnect
    assert leaver.future.cancelled(), "the leaving client's job was answered instead of dropped"
    clock.advance(5)
    for q, (status, body, headers) in zip(questions[1:], await asyncio.gather(*tasks[1:])):
        assert status == 200 and body["choices"][0]["message"]["content"] == answer_for(q)
        assert headers["X-Broker-Batch-Size"] == "2"
    assert (simulator.stats()["chat_calls"], simulator.stats()["merged_calls"]) == (1, 1)


async def test_two_brokers_share_a_tier_limit_through_redis(simulator, start_broker, redis_server):
    settings = config(simulator, [{"name": "shared", "window_ms": 0, "rpm": 3}], redis={"url": redis_server.url})
    first, second = await start_broker(settings), await start_broker(settings)
    statuses = [(await b.chat(f"q{i}"))[0] for i, b in enumerate([first, second, first, second, first])]
    assert statuses == [200, 200, 200, 429, 429]
    assert rejected(first, "shared", "rate_limited") + rejected(second, "shared", "rate_limited") == 2


async def test_requests_still_succeed_on_local_limits_when_redis_stops(simulator, start_broker, redis_server):
    settings = config(simulator, [{"name": "shared", "window_ms": 0, "rpm": 50}], redis={"url": redis_server.url})
    broker = await start_broker(settings)
    status, _, headers = await broker.chat("before")
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "49"
    redis_server.stop()
    with capture_logs() as logs:
        status, body, headers = await broker.chat("after")
    assert status == 200 and body["choices"][0]["message"]["content"] == answer_for("after")
    assert headers["x-ratelimit-limit-requests"] == "50"  # the in-process fallback still enforces the tier
    assert any(e["event"] == "ratelimit_redis_unavailable" for e in logs)
