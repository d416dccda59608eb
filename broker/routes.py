"""Thin HTTP handlers: parse, authenticate, call the service, shape the response and its headers."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from mergebroker.broker.admission import TIER_HEADER, Caller
from mergebroker.broker.body import BODY_LIMITS, read_json
from mergebroker.broker.state import BROKER, Broker
from mergebroker.broker.chat import CacheControl
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError, NotFound, Unauthorized
from mergebroker.broker.middleware import INFO
from mergebroker.broker.schemas import parse_chat, parse_embeddings

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
    app.router.add_get("/v1/broker/stats", broker_stats)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)


async def _json_body(request: web.Request) -> Any:
    return await read_json(request, request.app[BODY_LIMITS])


def _authenticate(request: web.Request, broker: Broker, options: Any, user: str | None) -> Caller:
    try:
        caller = broker.auth.authenticate(request.headers, body_tier=options.tier if options else None,
                                          body_user=user)
    except Exception as exc:
        reason = "unauthorized" if getattr(exc, "status", 0) == 401 else "forbidden"
        broker.metrics.rejected.labels(_tier_label(broker, request.headers.get(TIER_HEADER)), reason).inc()
        raise
    request[INFO].tenant, request[INFO].tier = caller.tenant, caller.tier
    return caller


def _with_body_options(request: web.Request, broker: Broker, known: Caller, parsed: Any) -> Caller:
    """The caller once the body is read: its `broker.tier` and `user` may still choose (and be refused)."""
    if (parsed.broker is None or parsed.broker.tier is None) and parsed.user is None:
        return known
    return _authenticate(request, broker, parsed.broker, parsed.user)


def _tier_label(broker: Broker, requested: str | None) -> str:
    """A metric label for a tier named by an unauthenticated request: only configured names, never junk."""
    return requested if any(t.name == requested for t in broker.settings.tiers) else "unknown"


def _model_not_found(model: str) -> NotFound:
    return NotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model",
                    code="model_not_found")


def _check_model(broker: Broker, model: str) -> None:
    if not broker.pools.serves(model) and not broker.embeddings.serves(model):
        raise _model_not_found(model)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    broker = request.app[BROKER]
    known = _authenticate(request, broker, None, None)  # from the headers, before the body costs anything
    parsed, body = parse_chat(await _json_body(request), max_messages=broker.settings.server.max_messages)
    caller = _with_body_options(request, broker, known, parsed)
    request[INFO].model = parsed.model
    if not broker.pools.serves(parsed.model):  # a local embedding model cannot chat
        raise _model_not_found(parsed.model)
    options = parsed.broker
    timeout_s = options.timeout_s if options else None
    if parsed.stream:
        return await _stream(request, broker, caller, body, timeout_s)
    result = await broker.chat.complete(
        caller, request[INFO].request_id, body, timeout_s=timeout_s,
        merge_opt_out=bool(options and options.merge is False),
        cache_control=CacheControl.from_header(request.headers.get("Cache-Control")))
    outcome = result.outcome
    info = request[INFO]
    info.upstream_s, info.batch_size, info.batch_id, info.cache = (outcome.upstream_s, outcome.batch_size,
                                                                   outcome.batch_id, result.cache)
    usage = outcome.body.get("usage") or {}
    info.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    info.completion_tokens = int(usage.get("completion_tokens") or 0)
    info.alone_prompt_tokens = result.prompt_estimate
    headers = {"X-Broker-Batch-Size": str(outcome.batch_size), "X-Broker-Cache": result.cache, **result.limit_headers}
    if outcome.batch_id:
        headers["X-Broker-Batch-Id"] = outcome.batch_id
    if outcome.fallback:
        headers["X-Broker-Fallback"] = outcome.fallback
    return web.json_response(outcome.body, headers=headers)


async def _stream(request: web.Request, broker: Broker, caller: Caller, body: dict[str, Any],
                  timeout_s: float | None) -> web.StreamResponse:
    """Relay an upstream stream. Errors before the first byte leave as ordinary error responses; once the
    response is prepared, an error ends the stream with one SSE `error` event (no `[DONE]`)."""
    info = request[INFO]
    before_upstream = time.perf_counter()
    chunks, _, reservation = await broker.chat.stream(caller, body, timeout_s=timeout_s)
    # No await between here and the `try`: the stream and the reservation are released on every path.
    spent = reservation.tokens  # unless the stream reports its usage, keep the reservation as spent
    response = info.response = web.StreamResponse()  # noted, so the middleware never answers twice
    try:
        info.upstream_s = time.perf_counter() - before_upstream  # until the first chunk
        info.batch_size, info.cache = 1, "miss"
        response.headers.update({
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-ID": info.request_id,
            "X-Broker-Batch-Size": "1", "X-Broker-Cache": "miss",
            "X-Broker-Overhead-Ms": f"{(before_upstream - info.started) * 1000:.2f}", **reservation.headers()})
        await response.prepare(request)
        spent = await _relay(response, chunks, spent)
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


def _stream_usage(chunk: bytes, *, default: int) -> int:
    """Total tokens from a `stream_options.include_usage` chunk (`data: {..."usage": {...}}`)."""
    try:
        usage = json.loads(chunk.split(b"data:", 1)[1]).get("usage") or {}
        return int(usage.get("total_tokens", default))
    except (ValueError, IndexError, AttributeError, TypeError):
        return default


async def embeddings(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    known = _authenticate(request, broker, None, None)  # from the headers, before the body costs anything
    parsed, body = parse_embeddings(await _json_body(request))
    caller = _with_body_options(request, broker, known, parsed)
    request[INFO].model = parsed.model
    _check_model(broker, parsed.model)
    result = await broker.embeddings.create(caller, parsed, body)
    info = request[INFO]
    info.cache, info.batch_size, info.upstream_s = result.cache_summary, 1, result.upstream_s
    info.prompt_tokens = info.alone_prompt_tokens = int(result.body["usage"]["prompt_tokens"])
    return web.json_response(result.body, headers={"X-Broker-Cache": result.cache_summary,
                                                   "X-Broker-Batch-Size": "1", **result.limit_headers})


async def list_models(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    _authenticate(request, broker, None, None)
    names = broker.pools.explicit_models()
    if broker.pools.has_wildcard():
        names += await request.app[UPSTREAM_MODELS].get(broker.pools.upstream_models)
    names += broker.embeddings.local_models()
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "mergebroker"} for n in dict.fromkeys(names)]
    return web.json_response({"object": "list", "data": data})


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
