"""The shutdown drain with streams open, over real loopback servers: streams in flight finish while the broker
drains (readiness 503 with the reason, new requests refused in their API's envelope), the drain ends as soon
as they have, and a stream still open at the deadline ends with its API's error event and a clean end."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mergebroker.broker.http.drain import DRAIN, Drain
from mergebroker.providers.simulator.server import start_simulator
from tests.conftest import provider_for

TIERS = [{"name": "standard", "priority": 50, "window_ms": 0, "max_batch": 1}]
STREAMS = 20
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


class Gate:
    """The simulated upstream's latency: every pause waits until the test opens the gate."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def sleep(self, _seconds: float) -> None:
        await self.open.wait()


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Any, Gate]]:
    """A simulator whose streams send their first chunk at once, then wait for the gate before the text."""
    gate = Gate()
    sim = await start_simulator(sleep=gate.sleep)
    sim.set_faults(latency_per_token_ms=1.0)  # a pause before every piece of text: each waits on the gate
    try:
        yield sim, gate
    finally:
        gate.open.set()
        await sim.close()


async def _broker(start_broker, sim, **server: Any) -> Any:
    return await start_broker({"providers": [provider_for(sim)], "tiers": TIERS, "merge": {"embedder": "none"},
                               "server": {"drain_timeout_s": 30, **server}})


def _drain(broker) -> Drain:
    return broker.runner.app[DRAIN]


def _body(api: str, text: str, *, stream: bool = True) -> dict[str, Any]:
    if api == "responses":
        return {"model": "sim-small", "input": text, "stream": stream}
    body = {"model": "sim-small", "stream": stream, "messages": [{"role": "user", "content": text}]}
    return {**body, "max_tokens": 64} if api == "messages" else body


class OpenStream:
    """One streamed request: `started` is set on its first frame; `done` resolves to the whole body read."""

    def __init__(self, session: aiohttp.ClientSession, api: str, text: str) -> None:
        self.api = api
        self.started = asyncio.Event()
        self.done: asyncio.Task[str] = asyncio.ensure_future(self._read(session, text))

    async def _read(self, session: aiohttp.ClientSession, text: str) -> str:
        async with session.post(PATHS[self.api], json=_body(self.api, text)) as resp:
            assert resp.status == 200, await resp.text()
            first = await resp.content.readline()
            self.started.set()
            return (first + await resp.read()).decode()  # a cut stream raises ClientPayloadError here


async def _open(broker, apis: list[str]) -> list[OpenStream]:
    streams = [OpenStream(broker.http, api, f"question number {i} about {api}") for i, api in enumerate(apis)]
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 10)
    return streams


async def _readyz(broker) -> tuple[int, dict[str, Any]]:
    async with broker.http.get("/readyz") as resp:
        return resp.status, await resp.json()


