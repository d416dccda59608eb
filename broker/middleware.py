"""The one place HTTP errors leave the service, in OpenAI's envelope; request IDs; per-request log events.

Every response carries `X-Request-ID` (the caller's, or a generated one) and `X-Broker-Overhead-Ms`
(time in the broker minus time waiting on upstreams, which handlers note in `request[INFO].upstream_s`).
The ledger keys its records by a broker-generated ID, never the caller's: a client can neither reuse
nor claim another's. Once a handler has sent a response's headers (a stream), no error response
follows it: the handler ends the stream itself and notes the error in `request[INFO].stream_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from mergebroker.errors import BrokerError, MethodNotAllowed, NotFound, PayloadTooLarge
from mergebroker.broker.ledger import Ledger, LedgerRecord, saved_tokens
from mergebroker.broker.metrics import Metrics
from mergebroker.broker.drain import DRAIN
from mergebroker.broker.server import CONNECTIONS
from mergebroker.broker.state import BROKER, SETTINGS_MAX_BODY, Broker

log = structlog.get_logger("mergebroker.access")


@dataclass
class RequestInfo:
    """What handlers learn about a request, for its headers, log event and metrics."""

    request_id: str  # the caller's X-Request-ID when usable, else `broker_request_id`
    broker_request_id: str  # generated here for every request: unique, the ledger's key
    started: float = 0.0  # perf_counter at arrival
    upstream_s: float = 0.0
    tenant: str | None = None
    tier: str = ""
    model: str | None = None
    batch_size: int | None = None
    batch_id: str | None = None
    cache: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    alone_prompt_tokens: int = 0
    response: web.StreamResponse | None = None  # a handler's own (streamed) response, once created
    usage_settles: asyncio.Future[dict[str, int]] | None = None  # released early: its reported usage, later
    stream_error: BrokerError | None = None  # what ended a stream whose headers were already sent


INFO = web.RequestKey("info", RequestInfo)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLIENT_CLOSED = 499
"""The status a request aborted by its client is counted with (nginx's convention; nothing is sent)."""
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/embeddings": "embeddings", "/v1/models": "models"}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    broker_request_id = "req_" + secrets.token_hex(16)
    given = request.headers.get("X-Request-ID", "")
    request_id = given if 0 < len(given) <= 128 and given.isprintable() else broker_request_id
    info = request[INFO] = RequestInfo(request_id, broker_request_id, started)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id, broker_request_id=broker_request_id)
    guard = request.app.get(CONNECTIONS)
    if guard is not None:
        guard.request_started(request.protocol, request.content.is_eof)
    drain = request.app.get(DRAIN)
    try:
        with drain.track() if drain is not None else contextlib.nullcontext():
            response = await handler(request)
    except Exception as exc:  # noqa: BLE001 - every failure leaves in the one envelope (or, mid-stream, not at all)
        response = _failure_response(request, info, exc)
    except asyncio.CancelledError:
        if drain is None or not drain.expired or (info.response is not None and info.response.prepared):
            # The client went away (handler cancellation): counted, never answered.
            _observe(request, info, CLIENT_CLOSED, time.perf_counter() - started)
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]  # cut off by the shutdown drain: answer 503
        response = _error_response(drain.refusal())
    finally:
        if guard is not None:
            guard.request_finished(request.protocol)
    elapsed = time.perf_counter() - started
    if not response.prepared:
        response.headers["X-Request-ID"] = request_id
        response.headers["X-Broker-Overhead-Ms"] = f"{max(0.0, elapsed - info.upstream_s) * 1000:.2f}"
    # A stream that failed after its 200 went out counts with its error's status in metrics and ledger.
    _observe(request, info, info.stream_error.status if info.stream_error is not None else response.status, elapsed,
             sent_status=response.status)
    return response


def _failure_response(request: web.Request, info: RequestInfo, exc: Exception) -> web.StreamResponse:
    """The response for a handler that raised `exc`: the OpenAI envelope, or the stream already begun."""
    if info.response is not None and info.response.prepared:
        # The status line is out: a second response would be written into the stream's body.
        if isinstance(exc, ConnectionError):
            log.info("client_gone", path=request.path)
        else:
            log.exception("stream_aborted", path=request.path, error=type(exc).__name__)
            info.stream_error = info.stream_error or BrokerError("The stream failed.", status=500,
                                                                 code="stream_failed")
        return info.response
    if isinstance(exc, BrokerError):
        return _error_response(exc)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _error_response(PayloadTooLarge(
            f"Request body too large: the limit is {request.app[SETTINGS_MAX_BODY]} bytes."))
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return _error_response(MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}; "
                                                f"use {', '.join(sorted(exc.allowed_methods))}."))
    if isinstance(exc, web.HTTPNotFound):
        return _error_response(NotFound(f"Unknown route: {request.method} {request.path}."))
    if isinstance(exc, web.HTTPException):
        return _error_response(BrokerError(exc.reason, status=exc.status))
    log.exception("unhandled_error", path=request.path)  # never a traceback to the client
    return _error_response(BrokerError("The broker failed to handle the request.", status=500))


