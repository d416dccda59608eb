"""Thin HTTP handlers: parse, authenticate, call the service, shape the response and its headers."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.http.bulk_routes import add_batch_routes
from mergebroker.broker.http.body import BODY_LIMITS, read_json
from mergebroker.broker.engine.broker import Broker
from mergebroker.broker.http.keys import BROKER
from mergebroker.broker.engine.chat.service import CacheControl
from mergebroker import jsonio
from mergebroker.clock import Clock, monotonic
from mergebroker.broker.engine.handling import (authenticate, chat_headers, check_chat_model, complete_chat,
                                                create_embeddings, embedding_headers, model_not_found,
                                                with_body_options)
from mergebroker.errors import BrokerError, Unauthorized
from mergebroker.token_usage import TokenUsage
from mergebroker.broker.http.middleware import INFO, RESPONSE
from mergebroker.broker.engine.schemas import parse_chat, parse_embeddings

log = structlog.get_logger(__name__)

MODELS_TTL_S = 60.0
"""How long the model list reported by wildcard upstreams is reused before asking them again."""


class UpstreamModels:
    """The wildcard upstreams' model list, fetched at most once per `ttl_s` (concurrent askers share a fetch)."""

    def __init__(self, *, ttl_s: float = MODELS_TTL_S, clock: Clock = monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._names: list[str] = []
        self._expires = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self, fetch: Callable[[], Awaitable[list[str]]]) -> list[str]:
        """The cached names, refreshed with `fetch()` when older than the TTL."""
        if self._clock() < self._expires:
            return list(self._names)
        async with self._lock:
            if self._clock() >= self._expires:  # the holder before us may have refreshed it
                self._names = await fetch()
                self._expires = self._clock() + self._ttl_s
        return list(self._names)


UPSTREAM_MODELS = web.AppKey("upstream_models", UpstreamModels)


def add_routes(app: web.Application) -> None:
    app[UPSTREAM_MODELS] = UpstreamModels()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # IDs may hold slashes ("org/model")
    app.router.add_get("/v1/broker/stats", broker_stats)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    add_batch_routes(app)


async def _json_body(request: web.Request) -> Any:
    return await read_json(request, request.app[BODY_LIMITS])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    broker, info = request.app[BROKER], request[INFO]
    known = authenticate(broker, info, request.headers, None, None)  # from the headers, before the body costs anything
    parsed, body = parse_chat(await _json_body(request), max_messages=broker.settings.server.max_messages)
    caller = with_body_options(broker, info, request.headers, known, parsed)
    check_chat_model(broker, info, parsed, body)
    if parsed.stream:
        options = parsed.broker
        return await _stream(request, broker, caller, body, options.timeout_s if options else None,
                             bool(options and options.merge is False))
    result = await complete_chat(broker, info, caller, parsed, body,
                                 CacheControl.from_header(request.headers.get("Cache-Control")))
    return web.Response(body=jsonio.dumps(result.outcome.body), content_type="application/json",
                        headers=chat_headers(result))


async def _stream(request: web.Request, broker: Broker, caller: Caller, body: dict[str, Any],
                  timeout_s: float | None, merge_opt_out: bool) -> web.StreamResponse:
    """Relay an upstream stream (or a merged member's own stream). Errors before the first byte leave as
    ordinary error responses; once the response is prepared, an error ends the stream with one SSE `error`
    event (no `[DONE]`)."""
    info = request[INFO]
    before_upstream = time.perf_counter()
    start = await broker.chat.stream(caller, body, timeout_s=timeout_s, request_id=info.request_id,
                                     merge_opt_out=merge_opt_out)
    chunks, outcome, reservation = start.chunks, start.outcome, start.reservation
    # No await between here and the `try`: the stream and the reservation are released on every path.
    spent = reservation.tokens  # unless the stream reports its usage, keep the reservation as spent
    info.usage_settles, info.alone_prompt_tokens = outcome.settled_usage, start.prompt_estimate  # the ledger waits
    info.provider = outcome.provider
    response = request[RESPONSE] = web.StreamResponse()  # noted, so the middleware never answers twice
    try:
        info.upstream_s = time.perf_counter() - before_upstream  # until the first chunk
        info.batch_size, info.batch_id, info.cache = outcome.batch_size, outcome.batch_id, "miss"
        if outcome.batch_id:
            response.headers["X-Broker-Batch-Id"] = outcome.batch_id
        response.headers.update({
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-ID": info.request_id,
            "X-Broker-Batch-Size": str(outcome.batch_size), "X-Broker-Cache": "miss",
            "X-Broker-Overhead-Ms": f"{(before_upstream - info.started) * 1000:.2f}", **reservation.headers()})
        await response.prepare(request)
        spent = _spent(outcome.settled_usage, await _relay(response, chunks, spent))
    except BrokerError as exc:
        if not response.prepared:
            raise
        info.stream_error = exc
        log.warning("stream_failed", status=exc.status, code=exc.code)
        await response.write(b"data: " + json.dumps(exc.body()).encode() + b"\n\n")
    finally:
        try:
            await chunks.aclose()  # a client leaving mid-stream frees the upstream slot and connection now
        finally:
            await reservation.settle(spent)
    await response.write_eof()
    return response


