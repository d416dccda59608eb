"""One clock for the cluster: Redis server time, seen through each process's monotonic clock.

Deadlines cross process (and machine) boundaries as Redis server milliseconds. Each process measures
the offset between its own monotonic clock and the server's (`TIME`, halfway through the round trip)
and converts at the edge, so the rest of the code keeps one local clock.

A sample is only as exact as its round trip is short (the reply may have waited anywhere in it), and on
a busy host one round trip in many is slow: the offset used is the one from the fastest of the recent
samples, so one slow sample cannot move a merge window or a deadline by milliseconds. A job's merge window
on a worker counts from its queueing at the front-end (`window_anchor`), converted the same way.
"""

from __future__ import annotations

import collections
from typing import Any

from mergebroker.clock import Clock, monotonic
from mergebroker.redis_connect import routed_to

KEEP_SAMPLES = 16  # the recent samples the fastest is chosen from (with a sync per lease round: ~3 s)
FIRST_SYNC_SAMPLES = 3


class ServerClock:
    """Converts between local monotonic seconds and Redis server milliseconds."""

    def __init__(self, clock: Clock = monotonic, *, keep: int = KEEP_SAMPLES, node_key: str | None = None) -> None:
        """`node_key`: a key of the node whose clock counts. In a Redis Cluster every node keeps its own, and
        the deadlines (PXAT) of cluster mode's keys are checked by the clock of the node that holds them."""
        self._clock = clock
        self._node_key = node_key
        self._offset_ms: float | None = None  # server ms - local ms
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=keep)  # (rtt, offset)

    @property
    def synced(self) -> bool:
        return self._offset_ms is not None

    async def sync(self, redis: Any) -> None:
        """Measure the offset with one `TIME` round trip (a few on the first sync); raises the client's error
        when Redis is down."""
        routing = await routed_to(redis, self._node_key) if self._node_key else {}
        for _ in range(1 if self._samples else FIRST_SYNC_SAMPLES):
            before = self._clock()
            seconds, micros = await redis.time(**routing)
            after = self._clock()
            server_ms = seconds * 1000 + micros / 1000
            self._samples.append(((after - before) * 1000, server_ms - (before + after) / 2 * 1000))
        self._offset_ms = min(self._samples)[1]  # the fastest round trip's

    def to_server_ms(self, local_s: float) -> int:
        """A local monotonic time as server milliseconds."""
        return int(local_s * 1000 + (self._offset_ms or 0.0))

    def to_local(self, server_ms: float) -> float:
        """Server milliseconds as local monotonic seconds."""
        return (server_ms - (self._offset_ms or 0.0)) / 1000

    def now_ms(self) -> int:
        """The server's time now, from the local clock and the last measured offset."""
        return self.to_server_ms(self._clock())


LATE_GRACE_S = 0.05


def late_grace(window_s: float) -> float:
    """How long a job that arrives after its window would have closed still waits for the rest of its backlog."""
    return min(window_s / 2, LATE_GRACE_S)


def window_anchor(now: float, queued: float, window_s: float) -> float:
    """When the window of a job queued at `queued` (front-end time, on this clock) counts from: its queueing,
    unless that leaves less than `late_grace`, and never in the future."""
    return max(min(now, queued), now - window_s + late_grace(window_s))
