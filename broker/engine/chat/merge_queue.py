"""Per-tier merge windows and the priority hand-off to workers.

A request waits in an open *group* (same tier, same merge key) until the group's window expires, the
group reaches `max_batch`, or the tier's open windows together hold `max_queue` requests (forced flush:
every open group of the tier is released at once, so windows never hold more than that). Released groups wait
in their tier's ready line; workers take from the tier with the highest effective priority, where
effective priority = tier priority + `aging_per_s` x seconds the oldest released group has waited. So a
released batch-tier group overtakes fresh realtime traffic after at most
(priority_realtime - priority_batch) / aging_per_s seconds: the starvation bound.

With `adaptive` windows (`window_policy`), a request that opens a group waits only when a partner is likely
to arrive within the window; otherwise it is released at once. Windows are timers on the injected clock
(`clock.call_at`), never polling, so a fake clock's `advance` closes them. Requests whose future is already
done (deadline, client gone) are dropped when their group
is taken, the others of the group stay. Past the tier's hard cap (everything not yet taken by a worker),
`submit` refuses at once with `Overloaded` (503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import structlog

from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.clock import Clock, Timer, monotonic
from mergebroker.errors import Overloaded
from mergebroker.merge.window_policy import DEFAULT_MIN_PARTNERS, WindowEstimator

log = structlog.get_logger(__name__)


class Queued(Protocol):
    """What the queue needs from a request: its tier, merge key (None: never waits), future, and when it
    reached the broker (a window opened by it counts from then, which is earlier than now only for a job
    that travelled, e.g. through a cluster's Redis)."""

    merge_key: str | None
    future: asyncio.Future
    enqueued_at: float

    @property
    def tier(self) -> str: ...


T = TypeVar("T", bound=Queued)


@dataclass(frozen=True)
class TierWindow:
    """The queue-relevant part of a tier's settings (`hard_cap`: depth past which `submit` refuses)."""

    name: str
    priority: int
    window_s: float
    max_batch: int
    max_queue: int
    hard_cap: int
    adaptive: bool = False  # window_policy adaptive: a request with no likely partner skips the window
    min_partners: float = DEFAULT_MIN_PARTNERS


@dataclass
class _Group(Generic[T]):
    key: str | None
    opened_at: float
    items: list[T] = field(default_factory=list)
    timer: Timer | None = None


@dataclass(frozen=True)
class ReleasedGroup(Generic[T]):
    """A group handed to a worker: same tier, same merge key; members still waiting for an answer."""

    tier: str
    key: str | None
    items: list[T]
    released_at: float


class MergeQueue(Generic[T]):
    """Bounded per-tier queues with merge windows; `take()` hands out groups by effective priority."""

    def __init__(self, tiers: list[TierWindow], *, aging_per_s: float = 10.0, clock: Clock = monotonic,
                 metrics: Metrics | None = None, on_partners: Callable[[str, list[T]], None] | None = None) -> None:
        """`on_partners(tier, items)` hears of requests as soon as they have a merge partner in their window
        (both of the first pair, then each newcomer), so work such as embedding can overlap the window."""
        self._on_partners = on_partners
        self._tiers = {t.name: t for t in tiers}
        self._aging = aging_per_s
        self._clock = clock
        self._metrics = metrics
        self._open: dict[str, dict[str | None, _Group[T]]] = {t.name: {} for t in tiers}
        self._open_count = dict.fromkeys(self._tiers, 0)
        self._ready: dict[str, collections.deque[ReleasedGroup[T]]] = {t.name: collections.deque() for t in tiers}
        self._ready_count = dict.fromkeys(self._tiers, 0)
        self._idle_workers: collections.deque[asyncio.Future[None]] = collections.deque()
        self.hand_off: Callable[[Callable[[], ReleasedGroup[T] | None]], bool] | None = None
        """Set by the worker pool: dispatches the best released group at once (given `pick`), or says False."""
        self._estimator = WindowEstimator()
        self._decisions: dict[tuple[str, str], Any] = {}  # window_decisions' children by (tier, decision)
        self._closed = False
        if metrics is not None:
            # Read when scraped rather than set on every submit and take: no per-request work.
            for name in self._tiers:
                metrics.queue_depth.labels(name).set_function(functools.partial(self.depth, name))

    def sends_alone(self, item: T) -> bool:
        """True when `item` never waits in a window: it cannot merge, or its tier has no window."""
        tier = self._tiers[item.tier]
        return item.merge_key is None or tier.window_s <= 0 or tier.max_batch <= 1

    def idle(self) -> bool:
        """True while accepting and no released group waits for a worker: a request sent now jumps no one."""
        return not self._closed and not any(self._ready_count.values())

    def depth(self, tier: str) -> int:
        """Requests of a tier not yet taken by a worker."""
        return self._open_count[tier] + self._ready_count[tier]

    def submit(self, item: T) -> None:
        """Place a request in its tier's window; raises `Overloaded` past the hard cap."""
        tier = self._tiers[item.tier]
        if self._closed:
            raise Overloaded("The broker is shutting down.", retry_after=1)
        if self.depth(tier.name) >= tier.hard_cap:
            if self._metrics:
                self._metrics.rejected.labels(tier.name, "queue_full").inc()
            raise Overloaded(f"Tier '{tier.name}' queue is full; retry later.", retry_after=1, code="queue_full")
        if self.sends_alone(item):
            self._make_ready(tier.name, None, [item])
        elif tier.adaptive and not self._worth_waiting(tier, item, (tier.name, item.merge_key), self._clock()):
            self._make_ready(tier.name, item.merge_key, [item])
        else:
            self._add_to_window(tier, item)

    def take_alone(self, item: T) -> bool:
        """For a caller that can send `item` itself: True when `submit` would release it alone at once (it
        sends alone, or its adaptive tier expects no partner and no window of its group is open), with its
        arrival recorded as `submit` records it; the caller then sends it and this queue never holds it.
        False records nothing: the caller submits it."""
        if self.sends_alone(item):
            return True
        tier = self._tiers[item.tier]
        if self._closed or not tier.adaptive or item.merge_key in self._open[tier.name]:
            return False
        group, now = (tier.name, item.merge_key), self._clock()
        if self._estimator.would_wait(group, now, window_s=tier.window_s, min_partners=tier.min_partners,
                                      family=tier.name):
            return False
        self._worth_waiting(tier, item, group, now)  # records the arrival: it answers False, as asked just now
        return True

    def _worth_waiting(self, tier: TierWindow, item: T, group: tuple[str, str | None], now: float) -> bool:
        """Adaptive windows: whether `item` (of `group`, arriving `now`) should wait for partners (see
        `merge.window_policy`).

        Every arrival feeds its group's estimate, and its answer (or departure) ends its pending time.
        """
        wait = self._estimator.arrive(group, now, window_s=tier.window_s, min_partners=tier.min_partners,
                                      family=tier.name)
        item.future.add_done_callback(functools.partial(self._departed, group))
        if item.merge_key in self._open[tier.name]:
            decision, wait = "join", True  # an open window costs nothing more to join
        else:
            decision = "wait" if wait else "skip"
        if self._metrics is not None:
            counter = self._decisions.get((tier.name, decision))
            if counter is None:  # `labels()` costs more than the count itself: each child is looked up once
                counter = self._decisions[(tier.name, decision)] = self._metrics.window_decisions.labels(tier.name,
                                                                                                        decision)
            counter.inc()
        return wait

    def _departed(self, group: tuple[str, str | None], _future: asyncio.Future) -> None:
        self._estimator.depart(group, self._clock())

    def _add_to_window(self, tier: TierWindow, item: T) -> None:
        groups = self._open[tier.name]
        group = groups.get(item.merge_key)
        if group is None:
            group = groups[item.merge_key] = _Group(item.merge_key, min(self._clock(), item.enqueued_at))
            group.timer = self._clock.call_at(group.opened_at + tier.window_s, self._release, tier.name,
                                              item.merge_key)
        group.items.append(item)
        self._open_count[tier.name] += 1
        if self._on_partners is not None and len(group.items) > 1:
            self._on_partners(tier.name, group.items if len(group.items) == 2 else [item])
        if len(group.items) >= tier.max_batch:
            self._release(tier.name, item.merge_key)
        elif self._open_count[tier.name] >= tier.max_queue:
            # Counting only what waits in windows keeps merging alive while workers lag behind: a long
            # ready line is no reason to stop merging, a window holding max_queue requests is.
            self._forced_flush(tier.name)

    def _forced_flush(self, tier: str) -> None:
        if self._metrics:
            self._metrics.forced_flush.labels(tier).inc()
        log.warning("queue_forced_flush", tier=tier, depth=self._open_count[tier])
        for key in list(self._open[tier]):
            self._release(tier, key)

    def _release(self, tier: str, key: str | None) -> None:
        group = self._open[tier].pop(key, None)
        if group is None:
            return
        if group.timer is not None:
            group.timer.cancel()
        self._open_count[tier] -= len(group.items)
        self._make_ready(tier, key, group.items)

    def _make_ready(self, tier: str, key: str | None, items: list[T]) -> None:
        self._ready[tier].append(ReleasedGroup(tier, key, items, self._clock()))
        self._ready_count[tier] += len(items)
        if self._idle_workers and self.hand_off is not None and self.hand_off(self.pick):
            return  # workers idle (keeping up): the group goes to dispatch now, not one loop step later
        while self._idle_workers:  # wake exactly one idle worker, not all of them
            waiter = self._idle_workers.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def pick(self) -> ReleasedGroup[T] | None:
        """The released group with the highest effective priority, or None. Pure decision + pop."""
        now = self._clock()
        best, best_score = None, float("-inf")
        for name, line in self._ready.items():
            if not line:
                continue
            score = self._tiers[name].priority + self._aging * (now - line[0].released_at)
            if score > best_score:
                best, best_score = name, score
        if best is None:
            return None
        group = self._ready[best].popleft()
        self._ready_count[best] -= len(group.items)
        live = [item for item in group.items if not item.future.done()]
        return group if len(live) == len(group.items) else ReleasedGroup(group.tier, group.key, live,
                                                                          group.released_at)

    async def take(self) -> ReleasedGroup[T]:
        """Wait for the next released group that still has live members."""
        while True:
            group = self.pick()
            if group is not None and group.items:
                return group
            if group is None:  # an all-dead group is skipped; look again before sleeping
                waiter = asyncio.get_running_loop().create_future()
                self._idle_workers.append(waiter)
                await waiter

    def close(self) -> list[T]:
        """Stop accepting; return every request still waiting (to be answered with an error)."""
        self._closed = True
        left: list[T] = []
        for tier in self._tiers:
            for group in self._open[tier].values():
                if group.timer is not None:
                    group.timer.cancel()
                left.extend(group.items)
            self._open[tier].clear()
            while self._ready[tier]:
                left.extend(self._ready[tier].popleft().items)
            self._open_count[tier] = self._ready_count[tier] = 0
        return left
