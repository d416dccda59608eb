"""One circuit breaker per upstream provider: an asyncio wrapper over pybreaker's state machine.

pybreaker holds the state (its storage) and tells its listeners about every change; this module decides
when to change it, through pybreaker's state API (`open()`, `half_open()`, `close()`). We never use
pybreaker's call path: it is synchronous (an `async def` looks like an instant success), judges the open
timeout with wall time, counts `CancelledError` as a failure and admits every caller while half-open.
Instead `guard()` awaits the call itself, classifies the outcome, feeds a `SlidingWindow`, and trips on
ratios over the window (`trip_reason`), with half-open probes limited here and open time judged by the
injected clock. A call is slow when it took longer than expected for its output: `slow_call_s` plus the
allowance its caller sets on the guard (its output tokens at the provider's token rate). Each call is
recorded for the tenant it was made for, and `breaker.blame` decides whether a window over its
threshold opens the breaker for everyone or only refuses the one tenant whose calls fail.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pybreaker
import structlog

from mergebroker.breaker.blame import judge
from mergebroker.breaker.window import Outcome, SlidingWindow, WindowStats
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import UpstreamError, UpstreamTimeout

log = structlog.get_logger(__name__)

TransitionCallback = Callable[[str, str, str, dict[str, Any]], None]
"""`(provider, from_state, to_state, reason)`, called synchronously on every state change."""

# A refused caller while a probe is in flight: the probe usually answers within this long.
PROBE_BUSY_RETRY_S = 1.0


class BreakerState(enum.Enum):
    """A breaker's state; values are pybreaker's state names."""

    CLOSED = pybreaker.STATE_CLOSED
    HALF_OPEN = pybreaker.STATE_HALF_OPEN
    OPEN = pybreaker.STATE_OPEN


_BY_NAME = {s.value: s for s in BreakerState}  # a dict lookup: calling the Enum class costs more, on every call

STATE_LEVEL = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
"""The value of the `breaker_state` gauge for each state."""


class BreakerOpenError(UpstreamError):
    """The provider's breaker refused the call; retryable, so a pool fails over to another provider."""

    status, type, code = 503, "service_unavailable", "breaker_open"
    retryable = True

    def __init__(self, retry_after: float, provider: str = "") -> None:
        super().__init__(f"circuit breaker open for provider {provider!r}", retry_after=retry_after)
        self.provider = provider


@dataclass(frozen=True)
class BreakerSettings:
    """When a breaker trips, how long it stays open, and when merging pauses (the lower watermark)."""

    window_s: float = 30.0
    min_calls: int = 10
    error_ratio: float = 0.10
    slow_ratio: float = 0.30
    slow_call_s: float = 10.0
    open_s: float = 10.0
    open_backoff: float = 2.0
    open_max_s: float = 120.0
    half_open_probes: int = 1
    degrade_error_ratio: float = 0.05


def classify(exc: BaseException | None, elapsed_s: float, slow_call_s: float) -> Outcome | None:
    """The outcome of one call for the breaker, or None when it says nothing about the upstream's health.

    Neither success nor failure: cancellation (the caller gave up), caller-fault 4xx and other
    non-retryable upstream errors, and exceptions that are not upstream errors (our own bugs).
    """
    if exc is None:
        return Outcome.SLOW if elapsed_s > slow_call_s else Outcome.SUCCESS
    if isinstance(exc, UpstreamTimeout):
        return Outcome.TIMEOUT
    if isinstance(exc, UpstreamError) and exc.retryable:
        return Outcome.FAILURE
    return None


def trip_reason(stats: WindowStats, settings: BreakerSettings) -> dict[str, Any] | None:
    """Why a closed breaker must open now, or None: a ratio over its threshold with enough calls."""
    if stats.calls < settings.min_calls:
        return None
    if stats.error_ratio > settings.error_ratio:
        cause = "error_ratio"
    elif stats.slow_ratio > settings.slow_ratio:
        cause = "slow_ratio"
    else:
        return None
    return {"cause": cause, "error_ratio": round(stats.error_ratio, 4), "slow_ratio": round(stats.slow_ratio, 4),
            "calls": stats.calls, "failures": stats.failures, "slow": stats.slow}


def next_open_s(current_s: float, settings: BreakerSettings) -> float:
    """How long to stay open after a failed probe: the last open time times the backoff, capped."""
    return min(current_s * settings.open_backoff, settings.open_max_s)


@dataclass(slots=True)
class _Ticket:
    """An admitted call: the state epoch it was admitted in, whether it holds a probe slot, its tenant."""

    epoch: int
    probe: bool
    tenant: str | None = None


@dataclass
class GuardedCall:
    """What `guard()` yields: the body sets `allowance_s` once it knows the output it got (slow threshold), or
    `allowance`, which works it out only for a call slower than `slow_call_s` (reading the output costs more
    than the whole check, and most calls are quick)."""

    allowance_s: float = 0.0
    allowance: Callable[[], float] | None = None


