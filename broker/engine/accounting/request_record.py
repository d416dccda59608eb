"""One request's account: what handling learns about it (`RequestInfo`), and the one place it is counted
(metrics), logged (the `request` event) and written to the usage ledger (`LedgerRecord`, built only in
`ledger_record`). HTTP and the library record through here alike.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from mergebroker.broker.engine.accounting.costs import CostBook
from mergebroker.broker.engine.accounting.ledger import Ledger, LedgerRecord, saved_tokens
from mergebroker.broker.engine.ground.logging import REQUEST_LOG, log_info_event
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.errors import BrokerError
from mergebroker.token_usage import TokenUsage

log = structlog.get_logger("mergebroker.access")


@dataclass(init=False)
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
    cached_tokens: int = 0  # of prompt_tokens: read from the provider's prompt cache, as it reported
    cache_write_tokens: int = 0  # of prompt_tokens: written to the provider's prompt cache
    usage_counted: bool = False  # the broker counted the usage: the provider reported none
    provider: str | None = None  # the upstream that answered
    alone_cached_tokens: int = 0  # broker's count: what its provider would have read from cache, sent alone
    answer_tokens: int = 0  # broker's count of its own answer's text (merged members: the alone estimate)
    costs: CostBook | None = None  # prices it, once its model is known
    # Known later (released early, or a stream): the usage the provider reported, as a `TokenUsage` or an
    # OpenAI `usage` mapping; the ledger record waits for it.
    usage_settles: asyncio.Future[TokenUsage] | None = None
    stream_error: BrokerError | None = None  # what ended a stream whose headers were already sent
    dropped: tuple[str, ...] = ()  # fields a translation to another API could not carry (X-Broker-Dropped)
    usd_actual: float | None = None  # priced when it is recorded (`costs`): what it cost, and would alone
    usd_alone: float | None = None

    def __init__(self, request_id: str, broker_request_id: str, started: float = 0.0, **known: Any) -> None:
        # One is built for every request with nearly every field at its default, and the defaults (all
        # immutable) stay class attributes: only what is given is written, not all 26 fields.
        self.request_id, self.broker_request_id, self.started = request_id, broker_request_id, started
        if known:
            unknown = known.keys() - _INFO_FIELDS
            if unknown:
                raise TypeError(f"RequestInfo has no field {sorted(unknown)[0]!r}")
            self.__dict__.update(known)


_INFO_FIELDS = frozenset(RequestInfo.__dataclass_fields__)


def new_request_id() -> str:
    """A broker-generated request ID ("req_" and 32 random hex digits): the ledger's key, never a caller's."""
    return "req_" + os.urandom(16).hex()  # what secrets.token_hex(16) returns, without its two calls


def record_request(metrics: Metrics | None, ledger: Ledger | None, info: RequestInfo, endpoint: str, status: int,
                   elapsed: float, *, sent_status: int | None = None) -> None:
    """Count one answered request (metrics, usage ledger) and log its event; HTTP and the library alike."""
    if metrics is not None:
        requests, latency = metrics.request_series(endpoint, info.tier, status)
        requests.inc()
        latency.observe(elapsed)
    if endpoint != "models" and (ledger is not None or info.costs is not None):
        _record(ledger, info, endpoint, status, elapsed)
    if not REQUEST_LOG.admit(error=status >= 400 or info.stream_error is not None):
        return
    fields = {"endpoint": endpoint, "status": sent_status or status, "tenant": info.tenant, "tier": info.tier,
              "model": info.model, "latency_ms": round(elapsed * 1000, 2),
              "upstream_ms": round(info.upstream_s * 1000, 2), "batch_size": info.batch_size,
              "batch_id": info.batch_id, "cache": info.cache,
              "stream_error": (info.stream_error.code or info.stream_error.type) if info.stream_error else None}
    if info.dropped:
        fields["dropped"] = list(info.dropped)
    log_info_event(log, "request", fields)


def _record(ledger: Ledger | None, info: RequestInfo, endpoint: str, status: int, elapsed: float, *_: Any) -> None:
    """Price the request and write its ledger record; a member released early (or a stream) waits for the
    usage the provider reports."""
    settles = info.usage_settles
    if settles is not None and not settles.done():
        settles.add_done_callback(functools.partial(_record, ledger, info, endpoint, status, elapsed))
        return
    if settles is not None and not settles.cancelled() and settles.exception() is None:
        note_usage(info, settles.result())
    dollars = info.costs.account(info, status) if info.costs is not None else (None, None)
    info.usd_actual, info.usd_alone = dollars
    if ledger is not None:
        ledger.record(ledger_record(info, endpoint, status, elapsed, dollars))


def note_usage(info: RequestInfo, usage: TokenUsage | None) -> None:
    """Take the usage an answer reports into the request's record (None: it reported none)."""
    if usage is None:
        return
    info.prompt_tokens, info.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    info.cached_tokens, info.cache_write_tokens = usage.cached_tokens, usage.cache_write_tokens
    info.usage_counted = usage.counted


_LEDGER_ENDPOINTS = ("responses", "messages", "count_tokens", "embeddings", "batch")
"""The APIs a ledger row names; the rest is chat."""


def ledger_record(info: RequestInfo, endpoint: str, status: int, elapsed: float,
                  dollars: tuple[float | None, float | None] = (None, None)) -> LedgerRecord:
    """The ledger's account of one answered request (token rules in `broker.engine.accounting.ledger`)."""
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
        endpoint=endpoint if endpoint in _LEDGER_ENDPOINTS else "chat",  # type: ignore[arg-type]
        cached_tokens=0 if reused else info.cached_tokens, cache_write_tokens=0 if reused else info.cache_write_tokens,
        usage_counted=info.usage_counted, actual_usd=dollars[0], alone_usd=dollars[1])


def record_bulk_line(metrics: Metrics | None, ledger: Ledger | None, costs: CostBook | None, *, line_id: str,
                     tenant: str, tier: str, status: int, body: Mapping[str, Any], batch_id: str | None = None,
                     batch_size: int = 1, alone_prompt_tokens: int | None = None) -> None:
    """Account one answered Batch API line like a request (`endpoint=batch`, keyed by its job and custom_id,
    so a line answered again after a restart is ledgered once), with its apportioned usage.

    `batch_id` names the upstream call that answered it and `batch_size` counts the lines that call answered,
    so the report counts the call once (0: refused before any call); `alone_prompt_tokens` is the broker's
    count of its prompt sent alone (default: its share, for a line sent alone)."""
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    info = RequestInfo(line_id, line_id, tenant=tenant, tier=tier, model=model, cache="miss", batch_size=batch_size,
                       batch_id=batch_id)
    note_usage(info, TokenUsage.from_body(dict(body)))
    info.alone_prompt_tokens = info.prompt_tokens if alone_prompt_tokens is None else alone_prompt_tokens
    if costs is not None and costs.price(model) is not None:
        info.costs = costs
    if ledger is not None or info.costs is not None:
        _record(ledger, info, "batch", status, 0.0)
