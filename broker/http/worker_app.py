"""`mergebroker worker`: one cluster-mode queue worker, with /metrics, /healthz and /readyz on its own port."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator

from aiohttp import web

from mergebroker.broker.cluster.worker_runtime import Worker, start_worker, stop_worker
from mergebroker.broker.engine.ground.settings import Settings

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
    from mergebroker.broker.engine.ground.config import settings_for_command
    from mergebroker.broker.engine.ground.logging import configure_logging

    settings = settings_for_command(args.config)
    if settings is None:
        return 2
    if not settings.redis.url:
        print("mergebroker: a worker needs redis.url (the Redis its front-ends use)", file=sys.stderr)
        return 2
    configure_logging(settings.logging.level, json_lines=settings.logging.json_lines,
                      request_lines_per_s=settings.logging.request_lines_per_s)
    web.run_app(create_worker_app(settings), host=args.host or settings.server.host, port=args.metrics_port,
                print=None, access_log=None)
    return 0
