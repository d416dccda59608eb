"""An OpenAI-compatible upstream that does not stream still serves streamed calls: a JSON answer is replayed as
chunks, a 400 refusing `stream_options` or `stream` is answered by asking without them, and the provider
remembers what the upstream refused so that it stops asking."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mergebroker.breaker.circuit import BreakerSettings, BreakerState, CircuitBreaker
from mergebroker.clock import FakeClock
from mergebroker.errors import UpstreamHTTPError
from mergebroker.providers.openai.compat import HttpProviderSettings, OpenAICompatProvider
from mergebroker.providers.pool import ProviderPools
from mergebroker.providers.retry import RetryPolicy
from mergebroker.providers.sse import chat_event
from mergebroker.providers.upstream import Upstream
from mergebroker.providers.whole_reply import DONE, ProviderStream, StreamSupport, replay_chunks, streaming_refusal

REPLY = {"id": "c1", "object": "chat.completion", "created": 7, "model": "m", "system_fingerprint": "fp",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there", "refusal": None},
                      "logprobs": None, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
TOOL_REPLY = {**REPLY, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
    "role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}}]}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}


def decoded(chunks: list[bytes]) -> list[dict[str, Any]]:
    assert chunks[-1] == DONE
    return [json.loads(c[len(b"data: "):]) for c in chunks[:-1]]


def test_a_whole_reply_replays_as_the_chunks_an_openai_upstream_streams():
    chunks = decoded(replay_chunks(REPLY, include_usage=True))
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "c1" and c["model"] == "m"
               and c["system_fingerprint"] == "fp" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hello there"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == REPLY["usage"]
    assert "".join(chat_event(c).text for c in replay_chunks(REPLY, include_usage=False)) == "Hello there"
    assert all("usage" not in c for c in decoded(replay_chunks(REPLY, include_usage=False)))


def test_tool_calls_replay_whole_with_their_index_id_and_name():
    chunks = decoded(replay_chunks(TOOL_REPLY, include_usage=False))
    calls = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert [(c["index"], c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "call_1", "weather", '{"city":"Oslo"}'), (1, "call_2", "time", "{}")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def refusal(status: int, body: Any, message: str = "bad request") -> UpstreamHTTPError:
    return UpstreamHTTPError(status, message, body=body)


@pytest.mark.parametrize("error, sent, support", [
    (refusal(400, {"error": {"message": "Unrecognized request argument supplied: stream_options",
                             "param": None}}), {"stream_options": {}}, StreamSupport.WITHOUT_OPTIONS),
    (refusal(422, {"detail": [{"loc": ["body", "stream_options"], "msg": "extra fields not permitted"}]}),
     {"stream_options": {}}, StreamSupport.WITHOUT_OPTIONS),
    (refusal(400, {"error": {"message": "Streaming is not supported", "param": "stream"}}), {}, StreamSupport.NONE),
    (refusal(400, {"error": {"message": "'stream_options' needs 'stream'"}}), {}, StreamSupport.NONE),
    (refusal(400, {"error": {"message": "messages: too many", "param": "messages"}}), {"stream_options": {}}, None),
    (refusal(400, {"error": {"message": "the upstream model is busy"}}), {}, None),
    (refusal(503, {"error": {"message": "stream overloaded"}}), {}, None),
])
def test_a_refusal_says_what_the_upstream_streams(error, sent, support):
    assert streaming_refusal(error, sent) is support


class Quirky:
    """A loopback OpenAI upstream that answers streamed requests whole, or refuses a streaming field with a 400."""

    def __init__(self, quirk: str) -> None:
        self.quirk = quirk
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        refused = {"no_stream_options": "stream_options", "no_stream": "stream"}.get(self.quirk)
        if refused and refused in body:
            return web.json_response({"error": {"message": f"Unknown field: {refused}", "type": "invalid_request_error",
                                                "param": refused, "code": None}}, status=400)
        if self.quirk == "unrelated_400":
            return web.json_response({"error": {"message": "bad messages", "param": "messages"}}, status=400)
        if not body.get("stream") or self.quirk == "json":
            return web.json_response(REPLY)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"streamed"},"finish_reason":"stop"}]}'
                             b"\n\ndata: [DONE]\n\n")
        return response


@pytest.fixture
async def quirky():
    """Factory: a provider pointed at a `Quirky` upstream with the given quirk."""
    started: list[tuple[TestServer, OpenAICompatProvider]] = []

    async def start(quirk: str) -> tuple[Quirky, OpenAICompatProvider]:
        upstream = Quirky(quirk)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", upstream.chat)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        provider = OpenAICompatProvider(HttpProviderSettings(name="q", base_url=f"http://127.0.0.1:{server.port}/v1"))
        started.append((server, provider))
        return upstream, provider

    yield start
    for server, provider in started:
        await provider.close()
        await server.close()


async def read(provider: OpenAICompatProvider) -> tuple[str, list[bytes], Any]:
    stream = provider.stream_chat(BODY, timeout=5)
    chunks = [c async for c in stream]
    return "".join(chat_event(c).text for c in chunks), chunks, stream.whole_reply


async def test_a_json_answer_to_a_stream_is_replayed_and_later_calls_ask_plainly(quirky):
    upstream, provider = await quirky("json")
    text, chunks, whole = await read(provider)
    assert text == "Hello there" and chunks[-1] == DONE and whole == REPLY
    assert chat_event(chunks[-2]).usage == REPLY["usage"]  # the caller asked for usage: it gets it
    assert upstream.bodies[0]["stream"] is True
    assert (await read(provider))[0] == "Hello there"
    assert "stream" not in upstream.bodies[1] and "stream_options" not in upstream.bodies[1]


async def test_a_refused_stream_options_is_dropped_for_this_call_and_the_next(quirky):
    upstream, provider = await quirky("no_stream_options")
    text, _, whole = await read(provider)
    assert text == "streamed" and whole is None
    assert [("stream_options" in b, b.get("stream")) for b in upstream.bodies] == [(True, True), (False, True)]
    await read(provider)
    assert len(upstream.bodies) == 3 and "stream_options" not in upstream.bodies[2]


async def test_a_refused_stream_is_answered_by_a_plain_call_and_remembered(quirky):
    upstream, provider = await quirky("no_stream")
    text, chunks, whole = await read(provider)
    assert text == "Hello there" and whole == REPLY and chunks[-1] == DONE
    assert [b.get("stream") for b in upstream.bodies] == [True, None]
    await read(provider)
    assert len(upstream.bodies) == 3 and "stream" not in upstream.bodies[2]


async def test_an_unrelated_400_is_the_callers_and_teaches_nothing(quirky):
    upstream, provider = await quirky("unrelated_400")
    for _ in range(2):
        with pytest.raises(UpstreamHTTPError) as info:
            await read(provider)
        assert info.value.status == 400 and info.value.caller_fault
    assert [b.get("stream") for b in upstream.bodies] == [True, True]


class SlowFirstChunk:
    """A Provider whose stream's first chunk comes `wait_s` after the call (on the fake clock): a stream that
    took that long to start, or, `whole`, one replaying a reply of 500 output tokens generated meanwhile."""

    def __init__(self, clock: FakeClock, wait_s: float, *, whole: bool) -> None:
        self.name = "slow"
        self._clock, self._wait_s, self._whole = clock, wait_s, whole

    def stream_chat(self, body: dict[str, Any], *, timeout: float) -> ProviderStream:
        async def events(stream: ProviderStream):
            self._clock.advance(self._wait_s)
            if self._whole:
                stream.whole_reply = {**REPLY, "usage": {"prompt_tokens": 5, "completion_tokens": 500,
                                                         "total_tokens": 505}}
            for chunk in replay_chunks(REPLY, include_usage=False):
                yield chunk
        return ProviderStream(events)


@pytest.mark.parametrize("whole, opens", [(True, False), (False, True)])
async def test_a_whole_reply_waiting_for_its_generation_is_not_slow_for_the_breaker(fake_clock, whole, opens):
    breaker = CircuitBreaker("slow", BreakerSettings(min_calls=2, slow_call_s=2.0, slow_ratio=0.3), clock=fake_clock)
    # 500 output tokens at 50 tokens/s take 10 s to generate; a stream that waits 8 s to start is slow.
    upstream = Upstream(SlowFirstChunk(fake_clock, 8.0, whole=whole), breaker=breaker, token_rate=50.0)
    pools = ProviderPools([upstream], retry=RetryPolicy(attempts=1), clock=fake_clock, sleep=fake_clock.skip)
    for _ in range(2):  # the breaker's minimum of calls
        chunks, _ = await pools.stream_chat("m", BODY, deadline=fake_clock() + 60)
        assert "".join([chat_event(c).text async for c in chunks]) == "Hello there"
    assert (breaker.state is BreakerState.OPEN) is opens
