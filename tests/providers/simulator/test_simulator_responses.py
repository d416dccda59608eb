"""The simulator's OpenAI mode speaks the Responses API as the official `openai` SDK expects it: the answers, token
counts and bill of the chat route for the same conversation; streams of every event the SDK knows, numbered;
structured output, tool round trips (parallel, namespaced, shell-like), reasoning, `max_output_tokens` cuts;
stored responses chained by `previous_response_id`, retrieved, listed and deleted; faults as on chat; and a
chat-only mode that answers 404."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.agent import after_tools
from mergebroker.providers.simulator.cli import add_simulate_arguments, config_from_args
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.running import RunningSimulator
from mergebroker.providers.simulator.server import answer_for, start_simulator

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}
CLOCK = {"type": "function", "name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
async def client(simulator: RunningSimulator) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=simulator.url, api_key="sk-test", max_retries=0) as sdk:
        yield sdk


async def raw_events(simulator: RunningSimulator, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed call, checked to be framed as OpenAI frames them."""
    async with aiohttp.ClientSession() as http:
        async with http.post(simulator.url + "/responses", json={**body, "stream": True}) as reply:
            assert reply.status == 200 and reply.content_type == "text/event-stream"
            text = await reply.text()
    events = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


async def test_a_response_carries_the_chat_routes_answer_and_token_counts(client, simulator):
    response = await client.responses.create(model="sim-small", instructions="Be brief.", input=QUESTION,
                                             metadata={"run": "1"}, temperature=0.2, user="u-1")
    chat = await client.chat.completions.create(model="sim-small", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    Response.model_validate(response.model_dump())
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == chat.choices[0].message.content == answer_for(QUESTION)
    message = response.output[0]
    assert message.type == "message" and message.content[0].annotations == []
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert (response.metadata, response.temperature, response.user, response.instructions) == (
        {"run": "1"}, 0.2, "u-1", "Be brief.")
    assert response.error is None and response.incomplete_details is None and response.store is True
    assert simulator.stats()["calls"]["responses"] == 1


async def test_the_sdks_stream_helper_accepts_every_event_in_order(client, simulator):
    async with client.responses.stream(model="sim-small", input=QUESTION) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == answer_for(QUESTION) and final.status == "completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert kinds.count("response.output_text.delta") > 2
    events = await raw_events(simulator, {"model": "sim-small", "input": QUESTION})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == answer_for(QUESTION)
    Response.model_validate(events[-1]["response"])


class City(BaseModel):
    name: str
    population: int
    landmarks: list[str]


async def test_parse_fills_a_pydantic_model_from_a_json_schema_format(client):
    parsed = await client.responses.parse(model="sim-small", input=QUESTION, text_format=City)
    city = parsed.output_parsed
    assert isinstance(city, City) and city.name and city.landmarks
    loose = await client.responses.create(model="sim-small", input=QUESTION, text={"format": {"type": "json_object"}})
    assert json.loads(loose.output_text) == {"answer": answer_for(QUESTION)}


async def test_a_tool_round_trip_with_parallel_calls_then_an_answer_quoting_the_outputs(client):
    first = await client.responses.create(model="sim-small", input=QUESTION, tools=[WEATHER, CLOCK,
                                                                                    {"type": "web_search"}])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["weather", "clock"] and all(c.status == "completed" for c in calls)
    for call, tool in zip(calls, (WEATHER, CLOCK)):
        jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": out}
               for c, out in zip(calls, ("Sunny", "12:00"))]
    history = [{"role": "user", "content": QUESTION}, *[c.model_dump(exclude_none=True) for c in calls], *outputs]
    final = await client.responses.create(model="sim-small", input=history, tools=[WEATHER, CLOCK])
    assert final.output_text == after_tools(["Sunny", "12:00"]) == "From the tools: Sunny; 12:00."
    single = await client.responses.create(model="sim-small", input=QUESTION, tools=[WEATHER, CLOCK],
                                           parallel_tool_calls=False)
    assert [item.name for item in single.output] == ["weather"]
    forced = await client.responses.create(model="sim-small", input=QUESTION, tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "name": "clock"})
    assert [item.name for item in forced.output] == ["clock"]
    none = await client.responses.create(model="sim-small", input=QUESTION, tools=[WEATHER], tool_choice="none")
    assert none.output_text == answer_for(QUESTION)


