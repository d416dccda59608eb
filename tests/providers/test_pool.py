"""Provider pools route by load or weight, fail over on retryable errors only, keep caps and breakers, count it all."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from mergebroker.breaker.circuit import BreakerSettings, BreakerState, CircuitBreaker
from mergebroker.broker.engine.ground.metrics import Metrics, PoolMetrics
from mergebroker.clock import FakeClock
from mergebroker.errors import DeadlineExceeded, UpstreamError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable
from mergebroker.providers.fake import FakeProvider
from mergebroker.providers.openai.compat import read_timeout_for
from mergebroker.providers.pacing import UpstreamLimiter
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.retry import RetryPolicy
from mergebroker.providers.upstream import Upstream, order_upstreams

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
NO_WAIT = RetryPolicy(attempts=3, backoff_base_s=0, backoff_max_s=0)


class TimingOutProvider(FakeProvider):
    """A Provider whose every chat call times out: after its whole timeout, or after `after_s` if set."""

    def __init__(self, name: str, clock: FakeClock, *, after_s: float | None = None) -> None:
        super().__init__(name)
        self._clock = clock
        self._after_s = after_s

    async def chat(self, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        self.calls += 1
        self.timeouts.append(timeout)
        self._clock.advance(timeout if self._after_s is None else self._after_s)
        raise UpstreamTimeout("upstream chat timed out")


def pools_of(*upstreams: Upstream, clock: FakeClock, metrics: Metrics | None = None, **options: Any) -> ProviderPools:
    return ProviderPools(list(upstreams), retry=options.pop("retry", NO_WAIT), clock=clock, sleep=clock.skip,
                         observer=PoolMetrics(metrics) if metrics else None, **options)


def breaker_for(name: str, clock: FakeClock, **settings: Any) -> CircuitBreaker:
    return CircuitBreaker(name, BreakerSettings(**{"min_calls": 2, "open_s": 10.0, **settings}), clock=clock)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def settle() -> None:
    """Let started tasks run up to their next real wait (only the loop has to turn)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_least_in_flight_orders_by_load_per_weight_then_heavier_first() -> None:
    a, b, c = (Upstream(FakeProvider(n), weight=w) for n, w in (("a", 1), ("b", 2), ("c", 1)))
    a.in_flight, b.in_flight, c.in_flight = 2, 2, 0
    assert [u.name for u in order_upstreams([a, b, c], "least_in_flight")] == ["c", "b", "a"]
    c.in_flight = 1
    assert [u.name for u in order_upstreams([a, b, c], "least_in_flight")] == ["b", "c", "a"]


async def test_a_call_goes_to_the_upstream_with_fewer_calls_in_flight(fake_clock: FakeClock) -> None:
    gate = asyncio.Event()
    a, b = FakeProvider("a", gate=gate), FakeProvider("b")
    pools = pools_of(Upstream(a), Upstream(b), clock=fake_clock)
    held = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60))
    await settle()
    assert a.active == 1
    _, provider = await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert provider == "b"
    gate.set()
    assert (await held)[1] == "a"


async def test_smooth_weighted_round_robin_interleaves_by_weight(fake_clock: FakeClock) -> None:
    pools = pools_of(Upstream(FakeProvider("a"), weight=5), Upstream(FakeProvider("b")),
                     Upstream(FakeProvider("c")), clock=fake_clock, strategy="round_robin")
    order = [(await pools.chat("m", BODY, deadline=fake_clock() + 60))[1] for _ in range(14)]
    assert order == ["a", "a", "b", "a", "c", "a", "a"] * 2


async def test_a_retryable_error_fails_over_to_the_next_upstream_within_one_round(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    a, b = FakeProvider("a", [UpstreamHTTPError(500, "boom")]), FakeProvider("b")
    pools = pools_of(Upstream(a), Upstream(b), clock=fake_clock, metrics=metrics)
    reply, provider = await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert provider == "b" and reply["choices"][0]["message"]["content"] == "from b"
    assert (a.calls, b.calls) == (1, 1)
    assert sample(metrics, "mergebroker_retries_total", provider="a", reason="5xx") == 0


async def test_a_caller_fault_is_neither_failed_over_nor_retried(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    a, b = FakeProvider("a", [UpstreamHTTPError(400, "bad request")]), FakeProvider("b")
    pools = pools_of(Upstream(a), Upstream(b), clock=fake_clock, metrics=metrics)
    with pytest.raises(UpstreamHTTPError) as raised:
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert raised.value.status == 400 and raised.value.provider == "a"
    assert (a.calls, b.calls) == (1, 0)
    assert sample(metrics, "mergebroker_upstream_calls_total", provider="a", outcome="client_error") == 1


async def test_a_caller_fault_never_trips_the_breaker(fake_clock: FakeClock) -> None:
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(FakeProvider("a", [UpstreamHTTPError(422, "bad")] * 6), breaker=breaker),
                     clock=fake_clock)
    for _ in range(6):
        with pytest.raises(UpstreamHTTPError):
            await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert breaker.state is BreakerState.CLOSED and breaker.snapshot()["calls"] == 0


async def test_max_in_flight_caps_concurrent_calls_per_upstream(fake_clock: FakeClock) -> None:
    gate = asyncio.Event()
    provider = FakeProvider("a", gate=gate)
    upstream = Upstream(provider, max_in_flight=2)
    pools = pools_of(upstream, clock=fake_clock)
    calls = [asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60)) for _ in range(5)]
    await settle()
    assert (provider.active, upstream.in_flight) == (2, 2)
    gate.set()
    results = await asyncio.gather(*calls)
    assert [p for _, p in results] == ["a"] * 5
    assert provider.max_active == 2 and upstream.in_flight == 0


