"""The simulator's Anthropic mode speaks the Messages API as the official `anthropic` SDK expects it: answers,
streams, stop reasons, usage and typed errors; tool calls, tool results, structured output and images; and it
refuses every body the SDK's request types or a strict upstream would refuse, naming the field."""

from __future__ import annotations

import base64
import json

import aiohttp
import anthropic
import pytest

from mergebroker.providers.simulator.server import answer_for

USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def client(simulator):
    sdk = anthropic.AsyncAnthropic(base_url=simulator.url.removesuffix("/v1"), api_key="sk-test", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


async def test_the_sdk_gets_a_message_with_usage(client, simulator):
    message = await client.messages.create(model="claude-x", max_tokens=200, system="Be brief.", messages=USER)
    assert message.type == "message" and message.role == "assistant" and message.model == "claude-x"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == answer_for(USER[0]["content"])
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert simulator.stats()["calls"]["messages"] == 1


async def test_the_sdk_streams_text_and_the_final_message(client):
    async with client.messages.stream(model="claude-x", max_tokens=200, messages=USER) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == answer_for(USER[0]["content"])
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 1


async def test_stop_sequences_and_max_tokens_end_the_answer_with_their_reason(client):
    answer = answer_for(USER[0]["content"])
    stop = answer.split()[3]
    stopped = await client.messages.create(model="claude-x", max_tokens=200, messages=USER, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == answer[: answer.index(stop)]
    cut = await client.messages.create(model="claude-x", max_tokens=3, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize("override, error", [(429, anthropic.RateLimitError), (529, anthropic.OverloadedError),
                                             (500, anthropic.InternalServerError)])
async def test_injected_faults_arrive_as_the_sdks_typed_errors(client, simulator, override, error):
    simulator.set_faults(status_override=override, retry_after_s=2)
    with pytest.raises(error) as info:
        await client.messages.create(model="claude-x", max_tokens=10, messages=USER)
    assert info.value.body["type"] == "error"
    if override == 429:
        assert info.value.response.headers["retry-after"] == "2"


async def test_invalid_requests_are_refused_as_the_messages_api_does(client):
    # SDK 1.0 dropped the sampling keywords (newer models refuse them); the API still takes them in the body.
    accepted = await client.messages.create(model="claude-x", max_tokens=10, messages=USER,
                                            extra_body={"temperature": 0.5, "top_p": 0.9})
    assert accepted.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=USER, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match="frequency_penalty"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=USER,
                                     extra_body={"frequency_penalty": 1})
    with pytest.raises(anthropic.BadRequestError, match="role"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=[{"role": "system", "content": "x"}])


async def test_headers_are_required(simulator):
    url = simulator.url.removesuffix("/v1") + "/v1/messages"
    body = {"model": "claude-x", "max_tokens": 10, "messages": USER}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers={"anthropic-version": "2023-06-01"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
        async with http.post(url, json=body, headers={"x-api-key": "k"}) as resp:
            assert resp.status == 400 and "anthropic-version" in (await resp.json())["error"]["message"]


WEATHER = {"name": "weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}
CLOCK = {"name": "clock", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}}


async def test_the_sdk_gets_parallel_tool_calls_then_an_answer_from_the_results(client):
    first = await client.messages.create(model="claude-x", max_tokens=200, messages=USER, tools=[WEATHER, CLOCK])
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use", "tool_use"]
    calls = first.content[1:]
    assert [c.name for c in calls] == ["weather", "clock"]
    assert isinstance(calls[0].input["city"], str) and isinstance(calls[0].input["days"], int)
    assert calls[1].input["zone"] in ("UTC", "CET")
    again = await client.messages.create(model="claude-x", max_tokens=200, messages=USER, tools=[WEATHER, CLOCK])
    assert [c.input for c in again.content[1:]] == [c.input for c in calls]  # deterministic per question
    follow_up = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny"},
                            {"type": "tool_result", "tool_use_id": calls[1].id,
                             "content": [{"type": "text", "text": "12:00"}]}]}]
    final = await client.messages.create(model="claude-x", max_tokens=200, messages=follow_up, tools=[WEATHER, CLOCK])
    assert final.stop_reason == "end_turn" and final.content[0].text == "From the tools: Sunny; 12:00."


