"""What a worker holds, and the fence that keeps two workers from sending one job upstream.

A worker holds an entry from its read (or claim) until its answer is written. While it holds it, its
heartbeat (`HEARTBEAT`, every `HEARTBEAT_SHARE` of `claim_idle_ms`) resets the entry's idle time, and
only if the entry is still its own: a worker back from a pause must not take back what another claimed.
Each successful touch (read, claim, heartbeat) is remembered locally (`Held.touched_at`).

The fence: a job not yet sent upstream is never sent once none of its entries was touched for
`FENCE_SHARE` of `claim_idle_ms`, because from `claim_idle_ms` on another worker may claim it. Those
entries are dropped unanswered and unacknowledged (`fence_drops`): whoever claims them (maybe this worker)
runs them. A job already sent is kept and answered: its sent marker stops the others from running it. So
is a marked entry whose job has not gone yet (a mark confirmed after Redis came back, `markers`, is older
than the fence by the local clock): its front-end waits for this worker's reply.
The fence also closes at once when the worker loses Redis (`StreamConsumer.fence_all`), since the
front-ends then serve what no worker has sent.

Before the upstream call the engine awaits the job's `before_send`, which writes the entries' sent markers
(`markers`); the fence leaves a flight alone while that is under way, since the marking script, not the
local clock, then decides which entries are still this worker's. `ClusterJob` is the engine's `ChatJob`
that says when it is sent (`mark_sent` is the engine's last step before the upstream call), so the worker
tells the front-ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from mergebroker.broker.cluster.partition import GROUP
from mergebroker.broker.cluster.wire import WireJob
from mergebroker.broker.engine.chat.jobs import ChatJob
from mergebroker.clock import Clock, Timer

log = structlog.get_logger(__name__)

HEARTBEAT_SHARE = 1 / 3  # held entries are touched every claim_idle_ms x this
FENCE_SHARE = 2 / 3  # an unsent job untouched this long (x claim_idle_ms) is never sent: another may claim it

# Touch the listed entries still pending under this consumer; returns {kept IDs, IDs another consumer owns}.
# ARGV: group, consumer, entry IDs. An entry no longer pending (answered, deleted by its front-end) is in neither.
HEARTBEAT = """local kept, taken = {}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] then
    if p[1][2] == ARGV[2] then
      if redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')[1] then kept[#kept + 1] = ARGV[i] end
    else
      taken[#taken + 1] = ARGV[i]
    end
  end
end
return {kept, taken}"""


@dataclass(eq=False)
class ClusterJob(ChatJob):
    """A `ChatJob` that calls `on_sent` the first time the engine sends it upstream."""

    on_sent: Callable[[], None] | None = None

    def mark_sent(self) -> float:
        first = not self.dispatched
        deadline = super().mark_sent()
        if first and self.on_sent is not None:
            self.on_sent()
        return deadline


@dataclass(eq=False)
class Flight:
    """One job on the engine's queue and the entries it answers (identical jobs from any front-end)."""

    job: ChatJob
    entries: list[Held] = field(default_factory=list)
    marking: bool = False  # its sent markers are being written: it is about to go upstream

    @property
    def sent(self) -> bool:
        return self.job.dispatched

    @property
    def fenced_off(self) -> bool:
        """Whether the fence may no longer drop its entries: sent, or being marked to be sent."""
        return self.marking or self.job.dispatched


@dataclass(eq=False)
class Held:
    """One stream entry this worker is answering."""

    stream: str
    entry_id: bytes
    job: WireJob
    read_at: float = 0.0
    touched_at: float = 0.0  # local time of the last read, claim or heartbeat that reset its idle time
    flight: Flight | None = None
    lost: bool = False  # no longer this worker's in Redis, but sent before: still answered, never heartbeated
    noted: bool = False  # marked, and its front-end told, by the marker script (`markers`)

    @property
    def fenced_off(self) -> bool:
        """Whether the fence may no longer drop it: marked (a live owner's marked entry is never claimed, and
        its front-end waits for this worker's reply), or its job sent or being marked."""
        return self.noted or (self.flight is not None and self.flight.fenced_off)


def fence_drops(held: Iterable[Held], now: float, fence_s: float) -> list[Held]:
    """The entries to drop at the fence: untouched for `fence_s`, of jobs not sent upstream (pure)."""
    return [h for h in held if not h.lost and h.flight is not None and not h.fenced_off
            and now - h.touched_at >= fence_s]


def next_fence(held: Iterable[Held], fence_s: float) -> float | None:
    """When the earliest unsent entry reaches the fence, or None when none is waiting."""
    times = [h.touched_at for h in held if not h.lost and h.flight is not None and not h.fenced_off]
    return min(times) + fence_s if times else None


Key = tuple[str, bytes]  # (stream, entry ID)


class Holds:
    """The entries one worker holds: touched by reads, claims and heartbeats, dropped at the fence.

    `count(outcome)` is called once per entry dropped (fenced, withdrawn, taken_over).
    """

    def __init__(self, *, clock: Clock, fence_s: float, count: Callable[[str], None]) -> None:
        self._clock = clock
        self._fence_s = fence_s
        self._count = count
        self._held: dict[Key, Held] = {}
        self._timer: Timer | None = None
        self._timer_at = math.inf
        self.fenced_at = -math.inf
        """When (local clock) entries were last dropped at the fence: this worker may have to claim them back."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Key) -> bool:
        return key in self._held

    def keys(self) -> Iterable[Key]:
        return self._held.keys()

    def __iter__(self) -> Iterator[Key]:
        return iter(self._held)

    def get(self, key: Key) -> Held | None:
        return self._held.get(key)

    def add(self, held: Held) -> None:
        self._held[(held.stream, held.entry_id)] = held

    def finished(self, held: Held) -> None:
        """`held` was answered (or dropped) and written."""
        if self._held.get((held.stream, held.entry_id)) is held:
            del self._held[(held.stream, held.entry_id)]

    async def heartbeat(self, redis: Any, script: Any, consumer_id: str) -> None:
        """Reset the idle time of every entry held that is still this worker's (`HEARTBEAT`).

        An entry no longer pending was deleted by its front-end, whose callers all left (or Redis lost
        it); one another worker owns now was claimed while this one was silent. Either way its job is
        dropped here if it has not been sent upstream. A sent one is still answered (its front-end may be
        waiting for just this reply, and no one else runs it), and no longer heartbeated; so is one being
        marked, once its mark went through (a front-end's hand-over deletes a marked entry too, and then
        waits for its reply).
        """
        by_stream: dict[str, list[bytes]] = {}
        for (stream, entry_id), entry in self._held.items():
            if not entry.lost:
                by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return
        started = self._clock()
        pipe = redis.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.scripts.add(script)
            pipe.evalsha(script.sha, 1, stream, GROUP, consumer_id, *ids)
        for (stream, ids), result in zip(by_stream.items(), await pipe.execute(raise_on_error=False)):
            if isinstance(result, Exception):
                continue  # the stream is gone (Redis lost its data): what is held finishes or is fenced
            kept, taken = set(result[0]), set(result[1])
            for entry_id in ids:
                held = self._held.get((stream, entry_id))
                if held is None:
                    continue
                if entry_id in kept:
                    held.touched_at = max(held.touched_at, started)
                elif held.flight is not None and held.fenced_off:
                    held.lost = True  # sent, or being marked: the marking script's verdict stands
                else:
                    self.drop(held, "taken_over" if entry_id in taken else "withdrawn")
        self.arm()

    def drop(self, held: Held, outcome: str) -> None:
        """Forget `held` without answering or acknowledging it; cancel its job when nothing else rides on it."""
        self.finished(held)
        flight = held.flight
        if flight is None or held not in flight.entries:
            return
        flight.entries.remove(held)
        self._count(outcome)
        if not flight.entries and not flight.sent:
            flight.job.future.cancel()  # the queue drops a cancelled job before dispatch

    def fence_all(self) -> int:
        """Redis is lost: drop every entry of a job not sent upstream (the front-ends serve them)."""
        return self._fence(fence_drops(self._held.values(), math.inf, 0.0))

    def arm(self) -> None:
        """Keep one timer at the earliest time an unsent entry reaches the fence."""
        when = next_fence(self._held.values(), self._fence_s)
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        if when is not None:
            self._timer, self._timer_at = self._clock.call_at(when, self._fence_due), when

    def _fence_due(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._fence(fence_drops(self._held.values(), self._clock(), self._fence_s))
        self.arm()

    def _fence(self, drops: list[Held]) -> int:
        for held in drops:
            self.drop(held, "fenced")
        if drops:
            self.fenced_at = self._clock()
            log.info("cluster_jobs_fenced", count=len(drops))
        return len(drops)

    def stale(self, held: Held) -> bool:
        """Whether `held` is past the fence (a job about to be sent with it would break the bargain)."""
        return self._clock() - held.touched_at >= self._fence_s
