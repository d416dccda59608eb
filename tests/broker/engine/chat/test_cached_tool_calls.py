"""A tool-call reply is cached for a deterministic request (temperature 0, or a seed) and never shared across
different tools; a tool call at a temperature, and a cut (`length`) reply, are never cached."""

from __future__ import annotations

import pytest

from mergebroker.broker.engine.chat.service import cacheable_reply
from tests.conftest import provider_for


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def reply(*finish_reasons: str) -> dict:
    return {"choices": [{"index": n, "finish_reason": f} for n, f in enumerate(finish_reasons)]}


@pytest.mark.parametrize("request_body, finish_reasons, cached", [
    ({"temperature": 0}, ("stop",), True),
    ({"temperature": 0}, ("tool_calls",), True),
    ({"temperature": 0.7, "seed": 7}, ("tool_calls", "stop"), True),
    ({"temperature": 0, "seed": 0}, ("tool_calls",), True),
    ({"temperature": 1}, ("stop",), True),  # the request gate (`cache_nondeterministic`) decides this one
    ({"temperature": 1}, ("tool_calls",), False),
    ({}, ("tool_calls",), False),
    ({"temperature": 0}, ("length",), False),
    ({"temperature": 0}, ("tool_calls", "length"), False),
    ({"temperature": 0}, ("content_filter",), False),
    ({"temperature": 0}, (), False),
])
def test_cacheable_reply_takes_whole_answers_and_tool_calls_only_when_deterministic(request_body, finish_reasons,
                                                                                     cached):
    assert cacheable_reply(reply(*finish_reasons), request_body) is cached


async def ask(broker, tools: list[dict], **extra) -> tuple[dict, str]:
    status, body, headers = await broker.chat("What is the weather in Paris?", tools=tools, **extra)
    assert status == 200, body
    return body, headers["X-Broker-Cache"]


async def test_a_deterministic_tool_call_reply_is_answered_from_the_cache(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"}})
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
        first, cache = await ask(broker, [tool("weather")], **extra)
        assert cache == "miss" and first["choices"][0]["finish_reason"] == "tool_calls"
        again, cache = await ask(broker, [tool("weather")], **extra)
        assert cache == "hit" and again["choices"] == first["choices"]
    assert simulator.stats()["chat_calls"] == 2


async def test_requests_differing_only_in_tools_never_share_a_cached_reply(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"}})
    await ask(broker, [tool("weather")], temperature=0)
    other, cache = await ask(broker, [tool("forecast")], temperature=0)
    assert cache == "miss"
    assert [c["function"]["name"] for c in other["choices"][0]["message"]["tool_calls"]] == ["forecast"]
    _, cache = await ask(broker, [tool("weather")], temperature=0, tool_choice="required")
    assert cache == "miss"  # tool_choice is part of the key too
    assert simulator.stats()["chat_calls"] == 3


async def test_a_tool_call_at_a_temperature_is_sampled_afresh_even_where_text_is_cached(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"},
                                 "cache": {"cache_nondeterministic": True}})
    caches = [(await ask(broker, [tool("weather")], temperature=1))[1] for _ in range(2)]
    assert caches == ["miss", "miss"]
    _, _, text = await broker.chat("Say hello.", temperature=1)
    _, _, text_again = await broker.chat("Say hello.", temperature=1)
    assert (text["X-Broker-Cache"], text_again["X-Broker-Cache"]) == ("miss", "hit")
    assert simulator.stats()["chat_calls"] == 3


async def test_a_cut_reply_is_never_cached(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator)], "merge": {"embedder": "none"}})
    for _ in range(2):
        status, body, headers = await broker.chat("Tell me a long story about the sea.", temperature=0, max_tokens=3)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert headers["X-Broker-Cache"] == "miss"
    assert simulator.stats()["chat_calls"] == 2