class _Guard:
    """`CircuitBreaker.guard()`'s context: a plain class, as it runs around every upstream call (a
    generator-based context manager costs several times more). It works as `with` as well as `async with`:
    admitting and settling never wait, and the plain form spares the two coroutines of the async one."""

    __slots__ = ("_breaker", "_tenant", "_ticket", "_call", "_started")

    def __init__(self, breaker: CircuitBreaker, tenant: str | None) -> None:
        self._breaker, self._tenant = breaker, tenant

    def __enter__(self) -> GuardedCall:
        breaker = self._breaker
        self._ticket = breaker._admit(self._tenant)
        self._call = GuardedCall()
        self._started = breaker._clock()
        return self._call

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> None:
        breaker = self._breaker
        elapsed = breaker._clock() - self._started
        if exc_type is not None:
            breaker._settle(self._ticket, classify(exc, elapsed, breaker._settings.slow_call_s))
            return
        threshold = breaker._settings.slow_call_s
        if elapsed > threshold:  # only then can the allowance for its output change the verdict
            call = self._call
            threshold += max(0.0, call.allowance() if call.allowance is not None else call.allowance_s)
        breaker._settle(self._ticket, classify(None, elapsed, threshold))

    async def __aenter__(self) -> GuardedCall:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)


class _Relay(pybreaker.CircuitBreakerListener):
    """Turns pybreaker's `state_change` into our transition handling."""

    def __init__(self, owner: CircuitBreaker) -> None:
        self._owner = owner

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state: Any, new_state: Any) -> None:
        self._owner._on_state_change(old_state.name if old_state else pybreaker.STATE_CLOSED, new_state.name)


