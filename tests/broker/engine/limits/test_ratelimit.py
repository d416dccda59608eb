"""Local token buckets refill exactly, and the admission limiter reserves all-or-nothing with OpenAI headers."""

from __future__ import annotations

import math

import pytest

from mergebroker.broker.engine.limits.ratelimit import LimitSpec, RateLimiter, TokenBucket, format_duration
from mergebroker.clock import FakeClock
from mergebroker.errors import RateLimited

TIER = LimitSpec("tier:standard", rpm=5, tpm=1000)
KEY = LimitSpec("key:ab12cd", rpm=60, tpm=600)


def test_bucket_refills_at_its_rate_up_to_capacity(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(60, 1.0, fake_clock)
    assert bucket.try_take(60)
    assert not bucket.try_take(1)
    fake_clock.advance(1.5)
    assert bucket.available() == pytest.approx(1.5)
    assert bucket.seconds_until(4) == pytest.approx(2.5)
    fake_clock.advance(1000)
    assert bucket.available() == 60


def test_bucket_failed_take_takes_nothing_and_too_big_never_fits(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(10, 2.0, fake_clock)
    assert bucket.try_take(7)
    assert not bucket.try_take(4)
    assert bucket.available() == pytest.approx(3)
    assert bucket.seconds_until(11) == math.inf


def test_bucket_give_back_never_exceeds_capacity(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(10, 1.0, fake_clock)
    bucket.try_take(3)
    bucket.give_back(100)
    assert bucket.available() == 10


def test_per_minute_bucket_frees_one_request_every_sixtieth_of_the_limit(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(5, 5 / 60, fake_clock)
    for _ in range(5):
        assert bucket.try_take(1)
    assert bucket.seconds_until(1) == pytest.approx(12.0)
    fake_clock.advance(11.9)
    assert not bucket.try_take(1)
    fake_clock.advance(0.1)
    assert bucket.try_take(1)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (0.02, "20ms"), (1, "1s"), (1.5, "1.5s"), (12, "12s"),
                                           (360, "6m0s"), (83.25, "1m23.25s"), (3723, "1h2m3s")])
def test_durations_use_openais_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


async def test_success_reports_headers_of_the_tightest_limits(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    reservation = await limiter.reserve([TIER, KEY], tokens=100)
    assert reservation.headers() == {
        "x-ratelimit-limit-requests": "5",       # tier: 4 left of 5 beats key: 59 left of 60
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "12s",
        "x-ratelimit-limit-tokens": "600",       # key: 500 left beats tier: 900 left
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "10s",
    }


async def test_sixth_request_in_a_minute_gets_429_with_retry_after(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    for _ in range(5):
        await limiter.reserve([TIER], tokens=10)
    fake_clock.advance(3)
    with pytest.raises(RateLimited) as caught:
        await limiter.reserve([TIER], tokens=10)
    exc = caught.value
    assert exc.status == 429
    assert exc.retry_after == pytest.approx(9.0)
    assert exc.headers() == {"Retry-After": "9"}
    assert "requests per minute on tier standard" in exc.message
    assert exc.extra_headers["x-ratelimit-remaining-requests"] == "0"
    assert exc.extra_headers["x-ratelimit-limit-requests"] == "5"
    fake_clock.advance(9)
    await limiter.reserve([TIER], tokens=10)


async def test_refusal_by_one_bucket_takes_nothing_from_the_others(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    tier = LimitSpec("tier:standard", rpm=100, tpm=1000)
    key = LimitSpec("key:ab12cd", rpm=100, tpm=300)
    await limiter.reserve([tier, key], tokens=250)
    with pytest.raises(RateLimited) as caught:
        await limiter.reserve([tier, key], tokens=100)  # the key's token bucket holds only 50
    assert "tokens per minute on key ab12cd" in caught.value.message
    assert caught.value.retry_after == pytest.approx(10.0)  # 50 more tokens at 5 per second
    ok = await limiter.reserve([tier], tokens=0)
    assert ok.headers()["x-ratelimit-remaining-requests"] == "98"  # only the two that succeeded
    assert ok.headers()["x-ratelimit-remaining-tokens"] == "750"


async def test_retry_after_is_the_longest_wait_among_exhausted_buckets(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    rpm_spec = LimitSpec("tier:free", rpm=1, tpm=None)         # next request in 60 s
    tpm_spec = LimitSpec("key:ff00", rpm=None, tpm=600)        # 100 tokens back in 10 s
    await limiter.reserve([rpm_spec, tpm_spec], tokens=600)
    with pytest.raises(RateLimited) as caught:
        await limiter.reserve([rpm_spec, tpm_spec], tokens=100)
    assert caught.value.retry_after == pytest.approx(60.0)
    assert "requests per minute on tier free" in caught.value.message


async def test_request_larger_than_the_limit_is_refused_without_retry_after(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    with pytest.raises(RateLimited) as caught:
        await limiter.reserve([TIER], tokens=5000)
    assert caught.value.retry_after is None
    assert caught.value.message.startswith("Request too large for tokens per minute on tier standard")


async def test_settle_gives_back_unused_tokens_once(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    spec = LimitSpec("tier:standard", rpm=None, tpm=1000)
    reservation = await limiter.reserve([spec], tokens=800)
    await reservation.settle(100)
    await reservation.settle(100)
    after = await limiter.reserve([spec], tokens=0)
    assert after.headers()["x-ratelimit-remaining-tokens"] == "900"


async def test_settle_takes_the_excess_without_failing(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    spec = LimitSpec("tier:standard", rpm=None, tpm=1000)
    reservation = await limiter.reserve([spec], tokens=100)
    await reservation.settle(1300)  # used more than the whole budget: the bucket goes into debt
    with pytest.raises(RateLimited) as caught:
        await limiter.reserve([spec], tokens=1)
    assert caught.value.retry_after == pytest.approx(301 / (1000 / 60))


async def test_unlimited_specs_produce_no_headers_and_never_refuse(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    unlimited = [LimitSpec("tier:enterprise", rpm=None, tpm=None)]
    for _ in range(1000):
        reservation = await limiter.reserve(unlimited, tokens=10**6)
        assert reservation.headers() == {}
    await reservation.settle(0)


async def test_only_headers_of_existing_limits_are_sent(fake_clock: FakeClock) -> None:
    limiter = RateLimiter(fake_clock)
    reservation = await limiter.reserve([LimitSpec("tier:standard", rpm=10, tpm=None)], tokens=50)
    assert set(reservation.headers()) == {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                          "x-ratelimit-reset-requests"}


def test_limits_must_be_positive_or_none() -> None:
    with pytest.raises(ValueError):
        LimitSpec("tier:x", rpm=0, tpm=None)