async def test_namespaced_and_shell_tools_get_calls_an_agent_can_run(client, simulator):
    crm = {"type": "namespace", "name": "crm", "description": "The CRM", "tools": [
        {"type": "function", "name": "lookup", "parameters": {
            "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}]}
    grouped = await client.responses.create(model="sim-small", input=QUESTION, tools=[crm])
    assert [(i.name, i.namespace) for i in grouped.output] == [("lookup", "crm")]
    shell = {"type": "function", "name": "exec_command", "parameters": {
        "type": "object", "required": ["cmd"], "properties": {"cmd": {"type": "string"},
                                                               "yield_time_ms": {"type": "number"}}}}
    events = await raw_events(simulator, {"model": "sim-small", "input": QUESTION, "tools": [shell, CLOCK]})
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert len(done) == 1 and deltas == done[0]["arguments"]
    for event in events:
        EVENTS.validate_python(event)
    Response.model_validate(events[-1]["response"])
    assert json.loads(deltas)["cmd"].startswith("echo ") and set(json.loads(deltas)) == {"cmd"}


async def test_reasoning_comes_first_and_max_output_tokens_leaves_the_response_incomplete(client, simulator):
    thought = await client.responses.create(model="sim-small", input=QUESTION, include=[
        "reasoning.encrypted_content"], reasoning={"effort": "low", "summary": "auto"}, store=False)
    assert [i.type for i in thought.output] == ["reasoning", "message"]
    assert thought.output[0].summary[0].text and thought.output[0].encrypted_content
    assert 0 < thought.usage.output_tokens_details.reasoning_tokens < thought.usage.output_tokens
    events = await raw_events(simulator, {"model": "sim-small", "input": QUESTION,
                                          "reasoning": {"effort": "low", "summary": "auto"}})
    for event in events:
        EVENTS.validate_python(event)
    assert "response.reasoning_summary_text.delta" in {e["type"] for e in events}
    cut = await client.responses.create(model="sim-small", input=QUESTION, max_output_tokens=4)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4 and answer_for(QUESTION).startswith(cut.output_text)
    async with client.responses.stream(model="sim-small", input=QUESTION, max_output_tokens=4) as stream:
        kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.incomplete"


async def test_a_three_turn_chain_continues_each_stored_conversation(client):
    first = await client.responses.create(model="sim-small", input="Name a colour.")
    second = await client.responses.create(model="sim-small", input="Name a fruit.", previous_response_id=first.id)
    third = await client.responses.create(model="sim-small", input="Name a tree.", previous_response_id=second.id)
    assert third.previous_response_id == second.id and third.output_text == answer_for("Name a tree.")
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    items = await client.responses.input_items.list(third.id, order="asc")
    texts = [i.content[0].text for i in items.data]
    assert texts == ["Name a colour.", first.output_text, "Name a fruit.", second.output_text, "Name a tree."]
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="sim-small", input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"
    unstored = await client.responses.create(model="sim-small", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="sim-small", input="y", previous_response_id=unstored.id)


async def test_stored_responses_are_retrieved_listed_and_deleted(client, simulator):
    made = await client.responses.create(model="sim-small", input=[
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": "https://example.com/a.png",
                                      "detail": "auto"}]}])
    assert made.output_text == answer_for(QUESTION)
    got = await client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    newest_first = await client.responses.input_items.list(made.id)
    assert [i.role for i in newest_first.data] == ["user", "developer"] and newest_first.data[0].id
    page = await client.responses.input_items.list(made.id, limit=1)
    assert len(page.data) == 1 and page.has_more
    await client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)
    assert simulator.stats()["calls"]["responses_delete"] == 1


async def test_faults_apply_as_on_chat_and_a_mid_stream_fault_fails_the_response(client, simulator):
    simulator.set_faults(status_override=429, retry_after_s=2)
    with pytest.raises(openai.RateLimitError):
        await client.responses.create(model="sim-small", input=QUESTION)
    simulator.set_faults(status_override=None, stream_error_rate=1.0, stream_error_after=3)
    events = await raw_events(simulator, {"model": "sim-small", "input": QUESTION})
    assert len(events) == 4 and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "rate_limit_exceeded"
    EVENTS.validate_python(events[-1])
    assert simulator.stats()["faults"] == {"status_override": 1, "stream_error": 1}


