"""Thin HTTP handlers: parse, authenticate, call the service, shape the response and its headers."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
from aiohttp import web
from pydantic import SecretStr

from mergebroker import jsonio
from mergebroker.broker.engine.chat.service import CacheControl
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.schemas import parse_chat, parse_embeddings
from mergebroker.broker.engine.handling import (
    authenticate,
    chat_headers,
    check_chat_model,
    complete_chat,
    create_embeddings,
    embedding_headers,
    model_not_found,
    open_chat_stream,
    with_body_options,
)
from mergebroker.broker.http.api_routes import (
    count_message_tokens,
    create_message,
    create_response,
    delete_response,
    response_input_items,
    retrieve_response,
    send_stream,
)
from mergebroker.broker.http.body import BODY_LIMITS, read_json
from mergebroker.broker.http.bulk_routes import (
    cancel_batch,
    create_batch,
    delete_file,
    file_content,
    list_batches,
    list_files,
    retrieve_batch,
    retrieve_file,
    upload_file,
)
from mergebroker.broker.http.drain import DRAIN
from mergebroker.broker.http.keys import BROKER, RELOADER
from mergebroker.broker.http.middleware import INFO, Handler
from mergebroker.clock import Clock, monotonic
from mergebroker.errors import BrokerError, Forbidden, InvalidRequest, Unauthorized

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


def add_routes(app: web.Application, wrap: Callable[[Handler], Handler]) -> None:
    """Register every endpoint, each handler wrapped by `wrap` (the error handling, `middleware.error_handling`)."""
    app[UPSTREAM_MODELS] = UpstreamModels()
    table = [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/embeddings", embeddings),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", retrieve_model),  # IDs may hold slashes ("org/model")
        web.get("/v1/broker/stats", broker_stats),
        web.post("/v1/broker/drain", broker_drain),
        web.post("/v1/broker/reload", broker_reload),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.post("/v1/files", upload_file),
        web.get("/v1/files", list_files),
        web.get("/v1/files/{file_id}", retrieve_file),
        web.delete("/v1/files/{file_id}", delete_file),
        web.get("/v1/files/{file_id}/content", file_content),
        web.post("/v1/batches", create_batch),
        web.get("/v1/batches", list_batches),
        web.get("/v1/batches/{batch_id}", retrieve_batch),
        web.post("/v1/batches/{batch_id}/cancel", cancel_batch),
        web.post("/v1/responses", create_response),
        web.get("/v1/responses/{response_id}", retrieve_response),
        web.delete("/v1/responses/{response_id}", delete_response),
        web.get("/v1/responses/{response_id}/input_items", response_input_items),
        web.post("/v1/messages", create_message),
        web.post("/v1/messages/count_tokens", count_message_tokens),
    ]
    app.router.add_routes([web.RouteDef(r.method, r.path, wrap(r.handler), r.kwargs) for r in table])


async def _json_body(request: web.Request) -> Any:
    return await read_json(request, request.app[BODY_LIMITS])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    broker, info = request.app[BROKER], request[INFO]
    known = authenticate(broker, info, request.headers, None, None)  # from the headers, before the body costs anything
    parsed, body = parse_chat(await _json_body(request), max_messages=broker.settings.server.max_messages)
    caller = with_body_options(broker, info, request.headers, known, parsed)
    check_chat_model(broker, info, parsed, body)
    if parsed.stream:
        return await send_stream(request, await open_chat_stream(broker, info, caller, parsed, body))
    result = await complete_chat(broker, info, caller, parsed, body,
                                 CacheControl.from_header(request.headers.get("Cache-Control")))
    return web.Response(body=jsonio.dumps(result.outcome.body), content_type="application/json",
                        headers=chat_headers(result))


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
    drain = request.app.get(DRAIN)
    draining = drain.status() if drain is not None else None
    broker = request.app.get(BROKER)
    if broker is None:
        return web.json_response({"ready": False, "reason": draining or "starting"}, status=503)
    ready, checks = broker.ready()
    failing = [name for name, ok in checks.items() if not ok]
    body: dict[str, Any] = {"ready": ready and draining is None, "checks": checks,
                            "providers": {name: b.snapshot() for name, b in broker.breakers.items()}}
    if not body["ready"]:
        body["reason"] = draining or "failing checks: " + ", ".join(failing)
    return web.json_response(body, status=200 if body["ready"] else 503)


def _operator_only(request: web.Request, broker: Engine) -> None:
    """With `server.metrics_token_env` set, the operator's endpoints need `Authorization: Bearer <token>`."""
    token = broker.settings.server.metrics_token
    if token is not None and not _bearer_matches(request.headers, token):
        raise Unauthorized("This endpoint needs the metrics token: 'Authorization: Bearer <token>'.",
                           code="invalid_metrics_token")


