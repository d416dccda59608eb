"""A running queue worker of cluster mode: the engine, fed from the partitions it leases.

A worker is a broker without the HTTP API: the same pools, breakers, merge windows, dispatcher and
similarity model (`assemble` with the in-process queue builds them), fed by a `StreamConsumer` from the
partitions it holds instead of by HTTP handlers. Workers scale independently of front-ends; the
`mergebroker worker` command serves it with /metrics, /healthz and /readyz (`http.worker_app`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import structlog

from mergebroker import tracing
from mergebroker.broker.cluster.client import make_stream_client
from mergebroker.broker.cluster.consumer import StreamConsumer
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.partition import Keys
from mergebroker.broker.cluster.presence import Presence, make_presence_client
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.cluster.worker import ClusterWorker
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.metrics import preinitialise_cluster
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.wiring.assemble import assemble, stop_engine
from mergebroker.clock import Clock, Sleep, monotonic

log = structlog.get_logger(__name__)


@dataclass
class Worker:
    """A running worker: the broker parts it dispatches with, and its cluster loops."""

    broker: Engine
    cluster: ClusterWorker
    redis: Any
    worker_id: str
    traced: bool = False  # this worker installed the process's telemetry (`stop_worker` removes it)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        ok, checks = self.broker.ready()
        checks["cluster"] = self.cluster.alive()
        return ok and checks["cluster"], checks


async def start_worker(settings: Settings, *, clock: Clock = monotonic, sleep: Sleep | None = None,
                       worker_id: str | None = None) -> Worker:
    """Build the broker parts (cluster mode off: this process dispatches) and start reading the partitions."""
    if not settings.redis.url:
        raise ValueError("a worker needs redis.url")
    local = settings.model_copy(update={"cluster": settings.cluster.model_copy(update={"enabled": False})})
    sleep = sleep or clock.sleep

    broker = await assemble(local, clock=clock, sleep=sleep)
    preinitialise_cluster(broker.metrics)
    c = settings.cluster
    redis = make_stream_client(settings.redis.url, block_ms=c.block_ms)
    keys = Keys(c.prefix)
    server_clock = ServerClock(clock, node_key=keys.presence)
    worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    leases = PartitionLeases(redis, keys, worker_id, partitions=c.partitions, lease_ms=c.lease_ms,
                             server_clock=server_clock, clock=clock,
                             on_change=lambda _p, event: broker.metrics.cluster_lease_changes.labels(event).inc())
    consumer = StreamConsumer(redis, broker.queue, keys=keys, settings=c, tiers=settings.tiers, leases=leases,
                              server_clock=server_clock, consumer_id=worker_id,
                              aging_per_s=settings.server.aging_per_s, metrics=broker.metrics, clock=clock,
                              sleep=sleep)
    presence = Presence(make_presence_client(settings.redis.url, worker_id), keys, worker_id)
    cluster = ClusterWorker(redis, consumer, leases, keys=keys, settings=c, metrics=broker.metrics, sleep=sleep,
                            clock=clock, presence=presence, worker_id=worker_id)
    traced = bool(settings.telemetry.enabled)
    if traced:  # the worker's upstream calls, linked to the front-ends' request spans (`WireJob.traceparent`)
        tracing.install(settings.telemetry.config())
    cluster.start()
    log.info("worker_started", worker_id=worker_id, partitions=c.partitions)
    return Worker(broker, cluster, redis, worker_id, traced)


async def stop_worker(worker: Worker) -> None:
    """Give the partitions back and finish the jobs held, then stop the broker parts."""
    await worker.cluster.stop()
    await worker.redis.aclose()
    await stop_engine(worker.broker)
    if worker.traced:
        await asyncio.to_thread(tracing.uninstall)  # the last export goes out over HTTP: off the loop
