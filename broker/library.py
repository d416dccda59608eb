"""Use the broker in-process: the engine behind the HTTP API, with no HTTP server.

    async with Broker.from_settings({"tiers": [...]}) as broker:
        completion = await broker.chat({"model": "sim-small", "messages": [...]})
        vectors = await broker.embed(["a text", "another"], model="all-MiniLM-L6-v2")
        print(broker.stats())

Every call takes the path an HTTP request takes (`engine.handling`): validation, admission (tier and key
limits), the chat cache and coalescing, the tier's merge window and queue, merging and splitting, the
embedding caches and window batching; it is counted in the same metrics and usage ledger. Callers in one
process share one engine, so concurrent callers of one text share one computation.

Named `Broker` for its users; the running engine inside it is `mergebroker.broker.engine.container.Broker`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergebroker.broker.cluster.queue_choice import front_end_queue
from mergebroker.broker.engine import handling
from mergebroker.broker.engine.accounting.request_record import RequestInfo, new_request_id, record_request
from mergebroker.broker.engine.chat.service import CacheControl
from mergebroker.broker.engine.container import Engine
from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.schemas import BrokerOptions, parse_chat, parse_embeddings
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.engine.inbound import messages as inbound_messages
from mergebroker.broker.engine.inbound import responses as inbound_responses
from mergebroker.broker.engine.limits.admission import Caller
from mergebroker.broker.engine.streams import chat_chunk
from mergebroker.broker.engine.wiring.assemble import assemble, stop_engine
from mergebroker.clock import Clock, Sleep, monotonic
from mergebroker.errors import BrokerError, Forbidden, InvalidRequest

CallerLike = Caller | Mapping[str, str] | None
"""Who calls: a `Caller` (trusted as it is, its tier checked), request headers (authenticated as over HTTP:
`Authorization: Bearer <key>`, `X-Broker-Tier`, ...), or None (no credentials: the default tenant in open
mode, 401 in keys mode)."""


@dataclass(frozen=True)
class Reply:
    """An answer's body and the headers the HTTP API would send with it (`X-Broker-Batch-Size`, ...)."""

    body: dict[str, Any]
    headers: dict[str, str]


