"""Taking over another worker's jobs: who may claim which pending entry, decided purely, done atomically.

The rule (`plan_claims`), for an entry of a held partition that is pending (read, unanswered):
- its owner is dead (`presence`): claim it at once, even if it went upstream: its answer will never come;
- it idled `claim_idle_ms` (its owner stopped heartbeating: paused, hung, cut off from Redis, or this
  worker itself dropped it at its fence): claim it, unless it went upstream (its sent marker exists), in
  which case its owner answers it when it resumes, and no one runs it twice;
- anything else is being worked on.

The owner's side of the bargain is the fence (`holds`): it never sends a job upstream once the job went
unheartbeated for `FENCE_SHARE` of `claim_idle_ms`, so by the time a claim is allowed, what it sent is
final and marked. `CLAIM` checks owner, idle time and marker again inside Redis, so a heartbeat or a
marker that lands between the scan and the claim wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from redis.exceptions import RedisError

from mergebroker.broker.cluster.partition import GROUP, Keys

log = structlog.get_logger(__name__)

# Claims the listed entries whose owner, idle time and marker are as planned; returns them as XCLAIM does.
# ARGV: group, claimer, marker key prefix, then (entry ID, expected owner, min idle ms, 1 if a marker forbids).
# The marker keys it checks share the stream's hash tag (`partition.Keys`), so a cluster finds them in its slot.
_CLAIM = """local out = {}
for i = 4, #ARGV, 4 do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[i + 2], id, id, 1)
  if p[1] and p[1][2] == ARGV[i + 1] and (ARGV[i + 3] == '0' or redis.call('EXISTS', ARGV[3] .. id) == 0) then
    local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id)
    if claimed[1] then out[#out + 1] = claimed[1] end
  end
end
return out"""


@dataclass(frozen=True)
class Pending:
    """One pending entry as `XPENDING` reports it."""

    entry_id: bytes
    owner: str
    idle_ms: int


@dataclass(frozen=True)
class Claim:
    """Take `entry_id` from `owner` if it still idles `min_idle_ms` (and has no sent marker, if `unless_sent`)."""

    entry_id: bytes
    owner: str
    min_idle_ms: int
    unless_sent: bool


def plan_claims(pending: Iterable[Pending], *, me: str, held: set[bytes], dead: set[str],
                claim_idle_ms: int, room: int) -> list[Claim]:
    """The claims to try on one stream (at most `room`), by the rule in the module docstring."""
    claims: list[Claim] = []
    for p in pending:
        if len(claims) >= room:
            break
        if p.owner == me and p.entry_id in held:
            continue
        if p.owner in dead:
            claims.append(Claim(p.entry_id, p.owner, 0, unless_sent=False))
        elif p.idle_ms >= claim_idle_ms:
            claims.append(Claim(p.entry_id, p.owner, claim_idle_ms, unless_sent=True))
    return claims


HANDED_BACK_IDLE_MS = 86_400_000
"""The idle time an entry handed back at stop is given: past any `claim_idle_ms`, so the next scan claims it."""

# Hands back the listed entries if they are still this consumer's: claimed to itself with a large idle time,
# so that the next owner's claim rule (idle past claim_idle_ms, no sent marker) takes them on its next scan.
# ARGV: group, consumer, idle ms, then entry IDs. Returns how many were handed back.
_HAND_BACK = """local n = 0
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    n = n + 1
  end
end
return n"""


class HandBack:
    """A stopping worker's side of a claim: entries it read but never sent upstream are made claimable now
    (`HANDED_BACK_IDLE_MS`), only while they are still its own, checked inside Redis."""

    def __init__(self, redis: Any, consumer_id: str) -> None:
        self._id = consumer_id
        self._script = redis.register_script(_HAND_BACK)

    async def __call__(self, entries: dict[str, list[bytes]]) -> int:
        """Hand back `entries` (entry IDs by stream); how many went back (0 for those on a Redis error: the idle
        rule claims them later)."""
        handed = 0
        try:
            for stream, ids in entries.items():
                handed += int(await self._script(keys=[stream], args=[GROUP, self._id, HANDED_BACK_IDLE_MS, *ids]))
        except RedisError as exc:
            log.warning("cluster_hand_back_failed", error=type(exc).__name__)
        return handed


class Claimer:
    """Runs one worker's claims: scans pending entries and claims what `plan_claims` allows."""

    def __init__(self, redis: Any, keys: Keys, consumer_id: str, *, claim_idle_ms: int) -> None:
        self._redis = redis
        self._keys = keys
        self._id = consumer_id
        self._claim_idle_ms = claim_idle_ms
        self._script = redis.register_script(_CLAIM)

    async def scan(self, streams: list[str], *, dead: set[str], count: int) -> dict[str, list[Pending]]:
        """Pending entries that may be claimable: every entry of a dead owner, and any entry idle long enough."""
        pipe = self._redis.pipeline(transaction=False)
        asked: list[str] = []
        for stream in streams:
            pipe.xpending_range(stream, GROUP, "-", "+", count, idle=self._claim_idle_ms)
            asked.append(stream)
            for owner in sorted(dead):
                pipe.xpending_range(stream, GROUP, "-", "+", count, consumername=owner)
                asked.append(stream)
        found: dict[str, dict[bytes, Pending]] = {}
        for stream, result in zip(asked, await pipe.execute(raise_on_error=False)):
            if isinstance(result, Exception):
                continue  # no group yet (nothing pending), or a stream deleted meanwhile
            for p in result:
                entry = Pending(p["message_id"], _text(p["consumer"]), int(p["time_since_delivered"]))
                found.setdefault(stream, {})[entry.entry_id] = entry
        return {stream: list(entries.values()) for stream, entries in found.items()}

    async def claim(self, stream: str, claims: list[Claim]) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Claim what is still as planned, in one atomic step; the entries taken, with their fields."""
        if not claims:
            return []
        args: list[Any] = [GROUP, self._id, self._keys.sent_prefix(stream)]
        for c in claims:
            args += [c.entry_id, c.owner, c.min_idle_ms, 1 if c.unless_sent else 0]
        result = await self._script(keys=[stream], args=args)
        return [(entry_id, _fields(flat)) for entry_id, flat in result or [] if flat is not None]

    def plan(self, pending: list[Pending], *, held: set[bytes], dead: set[str], room: int) -> list[Claim]:
        return plan_claims(pending, me=self._id, held=held, dead=dead, claim_idle_ms=self._claim_idle_ms,
                           room=room)


def _fields(flat: list[Any]) -> dict[bytes, bytes]:
    return dict(zip(flat[0::2], flat[1::2]))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
