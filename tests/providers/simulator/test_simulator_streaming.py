"""The simulated upstream cuts replies at max_tokens and streams as real providers do, quirks and mid-stream
errors included, each switchable at run time and from `mergebroker simulate`."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from mergebroker.providers.simulator.cli import add_simulate_arguments, config_from_args
from mergebroker.providers.simulator.content import answer_for, count_tokens
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import RunningSimulator, start_simulator

QUESTION = "What is the capital of France?"
BLOCKS = {"K42": "How tall is Everest?", "B07": "Who wrote Hamlet?", "Q11": "Why is the sky blue?"}
LONG = SimulatorConfig(answer_words=80)  # answers longer than every budget below


def chat_body(text: str = QUESTION, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-small", "messages": [{"role": "user", "content": text}], **extra}


def merged_text(blocks: dict[str, str]) -> str:
    return "\n".join(f"<{block_id}>{text}</{block_id}>" for block_id, text in blocks.items())


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, sim: RunningSimulator, body: Any) -> tuple[int, str, str]:
    async with http.post(sim.url + "/chat/completions", json=body) as resp:
        return resp.status, resp.content_type, await resp.text()


def sse_data(raw: str) -> list[Any]:
    """Every `data:` payload of an SSE body, JSON-decoded except the `[DONE]` marker."""
    payloads = [line.removeprefix("data: ") for line in raw.split("\n") if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def streamed_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_plain_reply_stops_at_the_token_budget_with_length(http: aiohttp.ClientSession, field: str) -> None:
    async with await start_simulator(LONG) as sim:
        status, _, raw = await post(http, sim, chat_body(**{field: 7}))
        assert status == 200
        body = json.loads(raw)
        content = body["choices"][0]["message"]["content"]
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 7
        assert answer_for(QUESTION, 80).startswith(content) and count_tokens(content) == 7
        _, _, raw = await post(http, sim, chat_body(max_tokens=10_000))
        assert json.loads(raw)["choices"][0]["finish_reason"] == "stop"
        assert json.loads(raw)["choices"][0]["message"]["content"] == answer_for(QUESTION, 80)


async def test_a_merged_reply_cut_by_the_budget_loses_its_later_blocks(http: aiohttp.ClientSession) -> None:
    async with await start_simulator(LONG) as sim:
        first_block = f'<K42>{answer_for(BLOCKS["K42"], 80)}</K42>'
        status, _, raw = await post(http, sim, chat_body(merged_text(BLOCKS), max_tokens=count_tokens(first_block) + 12))
        body = json.loads(raw)
    content = body["choices"][0]["message"]["content"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert content.startswith(first_block) and "</B07>" not in content  # the second block is cut short
    assert "<B07>" in content and "Q11" not in content


async def test_a_streamed_reply_cut_by_the_budget_ends_with_length_then_usage_then_done(
        http: aiohttp.ClientSession) -> None:
    async with await start_simulator(LONG) as sim:
        status, _, raw = await post(http, sim, chat_body(max_tokens=9, stream=True,
                                                         stream_options={"include_usage": True}))
    events = sse_data(raw)
    assert status == 200 and events[-1] == "[DONE]"
    finish, usage = events[-3], events[-2]
    assert finish["choices"][0]["finish_reason"] == "length" and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 9
    assert answer_for(QUESTION, 80).startswith(streamed_text(events)) and count_tokens(streamed_text(events)) == 9


async def test_answer_words_changes_at_run_time(http: aiohttp.ClientSession) -> None:
    async with await start_simulator() as sim:
        sim.set_faults(answer_words=40)
        _, _, raw = await post(http, sim, chat_body())
    assert json.loads(raw)["choices"][0]["message"]["content"] == answer_for(QUESTION, 40)


async def test_ignore_stream_answers_a_streamed_request_with_a_plain_completion(http: aiohttp.ClientSession) -> None:
    async with await start_simulator(SimulatorConfig(ignore_stream=True)) as sim:
        status, content_type, raw = await post(http, sim, chat_body(stream=True, stream_options={"include_usage": True}))
        assert status == 200 and content_type == "application/json"
        body = json.loads(raw)
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == answer_for(QUESTION)
        assert sim.stats()["stream_calls"] == 1
        sim.set_faults(ignore_stream=False)
        _, content_type, raw = await post(http, sim, chat_body(stream=True))
    assert content_type == "text/event-stream" and sse_data(raw)[-1] == "[DONE]"


async def test_a_provider_without_stream_options_refuses_them_by_name(http: aiohttp.ClientSession) -> None:
    async with await start_simulator(SimulatorConfig(reject_stream_options=True)) as sim:
        status, _, raw = await post(http, sim, chat_body(stream=True, stream_options={"include_usage": True}))
        error = json.loads(raw)["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "stream_options"
        assert "stream_options" in error["message"]
        status, _, raw = await post(http, sim, chat_body(stream=True))
        assert status == 200 and sse_data(raw)[-1] == "[DONE]"
        assert sim.stats()["chat_calls"] == 1  # a refused request is not a call the model saw


async def test_a_provider_that_cannot_stream_refuses_stream_true_by_name(http: aiohttp.ClientSession) -> None:
    async with await start_simulator() as sim:
        await http.post(f"http://127.0.0.1:{sim.port}/control/faults", json={"reject_stream": True})
        status, _, raw = await post(http, sim, chat_body(stream=True))
        error = json.loads(raw)["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "stream"
        assert "'stream'" in error["message"]
        status, _, raw = await post(http, sim, chat_body(stream=False))
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == answer_for(QUESTION)


@pytest.mark.parametrize(("status", "type_", "code"), [(429, "rate_limit_error", "rate_limit_exceeded"),
                                                       (529, "overloaded_error", "overloaded_error")])
async def test_a_stream_can_end_in_an_error_event_after_n_chunks(http: aiohttp.ClientSession, status: int,
                                                                 type_: str, code: str) -> None:
    config = SimulatorConfig(answer_words=30, stream_error_rate=1.0, stream_error_after=3, stream_error_status=status,
                             billing="openai")
    async with await start_simulator(config) as sim:
        http_status, _, raw = await post(http, sim, chat_body(stream=True, stream_options={"include_usage": True}))
        events = sse_data(raw)
        assert http_status == 200 and len(events) == 4 and "[DONE]" not in events
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:3])
        assert (events[3]["error"]["type"], events[3]["error"]["code"]) == (type_, code)
        sent = streamed_text(events)
        assert answer_for(QUESTION, 30).startswith(sent) and 0 < len(sent) < len(answer_for(QUESTION, 30))
        assert sim.stats()["faults"] == {"stream_error": 1}
        assert sim.bill()["completion_tokens"] == sim.stats()["completion_tokens"] == count_tokens(sent)


async def test_the_openai_sdk_raises_on_a_mid_stream_error() -> None:
    async with await start_simulator(SimulatorConfig(stream_error_rate=1.0, stream_error_after=1)) as sim:
        async with openai.AsyncOpenAI(base_url=sim.url, api_key="x", max_retries=0) as client:
            stream = await client.chat.completions.create(model="sim-small", stream=True,
                                                          messages=[{"role": "user", "content": QUESTION}])
            with pytest.raises(openai.APIError, match="Rate limit reached"):
                async for _ in stream:
                    pass


async def test_mid_stream_errors_follow_the_seed_and_spare_plain_calls(http: aiohttp.ClientSession) -> None:
    async def outcomes(seed: int) -> list[bool]:
        async with await start_simulator(SimulatorConfig(seed=seed, stream_error_rate=0.5)) as sim:
            ended = [sse_data((await post(http, sim, chat_body(stream=True)))[2])[-1] == "[DONE]" for _ in range(12)]
            plain = [(await post(http, sim, chat_body()))[0] for _ in range(3)]
        assert plain == [200, 200, 200]
        return ended

    first = await outcomes(7)
    assert first == await outcomes(7) and True in first and False in first


def test_the_new_options_are_flags_of_mergebroker_simulate() -> None:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    ns = parser.parse_args(["--billing", "openai", "--cache-scope", "global", "--price-input", "1.1",
                            "--ignore-stream", "--reject-stream-options", "--stream-error-rate", "0.2",
                            "--stream-error-status", "529", "--answer-words", "50"])
    config = config_from_args(ns)
    assert (config.billing, config.cache_scope, config.price_input, config.ignore_stream, config.reject_stream_options,
            config.reject_stream, config.stream_error_rate, config.stream_error_status, config.answer_words) == \
        ("openai", "global", 1.1, True, True, False, 0.2, 529, 50)
    defaults = config_from_args(parser.parse_args([]))
    assert (defaults.billing, defaults.price_input, defaults.price_cached_input, defaults.price_output) == \
        ("none", 2.5, 1.25, 10.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--billing", "free"])
    assert "--reject-stream" in parser.format_help() and "/control/faults" in parser.format_help()
