"""One request's handling apart from its transport: admission, the model check, the service call, its headers.

The HTTP handlers (`routes`) and the in-process library (`library`) both answer through here, so a
request gets the same authentication, limits, cache, coalescing, queue and merging whichever way it came.
Each function notes what it learns in the request's `RequestInfo` (log event, metrics, ledger).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from mergebroker.broker.engine.accounting.request_record import RequestInfo, note_usage
from mergebroker.broker.engine.chat.service import CacheControl, ChatResult
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.embeddings.service import EmbeddingResponse
from mergebroker.broker.engine.ground.schemas import BrokerOptions, ChatRequest, EmbeddingRequest
from mergebroker.broker.engine.ground.tokens import count_text_tokens, estimate_prompt_tokens
from mergebroker.broker.engine.limits.admission import TIER_HEADER, Caller
from mergebroker.broker.engine.streams import HandledStream, PassThrough, Relay
from mergebroker.errors import NotFound
from mergebroker.token_usage import TokenUsage


def authenticate(broker: Engine, info: RequestInfo, headers: Mapping[str, str], options: BrokerOptions | None,
                 user: str | None) -> Caller:
    """The caller named by `headers` (and the body's `broker.tier` / `user`); refusals are counted by tier."""
    try:
        caller = broker.auth.authenticate(headers, body_tier=options.tier if options else None, body_user=user)
    except Exception as exc:
        reason = "unauthorized" if getattr(exc, "status", 0) == 401 else "forbidden"
        broker.metrics.rejected.labels(_tier_label(broker, headers.get(TIER_HEADER)), reason).inc()
        raise
    info.tenant, info.tier = caller.tenant, caller.tier
    return caller


def with_body_options(broker: Engine, info: RequestInfo, headers: Mapping[str, str], known: Caller,
                      parsed: ChatRequest | EmbeddingRequest) -> Caller:
    """The caller once the body is read: its `broker.tier` and `user` may still choose (and be refused).

    Callers are first authenticated from the headers alone, so an unknown caller costs no body parsing.
    """
    if (parsed.broker is None or parsed.broker.tier is None) and parsed.user is None:
        return known
    return authenticate(broker, info, headers, parsed.broker, parsed.user)


def _tier_label(broker: Engine, requested: str | None) -> str:
    """A metric label for a tier named by an unauthenticated request: only configured names, never junk."""
    return requested if requested is not None and any(t.name == requested for t in broker.settings.tiers) else "unknown"


def model_not_found(model: str) -> NotFound:
    """The 404 for a model no upstream (or local model) serves."""
    return NotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model",
                    code="model_not_found")


def check_chat_model(broker: Engine, info: RequestInfo, parsed: ChatRequest, body: Mapping[str, Any]) -> None:
    """404 unless an upstream serves the model (a local embedding model cannot chat); then note how the
    request is priced."""
    info.model = parsed.model
    if not broker.pools.serves(parsed.model):
        raise model_not_found(parsed.model)
    price_on_arrival(broker, info, body)


def price_on_arrival(broker: Engine, info: RequestInfo, body: Mapping[str, Any]) -> None:
    """A priced request (`body`: its chat form) is priced when answered, native calls of the other APIs too; in a tier that merges, the model of the provider's cache
    sees its prompt now, in arrival order, as it would have were every request sent alone."""
    costs = broker.costs
    if costs is None or info.costs is not None or costs.price(info.model) is None:
        return  # unpriced, or priced already (a native call that fell back to its chat form)
    info.costs = costs
    if broker.chat.merges(info.tier):
        info.alone_cached_tokens = costs.observe_alone("", info.model or "", body.get("messages") or [])


