"""The Anthropic Messages API through the broker, as the official anthropic SDK uses it: native to an Anthropic
upstream (the simulator's Anthropic mode checks every body against the SDK's types), translated to chat for an
OpenAI-compatible one, merged like chat when plain text; errors in Anthropic's envelope."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import struct
import zlib
from typing import Any

import anthropic
import pytest

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.server import answer_for
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.conftest import provider_for
from tests.helpers.paths import DATA

ENV = {"ANTHROPIC_KEY": "sk-ant-test"}
WINDOW_S = 0.2
TIERS = [{"name": "standard", "priority": 50, "window_ms": 0, "max_batch": 1},
         {"name": "batch", "priority": 0, "window_ms": WINDOW_S * 1000, "max_batch": 8,
          "similarity_threshold": 0.0}]
WEATHER = {"name": "weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _png() -> str:
    """A valid 1x1 PNG, base64-encoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))
    return base64.b64encode(raw).decode()


PNG = _png()


def anthropic_kind(sim) -> dict[str, Any]:
    return {"name": "claude", "kind": "anthropic", "base_url": sim.url, "api_key_env": "ANTHROPIC_KEY",
            "models": ["sim-small"], "model_map": {"sim-small": "claude-x"}}


def config(upstream: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"providers": [upstream], "tiers": TIERS, "merge": {"embedder": "none"}, **extra}


def client_for(broker, key: str = "test-key") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=broker.url, api_key=key, max_retries=0)


@pytest.fixture(params=["anthropic", "openai"])
async def through(request, simulator, start_broker):
    """A broker over an Anthropic upstream (native) or an OpenAI-compatible one (translated), and a client."""
    upstream = anthropic_kind(simulator) if request.param == "anthropic" else provider_for(simulator)
    broker = await start_broker(config(upstream), environ=ENV)
    client = client_for(broker)
    yield request.param, client
    await client.close()


@pytest.fixture(params=["anthropic", "openai"])
async def through_http(request, simulator, start_broker):
    """A broker over an Anthropic upstream (native) or an OpenAI-compatible one (translated), called over HTTP."""
    upstream = anthropic_kind(simulator) if request.param == "anthropic" else provider_for(simulator)
    return request.param, await start_broker(config(upstream), environ=ENV)


async def test_a_tool_round_trip_on_either_kind_of_upstream(through, simulator):
    kind, client = through
    first = await client.messages.create(model="sim-small", max_tokens=200, messages=QUESTION, tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    call = next(block for block in first.content if block.type == "tool_use")
    assert call.name == "weather" and isinstance(call.input["city"], str)
    second = await client.messages.create(model="sim-small", max_tokens=200, tools=[WEATHER], messages=[
        *QUESTION, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}])
    assert second.stop_reason == "end_turn" and "sunny, 21 C" in second.content[0].text
    assert second.usage.input_tokens > 0 and second.usage.output_tokens > 0
    calls = simulator.stats()["calls"]
    assert calls.get("messages", 0) == (2 if kind == "anthropic" else 0)
    assert calls.get("chat_completions", 0) == (0 if kind == "anthropic" else 2)


async def test_a_streamed_tool_call_on_either_kind_of_upstream(through):
    _, client = through
    async with client.messages.stream(model="sim-small", max_tokens=200, messages=QUESTION, tools=[WEATHER]) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0
    assert next(b for b in final.content if b.type == "tool_use").input["city"]


async def test_a_streamed_answer_on_either_kind_of_upstream(through):
    _, client = through
    async with client.messages.stream(model="sim-small", max_tokens=300,
                                      messages=[{"role": "user", "content": "Tell me about rivers"}]) as s:
        text = "".join([piece async for piece in s.text_stream])
        final = await s.get_final_message()
    assert text == final.content[0].text == answer_for("Tell me about rivers")


async def test_the_callers_beta_header_reaches_an_anthropic_upstream(simulator, start_broker):
    broker = await start_broker(config(anthropic_kind(simulator)), environ=ENV)
    client = client_for(broker)
    try:
        await client.messages.create(model="sim-small", max_tokens=100, messages=QUESTION, tools=[WEATHER],
                                     extra_headers={"anthropic-beta": "context-management-2025-06-27"})
    finally:
        await client.close()
    sent = simulator.last_request()
    assert sent["headers"]["anthropic-beta"] == "context-management-2025-06-27"
    assert sent["body"]["model"] == "claude-x" and sent["headers"]["x-api-key"] == "sk-ant-test"


async def test_count_tokens_is_forwarded_or_estimated(through, simulator):
    kind, client = through
    counted = await client.messages.count_tokens(model="sim-small", messages=QUESTION, tools=[WEATHER])
    assert counted.input_tokens > 0
    assert simulator.stats()["calls"].get("count_tokens", 0) == (1 if kind == "anthropic" else 0)


