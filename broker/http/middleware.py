"""The one place HTTP errors leave the service, in OpenAI's envelope; request IDs; per-request log events.

Every route's handler is wrapped (`error_handling`) when it is registered, rather than run under an aiohttp
middleware: an app with any middleware runs two more layers for every request (aiohttp's own current-app
middleware and the chain it builds). Requests no route takes get the same wrapper through the catch-all
routes `add_unmatched_routes` registers last: 404 for an unknown path, 405 (with `Allow`) for a known path
asked with another method.

Every response carries `X-Request-ID` (the caller's, or a generated one) and `X-Broker-Overhead-Ms`
(time in the broker minus time waiting on upstreams, which handlers note in `request[INFO].upstream_s`).
The ledger keys its records by a broker-generated ID, never the caller's: a client can neither reuse
nor claim another's. Once a handler has sent a response's headers (a stream), no error response
follows it: the handler ends the stream itself and notes the error in `request[INFO].stream_error`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from functools import partial

import structlog
from aiohttp import hdrs, web

from mergebroker import tracing
from mergebroker.broker.engine.accounting.request_record import RequestInfo, new_request_id, record_request
from mergebroker.broker.engine.apis.messages import anthropic_error
from mergebroker.broker.engine.ground.logging import bind_log_context
from mergebroker.broker.http.connections import ConnectionGuard
from mergebroker.broker.http.drain import Drain
from mergebroker.broker.http.keys import BROKER, SETTINGS_MAX_BODY
from mergebroker.errors import BrokerError, MethodNotAllowed, NotFound, PayloadTooLarge

log = structlog.get_logger("mergebroker.access")


INFO = web.RequestKey("info", RequestInfo)
RESPONSE = web.RequestKey("response", web.StreamResponse)
"""A handler's own (streamed) response, once created: the middleware never answers twice."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLIENT_CLOSED = 499
"""The status a request aborted by its client is counted with (nginx's convention; nothing is sent)."""
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/embeddings": "embeddings", "/v1/models": "models",
              "/v1/responses": "responses", "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}
OPERATOR_PATHS = frozenset(("/healthz", "/readyz", "/metrics", "/v1/broker/stats", "/v1/broker/drain"))
"""Routes the shutdown drain neither waits for nor refuses: probes, scrapes and the drain call itself."""
_ANTHROPIC_PATHS = "/v1/messages"
"""Routes of the Anthropic Messages API: their errors leave in Anthropic's envelope, not OpenAI's."""


def error_handling(guard: ConnectionGuard | None, app_drain: Drain | None) -> Callable[[Handler], Handler]:
    """What wraps each route's handler: its request's ID and account, its failures in the API's envelope,
    the connection `guard` told of it and the shutdown `app_drain` waiting for it (each known when the app is
    built, so neither is looked up in the app on every request)."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def handled(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            broker_request_id = new_request_id()
            given = request.headers.get("X-Request-ID", "")
            request_id = given if 0 < len(given) <= 128 and given.isprintable() else broker_request_id
            info = request[INFO] = RequestInfo(request_id, broker_request_id, started)
            # aiohttp runs each request in a task of its own, whose context is a copy: what is bound here stays
            # with this request, so nothing needs clearing first.
            bind_log_context(request_id=request_id, broker_request_id=broker_request_id)
            protocol = request.protocol
            if guard is not None:
                guard.request_started(protocol, request.content.is_eof)
            # Probes, scrapes and the drain call itself neither wait for the drain nor are refused.
            drain = app_drain if app_drain is not None and request.path not in OPERATOR_PATHS else None
            try:
                response = await _handled(request, handler, info, drain)
            finally:
                if guard is not None:
                    guard.request_finished(protocol)
            if drain is not None and drain.draining and not response.prepared:
                response.force_close()  # the client's next request goes to another replica
            elapsed = time.perf_counter() - started
            if not response.prepared:
                response.headers["X-Request-ID"] = request_id
                response.headers["X-Broker-Overhead-Ms"] = f"{max(0.0, elapsed - info.upstream_s) * 1000:.2f}"
            # A stream that failed after its 200 went out counts with its error's status in metrics and ledger.
            status = info.stream_error.status if info.stream_error is not None else response.status
            if tracing.enabled():  # the tracing middleware reads the request's account (its dollars) as this returns
                _observe(request, info, status, elapsed, sent_status=response.status)
            else:
                # Kept one loop turn later, once aiohttp has written the response: the account (metrics, ledger, the
                # request line) changes nothing the caller gets, and the request line alone is a visible share of a
                # request's latency when requests come one at a time. Anything that reads the account over HTTP comes
                # in a later turn, after it.
                asyncio.get_running_loop().call_soon(partial(_observe, request, info, status, elapsed,
                                                             sent_status=response.status))
            return response

        return handled

    return wrap


def add_unmatched_routes(app: web.Application, wrap: Callable[[Handler], Handler]) -> None:
    """Register, after every other route, what answers a request none of them takes, through `wrap`: a known
    path asked with a method it does not serve (405, with the methods it does), and any other path (404)."""
    for resource in list(app.router.resources()):
        allowed = {route.method for route in resource}
        if isinstance(resource, web.Resource) and hdrs.METH_ANY not in allowed:
            resource.add_route(hdrs.METH_ANY, wrap(partial(_method_not_allowed, frozenset(allowed))))
    app.router.add_route(hdrs.METH_ANY, r"/{unmatched:[\s\S]*}", wrap(_not_found))  # any character, newlines too


async def _method_not_allowed(allowed: frozenset[str], request: web.Request) -> web.StreamResponse:
    raise web.HTTPMethodNotAllowed(request.method, allowed)  # answered in the envelope by `_failure_response`


async def _not_found(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()  # answered in the envelope by `_failure_response`


async def _handled(request: web.Request, handler: Handler, info: RequestInfo,
                   drain: Drain | None) -> web.StreamResponse:
    """The handler's response, or the one envelope for its failure; refused while the broker drains."""
    if drain is not None and drain.draining:
        drain.refused()
        return _error_response(drain.refusal(), anthropic=request.path.startswith(_ANTHROPIC_PATHS))
    task = asyncio.current_task()  # the handler's own (`request.task` is its connection's)
    if drain is not None and task is not None:
        drain.enter(task)
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - every failure leaves in the one envelope (or, mid-stream, not at all)
        return _failure_response(request, info, exc)
    except asyncio.CancelledError:
        if drain is None or not drain.expired or _streaming(request):
            # The client went away (handler cancellation): counted, never answered.
            _observe(request, info, CLIENT_CLOSED, time.perf_counter() - info.started)
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]  # cut off by the shutdown drain: answer 503
        return _error_response(drain.refusal(), anthropic=request.path.startswith(_ANTHROPIC_PATHS))
    finally:
        if drain is not None and task is not None:
            drain.leave(task)


