"""The circuit breaker trips on error and slow ratios, probes in half-open, backs off, and reports transitions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from mergebroker.breaker.circuit import BreakerOpenError, BreakerSettings, BreakerState, CircuitBreaker
from mergebroker.broker.engine.ground.metrics import Metrics, breaker_listener
from mergebroker.clock import FakeClock
from mergebroker.errors import UpstreamConnectionError, UpstreamError, UpstreamHTTPError, UpstreamTimeout

SETTINGS = BreakerSettings()  # min_calls 10, error_ratio 0.10, slow 0.30 / 10 s, open 10 s x2 up to 120 s


class Recorder:
    """Collects on_transition calls."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, dict[str, Any]]] = []

    def __call__(self, provider: str, old: str, new: str, reason: dict[str, Any]) -> None:
        self.events.append((provider, old, new, reason))

    @property
    def moves(self) -> list[tuple[str, str]]:
        return [(old, new) for _, old, new, _ in self.events]


async def succeed(breaker: CircuitBreaker, clock: FakeClock | None = None, took: float = 0.0) -> None:
    async with breaker.guard():
        if clock is not None:
            clock.advance(took)


async def fail(breaker: CircuitBreaker, exc: BaseException | None = None) -> None:
    with pytest.raises(type(exc) if exc else UpstreamHTTPError):
        async with breaker.guard():
            raise exc or UpstreamHTTPError(500, "boom")


async def trip(breaker: CircuitBreaker) -> None:
    for _ in range(SETTINGS.min_calls):
        await fail(breaker)
    assert breaker.state is BreakerState.OPEN


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def breaker(fake_clock: FakeClock, recorder: Recorder) -> CircuitBreaker:
    return CircuitBreaker("alpha", SETTINGS, clock=fake_clock, on_transition=recorder)


async def test_failures_below_min_calls_never_open_it(breaker: CircuitBreaker) -> None:
    for _ in range(SETTINGS.min_calls - 1):
        await fail(breaker)
    assert breaker.state is BreakerState.CLOSED
    await succeed(breaker)  # the tenth call: 9 of 10 failed
    assert breaker.state is BreakerState.OPEN


async def test_error_ratio_at_threshold_stays_closed_and_above_it_opens(breaker: CircuitBreaker,
                                                                      recorder: Recorder) -> None:
    for _ in range(9):
        await succeed(breaker)
    await fail(breaker, UpstreamConnectionError("refused"))
    assert breaker.state is BreakerState.CLOSED  # 1 of 10 is not above 10%
    await fail(breaker, UpstreamHTTPError(429, "slow down"))
    assert breaker.state is BreakerState.OPEN  # 2 of 11
    provider, old, new, reason = recorder.events[-1]
    assert (provider, old, new) == ("alpha", "closed", "open")
    assert reason["cause"] == "error_ratio"
    assert reason["calls"] == 11 and reason["failures"] == 2
    assert reason["error_ratio"] == pytest.approx(2 / 11, abs=1e-3)
    assert reason["open_s"] == 10.0


async def test_slow_call_ratio_trips_it(fake_clock: FakeClock, recorder: Recorder) -> None:
    breaker = CircuitBreaker("alpha", BreakerSettings(slow_call_s=1.0), clock=fake_clock, on_transition=recorder)
    for _ in range(7):
        await succeed(breaker, fake_clock, took=0.5)
    for _ in range(3):
        await succeed(breaker, fake_clock, took=1.5)
    assert breaker.state is BreakerState.CLOSED  # 3 of 10 slow is not above 30%
    await succeed(breaker, fake_clock, took=1.5)
    assert breaker.state is BreakerState.OPEN
    reason = recorder.events[-1][3]
    assert reason["cause"] == "slow_ratio" and reason["slow"] == 4 and reason["failures"] == 0


async def test_timeouts_count_as_slow_calls(fake_clock: FakeClock, recorder: Recorder) -> None:
    never_on_errors = BreakerSettings(error_ratio=1.0)
    breaker = CircuitBreaker("alpha", never_on_errors, clock=fake_clock, on_transition=recorder)
    for _ in range(7):
        await succeed(breaker)
    for _ in range(4):
        await fail(breaker, UpstreamTimeout("no answer"))
    assert breaker.state is BreakerState.OPEN
    assert recorder.events[-1][3]["cause"] == "slow_ratio"