class CircuitBreaker:
    """The breaker of one provider. Use `with breaker.guard(): await call()` (or `async with`) around each
    attempt.

    Closed: every call is admitted and its outcome recorded; when the window holds at least `min_calls`
    and the error or slow ratio is over its threshold, the breaker opens. Open: calls are refused with
    `BreakerOpenError` until the open time has passed on `clock`, then it is half-open. Half-open: at most
    `half_open_probes` calls at once; a probe success closes it (window and backoff reset), a probe failure
    re-opens it for `open_backoff` times longer, up to `open_max_s`.
    """

    def __init__(self, name: str, settings: BreakerSettings, *, clock: Clock = monotonic,
                 on_transition: TransitionCallback | None = None) -> None:
        self._name = name
        self._settings = settings
        self._clock = clock
        self._window = SlidingWindow(settings.window_s, clock)
        self._callbacks: list[TransitionCallback] = []
        if on_transition is not None:
            self._callbacks.append(on_transition)
        self._open_s = settings.open_s
        self._open_until = 0.0
        # pybreaker's state, mirrored on each change it announces: asking its storage costs several calls,
        # and every attempt asks.
        self._state = BreakerState.CLOSED
        self._probes = 0
        # Bumped on every transition: outcomes of calls admitted in an earlier state are ignored.
        self._epoch = 0
        self._transitions: list[tuple[str, str]] = []
        self._isolated: dict[str | None, float] = {}  # tenant -> refused until (its own failures, see blame)
        # fail_max is unreachable and the call path unused: our window decides, pybreaker keeps the state.
        self._pb = pybreaker.CircuitBreaker(fail_max=sys.maxsize, reset_timeout=settings.open_s, name=name,
                                            listeners=[_Relay(self)], throw_new_error_on_trip=False)

    @property
    def name(self) -> str:
        """The provider this breaker protects."""
        return self._name

    @property
    def settings(self) -> BreakerSettings:
        """The thresholds this breaker was built with."""
        return self._settings

    @property
    def state(self) -> BreakerState:
        """The current state; an open breaker whose open time has passed becomes half-open here."""
        state = self._state
        if state is BreakerState.OPEN and self._clock() >= self._open_until:
            self._move(BreakerState.HALF_OPEN, {"cause": "open_elapsed", "open_s": self._open_s})
            state = BreakerState.HALF_OPEN
        return state

    def seconds_until_probe(self) -> float:
        """Seconds until an open breaker admits a probe; 0 when it is not open."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._open_until - self._clock())

    @property
    def degraded(self) -> bool:
        """True when merging should pause: not closed, or closed with an error ratio over the lower watermark."""
        if self.state is not BreakerState.CLOSED:
            return True
        stats = self._window.stats()
        return (stats.calls >= max(1, self._settings.min_calls // 2)
                and stats.error_ratio > self._settings.degrade_error_ratio)

    def snapshot(self) -> dict[str, Any]:
        """State and window figures for /readyz."""
        state = self.state
        stats = self._window.stats()
        return {"state": state.value, "error_ratio": round(stats.error_ratio, 4),
                "slow_ratio": round(stats.slow_ratio, 4), "calls": stats.calls,
                "seconds_until_probe": round(self.seconds_until_probe(), 3)}

    def add_transition_listener(self, callback: TransitionCallback) -> None:
        """Also call `callback(provider, from_state, to_state, reason)` on every state change."""
        self._callbacks.append(callback)

    def before_call(self, tenant: str | None = None) -> None:
        """Raise `BreakerOpenError` if a call for `tenant` would be refused now; reserves nothing (`guard` does)."""
        until = self._isolated.get(tenant) if tenant is not None else None
        if until is not None:
            if self._clock() < until:
                raise BreakerOpenError(until - self._clock(), self._name)
            del self._isolated[tenant]
        state = self.state
        if state is BreakerState.OPEN:
            raise BreakerOpenError(self.seconds_until_probe(), self._name)
        if state is BreakerState.HALF_OPEN and self._probes >= self._settings.half_open_probes:
            raise BreakerOpenError(PROBE_BUSY_RETRY_S, self._name)

    def guard(self, tenant: str | None = None) -> _Guard:
        """Admit one call for `tenant` (or raise `BreakerOpenError`), then record how the awaited body ended.

        Exceptions from the body are re-raised untouched; `CancelledError` and caller-fault errors
        only free the probe slot, if any, and count as neither success nor failure. A success is slow
        past `slow_call_s` plus the allowance the body set on the yielded `GuardedCall`.
        """
        return _Guard(self, tenant)

    def record_failure(self, tenant: str | None = None) -> None:
        """Count a failure seen after `guard()` settled (a stream whose upstream died mid-way)."""
        self._settle(_Ticket(self._epoch, probe=False, tenant=tenant), Outcome.FAILURE)

    def force_open(self, until_s: float, reason: dict[str, Any]) -> None:
        """Open until `until_s` on this breaker's clock (e.g. because another replica saw the upstream fail).

        An already open breaker only extends its open time; the backoff is left as it is.
        """
        now = self._clock()
        if until_s <= now:
            return
        if self.state is BreakerState.OPEN:
            self._open_until = max(self._open_until, until_s)
            return
        self._open_until = until_s
        self._move(BreakerState.OPEN, {**reason, "open_s": round(until_s - now, 3)})

    def _admit(self, tenant: str | None) -> _Ticket:
        self.before_call(tenant)
        if self._state is BreakerState.HALF_OPEN:
            self._probes += 1
            return _Ticket(self._epoch, probe=True, tenant=tenant)
        return _Ticket(self._epoch, probe=False, tenant=tenant)

    def _settle(self, ticket: _Ticket, outcome: Outcome | None) -> None:
        if ticket.epoch != self._epoch:
            return  # the state changed meanwhile; probe slots were reset with it
        if ticket.probe:
            self._probes -= 1
            if outcome is Outcome.SUCCESS:
                self._move(BreakerState.CLOSED, {"cause": "probe_succeeded"})
            elif outcome is not None:
                # A slow probe re-opens too: the upstream has not shown it is healthy again.
                self._open(next_open_s(self._open_s, self._settings), {"cause": "probe_failed",
                                                                        "outcome": outcome.value})
            return
        if outcome is None:
            return
        self._window.record(outcome, ticket.tenant)
        if self._window.spotless():
            return  # no ratio above zero: no threshold can be passed (every healthy call ends here)
        overall = self._window.stats()
        if trip_reason(overall, self._settings) is None:
            return  # judge would say nothing: skip its per-tenant breakdown, on every healthy call
        verdict = judge(overall, self._window.by_tenant(), self._settings, trip_reason)
        if verdict.reason is not None:
            self._open(self._open_s, verdict.reason)
        elif verdict.isolate is not None and verdict.isolate not in self._isolated:
            self._isolated[verdict.isolate] = self._clock() + self._settings.open_s
            log.warning("breaker_tenant_isolated", provider=self._name, tenant=verdict.isolate,
                        open_s=self._settings.open_s)

    def _open(self, open_s: float, reason: dict[str, Any]) -> None:
        self._open_s = open_s
        self._open_until = self._clock() + open_s
        self._move(BreakerState.OPEN, {**reason, "open_s": open_s})

    def _move(self, to: BreakerState, reason: dict[str, Any]) -> None:
        if to is BreakerState.OPEN:
            self._pb.open()
        elif to is BreakerState.HALF_OPEN:
            self._pb.half_open()
        else:
            self._pb.close()
        # pybreaker notifies listeners before its storage holds the new state, so callbacks run
        # only now, when `state` and `seconds_until_probe()` already tell the truth.
        transitions, self._transitions = self._transitions, []
        for old, new in transitions:
            self._announce(old, new, reason)

    def _on_state_change(self, old: str, new: str) -> None:
        self._state = _BY_NAME[new]
        self._epoch += 1
        self._probes = 0
        if new == pybreaker.STATE_CLOSED:
            self._window.reset()
            self._isolated.clear()
            self._open_s = self._settings.open_s
        self._transitions.append((old, new))

    def _announce(self, old: str, new: str, reason: dict[str, Any]) -> None:
        level = "warning" if new == pybreaker.STATE_OPEN else "info"
        getattr(log, level)("breaker_transition", provider=self._name, from_state=old, to_state=new, reason=reason)
        for callback in self._callbacks:
            try:
                callback(self._name, old, new, dict(reason))
            except Exception:
                log.exception("breaker_listener_failed", provider=self._name, to_state=new)

