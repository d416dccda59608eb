"""`ClusterQueue`: the front-end's job queue in cluster mode (a `JobQueue`, like the in-process one).

`submit` hands the job to a writer task that adds it (`XADD`, pipelined with whatever else arrived in
the same loop turn) to its partition's stream of its tier; one reader task reads the front-end's own
reply stream and completes each job's future by correlation ID. The first reply wins; a later one (a
job answered twice after a claim, or one whose caller left) is dropped and counted.

Redis down, or no live worker (none renewed its liveness within `lease_ms`; `local_without_workers`):
the front-end falls back to its in-process queue (`local`, today's merge windows and workers, without the
similarity model), logs it and exports `cluster_fallback = 1`. New jobs go to the local queue. Jobs sent
and not yet answered are handed over (`inflight`): those a worker noted it sent upstream keep waiting for
that worker's reply, so no job goes upstream twice, unless the sender is found dead (`presence`); the
others wait for Redis, when the hand-over deletes their entries (no worker can mark them after that), reads
the replies that came meanwhile (with the workers' notes, `markers`) and moves the un-noted ones to the local
queue; past `failover_wait_s` without Redis they are served locally regardless. A probe every
`fallback_probe_s` (more often while only workers are missing) returns to cluster mode once Redis answers
again and a worker is alive.

Streaming jobs (a tier's `merge_streams`) always go to the local queue: their outcome is a live stream,
which a reply stream cannot carry.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import replace
from functools import partial
from typing import Any

import structlog
from redis.exceptions import RedisError

from mergebroker import tracing
from mergebroker.background import spawn
from mergebroker.broker.cluster.inflight import InFlight
from mergebroker.broker.cluster.partition import Keys, flight_key, partition_of
from mergebroker.broker.cluster.presence import DeathWatch, absent_workers
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.cluster.settlements import Settlements
from mergebroker.broker.cluster.wire import WireJob, decode_reply, encode_job, next_stream_id, stream_pairs
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.chat.jobs import ChatJob, ChatOutcome
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import ClusterSettings
from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.errors import Overloaded
from mergebroker.redis_connect import drop_connections
from mergebroker.tasks import stop_loops

log = structlog.get_logger(__name__)

REPLY_TTL_MS = 60_000  # a dead front-end's reply stream disappears after this; a live one renews it
TRIM_EVERY = 256  # replies read between two trims of the reply stream (a trim costs a round trip)
WITHDRAW_KEEP = 100_000  # entries to take back kept through an outage (each a few dozen bytes)
WORKERS_PROBE_S = 0.25  # how often a front-end without live workers looks for one (a worker renews this often)


class ClusterQueue:
    """Sends jobs to the workers through Redis Streams; falls back to `local` while Redis is unreachable.

    A `JobQueue` (contract in `broker.engine.chat.job_queue`). `owns_client`: `stop()` closes `redis` too.
    """

    def __init__(self, redis: Any, local: JobQueue, *, keys: Keys, settings: ClusterSettings, partitions: int,
                 server_clock: ServerClock, metrics: Metrics, sleep: Sleep = asyncio.sleep,
                 frontend_id: str | None = None, owns_client: bool = False, clock: Clock = monotonic) -> None:
        self._redis = redis
        self._clock = clock
        self._owns_client = owns_client
        self._local = local
        self._keys = keys
        self._settings = settings
        self._partitions = partitions
        self._server_clock = server_clock
        self._metrics = metrics
        self._sleep = sleep
        self._reply_stream = keys.replies(frontend_id or uuid.uuid4().hex[:16])
        self._reply_cursor: Any = "0-0"  # the last reply read (by the reply loop or a hand-over)
        self._inflight = InFlight()  # jobs sent and not answered
        self._deaths = DeathWatch()  # senders missing from Redis, dead once missing for its confirmation window
        self._withdrawn: list[tuple[str, Any]] = []  # entries of jobs served elsewhere or abandoned, to delete
        self._settlements = Settlements(clock)  # usage to come of answers released early
        self._outbox: list[ChatJob] = []
        self._outbox_ready = asyncio.Event()
        self._fallback = False
        self._fallback_reason = ""  # "redis" | "no_workers"
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        metrics.cluster_fallback.set(0)

    @property
    def in_fallback(self) -> bool:
        """True while Redis is unreachable and jobs go to the local queue."""
        return self._fallback

    def submit(self, job: ChatJob) -> asyncio.Future[ChatOutcome]:
        """Queue `job` for the cluster (or the local queue in fallback); its future carries the answer."""
        if self._closed:
            raise Overloaded("The broker is shutting down.", retry_after=1)
        if self._fallback or job.stream:  # a stream cannot cross Redis: merged streams merge on this front-end
            return self._local.submit(job)
        self._outbox.append(job)
        self._outbox_ready.set()
        return job.future

    def extend(self, job: ChatJob, deadline: float) -> bool:
        """Extend a job still in this front-end (not yet added to its stream); False once it was sent."""
        return job.extend_deadline(deadline)

    def run_now(self, job: ChatJob) -> Awaitable[None] | None:
        """In fallback, the local queue's run (`LocalJobQueue.run_now`); else None: jobs go to the cluster."""
        return self._local.run_now(job) if self._fallback and not self._closed else None

    def depth(self, tier: str) -> int:
        """Jobs of `tier` waiting here: in the local queue, or about to be sent (the rest is in Redis)."""
        return self._local.depth(tier) + sum(1 for j in self._outbox if j.tier == tier)

    def start(self) -> None:
        self._local.start()
        loops = [("send", self._send_loop()), ("replies", self._reply_loop())]
        if self._settings.local_without_workers:
            loops.append(("workers", self._watch_workers()))
        for name, coro in loops:
            spawn(self._tasks, coro, f"cluster-{name}")

    def alive(self) -> bool:
        return self._local.alive() and len(self._tasks) == (3 if self._settings.local_without_workers else 2)

    async def stop(self) -> None:
        """Refuse new jobs, answer the waiting ones with `Overloaded`, stop the loops and the local queue."""
        self._closed = True
        self._outbox_ready.set()
        # Each loop ends after its current blocking read: cancelling redis-py in the middle of one can leave
        # the task waiting on its connection for seconds.
        stuck = await stop_loops(set(self._tasks), grace_s=self._settings.block_ms / 1000 + 0.5)
        if stuck:
            log.error("cluster_loops_stuck", loops=sorted(t.get_name() for t in stuck))
        for job in self._outbox + self._inflight.jobs():
            job.fail(Overloaded("The broker is shutting down.", retry_after=1))
        self._outbox.clear()
        self._inflight.clear()
        self._settlements.cancel_all()  # the ledger keeps the counted usage
        await self._local.stop()
        try:
            await self._redis.delete(self._reply_stream)
        except RedisError:
            pass
        if self._owns_client:
            await self._redis.aclose()

    async def _send_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            if self._closed:
                return
            self._outbox_ready.clear()
            batch, self._outbox = self._outbox, []
            live = [j for j in batch if not j.future.done()]  # callers gone before sending: dropped
            unsent = await self._send(live) if live else None
            if unsent is not None:
                self._fall_back(unsent, "redis")
            if self._withdrawn:
                await self._withdraw()

    async def _send(self, jobs: list[ChatJob]) -> list[ChatJob] | None:
        """Add `jobs` to their streams in one round trip; None when sent, else the jobs left to serve locally.

        A job is awaited by correlation ID before it is sent (its reply may come before `execute`
        returns); on failure only the jobs still awaited here are returned, the others were moved already.
        """
        sent: list[tuple[str, ChatJob]] = []
        try:
            if not self._server_clock.synced:
                await self._server_clock.sync(self._redis)
            pipe = self._redis.pipeline(transaction=False)
            streams = []
            for job in jobs:
                wire = self._wire(job)
                self._inflight.add(wire.correlation_id, job, self._clock())
                job.future.add_done_callback(partial(self._forget, wire.correlation_id))
                streams.append(self._keys.jobs(job.tier, partition_of(job.merge_key or wire.flight_key,
                                                                      self._partitions)))
                pipe.xadd(streams[-1], encode_job(wire))
                sent.append((wire.correlation_id, job))
            for (cid, _job), stream, entry_id in zip(sent, streams, await pipe.execute()):
                if not self._inflight.entry_added(cid, (stream, entry_id)):
                    # While it was being sent, every caller left or a fallback moved it to the local queue
                    # (or a worker answered it already: deleting is harmless).
                    self._withdrawn.append((stream, entry_id))
            return None
        except RedisError as exc:
            log.info("cluster_send_failed", error=type(exc).__name__, jobs=len(jobs))
            if not sent:
                return jobs
            return [job for cid, job in sent if self._inflight.pop(cid) is not None]

    def _forget(self, cid: str, future: Any) -> None:
        awaited = self._inflight.pop(cid)
        entry = awaited.entry if awaited is not None else None
        if entry is not None and future.cancelled():
            # Every caller left (SingleFlight cancelled the job): take it back from its stream, so a
            # worker that has not read it yet never makes the upstream call (in-process, the queue drops
            # such a job before dispatch). A worker already holding it answers into the void.
            self._withdrawn.append(entry)
            self._outbox_ready.set()

    async def _withdraw(self) -> bool:
        """Delete the entries of jobs served elsewhere or abandoned; False (they stay queued) if Redis is away."""
        batch, self._withdrawn = self._withdrawn, []
        pipe = self._redis.pipeline(transaction=False)
        for stream, entry_id in batch:
            pipe.xdel(stream, entry_id)
        try:
            await pipe.execute()
        except RedisError:
            # Redis is away: try again when it is back (the probe does), before any worker reads them.
            self._withdrawn = (batch + self._withdrawn)[-WITHDRAW_KEEP:]
            return False
        return True

    def _wire(self, job: ChatJob) -> WireJob:
        deadline = job.mark_sent()  # its deadline leaves with it
        return WireJob(correlation_id=uuid.uuid4().hex, reply_to=self._reply_stream, request_id=job.request_id,
                       caller=job.caller, body=job.body, merge_key=job.merge_key,
                       flight_key=flight_key(job.caller.tenant, job.tier, job.merge_key is not None, job.body),
                       prompt_tokens=job.counted_prompt(), max_tokens=job.max_tokens,
                       deadline_ms=self._server_clock.to_server_ms(deadline),
                       enqueued_ms=self._server_clock.to_server_ms(job.enqueued_at),
                       traceparent=tracing.traceparent(job.trace_context))

    async def _reply_loop(self) -> None:
        since_trim = 0
        while not self._closed:
            if self._fallback:
                await self._probe()
                continue
            try:
                response = await self._redis.xread({self._reply_stream: self._reply_cursor}, count=512,
                                                   block=self._settings.block_ms)
            except RedisError as exc:
                log.info("cluster_replies_failed", error=type(exc).__name__)
                self._fall_back([], "redis")
                continue
            except Exception:  # noqa: BLE001 - a dead reply loop would leave every caller waiting out its deadline
                log.exception("cluster_replies_crashed")
                self._fall_back([], "redis")  # serve in-process; the probe brings the cluster back
                continue
            for _stream, entries in stream_pairs(response):
                for entry_id, fields in entries:
                    self._reply_cursor = entry_id
                    since_trim += 1
                    self._deliver(fields)
            if since_trim >= TRIM_EVERY or (since_trim and not response):  # many read, or idle now
                since_trim = 0
                await self._trim(self._reply_cursor)

    def _deliver(self, fields: dict[bytes, bytes]) -> None:
        try:
            reply = decode_reply(fields)
        except ValueError as exc:
            log.warning("cluster_reply_unreadable", error=str(exc))
            return
        if reply.sent_by is not None:  # a worker sent it upstream: only that worker may answer it now
            self._inflight.note(reply.correlation_id, reply.sent_by)
            return
        if reply.settled is not None:  # the reported usage of an answer released early, delivered before
            self._settlements.settle(reply.correlation_id, reply.settled)
            return
        awaited = self._inflight.pop(reply.correlation_id)
        if awaited is None or awaited.job.future.done():
            self._metrics.cluster_duplicates_dropped.inc()
            return
        job = awaited.job
        self._metrics.cluster_hop.observe(max(0.0, self._clock() - awaited.sent_at - reply.worker_s))
        if reply.outcome is not None:
            outcome = reply.outcome
            if reply.settles:
                outcome = replace(outcome, settled_usage=self._settlements.expect(reply.correlation_id, job.deadline))
            job.resolve(outcome)
        else:
            job.fail(reply.error)  # type: ignore[arg-type]

    async def _trim(self, last_id: Any) -> None:
        """Drop what was read (later ones stay) and keep the stream's expiry renewed while this front-end lives."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xtrim(self._reply_stream, minid=next_stream_id(last_id))
        pipe.pexpire(self._reply_stream, REPLY_TTL_MS)
        try:
            await pipe.execute()
        except RedisError:
            pass  # the next read notices

    def _fall_back(self, unsent: list[ChatJob], reason: str, dead: set[str] | frozenset[str] = frozenset()) -> None:
        """Serve `unsent`, and every awaited job no worker will answer (`InFlight.release`), from the local
        queue, and stay local until Redis is back and a worker alive (`reason`: "redis" or "no_workers")."""
        released, entries = self._inflight.release_noted_by(dead)
        self._inflight.hold_unnoted(self._clock(), self._settings.failover_wait_s)  # until the hand-over
        moved = unsent + released + self._outbox
        if not self._fallback:
            self._fallback, self._fallback_reason = True, reason
            # Redis lost is an outage; no worker yet is also what a deployment starting up looks like.
            (log.error if reason == "redis" else log.warning)("cluster_fallback", reason=reason,
                                                              message=_FALLBACK_MESSAGES[reason], moved=len(moved),
                                                              awaiting_workers=len(self._inflight))
            self._metrics.cluster_fallback.set(1)
            self._metrics.cluster_fallback_transitions.labels("local").inc()
        # Take the moved jobs back from their streams (now, or once Redis answers again): a worker reading
        # them later must not run them.
        self._withdrawn.extend(entries)
        self._outbox_ready.set()
        self._outbox = []
        self._serve_locally(moved)

    def _serve_locally(self, jobs: list[ChatJob]) -> None:
        for job in (j for j in jobs if not j.future.done()):
            try:
                self._local.submit(job)
            except Overloaded as exc:
                job.fail(exc)

    async def _hand_over(self) -> None:
        """Serve here the held jobs no worker sent upstream: delete their entries, then read the replies that
        came meanwhile, in one round trip. A worker's mark and note are one script, so each job was either
        noted before its deletion, and the note is read here (it keeps waiting for that worker's reply), or
        can no longer be marked. Raises the client's error when Redis cannot be reached (nothing moved)."""
        held = self._inflight.held()
        if not held:
            return
        pipe = self._redis.pipeline(transaction=False)
        for stream, entry_id in self._inflight.entries_of(held):
            pipe.xdel(stream, entry_id)
        pipe.xrange(self._reply_stream, min=next_stream_id(self._reply_cursor))
        replies = (await pipe.execute())[-1]
        for entry_id, fields in replies or []:
            self._reply_cursor = entry_id
            self._deliver(fields)
        moved = self._inflight.release_unnoted(held)
        log.info("cluster_handed_over", served_here=len(moved), awaiting_workers=len(self._inflight))
        self._serve_locally(moved)

    async def _probe(self) -> None:
        await self._sleep(self._settings.fallback_probe_s if self._fallback_reason == "redis"
                          else min(self._settings.fallback_probe_s, WORKERS_PROBE_S))
        try:
            if self._fallback_reason == "redis":
                await drop_connections(self._redis)  # connections from before the outage are stale
                await self._redis.ping()
                await self._server_clock.sync(self._redis)
                self._fallback_reason = "no_workers"  # Redis is back; a worker must be too
            await self._hand_over()
            if self._withdrawn and not await self._withdraw():
                return
            dead = await self._dead_senders()
            if dead:  # jobs a worker sent upstream wait for its reply, unless it died meanwhile
                self._fall_back([], self._fallback_reason or "no_workers", dead)
            if self._settings.local_without_workers and not await self._workers_alive():
                return
        except RedisError:
            overdue, entries = self._inflight.release_overdue(self._clock())  # Redis stays away: serve them here
            self._withdrawn.extend(entries)
            self._serve_locally(overdue)
            return
        self._fallback = False
        log.info("cluster_resumed", message="Redis and a worker are back: sending jobs to the cluster again.")
        self._metrics.cluster_fallback.set(0)
        self._metrics.cluster_fallback_transitions.labels("cluster").inc()

    async def _watch_workers(self) -> None:
        """Every `fallback_probe_s`: with no live worker, jobs sent to Redis would wait there until their
        deadline, so serve locally instead (Redis trouble is noticed by the other loops)."""
        while not self._closed:  # checked at once on start: a front-end up before its workers serves locally
            if not self._fallback:
                try:
                    if not await self._workers_alive() and not self._fallback:
                        self._fall_back([], "no_workers", await self._dead_senders())
                except RedisError:
                    pass  # the send and reply loops notice Redis trouble
            await self._sleep(self._settings.fallback_probe_s)

    async def _dead_senders(self) -> set[str]:
        """Workers that sent awaited jobs upstream and died since (`presence`, confirmed over `DeathWatch`'s
        window: right after a failover no worker is registered yet), whose jobs are served here."""
        senders = self._inflight.senders()
        absent = senders & await absent_workers(self._redis, self._keys, me="") if senders else set()
        return self._deaths.observe(absent, self._clock())

    async def _workers_alive(self) -> bool:
        """Whether some worker renewed its liveness (`PartitionLeases`) within the last `lease_ms`."""
        if not self._server_clock.synced:
            await self._server_clock.sync(self._redis)
        since = self._server_clock.now_ms() - self._settings.lease_ms
        return bool(await self._redis.zcount(self._keys.workers, since, "+inf"))


_FALLBACK_MESSAGES = {
    "redis": "Redis is unreachable: merging in-process until it is back.",
    "no_workers": "No cluster worker is alive: merging in-process until one is back.",
}
