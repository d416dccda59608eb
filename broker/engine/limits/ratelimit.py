"""Admission rate limits: token buckets per key, all-or-nothing reservations, OpenAI-style headers.

A per-minute limit L is a bucket of capacity L that refills L/60 per second. A request reserves one
request and its estimated tokens from every bucket that applies to it (its tier's, its key's) or from
none; once the provider reports real usage, `Reservation.settle` returns the difference.

The deciding parts are pure (`bucket_requests`, `refusal`, `ratelimit_headers`) and shared with the
Redis-backed limiter in `broker.engine.limits.redis_limiter`, which keeps the same buckets in Redis instead.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from mergebroker.clock import Clock
from mergebroker.errors import RateLimited
from mergebroker.frozen_init import direct_init
from mergebroker.providers.token_bucket import EPSILON, TokenBucket

Kind = Literal["requests", "tokens"]
_KIND_WORDS = {"requests": "requests per minute", "tokens": "tokens per minute"}
@dataclass(frozen=True)
class LimitSpec:
    """Per-minute limits for one key ("tier:standard", "key:<hash prefix>"); None means unlimited."""

    key: str
    rpm: int | None
    tpm: int | None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")


@direct_init  # built on every request
@dataclass(frozen=True)
class BucketRequest:
    """One bucket a reservation touches: whose, which kind, its per-minute limit, and how much to take."""

    key: str
    kind: Kind
    limit: int
    amount: int

    @property
    def refill_per_s(self) -> float:
        return self.limit / 60.0


@direct_init  # built on every request
@dataclass(frozen=True)
class BucketLevel:
    """A bucket's level at one moment, next to the request made of it."""

    bucket: BucketRequest
    level: float

    def wait_s(self) -> float:
        """Seconds until the requested amount fits: 0 if it does, `inf` if it never can."""
        if self.level + EPSILON >= self.bucket.amount:
            return 0.0
        if self.bucket.amount > self.bucket.limit:
            return math.inf
        return (self.bucket.amount - self.level) / self.bucket.refill_per_s

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return max(0.0, (self.bucket.limit - self.level) / self.bucket.refill_per_s)


def bucket_requests(specs: Sequence[LimitSpec], tokens: int) -> list[BucketRequest]:
    """The buckets a request of `tokens` tokens touches: one request and the tokens from each limit that exists."""
    if len(specs) > 1:  # one spec (a tier's own, the common case) cannot repeat a key
        keys = [spec.key for spec in specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"limit keys must be distinct: {keys}")
    wanted: list[BucketRequest] = []
    for spec in specs:
        if spec.rpm is not None:
            wanted.append(BucketRequest(spec.key, "requests", spec.rpm, 1))
        if spec.tpm is not None:
            wanted.append(BucketRequest(spec.key, "tokens", spec.tpm, max(0, tokens)))
    return wanted


def format_duration(seconds: float) -> str:
    """OpenAI's reset duration format ("20ms", "1s", "1.5s", "6m0s", "1h2m3s"), rounded up to the ms."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))  # the epsilon absorbs float noise such as 6.000000000001
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}.{ms % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def ratelimit_headers(levels: Sequence[BucketLevel]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tightest bucket of each kind.

    The tightest is the one with the fewest remaining (ties: the smaller limit, then the first), since that is
    the one the caller will hit first. Kinds without any limit get no headers.
    """
    tightest: dict[str, BucketLevel] = {}
    for lv in levels:  # one pass, no sort: this runs on every admitted request
        held = tightest.get(lv.bucket.kind)
        if held is None or (lv.level, lv.bucket.limit) < (held.level, held.bucket.limit):
            tightest[lv.bucket.kind] = lv
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        chosen = tightest.get(kind)
        if chosen is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(chosen.bucket.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(chosen.level + EPSILON)))
        headers[f"x-ratelimit-reset-{kind}"] = format_duration(chosen.reset_s())
    return headers


def _describe(bucket: BucketRequest) -> str:
    kind, _, name = bucket.key.partition(":")
    where = f"{kind} {name}" if name else bucket.key
    return f"{_KIND_WORDS[bucket.kind]} on {where}"


