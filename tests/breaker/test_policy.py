"""The degradation policy pauses merging while a model's upstreams look unwell and fast-fails when all are open."""

from __future__ import annotations

import pytest

from mergebroker.breaker.circuit import BreakerSettings, BreakerState, CircuitBreaker
from mergebroker.breaker.policy import DegradationPolicy
from mergebroker.broker.engine.ground.metrics import Metrics, merging_listener
from mergebroker.clock import FakeClock
from mergebroker.errors import UpstreamHTTPError

SETTINGS = BreakerSettings()


async def record(breaker: CircuitBreaker, failures: int, successes: int = 0) -> None:
    for _ in range(successes):
        async with breaker.guard():
            pass
    for _ in range(failures):
        with pytest.raises(UpstreamHTTPError):
            async with breaker.guard():
                raise UpstreamHTTPError(502, "bad gateway")


@pytest.fixture
def breakers(fake_clock: FakeClock) -> dict[str, CircuitBreaker]:
    return {name: CircuitBreaker(name, SETTINGS, clock=fake_clock) for name in ("a", "b", "c")}


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def policy(breakers: dict[str, CircuitBreaker], metrics: Metrics) -> DegradationPolicy:
    return DegradationPolicy({"gpt-x": ["a", "b"], "*": ["c"]}, breakers, merging_listener(metrics))


def degraded_gauge(metrics: Metrics, model: str) -> float | None:
    return metrics.registry.get_sample_value("mergebroker_degraded", {"model": model})


def test_providers_for_lists_own_routes_then_wildcard_without_repeats(breakers: dict[str, CircuitBreaker]) -> None:
    policy = DegradationPolicy({"gpt-x": ["a", "c"], "*": ["c", "b"]}, breakers)
    assert policy.providers_for("gpt-x") == ["a", "c", "b"]
    assert policy.providers_for("other") == ["c", "b"]
    assert DegradationPolicy({"gpt-x": ["a"]}, breakers).providers_for("other") == []


async def test_merging_allowed_while_every_breaker_is_healthy(policy: DegradationPolicy, metrics: Metrics) -> None:
    assert policy.merging_allowed("gpt-x")
    assert degraded_gauge(metrics, "gpt-x") == 0


async def test_merging_paused_when_a_closed_breaker_is_degraded(policy: DegradationPolicy,
                                                                breakers: dict[str, CircuitBreaker],
                                                                metrics: Metrics) -> None:
    await record(breakers["b"], failures=1, successes=9)  # 10% errors: over 5%, not over 10%
    assert breakers["b"].state is BreakerState.CLOSED
    assert not policy.merging_allowed("gpt-x")
    assert degraded_gauge(metrics, "gpt-x") == 1


async def test_wildcard_provider_trouble_pauses_every_model(policy: DegradationPolicy,
                                                            breakers: dict[str, CircuitBreaker]) -> None:
    await record(breakers["c"], failures=10)
    assert not policy.merging_allowed("gpt-x")
    assert not policy.merging_allowed("any-model")


async def test_merging_paused_while_half_open_and_resumes_after_close(policy: DegradationPolicy,
                                                                      breakers: dict[str, CircuitBreaker],
                                                                      fake_clock: FakeClock,
                                                                      metrics: Metrics) -> None:
    await record(breakers["a"], failures=10)
    fake_clock.advance(SETTINGS.open_s)
    assert breakers["a"].state is BreakerState.HALF_OPEN
    assert not policy.merging_allowed("gpt-x")
    await record(breakers["a"], failures=0, successes=1)  # the probe succeeds
    assert policy.merging_allowed("gpt-x")
    assert degraded_gauge(metrics, "gpt-x") == 0


async def test_fast_fail_only_when_every_provider_is_open(policy: DegradationPolicy,
                                                          breakers: dict[str, CircuitBreaker],
                                                          fake_clock: FakeClock) -> None:
    await record(breakers["a"], failures=10)
    await record(breakers["b"], failures=10)
    assert policy.fast_fail_retry_after("gpt-x") is None  # c still serves it
    fake_clock.advance(3)
    await record(breakers["c"], failures=10)
    assert policy.fast_fail_retry_after("gpt-x") == pytest.approx(7.0)  # a and b probe first
    fake_clock.advance(6.95)
    assert policy.fast_fail_retry_after("gpt-x") == pytest.approx(0.1)  # never below 0.1
    fake_clock.advance(0.05)
    assert policy.fast_fail_retry_after("gpt-x") is None  # a and b are half-open now


def test_fast_fail_never_for_unknown_models_or_providers_without_breakers(breakers: dict[str, CircuitBreaker],
                                                                          fake_clock: FakeClock) -> None:
    breakers["a"].force_open(fake_clock() + 30, {"cause": "test"})
    policy = DegradationPolicy({"gpt-x": ["a", "unguarded"], "gpt-y": ["a"]}, breakers)
    assert policy.fast_fail_retry_after("gpt-x") is None
    assert policy.fast_fail_retry_after("unknown") is None
    assert policy.fast_fail_retry_after("gpt-y") is not None


async def test_glob_routes_pause_merging_for_the_models_they_match(breakers: dict[str, CircuitBreaker],
                                                                   metrics: Metrics) -> None:
    policy = DegradationPolicy({"sim-*": ["a"]}, breakers, merging_listener(metrics))
    assert policy.providers_for("sim-small") == ["a"]
    assert policy.providers_for("gpt-x") == []
    await record(breakers["a"], failures=3, successes=7)
    assert policy.merging_allowed("sim-small") is False
    assert policy.merging_allowed("gpt-x") is True


def test_the_degraded_gauge_keeps_one_series_per_known_model_and_one_for_the_rest(
        breakers: dict[str, CircuitBreaker]) -> None:
    metrics = Metrics(max_model_labels=3)
    policy = DegradationPolicy({"*": ["c"]}, breakers, merging_listener(metrics))
    for n in range(50):
        assert policy.merging_allowed(f"client-chosen-{n}")
    series = {s.labels["model"] for s in metrics.degraded.collect()[0].samples}
    assert series == {"client-chosen-0", "client-chosen-1", "client-chosen-2", "other"}
