"""Answers match the official OpenAI response schemas (plain, merged, cached, stream chunks, embeddings, errors),
and requests the spec allows (empty content, null stream and n) are accepted while mistyped ones name their field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import provider_for
from tests.helpers.paths import SCHEMAS


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


_SPEC = _nullable(json.loads((SCHEMAS / "openai_responses.json").read_text()))
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


MODEL_SCHEMA = {  # the official spec's `Model` (not among the vendored response schemas)
    "type": "object", "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"enum": ["model"]}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}}}


async def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(simulator, start_broker):
    broker = await start_broker({"providers": [provider_for(simulator, models=["sim-small", "org/sim-large"])],
                                 "merge": {"embedder": "none"}})
    model = await broker.openai.models.retrieve("sim-small")
    assert (model.id, model.object) == ("sim-small", "model")
    assert (await broker.openai.models.retrieve("org/sim-large")).id == "org/sim-large"  # IDs may hold a slash
    async with broker.http.get("/v1/models/sim-small") as resp:
        jsonschema.validate(await resp.json(), MODEL_SCHEMA)
    with pytest.raises(openai.NotFoundError) as missing:
        await broker.openai.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


async def test_a_405_names_the_methods_the_route_allows(simulator, start_broker):
    broker = await start_broker(config(simulator))
    for method, path, allowed in [("POST", "/v1/models", "GET, HEAD"), ("GET", "/v1/chat/completions", "POST"),
                                  ("DELETE", "/v1/models/sim-small", "GET, HEAD")]:
        async with broker.http.request(method, path) as resp:
            assert resp.status == 405 and resp.headers["Allow"] == allowed, path
            assert_matches(await resp.json(), "ErrorResponse")


async def test_a_path_no_route_takes_is_a_404_in_the_envelope(simulator, start_broker):
    """Whatever the path holds (a newline once decoded, more than a real route, a prefix of one), the 404 is
    the API's JSON envelope with a request ID, never aiohttp's plain-text page."""
    broker = await start_broker(config(simulator))
    for method, path in [("GET", "/nope"), ("GET", "/v1/models/a%0Ab"), ("POST", "/v1/chat/completions/x"),
                         ("PATCH", "/v1")]:
        async with broker.http.request(method, path) as resp:
            assert resp.status == 404 and resp.headers["X-Request-ID"].startswith("req_"), path
            assert_matches(await resp.json(), "ErrorResponse")


async def test_integer_fields_take_whole_number_floats_and_forward_them_as_integers(simulator, start_broker):
    broker = await start_broker(config(simulator))
    status, body, _ = await broker.chat("whole numbers", max_tokens=50.0, n=1.0, seed=3.0, top_logprobs=2.0,
                                        logprobs=True, logit_bias={"1734": 5.0})
    assert status == 200, body
    sent = simulator.last_request_body()
    assert [(sent[k], type(sent[k])) for k in ("max_tokens", "n", "seed", "top_logprobs")] == [(50, int), (1, int),
                                                                                               (3, int), (2, int)]
    assert sent["logit_bias"] == {"1734": 5} and isinstance(sent["logit_bias"]["1734"], int)
    async with broker.http.post("/v1/embeddings", json={"model": "sim-embed", "input": "x", "dimensions": 64.0}) as r:
        assert r.status == 200 and len((await r.json())["data"][0]["embedding"]) == 64
    for field, value in [("max_tokens", 50.5), ("n", 1.5), ("seed", 0.1), ("max_tokens", True)]:
        status, error, _ = await broker.chat("not whole", **{field: value})
        assert status == 400 and error["error"]["param"] == field, (field, value)


@pytest.mark.parametrize(("extra", "param"), [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"top_p": 1.5}, "top_p"), ({"top_logprobs": 21}, "top_logprobs"), ({"logit_bias": {"50256": 101}},
                                                                         "logit_bias.50256"),
    ({"logit_bias": {"50256": "up"}}, "logit_bias.50256"), ({"logprobs": "yes"}, "logprobs"),
    ({"tools": {"type": "function"}}, "tools"), ({"tools": ["f"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].custom.name"),
    ({"tool_choice": "maybe"}, "tool_choice"), ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}}},
     "tool_choice.allowed_tools.mode"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
async def test_known_fields_out_of_range_or_shape_get_a_400_naming_them(simulator, start_broker, extra, param):
    broker = await start_broker(config(simulator))
    status, error, _ = await broker.chat("checked", **extra)
    assert status == 400 and error["error"]["param"] == param, error
    assert_matches(error, "ErrorResponse")
    assert simulator.stats()["chat_calls"] == 0


async def test_known_fields_at_their_limits_and_unknown_fields_pass_through(simulator, start_broker):
    broker = await start_broker(config(simulator))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                               "strict": True, "x-extra": 1}},
             {"type": "custom", "custom": {"name": "grep", "format": {"type": "text"}}}]
    extra = {"presence_penalty": -2, "frequency_penalty": 2.0, "top_p": 0, "top_logprobs": 20, "logprobs": True,
             "logit_bias": {"1": -100, "2": 100}, "tools": tools, "parallel_tool_calls": False,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "some_new_field": {"a": 1}}
    status, body, _ = await broker.chat("at the limits", **extra)
    assert status == 200, body
    sent = simulator.last_request_body()
    assert {k: sent[k] for k in extra} == extra
    for choice in ["none", "auto", "required", {"type": "custom", "custom": {"name": "grep"}},
                   {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function"}]}}]:
        status, body, _ = await broker.chat("choices", tools=tools, tool_choice=choice)
        assert status == 200, (choice, body)
