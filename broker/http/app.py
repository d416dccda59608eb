"""`create_app(settings)`: the HTTP way in. Builds the engine (`assemble`) and the Batch API when the app
starts, and wires the request path; nothing reads globals.

Components are built at start-up inside the app's cleanup context (the simulated upstream, when no
provider is configured, has to be listening before the pools can point at it) and stored under typed
`web.AppKey`s (`http.keys`).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from aiohttp import web

from mergebroker import tracing
from mergebroker.broker.bulk.batches import BatchService, build_batch_service
from mergebroker.broker.bulk.runner import BulkJob, Limits
from mergebroker.broker.bulk.settling import CallShare
from mergebroker.broker.cluster.queue_choice import front_end_queue
from mergebroker.broker.engine.accounting.request_record import record_bulk_line
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.metrics import connections_listener, drain_listener, reload_listener
from mergebroker.broker.engine.ground.settings import HTTP_PROVIDER_KINDS, Settings
from mergebroker.broker.engine.ground.telemetry_settings import TelemetrySettings
from mergebroker.broker.engine.wiring.assemble import assemble, freeze_startup_objects, stop_engine
from mergebroker.broker.engine.wiring.reload import Reloader, engine_idle
from mergebroker.broker.http.body import BODY_LIMITS, HANDLER_ARGS, BodyLimits
from mergebroker.broker.http.connections import ConnectionGuard, ConnectionLimits, auto_max_connections
from mergebroker.broker.http.drain import DRAIN, Drain
from mergebroker.broker.http.keys import BATCHES, BROKER, RELOADER, SETTINGS_MAX_BODY
from mergebroker.broker.http.middleware import add_unmatched_routes, error_handling
from mergebroker.broker.http.routes import add_routes
from mergebroker.broker.http.server import CONNECTIONS
from mergebroker.broker.http.tracing import TELEMETRY, tracing_middleware
from mergebroker.clock import Clock, Sleep, monotonic


def create_app(settings: Settings, *, clock: Clock = monotonic, sleep: Sleep | None = None,
               reload_from: Callable[[], Settings] | None = None) -> web.Application:
    """The aiohttp application for `settings`; components are built when it starts.

    `reload_from` re-reads the configuration (what `mergebroker serve` was started from): with it, SIGHUP and
    `POST /v1/broker/reload` apply a changed config without a restart (`engine.reload`).
    """
    traced = bool(settings.telemetry.enabled)  # off: no tracing middleware, no OpenTelemetry call at all
    guard = ConnectionGuard(connection_limits(settings), clock=clock)
    drain = Drain(settings.server.drain_timeout_s)  # real time: a fake-clock test must still shut down
    app = web.Application(client_max_size=settings.server.max_body_bytes, handler_args=HANDLER_ARGS,
                          middlewares=[tracing_middleware] if traced else [])
    app[SETTINGS_MAX_BODY] = settings.server.max_body_bytes
    app[BODY_LIMITS] = BodyLimits(settings.server.max_body_bytes, settings.server.body_timeout_s,
                                  settings.server.max_json_depth)
    app[CONNECTIONS] = guard
    app[DRAIN] = drain
    app.on_shutdown.append(drain.drain)
    errors = error_handling(guard, drain)
    add_routes(app, errors)
    add_unmatched_routes(app, errors)  # last: they take what no route above takes

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        broker = await assemble(settings, queue=front_end_queue(settings), clock=clock, sleep=sleep)
        app[BROKER] = broker
        batches = batch_service(broker)
        if batches is not None:
            app[BATCHES] = batches
            await batches.start()
            freeze_startup_objects()
        guard.observe(connections_listener(broker.metrics, guard.__len__))
        drain.observe(drain_listener(broker.metrics))
        reloader = None
        if reload_from is not None:
            app[RELOADER] = reloader = engine_reloader(app, reload_from, batches)
        sweeper = asyncio.create_task(guard.run())  # real time: it only acts on connections a GuardedSite tracks
        try:
            yield
        finally:
            sweeper.cancel()
            if reloader is not None:
                await reloader.close()  # engines a reload replaced finish retiring first
            if batches is not None:
                await batches.stop()
            await stop_engine(app[BROKER])

    if traced:
        app.cleanup_ctx.append(partial(telemetry_lifecycle, settings.telemetry))
    app.cleanup_ctx.append(lifecycle)
    return app


def engine_reloader(app: web.Application, reload_from: Callable[[], Settings],
                    batches: BatchService | None) -> Reloader:
    """The reloader of `app`'s engine: a new one is assembled sharing the running one's process-wide parts,
    becomes `app[BROKER]` for requests that arrive from then on, and the Batch API follows it."""
    first = app[BROKER]

    async def build(settings: Settings, old: Engine) -> Engine:
        return await assemble(settings, queue=front_end_queue(settings), clock=old.clock, sleep=old.sleep, keep=old)

    def swap(new: Engine) -> None:
        with warnings.catch_warnings():  # aiohttp warns on any change to a started app's state; this one is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            app[BROKER] = new
        if batches is not None:
            assert new.limiter is not None, "assemble() sets the limiter"
            batches.follow(pools=new.pools, limits=Limits(new.limiter, new.chat.limit_specs),
                           merging_allowed=new.policy.merging_allowed)

    async def retire(old: Engine, new: Engine) -> None:
        await stop_engine(old, successor=new)

    return Reloader(load=reload_from, current=lambda: app[BROKER], build=build, swap=swap, retire=retire,
                    idle=engine_idle, on_result=reload_listener(first.metrics))  # retirement waits in real time


async def telemetry_lifecycle(section: TelemetrySettings, app: web.Application) -> AsyncIterator[None]:
    """Install this process's telemetry before the engine starts; flush and remove it after it stopped."""
    app[TELEMETRY] = tracing.install(section.config())
    try:
        yield
    finally:
        await asyncio.to_thread(tracing.uninstall)  # the last export goes out over HTTP: off the loop


def batch_service(broker: Engine) -> BatchService | None:
    """The Batch API over the engine's pools, limits and similarity model (None when disabled)."""
    limiter = broker.limiter
    assert limiter is not None, "assemble() sets the limiter"
    def ledger_line(job: BulkJob, custom_id: str, status: int, body: dict[str, Any], call: CallShare | None) -> None:
        record_bulk_line(broker.metrics, broker.ledger, broker.costs, line_id=f"{job.batch_id}:{custom_id}",
                         tenant=job.tenant, tier=job.tier, status=status, body=body,
                         batch_id=call.batch_id if call else None, batch_size=call.lines if call else 0,
                         alone_prompt_tokens=call.alone_prompt_tokens.get(custom_id) if call else None)

    return build_batch_service(broker.settings, pools=broker.pools, providers=list(broker.providers),
                               limits=Limits(limiter, broker.chat.limit_specs), embedder=broker.embedder,
                               merging_allowed=broker.policy.merging_allowed, metrics=broker.metrics,
                               clock=broker.clock, sleep=broker.sleep or broker.clock.sleep, on_line=ledger_line,
                               costs=broker.costs)


def connection_limits(settings: Settings) -> ConnectionLimits:
    """The client-connection bounds; the default cap leaves descriptors for every provider's connections."""
    s = settings.server
    upstream_fds = sum(p.max_connections for p in settings.providers if p.kind in HTTP_PROVIDER_KINDS) or 100
    cap = s.max_connections or auto_max_connections(s.reserved_fds + upstream_fds)
    return ConnectionLimits(cap, s.header_timeout_s, s.body_timeout_s, s.idle_timeout_s)