async def test_open_breaker_refuses_with_retry_after_then_half_opens_after_open_s(
        breaker: CircuitBreaker, fake_clock: FakeClock, recorder: Recorder) -> None:
    await trip(breaker)
    fake_clock.advance(4)
    with pytest.raises(BreakerOpenError) as refused:
        async with breaker.guard():
            pytest.fail("an open breaker must not run the call")
    assert refused.value.retry_after == pytest.approx(6.0)
    assert refused.value.retryable and isinstance(refused.value, UpstreamError)
    assert breaker.seconds_until_probe() == pytest.approx(6.0)
    fake_clock.advance(6)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.seconds_until_probe() == 0.0
    assert recorder.moves[-1] == ("open", "half-open")
    assert recorder.events[-1][3]["cause"] == "open_elapsed"


async def test_half_open_admits_one_probe_and_refuses_concurrent_callers(
        breaker: CircuitBreaker, fake_clock: FakeClock) -> None:
    await trip(breaker)
    fake_clock.advance(SETTINGS.open_s)
    release = asyncio.Event()
    entered = asyncio.Event()

    async def probe() -> None:
        async with breaker.guard():
            entered.set()
            await release.wait()

    probe_task = asyncio.create_task(probe())
    await entered.wait()
    with pytest.raises(BreakerOpenError):
        breaker.before_call()
    with pytest.raises(BreakerOpenError):
        async with breaker.guard():
            pytest.fail("a second probe must not run")
    release.set()
    await probe_task
    assert breaker.state is BreakerState.CLOSED


async def test_probe_success_closes_and_resets_the_window(breaker: CircuitBreaker, fake_clock: FakeClock,
                                                          recorder: Recorder) -> None:
    await trip(breaker)
    fake_clock.advance(SETTINGS.open_s)
    await succeed(breaker)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot()["calls"] == 0
    assert recorder.events[-1][1:3] == ("half-open", "closed")
    assert recorder.events[-1][3]["cause"] == "probe_succeeded"
    await fail(breaker)  # one failure in a fresh window does not re-open it
    assert breaker.state is BreakerState.CLOSED


async def test_probe_failure_reopens_with_backoff_capped_and_closing_resets_it(
        breaker: CircuitBreaker, fake_clock: FakeClock, recorder: Recorder) -> None:
    await trip(breaker)
    expected = [20.0, 40.0, 80.0, 120.0, 120.0]
    open_s = SETTINGS.open_s
    for want in expected:
        fake_clock.advance(open_s)
        await fail(breaker)  # the probe fails
        assert breaker.state is BreakerState.OPEN
        assert breaker.seconds_until_probe() == pytest.approx(want)
        assert recorder.events[-1][1:3] == ("half-open", "open")
        assert recorder.events[-1][3]["cause"] == "probe_failed"
        open_s = want
    fake_clock.advance(open_s)
    await succeed(breaker)
    await trip(breaker)
    assert breaker.seconds_until_probe() == pytest.approx(SETTINGS.open_s)


async def test_slow_probe_counts_as_failed(breaker: CircuitBreaker, fake_clock: FakeClock) -> None:
    await trip(breaker)
    fake_clock.advance(SETTINGS.open_s)
    await succeed(breaker, fake_clock, took=SETTINGS.slow_call_s + 1)
    assert breaker.state is BreakerState.OPEN


async def test_cancellation_and_caller_faults_neither_trip_nor_reset_counts(breaker: CircuitBreaker) -> None:
    for _ in range(5):
        await fail(breaker)
    for status in (400, 404, 413, 422):
        await fail(breaker, UpstreamHTTPError(status, "your fault"))
    await fail(breaker, ValueError("a bug of ours, not the upstream's"))
    gate = asyncio.Event()

    async def waits() -> None:
        async with breaker.guard():
            await gate.wait()

    for _ in range(3):
        task = asyncio.create_task(waits())
        await asyncio.sleep(0)  # let the task enter the guard
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    snapshot = breaker.snapshot()
    assert (snapshot["state"], snapshot["calls"], snapshot["error_ratio"]) == ("closed", 5, 1.0)
    for _ in range(5):
        await fail(breaker)
    assert breaker.state is BreakerState.OPEN  # the first five still counted


