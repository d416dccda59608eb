"""Retries of upstream calls stay within attempts, Retry-After and the caller's deadline, and raise the real error."""

from __future__ import annotations

import asyncio
import email.utils
import random

import pytest

from mergebroker.clock import FakeClock
from mergebroker.errors import (
    DeadlineExceeded,
    UpstreamBadResponse,
    UpstreamConnectionError,
    UpstreamHTTPError,
    UpstreamTimeout,
)
from mergebroker.providers.retry import RetryPolicy, call_with_retries, parse_retry_after, remaining, retry_reason


class Script:
    """An upstream call that raises the scripted errors in turn, then returns "ok"; records call times."""

    def __init__(self, clock: FakeClock, *errors: BaseException) -> None:
        self.clock = clock
        self.errors = list(errors)
        self.calls: list[float] = []

    async def __call__(self) -> str:
        self.calls.append(self.clock())
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


class RecordingSleep:
    """FakeClock.skip (time passes at once) that also records each requested wait."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(float(seconds))
        await self.clock.skip(seconds)


def http(status: int, retry_after: float | None = None) -> UpstreamHTTPError:
    return UpstreamHTTPError(status, f"upstream said {status}", retry_after=retry_after)


async def run(script: Script, clock: FakeClock, sleep: RecordingSleep, *, policy: RetryPolicy = RetryPolicy(),
              budget: float = 60.0, on_retry=None) -> str:
    return await call_with_retries(script, policy=policy, deadline=clock() + budget, clock=clock, sleep=sleep,
                                   on_retry=on_retry)


async def test_succeeds_after_two_503s(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock, http(503), http(503)), RecordingSleep(fake_clock)
    assert await run(script, fake_clock, sleep) == "ok"
    assert len(script.calls) == 3
    assert len(sleep.waits) == 2


async def test_wait_honours_retry_after_when_longer_than_backoff(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock, http(429, retry_after=2.5), http(503, retry_after=1.0)), RecordingSleep(fake_clock)
    assert await run(script, fake_clock, sleep) == "ok"
    assert sleep.waits[0] >= 2.5 and sleep.waits[1] >= 1.0
    assert script.calls[1] - script.calls[0] >= 2.5


async def test_caller_fault_400_is_raised_at_once_without_retry(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock, http(400)), RecordingSleep(fake_clock)
    with pytest.raises(UpstreamHTTPError) as info:
        await run(script, fake_clock, sleep)
    assert info.value.upstream_status == 400
    assert len(script.calls) == 1 and sleep.waits == []


async def test_cancellation_is_not_retried(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock, asyncio.CancelledError()), RecordingSleep(fake_clock)
    with pytest.raises(asyncio.CancelledError):
        await run(script, fake_clock, sleep)
    assert len(script.calls) == 1


async def test_retry_after_past_the_deadline_raises_the_429_itself_at_once(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock, http(429, retry_after=10.0)), RecordingSleep(fake_clock)
    with pytest.raises(UpstreamHTTPError) as info:
        await run(script, fake_clock, sleep, budget=5.0)
    assert info.value.upstream_status == 429 and info.value.retry_after == 10.0
    assert len(script.calls) == 1 and sleep.waits == []


async def test_retry_after_beyond_policy_limit_is_not_waited_for(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock, http(429, retry_after=45.0)), RecordingSleep(fake_clock)
    with pytest.raises(UpstreamHTTPError):
        await run(script, fake_clock, sleep, policy=RetryPolicy(max_retry_after_s=30.0), budget=600.0)
    assert len(script.calls) == 1 and sleep.waits == []


async def test_attempts_bound_raises_the_last_original_error(fake_clock: FakeClock) -> None:
    errors = [UpstreamTimeout("t1"), UpstreamConnectionError("c2"), UpstreamBadResponse("b3"), http(503)]
    script, sleep = Script(fake_clock, *errors), RecordingSleep(fake_clock)
    with pytest.raises(UpstreamBadResponse, match="b3"):
        await run(script, fake_clock, sleep, policy=RetryPolicy(attempts=3))
    assert len(script.calls) == 3 and len(sleep.waits) == 2


async def test_passed_deadline_raises_deadline_exceeded_without_calling(fake_clock: FakeClock) -> None:
    script, sleep = Script(fake_clock), RecordingSleep(fake_clock)
    with pytest.raises(DeadlineExceeded):
        await run(script, fake_clock, sleep, budget=0.0)
    assert script.calls == []


async def test_jittered_backoff_stays_within_zero_and_the_exponential_cap(fake_clock: FakeClock) -> None:
    random.seed(7)
    policy = RetryPolicy(attempts=6, backoff_base_s=0.1, backoff_max_s=0.5)
    caps = [min(0.5, 0.1 * 2 ** n) for n in range(5)]
    samples: list[list[float]] = []
    for _ in range(40):
        script, sleep = Script(fake_clock, *[http(502) for _ in range(5)]), RecordingSleep(fake_clock)
        assert await run(script, fake_clock, sleep, policy=policy) == "ok"
        assert all(0.0 <= w <= cap for w, cap in zip(sleep.waits, caps, strict=True))
        samples.append(sleep.waits)
    # Jitter, not a fixed schedule: the first waits differ between calls.
    assert len({round(s[0], 6) for s in samples}) > 10


async def test_on_retry_reports_each_error_and_wait(fake_clock: FakeClock) -> None:
    seen: list[tuple[str, float]] = []
    script, sleep = Script(fake_clock, http(429, retry_after=1.0), UpstreamTimeout("slow")), RecordingSleep(fake_clock)
    await run(script, fake_clock, sleep, on_retry=lambda exc, wait: seen.append((retry_reason(exc), wait)))
    assert [reason for reason, _ in seen] == ["429", "timeout"]
    assert [wait for _, wait in seen] == sleep.waits


def test_retry_reason_labels_each_retryable_kind() -> None:
    assert retry_reason(http(429)) == "429"
    assert retry_reason(http(500)) == "5xx"
    assert retry_reason(UpstreamTimeout("x")) == "timeout"
    assert retry_reason(UpstreamConnectionError("x")) == "connection"
    assert retry_reason(UpstreamBadResponse("x")) == "bad_response"


def test_remaining_counts_down_on_the_clock_and_never_goes_negative(fake_clock: FakeClock) -> None:
    deadline = fake_clock() + 3.0
    fake_clock.advance(1.0)
    assert remaining(deadline, fake_clock) == pytest.approx(2.0)
    fake_clock.advance(5.0)
    assert remaining(deadline, fake_clock) == 0.0


def test_parse_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30.0)
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