async def _relay(response: web.StreamResponse, chunks: AsyncIterator[bytes], spent: int) -> int:
    """Copy the upstream's events to the client; the tokens spent (the reported usage, if any)."""
    async for chunk in chunks:
        await response.write(chunk)
        if b'"total_tokens"' in chunk:
            spent = _stream_usage(chunk, default=spent)
    return spent


def _spent(usage: asyncio.Future[Any] | None, default: int) -> int:
    """The tokens a stream spent: its settled usage when it is known by the stream's end, else `default`."""
    if usage is None or not usage.done() or usage.cancelled() or usage.exception() is not None:
        return default
    settled = usage.result()
    return settled.total_tokens if isinstance(settled, TokenUsage) else _stream_usage_of(settled, default)


def _stream_usage_of(usage: Any, default: int) -> int:
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else default


def _stream_usage(chunk: bytes, *, default: int) -> int:
    """Total tokens from a `stream_options.include_usage` chunk (`data: {..."usage": {...}}`)."""
    try:
        usage = json.loads(chunk.split(b"data:", 1)[1]).get("usage") or {}
        return int(usage.get("total_tokens", default))
    except (ValueError, IndexError, AttributeError, TypeError):
        return default


async def embeddings(request: web.Request) -> web.Response:
    broker, info = request.app[BROKER], request[INFO]
    known = authenticate(broker, info, request.headers, None, None)  # from the headers, before the body costs anything
    parsed, body = parse_embeddings(await _json_body(request))
    caller = with_body_options(broker, info, request.headers, known, parsed)
    result = await create_embeddings(broker, info, caller, parsed, body)
    return web.json_response(result.body, headers=embedding_headers(result))


async def list_models(request: web.Request) -> web.Response:
    names = await _model_names(request)
    return web.json_response({"object": "list", "data": [_model(n) for n in names]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one model of the list, or the 404 a chat request for it would get."""
    model = request.match_info["model"]
    if model not in await _model_names(request):
        raise model_not_found(model)
    return web.json_response(_model(model))


async def _model_names(request: web.Request) -> list[str]:
    """The models this caller may use (authenticated like the other `/v1` routes), each once, in order."""
    broker = request.app[BROKER]
    authenticate(broker, request[INFO], request.headers, None, None)
    names = broker.pools.explicit_models()
    if broker.pools.has_wildcard():
        names += await request.app[UPSTREAM_MODELS].get(broker.pools.upstream_models)
    names += broker.embeddings.local_models()
    return list(dict.fromkeys(names))


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mergebroker"}


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    broker = request.app.get(BROKER)
    if broker is None:
        return web.json_response({"ready": False}, status=503)
    ready, checks = broker.ready()
    body = {"ready": ready, "checks": checks,
            "providers": {name: b.snapshot() for name, b in broker.breakers.items()}}
    return web.json_response(body, status=200 if ready else 503)


def _operator_only(request: web.Request, broker: Broker) -> None:
    """With `server.metrics_token_env` set, the operator's endpoints need `Authorization: Bearer <token>`."""
    token = broker.settings.server.metrics_token
    if token is None:
        return
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, b"Bearer " + token.get_secret_value().encode()):
        raise Unauthorized("This endpoint needs the metrics token: 'Authorization: Bearer <token>'.",
                           code="invalid_metrics_token")


async def metrics(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    _operator_only(request, broker)
    return web.Response(body=broker.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def broker_stats(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    _operator_only(request, broker)
    return web.json_response(broker.stats())