async def test_plain_text_messages_merge_like_chat(simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(config(anthropic_kind(simulator)), clock=clock, environ=ENV)
    client = client_for(broker)
    spy = SubmitSpy(broker)
    questions = [f"Summarise chapter {i} of the handbook" for i in range(8)]
    asked = asyncio.gather(*(client.messages.create(
        model="sim-small", max_tokens=200, system="Answer briefly.", messages=[{"role": "user", "content": q}],
        extra_headers={"X-Broker-Tier": "batch"}) for q in questions))
    await spy.wait_for(len(questions))
    clock.advance(WINDOW_S)
    answers = await asked
    await client.close()
    assert [a.content[0].text for a in answers] == [answer_for(q) for q in questions]
    assert simulator.stats()["calls"]["messages"] == 1  # one merged call for eight callers


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 10, "messages": QUESTION}, "model"),
    ({"model": "sim-small", "messages": QUESTION}, "max_tokens"),
    ({"model": "sim-small", "max_tokens": 10, "messages": []}, "messages"),
    ({"model": "sim-small", "max_tokens": 10, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"model": "sim-small", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
     "type"),
])
async def test_bad_input_is_a_400_in_anthropics_envelope_naming_the_field(simulator, start_broker, body, field):
    broker = await start_broker(config(anthropic_kind(simulator)), environ=ENV)
    async with broker.http.post("/v1/messages", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert field in answer["error"]["message"]
    assert simulator.stats()["calls"].get("messages", 0) == 0


async def test_a_bad_key_and_an_unknown_model_answer_as_anthropic_does(simulator, start_broker):
    auth = {"mode": "keys", "keys": [{"sha256": hashlib.sha256(b"good").hexdigest(), "tenant": "a"}]}
    broker = await start_broker(config(anthropic_kind(simulator), auth=auth), environ=ENV)
    bad, good = client_for(broker, "wrong"), client_for(broker, "good")
    try:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await bad.messages.create(model="sim-small", max_tokens=10, messages=QUESTION)
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await good.messages.create(model="no-such-model", max_tokens=10, messages=QUESTION)
        answer = await good.messages.create(model="sim-small", max_tokens=100, messages=QUESTION)
    finally:
        await bad.close()
        await good.close()
    assert denied.value.body["error"]["type"] == "authentication_error"
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert answer.content[0].text


def claude_code_turn() -> tuple[dict[str, Any], dict[str, str]]:
    """Claude Code's first turn as captured from a real run (tests/data/agents), and its beta headers."""
    capture = json.loads((DATA / "agents" / "claude_turn1.json").read_text())
    headers = {k: v for k, v in capture["headers"].items() if k.lower() in ("anthropic-beta", "anthropic-version")}
    return {**capture["body"], "model": "sim-small"}, headers


async def test_a_claude_code_turn_completes_a_tool_round_trip_on_either_kind(through_http, simulator):
    kind, broker = through_http
    body, headers = claude_code_turn()
    body = {**body, "stream": False}

    async def send(request: dict[str, Any]) -> anthropic.types.Message:
        async with broker.http.post("/v1/messages?beta=true", json=request, headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        return anthropic.types.Message.model_validate(answer)

    first = await send(body)
    call = next(block for block in first.content if block.type == "tool_use")
    assert first.stop_reason == "tool_use" and call.name == "Bash" and call.input["command"]
    if kind == "anthropic":  # native: breakpoints, thinking, context management and betas arrive intact
        sent = simulator.last_request()
        assert sent["headers"]["anthropic-beta"] == headers["anthropic-beta"]
        assert any("cache_control" in block for block in sent["body"]["system"])
        assert sent["body"]["thinking"] == body["thinking"]
        assert sent["body"]["context_management"] == body["context_management"]
    second = await send({**body, "messages": [
        *body["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "done"}]}]})
    assert second.stop_reason == "end_turn" and "done" in second.content[-1].text


async def test_an_image_and_cached_usage_in_the_stream_on_either_kind(through, simulator):
    kind, client = through
    if kind == "openai":
        simulator.set_faults(billing="openai")  # an OpenAI-compatible upstream that caches prefixes
    rules = "Rules of the house. " * 300  # long enough for the provider to cache
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
               {"type": "text", "text": "What is in this picture?"}]
    system = [{"type": "text", "text": rules, "cache_control": {"type": "ephemeral"}}]
    for _ in range(2):
        async with client.messages.stream(model="sim-small", max_tokens=100, system=system,
                                          messages=[{"role": "user", "content": content}]) as stream:
            final = await stream.get_final_message()
    assert final.content[0].text and final.usage.output_tokens > 0
    assert (final.usage.cache_read_input_tokens or 0) > 0  # the second call read the prefix from the cache


@pytest.mark.parametrize("content, field", [
    ([{"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "x"}], "tool_use_id"),
    ([{"type": "text", "text": ""}], "text"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"}}], "media_type"),
])
async def test_bad_content_is_a_400_naming_the_field(simulator, start_broker, content, field):
    broker = await start_broker(config(anthropic_kind(simulator)), environ=ENV)
    async with broker.http.post("/v1/messages", json={"model": "sim-small", "max_tokens": 10,
                                                      "messages": [{"role": "user", "content": content}]}) as resp:
        answer = await resp.json()
        assert resp.status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and field in answer["error"]["message"]
    assert simulator.stats()["calls"].get("messages", 0) == 0


async def test_count_tokens_learns_the_providers_count_from_its_reports(simulator, start_broker):
    """With no Anthropic upstream to ask, the broker counts; once priced answers have reported the provider's
    own counts for the model, its count is scaled to them."""
    price = {"input": 3.0, "cached_input": 0.3, "output": 15.0}
    broker = await start_broker(config(provider_for(simulator), pricing={"sim-small": price}), environ=ENV)
    client = client_for(broker)
    ask = {"model": "sim-small", "system": "You are terse. " * 20,
           "messages": [{"role": "user", "content": "Explain the rivers of Europe with care. " * 5}]}
    try:
        answered = await client.messages.create(**ask, max_tokens=50)
        counted = await client.messages.count_tokens(**ask)
    finally:
        await client.close()
    assert counted.input_tokens == pytest.approx(answered.usage.input_tokens, rel=0.05)
    assert broker.broker.costs.calibration.learnt("sim-small") is not None