def _data(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


async def test_streams_in_flight_finish_while_the_broker_drains_and_the_drain_ends_when_they_have(
        gated, start_broker):
    sim, gate = gated
    broker = await _broker(start_broker, sim)
    streams = await _open(broker, ["chat"] * STREAMS)
    drain = _drain(broker)
    drain.begin("SIGTERM received")

    status, ready = await _readyz(broker)
    assert status == 503 and ready["ready"] is False
    assert ready["reason"] == f"draining: SIGTERM received, {STREAMS} requests in flight"
    async with broker.http.post(PATHS["chat"], json=_body("chat", "a new one", stream=False)) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"
        assert resp.headers["Retry-After"] == "1" and resp.headers["Connection"] == "close"
    async with broker.http.post(PATHS["messages"], json=_body("messages", "a new one")) as resp:
        body = await resp.json()
        assert resp.status == 529 and body == {"type": "error", "error": {"type": "overloaded_error",
                                                                         "message": drain.refusal().message}}
    assert not any(s.done.done() for s in streams)

    gate.open.set()
    result = await asyncio.wait_for(drain.wait(), 10)  # not the 30 s timeout: it ends when the last one does
    assert result.drained and result.in_flight == 0
    for stream in streams:
        text = await stream.done
        assert _data(text)[-1] == "[DONE]" and "error" not in text
    assert not drain.expired


async def test_a_stream_open_at_the_deadline_ends_with_its_apis_error_event_and_a_clean_end(gated, start_broker):
    sim, _gate = gated  # never opened: nothing finishes before the deadline
    broker = await _broker(start_broker, sim)
    streams = await _open(broker, ["chat", "messages", "responses"])
    plain = asyncio.ensure_future(broker.chat("a call that never gets its answer"))
    await asyncio.wait_for(_until_in_flight(_drain(broker), 4), 10)
    drain = _drain(broker)
    drain.begin("SIGTERM received")
    drain.expire()  # the deadline

    chat, messages, responses = [await asyncio.wait_for(s.done, 10) for s in streams]  # no ClientPayloadError
    last = json.loads(_data(chat)[-1])
    assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "service_unavailable"
    assert messages.rstrip().splitlines()[-2] == "event: error"
    assert json.loads(_data(messages)[-1]) == {"type": "error", "error": {"type": "overloaded_error",
                                                                         "message": drain.refusal().message}}
    failed = json.loads(_data(responses)[-1])
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    status, body, _ = await asyncio.wait_for(plain, 10)
    assert status == 503 and body["error"]["code"] == "shutting_down"
    result = await drain.wait()
    assert not result.drained


async def _until_in_flight(drain: Drain, count: int) -> None:
    # The handlers register on the broker's own loop, which is this one: yielding lets them run.
    while drain.in_flight < count:
        await asyncio.sleep(0)


async def test_the_drain_deadline_cuts_what_is_left_on_its_own(gated, start_broker):
    sim, _gate = gated
    broker = await _broker(start_broker, sim, drain_timeout_s=0.2)
    [stream] = await _open(broker, ["chat"])
    drain = _drain(broker)
    drain.begin("test")
    result = await asyncio.wait_for(drain.wait(), 10)
    assert not result.drained and drain.expired
    assert json.loads(_data(await asyncio.wait_for(stream.done, 10))[-1])["error"]["code"] == "shutting_down"


async def test_post_drain_from_loopback_answers_once_nothing_is_in_flight(gated, start_broker):
    sim, gate = gated
    broker = await _broker(start_broker, sim)
    streams = await _open(broker, ["chat", "chat"])
    async with broker.http.post("/v1/broker/drain", params={"timeout_s": "0"}) as resp:
        assert resp.status == 200 and await resp.json() == {"drained": False, "in_flight": 2}
    waiting = asyncio.ensure_future(broker.http.post("/v1/broker/drain"))
    status, ready = await _readyz(broker)
    assert status == 503 and ready["reason"] == "draining: POST /v1/broker/drain, 2 requests in flight"
    assert not waiting.done()
    gate.open.set()
    async with await asyncio.wait_for(waiting, 10) as resp:
        assert resp.status == 200 and await resp.json() == {"drained": True, "in_flight": 0}
    for stream in streams:
        assert _data(await stream.done)[-1] == "[DONE]"


async def test_post_drain_through_a_proxy_needs_the_metrics_token(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
                                 "server": {"metrics_token_env": "MB_TOKEN"}}, environ={"MB_TOKEN": "t0ken"})
    proxied = {"X-Forwarded-For": "203.0.113.9"}
    async with broker.http.post("/v1/broker/drain", headers=proxied) as resp:
        body = await resp.json()
        assert resp.status == 403 and body["error"]["code"] == "drain_not_allowed"
    assert not _drain(broker).draining
    async with broker.http.post("/v1/broker/drain", headers={**proxied, "Authorization": "Bearer t0ken"}) as resp:
        assert resp.status == 200 and await resp.json() == {"drained": True, "in_flight": 0}


def _own_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one that is not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


async def test_post_drain_from_a_peer_that_is_not_loopback_is_refused(simulator, start_broker):
    address = _own_address()
    if address is None:
        pytest.skip("no address other than loopback to call from")
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"}})
    site = web.TCPSite(broker.runner, address, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{address}:{port}/v1/broker/drain") as resp:
            body = await resp.json()
    assert resp.status == 403 and body["error"]["type"] == "permission_error"
    assert not _drain(broker).draining
