"""The HTTP provider talks to a real loopback upstream, maps every failure onto our errors and reuses connections."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from mergebroker.errors import UpstreamBadResponse, UpstreamConnectionError, UpstreamHTTPError, UpstreamTimeout
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider, read_timeout_for
from tests.conftest import free_port

API_KEY = "sk-test-secret-123"
CHAT_OK = {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                         "content": "hi"}}]}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Upstream:
    """A loopback OpenAI-ish app: routes given per test; remembers requests and the connections they came on."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.transports: list[object] = []  # kept alive so identity comparisons stay valid
        self.app = web.Application(middlewares=[self._record])

    @web.middleware
    async def _record(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, dict(request.headers), body))
        if request.transport not in self.transports:
            self.transports.append(request.transport)
        return await handler(request)

    def route(self, method: str, path: str, handler: Handler) -> None:
        self.app.router.add_route(method, "/v1" + path, handler)


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[[Upstream], Awaitable[OpenAICompatProvider]]]:
    """Start an `Upstream` on 127.0.0.1 port 0 and return a provider pointed at it."""
    servers: list[TestServer] = []
    providers: list[OpenAICompatProvider] = []

    async def start(up: Upstream) -> OpenAICompatProvider:
        server = TestServer(up.app, host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        provider = OpenAICompatProvider(HttpProviderSettings(
            name="up1", base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY,
            extra_headers=(("X-Tenant", "acme"),)))
        providers.append(provider)
        return provider

    yield start
    for provider in providers:
        await provider.close()
    for server in servers:
        await server.close()


def reply(status: int = 200, payload: Any = CHAT_OK, headers: dict[str, str] | None = None) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(payload, status=status, headers=headers)
    return handler


def envelope(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


async def test_chat_round_trip_sends_bearer_key_and_extra_headers(upstream) -> None:
    up = Upstream()
    up.route("POST", "/chat/completions", reply())
    provider = await upstream(up)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert await provider.chat(body, timeout=5) == CHAT_OK
    path, headers, sent = up.requests[0]
    assert path == "/v1/chat/completions" and sent == body
    assert headers["Authorization"] == f"Bearer {API_KEY}"
    assert headers["X-Tenant"] == "acme"


async def test_embeddings_and_models_round_trip(upstream) -> None:
    up = Upstream()
    up.route("POST", "/embeddings", reply(payload={"data": [{"index": 0, "embedding": [0.1, 0.2]}]}))
    up.route("GET", "/models", reply(payload={"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}))
    provider = await upstream(up)
    result = await provider.embeddings({"model": "e", "input": ["x"]}, timeout=5)
    assert result["data"][0]["embedding"] == [0.1, 0.2]
    assert await provider.list_models(timeout=5) == ["m1", "m2"]


async def test_429_envelope_becomes_http_error_with_message_and_retry_after_seconds(upstream) -> None:
    up = Upstream()
    up.route("POST", "/chat/completions", reply(429, envelope("slow down", "rate_limit_error", "rate_limit_exceeded"),
                                                {"Retry-After": "3"}))
    provider = await upstream(up)
    with pytest.raises(UpstreamHTTPError) as info:
        await provider.chat({"model": "m"}, timeout=5)
    err = info.value
    assert (err.upstream_status, err.message, err.retry_after) == (429, "slow down", 3.0)
    assert err.retryable and err.upstream_body["error"]["code"] == "rate_limit_exceeded"


async def test_503_retry_after_http_date_is_converted_to_seconds(upstream) -> None:
    up = Upstream()
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    up.route("POST", "/chat/completions", reply(503, {"detail": "down"}, {"Retry-After": when}))
    provider = await upstream(up)
    with pytest.raises(UpstreamHTTPError) as info:
        await provider.chat({"model": "m"}, timeout=5)
    assert info.value.upstream_status == 503 and info.value.retryable
    assert info.value.message == "upstream answered HTTP 503"
    assert 110 <= info.value.retry_after <= 121


async def test_400_is_caller_fault_and_not_retryable(upstream) -> None:
    up = Upstream()
    up.route("POST", "/chat/completions", reply(400, envelope("bad messages", "invalid_request_error")))
    provider = await upstream(up)
    with pytest.raises(UpstreamHTTPError) as info:
        await provider.chat({"model": "m"}, timeout=5)
    assert info.value.caller_fault and not info.value.retryable
    assert info.value.status == 400 and info.value.message == "bad messages"


async def test_connection_refused_raises_upstream_connection_error() -> None:
    provider = OpenAICompatProvider(HttpProviderSettings(name="gone", base_url=f"http://127.0.0.1:{free_port()}/v1"))
    try:
        with pytest.raises(UpstreamConnectionError):
            await provider.chat({"model": "m"}, timeout=5)
    finally:
        await provider.close()


async def test_upstream_dropping_the_connection_raises_upstream_connection_error(upstream) -> None:
    up = Upstream()

    async def drop(request: web.Request) -> web.Response:
        request.transport.close()
        return web.Response()
    up.route("POST", "/chat/completions", drop)
    provider = await upstream(up)
    with pytest.raises(UpstreamConnectionError):
        await provider.chat({"model": "m"}, timeout=5)


async def test_slow_upstream_raises_timeout_within_the_budget(upstream) -> None:
    up = Upstream()
    never = asyncio.Event()

    async def stall(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response(CHAT_OK)
    up.route("POST", "/chat/completions", stall)
    provider = await upstream(up)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        await provider.chat({"model": "m"}, timeout=0.3)
    assert time.monotonic() - started < 2.0
    never.set()


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"id": "no choices"}'])
async def test_unusable_2xx_body_raises_bad_response(upstream, raw: bytes) -> None:
    up = Upstream()

    async def broken(request: web.Request) -> web.Response:
        return web.Response(body=raw, content_type="application/json")
    up.route("POST", "/chat/completions", broken)
    provider = await upstream(up)
    with pytest.raises(UpstreamBadResponse):
        await provider.chat({"model": "m"}, timeout=5)


async def test_stream_relays_each_event_before_the_next_is_sent(upstream) -> None:
    up = Upstream()
    release_second = asyncio.Event()
    sent: list[int] = []

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        sent.append(1)
        await release_second.wait()
        await resp.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
        sent.append(2)
        return resp
    up.route("POST", "/chat/completions", sse)
    provider = await upstream(up)

    events = provider.stream_chat({"model": "m", "messages": []}, timeout=5)
    first = await asyncio.wait_for(anext(events), 5)  # a buffering relay would never yield here
    assert first == b'data: {"n": 1}\n\n' and sent == [1]
    release_second.set()
    rest = [event async for event in events]
    assert rest == [b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
    assert up.requests[0][2]["stream"] is True


async def test_stream_reassembles_events_split_across_chunks(upstream) -> None:
    up = Upstream()

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in (b"data: {\"a\"", b": 1}\r\n", b"\r\ndata: [DO", b"NE]\n"):
            await resp.write(piece)
        return resp
    up.route("POST", "/chat/completions", sse)
    provider = await upstream(up)
    events = [e async for e in provider.stream_chat({"model": "m"}, timeout=5)]
    assert events == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    assert json.loads(events[0][len(b"data: "):]) == {"a": 1}


async def test_stream_error_status_raises_before_the_first_event(upstream) -> None:
    up = Upstream()
    up.route("POST", "/chat/completions", reply(503, envelope("overloaded", "server_error"), {"Retry-After": "2"}))
    provider = await upstream(up)
    with pytest.raises(UpstreamHTTPError) as info:
        await anext(provider.stream_chat({"model": "m"}, timeout=5))
    assert info.value.upstream_status == 503 and info.value.retry_after == 2.0


async def test_stream_stalled_between_chunks_raises_timeout(upstream) -> None:
    up = Upstream()
    never = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await never.wait()
        return resp
    up.route("POST", "/chat/completions", sse)
    provider = await upstream(up)
    events = provider.stream_chat({"model": "m"}, timeout=0.3)
    assert await anext(events) == b"data: 1\n\n"
    with pytest.raises(UpstreamTimeout):
        await anext(events)
    never.set()


async def test_sequential_calls_reuse_one_keep_alive_connection(upstream) -> None:
    up = Upstream()
    up.route("POST", "/chat/completions", reply())
    provider = await upstream(up)
    for _ in range(20):
        await provider.chat({"model": "m"}, timeout=5)
    assert len(up.requests) == 20
    assert len(up.transports) == 1


async def test_warm_up_opens_connections_that_later_calls_reuse(upstream) -> None:
    up = Upstream()
    up.route("GET", "/models", reply(payload={"data": [{"id": "m"}]}))
    up.route("POST", "/chat/completions", reply())
    provider = await upstream(up)
    await provider.warm_up(4)
    assert len(up.transports) == 4
    await asyncio.gather(*(provider.chat({"model": "m"}, timeout=5) for _ in range(4)))
    assert len(up.transports) == 4


async def test_failing_warm_up_logs_and_does_not_raise() -> None:
    provider = OpenAICompatProvider(HttpProviderSettings(name="gone", base_url=f"http://127.0.0.1:{free_port()}/v1",
                                                         api_key=API_KEY))
    try:
        with capture_logs() as logs:
            await provider.warm_up(3)
    finally:
        await provider.close()
    failed = [e for e in logs if e["event"] == "provider_warmup_failed"]
    assert failed and failed[0]["provider"] == "gone" and failed[0]["failed"] == 3
    assert API_KEY not in repr(logs)


def test_api_key_never_appears_in_repr() -> None:
    settings = HttpProviderSettings(name="up1", base_url="http://127.0.0.1:1/v1", api_key=API_KEY,
                                    extra_headers=(("api-key", API_KEY),))
    assert API_KEY not in repr(settings)
    assert API_KEY not in repr(OpenAICompatProvider(settings))


def test_read_timeout_scales_with_max_tokens() -> None:
    assert read_timeout_for(500, token_rate=50.0) == pytest.approx(15.0)
    assert read_timeout_for(None, token_rate=100.0, base_s=2.0, default_tokens=1000) == pytest.approx(12.0)
    assert read_timeout_for(100) == pytest.approx(7.0)