async def test_a_call_waiting_for_a_slot_gives_up_at_its_deadline(fake_clock: FakeClock) -> None:
    gate = asyncio.Event()
    provider = FakeProvider("a", gate=gate)
    upstream = Upstream(provider, max_in_flight=1)
    pools = pools_of(upstream, clock=fake_clock)
    held = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60))
    await settle()
    waiting = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 0.05))
    await settle()
    fake_clock.advance(0.05)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(waiting, 5)  # wait_for only keeps a regression from hanging
    assert provider.calls == 1
    gate.set()
    await held
    assert upstream.in_flight == 0


async def test_a_stream_holds_its_slot_until_it_is_consumed(fake_clock: FakeClock) -> None:
    upstream = Upstream(FakeProvider("a"), max_in_flight=1)
    pools = pools_of(upstream, clock=fake_clock)
    first, _ = await pools.stream_chat("m", BODY, deadline=fake_clock() + 60)
    second = asyncio.create_task(pools.stream_chat("m", BODY, deadline=fake_clock() + 60))
    await settle()
    assert not second.done() and upstream.in_flight == 1
    assert [chunk async for chunk in first] == [b"data: a\n\n", b"data: [DONE]\n\n"]
    stream, _ = await asyncio.wait_for(second, 5)
    await stream.aclose()
    assert upstream.in_flight == 0


async def test_a_stream_dropped_without_closing_gives_its_slot_back(fake_clock: FakeClock) -> None:
    upstream = Upstream(FakeProvider("a"), max_in_flight=1)
    pools = pools_of(upstream, clock=fake_clock)
    stream, _ = await pools.stream_chat("m", BODY, deadline=fake_clock() + 60)
    assert await stream.__anext__() == b"data: a\n\n"
    del stream  # a client that left mid-answer: nobody closes the stream
    gc.collect()
    assert upstream.in_flight == 0
    stream, _ = await asyncio.wait_for(pools.stream_chat("m", BODY, deadline=fake_clock() + 60), 5)
    await stream.aclose()


async def test_every_open_breaker_fails_at_once_with_seconds_until_the_first_probe(fake_clock: FakeClock) -> None:
    a, b = FakeProvider("a"), FakeProvider("b")
    pools = pools_of(Upstream(a, breaker=breaker_for("a", fake_clock)),
                     Upstream(b, breaker=breaker_for("b", fake_clock)), clock=fake_clock)
    pools.upstreams[0].breaker.force_open(fake_clock() + 7, {"cause": "test"})
    pools.upstreams[1].breaker.force_open(fake_clock() + 4, {"cause": "test"})
    assert pools.fast_fail_after("m") == 4
    with pytest.raises(UpstreamUnavailable) as raised:
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert raised.value.retry_after == 4 and raised.value.headers() == {"Retry-After": "4"}
    assert (a.calls, b.calls) == (0, 0)


async def test_an_open_breaker_is_skipped_in_favour_of_a_healthy_upstream(fake_clock: FakeClock) -> None:
    a, b = FakeProvider("a"), FakeProvider("b")
    pools = pools_of(Upstream(a, breaker=breaker_for("a", fake_clock)),
                     Upstream(b, breaker=breaker_for("b", fake_clock)), clock=fake_clock)
    pools.upstreams[0].breaker.force_open(fake_clock() + 10, {"cause": "test"})
    assert pools.fast_fail_after("m") is None
    assert (await pools.chat("m", BODY, deadline=fake_clock() + 60))[1] == "b"
    assert a.calls == 0


