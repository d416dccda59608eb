"""Sent markers written before the upstream call: a job goes upstream only for entries already marked.

Just before the engine sends a job (`ChatJob.before_send`), the worker marks the job's entries in one
script per stream, and only the entries still pending under its own name: that is the fence, checked in
Redis where the claim is decided (`claims`: a marked entry is never claimed from a live owner, and a
claim moves the entry to the claimer, so after it this worker's mark is refused). An entry another worker
claimed meanwhile, or one no longer pending (its front-end withdrew it), is not marked, and the job is not
sent for it; a job none of whose entries is marked is not sent at all. Marking first closes the gap in
which a worker that took the job over could run it again (the marker used to follow the call by a flush,
about a millisecond). The marker outlives the job's deadline by `MARKER_GRACE_MS`, then expires.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mergebroker.broker.cluster.holds import Held, Key
from mergebroker.broker.cluster.outbox import MARKER_GRACE_MS
from mergebroker.broker.cluster.partition import GROUP, Keys

# Marks the listed entries still pending under this consumer, and resets their idle time as a heartbeat does;
# returns the IDs marked.
# ARGV: group, consumer, marker key prefix, then (entry ID, marker expiry as Redis server ms) pairs.
# The marker keys are derived here, not declared: Redis Cluster allows that because they share the stream's
# hash tag (`partition.Keys`), hence one slot.
_MARK = """local marked = {}
for i = 4, #ARGV, 2 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('SET', ARGV[3] .. ARGV[i], ARGV[2], 'PXAT', ARGV[i + 1])
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    marked[#marked + 1] = ARGV[i]
  end
end
return marked"""


class SentMarkers:
    """Writes one worker's sent markers, each only while the entry is still the worker's."""

    def __init__(self, redis: Any, keys: Keys, consumer_id: str) -> None:
        self._keys = keys
        self._id = consumer_id
        self._script = redis.register_script(_MARK)

    async def mark(self, entries: list[Held]) -> set[Key]:
        """Mark `entries` (one round trip per stream, in parallel); the (stream, entry ID) pairs marked.
        Raises the client's error when Redis cannot be reached (nothing is marked then)."""
        by_stream: dict[str, list[Held]] = {}
        for held in entries:
            by_stream.setdefault(held.stream, []).append(held)
        results = await asyncio.gather(*(self._mark_stream(stream, group) for stream, group in by_stream.items()))
        return {key for marked in results for key in marked}

    async def _mark_stream(self, stream: str, entries: list[Held]) -> set[Key]:
        args: list[Any] = [GROUP, self._id, self._keys.sent_prefix(stream)]
        for held in entries:
            args += [held.entry_id, held.job.deadline_ms + MARKER_GRACE_MS]
        marked = await self._script(keys=[stream], args=args)
        return {(stream, entry_id if isinstance(entry_id, bytes) else str(entry_id).encode())
                for entry_id in marked or []}