async def test_merged_calls_are_answered_block_by_block_as_on_chat(client, simulator):
    text = "<K42>Who wrote Hamlet?</K42>\n<B07>How tall is Everest?</B07>"
    response = await client.responses.create(model="sim-small", input=text)
    chat = await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": text}])
    assert response.output_text == chat.choices[0].message.content
    assert f"<K42>{answer_for('Who wrote Hamlet?')}</K42>" in response.output_text
    assert simulator.stats()["merged_calls"] == 2


async def test_cached_prompt_tokens_are_reported_and_billed_like_chat(fake_clock: FakeClock):
    long_instructions = "Rules of the house. " * 400
    async with await start_simulator(SimulatorConfig(billing="openai"), clock=fake_clock) as sim:
        async with openai.AsyncOpenAI(base_url=sim.url, api_key="sk-a", max_retries=0) as client:
            cold = await client.responses.create(model="sim-small", instructions=long_instructions, input="one")
            warm = await client.responses.create(model="sim-small", instructions=long_instructions, input="two")
        assert cold.usage.input_tokens_details.cached_tokens == 0
        assert warm.usage.input_tokens_details.cached_tokens >= 1024
        bill = sim.bill()
        assert bill["requests"] == 2 and bill["cached_tokens"] == warm.usage.input_tokens_details.cached_tokens


async def test_the_chat_only_mode_answers_404_and_still_serves_chat():
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    config = config_from_args(parser.parse_args(["--no-responses"]))
    assert config.responses is False and config_from_args(parser.parse_args([])).responses is True
    async with await start_simulator(config) as sim:
        async with openai.AsyncOpenAI(base_url=sim.url, api_key="sk-a", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as info:
                await client.responses.create(model="sim-small", input=QUESTION)
            assert info.value.body["type"] == "invalid_request_error"
            chat = await client.chat.completions.create(model="sim-small",
                                                        messages=[{"role": "user", "content": QUESTION}])
            assert chat.choices[0].message.content == answer_for(QUESTION)
            sim.set_faults(responses=True)
            served = await client.responses.create(model="sim-small", input=QUESTION)
            assert served.output_text == answer_for(QUESTION)
        assert sim.stats()["calls"]["responses"] == 2


async def test_bad_bodies_get_a_400_naming_the_field(simulator):
    async with aiohttp.ClientSession() as http:
        for body, param in (({"input": "x"}, "model"), ({"model": "m"}, "input"),
                            ({"model": "m", "input": 3}, "input"),
                            ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
                            ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                            ({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "nope"}},
                             "tool_choice")):
            async with http.post(simulator.url + "/responses", json=body) as reply:
                assert reply.status == 400, body
                assert (await reply.json())["error"]["param"] == param


async def test_a_shell_tool_runs_the_command_the_prompt_quotes_between_backticks(client):
    shell = {"type": "function", "name": "shell", "parameters": {
        "type": "object", "required": ["command"], "properties": {"command": {"type": "array",
                                                                               "items": {"type": "string"}}}}}
    prompt = "Create result.txt using the shell: run `echo ready > result.txt`"
    response = await client.responses.create(model="sim-small", input=prompt, tools=[shell, WEATHER])
    assert [json.loads(i.arguments) for i in response.output] == [{"command": ["bash", "-lc",
                                                                               "echo ready > result.txt"]}]


async def test_the_chat_route_serves_an_agent_behind_a_chat_only_upstream(client):
    chat_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}}
                  for t in (WEATHER, CLOCK)]
    question = [{"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(model="sim-small", messages=question, tools=chat_tools)
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["weather", "clock"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["parameters"])
    stream = await client.chat.completions.create(model="sim-small", messages=question, tools=chat_tools,
                                                  stream=True, parallel_tool_calls=False)
    chunks = [chunk async for chunk in stream]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "weather"
    assert "".join(d.function.arguments for d in deltas) == calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = question + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": out} for c, out in zip(calls, ("Sunny", "12:00"))]
    final = await client.chat.completions.create(model="sim-small", messages=follow, tools=chat_tools)
    assert final.choices[0].message.content == after_tools(["Sunny", "12:00"])
    parsed = await client.chat.completions.parse(model="sim-small", messages=question, response_format=City)
    assert isinstance(parsed.choices[0].message.parsed, City)