async def test_an_outage_trips_the_breaker_and_later_calls_fail_fast(fake_clock: FakeClock) -> None:
    provider = FakeProvider("a", [UpstreamHTTPError(503, "down")] * 10)
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(provider, breaker=breaker), clock=fake_clock)
    with pytest.raises(UpstreamUnavailable):  # two failed attempts trip it; the third round is refused
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert provider.calls == 2 and breaker.state is BreakerState.OPEN
    with pytest.raises(UpstreamUnavailable):
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert provider.calls == 2


async def test_a_busy_half_open_probe_refuses_other_calls_without_calling(fake_clock: FakeClock) -> None:
    gate = asyncio.Event()
    provider = FakeProvider("a", gate=gate)
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(provider, breaker=breaker), clock=fake_clock)
    breaker.force_open(fake_clock() + 10, {"cause": "test"})
    fake_clock.advance(10)
    probe = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60))
    await settle()
    with pytest.raises(UpstreamUnavailable) as raised:
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert raised.value.retry_after == 1.0 and provider.calls == 1
    gate.set()
    await probe
    assert breaker.state is BreakerState.CLOSED


async def test_cancelled_calls_neither_trip_the_breaker_nor_keep_their_slot(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    upstream = Upstream(FakeProvider("a", gate=asyncio.Event()), breaker=breaker_for("a", fake_clock),
                        max_in_flight=8)
    pools = pools_of(upstream, clock=fake_clock, metrics=metrics)
    calls = [asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60)) for _ in range(6)]
    await settle()
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert upstream.breaker.state is BreakerState.CLOSED and upstream.breaker.snapshot()["calls"] == 0
    assert upstream.in_flight == 0
    assert sample(metrics, "mergebroker_upstream_calls_total", provider="a", outcome="cancelled") == 6


async def test_calls_and_retries_are_counted_per_provider_and_reason(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    a = FakeProvider("a", [UpstreamHTTPError(500, "boom")])
    b = FakeProvider("b", [UpstreamHTTPError(429, "slow down")])
    pools = pools_of(Upstream(a), Upstream(b), clock=fake_clock, metrics=metrics)
    assert (await pools.chat("m", BODY, deadline=fake_clock() + 60))[1] == "a"
    calls = {(p, o): sample(metrics, "mergebroker_upstream_calls_total", provider=p, outcome=o)
             for p, o in (("a", "5xx"), ("b", "429"), ("a", "success"))}
    assert calls == {("a", "5xx"): 1, ("b", "429"): 1, ("a", "success"): 1}
    assert sample(metrics, "mergebroker_retries_total", provider="b", reason="429") == 1
    assert sample(metrics, "mergebroker_retries_total", provider="a", reason="5xx") == 0


async def test_stream_retries_are_counted_and_the_retry_streams(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    pools = pools_of(Upstream(FakeProvider("a", [UpstreamHTTPError(502, "bad gateway")])), clock=fake_clock,
                     metrics=metrics)
    stream, provider = await pools.stream_chat("m", BODY, deadline=fake_clock() + 60)
    assert provider == "a" and [c async for c in stream] == [b"data: a\n\n", b"data: [DONE]\n\n"]
    assert sample(metrics, "mergebroker_retries_total", provider="a", reason="5xx") == 1


async def test_retries_stop_with_the_last_error_when_attempts_run_out(fake_clock: FakeClock) -> None:
    provider = FakeProvider("a", [UpstreamHTTPError(503, "down")] * 3)
    pools = pools_of(Upstream(provider), clock=fake_clock)
    with pytest.raises(UpstreamError) as raised:
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert raised.value.upstream_status == 503 and provider.calls == 3


async def test_unused_estimated_tokens_are_given_back_after_a_reply(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(None, tpm=6000, clock=fake_clock)  # a bucket of 100 tokens, refilled by the clock
    pools = pools_of(Upstream(FakeProvider("a", usage_tokens=10), limiter=limiter), clock=fake_clock)
    await pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=100)
    # 90 of the 100 estimated tokens came back, so a 90-token call goes at once on a clock that stands still.
    await asyncio.wait_for(pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=90), 2)
    limiter.close()


async def test_usage_beyond_the_estimate_is_charged_to_the_upstream_budget(fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(None, tpm=6000, clock=fake_clock)
    pools = pools_of(Upstream(FakeProvider("a", usage_tokens=100), limiter=limiter), clock=fake_clock)
    await pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=10)
    waiting = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=1))
    await settle()
    assert limiter.waiting == 1  # the reply used the whole bucket, not just the 10 estimated
    fake_clock.advance(1)
    assert (await waiting)[1] == "a"
    limiter.close()


