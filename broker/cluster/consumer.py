"""The worker's side of cluster mode: read jobs from the partitions it holds and feed today's queue.

Reading (`XREADGROUP`) goes realtime before standard before batch, and only while the worker holds
fewer than `prefetch` jobs: under load the backlog stays in Redis, where its length is exported. A
stream whose read came back full is read again on its own, with the whole room, so a backlog arrives
in one piece and merges as it would have in one process. Each job becomes a `ClusterJob` on the
worker's own `JobQueue` (merge windows, priority with aging, similarity, dispatch, breakers), so a
worker merges exactly as a single broker does. Identical jobs from any front-end share one job (the
flight key).

A job's merge window counts from when its front-end queued it, so cluster mode adds no hop to a window;
a job that arrives after its window would have closed still gets `server_time.late_grace` for the rest of its
backlog to join it, instead of leaving alone.

Every entry held is heartbeated (`holds`), and fenced: a job not yet sent upstream is dropped once its
entries went unheartbeated for `FENCE_SHARE` of `claim_idle_ms`, or at once when Redis is lost
(`fence_all`). A job goes upstream only after its entries' sent markers are written, and only for the
entries still this worker's (`markers`); its front-ends get a note that it was sent. Other workers'
jobs are claimed by `claims`' rule. An answer goes to the front-end's reply stream, then the entry is
acknowledged and deleted, in one round trip (`outbox`). A job already past its deadline is dropped
unanswered: its front-end has answered 504 by then.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import structlog
from redis.exceptions import RedisError, ResponseError

from mergebroker import tracing
from mergebroker.broker.cluster.claims import Claimer, HandBack
from mergebroker.broker.cluster.holds import FENCE_SHARE, HEARTBEAT, ClusterJob, Flight, Held, Holds, Key, fence_drops
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.markers import SentMarkers
from mergebroker.broker.cluster.outbox import Outbox
from mergebroker.broker.cluster.partition import GROUP, Keys
from mergebroker.broker.cluster.server_time import ServerClock, window_anchor
from mergebroker.broker.cluster.wire import WireJob, WireReply, decode_job, stream_pairs
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.chat.jobs import ChatOutcome, aged_rank
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import ClusterSettings, TierSettings
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.errors import BrokerError
from mergebroker.merge.shape import merge_shape
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger(__name__)

CONFIRM_RETRY_S = 0.1  # how often a worker asks again whether a mark whose reply was lost went through

OUTCOMES = ("answered", "failed", "expired", "coalesced", "unreadable", "withdrawn", "fenced", "taken_over")


class StreamConsumer:
    """Reads the held partitions' streams into `queue` and writes the answers back."""

    def __init__(self, redis: Any, queue: JobQueue, *, keys: Keys, settings: ClusterSettings,
                 tiers: list[TierSettings], leases: PartitionLeases, server_clock: ServerClock, consumer_id: str,
                 aging_per_s: float, metrics: Metrics, clock: Clock = monotonic,
                 sleep: Sleep = asyncio.sleep) -> None:
        self._redis = redis
        self._queue = queue
        self._keys = keys
        self._settings = settings
        self._tiers = sorted(tiers, key=lambda t: -t.priority)  # reading order: highest priority first
        self._tier_priority = {t.name: t.priority for t in tiers}
        self._windows = {t.name: t.window_ms / 1000 for t in tiers}
        self._leases = leases
        self._server_clock = server_clock
        self._id = consumer_id
        self._aging = aging_per_s
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._jobs = {o: metrics.cluster_jobs.labels(o) for o in OUTCOMES}
        self._held = Holds(clock=clock, fence_s=settings.claim_idle_ms * FENCE_SHARE / 1000,
                           count=lambda outcome: self._jobs[outcome].inc())
        self._flights: dict[str, Flight] = {}
        self._grouped: set[str] = set()
        self._backlog: set[str] = set()  # streams whose last read came back full: more is waiting there
        self._streams_of: frozenset[int] | None = None
        self._streams: dict[str, list[str]] = {}
        self._outbox = Outbox(keys)
        self._wrote = asyncio.Event()  # a write went through: room to read again
        self._claimer = Claimer(redis, keys, consumer_id, claim_idle_ms=settings.claim_idle_ms)
        self._markers = SentMarkers(redis, keys, consumer_id, clock=clock)
        self._heartbeat = redis.register_script(HEARTBEAT)
        self._hand_back = HandBack(redis, consumer_id)
        self._dead: dict[str, float] = {}  # workers found dead -> when: their entries are claimed at once

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

    @property
    def fenced_at(self) -> float:
        """When (local clock) this worker last dropped jobs at its fence: it may have to claim them back."""
        return self._held.fenced_at

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

        While some streams are backlogged, reads go tier by tier, realtime first, each over the tier's
        backlogged streams (or all its streams when none is), so a saturated worker takes the highest
        priority work and a backlog comes in whole; otherwise one read over every stream takes whatever
        arrived, in one round trip.
        """
        room = self._settings.prefetch - len(self._held)
        if room <= 0 or not self.streams():
            return 0
        await self._ensure_groups(self.streams())
        if self._backlog:
            for tier in self._tiers:
                streams = self.streams(tier.name)
                taken = await self._read([s for s in streams if s in self._backlog] or streams, room, None)
                if taken:
                    return taken
            self._backlog.clear()
        return await self._read(self.streams(), room, block_ms)

    async def _read(self, streams: list[str], room: int, block_ms: int | None) -> int:
        if not streams:
            return 0
        count = max(1, math.ceil(room / len(streams)))
        started = self._clock()
        try:
            response = await self._redis.xreadgroup(GROUP, self._id, dict.fromkeys(streams, ">"), count=count,
                                                    block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._grouped.clear()  # a stream was deleted (its group with it): create them again
            return 0
        pairs = stream_pairs(response)
        self._backlog.difference_update(streams)
        self._backlog.update(s for s, entries in pairs if len(entries) >= count)
        return self._accept_all(pairs, started)

    def _accept_all(self, pairs: Iterable[tuple[str, Any]], touched: float) -> int:
        taken = sum(self._accept(stream, entry_id, fields, touched) for stream, entries in pairs
                    for entry_id, fields in entries)
        self._held.arm()
        return taken

    def _accept(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes] | None, touched: float) -> int:
        if (stream, entry_id) in self._held:
            return 0  # claimed back while still held here
        if not fields:
            return 0  # deleted meanwhile (answered by its earlier owner)
        try:
            wire = decode_job(fields)
        except ValueError as exc:
            log.warning("cluster_job_unreadable", stream=stream, error=str(exc))
            self._jobs["unreadable"].inc()
            self._outbox.finish(Held(stream, entry_id, _placeholder()), None)
            return 0
        held = Held(stream, entry_id, wire, self._clock(), touched)
        if wire.deadline_ms <= self._server_clock.now_ms():
            self._jobs["expired"].inc()
            self._outbox.finish(held, None)
            return 0
        self._held.add(held)
        flight = self._flights.get(wire.flight_key)
        if flight is not None and not flight.job.future.done():
            self._join(flight, held)
            return 1
        job = self._chat_job(wire)
        flight = self._flights[wire.flight_key] = Flight(job, [held])
        held.flight = flight
        job.before_send = partial(self._mark, flight)
        job.on_sent = partial(self._sent, flight)
        try:
            future = self._queue.submit(job)
        except BrokerError as exc:  # the worker's own hard cap: the front-end hears it as it would in-process
            job.fail(exc)
            future = job.future
        future.add_done_callback(partial(self._answered, wire.flight_key, flight))
        return 1

    def _join(self, flight: Flight, held: Held) -> None:
        """An identical job from another front-end (or a retry) rides on the flight under way."""
        flight.entries.append(held)
        held.flight = flight
        flight.job.extend_deadline(self._server_clock.to_local(held.job.deadline_ms))
        self._jobs["coalesced"].inc()
        if flight.sent:
            self._outbox.sent(held, self._id, held.job.deadline_ms)

    def _chat_job(self, wire: WireJob) -> ClusterJob:
        # Priority ages from when the front-end queued the job; its window too, but for `late_grace`.
        now = self._clock()
        queued = self._server_clock.to_local(wire.enqueued_ms) if wire.enqueued_ms else now
        tier = wire.caller.tier
        body = wire.body
        return ClusterJob(request_id=wire.request_id, caller=wire.caller, body=body, model=body["model"],
                          priority=aged_rank(self._tier_priority.get(tier, 0), min(now, queued), self._aging),
                          shape=merge_shape(body) if wire.merge_key is not None else None, merge_key=wire.merge_key,
                          prompt_tokens=wire.prompt_tokens, max_tokens=wire.max_tokens,
                          deadline=self._server_clock.to_local(wire.deadline_ms),
                          enqueued_at=window_anchor(now, queued, self._windows.get(tier, 0.0)),
                          trace_context=tracing.from_traceparent(wire.traceparent))  # the caller's trace continues

    async def _mark(self, flight: Flight) -> bool:
        """The engine is about to send `flight` upstream: write its entries' sent markers first. An entry past
        the fence is dropped (`fenced`), one that is no longer this worker's (`taken_over`), and all of them
        when Redis cannot be reached (`fenced`: its front-ends serve what no worker sent). True when an entry
        is left to answer: only then does the job go."""
        for held in [h for h in flight.entries if self._held.stale(h)]:
            self._held.drop(held, "fenced")
        asked = list(flight.entries)
        if not asked:
            return False
        started, flight.marking = self._clock(), True
        try:
            marked = await self._markers.mark(asked)  # also a touch: their idle time starts again
        except RedisError as exc:
            # The script may have run before the reply was lost: what it wrote decides (`SentMarkers.confirm`).
            log.warning("cluster_marker_failed", request_id=flight.job.request_id, error=type(exc).__name__)
            marked, outcome = await self._confirmed_marks(flight, asked), "fenced"
        else:
            outcome = "taken_over"
        finally:
            flight.marking = False
        for held in asked:
            if (held.stream, held.entry_id) in marked:
                held.touched_at = max(held.touched_at, started)
                held.noted = True
            else:
                self._held.drop(held, outcome)
        self._held.arm()
        return bool(flight.entries)

    async def _confirmed_marks(self, flight: Flight, asked: list[Held]) -> set[Key]:
        """The entries of `asked` a mark whose reply was lost did mark, looked up once Redis answers (tried
        every `CONFIRM_RETRY_S`); none once the job's deadline has passed (its front-end answered by then)."""
        while self._clock() < flight.job.deadline:
            try:
                marked = await self._markers.confirm(asked)
            except RedisError:
                await self._sleep(CONFIRM_RETRY_S)
                continue
            log.info("cluster_marker_confirmed", request_id=flight.job.request_id, marked=len(marked),
                     asked=len(asked))
            return marked
        return set()

    def _sent(self, flight: Flight) -> None:
        """The engine is sending `flight` upstream: an entry that joined while `_mark` ran gets its marker and
        note now (`_mark` wrote those of the others)."""
        for held in flight.entries:
            if self._held.stale(held) and not held.noted:  # the fence drops such jobs first: a bug if ever seen
                log.warning("cluster_sent_after_fence", request_id=held.job.request_id)
            if not held.noted:
                self._outbox.sent(held, self._id, held.job.deadline_ms)

    def _answered(self, key: str, flight: Flight, future: asyncio.Future[ChatOutcome]) -> None:
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
            self._outbox.finish(held, WireReply(held.job.correlation_id, outcome=outcome, error=error,
                                                worker_s=self._clock() - held.read_at, settles=settles))
        if settles:  # released early: the provider's usage follows when the merged call ends
            targets = [(h.job.reply_to, h.job.correlation_id) for h in flight.entries]
            outcome.settled_usage.add_done_callback(partial(self._settled, targets))  # type: ignore[union-attr]

    def _settled(self, targets: list[tuple[str, str]], usage: asyncio.Future[TokenUsage]) -> None:
        """Send the usage the provider reported for an answer released early (none if it never came: the
        front-end's ledger then keeps the counted usage)."""
        if usage.cancelled() or usage.exception() is not None:
            return
        for reply_to, cid in targets:
            self._outbox.note(reply_to, WireReply(cid, settled=usage.result()))

    async def write_once(self) -> int:
        """Send queued markers, notes and replies, then acknowledge and delete the answered entries, in one
        round trip; how many entries it finished. On a Redis error everything stays queued (and held, so
        heartbeated) for the next try."""
        finished = await self._outbox.flush(self._redis)
        for held in finished:
            self._held.finished(held)
        self._wrote.set()
        return len(finished)

    async def heartbeat_once(self) -> None:
        """Reset the idle time of every entry held that is still this worker's (see `Holds.heartbeat`)."""
        await self._held.heartbeat(self._redis, self._heartbeat, self._id)

    def fence_all(self) -> int:
        """Redis is lost: drop every job held that has not gone upstream (the front-ends serve them)."""
        return self._held.fence_all()

    def mark_dead(self, workers: Iterable[str]) -> None:
        """Workers found dead: their entries are claimed at once, even those that went upstream."""
        now = self._clock()
        self._dead.update(dict.fromkeys(workers, now))

    def _dead_now(self) -> set[str]:
        # After two claim periods the claim rule covers them anyway (their entries idle past claim_idle_ms).
        horizon = self._clock() - 2 * self._settings.claim_idle_ms / 1000
        self._dead = {w: at for w, at in self._dead.items() if at >= horizon}
        return set(self._dead)

    async def claim_once(self) -> int:
        """Take over the entries of the held partitions that `claims` allows: a dead worker's at once, a
        silent one's after `claim_idle_ms` (unless sent upstream), and this worker's own dropped ones."""
        room = self._settings.prefetch - len(self._held)
        streams = [s for s in self.streams() if s in self._grouped]
        if room <= 0 or not streams:
            return 0
        dead = self._dead_now()
        started = self._clock()
        pending = await self._claimer.scan(streams, dead=dead, count=room)
        held_ids: dict[str, set[bytes]] = {}
        for stream, entry_id in self._held.keys():
            held_ids.setdefault(stream, set()).add(entry_id)
        claimed = 0
        for stream, entries in pending.items():
            plan = self._claimer.plan(entries, held=held_ids.get(stream, set()), dead=dead, room=room - claimed)
            if plan:
                claimed += self._take_claimed(stream, await self._claimer.claim(stream, plan), started)
        return claimed

    def _take_claimed(self, stream: str, entries: list[tuple[bytes, dict[bytes, bytes]]], touched: float) -> int:
        entries = [(entry_id, fields) for entry_id, fields in entries if (stream, entry_id) not in self._held]
        if not entries:
            return 0
        log.info("cluster_jobs_claimed", stream=stream, count=len(entries))
        self._metrics.cluster_claims.inc(len(entries))
        return self._accept_all([(stream, entries)], touched)

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

    async def hand_back(self) -> int:
        """Stopping with jobs left that never went upstream: drop them (as the fence does) and make their
        entries claimable now, so the partitions' next owners take them on their next scan rather than after
        `claim_idle_ms`; how many entries went back. A job sent upstream (or being marked to be) stays: its
        marker keeps anyone from running it twice. On a Redis error they are claimed by the idle rule."""
        held = [h for key in list(self._held.keys()) if (h := self._held.get(key)) is not None]
        drops = fence_drops(held, math.inf, 0.0)
        by_stream: dict[str, list[bytes]] = {}
        for h in drops:
            self._held.drop(h, "fenced")
            by_stream.setdefault(h.stream, []).append(h.entry_id)
        handed = await self._hand_back(by_stream)
        if drops:
            log.info("cluster_jobs_handed_back", count=handed, dropped=len(drops))
        return handed

    async def wait_for_replies(self) -> None:
        """Return when something is waiting to be written."""
        if not self._outbox:
            await self._outbox.ready.wait()


def _placeholder() -> WireJob:
    """The stand-in for an unreadable entry: it is acknowledged and deleted, never answered."""
    return WireJob("", "", "", Caller("", ""), {}, None, "", 0, 0, 0)
