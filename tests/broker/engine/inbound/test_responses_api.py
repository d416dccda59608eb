"""The OpenAI Responses API through the broker, as the official SDK uses it: native where the upstream speaks
it, translated to chat where it does not, merged like chat when the request is plain text; stored
responses per tenant; bad input answered in OpenAI's envelope."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import answer_for, start_simulator
from tests.broker.engine.limits.test_tiers_api import SubmitSpy
from tests.conftest import provider_for
from tests.helpers.paths import DATA

WINDOW_S = 0.2
TIERS = [{"name": "standard", "priority": 50, "window_ms": 0, "max_batch": 1},
         {"name": "batch", "priority": 0, "window_ms": WINDOW_S * 1000, "max_batch": 8,
          "similarity_threshold": 0.0}]
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def config(sim, **extra: Any) -> dict[str, Any]:
    return {"providers": [provider_for(sim)], "tiers": TIERS, "merge": {"embedder": "none"}, **extra}


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
async def chat_only():
    """An OpenAI-compatible upstream without /v1/responses (404), as many are."""
    sim = await start_simulator(SimulatorConfig(responses=False))
    try:
        yield sim
    finally:
        await sim.close()


def client_for(broker, key: str = "test-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=broker.url + "/v1", api_key=key, max_retries=0)


async def tool_round_trip(client: openai.AsyncOpenAI) -> tuple[Any, Any]:
    """A function call, then its output sent back on the stored chain: the two Responses."""
    first = await client.responses.create(model="sim-small", input="What is the weather in Oslo?", tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "weather" and "city" in call.arguments
    second = await client.responses.create(
        model="sim-small", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    return first, second


async def test_a_tool_round_trip_goes_native_to_an_upstream_that_speaks_responses(simulator, start_broker):
    broker = await start_broker(config(simulator))
    first, second = await tool_round_trip(broker.openai)
    assert second.status == "completed" and "sunny, 21 C" in second.output_text
    assert simulator.stats()["calls"]["responses"] == 2 and "chat_completions" not in simulator.stats()["calls"]
    sent = simulator.last_request_body()
    assert "previous_response_id" not in sent  # the chain is the broker's: its turns go as input items
    assert [item.get("type", "message") for item in sent["input"]][-2:] == ["function_call", "function_call_output"]
    assert all("id" not in item for item in sent["input"])  # ids the upstream never made would 404 there
    assert first.usage.input_tokens > 0 and second.usage.output_tokens > 0


async def test_a_chat_only_upstream_gets_the_chat_form_and_the_answer_comes_back_as_a_response(
        chat_only, start_broker):
    broker = await start_broker(config(chat_only))
    first, second = await tool_round_trip(broker.openai)
    assert first.id.startswith("resp_") and first.output[-1].type == "function_call"
    assert "sunny, 21 C" in second.output_text and second.previous_response_id == first.id
    calls = chat_only.stats()["calls"]
    assert (calls["responses"], calls["chat_completions"]) == (1, 2)  # the first 404 is learnt, then chat
    sent = chat_only.last_request_body()
    assert [m["role"] for m in sent["messages"]][-3:] == ["user", "assistant", "tool"]
    assert sent["tools"][0]["function"]["name"] == "weather"
    retrieved = await broker.openai.responses.retrieve(second.id)
    assert retrieved.output_text == second.output_text


async def test_a_stream_on_either_path_ends_with_the_completed_response(simulator, chat_only, start_broker):
    for upstream in (simulator, chat_only):
        broker = await start_broker(config(upstream))
        stream = await broker.openai.responses.create(model="sim-small", input="Tell me about rivers",
                                                      tools=[WEATHER], tool_choice="none", stream=True)
        events = [event async for event in stream]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text == answer_for("Tell me about rivers")
        assert events[-1].response.usage.output_tokens > 0


async def test_plain_text_requests_merge_like_chat(simulator, start_broker):
    clock = FakeClock()
    broker = await start_broker(config(simulator), clock=clock)
    spy = SubmitSpy(broker)
    questions = [f"Summarise chapter {i} of the handbook" for i in range(8)]
    asked = asyncio.gather(*(broker.openai.responses.create(
        model="sim-small", input=q, instructions="Answer briefly.", extra_headers={"X-Broker-Tier": "batch"})
        for q in questions))
    await spy.wait_for(len(questions))
    clock.advance(WINDOW_S)
    answers = await asked
    assert [a.output_text for a in answers] == [answer_for(q) for q in questions]
    assert simulator.stats()["calls"]["chat_completions"] == 1 and "responses" not in simulator.stats()["calls"]


async def test_stored_responses_belong_to_their_tenant(simulator, start_broker):
    auth = {"mode": "keys", "keys": [{"sha256": _key("key-a"), "tenant": "a"},
                                     {"sha256": _key("key-b"), "tenant": "b"}]}
    broker = await start_broker(config(simulator, auth=auth))
    a, b = client_for(broker, "key-a"), client_for(broker, "key-b")
    try:
        mine = await a.responses.create(model="sim-small", input="What is the weather in Oslo?", tools=[WEATHER])
        for attempt in (b.responses.retrieve(mine.id), b.responses.input_items.list(mine.id),
                        b.responses.create(model="sim-small", input="go on", previous_response_id=mine.id),
                        b.responses.delete(mine.id)):
            with pytest.raises(openai.NotFoundError):
                await attempt
        items = await a.responses.input_items.list(mine.id)
        assert items.data[0].content[0].text == "What is the weather in Oslo?"
        await a.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(mine.id)
    finally:
        await a.close()
        await b.close()


async def test_an_unstored_response_cannot_be_continued(simulator, start_broker):
    broker = await start_broker(config(simulator))
    gone = await broker.openai.responses.create(model="sim-small", input="hello", store=False)
    with pytest.raises(openai.NotFoundError) as caught:
        await broker.openai.responses.create(model="sim-small", input="again", previous_response_id=gone.id)
    assert caught.value.body["code"] == "previous_response_not_found"


@pytest.mark.parametrize("body, field", [
    ({"input": "hi"}, "model"),
    ({"model": "sim-small"}, "input"),
    ({"model": "sim-small", "input": 5}, "input"),
    ({"model": "sim-small", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "sim-small", "input": "hi", "background": True}, "background"),
    ({"model": "sim-small", "input": [{"type": "no_such_item"}]}, "input"),
])
async def test_bad_input_is_a_400_in_openais_envelope_naming_the_field(simulator, start_broker, body, field):
    broker = await start_broker(config(simulator))
    async with broker.http.post("/v1/responses", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, error
    assert field in (error.get("param") or "") + error["message"] and error["type"] == "invalid_request_error"
    assert simulator.stats()["calls"].get("responses", 0) == 0


async def test_an_unknown_model_is_a_404_before_any_upstream_call(simulator, start_broker):
    broker = await start_broker(config(simulator, providers=[provider_for(simulator, models=["sim-small"])]))
    with pytest.raises(openai.NotFoundError):
        await broker.openai.responses.create(model="no-such-model", input="hi")
    assert simulator.stats()["calls"].get("responses", 0) == 0


CLOCK = {"type": "function", "name": "clock", "description": "The time in a zone",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


class City(BaseModel):
    name: str
    population: int


def codex_turn() -> dict[str, Any]:
    """Codex CLI's first turn as captured from a real run (tests/data/agents): streamed, unstored, encrypted
    reasoning asked for, function, namespace and hosted tools."""
    capture = json.loads((DATA / "agents" / "codex_turn1.json").read_text())
    body = {**capture["body"], "model": "sim-small"}
    extra = {"client_metadata": body.pop("client_metadata")}  # newer than this SDK
    return {**body, "extra_body": extra}


@pytest.mark.parametrize("kind", ["native", "chat-only"])
async def test_parallel_calls_stream_helper_and_parse_on_either_path(simulator, chat_only, start_broker, kind):
    broker = await start_broker(config(simulator if kind == "native" else chat_only))
    first = await broker.openai.responses.create(model="sim-small", input="Weather and time in Oslo?",
                                                 tools=[WEATHER, CLOCK])
    calls = [item for item in first.output if item.type == "function_call"]
    assert sorted(c.name for c in calls) == ["clock", "weather"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"{c.name} is fine"} for c in calls]
    async with broker.openai.responses.stream(model="sim-small", previous_response_id=first.id, input=outputs,
                                              tools=[WEATHER, CLOCK]) as stream:
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text and "weather is fine" in final.output_text
    parsed = await broker.openai.responses.parse(model="sim-small", input="Describe Oslo.", text_format=City)
    assert isinstance(parsed.output_parsed, City)


async def test_a_chain_of_three_turns_continues_across_upstreams_and_replicas(simulator, chat_only, start_broker,
                                                                            tmp_path):
    store = {"responses": {"store_path": str(tmp_path / "responses.sqlite3")}}
    native, translated = (await start_broker(config(simulator, **store)),
                          await start_broker(config(chat_only, **store)))
    first = await native.openai.responses.create(model="sim-small", input="What is the weather in Oslo?",
                                                 tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    second = await translated.openai.responses.create(
        model="sim-small", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    third = await native.openai.responses.create(model="sim-small", previous_response_id=second.id,
                                                 input="And tomorrow?", tools=[WEATHER], tool_choice="none")
    assert "sunny, 21 C" in second.output_text and third.status == "completed"
    sent = [item.get("type", item.get("role")) for item in simulator.last_request_body()["input"]]
    assert sent == ["message", "function_call", "function_call_output", "message", "user"]


async def test_a_codex_turn_completes_a_tool_round_trip_through_the_translated_path(chat_only, start_broker):
    broker = await start_broker(config(chat_only))
    body = codex_turn()
    stream = await broker.openai.responses.create(**body)
    events = [event async for event in stream]
    done = events[-1]
    assert done.type == "response.completed" and done.response.id
    call = next(item for item in done.response.output if item.type == "function_call")
    assert call.name == "exec_command" and json.loads(call.arguments)["cmd"]
    assert {e.type for e in events} >= {"response.output_item.added", "response.output_item.done"}
    history = [item.model_dump(exclude_none=True) for item in done.response.output]
    again = await broker.openai.responses.create(**{**body, "input": [
        *body["input"], *history, {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]})
    final = [event async for event in again][-1]
    assert final.type == "response.completed" and "ok" in final.response.output_text
    sent = chat_only.last_request_body()
    assert {t["function"]["name"] for t in sent["tools"]} >= {"exec_command"}  # namespaces flattened, hosted dropped


@pytest.mark.parametrize("body, field", [
    ({"model": "sim-small", "input": [{"type": "function_call_output", "call_id": "nowhere", "output": "x"}]},
     "call_id"),
    ({"model": "sim-small", "input": "hi", "tools": [{**WEATHER, "name": "w" * 65}]}, "name"),
])
async def test_a_call_output_with_no_call_or_a_long_tool_name_is_a_400(simulator, start_broker, body, field):
    broker = await start_broker(config(simulator))
    async with broker.http.post("/v1/responses", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, error
    assert field in (error.get("param") or "") + error["message"]
    assert "responses" not in simulator.stats()["calls"]


async def test_what_the_chat_form_cannot_carry_is_named_in_a_header(chat_only, start_broker):
    broker = await start_broker(config(chat_only))
    async with broker.http.post("/v1/responses", json={
            "model": "sim-small", "input": "weather?", "tools": [WEATHER, {"type": "web_search"}],
            "include": ["reasoning.encrypted_content"], "store": False}) as resp:
        assert resp.status == 200
        dropped = resp.headers["X-Broker-Dropped"]
    assert "web_search" in dropped and "include" in dropped
    assert "web_search" not in json.dumps(chat_only.last_request_body())
