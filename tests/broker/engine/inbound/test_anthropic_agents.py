"""Agents' traffic through the broker to an Anthropic upstream, with the official OpenAI SDK as the client and the
simulator's Anthropic mode (which validates every body against the `anthropic` SDK's types) as the upstream: tool
round trips with parallel calls, plain and streamed; structured output parsed into a pydantic model; images from
data URLs and URLs; the same shapes as through an OpenAI-kind upstream; and no merging of any of it."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import BaseModel

from mergebroker.merge.prompt import request_blocks
from mergebroker.providers.simulator.agent import after_tools, instance, tool_calls
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import answer_for, create_simulator_app

ENV = {"ANTHROPIC_KEY": "sk-ant-test"}
TIERS = [{"name": "standard", "priority": 50, "window_ms": 10},
         {"name": "batch", "priority": 0, "window_ms": 200, "max_batch": 8, "similarity_threshold": 0.0}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather and the time in Oslo?"}]


class Person(BaseModel):
    name: str
    age: int
    languages: list[str]


def config(upstream: dict, **extra) -> dict:
    return {"providers": [upstream], "tiers": TIERS, "merge": {"embedder": "none"}, **extra}


def anthropic_upstream(url: str, model: str = "claude-x") -> dict:
    return {"name": "claude", "kind": "anthropic", "base_url": url, "api_key_env": "ANTHROPIC_KEY",
            "models": ["agent"], "model_map": {"agent": model}}


def all_validated(sim) -> bool:
    """Every request the Anthropic mode received passed the SDK's types (a refused one is not a chat call)."""
    stats = sim.stats()
    return stats["calls"]["messages"] == stats["chat_calls"] > 0


def results_for(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c.id, "content": f"result of {c.function.name}"} for c in calls]


@pytest.fixture
async def broker(simulator, start_broker):
    return await start_broker(config(anthropic_upstream(simulator.url)), environ=ENV)


async def test_a_tool_round_trip_with_parallel_calls(broker, simulator):
    first = await broker.openai.chat.completions.create(model="agent", messages=QUESTION, tools=[WEATHER, CLOCK])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Calling 2 tool(s)."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["weather", "clock"]
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F")
    turn = choice.message.model_dump(exclude_none=True)
    final = await broker.openai.chat.completions.create(
        model="agent", messages=QUESTION + [turn] + results_for(calls), tools=[WEATHER, CLOCK])
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == after_tools(["result of weather", "result of clock"])
    assert all_validated(simulator)


async def test_a_streamed_tool_round_trip_assembles_the_same_calls(broker, simulator):
    plain = await broker.openai.chat.completions.create(model="agent", messages=QUESTION, tools=[WEATHER, CLOCK])
    stream = await broker.openai.chat.completions.create(model="agent", messages=QUESTION, tools=[WEATHER, CLOCK],
                                                         stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if call.id:  # the first chunk of a call names it
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in plain.choices[0].message.tool_calls]
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()]}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['name']}"} for c in calls.values()]
    text = "".join([c.choices[0].delta.content or "" async for c in await broker.openai.chat.completions.create(
        model="agent", messages=QUESTION + [turn] + results, tools=[WEATHER, CLOCK], stream=True) if c.choices])
    assert text == after_tools(["result of weather", "result of clock"])
    assert all_validated(simulator)


@pytest.mark.parametrize("model", ["claude-x", "claude-sonnet-4-5"])  # forced tool, native structured output
async def test_structured_output_parses_into_a_pydantic_model(simulator, start_broker, model):
    broker = await start_broker(config(anthropic_upstream(simulator.url, model)), environ=ENV)
    reply = await broker.openai.chat.completions.parse(model="agent", response_format=Person,
                                                       messages=[{"role": "user", "content": "Describe Ada."}])
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and person.name and len(person.languages) == 1
    sent = simulator.last_request_body()
    assert ("output_config" in sent) is (model == "claude-sonnet-4-5")
    assert ("tool_choice" in sent) is (model == "claude-x")
    assert all_validated(simulator)


def png(width: int, height: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height) + b"\x08\x06\x00\x00\x00"


async def test_images_from_a_data_url_and_from_a_url(broker, simulator):
    encoded = base64.b64encode(png(4, 3)).decode()
    content = [{"type": "text", "text": "What is in these pictures?"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}", "detail": "low"}},
               {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]
    reply = await broker.openai.chat.completions.create(model="agent", messages=[{"role": "user", "content": content}])
    assert reply.choices[0].message.content == answer_for("What is in these pictures?")
    assert simulator.last_request_body()["messages"][0]["content"][1:] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}]
    assert all_validated(simulator)


