"""Admission rate limits shared by every broker replica, kept in Redis.

The buckets are the ones of `broker.engine.limits.ratelimit`, stored as one hash per (key, kind) with the level and
the time of the last refill. One Lua script refills, checks and takes all of a request's buckets in a
single atomic step, so N replicas enforce a limit once, not N times. "Now" comes from the caller's wall
clock (replicas share no monotonic clock); a replica whose clock lags never moves a bucket backwards.

Redis being down never fails a request: the limiter logs one `ratelimit_redis_unavailable` warning,
uses its in-process fallback (each replica then enforces the limits on its own) and tries Redis again
after `retry_after_s`. How long one Redis call may hang is the client's `socket_timeout`.
All keys of one request go to one script call, so they must share a Redis Cluster slot: a request takes
from its tier's bucket and its API key's, and an API key may call in several tiers, so no narrower tag
than the whole limiter fits. Every bucket lives under the prefix, which must hold a hash tag (the default
`{mb:rl}:` does): `{mb:rl}:tier:standard:requests`. In a cluster the limits live on one shard; each is
one small hash, so that shard's load is one script call per admitted request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import structlog
from redis.exceptions import RedisError

from mergebroker.broker.engine.limits.ratelimit import (
    BucketLevel,
    BucketRequest,
    LimitSpec,
    RateLimiter,
    Reservation,
    bucket_requests,
    ratelimit_headers,
    refusal,
)
from mergebroker.clock import Clock
from mergebroker.errors import RateLimited
from mergebroker.redis_connect import RedisClient, has_hash_tag

log = structlog.get_logger(__name__)

# KEYS: one hash per bucket. ARGV: now, all_or_nothing ("1"/"0"), then capacity, refill/s, amount per key.
# Returns {taken (1/0), level per key as a string}: Lua numbers would come back truncated to integers, and
# %.17g round-trips a double exactly, so Python's checks agree with the script's.
# With all_or_nothing=0 the amounts are applied regardless (settling: negative gives back, capped at
# capacity; positive may go into debt). Keys expire once they would have refilled: a missing key is full.
_RESERVE_LUA = """
local now = tonumber(ARGV[1])
local all_or_nothing = ARGV[2] == '1'
local levels, stamps = {}, {}
local fits = true
for i = 1, #KEYS do
  local cap, rate, amount = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  local state = redis.call('HMGET', KEYS[i], 'level', 'stamp')
  local level, stamp = tonumber(state[1]), tonumber(state[2])
  if level == nil or stamp == nil then
    level, stamp = cap, now
  elseif now > stamp then
    level, stamp = math.min(cap, level + (now - stamp) * rate), now
  end
  levels[i], stamps[i] = math.min(level, cap), stamp
  if levels[i] + 1e-9 < amount then fits = false end  -- EPSILON in broker.ratelimit
end
local taken = (fits or not all_or_nothing) and 1 or 0
local out = {taken}
for i = 1, #KEYS do
  local cap, rate, amount = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  local level = levels[i]
  if taken == 1 then
    level = math.min(cap, level - amount)
    redis.call('HSET', KEYS[i], 'level', string.format('%.17g', level), 'stamp', string.format('%.17g', stamps[i]))
    redis.call('PEXPIRE', KEYS[i], math.ceil((cap - level) / rate * 1000) + 1000)
  end
  out[i + 1] = string.format('%.17g', level)
end
return out
"""

_REDIS_ERRORS = (RedisError, OSError)  # OSError covers socket errors and the builtin TimeoutError
DEFAULT_PREFIX = "{mb:rl}:"


class RedisRateLimiter:
    """`RateLimiter`'s API over buckets shared in Redis, with the in-process limiter as the fallback."""

    def __init__(self, client: RedisClient, *, prefix: str = DEFAULT_PREFIX, fallback: RateLimiter, clock: Clock,
                 wall_clock: Callable[[], float] = time.time, retry_after_s: float = 5.0) -> None:
        if not has_hash_tag(prefix):
            raise ValueError(f"prefix {prefix!r} must hold a hash tag such as {{mb:rl}}: a request's buckets "
                             "go to one script call, so they must share a Redis Cluster slot")
        self._client = client
        self._script = client.register_script(_RESERVE_LUA)
        self._prefix = prefix
        self._fallback = fallback
        self._clock = clock
        self._wall_clock = wall_clock
        self._retry_after_s = retry_after_s
        self._down_until: float | None = None  # monotonic time before which Redis is not tried

    async def reserve(self, specs: Sequence[LimitSpec], tokens: int) -> Reservation:
        """Take 1 request and `tokens` tokens from every applicable shared bucket, or raise RateLimited."""
        wanted = bucket_requests(specs, tokens)
        if not wanted:
            return Reservation(tokens, {})
        if self._down_until is not None and self._clock() < self._down_until:
            return await self._fallback.reserve(specs, tokens)
        try:
            taken, levels = await self._run(wanted, all_or_nothing=True)
        except _REDIS_ERRORS as exc:
            self._mark_down(exc)
            return await self._fallback.reserve(specs, tokens)
        self._mark_up()
        if not taken:
            raise refusal(levels) or RateLimited("Rate limit reached.", retry_after=1.0)
        token_buckets = [w for w in wanted if w.kind == "tokens"]
        adjust = self._adjuster(token_buckets) if token_buckets else None
        return Reservation(tokens, ratelimit_headers(levels), adjust)

    async def _run(self, wanted: Sequence[BucketRequest], *, all_or_nothing: bool) -> tuple[bool, list[BucketLevel]]:
        keys = [f"{self._prefix}{w.key}:{w.kind}" for w in wanted]
        args: list[str] = [repr(float(self._wall_clock())), "1" if all_or_nothing else "0"]
        for w in wanted:
            args += [str(w.limit), repr(w.refill_per_s), str(w.amount)]
        reply = await self._script(keys=keys, args=args)
        levels = [BucketLevel(w, float(raw)) for w, raw in zip(wanted, reply[1:])]
        return int(reply[0]) == 1, levels

    def _adjuster(self, wanted: list[BucketRequest]) -> Callable[[int], Awaitable[None]]:
        async def adjust(returned: int) -> None:
            # Settling is bookkeeping after the answer: a Redis failure here is dropped, never raised.
            moves = [BucketRequest(w.key, w.kind, w.limit, -returned) for w in wanted]
            try:
                await self._run(moves, all_or_nothing=False)
            except _REDIS_ERRORS as exc:
                self._mark_down(exc)
        return adjust

    def _mark_down(self, exc: BaseException) -> None:
        if self._down_until is None:
            log.warning("ratelimit_redis_unavailable", error=type(exc).__name__, retry_in_s=self._retry_after_s)
        self._down_until = self._clock() + self._retry_after_s

    def _mark_up(self) -> None:
        if self._down_until is not None:
            log.info("ratelimit_redis_recovered")
            self._down_until = None

