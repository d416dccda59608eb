"""One clock for the cluster: Redis server time, seen through each process's monotonic clock.

Deadlines cross process (and machine) boundaries as Redis server milliseconds. Each process measures
the offset between its own monotonic clock and the server's (`TIME`, halfway through the round trip)
and converts at the edge, so the rest of the code keeps one local clock.
"""

from __future__ import annotations

from typing import Any

from mergebroker.clock import Clock, monotonic


class ServerClock:
    """Converts between local monotonic seconds and Redis server milliseconds."""

    def __init__(self, clock: Clock = monotonic) -> None:
        self._clock = clock
        self._offset_ms: float | None = None  # server ms - local ms

    @property
    def synced(self) -> bool:
        return self._offset_ms is not None

    async def sync(self, redis: Any) -> None:
        """Measure the offset with one `TIME` round trip; raises the client's error when Redis is down."""
        before = self._clock()
        seconds, micros = await redis.time()
        after = self._clock()
        server_ms = seconds * 1000 + micros / 1000
        self._offset_ms = server_ms - (before + after) / 2 * 1000

    def to_server_ms(self, local_s: float) -> int:
        """A local monotonic time as server milliseconds."""
        return int(local_s * 1000 + (self._offset_ms or 0.0))

    def to_local(self, server_ms: float) -> float:
        """Server milliseconds as local monotonic seconds."""
        return (server_ms - (self._offset_ms or 0.0)) / 1000

    def now_ms(self) -> int:
        """The server's time now, from the local clock and the last measured offset."""
        return self.to_server_ms(self._clock())
