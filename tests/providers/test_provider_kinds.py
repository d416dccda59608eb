"""The official OpenAI SDK, pointed at the broker, gets answers, streams, merged answers and errors from Anthropic
and Azure upstreams, and a model served by both an Anthropic and an OpenAI-compatible upstream fails over
between them when one's breaker trips."""

from __future__ import annotations

import asyncio

import openai
import pytest

from mergebroker.breaker.circuit import BreakerState
from mergebroker.providers.simulator.server import answer_for, start_simulator
from tests.conftest import provider_for

ENV = {"ANTHROPIC_KEY": "sk-ant-test", "AZURE_KEY": "az-test"}
BATCH = {"X-Broker-Tier": "batch"}
TIERS = [{"name": "standard", "priority": 50, "window_ms": 10},
         {"name": "batch", "priority": 0, "window_ms": 200, "max_batch": 8, "similarity_threshold": 0.0}]


def anthropic_upstream(sim, name: str = "claude", **extra) -> dict:
    return {"name": name, "kind": "anthropic", "base_url": sim.url, "api_key_env": "ANTHROPIC_KEY",
            "model_map": {"claude-alias": "claude-x"}, **extra}


def azure_upstream(sim, name: str = "az", **extra) -> dict:
    return {"name": name, "kind": "azure", "base_url": sim.url.removesuffix("/v1"), "api_key_env": "AZURE_KEY",
            "deployments": {"gpt-alias": "sim-small", "embed-alias": "sim-embed"}, **extra}


def config(*providers, **extra) -> dict:
    return {"providers": list(providers), "tiers": TIERS, "merge": {"embedder": "none"}, **extra}


