"""The worker's side of cluster mode: read jobs from the partitions it holds and feed today's queue.

Reading (`XREADGROUP`) goes realtime before standard before batch, and only while the worker holds
fewer than `prefetch` jobs: under load the backlog stays in Redis, where its length is exported. Each
job becomes a `ChatJob` on the worker's own `JobQueue` (merge windows, priority with aging, similarity,
dispatch, breakers), so a worker merges exactly as a single broker does. Identical jobs from any
front-end share one `ChatJob` (the flight key).

Every job held is heartbeated (`XCLAIM ... JUSTID` by its own consumer resets its idle time), so a
long upstream call is never taken for a dead worker's. A dead worker's jobs idle past `claim_idle_ms`
are taken over (`XAUTOCLAIM`) by whoever holds their partition now. An answer goes to the front-end's
reply stream, then the job is acknowledged and deleted, in one round trip. A job already past its
deadline is dropped unanswered: its front-end has answered 504 by then.
"""

from __future__ import annotations

import asyncio
import math
from functools import partial
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.exceptions import RedisError, ResponseError

from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.partition import GROUP, Keys
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.cluster.wire import WireJob, WireReply, decode_job, encode_reply
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome, aged_rank
from mergebroker.broker.engine.metrics import Metrics
from mergebroker.broker.engine.settings import ClusterSettings, TierSettings
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError
from mergebroker.merge.shape import merge_shape

log = structlog.get_logger(__name__)

REPLY_MAXLEN = 10_000  # a reply stream is read as it fills; this only bounds an abandoned one
HEARTBEAT_SHARE = 1 / 3  # held jobs are heartbeated every claim_idle_ms x this


@dataclass(eq=False)
class _Held:
    """One stream entry this worker is answering."""

    stream: str
    entry_id: bytes
    job: WireJob
    read_at: float = 0.0


@dataclass(eq=False)
class _Flight:
    job: ChatJob
    entries: list[_Held] = field(default_factory=list)