def refusal(levels: Sequence[BucketLevel]) -> RateLimited | None:
    """None if every bucket holds what is asked of it; else the 429 to raise (levels are before any take).

    Retry-After is the longest wait among the short buckets, because all of them must fit at once.
    A request larger than a whole limit can never fit: it is refused without a Retry-After.
    """
    short = [lv for lv in levels if lv.wait_s() > 0]
    if not short:
        return None
    worst = max(short, key=lambda lv: lv.wait_s())
    wait = worst.wait_s()
    b = worst.bucket
    if math.isinf(wait):
        exc = RateLimited(f"Request too large for {_describe(b)}: limit {b.limit}, requested {b.amount}.")
    else:
        exc = RateLimited(
            f"Rate limit reached for {_describe(b)}: limit {b.limit}, remaining {max(0, math.floor(worst.level))}, "
            f"requested {b.amount}. Please try again in {format_duration(wait)}.",
            retry_after=wait,
        )
    headers = ratelimit_headers(levels)
    if exc.retry_after is not None:
        headers["retry-after-ms"] = str(math.ceil(wait * 1000))
    exc.extra_headers = headers  # type: ignore[attr-defined]  # merged into the 429 by the HTTP layer
    return exc


_NO_HEADERS: Mapping[str, str] = {}


class Reservation:
    """What one request took from its buckets: headers to send now, tokens to settle later."""

    def __init__(self, tokens: int, headers: Mapping[str, str],
                 adjust: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.tokens = tokens
        self._headers = dict(headers)
        self._adjust = adjust
        self._settled = False

    def headers(self) -> dict[str, str]:
        """OpenAI-style x-ratelimit-* headers for the tightest applicable limits (none if unlimited)."""
        return dict(self._headers)

    async def settle(self, actual_tokens: int) -> None:
        """Correct the reservation with the real usage: give back the surplus, or take the excess.

        Taking the excess never fails (the tokens are already spent). Only the first call counts.
        """
        if self._settled:
            return
        self._settled = True  # before awaiting, so a concurrent second settle is also a no-op
        returned = self.tokens - actual_tokens
        if returned and self._adjust is not None:
            await self._adjust(returned)


class RateLimiter:
    """In-process admission limiter: one bucket per (key, kind), created on first use.

    Everything between check and take is synchronous, so a reservation is atomic on the event loop.
    """

    _SWEEP_EVERY = 4096

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, Kind], TokenBucket] = {}
        self._since_sweep = 0

    def _bucket(self, want: BucketRequest) -> TokenBucket:
        bucket = self._buckets.get((want.key, want.kind))
        if bucket is None or bucket.capacity != want.limit:
            # A changed limit keeps what was left (up to the new capacity) rather than refilling for free.
            level = None if bucket is None else bucket.available()
            bucket = TokenBucket(want.limit, want.refill_per_s, self._clock, level=level)
            self._buckets[(want.key, want.kind)] = bucket
        return bucket

    def _sweep(self) -> None:
        """Forget full buckets: a full bucket is indistinguishable from a new one, so nothing is lost."""
        self._since_sweep += 1
        if self._since_sweep < self._SWEEP_EVERY:
            return
        self._since_sweep = 0
        for name in [name for name, b in self._buckets.items() if b.available() >= b.capacity]:
            del self._buckets[name]

    async def reserve(self, specs: Sequence[LimitSpec], tokens: int) -> Reservation:
        """Take 1 request and `tokens` tokens from every applicable bucket, or nothing and raise RateLimited."""
        wanted = bucket_requests(specs, tokens)
        if not wanted:  # no limit applies (a tier without rpm or tpm): nothing to take, no headers to send
            return Reservation(tokens, _NO_HEADERS)
        self._sweep()
        buckets = [self._bucket(w) for w in wanted]
        error = refusal([BucketLevel(w, b.available()) for w, b in zip(wanted, buckets)])
        if error is not None:
            raise error
        for w, b in zip(wanted, buckets):
            b.take(w.amount)
        headers = ratelimit_headers([BucketLevel(w, b.available()) for w, b in zip(wanted, buckets)])
        token_buckets = [w for w in wanted if w.kind == "tokens"]
        return Reservation(tokens, headers, self._adjuster(token_buckets) if token_buckets else None)

    def _adjuster(self, wanted: list[BucketRequest]) -> Callable[[int], Awaitable[None]]:
        async def adjust(returned: int) -> None:
            for w in wanted:
                bucket = self._bucket(w)  # looked up again: the original may have been swept while full
                if returned > 0:
                    bucket.give_back(returned)
                else:
                    bucket.take(-returned)
        return adjust
