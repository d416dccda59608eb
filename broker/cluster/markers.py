"""Sent markers and sent notes written before the upstream call: a job goes upstream only for entries marked.

Just before the engine sends a job (`ChatJob.before_send`), the worker marks the job's entries in one
script per stream, and only the entries still in their stream and pending under its own name: that is the
fence, checked in Redis where the claim is decided (`claims`: a marked entry is never claimed from a live
owner, and a claim moves the entry to the claimer, so after it this worker's mark is refused). An entry
another worker claimed meanwhile, or one its front-end took back (deleted it to serve it itself), is not
marked, and the job is not sent for it; a job none of whose entries is marked is not sent at all.

The same script adds the sent note (`WireReply.sent_by`) to each marked entry's reply stream, so a
front-end that deletes its entries and then reads its replies (`ClusterQueue`'s hand-over after an
outage) knows exactly which jobs went upstream: a mark is either before the deletion, and its note is read,
or after it, and refused. Where the master has replicas, the script is followed on the same connection by
`WAIT 1`, so a failover right after the mark does not lose the note the front-end will look for (bounded by
`REPLICA_WAIT_MS`: a lagging replica delays a call that long at most, and the call goes anyway). In a Redis
Cluster both go to the node that holds cluster mode's slot, as does the ROLE that counts its replicas.

A mark whose reply is lost (the connection dropped, or the master died, mid-call) may or may not have run:
the worker then looks its markers up once Redis answers again (`confirm`) instead of guessing. Guessing
either way breaks a promise: dropping a job whose note was written (and replicated) leaves its front-end
waiting for a reply that never comes, and sending one whose mark was lost sends it twice, since its
front-end serves it too.

The marker outlives the job's deadline by `MARKER_GRACE_MS`, then expires.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from mergebroker.broker.cluster.holds import Held, Key
from mergebroker.broker.cluster.outbox import MARKER_GRACE_MS, REPLY_MAXLEN
from mergebroker.broker.cluster.partition import GROUP, Keys
from mergebroker.broker.cluster.wire import FIELD, WireReply, encode_reply
from mergebroker.clock import Clock, monotonic
from mergebroker.redis_connect import routed_to

log = structlog.get_logger(__name__)

REPLICA_WAIT_MS = 200  # the longest a mark waits for a replica's acknowledgement
REPLICAS_CHECK_S = 5.0  # how often the master's replica count is looked up again (ROLE)

# Marks the listed entries still in the stream and pending under this consumer, resets their idle time as a
# heartbeat does, and adds each one's sent note to its reply stream; returns the IDs marked.
# ARGV: group, consumer, marker key prefix, reply-stream trim length, then per entry: ID, marker expiry (Redis
# server ms), reply stream, note. The marker and reply keys are derived here, not declared: Redis Cluster
# allows that because they share the stream's hash tag (`partition.Keys`), hence one slot.
_MARK = """local marked = {}
for i = 5, #ARGV, 4 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] and #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) == 1 then
    redis.call('SET', ARGV[3] .. ARGV[i], ARGV[2], 'PXAT', ARGV[i + 1])
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    redis.call('XADD', ARGV[i + 2], 'MAXLEN', '~', ARGV[4], '*', '""" + FIELD.decode() + """', ARGV[i + 3])
    marked[#marked + 1] = ARGV[i]
  end
end
return marked"""


class SentMarkers:
    """Writes one worker's sent markers and notes, each only while the entry is still the worker's."""

    def __init__(self, redis: Any, keys: Keys, consumer_id: str, clock: Clock = monotonic) -> None:
        self._redis = redis
        self._keys = keys
        self._id = consumer_id
        self._clock = clock
        self._script = redis.register_script(_MARK)
        # WAIT counts the writes of the connection it runs on: only a pipeline keeps it on the script's.
        self._can_wait = callable(getattr(redis, "pipeline", None))
        self._replicas = 0
        self._replicas_checked = float("-inf")

    async def mark(self, entries: list[Held]) -> set[Key]:
        """Mark `entries` (one round trip per stream, in parallel); the (stream, entry ID) pairs marked.
        Raises the client's error when Redis cannot be reached (nothing is marked then)."""
        by_stream: dict[str, list[Held]] = {}
        for held in entries:
            by_stream.setdefault(held.stream, []).append(held)
        replicas = await self._replica_count()
        results = await asyncio.gather(*(self._mark_stream(stream, group, replicas)
                                         for stream, group in by_stream.items()))
        return {key for marked in results for key in marked}

    async def confirm(self, entries: list[Held]) -> set[Key]:
        """The (stream, entry ID) pairs of `entries` whose marker holds this worker's ID now: after a mark
        whose reply was lost, the ones it wrote. Marker and note come from one script, replicated as one, so an
        entry found marked has its note on the master that answers now, and one not found has neither (its
        front-end serves it itself). Raises the client's error when Redis cannot be reached."""
        values = await self._redis.mget([self._keys.sent(h.stream, h.entry_id) for h in entries])
        return {(h.stream, h.entry_id) for h, value in zip(entries, values) if _text(value) == self._id}

    async def _mark_stream(self, stream: str, entries: list[Held], replicas: int) -> set[Key]:
        args: list[Any] = [GROUP, self._id, self._keys.sent_prefix(stream), REPLY_MAXLEN]
        for held in entries:
            note = encode_reply(WireReply(held.job.correlation_id, sent_by=self._id))[FIELD]
            args += [held.entry_id, held.job.deadline_ms + MARKER_GRACE_MS, held.job.reply_to, note]
        if replicas:
            pipe = self._redis.pipeline(transaction=False)
            pipe.scripts.add(self._script)  # loaded first where the server does not know it
            pipe.evalsha(self._script.sha, 1, stream, *args)
            pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS, **await routed_to(self._redis, stream))
            marked, acknowledged = await pipe.execute()
            if not acknowledged:
                log.info("cluster_marker_unreplicated", stream=stream, wait_ms=REPLICA_WAIT_MS)
                self._replicas_checked = float("-inf")  # the replica may be gone: look again before the next mark
        else:
            marked = await self._script(keys=[stream], args=args)
        return {(stream, entry_id if isinstance(entry_id, bytes) else str(entry_id).encode())
                for entry_id in marked or []}

    async def _replica_count(self) -> int:
        """The replicas connected to the master now (ROLE), looked up every `REPLICAS_CHECK_S`; 0 where WAIT
        cannot be used or the server will not say (a managed Redis may refuse ROLE)."""
        if not self._can_wait or self._clock() - self._replicas_checked < REPLICAS_CHECK_S:
            return self._replicas
        self._replicas_checked = self._clock()
        try:
            role = await self._redis.execute_command("ROLE", **await routed_to(self._redis, self._keys.presence))
        except Exception:  # noqa: BLE001 - a refused ROLE only means no WAIT; a lost Redis shows in the mark
            self._replicas = 0
            return 0
        self._replicas = len(role[2]) if len(role) > 2 and _is_master(role[0]) and isinstance(role[2], list) else 0
        return self._replicas


def _is_master(kind: Any) -> bool:
    return _text(kind) == "master"


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else None if value is None else str(value)
