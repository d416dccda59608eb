"""Answers match the official OpenAI response schemas (plain, merged, cached, stream chunks, embeddings, errors),
and requests the spec allows (empty content, null stream and n) are accepted while mistyped ones name their field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.conftest import provider_for

def _nullable(node: Any) -> Any:
    """The spec still writes some nullables the OpenAPI 3.0 way (`nullable: true`); JSON Schema needs a null branch."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


_SPEC = _nullable(json.loads((Path(__file__).parent / "schemas" / "openai_responses.json").read_text()))
BATCH = {"X-Broker-Tier": "batch"}


def assert_matches(instance: Any, schema_name: str, **overrides: Any) -> None:
    """Validate `instance` against the vendored official schema `schema_name` (2020-12 JSON Schema)."""
    schema = {**_SPEC["components"]["schemas"][schema_name], **overrides}
    resolver_root = {**_SPEC, **schema}
    validator = jsonschema.Draft202012Validator(resolver_root)
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, f"{schema_name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def config(sim) -> dict:
    return {"providers": [provider_for(sim)], "merge": {"embedder": "none"},
            "tiers": [{"name": "standard", "priority": 50, "merge": False},
                      {"name": "batch", "priority": 0, "window_ms": 200, "max_batch": 8, "similarity_threshold": 0.0}]}


async def test_plain_merged_and_cached_answers_match_the_official_schema(simulator, start_broker):
    broker = await start_broker(config(simulator))
    status, plain, _ = await broker.chat("What is a plain answer?")
    assert status == 200
    assert_matches(plain, "CreateChatCompletionResponse")
    merged = await asyncio.gather(*(broker.chat(q, headers=BATCH, temperature=0)
                                    for q in ["First merged one?", "Second merged?"]))
    assert [h["X-Broker-Batch-Size"] for _, _, h in merged] == ["2", "2"]
    for _, body, _ in merged:
        assert_matches(body, "CreateChatCompletionResponse")
        assert body["choices"][0]["message"]["refusal"] is None
    status, cached, headers = await broker.chat("First merged one?", headers=BATCH, temperature=0)
    assert headers["X-Broker-Cache"] == "hit"
    assert_matches(cached, "CreateChatCompletionResponse")


async def test_stream_chunks_match_the_official_schema(simulator, start_broker):
    broker = await start_broker(config(simulator))
    async with broker.http.post("/v1/chat/completions", json={
            "model": "sim-small", "stream": True, "messages": [{"role": "user", "content": "stream please"}]}) as resp:
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    for event in events[:-1]:
        assert_matches(json.loads(event), "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize("encoding", ["float", "base64"])
async def test_embeddings_match_the_official_schema(simulator, start_broker, encoding):
    broker = await start_broker(config(simulator))
    async with broker.http.post("/v1/embeddings", json={"model": "sim-embed", "input": ["a", "b"],
                                                        "encoding_format": encoding}) as resp:
        body = await resp.json()
    assert resp.status == 200
    if encoding == "base64":  # the spec types only the float form; the base64 form is a string in its place
        assert all(isinstance(item["embedding"], str) for item in body["data"])
        body = {**body, "data": [{**item, "embedding": [0.0]} for item in body["data"]]}
    assert_matches(body, "CreateEmbeddingResponse")


async def test_errors_match_the_official_schema_and_name_their_parameter(simulator, start_broker):
    broker = await start_broker(config(simulator))
    for extra, param in [({"stream": []}, "stream"), ({"stream": "false"}, "stream"), ({"n": "2"}, "n"),
                         ({"model": 7}, "model"), ({"max_tokens": 1.5}, "max_tokens")]:
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "x"}], **extra}
        async with broker.http.post("/v1/chat/completions", json=body) as resp:
            error = await resp.json()
        assert resp.status in (400, 404), extra
        assert_matches(error, "ErrorResponse")
        assert error["error"]["param"] == param, extra
    parts = {"model": "sim-small", "messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}
    async with broker.http.post("/v1/chat/completions", json=parts) as resp:
        assert resp.status == 400


async def test_requests_the_spec_allows_are_accepted(simulator, start_broker):
    broker = await start_broker(config(simulator))
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    replay = [{"role": "user", "content": "call f"}, {"role": "assistant", "content": "", "tool_calls": [tool_call]},
              {"role": "tool", "tool_call_id": "call_1", "content": ""}, {"role": "user", "content": "and now?"}]
    for extra in [{"messages": replay}, {"stream": None, "n": None}, {"messages": [{"role": "user", "content": ""}]}]:
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "x"}], **extra}
        async with broker.http.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, (extra, await resp.text())
            assert_matches(await resp.json(), "CreateChatCompletionResponse")
