"""`mergebroker worker`: one queue worker of cluster mode, with /metrics, /healthz and /readyz on its own port.

A worker is a broker without the HTTP API: the same pools, breakers, merge windows, dispatcher and
similarity model (`build_broker` with cluster mode off builds them), fed by a `StreamConsumer` from the
partitions it holds instead of by HTTP handlers. Workers scale independently of front-ends.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import structlog
from aiohttp import web

from mergebroker.broker.app import build_broker, stop_broker
from mergebroker.broker.cluster.client import make_stream_client
from mergebroker.broker.cluster.consumer import StreamConsumer
from mergebroker.broker.cluster.leases import PartitionLeases
from mergebroker.broker.cluster.partition import Keys
from mergebroker.broker.cluster.server_time import ServerClock
from mergebroker.broker.cluster.worker import ClusterWorker
from mergebroker.broker.settings import Settings
from mergebroker.broker.state import Broker
from mergebroker.clock import Clock, Sleep, monotonic

log = structlog.get_logger(__name__)


@dataclass
class Worker:
    """A running worker: the broker parts it dispatches with, and its cluster loops."""

    broker: Broker
    cluster: ClusterWorker
    redis: Any
    worker_id: str

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
    broker = await build_broker(local, clock=clock, sleep=sleep)
    c = settings.cluster
    redis = make_stream_client(settings.redis.url, block_ms=c.block_ms)
    keys = Keys(c.prefix)
    server_clock = ServerClock(clock)
    worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    leases = PartitionLeases(redis, keys, worker_id, partitions=c.partitions, lease_ms=c.lease_ms,
                             server_clock=server_clock, clock=clock,
                             on_change=lambda _p, event: broker.metrics.cluster_lease_changes.labels(event).inc())
    consumer = StreamConsumer(redis, broker.queue, keys=keys, settings=c, tiers=settings.tiers, leases=leases,
                              server_clock=server_clock, consumer_id=worker_id,
                              aging_per_s=settings.server.aging_per_s, metrics=broker.metrics, clock=clock)
    cluster = ClusterWorker(redis, consumer, leases, keys=keys, settings=c, metrics=broker.metrics, sleep=sleep,
                            clock=clock)
    cluster.start()
    log.info("worker_started", worker_id=worker_id, partitions=c.partitions)
    return Worker(broker, cluster, redis, worker_id)


async def stop_worker(worker: Worker) -> None:
    """Give the partitions back and finish the jobs held, then stop the broker parts."""
    await worker.cluster.stop()
    await worker.redis.aclose()
    await stop_broker(worker.broker)


WORKER = web.AppKey("worker", Worker)


def create_worker_app(settings: Settings) -> web.Application:
    """The worker's small HTTP app: /metrics, /healthz, /readyz; the worker runs in its lifecycle."""
    app = web.Application()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        app[WORKER] = await start_worker(settings)
        try:
            yield
        finally:
            await stop_worker(app[WORKER])

    async def metrics(request: web.Request) -> web.Response:
        body = request.app[WORKER].broker.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        ok, checks = request.app[WORKER].ready()
        return web.json_response({"ready": ok, "checks": checks}, status=200 if ok else 503)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.cleanup_ctx.append(lifecycle)
    return app


def run_worker(args: argparse.Namespace) -> int:
    """`mergebroker worker`: run until interrupted."""
    from mergebroker.broker.logging import configure_logging
    from mergebroker.broker.settings import settings_for_command

    settings = settings_for_command(args.config)
    if settings is None:
        return 2
    if not settings.redis.url:
        print("mergebroker: a worker needs redis.url (the Redis its front-ends use)", file=sys.stderr)
        return 2
    configure_logging(settings.logging.level, json_lines=settings.logging.json_lines)
    web.run_app(create_worker_app(settings), host=args.host or settings.server.host, port=args.metrics_port,
                print=None, access_log=None)
    return 0
