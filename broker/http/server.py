"""Serving the app: a listening site whose connections the `ConnectionGuard` bounds, and `serve` for the CLI.

`web.run_app` cannot wrap the protocol factory, so `serve` does what it does (runner, site, signals,
graceful cleanup) with a `GuardedSite`. Accept errors for lack of descriptors (EMFILE and kin) already
make asyncio pause accepting for a second; `AcceptErrorLog` makes them one log line per interval,
with the count, instead of one traceback each.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, cast

import structlog
from aiohttp import http_parser, web
from aiohttp.web_protocol import RequestHandler

from mergebroker.background import spawn
from mergebroker.broker.engine.ground.settings import ServerSettings
from mergebroker.broker.http.connections import ConnectionGuard
from mergebroker.broker.http.drain import DRAIN, SETTLE_S, Drain
from mergebroker.broker.http.keys import RELOADER
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import error_body

log = structlog.get_logger(__name__)

CONNECTIONS = web.AppKey("connections", ConnectionGuard)
"""The app's connection guard (set by `create_app`, used by the site and the middleware)."""

_ACCEPT_RESOURCE_ERROR = "socket.accept() out of system resource"


class GuardedSite(web.BaseSite):
    """A TCP site whose every connection passes through `guard` (a `web.TCPSite` otherwise)."""

    __slots__ = ("_host", "_port", "_guard")

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked for)."""
        # aiohttp types it as an AbstractServer; it is the loop's `create_server` result (asyncio's or uvloop's),
        # which has `sockets`.
        server = cast("asyncio.Server | None", self._server)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        # aiohttp's Server builds a plain RequestHandler; ours differs only in how it answers what the
        # HTTP parser rejects, so it is built with the same arguments (aiohttp keeps them in `_kwargs`).
        kwargs = getattr(server, "_kwargs", {})
        self._server = await loop.create_server(
            self._guard.protocol_factory(lambda: EnvelopeRequestHandler(server, loop=loop, **kwargs)),
            self._host, self._port, backlog=self._backlog, reuse_address=True)


class EnvelopeRequestHandler(RequestHandler):
    """aiohttp's request handler, except that requests its HTTP parser rejects (a header over 8,190 bytes,
    invalid characters, a duplicated Content-Type...) are answered in the OpenAI error envelope and logged
    as one line, not a traceback."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # part of a response is out: nothing valid can follow
            raise ConnectionError("Response is sent already, cannot send an error response")
        detail = (message or getattr(exc, "message", None) or "").strip().splitlines()
        text = f"The request could not be read: {detail[-1][:200] if detail else 'malformed HTTP'}."
        log.info("http_rejected", status=status, error=type(exc).__name__ if exc else None)
        error_type = "invalid_request_error" if status < 500 else "server_error"
        response = web.json_response(error_body(text, error_type, None, "malformed_request"), status=status)
        response.force_close()
        return response


class AcceptErrorLog:
    """A loop exception handler: accept errors for lack of resources log once per `interval_s`."""

    def __init__(self, interval_s: float, *, clock: Clock = monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_RESOURCE_ERROR:
            loop.default_exception_handler(context)
            return
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return
        exc = context.get("exception")
        log.error("accept_failed", error=str(exc), suppressed_since_last=self.suppressed,
                  message="Out of file descriptors: not accepting for 1 s. Lower server.max_connections "
                          "or raise the open-file limit.")
        self.suppressed, self._next = 0, now + self._interval_s


def http_parser_kind() -> str:
    """`c` when aiohttp parses HTTP with its compiled parser, `python` when it fell back to the pure one (no
    wheel for the platform, or AIOHTTP_NO_EXTENSIONS set): several times slower, so the start-up log says."""
    return "c" if http_parser.HttpRequestParser.__module__ == "aiohttp._http_parser" else "python"


def runner_for(app: web.Application, settings: ServerSettings) -> web.AppRunner:
    """The app runner `serve` uses; aiohttp's own keep-alive timer doubles the guard's idle timeout."""
    return web.AppRunner(app, access_log=None, handler_cancellation=True,  # a gone client leaves its window
                         keepalive_timeout=settings.idle_timeout_s,
                         shutdown_timeout=SETTLE_S + 5)  # the drain ran before: only the handlers it cut are left


class StopSignals:
    """SIGINT/SIGTERM for `serve`: the first starts the drain and the stop; a second ends the drain at once."""

    def __init__(self, drain: Drain, stop: asyncio.Event) -> None:
        self._drain = drain
        self._stop = stop
        self.received = 0

    def __call__(self, sig: signal.Signals) -> None:
        self.received += 1
        if self.received == 1:
            self._drain.begin(f"{sig.name} received")
            self._stop.set()
        else:
            log.warning("drain_forced", signal=sig.name)
            self._drain.expire()


async def serve(app: web.Application, settings: ServerSettings, *, stop: asyncio.Event | None = None) -> None:
    """Serve `app` on `settings.host:port` until SIGINT/SIGTERM (or `stop` is set); then drain while still
    listening (`drain`: readiness goes 503, new requests are refused, those in flight finish), and only
    then stop listening and clean up."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptErrorLog(settings.accept_error_log_interval_s))
    stop = stop or asyncio.Event()
    drain = app[DRAIN]
    signals = StopSignals(drain, stop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals, sig)
    runner = runner_for(app, settings)
    await runner.setup()
    reloads: set[asyncio.Task[Any]] = set()
    reloader = app.get(RELOADER)
    if reloader is not None:  # SIGHUP re-reads the config, as `POST /v1/broker/reload` does
        loop.add_signal_handler(signal.SIGHUP, lambda: spawn(reloads, reloader.reload("SIGHUP"), "reload"))
    try:
        site = GuardedSite(runner, app[CONNECTIONS], settings.host, settings.port, backlog=settings.backlog)
        await site.start()
        log.info("listening", url=site.name, max_connections=app[CONNECTIONS].limits.max_connections)
        await stop.wait()
        await drain.drain()
    finally:
        await runner.cleanup()
