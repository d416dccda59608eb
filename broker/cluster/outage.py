"""One warning per Redis outage, however many loops run into it, and one line when it ends.

Every loop of a cluster process retries on its own after a Redis error; logging each failure would print
a warning per loop every retry for as long as Redis is away, and a stale pooled connection could print
one long after. Here the first connection failure logs a warning and runs `on_start` (a worker stops
sending jobs upstream, see `StreamConsumer.fence_all`); the others during the outage log at debug;
the first success after it logs `cluster_redis_recovered` at info. An error Redis answered (a script
error, a wrong type) is no outage: it is logged as a warning each time, as a bug would be.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from redis.exceptions import ConnectionError, RedisError, TimeoutError

log = structlog.get_logger(__name__)


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` means Redis could not be reached (as opposed to an error it answered)."""
    return isinstance(exc, (ConnectionError, TimeoutError, OSError))


class Outage:
    """The Redis reachability of one process, as its loops see it."""

    def __init__(self, role: str, on_start: Callable[[], object] | None = None) -> None:
        self._role = role
        self._on_start = on_start
        self.down = False

    def failed(self, loop: str, exc: RedisError | OSError) -> None:
        """A loop's Redis call failed."""
        if not unreachable(exc):
            log.warning("cluster_redis_error", role=self._role, loop=loop, error=type(exc).__name__,
                        detail=str(exc)[:200])
            return
        if self.down:
            log.debug("cluster_redis_still_unreachable", role=self._role, loop=loop, error=type(exc).__name__)
            return
        self.down = True
        log.warning("cluster_redis_unreachable", role=self._role, loop=loop, error=type(exc).__name__,
                    detail=str(exc)[:200])
        if self._on_start is not None:
            self._on_start()

    def ok(self) -> None:
        """A Redis call succeeded."""
        if self.down:
            self.down = False
            log.info("cluster_redis_recovered", role=self._role)