class Broker:
    """An in-process broker; start and stop it with `async with` (see the module doc)."""

    def __init__(self, settings: Settings, *, clock: Clock = monotonic, sleep: Sleep = asyncio.sleep) -> None:
        self.settings = settings
        self._clock, self._sleep = clock, sleep
        self._engine: Engine | None = None

    @classmethod
    def from_settings(cls, settings: Settings | Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                      environ: dict[str, str] | None = None, clock: Clock = monotonic,
                      sleep: Sleep = asyncio.sleep) -> Broker:
        """A broker for `settings`: a `Settings`, a mapping shaped like the YAML config, or a config file path.

        A mapping or path is loaded like `mergebroker serve` loads its config (`MERGEBROKER_*` variables
        apply, a mapping wins over them); secrets come from `environ` (default: the process environment).
        With no providers configured, answers come from the built-in simulated upstream.
        """
        if not isinstance(settings, Settings):
            if isinstance(settings, Mapping):
                settings = load_settings(None, environ=environ, overrides=dict(settings))
            else:
                settings = load_settings(settings, environ=environ)
        return cls(settings, clock=clock, sleep=sleep)

    async def __aenter__(self) -> Broker:
        if self._engine is not None:
            raise RuntimeError("this Broker is already running")
        self._engine = await assemble(self.settings, queue=front_end_queue(self.settings), clock=self._clock,
                                      sleep=self._sleep)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await stop_engine(engine)

    @property
    def engine(self) -> Engine:
        """The running engine (queues, pools, caches, metrics); only inside `async with`."""
        if self._engine is None:
            raise RuntimeError("the Broker is not running: use it inside `async with Broker.from_settings(...)`")
        return self._engine

    async def chat(self, body: Mapping[str, Any], *, caller: CallerLike = None,
                   cache_control: CacheControl | None = None) -> dict[str, Any]:
        """The `chat.completion` the HTTP API would answer for `body`; raises the `BrokerError` it would send."""
        return (await self.chat_reply(body, caller=caller, cache_control=cache_control)).body

    async def embed(self, texts: str | Sequence[str], *, model: str, dimensions: int | None = None,
                    caller: CallerLike = None) -> list[list[float]]:
        """One vector per text, in order, through the embedding caches, coalescing and window batching."""
        body: dict[str, Any] = {"model": model, "input": texts if isinstance(texts, str) else list(texts)}
        if dimensions is not None:
            body["dimensions"] = dimensions
        reply = await self.embeddings_reply(body, caller=caller)
        return [item["embedding"] for item in reply.body["data"]]

    async def chat_reply(self, body: Mapping[str, Any], *, caller: CallerLike = None,
                         cache_control: CacheControl | None = None) -> Reply:
        """`chat`, with the broker's response headers (batch size and id, cache, fallback, limits)."""
        async def answer(engine: Engine, info: RequestInfo) -> Reply:
            parsed, forward = parse_chat(dict(body), max_messages=engine.settings.server.max_messages)
            if parsed.stream:
                raise InvalidRequest("A streaming request goes through `chat_stream`; leave 'stream' unset here.",
                                     param="stream")
            who = self._caller(engine, info, caller, parsed.broker, parsed.user)
            handling.check_chat_model(engine, info, parsed, forward)
            result = await handling.complete_chat(engine, info, who, parsed, forward,
                                                  cache_control or CacheControl())
            return Reply(result.outcome.body, handling.chat_headers(result))

        return await self._handle("chat", answer)

    async def chat_stream(self, body: Mapping[str, Any], *, caller: CallerLike = None
                          ) -> AsyncIterator[dict[str, Any]]:
        """The `chat.completion.chunk`s the HTTP API would stream for `body`, as they come (the same
        handling: limits, merged streams in tiers with `merge_streams`, usage settled when it ends).
        An error before the first chunk is raised; one mid-stream is raised where the stream breaks."""
        engine = self.engine
        info = _new_info()
        parsed, forward = parse_chat({**body, "stream": True}, max_messages=engine.settings.server.max_messages)
        try:
            who = self._caller(engine, info, caller, parsed.broker, parsed.user)
            handling.check_chat_model(engine, info, parsed, forward)
            stream = await handling.open_chat_stream(engine, info, who, parsed, forward)
        except BrokerError as exc:
            record_request(engine.metrics, engine.ledger, info, "chat", exc.status, time.perf_counter() - info.started)
            raise
        try:
            async for frame in stream:
                if info.stream_error is not None:
                    raise info.stream_error
                chunk = chat_chunk(frame)
                if chunk is not None:
                    yield chunk
        finally:
            await stream.aclose()
            status = info.stream_error.status if info.stream_error is not None else 200
            record_request(engine.metrics, engine.ledger, info, "chat", status, time.perf_counter() - info.started)

    async def responses(self, body: Mapping[str, Any], *, caller: CallerLike = None) -> dict[str, Any]:
        """The Response the HTTP API's `POST /v1/responses` would answer for a non-streaming `body`."""
        async def answer(engine: Engine, info: RequestInfo) -> Reply:
            who = self._caller(engine, info, caller, None, None)
            result = await inbound_responses.create(engine, info, who, _unstreamed(body), {}, CacheControl())
            return Reply(result.body, result.headers)  # type: ignore[union-attr]

        return (await self._handle("responses", answer)).body

    async def messages(self, body: Mapping[str, Any], *, caller: CallerLike = None) -> dict[str, Any]:
        """The Message the HTTP API's `POST /v1/messages` would answer for a non-streaming `body`."""
        async def answer(engine: Engine, info: RequestInfo) -> Reply:
            who = self._caller(engine, info, caller, None, None)
            result = await inbound_messages.create(engine, info, who, _unstreamed(body), {}, CacheControl())
            return Reply(result.body, result.headers)  # type: ignore[union-attr]

        return (await self._handle("messages", answer)).body

    async def embeddings_reply(self, body: Mapping[str, Any], *, caller: CallerLike = None) -> Reply:
        """The `/v1/embeddings` answer for an OpenAI embeddings `body`, with the broker's headers."""
        async def answer(engine: Engine, info: RequestInfo) -> Reply:
            parsed, forward = parse_embeddings(dict(body))
            who = self._caller(engine, info, caller, parsed.broker, parsed.user)
            result = await handling.create_embeddings(engine, info, who, parsed, forward)
            return Reply(result.body, handling.embedding_headers(result))

        return await self._handle("embeddings", answer)

    def stats(self) -> dict[str, Any]:
        """What `/v1/broker/stats` shows: per tier the queue depth, merge rate and mean batch size; the chat
        cache's hit rate and coalesced ratio; the embedding coalescer's cache-hit rate, coalesced ratio,
        mean batch size and pending-window count; each provider's breaker."""
        return self.engine.stats()

    async def _handle(self, endpoint: str, answer: Callable[[Engine, RequestInfo], Awaitable[Reply]]) -> Reply:
        engine = self.engine
        info = _new_info()
        request_id = info.request_id
        try:
            reply = await answer(engine, info)
        except BrokerError as exc:
            record_request(engine.metrics, engine.ledger, info, endpoint, exc.status, time.perf_counter() - info.started)
            raise
        record_request(engine.metrics, engine.ledger, info, endpoint, 200, time.perf_counter() - info.started)
        return Reply(reply.body, {**reply.headers, "X-Request-ID": request_id})

    @staticmethod
    def _caller(engine: Engine, info: RequestInfo, caller: CallerLike, options: BrokerOptions | None,
                user: str | None) -> Caller:
        if not isinstance(caller, Caller):
            return handling.authenticate(engine, info, caller or {}, options, user)
        if not any(t.name == caller.tier for t in engine.settings.tiers):
            raise Forbidden(f"Unknown tier '{caller.tier}'.", param="tier", code="unknown_tier")
        info.tenant, info.tier = caller.tenant, caller.tier
        return caller


def _new_info() -> RequestInfo:
    request_id = new_request_id()
    return RequestInfo(request_id, request_id, time.perf_counter())


def _unstreamed(body: Mapping[str, Any]) -> dict[str, Any]:
    """`body` for a non-streaming call; streaming ones are refused (as `chat` refuses them)."""
    if body.get("stream"):
        raise InvalidRequest("Leave 'stream' unset here: the library answers Responses and Messages whole.",
                             param="stream")
    return dict(body)
