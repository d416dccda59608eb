"""The Anthropic provider calls /v1/messages with x-api-key and anthropic-version (never a Bearer token), and
turns cut or failing streams into the broker's upstream errors."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from mergebroker.errors import UpstreamBadResponse, UpstreamHTTPError, UpstreamUnsupported
from mergebroker.providers.anthropic.provider import AnthropicProvider
from mergebroker.providers.openai.compat import HttpProviderSettings
from tests.helpers.sse import event

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "stop_reason": "end_turn",
           "content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 3, "output_tokens": 1}}


START = event("message_start", message={**MESSAGE, "content": [], "stop_reason": None})
DELTA = event("content_block_delta", index=0, delta={"type": "text_delta", "text": "hi"})


@pytest.fixture
async def upstream():
    """A loopback Messages server: records requests; the stream it sends is chosen per test."""
    state: dict = {"seen": [], "stream": [START, DELTA, event("message_stop")]}

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["seen"].append((request.path, dict(request.headers), body))
        if not body.get("stream"):
            return web.json_response(MESSAGE)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in state["stream"]:
            await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield state
    await runner.cleanup()


def provider(base_url: str, **extra) -> AnthropicProvider:
    return AnthropicProvider(HttpProviderSettings(name="claude", base_url=base_url, api_key="sk-ant-secret"),
                             default_max_tokens=64, wall_clock=lambda: 1234.9, **extra)


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
async def test_calls_go_to_v1_messages_with_anthropic_headers(upstream, suffix):
    p = provider(upstream["url"] + suffix, anthropic_version="2099-01-01")
    try:
        reply = await p.chat({"model": "m", "messages": [{"role": "user", "content": "hello"}]}, timeout=5)
    finally:
        await p.close()
    path, headers, body = upstream["seen"][0]
    assert path == "/v1/messages"
    assert headers["x-api-key"] == "sk-ant-secret" and headers["anthropic-version"] == "2099-01-01"
    assert "Authorization" not in headers
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 64}
    assert reply["choices"][0]["message"]["content"] == "hi" and reply["created"] == 1234
    assert "secret" not in repr(p)


async def test_a_stream_is_relayed_as_openai_chunks(upstream):
    p = provider(upstream["url"])
    try:
        chunks = [c async for c in p.stream_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                                                 timeout=5)]
    finally:
        await p.close()
    assert upstream["seen"][0][2]["stream"] is True
    assert chunks[-1] == b"data: [DONE]\n\n"
    contents = [json.loads(c[6:])["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert contents == ["", "hi", None]


@pytest.mark.parametrize("events, error", [
    ([START, DELTA], UpstreamBadResponse),  # cut before message_stop
    ([START, DELTA, event("error", error={"type": "overloaded_error", "message": "Overloaded"})], UpstreamHTTPError),
])
async def test_a_cut_or_failing_stream_raises_after_its_chunks(upstream, events, error):
    upstream["stream"] = events
    p = provider(upstream["url"])
    received = []
    try:
        with pytest.raises(error):
            async for chunk in p.stream_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                                             timeout=5):
                received.append(chunk)
    finally:
        await p.close()
    assert len(received) == 2  # the role chunk and the text came through first


async def test_refusals_happen_before_anything_is_sent(upstream):
    p = provider(upstream["url"])
    try:
        with pytest.raises(UpstreamUnsupported):
            p.stream_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}, timeout=5)
        with pytest.raises(UpstreamUnsupported):
            await p.embeddings({"model": "m", "input": "x"}, timeout=5)
    finally:
        await p.close()
    assert upstream["seen"] == []
