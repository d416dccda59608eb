"""`ClusterWorker`: the background loops of one worker process around its `StreamConsumer`.

Loops, each in its own task: lease renewal, reading, writing, heartbeats, presence (every `PRESENCE_S`:
refresh this worker's own, find dead workers and take their partitions and jobs at once), claiming
(scans only while orphans can be expected, see `claim_due`), and a slow one exporting each held
partition's backlog, pending count and lag. A Redis error in any loop is retried after a short pause;
`Outage` logs one warning per outage and, when Redis cannot be reached, has the consumer drop the jobs
it has not sent upstream (the front-ends serve those). The worker never exits because Redis went away
(its leases lapse, and it takes partitions again when Redis is back).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from redis.exceptions import RedisError

from mergebroker.broker.cluster.consumer import StreamConsumer
from mergebroker.broker.cluster.holds import HEARTBEAT_SHARE
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.outage import Outage
from mergebroker.broker.cluster.partition import GROUP, Keys
from mergebroker.broker.cluster.presence import PRESENCE_S, DeathWatch, Presence, absent_workers
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.settings import ClusterSettings
from mergebroker.clock import Clock, Sleep, monotonic, sleep_or_event
from mergebroker.tasks import stop_loops

log = structlog.get_logger(__name__)

METRICS_INTERVAL_S = 5.0
RETRY_PAUSE_S = 0.2
DRAIN_S = 20.0  # how long a stopping worker finishes its jobs (orchestrators allow ~30 s before SIGKILL)
SAFETY_SCAN_EVERY = 10  # claim_idle_ms periods between two orphan scans when none is expected
READ_BLOCK_CAP_MS = 250  # a blocking read ends this soon at the latest, so partitions just acquired are read


def claim_due(now: float, orphans_at: float, last_scan_at: float, claim_idle_s: float) -> bool:
    """Whether to scan the held streams for orphaned jobs now.

    Orphans appear only when a partition changes hands, a worker disappears or this one fenced its own,
    and become claimable at most `claim_idle_s` later: scanning for twice that after such an event finds
    them, and scanning costs one command per stream, so in between a rare safety scan is enough.
    """
    return now - orphans_at <= 2 * claim_idle_s or now - last_scan_at >= SAFETY_SCAN_EVERY * claim_idle_s


class ClusterWorker:
    """Runs a consumer's loops; `start()` and `stop()` from the worker's lifecycle."""

    def __init__(self, redis: Any, consumer: StreamConsumer, leases: PartitionLeases, *, keys: Keys,
                 settings: ClusterSettings, metrics: Metrics, sleep: Sleep = asyncio.sleep,
                 clock: Clock = monotonic, drain_s: float = DRAIN_S, presence: Presence | None = None,
                 worker_id: str = "") -> None:
        self._redis = redis
        self._consumer = consumer
        self._leases = leases
        self._keys = keys
        self._settings = settings
        self._metrics = metrics
        self._sleep = sleep
        self._clock = clock
        self._presence = presence
        self._worker_id = worker_id
        self._deaths = DeathWatch()
        self._outage = Outage("worker", on_start=consumer.fence_all)
        self._last_scan_at = float("-inf")
        self._closed = False
        self._drain_s = drain_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops = 0
        self._leases_changed = asyncio.Event()
        self._claim_now = asyncio.Event()
        self._exported: set[tuple[str, str]] = set()

    def start(self) -> None:
        idle_s = self._settings.claim_idle_ms / 1000
        loops: dict[str, Callable[[], Awaitable[Any]]] = {
            "read": self._read, "write": self._write, "claim": self._claim,
            "heartbeat": lambda: self._every(idle_s * HEARTBEAT_SHARE, self._consumer.heartbeat_once),
            "backlog": lambda: self._every(METRICS_INTERVAL_S, self.export_backlog)}
        if self._presence is not None:  # registered at once: a worker killed in its first seconds is found too
            loops["presence"] = lambda: self._every(PRESENCE_S, self._watch_presence, first_at_once=True)
        self._spawn("leases", self._leases.run(self._sleep, self._leases_changed, self._outage.failed))
        for name, loop in loops.items():
            self._spawn(name, loop())
        self._loops = len(self._tasks)

    def _spawn(self, name: str, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"cluster-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cluster_loop_crashed", loop=task.get_name(), error=repr(task.exception()))

    def alive(self) -> bool:
        """True while every loop runs (for /readyz)."""
        return self._loops > 0 and len(self._tasks) == self._loops

    async def stop(self) -> None:
        """Stop reading, give the partitions back, finish the jobs held (up to `drain_s`), stop the loops.

        Other workers take the partitions at once; the jobs held here stay heartbeated while they finish,
        so none runs twice and no upstream call is wasted in a rolling restart. Jobs still held after
        `drain_s` that never went upstream are handed back (`StreamConsumer.hand_back`): the partitions'
        next owners claim them on their next scan. Those sent upstream are not: no one runs them twice.
        """
        self._closed = True  # the reader ends after its current read: cancelling a blocking read is slow
        await self._finish_tasks("cluster-read", self._read_block_ms() / 1000 + 0.5)
        await self._finish_tasks("cluster-leases", 0)
        try:
            await self._leases.release()
        except RedisError:
            pass  # they lapse on their own
        if not await self._consumer.drained(self._drain_s):
            await self._consumer.hand_back()  # the unsent ones: claimable now, not after claim_idle_ms
        await self._finish_tasks(None, 0)
        if self._presence is not None:
            try:
                await self._presence.withdraw()
            except RedisError:
                pass  # the others find the connection gone and call this worker dead: it holds nothing now
            await self._presence.aclose()

    async def _finish_tasks(self, name: str | None, wait_s: float) -> None:
        """Let the loop `name` (every loop: None) end by itself within `wait_s`, then cancel it."""
        tasks = {t for t in self._tasks if name is None or t.get_name() == name}
        stuck = await stop_loops(tasks, grace_s=wait_s)
        if stuck:
            log.error("cluster_loops_stuck", loops=sorted(t.get_name() for t in stuck))

    def _read_block_ms(self) -> int:
        # Short enough that partitions acquired meanwhile are read soon.
        return min(self._settings.block_ms, self._settings.lease_ms // 3, READ_BLOCK_CAP_MS)

    async def _read(self) -> None:
        while not self._closed:
            await self._consumer.wait_for_room()
            try:
                if not self._consumer.streams():
                    self._leases_changed.clear()
                    await self._leases_changed.wait()
                    continue
                await self._consumer.read_once(self._read_block_ms())
                self._outage.ok()
            except RedisError as exc:
                self._outage.failed("read", exc)
                await self._sleep(RETRY_PAUSE_S)

    async def _write(self) -> None:
        while True:
            await self._consumer.wait_for_replies()
            try:
                await self._consumer.write_once()
                self._outage.ok()
            except RedisError as exc:
                self._outage.failed("write", exc)
                await self._sleep(RETRY_PAUSE_S)

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[Any]], first_at_once: bool = False) -> None:
        if not first_at_once:
            await self._sleep(interval_s)
        while True:
            try:
                await step()
            except RedisError as exc:
                self._outage.failed(getattr(step, "__name__", "step"), exc)
            await self._sleep(interval_s)

    async def _claim(self) -> None:
        """Often, but only while orphans can be expected (`claim_due`), and at once after a worker died."""
        interval_s = max(0.05, self._settings.claim_idle_ms / 10_000)
        while True:
            await sleep_or_event(self._sleep, interval_s, self._claim_now)
            self._claim_now.clear()
            now = self._clock()
            orphans_at = max(self._leases.orphans_at, self._consumer.fenced_at)
            if not claim_due(now, orphans_at, self._last_scan_at, self._settings.claim_idle_ms / 1000):
                continue
            self._last_scan_at = now
            try:
                await self._consumer.claim_once()
            except RedisError as exc:
                self._outage.failed("claim", exc)

    async def _watch_presence(self) -> None:
        """Refresh this worker's presence (Redis reachable: the outage, if any, is over), then take over
        the partitions and jobs of workers whose presence connection is gone."""
        assert self._presence is not None
        await self._presence.refresh()
        self._outage.ok()
        dead = self._deaths.observe(await absent_workers(self._redis, self._keys, me=self._worker_id),
                                    self._clock())
        if dead:
            self._consumer.mark_dead(dead)
            await self._leases.forget(dead)
            try:  # their partitions are taken in this round; their jobs claimed right after it
                await asyncio.wait_for(self._leases.next_round(), self._leases.interval_s * 2)
            except TimeoutError:
                pass
            self._claim_now.set()

    async def export_backlog(self) -> None:
        """Backlog (not yet read), pending (read, unanswered) and lag of each held partition's streams."""
        m = self._metrics
        m.cluster_partitions_owned.set(len(self._leases.owned))
        streams = [(t, p, self._keys.jobs(t, p)) for t in self._tier_names() for p in sorted(self._leases.owned)]
        pipe = self._redis.pipeline(transaction=False)
        for _t, _p, stream in streams:
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
            pipe.xrange(stream, count=1)
        results = await pipe.execute(raise_on_error=False)
        now_ms = self._consumer.server_now_ms()
        labels = set()
        for i, (tier, p, _stream) in enumerate(streams):
            length, pending, oldest = results[3 * i: 3 * i + 3]
            pending_n = pending.get("pending", 0) if isinstance(pending, dict) else 0
            length_n = length if isinstance(length, int) else 0
            age = (now_ms - int(oldest[0][0].split(b"-")[0])) / 1000 if isinstance(oldest, list) and oldest else 0.0
            label = (tier, str(p))
            labels.add(label)
            m.cluster_backlog.labels(*label).set(max(0, length_n - pending_n))
            m.cluster_pending.labels(*label).set(pending_n)
            m.cluster_lag.labels(*label).set(max(0.0, age))
        for label in self._exported - labels:  # partitions given up: their new owner exports them
            for gauge in (m.cluster_backlog, m.cluster_pending, m.cluster_lag):
                gauge.remove(*label)
        self._exported = labels

    def _tier_names(self) -> list[str]:
        return self._consumer.tier_names
