"""A broker in front of an OpenAI-compatible upstream that does not stream (answers streamed requests with JSON, or
refuses `stream_options` or `stream` with a 400) serves merged calls released early, merged streams and plain
streams with no error, its breaker closed, and as many members per call as in front of a streaming upstream."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mergebroker.breaker.circuit import BreakerState
from mergebroker.providers.simulator.content import compose_reply, prompt_tokens, stream_pieces
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import answer_for

TIERS = [{"name": "standard", "priority": 50, "window_ms": 10},
         {"name": "batch", "priority": 0, "window_ms": 300, "max_batch": 8, "similarity_threshold": 0.0}]
BATCH = {"X-Broker-Tier": "batch"}
QUIRKS = ["streams", "json", "no_stream_options", "no_stream"]
EXPECTED_ASKS = {"streams": [True, True], "json": [True, False], "no_stream_options": [True, True, True],
                 "no_stream": [True, False, False]}
"""Whether each request the upstream received asked for a stream, over two rounds of one merged call each."""


class Upstream:
    """An OpenAI chat upstream answering like the simulator (merged calls block by block), with one quirk:
    `streams` (none), `json` (a streamed request is answered with a JSON body), `no_stream_options` or
    `no_stream` (a 400 naming that field)."""

    def __init__(self, quirk: str) -> None:
        self.quirk = quirk
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        refused = {"no_stream_options": "stream_options", "no_stream": "stream"}.get(self.quirk)
        if refused in body:
            return web.json_response({"error": {"message": f"Unrecognized request argument supplied: {refused}",
                                                "type": "invalid_request_error", "param": refused}}, status=400)
        reply = compose_reply(body["messages"], max_tokens=body.get("max_tokens"), config=SimulatorConfig(),
                              rng=random.Random(0))
        usage = {"prompt_tokens": prompt_tokens(body["messages"]), "completion_tokens": reply.completion_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        meta = {"id": "chatcmpl-q", "created": 1, "model": body["model"]}
        if not body.get("stream") or self.quirk == "json":
            return web.json_response({**meta, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply.content},
                 "finish_reason": reply.finish_reason}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        deltas = [{"role": "assistant", "content": ""}] + [{"content": p} for p in stream_pieces(reply.content)]
        for delta in deltas:
            await response.write(sse({**meta, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
        await response.write(sse({**meta, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(sse({**meta, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response

    def streamed_asks(self) -> list[bool]:
        return [bool(b.get("stream")) for b in self.bodies]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@pytest.fixture
async def upstream_of():
    """Factory: a running `Upstream` with the given quirk, and its base URL."""
    servers: list[TestServer] = []

    async def start(quirk: str) -> tuple[Upstream, str]:
        upstream = Upstream(quirk)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", upstream.chat)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return upstream, f"http://127.0.0.1:{server.port}/v1"

    yield start
    for server in servers:
        await server.close()


async def broker_for(start_broker, url: str):
    return await start_broker({"providers": [{"name": "up", "base_url": url}], "tiers": TIERS,
                               "merge": {"embedder": "none"}})


def questions(tag: str, count: int = 8) -> list[str]:
    return [f"{tag}: summarise chapter {i} of the manual" for i in range(count)]


async def merged_round(broker, qs: list[str]) -> list[str]:
    """Ask `qs` at once in the batch tier; check every answer; the batch sizes the callers were told."""
    replies = await asyncio.gather(*(broker.openai.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": q}], extra_headers=BATCH) for q in qs))
    for q, raw in zip(qs, replies):
        assert raw.parse().choices[0].message.content == answer_for(q)
    return [raw.headers["X-Broker-Batch-Size"] for raw in replies]


@pytest.mark.parametrize("quirk", QUIRKS)
async def test_merged_calls_released_early_keep_their_answers_and_their_batch_size(upstream_of, start_broker, quirk):
    upstream, url = await upstream_of(quirk)
    broker = await broker_for(start_broker, url)
    assert broker.broker.pools.streams_merged("sim-small")  # merged calls go out as streams (early release)
    sizes = [await merged_round(broker, questions(f"round {n}")) for n in range(2)]
    assert sizes == [["8"] * 8] * 2  # as many members per call as in front of a streaming upstream
    assert broker.broker.breakers["up"].state is BreakerState.CLOSED
    # A refusal costs one more request for the first call only; what the upstream refused is never asked again.
    assert upstream.streamed_asks() == EXPECTED_ASKS[quirk]
    assert ["stream_options" in b for b in upstream.bodies][1:] == [quirk == "streams"] * (len(upstream.bodies) - 1)


@pytest.mark.parametrize("quirk", QUIRKS[1:])
async def test_plain_and_merged_streams_still_reach_their_callers_as_sse(upstream_of, start_broker, quirk):
    upstream, url = await upstream_of(quirk)
    broker = await broker_for(start_broker, url)

    async def streamed(q: str, headers: dict[str, str]) -> tuple[str, list[Any]]:
        chunks = [c async for c in await broker.openai.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": q}], stream=True,
            stream_options={"include_usage": True}, extra_headers=headers)]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    text, chunks = await streamed("A plain streamed question", {})
    assert text == answer_for("A plain streamed question")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    if quirk != "no_stream_options":  # an upstream refusing stream_options cannot be asked for its usage
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    qs = questions("streamed", 4)
    results = await asyncio.gather(*(streamed(q, BATCH) for q in qs))  # merged streams (batch tier)
    assert [text for text, _ in results] == [answer_for(q) for q in qs]
    assert len(upstream.bodies) <= 4  # 1 plain stream + 1 merged call, each at most asked twice
    assert broker.broker.breakers["up"].state is BreakerState.CLOSED
