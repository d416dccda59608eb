"""Partition leases: a worker reads a partition only while it holds the partition's lease in Redis.

A lease is a key set-if-absent with an expiry (`SET NX PX`) holding the worker's ID, renewed every
`lease_ms / 3` by a script that extends it only if it still holds the worker's ID. Each renewal also
refreshes the worker's entry in the live-workers set and rebalances: a worker holds its fair share
(`partition.fair_share`), gives up what is above it and takes free partitions up to it.

A worker that cannot renew (Redis unreachable, the process paused) stops treating its partitions as
its own once `lease_ms` has passed since its last successful renewal, the moment another worker may
take them: a zombie stops taking work by itself, without being told. Its next renewal keeps the
leases nobody took meanwhile and reports the others lost.

A worker found dead (`presence`) is forgotten at once (`forget`): out of the live set, its leases
deleted, so the others take its partitions in their next round (which `wake` brings forward) instead
of after its leases expire. A worker short of its share (partitions still held by one that is giving
them up) tries again every `SHORT_RETRY_SHARE` of a round until it has it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from redis.exceptions import RedisError

from mergebroker.broker.cluster.partition import Keys, fair_share, lease_plan, preferred_order
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.clock import Clock, Sleep, monotonic, sleep_or_event

log = structlog.get_logger(__name__)

# Every lease held, extended in one call: 1 for each key still holding this worker's ID, else 0.
_RENEW = """local kept = {}
for i, key in ipairs(KEYS) do
  if redis.call('get', key) == ARGV[1] then kept[i] = redis.call('pexpire', key, ARGV[2]) else kept[i] = 0 end
end
return kept"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Every lease held by one of the workers in ARGV, deleted; how many.
_FORGET = """local gone, freed = {}, 0
for _, worker in ipairs(ARGV) do gone[worker] = true end
for _, key in ipairs(KEYS) do
  local holder = redis.call('get', key)
  if holder and gone[holder] then freed = freed + redis.call('del', key) end
end
return freed"""
SHORT_RETRY_SHARE = 1 / 4

LeaseEvent = Callable[[int, str], None]
"""`(partition, event)` with event one of acquired, released, lost."""