async def test_cancelled_probe_frees_its_slot_and_stays_half_open(breaker: CircuitBreaker,
                                                                  fake_clock: FakeClock) -> None:
    await trip(breaker)
    fake_clock.advance(SETTINGS.open_s)
    entered = asyncio.Event()

    async def probe() -> None:
        async with breaker.guard():
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(probe())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.state is BreakerState.HALF_OPEN
    await succeed(breaker)  # the slot is free again
    assert breaker.state is BreakerState.CLOSED


async def test_outcome_of_a_call_admitted_before_a_transition_is_ignored(breaker: CircuitBreaker,
                                                                         fake_clock: FakeClock) -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def slow_failure() -> None:
        async with breaker.guard():
            entered.set()
            await gate.wait()
            raise UpstreamHTTPError(503, "late")

    task = asyncio.create_task(slow_failure())
    await entered.wait()
    await trip(breaker)
    fake_clock.advance(SETTINGS.open_s)
    assert breaker.state is BreakerState.HALF_OPEN
    gate.set()
    with pytest.raises(UpstreamHTTPError):
        await task
    assert breaker.state is BreakerState.HALF_OPEN  # the stale failure was not taken for a probe


async def test_degraded_above_lower_watermark_with_half_min_calls(breaker: CircuitBreaker,
                                                                  fake_clock: FakeClock) -> None:
    await fail(breaker)
    for _ in range(3):
        await succeed(breaker)
    assert not breaker.degraded  # 4 calls: fewer than min_calls // 2
    await succeed(breaker)
    assert breaker.degraded  # 1 of 5 failed, above 5%
    assert breaker.state is BreakerState.CLOSED
    fake_clock.advance(SETTINGS.window_s)
    assert not breaker.degraded  # the failure left the window


async def test_degraded_while_half_open_or_open(breaker: CircuitBreaker, fake_clock: FakeClock) -> None:
    await trip(breaker)
    assert breaker.degraded
    fake_clock.advance(SETTINGS.open_s)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.degraded


async def test_transitions_are_logged_with_reason(breaker: CircuitBreaker) -> None:
    with capture_logs() as logs:
        await trip(breaker)
    transitions = [e for e in logs if e["event"] == "breaker_transition"]
    assert len(transitions) == 1
    entry = transitions[0]
    assert (entry["provider"], entry["from_state"], entry["to_state"]) == ("alpha", "closed", "open")
    assert entry["reason"]["cause"] == "error_ratio" and entry["log_level"] == "warning"


async def test_metrics_follow_state_and_count_transitions(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    breaker = CircuitBreaker("beta", SETTINGS, clock=fake_clock, on_transition=breaker_listener(metrics, "beta"))

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("mergebroker_breaker_state", {"provider": "beta"})

    def count(to: str) -> float | None:
        return metrics.registry.get_sample_value("mergebroker_breaker_transitions_total",
                                                 {"provider": "beta", "to": to})

    assert gauge() == 0
    await trip(breaker)
    assert gauge() == 2 and count("open") == 1
    fake_clock.advance(SETTINGS.open_s)
    assert breaker.state is BreakerState.HALF_OPEN
    assert gauge() == 1 and count("half-open") == 1
    await succeed(breaker)
    assert gauge() == 0 and count("closed") == 1


async def test_force_open_opens_until_the_given_time_and_only_extends_an_open_breaker(
        breaker: CircuitBreaker, fake_clock: FakeClock, recorder: Recorder) -> None:
    breaker.force_open(fake_clock() + 30, {"cause": "shared", "origin": "r2"})
    assert breaker.state is BreakerState.OPEN
    assert breaker.seconds_until_probe() == pytest.approx(30)
    assert recorder.events[-1][3] == {"cause": "shared", "origin": "r2", "open_s": 30.0}
    breaker.force_open(fake_clock() + 5, {"cause": "shared"})
    assert breaker.seconds_until_probe() == pytest.approx(30)
    breaker.force_open(fake_clock() + 45, {"cause": "shared"})
    assert breaker.seconds_until_probe() == pytest.approx(45)
    assert len(recorder.events) == 1
    breaker.force_open(fake_clock() - 1, {"cause": "shared"})  # already past: nothing to do
    assert len(recorder.events) == 1


async def test_failing_transition_listener_does_not_break_the_breaker(fake_clock: FakeClock) -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("listener bug")

    breaker = CircuitBreaker("gamma", SETTINGS, clock=fake_clock, on_transition=broken)
    await trip(breaker)
    assert breaker.snapshot()["state"] == "open"