async def test_a_forced_tool_and_disabled_parallel_calls_give_one_call_and_streams_carry_its_input(client):
    only = await client.messages.create(model="claude-x", max_tokens=200, messages=USER, tools=[WEATHER, CLOCK],
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in only.content] == ["tool_use"] and only.content[0].name == "weather"
    async with client.messages.stream(model="claude-x", max_tokens=200, messages=USER, tools=[WEATHER, CLOCK],
                                      tool_choice={"type": "tool", "name": "clock"}) as stream:
        final = await stream.get_final_message()
    assert [(b.type, b.name) for b in final.content] == [("tool_use", "clock")]
    assert final.content[0].input["zone"] in ("UTC", "CET") and final.stop_reason == "tool_use"
    none = await client.messages.create(model="claude-x", max_tokens=200, messages=USER, tools=[WEATHER],
                                        tool_choice={"type": "none"})
    assert none.content[0].text == answer_for(USER[0]["content"])


async def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "tags"],
              "properties": {"city": {"type": "string"}, "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}}},
              "$defs": {"Tag": {"type": "object", "properties": {"label": {"type": "string"}}}}}
    message = await client.messages.create(model="claude-x", max_tokens=200, messages=USER,
                                           output_config={"format": {"type": "json_schema", "schema": schema}})
    value = json.loads(message.content[0].text)
    assert isinstance(value["city"], str) and isinstance(value["tags"][0]["label"], str)


async def test_images_from_base64_and_urls_are_accepted(client, simulator):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16).decode()
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
               {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
               {"type": "text", "text": "What is this?"}]
    message = await client.messages.create(model="claude-x", max_tokens=200,
                                           messages=[{"role": "user", "content": content}])
    assert message.content[0].text == answer_for("What is this?")
    assert simulator.last_request_body()["messages"][0]["content"][:2] == content[:2]


@pytest.mark.parametrize("extra, expected", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": "red"}]}]},
     "messages.0.content.0.colour: Extra inputs are not permitted"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name: Field required"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "parameters": {}}]}, "tools.0.parameters"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "roles must alternate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "must be non-empty"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "}]}, "trailing whitespace"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]},
     "tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(b"\x89PNG....").decode()}}]}]},
     "does not match"),
    ({"stop_sequences": ["\n"]}, "non-whitespace"),
])
async def test_bodies_the_sdk_types_or_a_strict_upstream_refuse_get_a_400_naming_the_field(simulator, extra,
                                                                                          expected):
    body = {"model": "claude-x", "max_tokens": 10, "messages": USER, **extra}
    async with aiohttp.ClientSession() as http:
        async with http.post(simulator.url.removesuffix("/v1") + "/v1/messages", json=body,
                             headers={"x-api-key": "k", "anthropic-version": "2023-06-01"}) as resp:
            error = (await resp.json())["error"]
    assert resp.status == 400 and error["type"] == "invalid_request_error" and expected in error["message"]
    assert simulator.stats()["chat_calls"] == 0


LONG_SYSTEM = [{"type": "text", "text": "You answer questions about the catalogue of a bicycle shop. " * 200,
                "cache_control": {"type": "ephemeral"}}]


async def test_a_cache_breakpoint_is_written_once_then_read(client, simulator):
    first = await client.messages.create(model="claude-x", max_tokens=50, system=LONG_SYSTEM, messages=USER)
    second = await client.messages.create(model="claude-x", max_tokens=50, system=LONG_SYSTEM,
                                          messages=[{"role": "user", "content": "And of Spain?"}])
    assert first.usage.cache_creation_input_tokens > 1024 and first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0 and 0 < second.usage.input_tokens < 50
    other = await client.messages.create(model="claude-y", max_tokens=50, system=LONG_SYSTEM, messages=USER)
    assert other.usage.cache_read_input_tokens == 0  # caches are per model
    stats = simulator.stats()
    assert stats["cache_read_input_tokens"] == second.usage.cache_read_input_tokens


async def test_a_short_prefix_or_no_breakpoint_is_not_cached(client):
    short = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    for system in (short, short, LONG_SYSTEM[0]["text"], LONG_SYSTEM[0]["text"]):
        message = await client.messages.create(model="claude-x", max_tokens=50, system=system, messages=USER)
        assert message.usage.cache_read_input_tokens == 0 and message.usage.cache_creation_input_tokens == 0


async def test_more_than_four_breakpoints_are_refused(simulator):
    mark = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"part {i}", "cache_control": mark} for i in range(5)]
    body = {"model": "claude-x", "max_tokens": 10, "messages": USER, "system": system}
    async with aiohttp.ClientSession() as http:
        async with http.post(simulator.url.removesuffix("/v1") + "/v1/messages", json=body,
                             headers={"x-api-key": "k", "anthropic-version": "2023-06-01"}) as resp:
            error = (await resp.json())["error"]
    assert resp.status == 400 and "maximum of 4 blocks with cache_control" in error["message"]