def _failure_response(request: web.Request, info: RequestInfo, exc: Exception) -> web.StreamResponse:
    """The response for a handler that raised `exc`: the OpenAI envelope, or the stream already begun."""
    if _streaming(request):
        # The status line is out: a second response would be written into the stream's body.
        if isinstance(exc, ConnectionError):
            log.info("client_gone", path=request.path)
        else:
            log.exception("stream_aborted", path=request.path, error=type(exc).__name__)
            info.stream_error = info.stream_error or BrokerError("The stream failed.", status=500,
                                                                 code="stream_failed")
        return request[RESPONSE]
    anthropic = request.path.startswith(_ANTHROPIC_PATHS)
    if isinstance(exc, BrokerError):
        return _error_response(exc, anthropic=anthropic)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _error_response(PayloadTooLarge(
            f"Request body too large: the limit is {request.app[SETTINGS_MAX_BODY]} bytes."), anthropic=anthropic)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        response = _error_response(MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}; "
                                                    f"use {allowed}."), anthropic=anthropic)
        response.headers["Allow"] = allowed  # RFC 9110: a 405 says which methods the resource takes
        return response
    if isinstance(exc, web.HTTPNotFound):
        return _error_response(NotFound(f"Unknown route: {request.method} {request.path}."), anthropic=anthropic)
    if isinstance(exc, web.HTTPException):
        return _error_response(BrokerError(exc.reason, status=exc.status), anthropic=anthropic)
    log.exception("unhandled_error", path=request.path)  # never a traceback to the client
    return _error_response(BrokerError("The broker failed to handle the request.", status=500), anthropic=anthropic)


def _error_response(exc: BrokerError, *, anthropic: bool = False) -> web.Response:
    status, body = (anthropic_error(exc.status, exc.code, exc.message, exc.type) if anthropic
                    else (exc.status, exc.body()))
    response = web.json_response(body, status=status, headers=exc.headers())
    for name, value in getattr(exc, "extra_headers", {}).items():
        response.headers[name] = value
    return response


def _observe(request: web.Request, info: RequestInfo, status: int, elapsed: float, *,
             sent_status: int | None = None) -> None:
    endpoint = _ENDPOINTS.get(request.path) or ("models" if request.path.startswith("/v1/models/") else None)
    if endpoint is None:
        return
    broker = request.app.get(BROKER)
    metrics, ledger = (broker.metrics, broker.ledger) if broker is not None else (None, None)
    record_request(metrics, ledger, info, endpoint, status, elapsed, sent_status=sent_status)


def _streaming(request: web.Request) -> bool:
    """Whether the handler's own response has gone out (its status line is sent)."""
    response = request.get(RESPONSE)
    return response is not None and response.prepared