def _error_response(exc: BrokerError) -> web.Response:
    response = web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    for name, value in getattr(exc, "extra_headers", {}).items():
        response.headers[name] = value
    return response


def _observe(request: web.Request, info: RequestInfo, status: int, elapsed: float, *,
             sent_status: int | None = None) -> None:
    endpoint = _ENDPOINTS.get(request.path)
    if endpoint is None:
        return
    record_request(request.app.get(BROKER), info, endpoint, status, elapsed, sent_status=sent_status)


def record_request(broker: Broker | None, info: RequestInfo, endpoint: str, status: int, elapsed: float, *,
                   sent_status: int | None = None) -> None:
    """Count one answered request (metrics, usage ledger) and log its event; HTTP and the library alike."""
    if broker is not None:
        requests, latency = _request_metrics(broker.metrics, endpoint, info.tier, status)
        requests.inc()
        latency.observe(elapsed)
    if broker is not None and broker.ledger is not None and endpoint != "models":
        _record(broker.ledger, info, endpoint, status, elapsed)
    log.info("request", endpoint=endpoint, status=sent_status or status, tenant=info.tenant, tier=info.tier,
             model=info.model, latency_ms=round(elapsed * 1000, 2), upstream_ms=round(info.upstream_s * 1000, 2),
             batch_size=info.batch_size, batch_id=info.batch_id, cache=info.cache,
             stream_error=(info.stream_error.code or info.stream_error.type) if info.stream_error else None)


_CHILDREN: weakref.WeakKeyDictionary[Metrics, dict[tuple[str, str, int], tuple[Any, Any]]] = (
    weakref.WeakKeyDictionary())


def _request_metrics(metrics: Metrics, endpoint: str, tier: str, status: int) -> tuple[Any, Any]:
    """The request counter and latency histogram children for these labels.

    `labels()` costs more than the observation itself, so each child is looked up once per broker
    (weakly keyed, so a stopped broker's metrics are not kept alive).
    """
    children = _CHILDREN.get(metrics)
    if children is None:
        children = _CHILDREN[metrics] = {}
    key = (endpoint, tier, status)
    pair = children.get(key)
    if pair is None:
        pair = children[key] = (metrics.requests.labels(endpoint, tier, str(status)),
                                metrics.request_latency.labels(endpoint, tier))
    return pair


def _record(ledger: Ledger, info: RequestInfo, endpoint: str, status: int, elapsed: float, *_: Any) -> None:
    """Write the request's ledger record; a member released early waits for the merged call's reported usage."""
    settles = info.usage_settles
    if settles is not None and not settles.done():
        settles.add_done_callback(functools.partial(_record, ledger, info, endpoint, status, elapsed))
        return
    if settles is not None and not settles.cancelled() and settles.exception() is None:
        usage = settles.result()
        info.prompt_tokens, info.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    ledger.record(ledger_record(info, endpoint, status, elapsed))


def ledger_record(info: RequestInfo, endpoint: str, status: int, elapsed: float) -> LedgerRecord:
    """The ledger's account of one answered request (token rules in `broker.ledger`)."""
    cache = info.cache if info.cache in ("hit", "coalesced") else "miss"
    reused = cache != "miss"
    prompt = 0 if reused else info.prompt_tokens
    completion = 0 if reused else info.completion_tokens
    batch_size = 0 if reused or status >= 400 and not info.batch_size else (info.batch_size or 1)
    saved = saved_tokens(cache, batch_size, info.alone_prompt_tokens, prompt,  # type: ignore[arg-type]
                         info.completion_tokens if reused else 0, status)
    return LedgerRecord(
        request_id=info.broker_request_id, ts=time.time(), tenant=info.tenant or "", tier=info.tier, model=info.model or "",
        batch_id=None if reused else info.batch_id, batch_size=batch_size, cache=cache,  # type: ignore[arg-type]
        prompt_tokens=prompt, completion_tokens=completion, alone_prompt_tokens=info.alone_prompt_tokens,
        tokens_saved=saved, status=status, latency_ms=round(elapsed * 1000, 3),
        endpoint="embeddings" if endpoint == "embeddings" else "chat")