class PartitionLeases:
    """The partitions one worker holds; `renew()` once per `lease_ms / 3` keeps and rebalances them."""

    def __init__(self, redis: Any, keys: Keys, worker_id: str, *, partitions: int, lease_ms: int,
                 server_clock: ServerClock, on_change: LeaseEvent | None = None, clock: Clock = monotonic) -> None:
        self._redis = redis
        self._keys = keys
        self._id = worker_id
        self._partitions = partitions
        self._lease_ms = lease_ms
        self._server_clock = server_clock
        self._on_change = on_change
        self._clock = clock
        self._order = preferred_order(worker_id, partitions)
        self._owned: set[int] = set()
        self._valid_until = 0.0
        self._live: set[bytes] = set()
        self.orphans_at = float("-inf")
        """When (local clock) orphaned jobs last became possible: a partition acquired, a worker gone."""
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._forget = redis.register_script(_FORGET)
        self._short = False  # the last round got fewer partitions than the share
        self.wake = asyncio.Event()
        """Set it to bring the next round forward (a worker was found dead: take its partitions now)."""
        self._round_waiters: list[asyncio.Future[None]] = []

    @property
    def owned(self) -> frozenset[int]:
        """The partitions held now; empty once `lease_ms` has passed without a successful renewal."""
        if self._clock() >= self._valid_until:
            return frozenset()
        return frozenset(self._owned)

    @property
    def interval_s(self) -> float:
        return self._lease_ms / 3000

    async def renew(self) -> None:
        """Extend the leases held, refresh this worker's liveness, then give up or take partitions to its share.

        Raises the client's error when Redis is unreachable; the leases then lapse on their own.
        A late round (a paused process) keeps what it can: `owned` is empty while the leases may have
        lapsed, and the renewal script extends only keys that still hold this worker's ID, which no other
        worker can have held in between (it would have written its own ID).
        """
        started = self._clock()
        await self._server_clock.sync(self._redis)
        now_ms = self._server_clock.now_ms()
        held = sorted(self._owned)
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(self._keys.workers, {self._id: now_ms})
        # A worker silent for a whole lease is gone (its leases lapse just as fast): the others' share
        # grows at once, so they take its partitions as soon as its leases expire.
        pipe.zremrangebyscore(self._keys.workers, 0, now_ms - self._lease_ms)
        pipe.zrange(self._keys.workers, 0, -1)
        if held:
            _script(pipe, self._renew, [self._keys.lease(p) for p in held], self._id, self._lease_ms)
        results = await pipe.execute()
        self._drop([p for p, ok in zip(held, results[3] if held else []) if not ok], "lost")
        self._valid_until = started + self._lease_ms / 1000
        self._see_workers(set(results[2]))
        share = fair_share(self._partitions, len(results[2]))
        acquire, release = lease_plan(self._owned, share, self._order)
        if release:
            await self.release(release)
        if acquire:
            await self._acquire(acquire, share - len(self._owned))
        self._short = len(self._owned) < share

    @property
    def live_workers(self) -> frozenset[bytes]:
        """The workers (IDs) seen alive in the last renewal round; empty before the first."""
        return frozenset(self._live)

    def _see_workers(self, live: set[bytes]) -> None:
        """A worker gone since the last round (dead, or stopped with jobs unanswered) may have left orphans."""
        if self._live - live:
            self.orphans_at = self._clock()
        self._live = live

    async def _acquire(self, candidates: list[int], wanted: int) -> None:
        while wanted > 0 and candidates:
            batch, candidates = candidates[:wanted], candidates[wanted:]
            pipe = self._redis.pipeline(transaction=False)
            for p in batch:
                pipe.set(self._keys.lease(p), self._id, nx=True, px=self._lease_ms)
            for p, ok in zip(batch, await pipe.execute()):
                if ok:
                    self._owned.add(p)
                    wanted -= 1
                    self._event(p, "acquired")

    async def next_round(self) -> None:
        """Bring the next round forward and return when it is done (`run` must be running)."""
        waiter = asyncio.get_running_loop().create_future()
        self._round_waiters.append(waiter)
        self.wake.set()
        await waiter

    async def forget(self, workers: set[str]) -> int:
        """Take dead `workers` out of the live set and delete their leases; the partitions freed."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(self._keys.workers, *workers)
        pipe.hdel(self._keys.presence, *workers)
        _script(pipe, self._forget, [self._keys.lease(p) for p in range(self._partitions)], *sorted(workers))
        freed = (await pipe.execute())[2]
        self._live -= {w.encode() for w in workers}
        self.orphans_at = self._clock()
        log.warning("cluster_worker_dead", workers=sorted(workers), partitions_freed=freed)
        return int(freed)

    async def release(self, partitions: list[int] | None = None) -> None:
        """Give up `partitions` (all held when None) at once, so another worker can take them now."""
        chosen = sorted(self._owned) if partitions is None else partitions
        self._drop(chosen, "released")
        pipe = self._redis.pipeline(transaction=False)
        for p in chosen:
            _script(pipe, self._release, [self._keys.lease(p)], self._id)
        if partitions is None:
            pipe.zrem(self._keys.workers, self._id)
        await pipe.execute()

    def _drop(self, partitions: list[int], event: str) -> None:
        for p in partitions:
            if p in self._owned:
                self._owned.discard(p)
                self._event(p, event)

    def _event(self, partition: int, event: str) -> None:
        if event != "acquired":
            log.info("partition_lease", partition=partition, change=event)
        if self._on_change is not None:
            self._on_change(partition, event)

    async def run(self, sleep: Sleep, changed: asyncio.Event, on_error: Callable[[str, RedisError], None]) -> None:
        """Renew forever; sets `changed` after each round (the reader picks up new partitions at once) and
        hands Redis errors to `on_error` (which reports an outage once)."""
        while True:
            self.wake.clear()
            waiters, self._round_waiters = self._round_waiters, []  # a waiter that came mid-round waits for the next
            try:
                await self.renew()
            except RedisError as exc:
                on_error("leases", exc)
            changed.set()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            await sleep_or_event(sleep, self.interval_s * (SHORT_RETRY_SHARE if self._short else 1), self.wake)


def _script(pipe: Any, script: Any, keys: list[str], *args: Any) -> None:
    """Queue a registered script on a pipeline (the pipeline loads it first if Redis does not know it)."""
    pipe.scripts.add(script)
    pipe.evalsha(script.sha, len(keys), *keys, *args)