async def test_timeouts_set_by_callers_short_deadlines_never_open_the_breaker(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    provider = TimingOutProvider("a", fake_clock)
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(provider, breaker=breaker), clock=fake_clock, metrics=metrics)
    for _ in range(12):
        with pytest.raises(DeadlineExceeded):
            await pools.chat("m", BODY, deadline=fake_clock() + 0.05)
    assert provider.calls == 12 and provider.timeouts[0] == pytest.approx(0.05)
    assert breaker.state is BreakerState.CLOSED and breaker.snapshot()["calls"] == 0
    assert sample(metrics, "mergebroker_upstream_calls_total", provider="a", outcome="deadline") == 12


async def test_a_read_timeout_within_the_deadline_still_opens_the_breaker(fake_clock: FakeClock) -> None:
    provider = TimingOutProvider("a", fake_clock)
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(provider, breaker=breaker), clock=fake_clock)
    with pytest.raises(UpstreamUnavailable):  # two slow attempts trip it; the third round is refused
        await pools.chat("m", BODY, deadline=fake_clock() + 60)
    assert provider.timeouts[0] == pytest.approx(read_timeout_for(16, token_rate=50.0))
    assert breaker.state is BreakerState.OPEN


async def test_a_timeout_well_before_a_bounding_deadline_still_counts_against_the_breaker(
        fake_clock: FakeClock) -> None:
    provider = TimingOutProvider("a", fake_clock, after_s=1.0)  # e.g. the connect timeout of an unreachable host
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(provider, breaker=breaker), clock=fake_clock, retry=RetryPolicy(attempts=1))
    with pytest.raises(UpstreamTimeout):
        await pools.chat("m", BODY, deadline=fake_clock() + 3)  # under the 5.32 s read timeout
    assert breaker.snapshot()["calls"] == 1 and breaker.snapshot()["error_ratio"] == 1


async def test_the_read_timeout_is_the_shared_rule_applied_to_the_bodys_output_budget(fake_clock: FakeClock) -> None:
    provider = FakeProvider("a")
    pools = pools_of(Upstream(provider, token_rate=100.0), clock=fake_clock)
    bodies = [BODY, {**BODY, "max_tokens": None, "max_completion_tokens": 900}, {**BODY, "max_tokens": -5},
              {"model": "m", "messages": []}]
    for body in bodies:
        await pools.chat("m", body, deadline=fake_clock() + 600)
    assert provider.timeouts == [read_timeout_for(n, token_rate=100.0) for n in (16, 900, None, None)]


async def test_a_credentials_rejection_fails_over_and_counts_against_the_breaker(fake_clock: FakeClock) -> None:
    rejected = UpstreamHTTPError(401, "Incorrect API key provided: sk-...wxyz",
                                 body={"error": {"message": "Incorrect API key provided: sk-...wxyz",
                                                 "type": "invalid_request_error", "code": "invalid_api_key"}})
    a, b = FakeProvider("a", [rejected]), FakeProvider("b")
    breaker = breaker_for("a", fake_clock)
    pools = pools_of(Upstream(a, breaker=breaker), Upstream(b), clock=fake_clock)
    assert (await pools.chat("m", BODY, deadline=fake_clock() + 60))[1] == "b"
    assert breaker.snapshot()["calls"] == 1 and breaker.snapshot()["error_ratio"] == 1


async def test_a_caller_fault_gives_back_the_tokens_it_took_even_for_an_absurd_estimate(
        fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(None, tpm=6000, clock=fake_clock)  # a bucket of 100 tokens
    provider = FakeProvider("a", [UpstreamHTTPError(400, "max_tokens is too large")])
    pools = pools_of(Upstream(provider, limiter=limiter), clock=fake_clock)
    with pytest.raises(UpstreamHTTPError):
        await pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=10**12)
    # The clock stands still: the next call goes at once only if the rejected one left the bucket full.
    assert (await asyncio.wait_for(pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=100), 0.5))[1] == "a"
    limiter.close()


async def test_a_call_that_timed_out_waiting_for_a_slot_returns_its_request_and_tokens(
        fake_clock: FakeClock) -> None:
    limiter = UpstreamLimiter(rpm=120, tpm=6000, clock=fake_clock)  # a burst of 2 requests, 100 tokens
    gate = asyncio.Event()
    upstream = Upstream(FakeProvider("a", gate=gate), limiter=limiter, max_in_flight=1)
    pools = pools_of(upstream, clock=fake_clock)
    held = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=10))
    await settle()
    waiting = asyncio.create_task(pools.chat("m", BODY, deadline=fake_clock() + 0.05, tokens=90))
    await settle()
    fake_clock.advance(0.05)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(waiting, 5)
    gate.set()
    await held
    # One request and 90 tokens are left only if the timed-out call returned both.
    assert (await asyncio.wait_for(pools.chat("m", BODY, deadline=fake_clock() + 60, tokens=90), 0.5))[1] == "a"
    limiter.close()
