"""The SERVER span of every inbound request (`mergebroker.tracing`), registered only while telemetry is on.

It is the outermost middleware: the span covers the error envelope and the request's accounting, and
continues the caller's trace when it sends a `traceparent`. What the span records about the request
(tier, tenant, cache, batch, apportioned usage and dollars) is what the handlers and the accounting
already noted in `request[INFO]`; a member answered before its merged call's usage was reported (early
release, a stream) ends its span when that usage settles, after the ledger has priced it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from mergebroker import tracing
from mergebroker.broker.engine.accounting.request_record import RequestInfo
from mergebroker.broker.http.middleware import INFO, Handler
from mergebroker.broker.http.middleware import OPERATOR_PATHS as UNTRACED_PATHS

TELEMETRY = web.AppKey("telemetry", tracing.Telemetry)
"""The process's installed telemetry, while this app installed it (tests flush it)."""


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Open the request's SERVER span, keep it current while the request is handled, end it with its account."""
    if request.path in UNTRACED_PATHS:
        return await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    span = tracing.start_server(request.method, route, request.path, request.headers)
    if span is None:
        return await handler(request)
    try:
        response = await handler(request)
    except BaseException as exc:  # the client left (cancelled): its account was counted as 499
        span.detach()
        span.end(_attributes(request.get(INFO), None), 499 if isinstance(exc, asyncio.CancelledError) else 500)
        raise
    span.detach()
    info = request.get(INFO)
    attributes = _attributes(info, response)
    status = info.stream_error.status if info is not None and info.stream_error is not None else response.status
    settles = info.usage_settles if info is not None else None
    if settles is not None and not settles.done():
        # Added after the ledger's own callback (`record_request` ran inside the handler's middleware), so
        # the usage and dollars it reads are the settled ones.
        settles.add_done_callback(lambda _: span.end(_attributes(info, response), status))
    else:
        span.end(attributes, status)
    return response


def _attributes(info: RequestInfo | None, response: web.StreamResponse | None) -> dict[str, Any]:
    if info is None:
        return {}
    # Its own usage: a merged member's share of the call, as apportioned; nothing for an answer reused.
    counted = info.batch_size is not None and info.cache not in ("hit", "coalesced")
    return {"mergebroker.tier": info.tier or None, "mergebroker.tenant": info.tenant,
            "mergebroker.cache": info.cache, "mergebroker.batch_id": info.batch_id,
            "mergebroker.batch_size": info.batch_size, "mergebroker.merge_decision": _decision(info, response),
            "mergebroker.usd_actual": info.usd_actual, "mergebroker.usd_alone": info.usd_alone,
            "gen_ai.request.model": info.model, "mergebroker.provider": info.provider,
            "gen_ai.usage.input_tokens": info.prompt_tokens if counted else None,
            "gen_ai.usage.output_tokens": info.completion_tokens if counted else None}


def _decision(info: RequestInfo, response: web.StreamResponse | None) -> str | None:
    """How the request was answered: from the cache, coalesced, merged, re-sent alone (fallback), or alone."""
    if info.cache in ("hit", "coalesced"):
        return info.cache
    fallback = response.headers.get("X-Broker-Fallback") if response is not None else None
    if fallback:
        return f"fallback:{fallback}"
    if info.batch_size is None:
        return None
    return "merged" if info.batch_size > 1 else "alone"
