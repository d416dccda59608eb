"""Provider-side pacing: never send faster than an upstream's declared RPM/TPM; queue by priority instead.

Waiters sit in a private heap of (-priority, seq, future, tokens): higher priority first, FIFO within a
priority. Only the head may take, so a big high-priority call is not starved by small low-priority ones.
When the head cannot go yet, one timer is armed on the injected clock (`clock.call_at`) for the moment
its buckets will hold enough; nothing polls, and a fake clock's `advance` serves the waiters that fall due.

Providers enforce per-minute limits over shorter windows (OpenAI quantizes 600 RPM to 10 per second),
so the buckets hold `burst_s` seconds' worth rather than a whole minute. A call estimated at more tokens
than a bucket holds waits for a full bucket and takes just that: an estimate is only a guess (one
`max_tokens=1e12` must not leave the upstream in debt for years), and the caller settles with the real
usage afterwards, which charges what was really used beyond it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from mergebroker.clock import Clock, Timer
from mergebroker.providers.token_bucket import TokenBucket


class UpstreamLimiter:
    """Waits until one upstream's request and token buckets allow a call; serves waiters by priority."""

    def __init__(self, rpm: int | None, tpm: int | None, *, clock: Clock, burst_s: float = 1.0) -> None:
        self._clock = clock
        self._requests = self._bucket(rpm, burst_s)
        self._tokens = self._bucket(tpm, burst_s)
        self._waiters: list[tuple[float, int, asyncio.Future[None], int]] = []
        self._seq = itertools.count()
        self._timer: Timer | None = None

    def _bucket(self, per_minute: int | None, burst_s: float) -> TokenBucket | None:
        if per_minute is None:
            return None
        # At least one request (or token) must fit, however low the limit.
        return TokenBucket(max(1.0, per_minute * burst_s / 60.0), per_minute / 60.0, self._clock)

    @property
    def limits_tokens(self) -> bool:
        """Whether a token rate is declared: only then does a caller's token estimate matter."""
        return self._tokens is not None

    @property
    def waiting(self) -> int:
        """Callers currently queued (cancelled ones excluded)."""
        return sum(1 for entry in self._waiters if not entry[2].done())

    def rpm_pressure(self) -> float:
        """How close the request rate is to the declared RPM, 0..1: the share of the request bucket in use,
        1.0 while callers queue for it. 0 without an RPM limit (requests are never the scarce thing)."""
        if self._requests is None:
            return 0.0
        if self.waiting:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self._requests.available() / self._requests.capacity))

    async def acquire(self, tokens: int, priority: float) -> int:
        """Take one request and `tokens` tokens (at most one bucket's worth); higher `priority` is served first.

        Returns the tokens actually taken: what `refund` or a settlement should be based on.
        Cancelling the wait removes the caller from the queue; if it was cancelled just after being
        served, what it took is given back.
        """
        taken = max(0, tokens)
        if self._tokens is not None:
            taken = min(taken, int(self._tokens.capacity))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._seq), future, taken))
        self._wake()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.refund(taken)
            self._wake()  # the cancelled waiter may have been the head holding others back
            raise
        return taken

    def give_back(self, tokens: int) -> None:
        """Settle a call: return unused tokens (positive) or record tokens used beyond the estimate (negative)."""
        if self._tokens is not None:
            if tokens >= 0:
                self._tokens.give_back(tokens)
            else:
                self._tokens.take(-tokens)
        self._wake()

    def refund(self, tokens: int) -> None:
        """Undo an `acquire` whose call was never sent: its request and `tokens` tokens go back."""
        if self._requests is not None:
            self._requests.give_back(1)
        if self._tokens is not None:
            self._tokens.give_back(max(0, tokens))
        self._wake()

    def close(self) -> None:
        """Disarm the timer; waiters still queued stay queued."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wait_s(self, tokens: int) -> float:
        """Seconds until the head's call fits in both buckets (0 if now)."""
        wait = 0.0 if self._requests is None else self._requests.seconds_until(1)
        if self._tokens is not None:
            wait = max(wait, self._tokens.seconds_until(tokens))
        return wait

    def _wake(self) -> None:
        """Serve waiters from the head while the buckets allow; else arm one timer for the head."""
        self.close()
        while self._waiters:
            _, _, future, tokens = self._waiters[0]
            if future.done():  # cancelled while waiting
                heapq.heappop(self._waiters)
                continue
            wait = self._wait_s(tokens)
            if wait > 0:
                self._timer = self._clock.call_at(self._clock() + wait, self._wake)
                return
            heapq.heappop(self._waiters)
            if self._requests is not None:
                self._requests.take(1)
            if self._tokens is not None:
                self._tokens.take(tokens)
            future.set_result(None)