def ask(content: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


async def stream_text(client, **kwargs) -> tuple[str, list]:
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


async def test_anthropic_answers_with_the_request_translated(simulator, start_broker):
    broker = await start_broker(config(anthropic_upstream(simulator)), environ=ENV)
    reply = await broker.openai.chat.completions.create(model="claude-alias", messages=ask("Name a colour", "Be brief"),
                                                        stop=["zzz"], temperature=0.3)
    assert reply.choices[0].message.content == answer_for("Name a colour")
    assert reply.choices[0].finish_reason == "stop" and reply.model == "claude-x"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    sent = simulator.last_request_body()
    assert sent == {"model": "claude-x", "system": "Be brief", "messages": [{"role": "user", "content": "Name a colour"}],
                    "max_tokens": 256, "stop_sequences": ["zzz"], "temperature": 0.3}


async def test_anthropic_streams_become_openai_chunks(simulator, start_broker):
    broker = await start_broker(config(anthropic_upstream(simulator)), environ=ENV)
    text, chunks = await stream_text(broker.openai, model="claude-alias", messages=ask("Stream me"),
                                     stream_options={"include_usage": True})
    assert text == answer_for("Stream me")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    cut, cut_chunks = await stream_text(broker.openai, model="claude-alias", messages=ask("Stream me"), max_tokens=3)
    assert answer_for("Stream me").startswith(cut) and cut != answer_for("Stream me")
    assert [c.choices[0].finish_reason for c in cut_chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("kind", ["anthropic", "azure"])
async def test_merged_calls_give_each_caller_its_own_answer(simulator, start_broker, kind):
    upstream, model = ((anthropic_upstream(simulator), "claude-alias") if kind == "anthropic"
                       else (azure_upstream(simulator), "gpt-alias"))
    broker = await start_broker(config(upstream), environ=ENV)
    questions = [f"Summarise section {i} of the guide" for i in range(4)]
    replies = await asyncio.gather(*(broker.openai.chat.completions.with_raw_response.create(
        model=model, messages=ask(q), extra_headers=BATCH) for q in questions))
    for q, raw in zip(questions, replies):
        assert raw.parse().choices[0].message.content == answer_for(q)
        assert raw.headers["X-Broker-Batch-Size"] == "4"
    assert simulator.stats()["chat_calls"] == 1 and simulator.stats()["merged_calls"] == 1


async def test_fields_anthropic_cannot_carry_get_a_400_naming_them(simulator, start_broker):
    broker = await start_broker(config(anthropic_upstream(simulator)), environ=ENV)
    with pytest.raises(openai.BadRequestError) as info:
        await broker.openai.chat.completions.create(model="claude-alias", messages=ask("Hi"), logprobs=True)
    assert info.value.body["param"] == "logprobs" and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        await broker.openai.chat.completions.create(model="claude-alias", messages=ask("Hi"), stream=True, n=2)
    assert info.value.body["param"] == "n"
    assert simulator.stats()["chat_calls"] == 0
    assert broker.broker.breakers["claude"].state is BreakerState.CLOSED


async def test_anthropic_errors_are_mapped_for_openai_clients(simulator, start_broker):
    broker = await start_broker(config(anthropic_upstream(simulator), retry={"attempts": 1}), environ=ENV)
    simulator.set_faults(status_override=429, retry_after_s=3)
    with pytest.raises(openai.RateLimitError) as limited:
        await broker.openai.chat.completions.create(model="claude-alias", messages=ask("one"))
    assert limited.value.response.headers["Retry-After"] == "3"
    simulator.set_faults(status_override=529)
    with pytest.raises(openai.InternalServerError) as overloaded:
        await broker.openai.chat.completions.create(model="claude-alias", messages=ask("two"))
    assert overloaded.value.status_code == 503 and overloaded.value.response.headers["Retry-After"] == "1"
    assert overloaded.value.body["code"] == "upstream_overloaded"
    with pytest.raises(openai.InternalServerError) as in_stream:
        await stream_text(broker.openai, model="claude-alias", messages=ask("three"))
    assert in_stream.value.status_code == 503
    simulator.set_faults(status_override=400)
    with pytest.raises(openai.BadRequestError):
        await broker.openai.chat.completions.create(model="claude-alias", messages=ask("four"))
    simulator.set_faults(status_override=401)
    with pytest.raises(openai.APIStatusError) as rejected:
        await broker.openai.chat.completions.create(model="claude-alias", messages=ask("five"))
    assert rejected.value.status_code == 502 and "credentials" in rejected.value.message


@pytest.mark.parametrize("failing", ["anthropic", "openai"])
async def test_failover_between_kinds_under_a_breaker_trip(start_broker, failing):
    trip = {"min_calls": 2, "error_ratio": 0.5, "open_s": 60}
    async with await start_simulator() as anthropic_sim, await start_simulator() as openai_sim:
        first = anthropic_upstream(anthropic_sim, models=["shared"], breaker=trip)
        second = provider_for(openai_sim, "gpt", models=["shared"], breaker=trip)
        if failing == "openai":
            first, second = second, first  # the failing upstream is tried first
        broker = await start_broker(config(first, second, retry={"attempts": 1}), environ=ENV)
        bad, good = (anthropic_sim, openai_sim) if failing == "anthropic" else (openai_sim, anthropic_sim)
        bad.set_faults(status_override=529 if failing == "anthropic" else 503)
        for i in range(5):
            reply = await broker.openai.chat.completions.create(model="shared", messages=ask(f"Question {i}"))
            assert reply.choices[0].message.content == answer_for(f"Question {i}")
        text, _ = await stream_text(broker.openai, model="shared", messages=ask("Streamed"))
        assert text == answer_for("Streamed")
        assert broker.broker.breakers[first["name"]].state is BreakerState.OPEN
        assert bad.stats()["chat_calls"] == 2  # tried until its breaker tripped, then skipped
        assert good.stats()["chat_calls"] == 6


async def test_a_field_one_kind_cannot_carry_is_served_by_the_other_kind(start_broker):
    async with await start_simulator() as anthropic_sim, await start_simulator() as openai_sim:
        broker = await start_broker(config(anthropic_upstream(anthropic_sim, models=["shared"]),
                                           provider_for(openai_sim, "gpt", models=["shared"])), environ=ENV)
        reply = await broker.openai.chat.completions.create(model="shared", messages=ask("Hi"), seed=7)
        assert reply.choices[0].message.content == answer_for("Hi")
        assert anthropic_sim.stats()["chat_calls"] == 0 and openai_sim.stats()["chat_calls"] == 1


async def test_azure_serves_chat_streams_and_embeddings_on_deployments(simulator, start_broker):
    broker = await start_broker(config(azure_upstream(simulator, models=["gpt-alias", "embed-alias"])), environ=ENV)
    reply = await broker.openai.chat.completions.create(model="gpt-alias", messages=ask("Hello Azure"))
    assert reply.choices[0].message.content == answer_for("Hello Azure")
    text, _ = await stream_text(broker.openai, model="gpt-alias", messages=ask("Hello Azure"))
    assert text == answer_for("Hello Azure")
    vectors = await broker.openai.embeddings.create(model="embed-alias", input=["one", "two"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == simulator.config.embedding_dim
    assert simulator.stats()["chat_calls"] == 2 and simulator.stats()["embedding_calls"] == 1


async def test_azure_deployment_errors_reach_the_client(simulator, start_broker):
    broker = await start_broker(config(azure_upstream(simulator)), environ=ENV)
    with pytest.raises(openai.NotFoundError) as info:
        await broker.openai.chat.completions.create(model="not-deployed", messages=ask("Hi"))
    assert info.value.body["code"] == "DeploymentNotFound"


async def test_consecutive_merged_calls_with_a_long_shared_system_prompt_read_it_from_anthropics_cache(
        simulator, start_broker):
    broker = await start_broker(config(anthropic_upstream(simulator)), environ=ENV)
    system = "You are the support assistant of a bicycle shop; answer from its catalogue only. " * 90
    for round_ in range(2):
        questions = [f"Round {round_}: which bell fits handlebar {i}?" for i in range(3)]
        replies = await asyncio.gather(*(broker.openai.chat.completions.with_raw_response.create(
            model="claude-alias", messages=ask(q, system), extra_headers=BATCH) for q in questions))
        assert [r.headers["X-Broker-Batch-Size"] for r in replies] == ["3"] * 3
        assert [r.parse().choices[0].message.content for r in replies] == [answer_for(q) for q in questions]
        sent = simulator.last_request_body()
        assert sent["system"] == [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
        stats = simulator.stats()
        if round_ == 0:
            assert stats["cache_creation_input_tokens"] > 1024 and stats["cache_read_input_tokens"] == 0
    assert stats["merged_calls"] == 2
    assert stats["cache_read_input_tokens"] == stats["cache_creation_input_tokens"]  # the second call read it all
