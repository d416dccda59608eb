"""Retries of one upstream call: tenacity strategies bounded by attempts, Retry-After and the caller's deadline.

Only `UpstreamError`s whose `.retryable` is true are retried (429, 5xx, timeouts, dropped connections,
unusable 2xx bodies); a caller-fault 4xx or a cancellation ends the call at once. The wait before the
next attempt is full-jitter exponential backoff, raised to the upstream's Retry-After when it sent one.
If that wait would end at or after the caller's deadline, we stop at once and raise the last error, so
the caller gets the upstream's 429 (with its Retry-After) now instead of a 504 later.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.stop import stop_base
from tenacity.wait import wait_base, wait_random_exponential

from mergebroker.clock import Clock, Sleep
from mergebroker.errors import (
    DeadlineExceeded,
    UpstreamBadResponse,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamTimeout,
)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry one upstream call.

    `attempts` counts the first try. Backoff before retry n (n = 1, 2, ...) is uniform in
    [0, min(backoff_max_s, backoff_base_s * 2**(n-1))]. A Retry-After longer than `max_retry_after_s`
    ends the retries at once: waiting less than the upstream asked for would only earn another 429.
    """

    attempts: int = 3
    backoff_base_s: float = 0.1
    backoff_max_s: float = 5.0
    max_retry_after_s: float = 30.0


def remaining(deadline: float, clock: Clock) -> float:
    """Seconds left until `deadline` (absolute, on `clock`), never negative; use it as each attempt's timeout."""
    return max(0.0, deadline - clock())


def is_retryable(exc: BaseException) -> bool:
    """True for upstream failures that another attempt may fix."""
    return isinstance(exc, UpstreamError) and exc.retryable


def retry_reason(exc: BaseException) -> str:
    """The `reason` label of `mergebroker_retries_total`: 429, 5xx, auth, timeout, connection, bad_response, other."""
    if isinstance(exc, UpstreamHTTPError):
        if exc.upstream_status == 429:
            return "429"
        if exc.upstream_status in (401, 403, 407):
            return "auth"
        return "timeout" if exc.upstream_status == 408 else "5xx"
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    if isinstance(exc, UpstreamConnectionError):
        return "connection"
    if isinstance(exc, UpstreamBadResponse):
        return "bad_response"
    return "other"


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP-date; None if absent or unparsable.

    `now` is wall-clock Unix time (HTTP-dates are wall-clock, so the monotonic clock cannot serve here);
    it defaults to `time.time()`. A date in the past gives 0.
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT; obsolete forms may parse naive
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return None
    return max(0.0, seconds)


def _retry_after_of(retry_state: RetryCallState) -> float | None:
    exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
    return getattr(exc, "retry_after", None)


class _wait_backoff_or_retry_after(wait_base):
    """Jittered exponential backoff, but never shorter than the upstream's Retry-After."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._backoff = wait_random_exponential(multiplier=policy.backoff_base_s, max=policy.backoff_max_s)

    def __call__(self, retry_state: RetryCallState) -> float:
        backoff = self._backoff(retry_state)
        retry_after = _retry_after_of(retry_state)
        return backoff if retry_after is None else max(backoff, retry_after)


class _stop_before_deadline(stop_base):
    """Stop when the coming wait would end at or after the deadline (tenacity computes the wait first)."""

    def __init__(self, deadline: float, clock: Clock) -> None:
        self._deadline = deadline
        self._clock = clock

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._clock() + retry_state.upcoming_sleep >= self._deadline


class _stop_on_long_retry_after(stop_base):
    """Stop when the upstream asks us to stay away longer than the policy is willing to wait."""

    def __init__(self, limit_s: float) -> None:
        self._limit_s = limit_s

    def __call__(self, retry_state: RetryCallState) -> bool:
        retry_after = _retry_after_of(retry_state)
        return retry_after is not None and retry_after > self._limit_s


async def call_with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    deadline: float,
    clock: Clock,
    sleep: Sleep,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> T:
    """Await `fn()` until it succeeds, retrying retryable upstream errors within `policy` and `deadline`.

    `deadline` is absolute on `clock`; `fn` must bound its own attempt (e.g. with
    `timeout=remaining(deadline, clock)`). `on_retry(exc, wait_s)` runs before each wait, e.g. to count
    retries by `retry_reason(exc)`. Raises the last original exception, never tenacity's RetryError;
    raises `DeadlineExceeded` without calling `fn` if the deadline has already passed.
    """
    if remaining(deadline, clock) <= 0:
        raise DeadlineExceeded("request deadline passed before the upstream call")
    # The first attempt runs outside tenacity: most calls succeed at once, and building its machinery
    # for every call costs more than the call's own bookkeeping. Only a retryable failure enters it.
    try:
        return await fn()
    except BaseException as exc:
        if not is_retryable(exc) or policy.attempts <= 1:
            raise
        first_failure: BaseException | None = exc

    async def attempt() -> T:
        # Tenacity's first attempt replays the failure we already have, so every decision after it
        # (wait, stop, on_retry) is the one it would have taken had it made that call itself.
        nonlocal first_failure
        if first_failure is not None:
            failure, first_failure = first_failure, None
            raise failure
        return await fn()

    # The `async for` form, not `await retrying(fn)`: tenacity only awaits `fn` when it is a coroutine
    # function, and callers pass lambdas returning coroutines.
    async for attempt_state in _retrying(policy, deadline, clock, sleep, on_retry):
        with attempt_state:
            return await attempt()
    raise AssertionError("unreachable: tenacity returns or raises the last error")


def _retrying(policy: RetryPolicy, deadline: float, clock: Clock, sleep: Sleep,
              on_retry: Callable[[BaseException, float], None] | None) -> AsyncRetrying:
    """Tenacity's loop for `policy`: retryable errors only, backoff or Retry-After, three stop rules."""

    def before_sleep(retry_state: RetryCallState) -> None:
        if on_retry is not None and retry_state.outcome is not None:
            # `retry_if_exception`: only a failed attempt is retried, so its outcome holds an exception.
            on_retry(cast(BaseException, retry_state.outcome.exception()), retry_state.upcoming_sleep)

    return AsyncRetrying(
        sleep=sleep,
        retry=retry_if_exception(is_retryable),
        wait=_wait_backoff_or_retry_after(policy),
        stop=(stop_after_attempt(policy.attempts) | _stop_on_long_retry_after(policy.max_retry_after_s)
              | _stop_before_deadline(deadline, clock)),
        before_sleep=before_sleep,
        reraise=True,
    )