class OpenAIAgentUpstream:
    """An OpenAI-kind upstream answering tools and structured output as the simulator's Anthropic mode does
    (`providers.simulator.agent`), in OpenAI's shapes."""

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        question = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        finish = "stop"
        if body["messages"][-1]["role"] == "tool":
            results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
            message["content"] = after_tools(results)
        elif (body.get("response_format") or {}).get("type") == "json_schema":
            message["content"] = json.dumps(instance(body["response_format"]["json_schema"]["schema"], question))
        elif body.get("tools"):
            tools = [{"name": t["function"]["name"], "schema": t["function"].get("parameters")} for t in body["tools"]]
            calls = tool_calls(tools, "auto", seed=question)
            message["content"] = f"Calling {len(calls)} tool(s)."
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {
                "name": name, "arguments": json.dumps(value, separators=(",", ":"))}} for i, (name, value) in
                enumerate(calls)]
            finish = "tool_calls"
        else:
            message["content"] = answer_for(question)
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body["model"],
                                  "choices": [{"index": 0, "message": message, "logprobs": None,
                                               "finish_reason": finish}],
                                  "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


def shape(value: Any) -> Any:
    """A value's structure: keys and types all the way down, the values themselves left out."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


async def test_an_agent_conversation_has_the_same_shapes_over_either_kind(simulator, start_broker):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", OpenAIAgentUpstream().chat)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        openai_kind = await start_broker(config({"name": "gpt", "base_url": f"http://127.0.0.1:{server.port}/v1",
                                                 "models": ["agent"]}), environ=ENV)
        anthropic_kind = await start_broker(config(anthropic_upstream(simulator.url)), environ=ENV)
        seen = []
        for broker in (openai_kind, anthropic_kind):
            first = await broker.openai.chat.completions.create(model="agent", messages=QUESTION, tools=[WEATHER, CLOCK])
            calls = first.choices[0].message.tool_calls
            final = await broker.openai.chat.completions.create(
                model="agent", tools=[WEATHER, CLOCK],
                messages=QUESTION + [first.choices[0].message.model_dump(exclude_none=True)] + results_for(calls))
            parsed = await broker.openai.chat.completions.parse(model="agent", messages=QUESTION, response_format=Person)
            seen.append([(shape(r.choices[0].model_dump(warnings=False)), r.choices[0].finish_reason)
                         for r in (first, final, parsed)]
                        + [[c.function.name for c in calls], final.choices[0].message.content])
        assert seen[0] == seen[1]
    finally:
        await server.close()


async def test_agent_requests_never_merge_but_identical_ones_coalesce_and_cache(simulator, start_broker):
    broker = await start_broker(config(anthropic_upstream(simulator.url)), environ=ENV)
    batch = {"X-Broker-Tier": "batch"}
    tool_asks = [[{"role": "user", "content": f"Weather in city number {i}?"}] for i in range(4)]
    replies = await asyncio.gather(*(broker.openai.chat.completions.with_raw_response.create(
        model="agent", messages=m, tools=[WEATHER], extra_headers=batch) for m in tool_asks))
    assert [r.headers["X-Broker-Batch-Size"] for r in replies] == ["1"] * 4
    assert simulator.stats()["chat_calls"] == 4 and simulator.stats()["merged_calls"] == 0
    same = {"model": "agent", "messages": [{"role": "user", "content": "Describe Ada."}], "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}}
    together = await asyncio.gather(*(broker.openai.chat.completions.with_raw_response.create(
        **same, extra_headers=batch) for _ in range(4)))
    # One upstream call: the others shared it in flight, or (on a slow machine) found it cached already.
    assert sorted(r.headers["X-Broker-Cache"] for r in together)[-1] == "miss"
    assert all(r.headers["X-Broker-Cache"] in ("coalesced", "hit") for r in sorted(
        together, key=lambda r: r.headers["X-Broker-Cache"])[:-1])
    later = await broker.openai.chat.completions.with_raw_response.create(**same, extra_headers=batch)
    assert later.headers["X-Broker-Cache"] == "hit"
    assert len({r.parse().choices[0].message.content for r in [*together, later]}) == 1
    assert simulator.stats()["chat_calls"] == 5


async def test_a_replayed_tool_result_never_reaches_a_merged_call(start_broker):
    bodies: list[dict[str, Any]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/messages":
            bodies.append(await request.json())
        return await handler(request)

    app = create_simulator_app(SimulatorConfig())
    app.middlewares.append(record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        sim_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        broker = await start_broker(config(anthropic_upstream(sim_url)), environ=ENV)
        secret = "SECRET-tool-output-4711"
        replayed = QUESTION + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": secret}, {"role": "user", "content": "Thanks!"}]
        plain = [[{"role": "user", "content": f"Name a fact about planet {i}"}] for i in range(4)]
        replies = await asyncio.gather(*(broker.openai.chat.completions.with_raw_response.create(
            model="agent", messages=m, extra_headers={"X-Broker-Tier": "batch"}) for m in [replayed, *plain, replayed]))
    finally:
        await runner.cleanup()
    assert replies[0].parse().choices[0].message.content == after_tools([secret])
    assert [r.headers["X-Broker-Batch-Size"] for r in replies[1:5]] == ["4"] * 4
    merged = [b for b in bodies if request_blocks(json.dumps(b))]
    assert len(merged) == 1 and secret not in json.dumps(merged[0])
