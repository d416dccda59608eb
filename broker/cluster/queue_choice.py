"""How a way in (HTTP, the library) queues its chat jobs: through the cluster's `ClusterQueue` when cluster mode
is on, with the in-process queue as its fallback, else in process."""

from __future__ import annotations

import asyncio
import functools

from mergebroker.broker.cluster.client import make_stream_client
from mergebroker.broker.cluster.frontend import ClusterQueue
from mergebroker.broker.cluster.partition import Keys
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.engine.chat.job_queue import JobQueue
from mergebroker.broker.engine.ground.metrics import Metrics, preinitialise_cluster
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.wiring.assemble import QueueChoice
from mergebroker.clock import Clock, Sleep, monotonic


def build_cluster_queue(settings: Settings, local: JobQueue, *, metrics: Metrics, clock: Clock = monotonic,
                        sleep: Sleep = asyncio.sleep) -> ClusterQueue:
    """The front-end's queue for `settings` (cluster mode on, `redis.url` set), with its own stream client."""
    preinitialise_cluster(metrics)
    c = settings.cluster
    keys = Keys(c.prefix)
    return ClusterQueue(make_stream_client(settings.redis.url or "", block_ms=c.block_ms), local,
                        keys=keys, settings=c, partitions=c.partitions,
                        server_clock=ServerClock(clock, node_key=keys.presence),
                        metrics=metrics, sleep=sleep, owns_client=True, clock=clock)


def front_end_queue(settings: Settings) -> QueueChoice | None:
    """How a way in (HTTP, the library) queues its jobs: through the cluster when cluster mode is on, else in
    process (None). The in-process queue stays the cluster queue's fallback while Redis or workers are away."""
    if not settings.cluster.enabled:
        return None
    return functools.partial(build_cluster_queue, settings)
