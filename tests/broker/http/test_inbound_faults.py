"""Faults on the Responses and Messages APIs, as on chat: a stream an upstream breaks mid-way ends with the
API's own error event, rate limits answer 429 in the API's envelope, every answer leaves its ledger row."""

from __future__ import annotations

import sqlite3

import anthropic
import openai
import pytest

from mergebroker.clock import FakeClock
from mergebroker.providers.simulator.faults import SimulatorConfig
from mergebroker.providers.simulator.server import start_simulator
from tests.broker.engine.inbound.test_messages_api import ENV, QUESTION, WEATHER, anthropic_kind, client_for
from tests.conftest import provider_for

LIMITED = [{"name": "standard", "priority": 50, "window_ms": 0, "rpm": 2}]
FUNCTION = {"type": "function", "name": "weather", "parameters": WEATHER["input_schema"]}


def config(upstream, **extra):
    return {"providers": [upstream], "merge": {"embedder": "none"}, **extra}


@pytest.fixture
async def breaking():
    """An upstream whose every stream breaks after its third event with a 529 (Anthropic) or 429 error."""
    sim = await start_simulator(SimulatorConfig(stream_error_rate=1.0, stream_error_after=3, stream_error_status=529))
    try:
        yield sim
    finally:
        await sim.close()


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
async def test_a_messages_stream_broken_upstream_ends_with_an_anthropic_error_event(breaking, start_broker, kind):
    upstream = anthropic_kind(breaking) if kind == "anthropic" else provider_for(breaking)
    broker = await start_broker(config(upstream), environ=ENV)
    client = client_for(broker)
    try:
        with pytest.raises(anthropic.APIStatusError) as broken:
            async with client.messages.stream(model="sim-small", max_tokens=300, messages=[
                    {"role": "user", "content": "Tell me about rivers"}]) as stream:
                async for _ in stream:
                    pass
    finally:
        await client.close()
    assert broken.value.body["type"] == "error"
    assert broken.value.body["error"]["type"] in ("overloaded_error", "rate_limit_error", "api_error")


async def test_a_translated_responses_stream_that_breaks_ends_failed(breaking, start_broker):
    breaking.set_faults(responses=False)
    broker = await start_broker(config(provider_for(breaking)))
    stream = await broker.openai.responses.create(model="sim-small", input="Tell me about rivers", stream=True,
                                                  tools=[FUNCTION], tool_choice="none")
    events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.failed", "error")


async def test_rate_limits_answer_429_in_each_apis_envelope(simulator, start_broker):
    broker = await start_broker(config(anthropic_kind(simulator), tiers=LIMITED), environ=ENV, clock=FakeClock())
    client = client_for(broker)
    try:
        for _ in range(2):
            await client.messages.create(model="sim-small", max_tokens=50, messages=QUESTION, tools=[WEATHER])
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.create(model="sim-small", max_tokens=50, messages=QUESTION)
    finally:
        await client.close()
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert simulator.stats()["calls"]["messages"] == 2


async def test_a_native_responses_call_counts_against_the_tier_limit(simulator, start_broker):
    broker = await start_broker(config(provider_for(simulator), tiers=LIMITED), clock=FakeClock())
    for _ in range(2):
        await broker.openai.responses.create(model="sim-small", input="weather in Oslo?", tools=[FUNCTION])
    with pytest.raises(openai.RateLimitError) as limited:
        await broker.openai.responses.create(model="sim-small", input="weather in Oslo?", tools=[FUNCTION])
    assert limited.value.body["code"] == "rate_limit_exceeded"
    assert simulator.stats()["calls"]["responses"] == 2


async def test_every_answer_leaves_a_ledger_row_with_the_upstreams_tokens(simulator, start_broker, tmp_path):
    path = tmp_path / "ledger.sqlite3"
    broker = await start_broker(config(anthropic_kind(simulator), ledger={"path": str(path), "flush_interval_s": 0.05}),
                                environ=ENV)
    client = client_for(broker)
    try:
        reply = await client.messages.create(model="sim-small", max_tokens=100, messages=QUESTION, tools=[WEATHER])
        async with client.messages.stream(model="sim-small", max_tokens=100, messages=QUESTION, tools=[WEATHER]) as s:
            streamed = await s.get_final_message()
    finally:
        await client.close()
    await broker.broker.ledger.flush()
    rows = sqlite3.connect(path).execute(
        "SELECT endpoint, prompt_tokens, completion_tokens, status FROM ledger ORDER BY ts").fetchall()
    reported = [(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
                 + (m.usage.cache_creation_input_tokens or 0), m.usage.output_tokens) for m in (reply, streamed)]
    assert [(r[0], r[3]) for r in rows] == [("messages", 200), ("messages", 200)]
    assert [(r[1], r[2]) for r in rows] == reported


async def test_a_chat_stream_the_upstream_breaks_is_counted_as_broken(breaking, start_broker):
    broker = await start_broker(config(provider_for(breaking)))
    stream = await broker.openai.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "Tell me about rivers"}], stream=True)
    with pytest.raises(openai.APIError, match="Overloaded"):
        async for _ in stream:
            pass
    broken = broker.broker.metrics.registry.get_sample_value(
        "mergebroker_requests_total", {"endpoint": "chat", "tier": "standard", "status": "503"})
    assert broken == 1.0


@pytest.fixture
async def billing():
    """An OpenAI-compatible upstream that caches prompt prefixes and bills them as OpenAI does."""
    sim = await start_simulator(SimulatorConfig(billing="openai"))
    try:
        yield sim
    finally:
        await sim.close()


async def test_the_ledgers_dollars_match_the_providers_bill_on_every_path(billing, start_broker, tmp_path):
    path = tmp_path / "ledger.sqlite3"
    price = {"input": 2.50, "cached_input": 1.25, "output": 10.0}
    broker = await start_broker(config(provider_for(billing), pricing={"sim-small": price},
                                       ledger={"path": str(path), "flush_interval_s": 0.05}))
    rules = "Rules of the house. " * 400  # a long shared prefix: later calls read it from the provider's cache
    for i in range(3):  # native (tools), merged-like-chat (plain text), and the Messages API translated
        await broker.openai.responses.create(model="sim-small", instructions=rules, input=f"weather {i}?",
                                             tools=[FUNCTION])
        await broker.openai.responses.create(model="sim-small", instructions=rules, input=f"question {i}")
        async with broker.http.post("/v1/messages", json={
                "model": "sim-small", "max_tokens": 100, "system": rules, "tools": [WEATHER],
                "messages": [{"role": "user", "content": f"weather {i}?"}]}) as resp:
            assert resp.status == 200
    await broker.broker.ledger.flush()
    rows = sqlite3.connect(path).execute("SELECT endpoint, actual_usd FROM ledger").fetchall()
    assert sorted({r[0] for r in rows}) == ["messages", "responses"] and len(rows) == 9
    assert all(r[1] is not None for r in rows)
    bill = billing.bill()
    assert bill["cached_tokens"] > 0
    assert sum(r[1] for r in rows) == pytest.approx(bill["usd"], rel=0.01)