def _bearer_matches(headers: Mapping[str, str], token: SecretStr) -> bool:
    given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, b"Bearer " + token.get_secret_value().encode())


async def metrics(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    _operator_only(request, broker)
    return web.Response(body=broker.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def broker_stats(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    _operator_only(request, broker)
    return web.json_response(broker.stats())


async def broker_drain(request: web.Request) -> web.Response:
    """POST /v1/broker/drain[?timeout_s=S]: start the shutdown drain and answer once nothing is in flight, the
    drain's deadline passed, or `timeout_s` (the drain goes on): `{"drained": bool, "in_flight": n}`. For a
    preStop hook: from a loopback peer, or with the metrics token where one is set."""
    broker = request.app.get(BROKER)
    token = broker.settings.server.metrics_token if broker is not None else None
    if not drain_allowed(request.remote, request.headers, token):
        raise Forbidden("POST /v1/broker/drain is taken from a loopback peer (not through a proxy) or with "
                        "the metrics token.", code="drain_not_allowed")
    timeout_s = _timeout_param(request.query.get("timeout_s"))
    drain = request.app[DRAIN]
    drain.begin("POST /v1/broker/drain")
    result = await drain.wait(timeout_s)
    return web.json_response({"drained": result.drained, "in_flight": result.in_flight})


async def broker_reload(request: web.Request) -> web.Response:
    """POST /v1/broker/reload: re-read the config and apply it without a restart (as SIGHUP does); 200 with what
    changed, or 422 with the reason it was refused (the running config stays). From a loopback peer, or with
    the metrics token where one is set."""
    broker = request.app.get(BROKER)
    token = broker.settings.server.metrics_token if broker is not None else None
    if not drain_allowed(request.remote, request.headers, token):
        raise Forbidden("POST /v1/broker/reload is taken from a loopback peer (not through a proxy) or with "
                        "the metrics token.", code="reload_not_allowed")
    reloader = request.app.get(RELOADER)
    if reloader is None:
        raise BrokerError("This broker was not started from a config it can re-read (mergebroker serve is).",
                          status=409, code="reload_unavailable")
    result = await reloader.reload("POST /v1/broker/reload")
    if result.result == "refused":
        body = InvalidRequest(f"The configuration was refused: {result.reason}", code="config_refused").body()
        return web.json_response({**body, **result.as_dict()}, status=422)
    return web.json_response(result.as_dict())


_PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Real-IP")


def drain_allowed(remote: str | None, headers: Mapping[str, str], token: SecretStr | None) -> bool:
    """Whether a drain call may stop this broker: with the metrics token (when one is set), else only from a
    loopback peer that is not a proxy passing on someone else's request."""
    if token is not None and _bearer_matches(headers, token):
        return True
    if remote is None or any(name in headers for name in _PROXY_HEADERS):
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False  # a Unix socket peer or an unreadable address


def _timeout_param(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = -1.0
    if not 0 <= timeout_s < float("inf"):
        raise InvalidRequest("timeout_s must be a number of seconds, 0 or more.", param="timeout_s")
    return timeout_s