async def complete_chat(broker: Engine, info: RequestInfo, caller: Caller, parsed: ChatRequest,
                        body: dict[str, Any], cache_control: CacheControl) -> ChatResult:
    """Answer one non-streaming chat request (validated, authenticated, model checked)."""
    options = parsed.broker
    result = await broker.chat.complete(
        caller, info.request_id, body, timeout_s=options.timeout_s if options else None,
        merge_opt_out=bool(options and options.merge is False), cache_control=cache_control)
    outcome = result.outcome
    info.upstream_s, info.batch_size, info.batch_id, info.cache = (outcome.upstream_s, outcome.batch_size,
                                                                   outcome.batch_id, result.cache)
    note_usage(info, outcome.usage)
    info.usage_settles = outcome.settled_usage
    info.provider = outcome.provider
    # A request sent alone is its own alone bill: its counts only teach the calibration, which samples them.
    costs, sent_alone = info.costs, result.cache == "miss" and outcome.batch_size <= 1
    priced = costs is not None and (not sent_alone or costs.calibration.wants_sample(outcome.provider or "",
                                                                                      info.model or ""))
    estimate = result.prompt_estimate
    if estimate is None and (priced or broker.ledger is not None):  # counted late (`ChatService._admit`)
        estimate = estimate_prompt_tokens(body.get("messages") or [])
    info.alone_prompt_tokens = estimate or 0
    if priced and broker.chat.merges(info.tier):  # the alone estimate of its answer's tokens
        info.answer_tokens = count_text_tokens(_answer_text(outcome.body))
    return result


async def open_chat_stream(broker: Engine, info: RequestInfo, caller: Caller, parsed: ChatRequest,
                           body: dict[str, Any], *, relay: Relay | None = None,
                           headers: Mapping[str, str] | None = None) -> HandledStream:
    """Open one streaming chat request (validated, authenticated, model checked): its own upstream stream, or
    its block of a merged call, as a `HandledStream` of SSE frames, relayed as they are or through `relay`
    (another API's events translated from chat), with `headers` added to the broker's."""
    options = parsed.broker
    before_upstream = time.perf_counter()
    start = await broker.chat.stream(caller, body, timeout_s=options.timeout_s if options else None,
                                     request_id=info.request_id, merge_opt_out=bool(options and options.merge is False))
    outcome = start.outcome
    info.usage_settles, info.alone_prompt_tokens = outcome.settled_usage, start.prompt_estimate  # the ledger waits
    info.provider, info.batch_size, info.batch_id, info.cache = (outcome.provider, outcome.batch_size,
                                                                 outcome.batch_id, "miss")
    info.upstream_s = time.perf_counter() - before_upstream  # until the first chunk
    sent = {"X-Broker-Batch-Size": str(outcome.batch_size), "X-Broker-Cache": "miss", **(headers or {})}
    if outcome.batch_id:
        sent["X-Broker-Batch-Id"] = outcome.batch_id
    return HandledStream(info, start.chunks, start.reservation, relay or PassThrough(),
                         settled_usage=outcome.settled_usage, headers=sent)


def _answer_text(body: Mapping[str, Any]) -> str:
    choices = body.get("choices") or []
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else ""


def chat_headers(result: ChatResult) -> dict[str, str]:
    """The broker's response headers for a chat answer: batch size and id, cache, fallback, limits."""
    outcome = result.outcome
    headers = {"X-Broker-Batch-Size": str(outcome.batch_size), "X-Broker-Cache": result.cache,
               **result.limit_headers}
    if outcome.batch_id:
        headers["X-Broker-Batch-Id"] = outcome.batch_id
    if outcome.fallback:
        headers["X-Broker-Fallback"] = outcome.fallback
    return headers


async def create_embeddings(broker: Engine, info: RequestInfo, caller: Caller, parsed: EmbeddingRequest,
                            body: dict[str, Any]) -> EmbeddingResponse:
    """Answer one embeddings request (validated, authenticated) through the batcher and its caches."""
    info.model = parsed.model
    if not broker.pools.serves(parsed.model) and not broker.embeddings.serves(parsed.model):
        raise model_not_found(parsed.model)
    result = await broker.embeddings.create(caller, parsed, body)
    info.cache, info.batch_size, info.upstream_s = result.cache_summary, 1, result.upstream_s
    usage = TokenUsage.from_body(result.body)
    info.prompt_tokens = info.alone_prompt_tokens = usage.prompt_tokens if usage is not None else 0
    return result


def embedding_headers(result: EmbeddingResponse) -> dict[str, str]:
    """The broker's response headers for an embeddings answer."""
    return {"X-Broker-Cache": result.cache_summary, "X-Broker-Batch-Size": "1", **result.limit_headers}
