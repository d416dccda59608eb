"""The simulator's Anthropic mode takes what Claude Code sends and shows tests what arrived: beta bodies
(`?beta=true`, `anthropic-beta`) checked against the SDK's beta types, system reminders as `role: "system"` turns,
adaptive thinking, `context_management`, `$schema` and `defer_loading` tools, 128k budgets; it answers a shell
tool with a command Claude Code can run, streams full usage in `message_start` and `message_delta`, takes
`tool_result`s with `is_error` and parallel `tool_use`s, counts tokens at `/v1/messages/count_tokens`, and records
the last request's headers and body at `/_sim/last_request`."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import jsonschema
import pytest

from mergebroker.providers.simulator.agent import after_tools
from mergebroker.providers.simulator.content import prompt_tokens
from mergebroker.providers.simulator.server import answer_for

QUESTION = "List the files here."
BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                         "additionalProperties": False, "required": ["command"],
                         "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                                        "run_in_background": {"type": "boolean"}}}}
READ = {"name": "Read", "description": "Read a file", "defer_loading": True,
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
WEATHER = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"]}}
CLOCK = {"name": "clock", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}}
SYSTEM = [{"type": "text", "text": "You are Claude Code, Anthropic's CLI.", "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Rules of the house. " * 300, "cache_control": {"type": "ephemeral"}}]
HEADERS = {"anthropic-beta": "claude-code-20250219,context-management-2025-06-27", "x-api-key": "sk-ant-cc"}


def claude_code_body(**extra):
    """A body shaped like Claude Code's: cached system blocks, a reminder turn, thinking, effort, beta fields."""
    return {"model": "claude-sonnet-4-5", "max_tokens": 128000, "system": SYSTEM, "tools": [BASH, READ],
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]},
                         {"role": "system", "content": "<system-reminder>Stay on task.</system-reminder>"}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "metadata": {"user_id": json.dumps({"device_id": "d1", "session_id": "s1"})}, **extra}


@pytest.fixture
async def client(simulator):
    sdk = anthropic.AsyncAnthropic(base_url=simulator.url.removesuffix("/v1"), api_key="sk-ant-test", max_retries=0,
                                   timeout=60)
    try:
        yield sdk
    finally:
        await sdk.close()


async def test_a_claude_code_body_gets_a_bash_call_it_can_run_and_arrives_intact(client, simulator):
    message = await client.beta.messages.create(**claude_code_body(), extra_headers=HEADERS,
                                                extra_query={"beta": "true"})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [u.name for u in uses] == ["Bash"]
    jsonschema.validate(uses[0].input, BASH["input_schema"])
    assert uses[0].input["command"].startswith("echo ") and set(uses[0].input) == {"command"}
    seen = simulator.last_request()
    assert seen["path"] == "/v1/messages" and seen["query"] == "beta=true"
    assert seen["headers"]["anthropic-beta"] == HEADERS["anthropic-beta"]
    assert seen["headers"]["x-api-key"] == "sk-ant-cc"
    assert seen["headers"]["anthropic-version"] and seen["body"]["system"] == SYSTEM
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{simulator.port}/_sim/last_request") as reply:
            assert (await reply.json())["body"]["system"][1]["cache_control"] == {"type": "ephemeral"}


async def test_the_bash_result_is_answered_and_an_error_result_is_taken(client):
    first = await client.beta.messages.create(**claude_code_body(), extra_headers=HEADERS)
    use = next(b for b in first.content if b.type == "tool_use")
    body = claude_code_body()
    body["messages"] = body["messages"][:1] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "exit 127",
                                      "is_error": True}]},
        {"role": "system", "content": "<system-reminder>Answer briefly.</system-reminder>"}]
    final = await client.beta.messages.create(**body, extra_headers=HEADERS)
    assert final.stop_reason == "end_turn" and final.content[0].text == after_tools(["exit 127"])


async def test_a_stream_reports_cache_usage_at_the_start_and_the_end(client):
    body = claude_code_body(tools=[])
    usages = []
    for _ in range(2):
        async with client.beta.messages.stream(**body, extra_headers=HEADERS) as stream:
            events = [event async for event in stream]
        start = next(e for e in events if e.type == "message_start").message.usage
        delta = next(e for e in events if e.type == "message_delta").usage
        assert delta.input_tokens == start.input_tokens
        usages.append((start.cache_creation_input_tokens, start.cache_read_input_tokens,
                       delta.cache_creation_input_tokens, delta.cache_read_input_tokens))
    written, _, written_at_end, _ = usages[0]
    assert written > 1024 and written_at_end == written
    assert usages[1][1] == usages[1][3] == written and usages[1][0] == 0
    assert (await stream.get_final_message()).content[0].text == answer_for(QUESTION)


async def test_parallel_tool_use_round_trips_through_the_plain_api(client):
    question = [{"role": "user", "content": "Weather and time in Oslo?"}]
    first = await client.messages.create(model="claude-x", max_tokens=200, messages=question, tools=[WEATHER, CLOCK],
                                         extra_query={"beta": "true"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["weather", "clock"]
    follow = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Rain"},
                             {"type": "tool_result", "tool_use_id": uses[1].id, "content": "09:00",
                              "is_error": False}]}]
    final = await client.messages.create(model="claude-x", max_tokens=200, messages=follow, tools=[WEATHER, CLOCK])
    assert final.content[0].text == "From the tools: Rain; 09:00."


async def test_count_tokens_counts_the_prompt_as_messages_does(client, simulator):
    convo = [{"role": "user", "content": QUESTION}]
    counted = await client.messages.count_tokens(model="claude-x", system="Be brief.", messages=convo)
    answered = await client.messages.create(model="claude-x", max_tokens=50, system="Be brief.", messages=convo)
    assert counted.input_tokens == answered.usage.input_tokens == prompt_tokens(
        [{"role": "system", "content": "Be brief."}, *convo])
    beta = await client.beta.messages.count_tokens(**{k: v for k, v in claude_code_body().items()
                                                      if k not in ("max_tokens", "metadata")}, extra_headers=HEADERS)
    assert beta.input_tokens > 1000
    assert simulator.stats()["calls"]["count_tokens"] == 2 and simulator.stats()["calls"]["messages"] == 1
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await client.messages.count_tokens(model="claude-x", messages=convo, extra_body={"max_tokens": 5})


async def test_beta_fields_need_a_beta_call_and_a_leading_system_turn_is_refused(client):
    with pytest.raises(anthropic.BadRequestError, match="context_management"):
        await client.messages.create(model="claude-x", max_tokens=10, messages=[{"role": "user", "content": "x"}],
                                     extra_body={"context_management": {"edits": []}})
    with pytest.raises(anthropic.BadRequestError, match="role"):
        await client.beta.messages.create(model="claude-x", max_tokens=10, extra_headers=HEADERS, messages=[
            {"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