class StreamConsumer:
    """Reads the held partitions' streams into `queue` and writes the answers back."""

    def __init__(self, redis: Any, queue: JobQueue, *, keys: Keys, settings: ClusterSettings,
                 tiers: list[TierSettings], leases: PartitionLeases, server_clock: ServerClock, consumer_id: str,
                 aging_per_s: float, metrics: Metrics, clock: Clock = monotonic) -> None:
        self._redis = redis
        self._queue = queue
        self._keys = keys
        self._settings = settings
        self._tiers = sorted(tiers, key=lambda t: -t.priority)  # reading order: highest priority first
        self._tier_priority = {t.name: t.priority for t in tiers}
        self._leases = leases
        self._server_clock = server_clock
        self._id = consumer_id
        self._aging = aging_per_s
        self._metrics = metrics
        self._clock = clock
        self._held: dict[tuple[str, bytes], _Held] = {}
        self._flights: dict[str, _Flight] = {}
        self._grouped: set[str] = set()
        self._backlogged = False  # the last read filled its count on some stream: more may be waiting
        self._streams_of: frozenset[int] | None = None
        self._streams: dict[str, list[str]] = {}
        self._outbox: list[tuple[_Held, WireReply]] = []
        self._notes: list[tuple[str, dict[bytes, bytes]]] = []  # (reply stream, fields) of settled usages
        self._wrote = asyncio.Event()  # a reply was written: room to read again
        self._outbox_ready = asyncio.Event()
        self._jobs = {o: metrics.cluster_jobs.labels(o) for o in
                      ("answered", "failed", "expired", "coalesced", "unreadable", "withdrawn")}

    @property
    def tier_names(self) -> list[str]:
        """Tier names in reading order."""
        return [t.name for t in self._tiers]

    def server_now_ms(self) -> int:
        return self._server_clock.now_ms()

    @property
    def held(self) -> int:
        """Jobs read and not yet answered."""
        return len(self._held)

    def streams(self, tier: str | None = None) -> list[str]:
        """The job streams of the partitions held now (of one tier, or all, highest priority first)."""
        owned = self._leases.owned
        if owned != self._streams_of:  # rebuilt only when the partitions change: reads call this often
            self._streams_of = owned
            self._streams = {t.name: [self._keys.jobs(t.name, p) for p in sorted(owned)] for t in self._tiers}
            self._streams[""] = [s for t in self._tiers for s in self._streams[t.name]]
        return self._streams[tier or ""]

    async def read_once(self, block_ms: int | None) -> int:
        """One read; jobs taken. Blocks up to `block_ms` for new jobs (None: never).

        While a stream has more than one read takes (a backlog), reads go tier by tier, realtime first,
        so a saturated worker takes the highest priority work; otherwise one read over every stream
        takes whatever arrived, in one round trip.
        """
        room = self._settings.prefetch - len(self._held)
        if room <= 0 or not self.streams():
            return 0
        await self._ensure_groups(self.streams())
        if self._backlogged:
            for tier in self._tiers:
                taken = await self._read(self.streams(tier.name), room, None)
                if taken:
                    return taken
            self._backlogged = False
        return await self._read(self.streams(), room, block_ms)

    async def _read(self, streams: list[str], room: int, block_ms: int | None) -> int:
        if not streams:
            return 0
        count = max(1, math.ceil(room / len(streams)))
        try:
            response = await self._redis.xreadgroup(GROUP, self._id, dict.fromkeys(streams, ">"), count=count,
                                                    block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._grouped.clear()  # a stream was deleted (its group with it): create them again
            return 0
        pairs = _by_stream(response or [])
        self._backlogged = self._backlogged or any(len(entries) >= count for _s, entries in pairs)
        return self._accept_all(pairs)

    def _accept_all(self, pairs: list[tuple[str, Any]]) -> int:
        taken = 0
        for stream, entries in pairs:
            for entry_id, fields in entries:
                taken += self._accept(stream, entry_id, fields)
        return taken

    def _accept(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes] | None) -> int:
        if (stream, entry_id) in self._held:
            return 0  # claimed back while still held here
        if not fields:
            return 0  # deleted meanwhile (answered by its earlier owner)
        try:
            wire = decode_job(fields)
        except ValueError as exc:
            log.warning("cluster_job_unreadable", stream=stream, error=str(exc))
            self._jobs["unreadable"].inc()
            self._finish(_Held(stream, entry_id, _placeholder()), None)
            return 0
        held = _Held(stream, entry_id, wire, self._clock())
        if wire.deadline_ms <= self._server_clock.now_ms():
            self._jobs["expired"].inc()
            self._finish(held, None)
            return 0
        self._held[(stream, entry_id)] = held
        flight = self._flights.get(wire.flight_key)
        if flight is not None and not flight.job.future.done():
            flight.entries.append(held)
            flight.job.extend_deadline(self._server_clock.to_local(wire.deadline_ms))
            self._jobs["coalesced"].inc()
            return 1
        job = self._chat_job(wire)
        flight = self._flights[wire.flight_key] = _Flight(job, [held])
        try:
            future = self._queue.submit(job)
        except BrokerError as exc:  # the worker's own hard cap: the front-end hears it as it would in-process
            job.fail(exc)
            future = job.future
        future.add_done_callback(partial(self._answered, wire.flight_key, flight))
        return 1

    def _chat_job(self, wire: WireJob) -> ChatJob:
        # The job keeps the time its front-end queued it, so its merge window and its priority aging count
        # the trip through Redis as time already waited: cluster mode adds no hop to a window that opens.
        now = self._clock()
        enqueued = min(now, self._server_clock.to_local(wire.enqueued_ms)) if wire.enqueued_ms else now
        body = wire.body
        return ChatJob(request_id=wire.request_id, caller=wire.caller, body=body, model=body["model"],
                       priority=aged_rank(self._tier_priority.get(wire.caller.tier, 0), enqueued, self._aging),
                       shape=merge_shape(body) if wire.merge_key is not None else None, merge_key=wire.merge_key,
                       prompt_tokens=wire.prompt_tokens, max_tokens=wire.max_tokens,
                       deadline=self._server_clock.to_local(wire.deadline_ms), enqueued_at=enqueued)

    def _answered(self, key: str, flight: _Flight, future: asyncio.Future[ChatOutcome]) -> None:
        """Reply to every entry of `flight`; bound to the flight itself, because a newer flight may own
        `key` already (an identical job read after this one's answer was set, before this callback ran)."""
        if self._flights.get(key) is flight:
            del self._flights[key]
        if future.cancelled():
            error: BrokerError | None = BrokerError("The worker stopped before answering.", status=503)
            outcome = None
        else:
            exc = future.exception()
            error = exc if isinstance(exc, BrokerError) or exc is None else BrokerError(
                f"The worker failed ({type(exc).__name__}).")
            outcome = None if exc is not None else future.result()
        settles = outcome is not None and outcome.settled_usage is not None
        for held in flight.entries:
            self._jobs["failed" if error else "answered"].inc()
            self._finish(held, WireReply(held.job.correlation_id, outcome=outcome, error=error,
                                         worker_s=self._clock() - held.read_at, settles=settles))
        if settles:  # released early: the provider's usage follows when the merged call ends
            targets = [(h.job.reply_to, h.job.correlation_id) for h in flight.entries]
            outcome.settled_usage.add_done_callback(partial(self._settled, targets))  # type: ignore[union-attr]

    def _settled(self, targets: list[tuple[str, str]], usage: asyncio.Future[dict[str, int]]) -> None:
        """Send the usage the provider reported for an answer released early (none if it never came: the
        front-end's ledger then keeps the counted usage)."""
        if usage.cancelled() or usage.exception() is not None:
            return
        for reply_to, cid in targets:
            self._notes.append((reply_to, encode_reply(WireReply(cid, settled=usage.result()))))
        self._outbox_ready.set()

    def _finish(self, held: _Held, reply: WireReply | None) -> None:
        """Queue the reply (None: none) and the acknowledgement for the writer."""
        self._outbox.append((held, reply))  # type: ignore[arg-type]
        self._outbox_ready.set()

    async def write_once(self) -> None:
        """Send queued replies, then acknowledge and delete their entries, in one round trip.

        On a Redis error they stay queued (and held, so heartbeated) for the next try.
        """
        batch, self._outbox = self._outbox, []
        notes, self._notes = self._notes, []
        self._outbox_ready.clear()
        if not batch and not notes:
            return
        pipe = self._redis.pipeline(transaction=False)
        for reply_to, fields in notes:
            pipe.xadd(reply_to, fields, maxlen=REPLY_MAXLEN, approximate=True)
        for held, reply in batch:
            if reply is not None:
                pipe.xadd(held.job.reply_to, encode_reply(reply), maxlen=REPLY_MAXLEN, approximate=True)
            pipe.xack(held.stream, GROUP, held.entry_id)
            pipe.xdel(held.stream, held.entry_id)
        try:
            await pipe.execute()
        except RedisError:
            self._outbox = batch + self._outbox
            self._notes = notes + self._notes
            raise
        for held, _reply in batch:
            self._held.pop((held.stream, held.entry_id), None)
        self._wrote.set()

    async def heartbeat_once(self) -> None:
        """Reset the idle time of every job held, so none is claimed while it is being answered.

        An entry the heartbeat no longer finds was deleted by its front-end, whose callers all left
        (`XCLAIM` skips deleted entries): its job is dropped here too if it has not been sent upstream.
        """
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in list(self._held):
            by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return
        pipe = self._redis.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self._id, 0, ids, justid=True)
        for (stream, ids), kept in zip(by_stream.items(), await pipe.execute(raise_on_error=False)):
            if isinstance(kept, list):
                for entry_id in set(ids) - set(kept):
                    self._withdrawn(stream, entry_id)

    def _withdrawn(self, stream: str, entry_id: bytes) -> None:
        held = self._held.pop((stream, entry_id), None)
        flight = self._flights.get(held.job.flight_key) if held is not None else None
        if flight is None or held not in flight.entries:
            return  # answered meanwhile (this worker deleted it), or never part of a live flight
        flight.entries.remove(held)
        if not flight.entries and not flight.job.dispatched:
            self._jobs["withdrawn"].inc()
            flight.job.future.cancel()  # the queue drops a cancelled job before dispatch

    async def claim_once(self) -> int:
        """Take over the jobs of the held partitions that idled past `claim_idle_ms` (a dead worker's), and
        sooner those of a worker that has left the live set (see `_claim_departed`)."""
        room = self._settings.prefetch - len(self._held)
        streams = [s for s in self.streams() if s in self._grouped]
        if room <= 0 or not streams:
            return 0
        claimed = await self._claim_departed(streams, room)
        room -= claimed
        if room <= 0:
            return claimed
        pipe = self._redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xautoclaim(stream, GROUP, self._id, self._settings.claim_idle_ms, "0-0", count=room)
        for stream, result in zip(streams, await pipe.execute(raise_on_error=False)):
            if isinstance(result, Exception) or not result or not result[1]:
                continue
            claimed += self._take_claimed(stream, result[1])
        return claimed

    async def _claim_departed(self, streams: list[str], room: int) -> int:
        """Claim at once the jobs of consumers that are no longer live workers and stopped heartbeating.

        A worker silent for a whole lease is gone from the live set (`PartitionLeases.live_workers`); a
        job it holds whose idle time exceeds two heartbeat periods is not being worked on anywhere (a live
        worker, even one draining after it left the set, heartbeats every job it holds each period). So a
        dead worker's jobs move as soon as its partitions do, rather than after the full `claim_idle_ms`,
        which stays the rule for consumers still in the set (a live but stalled one gets that much grace).
        """
        live = self._leases.live_workers
        if not live:
            return 0  # no renewal seen yet: nobody is known to be gone
        idle_ms = int(self._settings.claim_idle_ms * HEARTBEAT_SHARE * 2)
        pipe = self._redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending_range(stream, GROUP, "-", "+", room, idle=idle_ms)
        me = self._id.encode()
        orphans: dict[str, list[bytes]] = {}
        for stream, pending in zip(streams, await pipe.execute(raise_on_error=False)):
            if isinstance(pending, Exception):
                continue
            ids = [p["message_id"] for p in pending if p["consumer"] not in live and p["consumer"] != me
                   and (stream, p["message_id"]) not in self._held]
            if ids:
                orphans[stream] = ids
        if not orphans:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for stream, ids in orphans.items():
            pipe.xclaim(stream, GROUP, self._id, idle_ms, ids)
        claimed = 0
        for stream, result in zip(orphans, await pipe.execute(raise_on_error=False)):
            if not isinstance(result, Exception) and result:
                claimed += self._take_claimed(stream, result)
        return claimed

    def _take_claimed(self, stream: str, result: list[Any]) -> int:
        entries = [(entry_id, fields) for entry_id, fields in result if (stream, entry_id) not in self._held]
        if not entries:
            return 0
        log.info("cluster_jobs_claimed", stream=stream, count=len(entries))
        self._metrics.cluster_claims.inc(len(entries))
        return self._accept_all([(stream, entries)])

    async def _ensure_groups(self, streams: list[str]) -> None:
        missing = [s for s in streams if s not in self._grouped]
        if not missing:
            return
        pipe = self._redis.pipeline(transaction=False)
        for stream in missing:
            pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for stream, result in zip(missing, await pipe.execute(raise_on_error=False)):
            if not isinstance(result, Exception) or "BUSYGROUP" in str(result):
                self._grouped.add(stream)

    async def wait_for_room(self) -> None:
        """Return when the worker holds fewer than `prefetch` jobs."""
        while len(self._held) >= self._settings.prefetch:
            self._wrote.clear()
            await self._wrote.wait()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until every job held is answered and written (True), or `timeout_s` passed (False)."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._held:
                    self._wrote.clear()
                    await self._wrote.wait()
        except TimeoutError:
            return False
        return True

    async def wait_for_replies(self) -> None:
        """Return when a reply (or an acknowledgement) is waiting to be written."""
        if not self._outbox and not self._notes:
            await self._outbox_ready.wait()


def _by_stream(response: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes] | None]]]]:
    """`XREADGROUP`'s answer (a list of pairs in RESP2, a mapping in RESP3) as (stream name, entries)."""
    pairs = response.items() if isinstance(response, dict) else response
    return [(s.decode() if isinstance(s, bytes) else s, entries) for s, entries in pairs]


def _placeholder() -> WireJob:
    """The stand-in for an unreadable entry: it is acknowledged and deleted, never answered."""
    return WireJob("", "", "", Caller("", ""), {}, None, "", 0, 0, 0)
